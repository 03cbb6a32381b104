"""The package's structure, read from the source (ast): no import circle inside ``megazero/``,
``megazero/parallel`` never imports ``megazero/models``, nothing outside ``megazero/models/`` imports a
concrete model (only its spec), the ZeRO package imports only downward, no module (library, tests,
tools, bench) reaches for another module's underscore name, no component reads the topology by duck
typing, and no package module is over 500 lines."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "megazero"
ZERO_ORDER = ["buckets", "grad_norm", "materialize", "swap", "adamw", "offload", "offload_params", "quantize",
              "reducers", "grad_sync", "units", "sharded_grads", "param_sync", "zeropp", "publish", "optimizer", "engine"]


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


# Modules of megazero/models/ that make up the model-spec contract; every other module there is a
# concrete model family (or part of one), which only models/ itself may import. recompute.py is the
# meaning of the --recompute-* flags, which any family's layers and the estimator share.
MODEL_CONTRACT = {"megazero.models", "megazero.models.spec", "megazero.models.kv_cache", "megazero.models.recompute"}


def _concrete_model_imports(paths) -> list[str]:
    modules = _modules()
    bad = []
    for path in paths:
        where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
        for target, _, _ in _imports(path, modules):
            if target.startswith("megazero.models") and target not in MODEL_CONTRACT:
                bad.append(f"{where}: {target}")
    return bad


def test_nothing_outside_models_imports_a_concrete_model():
    """The trainer, checkpoints, memory, data, tools and the entry point reach a model through its spec
    (``megazero.models.spec``: found by ``--model-family``), never by importing the model."""
    paths = [p for p in sorted(PACKAGE.rglob("*.py")) if not p.is_relative_to(PACKAGE / "models")]
    paths += sorted((ROOT / "tools").rglob("*.py")) + sorted(ROOT.glob("*.py"))
    assert not _concrete_model_imports(paths)


DUCK_TYPED_TOPOLOGY = re.compile(r"getattr\(\s*(self\.)?_?topo\b")


def test_no_component_reads_the_topology_by_duck_typing():
    """Components take typed group views (megazero.parallel.groups): no ``getattr(topo, ...)``
    fallbacks (and so no proxy standing in for the topology)."""
    paths = sorted(PACKAGE.rglob("*.py")) + sorted((ROOT / "tools").rglob("*.py")) + sorted(ROOT.glob("*.py"))
    bad = [str(p.relative_to(ROOT)) for p in paths if DUCK_TYPED_TOPOLOGY.search(p.read_text())]
    assert not bad, bad


def test_every_package_module_is_under_500_lines():
    long = {str(p.relative_to(ROOT)): n for p in sorted(PACKAGE.rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > 500}
    assert not long, f"split these modules (one idea each, under ~500 lines): {long}"


def test_the_new_rules_can_fail(tmp_path):
    """A synthetic concrete-model import and a synthetic duck-typed topology read are caught; the
    contract's imports are not."""
    bad = tmp_path / "bad.py"
    bad.write_text("from megazero.models.gpt import GPT\nfrom megazero.models.spec import get_model_spec\n")
    assert _concrete_model_imports([bad]) == ["bad.py: megazero.models.gpt"]
    assert DUCK_TYPED_TOPOLOGY.search('ep = getattr(topo, "ep_size", 1)')
    assert DUCK_TYPED_TOPOLOGY.search("self.average_over = getattr(self.topo, 'gradient_average_size', 1)")
    assert not DUCK_TYPED_TOPOLOGY.search("topology = getattr(module, 'topology_name', None)")


# ------------------------------------------------------------------------------------------------ bench/
# bench/ is a package run from the repository root (`python -m bench.run`): no import cycle among its
# modules, no module importing another's underscore name (from bench or megazero), no sys.path edits,
# nothing imported from tests/. Read with ast by the small readers below, which serve these rules only.

BENCH_REPO = Path(__file__).resolve().parents[1]
TEST_PACKAGES = {"tests", "helpers", "conftest"}     # tests/helpers is importable as `helpers` under pytest


