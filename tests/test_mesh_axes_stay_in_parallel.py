"""Only ``jaxtron/parallel/`` names mesh axes: a string literal equal to a mesh axis anywhere else in
``jaxtron/`` fails this test (docstrings and comments may mention them; code must ask the Layout).

A few literals are the word "data" meaning something else; they are listed with their count, so a new
occurrence in the same file still fails."""

import ast
import pathlib

from jaxtron.parallel.axes import AXES

ROOT = pathlib.Path(__file__).resolve().parents[1] / "jaxtron"

ALLOWED = {  # (file, literal): (count, why)
    ("train/checkpointing.py", "data"): (2, "the checkpoint metadata key of the data loader's position"),
    ("evaluate/__main__.py", "data"): (1, "the --data argument echoed in the JSON result"),
}


def _docstrings(tree) -> set:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                ids.add(id(body[0].value))
    return ids


def mesh_axis_literals(path: pathlib.Path) -> list:
    tree = ast.parse(path.read_text(), filename=str(path))
    docs = _docstrings(tree)
    return [(node.lineno, node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in AXES
            and id(node) not in docs]


def test_no_mesh_axis_literal_outside_parallel():
    found, counts = [], {}
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith("parallel/"):
            continue
        for line, value in mesh_axis_literals(path):
            counts[(rel, value)] = counts.get((rel, value), 0) + 1
            if (rel, value) not in ALLOWED:
                found.append(f"jaxtron/{rel}:{line}: {value!r}")
    assert not found, "mesh axis names outside jaxtron/parallel/ (ask the Layout instead):\n" + "\n".join(found)
    for key, (count, why) in ALLOWED.items():
        assert counts.get(key, 0) == count, f"{key}: expected {count} literal(s) ({why}), found {counts.get(key, 0)}"


def test_the_scan_sees_a_literal(tmp_path):
    """The scan is not vacuous: a mesh axis literal in code is found, one in a docstring is not."""
    f = tmp_path / "x.py"
    f.write_text('"""Runs over \'tensor\'."""\nsize = mesh.shape["tensor"]\n')
    assert mesh_axis_literals(f) == [(2, "tensor")]
