"""Every test that starts a second interpreter (a subprocess, Ray workers, torch multiprocessing via
``run_on_ranks`` / ``run_layouts``) is marked ``slow``, so ``-m "not slow"`` stays a single-process lane.

The check reads the test sources (``ast``): a test starts another interpreter when its body, a
fixture it requests, or a function it calls (in its module or imported from another test module)
uses ``subprocess``, ``sys.executable``, ``multiprocessing``/``torch.multiprocessing``, ``ray``, the
``ray_cluster`` fixture or one of the library helpers in ``SPAWNING_HELPERS``. It is marked when
``pytest.mark.slow`` decorates it or its class, or is in the module's ``pytestmark``.
"""

from __future__ import annotations

import ast
import os
import textwrap

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
# Modules whose use starts another process (imported as a module or through names from them).
SPAWNING_MODULES = ("subprocess", "multiprocessing", "torch.multiprocessing", "ray")
# Library entry points and fixtures that start processes: torch multiprocessing spawn, a Ray cluster and
# its workers. (A RayWorkerGroup needs a running cluster, i.e. ray_cluster or ray.init, both flagged, so
# a test constructing one only to see it refuse its arguments is not.)
SPAWNING_HELPERS = frozenset(
    {"run_on_ranks", "run_layouts", "start_ray", "build_actor_group", "ray_cluster", "ray_head"}
)


def _is_slow_mark(node: ast.AST) -> bool:
    """``pytest.mark.slow`` (or ``mark.slow``), called or not."""
    if isinstance(node, ast.Call):
        node = node.func
    return isinstance(node, ast.Attribute) and node.attr == "slow"


def _module_marked_slow(tree: ast.Module) -> bool:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "pytestmark" for t in node.targets):
            marks = node.value.elts if isinstance(node.value, (ast.List, ast.Tuple)) else [node.value]
            if any(_is_slow_mark(m) for m in marks):
                return True
    return False


def _spawning_module(name: str) -> bool:
    """Whether ``name`` is a module of SPAWNING_MODULES or inside one."""
    return any(name == m or name.startswith(m + ".") for m in SPAWNING_MODULES)


def _imports_spawning_module(value: ast.AST) -> bool:
    """``pytest.importorskip("ray")`` / ``importlib.import_module("subprocess")`` and the like."""
    return (
        isinstance(value, ast.Call)
        and value.args
        and isinstance(value.args[0], ast.Constant)
        and isinstance(value.args[0].value, str)
        and getattr(value.func, "attr", getattr(value.func, "id", "")) in ("importorskip", "import_module")
        and _spawning_module(value.args[0].value)
    )


class _Module:
    """One test source: its functions, the names bound to spawning modules, its imports from tests."""

    def __init__(self, tree: ast.Module):
        self.spawning_aliases: set[str] = set()  # local names of modules in SPAWNING_MODULES, or names from them
        self.test_imports: dict[str, tuple[str, str]] = {}  # local name -> (tests module, name there)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if _spawning_module(alias.name) and (alias.asname or "." not in alias.name):
                        self.spawning_aliases.add(alias.asname or alias.name)
                    elif _spawning_module(alias.name.split(".")[0]):  # import multiprocessing.pool
                        self.spawning_aliases.add(alias.name.split(".")[0])
            elif isinstance(node, ast.ImportFrom) and node.module:
                for alias in node.names:
                    local = alias.asname or alias.name
                    if _spawning_module(node.module) or _spawning_module(f"{node.module}.{alias.name}"):
                        self.spawning_aliases.add(local)
                    elif node.module.startswith("tests."):
                        self.test_imports[local] = (node.module, alias.name)
            elif isinstance(node, ast.Assign) and _imports_spawning_module(node.value):
                self.spawning_aliases.update(t.id for t in node.targets if isinstance(t, ast.Name))
        self.functions: dict[str, ast.FunctionDef] = {}
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self.functions[node.name] = node
            elif isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        self.functions.setdefault(item.name, item)

    def direct_spawn(self, names: set[str]) -> bool:
        """Whether a function reading ``names`` (``_names_in``) names a spawning module or helper."""
        # "multiprocessing" also catches `import torch.multiprocessing` used as torch.multiprocessing.spawn
        return bool(names & (self.spawning_aliases | SPAWNING_HELPERS | {"sys.executable", "multiprocessing"}))


def _names_in(func: ast.AST) -> set[str]:
    """Plain names read in ``func`` (nested functions included), its parameters (fixture requests),
    the attribute names it reads, and ``sys.executable`` when it reads that: one walk."""
    names = set()
    for node in ast.walk(func):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
            if node.attr == "executable" and getattr(node.value, "id", None) == "sys":
                names.add("sys.executable")
    return names


