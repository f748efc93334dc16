"""The shape of jaxtron's imports, read from the source (nothing is imported):

* **No import cycles** among the modules of ``jaxtron/`` and ``pallas_kernels/``. Every ``import`` and
  ``from ... import`` in a file counts, at any depth (a function-local import, or one under ``if TYPE_CHECKING``,
  is an edge like any other).
  ``import a.b.c`` is an edge to ``a.b.c``; ``from a.b import c`` is an edge to the submodule ``a.b.c`` when
  there is one, otherwise to ``a.b`` itself. A package's ``__init__.py`` is the node named for the package
  (``jaxtron.plan``), and it is reached only by importing that name: the parents Python initializes on the
  way to a submodule (``jaxtron`` and ``jaxtron.plan`` for ``jaxtron.plan.hlo``) are not edges, because a
  package whose ``__init__`` gathers its own submodules into its API would otherwise be a cycle by
  construction. So ``from jaxtron.plan import plan`` inside ``plan/search.py`` is a cycle when
  ``plan/__init__.py`` imports ``search``; ``from jaxtron.plan.hlo import parse`` is not.
* **No private imports**: no module imports another module's ``_name`` (``from x import _name``, or
  ``x._name`` where ``x`` is an imported jaxtron module). A module whose own name starts with ``_``
  (``pallas_kernels/_common.py``) is private to its package: its siblings may import it and its names.
* **No re-export shims**: a module that is not a package ``__init__.py`` imports a name only to use it. An
  imported name it never uses, or lists in ``__all__``, is a re-export for an old import path (import it from
  where it is defined) or dead. A package ``__init__.py`` defines that package's public API and may gather
  names from its own submodules; a name it takes from another package and does not use is a shim.

File size has one rule, in tests/test_code_size.py.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("jaxtron", "pallas_kernels")


@dataclasses.dataclass
class Module:
    name: str
    path: pathlib.Path
    is_package: bool
    tree: ast.Module

    def where(self, node: ast.AST, root: pathlib.Path) -> str:
        return f"{self.path.relative_to(root)}:{node.lineno}"


def load_modules(root: pathlib.Path, packages=PACKAGES) -> dict[str, Module]:
    modules = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            if is_package:
                parts.pop()
            tree = ast.parse(path.read_text(), filename=str(path))
            modules[".".join(parts)] = Module(".".join(parts), path, is_package, tree)
    return modules


def _from_base(module: Module, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    parts = module.name.split(".")
    if not module.is_package:
        parts.pop()
    parts = parts[:len(parts) - (node.level - 1)]
    return ".".join(parts + ([node.module] if node.module else []))


def _known(name: str, modules) -> str | None:
    """The longest prefix of the dotted ``name`` that is one of ``modules``."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in modules:
            return ".".join(parts[:n])
    return None


def imports(module: Module, modules):
    """Yield (node, target module, imported name or None, local binding or None) for every import."""
    for node in ast.walk(module.tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = _known(alias.name, modules)
                if target:
                    yield node, target, None, alias.asname
        elif isinstance(node, ast.ImportFrom):
            base = _from_base(module, node)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                if sub in modules:
                    yield node, sub, None, alias.asname or alias.name
                elif base in modules:
                    yield node, base, alias.name, alias.asname or alias.name


def import_edges(modules) -> dict[str, dict[str, list[str]]]:
    """module -> imported module -> the places (file:line) it is imported."""
    edges: dict[str, dict[str, list[str]]] = {name: {} for name in modules}
    for name, module in modules.items():
        for node, target, _, _ in imports(module, modules):
            if target != name:
                places = edges[name].setdefault(target, [])
                if module.where(node, _root_of(module)) not in places:
                    places.append(module.where(node, _root_of(module)))
    return edges


def _root_of(module: Module) -> pathlib.Path:
    depth = module.name.count(".") + (1 if module.is_package else 0)
    return module.path.parents[depth]


def _strongly_connected(edges) -> list[list[str]]:
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v):  # Tarjan's algorithm; the graph has a few hundred nodes, recursion is fine
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return [c for c in out if len(c) > 1]


