"""The package's import graph, module-level and function-level imports alike, read from the source.

Every module of ``verl_balance`` is parsed (AST) and every ``import`` in it, at any depth (inside
functions, methods, ``try`` blocks), is resolved to the ``verl_balance`` module it loads (relative
imports included; ``from pkg import name`` is ``pkg.name`` when that is a module, else ``pkg``).
Imports under ``if TYPE_CHECKING:`` never run, so they are left out of the cycle check (not out of
the layer rules). Invariants (docs/design.md, "Layers"):

- no import cycle anywhere in the package;
- ``balance/`` imports only the standard library, numpy and ``balance`` itself;
- ``single_controller/`` imports nothing of ``integrations/`` and never ``verl``;
- only ``single_controller/``, ``workers/``, ``trainer/``, ``integrations/`` and ``testing/`` import Ray;
- the suite's process pools (``TEST_MACHINERY``: the warm-host pool and the forked-worker server) are
  imported by nothing outside ``testing/``: production code knows only the ``WorkerFactory`` seam;
- only ``integrations/verl/`` imports ``verl``, and no core module imports ``integrations/``;
- the driver side (``trainer/``, ``single_controller/``) never imports ``torch.distributed``;
- the top-level command modules (``CLI_MODULES``: ``python -m verl_balance.<name>``) are imported by
  nothing in the package: a library module never reaches up into a command line.

Negative controls: a temporary package with planted cycles (module-level and function-level,
relative and absolute) and planted layer violations must be reported.
"""

from __future__ import annotations

import ast
import pathlib
import sys
from dataclasses import dataclass, field

import verl_balance

ROOT_PACKAGE = "verl_balance"
# Top-level command-line modules (``python -m verl_balance.<name>``): entry points, never a library's import.
CLI_MODULES = ("main_sft", "main_grpo", "export", "parity", "memory", "calibrate")
# The suite's process pools: test machinery that production modules never import.
TEST_MACHINERY = ("testing.worker_hosts", "testing.worker_host", "testing.forked_workers")


@dataclass(frozen=True)
class Import:
    """One import statement's target as the importing module sees it."""

    target: str  # dotted name: a package module, or a third-party / stdlib module
    line: int
    in_function: bool
    type_checking_only: bool


@dataclass
class Graph:
    """Modules of one package (dotted name -> file) and what each imports."""

    package: str
    files: dict[str, pathlib.Path] = field(default_factory=dict)
    imports: dict[str, list[Import]] = field(default_factory=dict)

    def internal_edges(self, *, runtime_only: bool = True) -> dict[str, set[str]]:
        """module -> package modules it imports (TYPE_CHECKING-only imports left out by default)."""
        return {
            module: {i.target for i in found if i.target in self.files and not (runtime_only and i.type_checking_only)}
            for module, found in self.imports.items()
        }


