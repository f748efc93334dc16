"""Files stay small enough to read and named for what they hold: no Python file in ``jaxtron/`` or
``pallas_kernels/`` over 450 lines, no function over 120 lines except a Pallas kernel body, which says why in
its docstring (the words "kernel body")."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("jaxtron", "pallas_kernels")
MAX_FILE_LINES = 450
MAX_FUNCTION_LINES = 120


def _sources():
    for package in PACKAGES:
        yield from sorted((ROOT / package).rglob("*.py"))


def long_functions(path: pathlib.Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            doc = ast.get_docstring(node) or ""
            kernel = path.parts[-2] == "pallas_kernels" and "kernel body" in doc.lower()
            if length > MAX_FUNCTION_LINES and not kernel:
                out.append(f"{path.name}:{node.lineno} {node.name}: {length} lines")
    return out


def test_files_are_small():
    long = [f"{p.relative_to(ROOT)}: {n} lines" for p in _sources()
            if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES]
    assert not long, f"split these along their seams (max {MAX_FILE_LINES} lines):\n" + "\n".join(long)


def test_functions_are_small():
    long = [entry for p in _sources() for entry in long_functions(p)]
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines:\n" + "\n".join(long)


def test_the_size_check_sees_a_long_function(tmp_path):
    f = tmp_path / "x.py"
    f.write_text("def f():\n" + "    x = 1\n" * MAX_FUNCTION_LINES)
    assert long_functions(f) == [f"x.py:1 f: {MAX_FUNCTION_LINES + 1} lines"]