def _shortest_cycle(start: str, component: set, edges) -> list[str]:
    """The shortest import path from ``start`` back to itself inside ``component`` (breadth first)."""
    parent, frontier = {start: None}, [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(edges[v]):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return path[::-1] + [start]
                if w in component and w not in parent:
                    parent[w] = v
                    nxt.append(w)
        frontier = nxt
    return [start]


def import_cycles(modules) -> list[str]:
    """One shortest cycle per set of mutually importing modules, each import with its file:line."""
    edges = import_edges(modules)
    out = []
    for component in _strongly_connected(edges):
        path = _shortest_cycle(component[0], set(component), edges)
        steps = [f"    {', '.join(edges[a][b])} imports {b}" for a, b in zip(path, path[1:])]
        more = f" (one of the cycles among {', '.join(component)})" \
            if len(component) > len(path) - 1 else ""
        out.append(f"cycle {' -> '.join(path)}{more}:\n" + "\n".join(steps))
    return out


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _sibling_private(importer: Module, target: str) -> bool:
    """Whether ``target`` is a private module (``_common``) of the package ``importer`` belongs to."""
    package = importer.name if importer.is_package else importer.name.rsplit(".", 1)[0]
    parent, _, last = target.rpartition(".")
    return _private(last) and parent == package


def private_imports(modules) -> list[str]:
    out = []
    for name, module in modules.items():
        root = _root_of(module)
        bound = {}  # local name -> jaxtron module it stands for
        for node, target, attr, local in imports(module, modules):
            sibling = _sibling_private(module, target)
            if attr is None and _private(target.rsplit(".", 1)[-1]) and not sibling:
                out.append(f"{module.where(node, root)} imports the private module {target}")
            if attr is not None and _private(attr) and not sibling:
                out.append(f"{module.where(node, root)} imports {attr} from {target}")
            if attr is None:  # `import a.b` binds `a`; `import a.b as x` and `from a import b` bind the module
                head = target.split(".")[0]
                bound[local or head] = target if local else head
        for node in ast.walk(module.tree):
            if isinstance(node, ast.Attribute):
                chain = []
                base = node
                while isinstance(base, ast.Attribute):
                    chain.append(base.attr)
                    base = base.value
                if not isinstance(base, ast.Name) or base.id not in bound:
                    continue
                current = bound[base.id]
                for attr in reversed(chain):
                    if f"{current}.{attr}" in modules:
                        current = f"{current}.{attr}"
                        continue
                    if _private(attr) and current != name and not _sibling_private(module, current):
                        out.append(f"{module.where(node, root)} uses {current}.{attr}")
                    break
    return sorted(set(out))


def _top_level_imports(tree: ast.Module):
    """Imports that run when the module is imported (not inside a function or class)."""
    todo = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, (ast.If, ast.Try)):
            todo.extend(ast.iter_child_nodes(node))
        elif isinstance(node, ast.ExceptHandler):
            todo.extend(node.body)


def _annotation_names(node: ast.AST | None) -> set[str]:
    """Names in an annotation, quoted ones included ("Config", "jax.Array")."""
    names = set()
    for n in ast.walk(node) if node is not None else ():
        if isinstance(n, ast.Name):
            names.add(n.id)
        elif isinstance(n, ast.Constant) and isinstance(n.value, str):
            try:
                names |= _annotation_names(ast.parse(n.value, mode="eval"))
            except SyntaxError:
                pass
    return names


def _used_names(tree: ast.Module) -> set[str]:
    """Names the module reads (in code or annotations); ``__all__``'s strings are not reads."""
    used = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Store):
            used.add(node.id)
        elif isinstance(node, (ast.arg, ast.AnnAssign)):
            used |= _annotation_names(node.annotation)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            used |= _annotation_names(node.returns)
    return used


