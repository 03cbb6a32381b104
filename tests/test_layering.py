"""The repository's structure, read from the source (ast).

* Packages form one order (:data:`PACKAGES`, bottom first): a package imports only packages below it, so
  there is no package cycle; inside ``megazero/`` no module cycle either, and the ZeRO package's modules
  import only downward (:data:`ZERO_ORDER`).
* A function-level import of the library's own modules is an exception with a reason
  (:data:`IMPORTS_IN_FUNCTIONS`, at most :data:`MOST_IMPORTS_IN_FUNCTIONS`).
* Nothing outside ``megazero/models/`` imports a concrete model (the spec is the contract); no module
  (library, tests, tools, bench) takes another module's underscore name; no component reads the topology
  by duck typing; the library imports nothing of tools/, bench/ or tests/; tools/ and bench/ never edit
  ``sys.path`` (run them with ``python -m``); test modules import helpers, not each other.
* Ownership, not a line count: every module says what it holds (its docstring), and a function stays
  short enough to read (:data:`LONGEST_FUNCTION` lines); ``pretrain_gpt.py`` is a thin entry point.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from megazero.config import ModelConfig

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "megazero"

# The library's packages (and top-level modules), bottom first: each imports only those before it.
PACKAGES = [
    "megazero.errors",          # the errors a run reports (a leaf)
    "megazero.ranks",           # the pure rank arithmetic (a leaf)
    "megazero.config",          # the sections, their flags and rules, validate()
    "megazero.foreign_config",  # DeepSpeed / Accelerate files onto the sections
    "megazero.state",           # what a resume needs besides tensors
    "megazero.metrics",         # where the log goes; peak memory and FLOP/s
    "megazero.kernels",         # which kernels run
    "megazero.precision",       # fp16 loss scaling
    "megazero.lr_schedule",
    "megazero.profiling",
    "megazero.compile",         # regional torch.compile
    "megazero.parallel",        # process groups and tensors, never a model
    "megazero.spec",            # the model contract
    "megazero.memory",          # estimate, measurement, planner, activation offload
    "megazero.data",
    "megazero.checkpoint",
    "megazero.fault_tolerance", # torchft replica groups: quorum, the average across jobs, healing
    "megazero.models",          # the model families
    "megazero.generation",
    "megazero.reporting",       # what a run says
    "megazero.training",        # the loop and the step
    "megazero.census",          # the op census of a trainer step
    "megazero.cli",             # the program: parse -> preflight -> plan -> build -> train
]
ZERO_ORDER = ["protocol", "buckets", "grad_norm", "materialize", "swap", "adamw", "offload", "offload_params", "quantize",
              "fp8_gather", "reducers", "replicated_params", "grad_sync", "units", "sharded_grads", "zeropp", "param_sync", "publish",
              "muon",
              "optimizer", "engine"]
# "module -> imported module": why the import cannot be at module level.
IMPORTS_IN_FUNCTIONS: dict[str, str] = {}
MOST_IMPORTS_IN_FUNCTIONS = 10
LONGEST_FUNCTION = 100


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


def _where(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name


def _package_of(module: str) -> str:
    """``megazero.parallel.zero.engine`` -> ``megazero.parallel``; a top-level module is its own."""
    return ".".join(module.split(".")[:2])


def _order_violations(graph: dict[str, set[str]], order: list[str]) -> list[str]:
    """Every import of a package by one below it (or by itself through a package not in the order)."""
    rank = {p: i for i, p in enumerate(order)}
    bad = []
    for module, deps in sorted(graph.items()):
        src = _package_of(module)
        for dep in sorted(deps):
            dst = _package_of(dep)
            if src != dst and not rank.get(dst, len(order)) < rank.get(src, -1):
                bad.append(f"{module} imports {dep}: {dst} is not below {src} in PACKAGES")
    return bad


def test_every_package_has_its_place_in_the_order():
    packages = {_package_of(m) for m in _modules()} - {"megazero"}
    assert packages == set(PACKAGES), {"not placed": sorted(packages - set(PACKAGES)),
                                       "gone": sorted(set(PACKAGES) - packages)}


def test_packages_import_only_the_packages_below_them():
    """One order for the whole library: no package cycle (``config`` <-> ``parallel``, ``checkpoint`` <->
    ``models`` ... cannot come back)."""
    assert not _order_violations(_graph(), PACKAGES)


def test_no_import_circle_inside_the_package():
    """Counting package ``__init__`` re-exports as edges too: importing any module never re-enters
    one that is still initialising."""
    cycle = _cycle(_graph())
    assert cycle is None, " -> ".join(cycle)


def test_zero_package_imports_only_downward():
    graph = _graph()
    for i, name in enumerate(ZERO_ORDER):
        deps = {d.rsplit(".", 1)[-1] for d in graph[f"megazero.parallel.zero.{name}"]
                if d.startswith("megazero.parallel.zero.")}
        assert deps <= set(ZERO_ORDER[:i]), (name, deps - set(ZERO_ORDER[:i]))


def _imports_in_functions(paths) -> list[str]:
    """``module -> imported module`` for every function-level import of a megazero module in ``paths``."""
    modules = _modules()
    out = []
    for path in paths:
        for target, _, at_top in _imports(path, modules):
            if not at_top:
                out.append(f"{_module_name(path) if path.is_relative_to(ROOT) else path.stem} -> {target}")
    return out


def test_function_level_imports_of_the_library_are_few_and_explained():
    found = _imports_in_functions(sorted(PACKAGE.rglob("*.py")))
    unexplained = sorted(set(found) - set(IMPORTS_IN_FUNCTIONS))
    assert not unexplained, f"import at module level, or say why not in IMPORTS_IN_FUNCTIONS: {unexplained}"
    assert len(IMPORTS_IN_FUNCTIONS) <= MOST_IMPORTS_IN_FUNCTIONS
    assert all(reason.strip() for reason in IMPORTS_IN_FUNCTIONS.values())


def _underscore_imports(paths) -> list[str]:
    modules = _modules()
    bad = []
    for path in paths:
        where = _where(path)
        for target, names, _ in _imports(path, modules):
            bad += [f"{where}: {target}.{n}" for n in names if n.startswith("_")]
            if any(part.startswith("_") and part != "__init__" for part in target.split(".")):
                bad.append(f"{where}: {target}")
    return bad


@pytest.mark.parametrize("where", ["megazero", "tests", "tools", "bench"])
def test_no_module_imports_another_modules_underscore_name(where):
    paths = sorted((ROOT / where).rglob("*.py")) + (sorted(ROOT.glob("*.py")) if where == "megazero" else [])
    assert not _underscore_imports(paths)


def test_test_modules_import_helpers_not_each_other():
    bad = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            bad += [f"{path.relative_to(ROOT)}: {n}" for n in names if n.split(".")[0].startswith("test_")]
    assert not bad, bad


def _concrete_model_imports(paths) -> list[str]:
    modules = _modules()
    bad = []
    for path in paths:
        where = _where(path)
        for target, _, _ in _imports(path, modules):
            if target == "megazero.models" or target.startswith("megazero.models."):
                bad.append(f"{where}: {target}")
    return bad


def test_nothing_outside_models_imports_a_concrete_model():
    """The trainer, checkpoints, memory, data, tools and the entry point reach a model through its spec
    (``megazero.spec``: found by ``--model-family``), never by importing the model."""
    paths = [p for p in sorted(PACKAGE.rglob("*.py")) if not p.is_relative_to(PACKAGE / "models")]
    paths += sorted((ROOT / "tools").rglob("*.py")) + sorted(ROOT.glob("*.py"))
    assert not _concrete_model_imports(paths)


def _family_mentions(family: str, paths) -> list[str]:
    """``path:line`` of every line naming model family ``family`` by its name (``--model-family``, the package
    name, in any case; prose citing the paper a family implements, "DeepSeek-V3 routing", names no family)."""
    spelled = re.compile(rf"\b{re.escape(family)}\b", re.IGNORECASE)
    return [f"{_where(path)}:{n}" for path in paths for n, line in enumerate(path.read_text().splitlines(), 1)
            if spelled.search(line)]


def test_a_family_is_named_only_inside_its_package():
    """Adding a model family touches no file outside ``megazero/models/<family>/``: the registry finds the
    packages of ``megazero/models/``, and the library, tools, benchmarks and the entry point never name a
    family (the default family, ``--model-family``'s default, excepted)."""
    default = ModelConfig.model_family
    families = [p for p in sorted((PACKAGE / "models").iterdir()) if (p / "__init__.py").exists()]
    assert len(families) >= 2
    code = sorted(PACKAGE.rglob("*.py")) + sorted((ROOT / "tools").rglob("*.py")) + \
        sorted((ROOT / "bench").rglob("*.py")) + sorted(ROOT.glob("*.py"))
    for package in families:
        if package.name != default:
            assert not _family_mentions(package.name, [p for p in code if not p.is_relative_to(package)])


def _outside_imports(paths) -> list[str]:
    """Imports of the repository's other top-level packages (tools, bench, tests' helpers)."""
    bad = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            bad += [f"{_where(path)}: {n}" for n in names
                    if n.split(".")[0] in ("tools", "bench", "tests", "helpers", "pretrain_gpt")]
    return bad


def test_the_library_imports_nothing_of_tools_bench_or_tests():
    assert not _outside_imports(sorted(PACKAGE.rglob("*.py")))


DUCK_TYPED_TOPOLOGY = re.compile(r"getattr\(\s*(self\.)?_?topo\b")


def test_no_component_reads_the_topology_by_duck_typing():
    """Components take typed group views (megazero.parallel.groups): no ``getattr(topo, ...)``
    fallbacks (and so no proxy standing in for the topology)."""
    paths = sorted(PACKAGE.rglob("*.py")) + sorted((ROOT / "tools").rglob("*.py")) + sorted(ROOT.glob("*.py"))
    bad = [str(p.relative_to(ROOT)) for p in paths if DUCK_TYPED_TOPOLOGY.search(p.read_text())]
    assert not bad, bad


def test_tools_run_as_a_package_without_editing_sys_path():
    """``python -m tools.X`` from the repository, the library pip-installed (bench/'s rule is below)."""
    assert not _sys_path_edits(sorted((ROOT / "tools").rglob("*.py")))
    assert (ROOT / "tools" / "__init__.py").is_file()


def _undocumented(paths) -> list[str]:
    return [_where(p) for p in paths if not ast.get_docstring(ast.parse(p.read_text()))]


def test_every_module_says_what_it_holds():
    """A module holds one owner's code, and its docstring says what that is (the ownership rule that
    replaces a line count: a long data-only file is fine, a concept is never split to meet a number)."""
    paths = sorted(PACKAGE.rglob("*.py")) + sorted((ROOT / "tools").rglob("*.py"))
    assert not _undocumented(paths)


def _long_functions(paths, most: int) -> list[str]:
    out = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= most:
                out.append(f"{_where(path)}:{node.name}")
    return out


def test_functions_stay_short_enough_to_read():
    assert not _long_functions(sorted(PACKAGE.rglob("*.py")), LONGEST_FUNCTION)


def test_the_entry_point_is_thin():
    """``pretrain_gpt.py`` is a few lines over :mod:`megazero.cli` (as torchtitan's train.py over its trainer)."""
    text = (ROOT / "pretrain_gpt.py").read_text()
    assert len(text.splitlines()) < 40
    imported = {n.module for n in ast.walk(ast.parse(text)) if isinstance(n, ast.ImportFrom)}
    assert imported == {"megazero.cli.main"}


def test_the_checker_sees_what_it_should(tmp_path):
    """Each rule above can fail: a synthetic circle, order violation, underscore import, concrete-model
    import, function-level import, sys.path edit, undocumented module and long function are caught."""
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _order_violations({"megazero.config.x": {"megazero.parallel.y"}}, PACKAGES) == [
        "megazero.config.x imports megazero.parallel.y: megazero.parallel is not below megazero.config in PACKAGES"]
    bad = tmp_path / "bad.py"
    bad.write_text("import sys\nfrom megazero.parallel.zero.buckets import _hidden, nbytes\n"
                   "from megazero.models.gpt import GPT\nfrom megazero.spec import get_model_spec\n"
                   "def f():\n    from megazero.config import flag\n    sys.path.insert(0, '.')\n")
    assert _underscore_imports([bad]) == ["bad.py: megazero.parallel.zero.buckets._hidden"]
    assert _concrete_model_imports([bad]) == ["bad.py: megazero.models.gpt"]
    assert _imports_in_functions([bad]) == ["bad -> megazero.config"]
    assert _sys_path_edits([bad]) == ["bad.py:7"]
    assert _undocumented([bad]) == ["bad.py"]
    assert _long_functions([bad], 2) == ["bad.py:f"]
    assert _outside_imports([bad]) == []
    assert DUCK_TYPED_TOPOLOGY.search('ep = getattr(topo, "ep_size", 1)')
    assert DUCK_TYPED_TOPOLOGY.search("self.average_over = getattr(self.topo, 'gradient_average_size', 1)")
    assert not DUCK_TYPED_TOPOLOGY.search("topology = getattr(module, 'topology_name', None)")


# ------------------------------------------------------------------------------------------------ bench/
# bench/ is a package run from the repository root (`python -m bench.run`): no import cycle among its
# modules, no module importing another's underscore name (from bench or megazero), no sys.path edits,
# nothing imported from tests/. Read with ast by the small readers below, which serve these rules only.

BENCH_REPO = ROOT
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