def _module_name(root: pathlib.Path, package: str, path: pathlib.Path) -> str:
    parts = [package, *path.relative_to(root).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking_block(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")
    )


def _walk_imports(node: ast.AST, *, in_function: bool = False, type_checking: bool = False):
    """(import node, in_function, under TYPE_CHECKING) for every import below ``node``."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child, in_function, type_checking
            continue
        yield from _walk_imports(
            child,
            in_function=in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)),
            type_checking=type_checking or _is_type_checking_block(child),
        )


def _resolve_from(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module name of ``from <node.module> import ...`` written in ``module``."""
    if node.level == 0:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def _targets(module: str, is_package: bool, node: ast.AST, modules: set[str]) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    source = _resolve_from(module, is_package, node)
    # `from pkg import sub` loads the module pkg.sub when there is one, else a name of pkg
    return [f"{source}.{a.name}" if f"{source}.{a.name}" in modules else source for a in node.names]


def build_graph(root: pathlib.Path, package: str) -> Graph:
    """Parse every ``.py`` file under ``root`` (the directory of package ``package``)."""
    graph = Graph(package)
    for path in sorted(root.rglob("*.py")):
        graph.files[_module_name(root, package, path)] = path
    modules = set(graph.files)
    for module, path in graph.files.items():
        is_package = path.name == "__init__.py"
        found = []
        for node, in_function, type_checking in _walk_imports(ast.parse(path.read_text(), filename=str(path))):
            for target in _targets(module, is_package, node, modules):
                found.append(Import(target, node.lineno, in_function, type_checking))
        graph.imports[module] = found
    return graph


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a module path that ends where it starts, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for dep in sorted(edges.get(node, ())):
            if state.get(dep) == 1:
                return path[path.index(dep) :] + [dep]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def _top(name: str) -> str:
    return name.split(".")[0]


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _layer_rules(pkg: str) -> dict[str, object]:
    """rule name -> broken(importing module, imported target)."""
    ray_allowed = [f"{pkg}.{p}" for p in ("single_controller", "workers", "trainer", "integrations", "testing")]
    driver = [f"{pkg}.{p}" for p in ("trainer", "single_controller")]
    return {
        "balance/ imports numpy and the standard library only": lambda m, t: (
            _in(m, f"{pkg}.balance")
            and not (
                _in(t, f"{pkg}.balance") or _top(t) in ("numpy", "__future__") or _top(t) in sys.stdlib_module_names
            )
        ),
        "single_controller/ knows nothing of verl": lambda m, t: (
            _in(m, f"{pkg}.single_controller") and (_in(t, f"{pkg}.integrations") or _top(t) == "verl")
        ),
        "only single_controller/, workers/, trainer/, integrations/, testing/ import Ray": lambda m, t: (
            _top(t) == "ray" and not any(_in(m, p) for p in ray_allowed)
        ),
        "only integrations/verl/ imports verl": lambda m, t: (
            _top(t) == "verl" and not _in(m, f"{pkg}.integrations.verl")
        ),
        "no core module imports integrations/": lambda m, t: (
            _in(t, f"{pkg}.integrations") and not _in(m, f"{pkg}.integrations")
        ),
        "the driver never imports torch.distributed": lambda m, t: (
            _in(t, "torch.distributed") and any(_in(m, p) for p in driver)
        ),
        "test machinery is imported by nothing outside testing/": lambda m, t: (
            any(_in(t, f"{pkg}.{name}") for name in TEST_MACHINERY) and not _in(m, f"{pkg}.testing")
        ),
        "top-level command modules are imported by nothing in the package": lambda m, t: (
            any(_in(t, f"{pkg}.{cli}") for cli in CLI_MODULES) and not _in(m, t)
        ),
    }


def layer_violations(graph: Graph) -> set[tuple[str, int, str, str]]:
    """Every import that breaks a layer rule of the module docstring: (module, line, target, rule)."""
    rules = _layer_rules(graph.package)
    return {
        (module, imp.line, imp.target, rule)
        for module, found in graph.imports.items()
        for imp in found
        for rule, broken in rules.items()
        if broken(module, imp.target)
    }


PACKAGE_GRAPH = build_graph(pathlib.Path(verl_balance.__file__).parent, ROOT_PACKAGE)


def test_the_package_has_no_import_cycle_counting_function_level_imports():
    assert len(PACKAGE_GRAPH.files) > 100, sorted(PACKAGE_GRAPH.files)  # the walk saw the whole package
    assert any(i.in_function for found in PACKAGE_GRAPH.imports.values() for i in found)  # and lazy imports
    cycle = find_cycle(PACKAGE_GRAPH.internal_edges())
    assert cycle is None, " -> ".join(cycle)


def test_every_import_respects_the_layer_rules():
    assert sorted(layer_violations(PACKAGE_GRAPH)) == []


def test_single_controller_imports_only_its_own_modules_and_the_protocol():
    internal = {
        target
        for module, targets in PACKAGE_GRAPH.internal_edges(runtime_only=False).items()
        if _in(module, f"{ROOT_PACKAGE}.single_controller")
        for target in targets
    }
    assert {t for t in internal if not _in(t, f"{ROOT_PACKAGE}.single_controller")} == {f"{ROOT_PACKAGE}.protocol"}


# ----------------------------------------------------------------- negative controls
def _write_package(tmp_path: pathlib.Path, files: dict[str, str]) -> pathlib.Path:
    root = tmp_path / "planted"
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_a_planted_function_level_cycle_through_a_relative_import_is_found(tmp_path):
    root = _write_package(
        tmp_path,
        {
            "__init__.py": "",
            "sub/__init__.py": "",
            "sub/a.py": "from . import b\n",
            "sub/b.py": "def late():\n    from ..c import helper\n    return helper\n",
            "c.py": "import planted.sub.a\n\ndef helper():\n    return 1\n",
            "typed.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from planted.c import helper\n",
        },
    )
    graph = build_graph(root, "planted")
    assert graph.internal_edges()["planted.sub.b"] == {"planted.c"}  # `..c` resolved from inside sub/
    cycle = find_cycle(graph.internal_edges())
    assert cycle is not None and set(cycle) == {"planted.sub.a", "planted.sub.b", "planted.c"}
    # the same graph without the function-level import has no cycle: the lazy import is what closes it
    module_level = {
        m: {i.target for i in found if i.target in graph.files and not i.in_function}
        for m, found in graph.imports.items()
    }
    assert find_cycle(module_level) is None
    assert graph.internal_edges()["planted.typed"] == set()  # TYPE_CHECKING imports never run


def test_a_planted_module_level_cycle_through_a_package_init_is_found(tmp_path):
    root = _write_package(
        tmp_path,
        {
            "__init__.py": "from planted.x import name\n",
            "x.py": "from planted import other\nname = 1\n",
            "other.py": "",
        },
    )
    graph = build_graph(root, "planted")
    assert graph.internal_edges()["planted.x"] == {"planted.other"}  # a submodule, not the package
    root2 = _write_package(
        tmp_path / "2", {"__init__.py": "from planted.x import name\n", "x.py": "from planted import VALUE\n"}
    )
    cycle = find_cycle(build_graph(root2, "planted").internal_edges())
    assert cycle == ["planted", "planted.x", "planted"]


def test_planted_layer_violations_are_reported(tmp_path):
    root = _write_package(
        tmp_path,
        {
            "__init__.py": "",
            "balance/__init__.py": "import numpy\nimport json\n",
            "balance/plan.py": "def f():\n    import torch\n",
            "single_controller/__init__.py": "def g():\n    from planted.integrations.verl import x\n",
            "single_controller/w.py": "import verl.protocol\n",
            "integrations/__init__.py": "",
            "integrations/verl/__init__.py": "import verl\n",
            "models/m.py": "import ray\n",
            "trainer/t.py": "import ray\nimport torch.distributed as dist\n",
            "loss.py": "from planted.integrations import verl\n",
            "export.py": "import json\n\ndef main():\n    from planted.engine import e\n",
            "engine/__init__.py": "",
            "engine/e.py": "def names():\n    from planted.export import main\n",
            "main_sft.py": "from planted import export\n",
            "testing/__init__.py": "",
            "testing/worker_hosts.py": "import ray\nfrom planted.testing import forked_workers\n",
            "testing/forked_workers.py": "",
            "single_controller/g.py": "def h():\n    from planted.testing.worker_hosts import enable\n",
            "distributed/launcher.py": "from planted.testing import forked_workers\n",
        },
    )
    found = {
        (module, line, target, rule.split()[0])
        for module, line, target, rule in layer_violations(build_graph(root, "planted"))
    }
    assert found == {
        ("planted.balance.plan", 2, "torch", "balance/"),
        ("planted.single_controller", 2, "planted.integrations.verl", "single_controller/"),
        ("planted.single_controller", 2, "planted.integrations.verl", "no"),
        ("planted.single_controller.w", 1, "verl.protocol", "single_controller/"),
        ("planted.single_controller.w", 1, "verl.protocol", "only"),
        ("planted.models.m", 1, "ray", "only"),
        ("planted.trainer.t", 2, "torch.distributed", "the"),
        ("planted.loss", 1, "planted.integrations.verl", "no"),
        ("planted.engine.e", 2, "planted.export", "top-level"),
        ("planted.main_sft", 1, "planted.export", "top-level"),
        ("planted.single_controller.g", 2, "planted.testing.worker_hosts", "test"),
        ("planted.distributed.launcher", 1, "planted.testing.forked_workers", "test"),
    }, sorted(found)