def _all_names(tree: ast.Module) -> set[str]:
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets) and node.value is not None:
            return {e.value for e in ast.walk(node.value) if isinstance(e, ast.Constant)}
    return set()


def reexports(modules) -> list[str]:
    out = []
    for name, module in modules.items():
        root = _root_of(module)
        in_all, used = _all_names(module.tree), _used_names(module.tree)
        lines = module.path.read_text().splitlines()
        for node in _top_level_imports(module.tree):
            if isinstance(node, ast.ImportFrom) and node.module == "__future__":
                continue
            base = _from_base(module, node) if isinstance(node, ast.ImportFrom) else None
            if not module.is_package and any("noqa: F401" in line for line in lines[node.lineno - 1:node.end_lineno]):
                out.append(f"{module.where(node, root)} silences F401, the mark of a re-export")
            for alias in node.names:
                if alias.name == "*":
                    out.append(f"{module.where(node, root)} imports * from {base}")
                    continue
                local = alias.asname or (alias.name if base is not None else alias.name.split(".")[0])
                source = base if base is not None else alias.name
                if module.is_package and (f"{source}.".startswith(name + ".") or "." not in name):
                    continue  # a package's API gathered from its own submodules (the top level: from anywhere)
                if local in in_all:
                    out.append(f"{module.where(node, root)} re-exports {local} (from {source}) in __all__")
                elif local not in used:
                    out.append(f"{module.where(node, root)} imports {local} (from {source}) and never uses it")
    return sorted(out)


def violations(root: pathlib.Path = ROOT, packages=PACKAGES) -> dict[str, list[str]]:
    if root == ROOT and packages == PACKAGES:
        return _tree_violations()
    return _violations(load_modules(root, packages))


@functools.cache
def _tree_modules() -> dict[str, Module]:  # the tests on the real tree share one read of it
    return load_modules(ROOT)


@functools.cache
def _tree_violations() -> dict[str, list[str]]:
    return _violations(_tree_modules())


def _violations(modules) -> dict[str, list[str]]:
    return {"import cycles": import_cycles(modules), "private imports": private_imports(modules),
            "re-exports or unused imports": reexports(modules)}


def _report(kind: str, found: list[str]) -> str:
    return f"{len(found)} {kind}:\n" + "\n".join(found)


def test_no_import_cycles():
    found = violations()["import cycles"]
    assert not found, _report("import cycles (function-local imports count)", found)


def test_no_private_imports():
    found = violations()["private imports"]
    assert not found, _report("imports of another module's private names", found)


def test_no_reexport_shims():
    found = violations()["re-exports or unused imports"]
    assert not found, _report("imports a module re-exports or never uses", found)


def _defines(module: Module, name: str) -> bool:
    """Whether ``module`` defines ``name`` at its top level (a package ``__init__``: or gathers it from its own
    submodules, its API)."""
    for node in module.tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return True
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                return True
        if module.is_package and isinstance(node, ast.ImportFrom) and node.level == 0 and \
                (node.module or "").startswith(module.name + ".") and any(
                    (a.asname or a.name) == name for a in node.names):
            return True
    return False


def test_the_lazy_api_points_where_each_name_is_defined():
    """``jaxtron/__init__.py`` imports its public names on first use from ``_EXPORTS``; each entry names the
    module that defines the name (not one that re-exports it), and the ``TYPE_CHECKING`` imports for type
    checkers say the same."""
    modules = _tree_modules()
    root = modules["jaxtron"]
    exports = next(ast.literal_eval(n.value) for n in root.tree.body
                   if isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "_EXPORTS" for t in n.targets))
    wrong = [f"{public}: {mod}.{attr}" for public, (mod, attr) in sorted(exports.items())
             if mod not in modules or (attr is not None and not _defines(modules[mod], attr))]
    assert not wrong, "jaxtron._EXPORTS entries whose module does not define the name:\n" + "\n".join(wrong)
    checking = next(n for n in root.tree.body if isinstance(n, ast.If) and getattr(n.test, "id", "") == "TYPE_CHECKING")
    typed = {}
    for node in ast.walk(checking):
        if isinstance(node, ast.ImportFrom):
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                typed[a.asname or a.name] = (sub, None) if sub in modules else (node.module, a.name)
    assert typed == exports, "jaxtron/__init__.py: the TYPE_CHECKING imports and _EXPORTS differ"


