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
    "megazero.models",          # the model families
    "megazero.generation",
    "megazero.reporting",       # what a run says
    "megazero.training",        # the loop and the step
    "megazero.cli",             # the program: parse -> preflight -> plan -> build -> train
]
ZERO_ORDER = ["protocol", "buckets", "grad_norm", "materialize", "swap", "adamw", "offload", "offload_params", "quantize",
              "reducers", "replicated_params", "grad_sync", "units", "sharded_grads", "zeropp", "param_sync", "publish",
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


def _sys_path_edits(paths) -> list[str]:
    """Every ``sys.path`` change (insert, append, extend, assignment) in ``paths``."""
    bad = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            target = node.func.value if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) else None
            if isinstance(node, (ast.Assign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                target = next((t for t in targets if ast.unparse(t) == "sys.path"), None)
            if target is not None and ast.unparse(target) == "sys.path":
                bad.append(f"{_where(path)}:{node.lineno}")
    return bad


@pytest.mark.parametrize("where", ["tools", "bench"])
def test_tools_and_benchmarks_run_as_packages_without_editing_sys_path(where):
    """``python -m tools.X`` / ``python -m bench.run`` from the repository, the library pip-installed."""
    assert not _sys_path_edits(sorted((ROOT / where).rglob("*.py")))
    assert (ROOT / where / "__init__.py").is_file()


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
    assert not DUCK_TYPED_TOPOLOGY.search("topology = getattr(module, 'topology_name', None)")