def _bench_name(path: Path, repo: Path) -> str:
    parts = list(path.relative_to(repo).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _bench_paths(repo: Path) -> dict[str, Path]:
    return {_bench_name(p, repo): p for p in sorted((repo / "bench").rglob("*.py"))}


def _bench_imports(path: Path, repo: Path) -> list[tuple[str, str | None]]:
    """(module, name) for each import in ``path``, relative ones resolved: ``import a.b`` -> ("a.b", None),
    ``from a import b`` -> ("a", "b"), at any depth (function-level imports count too)."""
    own = _bench_name(path, repo).split(".")
    package = own if path.name == "__init__.py" else own[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module.split(".") if node.module else []
            module = ".".join(package[:len(package) - node.level + 1] + base) if node.level else node.module
            found += [(module, alias.name) for alias in node.names]
    return found


def _bench_graph(repo: Path) -> dict[str, set[str]]:
    """Each bench module -> the bench modules it imports (``from bench import report`` names the module)."""
    paths = _bench_paths(repo)
    graph = {}
    for name, path in paths.items():
        deps = set()
        for module, imported in _bench_imports(path, repo):
            target = f"{module}.{imported}" if imported and f"{module}.{imported}" in paths else module
            if target in paths and target != name:
                deps.add(target)
        graph[name] = deps
    return graph


def _bench_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    import graphlib

    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as e:
        return e.args[1]
    return None


def _bench_underscore_imports(paths, repo: Path) -> list[str]:
    bad = []
    for path in paths:
        for module, imported in _bench_imports(path, repo):
            if module.split(".")[0] not in ("bench", "megazero"):
                continue
            hidden = [p for p in module.split(".") if p.startswith("_") and p != "__init__"]
            if hidden or (imported or "").startswith("_"):
                bad.append(f"{path.name}: {module}" + (f".{imported}" if imported else ""))
    return bad


SYS_PATH_METHODS = {"insert", "append", "extend", "remove", "pop", "clear", "__setitem__", "__iadd__"}


def _is_sys_path(node: ast.AST) -> bool:
    node = node.value if isinstance(node, ast.Subscript) else node
    return (isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name)
            and node.value.id == "sys")


def _sys_path_edits(paths) -> list[str]:
    """``sys.path.insert(...)`` and the like, assignments to ``sys.path`` (or an item of it), ``from sys
    import path``: each as 'file:line'."""
    bad = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            edit = (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in SYS_PATH_METHODS and _is_sys_path(node.func.value))
            edit |= isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)) and any(
                _is_sys_path(t) for t in (node.targets if isinstance(node, ast.Assign) else [node.target]))
            edit |= isinstance(node, ast.ImportFrom) and node.module == "sys" and any(
                a.name == "path" for a in node.names)
            if edit:
                bad.append((path.name, node.lineno))
    return [f"{name}:{line}" for name, line in sorted(bad)]


def _test_imports(paths, repo: Path) -> list[str]:
    return [f"{path.name}: {module}" for path in paths for module, _ in _bench_imports(path, repo)
            if module.split(".")[0] in TEST_PACKAGES]


def test_bench_has_no_import_cycle():
    """Function-level imports count: a cycle through one still re-enters a module that is initialising
    when that function first runs."""
    graph = _bench_graph(BENCH_REPO)
    assert "bench.run" in graph and "bench.common" in graph["bench.run"], sorted(graph)
    cycle = _bench_cycle(graph)
    assert cycle is None, " -> ".join(cycle)


def test_bench_imports_no_underscore_name():
    paths = sorted((BENCH_REPO / "bench").rglob("*.py"))
    assert not _bench_underscore_imports(paths, BENCH_REPO)


def test_bench_edits_no_sys_path():
    """bench is imported as a package from the repository root and megazero as installed; the peer scripts
    run as ``torchrun -m bench.peers.<script>``."""
    assert not _sys_path_edits(sorted((BENCH_REPO / "bench").rglob("*.py")))


def test_bench_imports_nothing_from_tests():
    assert not _test_imports(sorted((BENCH_REPO / "bench").rglob("*.py")), BENCH_REPO)


def test_the_bench_rules_can_fail(tmp_path):
    """Each bench rule on a synthetic package: a cycle (through an absolute, a package-form and a relative
    import), underscore names from bench and megazero, sys.path edits and imports from tests are caught;
    their allowed neighbours are not."""
    (tmp_path / "bench" / "peers").mkdir(parents=True)
    files = {"__init__.py": "", "a.py": "from bench.b import thing\n", "b.py": "from bench import c\n",
             "c.py": "def f():\n    from .a import g\n", "d.py": "import bench.a\nfrom bench.peers import p\n",
             "peers/__init__.py": "", "peers/p.py": "from ..a import x\n"}
    for rel, text in files.items():
        (tmp_path / "bench" / rel).write_text(text)
    graph = _bench_graph(tmp_path)
    assert graph["bench.d"] == {"bench.a", "bench.peers.p"} and graph["bench.peers.p"] == {"bench.a"}
    assert set(_bench_cycle(graph)) == {"bench.a", "bench.b", "bench.c"}
    assert _bench_cycle({**graph, "bench.c": set()}) is None

    bad = tmp_path / "bench" / "bad.py"
    bad.write_text("from bench.common import table, _private\nfrom megazero.models.gpt import GPT\n"
                   "from megazero.parallel.zero.buckets import _hidden\nimport bench._secret\n"
                   "from ._own import x\nfrom __future__ import annotations\nimport torch._dynamo\n")
    assert _bench_underscore_imports([bad], tmp_path) == [
        "bad.py: bench.common._private", "bad.py: megazero.parallel.zero.buckets._hidden", "bad.py: bench._secret",
        "bad.py: bench._own.x"]

    bad.write_text("import sys\nfrom sys import path\nsys.path.insert(0, 'x')\nsys.path += ['y']\n"
                   "sys.path[0] = 'z'\nsys.path = []\nprint(sys.path, sys.argv)\nsys.argv.append('--flag')\n")
    assert _sys_path_edits([bad]) == ["bad.py:2", "bad.py:3", "bad.py:4", "bad.py:5", "bad.py:6"]

    bad.write_text("from tests.helpers import run_on_ranks\nimport helpers.data\nfrom helpers import tinynet\n"
                   "from bench.common import table\nimport testing_tools\n")
    assert _test_imports([bad], tmp_path) == ["bad.py: tests.helpers", "bad.py: helpers.data", "bad.py: helpers"]