def spawning_functions(trees: dict[str, ast.Module]) -> dict[str, set[str]]:
    """Per module name (``tests.x.y``), the names of its functions that start another interpreter,
    directly or through a function of its own or imported from another module of ``trees``
    (conftest fixtures are reached by the parameter names of the functions requesting them)."""
    modules = {name: _Module(tree) for name, tree in trees.items()}
    used = {name: {f: _names_in(node) for f, node in m.functions.items()} for name, m in modules.items()}
    spawning = {name: {f for f, names in used[name].items() if m.direct_spawn(names)} for name, m in modules.items()}
    changed = True
    while changed:
        changed = False
        for name, module in modules.items():
            reachable = spawning[name] | _conftest_spawners(name, spawning)
            reachable |= {local for local, (mod, n) in module.test_imports.items() if n in spawning.get(mod, ())}
            for func_name, names in used[name].items():
                if func_name not in spawning[name] and names & (reachable - {func_name}):
                    spawning[name].add(func_name)
                    changed = True
    return spawning


def _conftest_spawners(module_name: str, spawning: dict[str, set[str]]) -> set[str]:
    """Spawning functions of the conftest modules of ``module_name``'s package and its parents."""
    parts = module_name.split(".")[:-1]
    out: set[str] = set()
    for depth in range(1, len(parts) + 1):
        out |= spawning.get(".".join(parts[:depth] + ["conftest"]), set())
    return out


def unmarked_spawning_tests(sources: dict[str, str]) -> list[str]:
    """``module::test`` of each test function that starts another interpreter but is not marked slow."""
    trees = {name: ast.parse(text) for name, text in sources.items()}
    spawning = spawning_functions(trees)
    out = []
    for name, tree in trees.items():
        if not name.split(".")[-1].startswith("test_"):
            continue
        if _module_marked_slow(tree):
            continue
        for node, class_marked in _test_functions(tree):
            if node.name not in spawning[name] or class_marked:
                continue
            if not any(_is_slow_mark(d) for d in node.decorator_list):
                out.append(f"{name}::{node.name}")
    return sorted(out)


def _test_functions(tree: ast.Module):
    """(test function, whether its class is marked slow)."""
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
            yield node, False
        elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            marked = any(_is_slow_mark(d) for d in node.decorator_list)
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name.startswith("test"):
                    yield item, marked


def _read_test_sources() -> dict[str, str]:
    sources = {}
    root = os.path.dirname(TESTS_DIR)
    for dirpath, _, files in os.walk(TESTS_DIR):
        for file in files:
            if file.endswith(".py"):
                path = os.path.join(dirpath, file)
                module = os.path.relpath(path, root)[: -len(".py")].replace(os.sep, ".")
                with open(path, encoding="utf-8") as f:
                    sources[module] = f.read()
    return sources


def test_every_test_that_starts_another_interpreter_is_marked_slow():
    missing = unmarked_spawning_tests(_read_test_sources())
    assert not missing, (
        "these tests start another interpreter (subprocess, Ray, torch multiprocessing) but are not marked "
        f"@pytest.mark.slow: {missing}"
    )


def _planted(text: str) -> str:
    return textwrap.dedent(text)


def test_the_slow_mark_check_flags_planted_unmarked_spawning_tests():
    """Negative control: each way of starting an interpreter, left unmarked, is flagged; the same
    tests marked (function, class or module) and a test that starts nothing are not."""
    helper = _planted(
        """
        import subprocess

        def run_cli(args):
            return subprocess.run(args)
        """
    )
    planted = _planted(
        """
        import subprocess, sys
        import pytest
        import torch.multiprocessing as mp
        from verl_balance.distributed.launcher import run_on_ranks
        from tests.fake.helpers import run_cli

        def _indirect():
            return subprocess.check_output(["true"])

        def test_subprocess():
            subprocess.run(["true"])

        def test_executable():
            print(sys.executable)

        def test_spawn():
            mp.spawn(print, nprocs=2)

        def test_dotted_spawn():
            import torch.multiprocessing

            torch.multiprocessing.spawn(print, nprocs=2)

        def test_run_on_ranks():
            run_on_ranks(print, world=2)

        def test_ray(ray_cluster):
            pass

        def test_conftest_fixture(cluster_client):
            pass

        def test_local_helper():
            _indirect()

        def test_imported_helper():
            run_cli(["x"])

        @pytest.mark.slow
        def test_marked():
            subprocess.run(["true"])

        @pytest.mark.slow
        class TestMarked:
            def test_in_marked_class(self):
                subprocess.run(["true"])

        def test_nothing_spawned():
            assert 1 + 1 == 2
        """
    )
    conftest = _planted(
        """
        import pytest

        @pytest.fixture
        def cluster_client(ray_cluster):
            return ray_cluster
        """
    )
    sources = {"tests.fake.helpers": helper, "tests.fake.conftest": conftest, "tests.fake.test_planted": planted}
    flagged = {name.split("::")[1] for name in unmarked_spawning_tests(sources)}
    assert flagged == {
        "test_subprocess",
        "test_executable",
        "test_spawn",
        "test_dotted_spawn",
        "test_run_on_ranks",
        "test_ray",
        "test_conftest_fixture",
        "test_local_helper",
        "test_imported_helper",
    }
    module_marked = "import pytest\npytestmark = pytest.mark.slow\n" + planted.replace("import pytest\n", "")
    assert unmarked_spawning_tests({**sources, "tests.fake.test_planted": module_marked}) == []
