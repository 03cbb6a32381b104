"""The package's import structure, read from the source (ast): no import circle inside ``megazero/``,
``megazero/parallel`` never imports ``megazero/models``, the ZeRO package imports only downward, and
no module (library or test) reaches for another module's underscore name."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "megazero"
ZERO_ORDER = ["buckets", "materialize", "swap", "adamw", "offload", "offload_params", "quantize", "reducers",
              "grad_sync", "units", "sharded_grads", "param_sync", "zeropp", "publish", "optimizer", "engine"]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(path: Path, modules: dict[str, Path]) -> list[tuple[str, list[str], bool]]:
    """(imported megazero module, names taken from it, at module level?) for every import in ``path``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    top = {id(n) for n in tree.body}
    typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If) and _is_type_checking(block.test)
                   for stmt in block.body for n in ast.walk(stmt)}
    this = _module_name(path) if path.is_relative_to(PACKAGE) else ""
    out = []
    for node in ast.walk(tree):
        if id(node) in typing_only:                          # `if TYPE_CHECKING:` imports never run
            continue
        if isinstance(node, ast.Import):
            out += [(a.name, [], id(node) in top) for a in node.names if a.name.startswith("megazero")]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:                                   # relative import
                pkg = this.split(".")[:len(this.split(".")) - node.level + (path.name == "__init__.py")]
                base = ".".join(pkg + ([base] if base else []))
            if not base.startswith("megazero"):
                continue
            names = [a.name for a in node.names]
            submodules = [f"{base}.{n}" for n in names if f"{base}.{n}" in modules]
            if submodules:                                   # `from megazero.parallel import comm`
                out += [(m, [], id(node) in top) for m in submodules]
                names = [n for n in names if f"{base}.{n}" not in modules]
            if names or not submodules:
                out.append((base, names, id(node) in top))
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        deps = set()
        for target, _, _ in _imports(path, modules):
            while target not in modules and "." in target:   # `import megazero.x.y` names a package
                target = target.rsplit(".", 1)[0]
            if target in modules and target != name:
                deps.add(target)
        graph[name] = deps
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state and (found := visit(m)):
                return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (found := visit(n)):
            return found
    return None


def test_no_import_circle_inside_the_package():
    """Counting package ``__init__`` re-exports as edges too: importing any module never re-enters
    one that is still initialising."""
    cycle = _cycle(_graph())
    assert cycle is None, " -> ".join(cycle)


def test_parallel_knows_no_model():
    offenders = [(m, d) for m, deps in _graph().items() if m.startswith("megazero.parallel")
                 for d in deps if d.startswith("megazero.models")]
    assert not offenders, offenders


def test_zero_package_imports_only_downward():
    graph = _graph()
    for i, name in enumerate(ZERO_ORDER):
        deps = {d.rsplit(".", 1)[-1] for d in graph[f"megazero.parallel.zero.{name}"]
                if d.startswith("megazero.parallel.zero.")}
        assert deps <= set(ZERO_ORDER[:i]), (name, deps - set(ZERO_ORDER[:i]))


def _underscore_imports(paths) -> list[str]:
    modules = _modules()
    bad = []
    for path in paths:
        where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
        for target, names, _ in _imports(path, modules):
            bad += [f"{where}: {target}.{n}" for n in names if n.startswith("_")]
            if any(part.startswith("_") and part != "__init__" for part in target.split(".")):
                bad.append(f"{where}: {target}")
    return bad


@pytest.mark.parametrize("where", ["megazero", "tests", "tools", "bench"])
def test_no_module_imports_another_modules_underscore_name(where):
    paths = sorted((ROOT / where).rglob("*.py")) + (sorted(ROOT.glob("*.py")) if where == "megazero" else [])
    assert not _underscore_imports(paths)


def test_the_checker_sees_what_it_should(tmp_path):
    """The rules above can fail: a synthetic circle and a synthetic underscore import are caught."""
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    bad = tmp_path / "bad.py"
    bad.write_text("from megazero.parallel.zero.buckets import _hidden, nbytes\n")
    assert _underscore_imports([bad]) == ["bad.py: megazero.parallel.zero.buckets._hidden"]


def test_test_modules_import_helpers_not_each_other():
    bad = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            bad += [f"{path.relative_to(ROOT)}: {n}" for n in names if n.split(".")[0].startswith("test_")]
    assert not bad, bad