def _package(tmp_path, files: dict[str, str]) -> pathlib.Path:
    for rel, text in files.items():
        path = tmp_path / "pkg" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def test_the_check_sees_a_cycle_through_a_function_local_import(tmp_path):
    root = _package(tmp_path, {
        "__init__.py": "",
        "a.py": "from pkg.b import g\n\ndef f():\n    return g()\n",
        "b.py": "def g():\n    from . import a\n    return a\n",
        "c.py": "import pkg.a\n\nX = pkg.a.f\n",
    })
    assert violations(root, ("pkg",))["import cycles"] == [
        "cycle pkg.a -> pkg.b -> pkg.a:\n    pkg/a.py:1 imports pkg.b\n    pkg/b.py:2 imports pkg.a"]


def test_the_check_sees_a_cycle_through_a_package_init(tmp_path):
    root = _package(tmp_path, {
        "__init__.py": "",
        "sub/__init__.py": "from pkg.sub.search import search\n",
        "sub/search.py": "def search():\n    from pkg.sub import helper\n    return helper\n",
        "sub/fine.py": "from pkg.sub.search import search\n\nX = search\n",
    })
    found = violations(root, ("pkg",))["import cycles"]
    assert found == ["cycle pkg.sub -> pkg.sub.search -> pkg.sub:\n    pkg/sub/__init__.py:1 imports pkg.sub.search\n"
                     "    pkg/sub/search.py:2 imports pkg.sub"]


def test_the_check_sees_private_imports(tmp_path):
    root = _package(tmp_path, {
        "__init__.py": "",
        "a.py": "_RE = 1\n\ndef _dims():\n    return 2\n",
        "b.py": "from pkg.a import _RE\n\ndef f():\n    from .a import _dims\n    return _RE + _dims()\n",
        "c.py": "from pkg import a\nimport pkg.a as aa\n\nX = a._RE + aa._dims() + a.__name__.count('x')\n",
        "k/__init__.py": "",
        "k/_common.py": "def _h():\n    return 1\n",
        "k/user.py": "from pkg.k._common import _h\n\nY = _h\n",
        "outside.py": "from pkg.k import _common\n\nZ = _common\n",
    })
    assert violations(root, ("pkg",))["private imports"] == [
        "pkg/b.py:1 imports _RE from pkg.a", "pkg/b.py:4 imports _dims from pkg.a",
        "pkg/c.py:4 uses pkg.a._RE", "pkg/c.py:4 uses pkg.a._dims",
        "pkg/outside.py:1 imports the private module pkg.k._common"]


def test_the_check_sees_a_reexport_shim(tmp_path):
    root = _package(tmp_path, {
        "__init__.py": "from pkg.a import f\n",
        "a.py": "import os\n\ndef f():\n    return os.sep\n",
        "b.py": "from pkg.a import f  # noqa: F401 (re-exported)\nimport json\n",
        "c.py": "from pkg.a import f\n\n__all__ = ['f', 'g']\n\ndef g():\n    return f\n",
        "d.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import f\n\n"
                "def h(x: 'f'):\n    return x\n",
        "sub/__init__.py": "from pkg.sub.x import y\nfrom pkg.a import f  # an old path\n",
        "sub/x.py": "y = 1\n",
    })
    assert violations(root, ("pkg",))["re-exports or unused imports"] == [
        "pkg/b.py:1 imports f (from pkg.a) and never uses it",
        "pkg/b.py:1 silences F401, the mark of a re-export",
        "pkg/b.py:2 imports json (from json) and never uses it",
        "pkg/c.py:1 re-exports f (from pkg.a) in __all__",
        "pkg/sub/__init__.py:2 imports f (from pkg.a) and never uses it"]
