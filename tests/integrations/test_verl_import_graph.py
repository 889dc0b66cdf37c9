"""The verl integration's modules import each other without a circle, and never the facade."""

from __future__ import annotations

import ast
import pathlib

import verl_balance.integrations.verl as facade

PACKAGE = "verl_balance.integrations.verl"
ROOT = pathlib.Path(facade.__file__).parent


def _module_level_edges() -> dict[str, set[str]]:
    """Module -> integration modules it imports at module level (lazy imports inside functions excluded)."""
    edges = {}
    for path in ROOT.glob("*.py"):
        name = PACKAGE if path.stem == "__init__" else f"{PACKAGE}.{path.stem}"
        deps = set()
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(PACKAGE):
                deps.add(node.module)
        edges[name] = deps
    return edges


def _find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}

    def visit(node, path):
        state[node] = 1
        for dep in sorted(edges.get(node, ())):
            if state.get(dep) == 1:
                return path + [node, dep]
            if dep not in state and (found := visit(dep, path + [node])):
                return found
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (found := visit(node, [])):
            return found
    return None


def test_integration_modules_form_no_import_cycle_and_skip_the_facade():
    edges = _module_level_edges()
    assert len(edges) >= 8, sorted(edges)  # the split happened
    assert _find_cycle(edges) is None, _find_cycle(edges)
    for module, deps in edges.items():
        if module != PACKAGE:
            assert PACKAGE not in deps, f"{module} imports the facade"


def test_cycle_finder_finds_a_planted_cycle_negative_control():
    edges = _module_level_edges()
    edges[f"{PACKAGE}.errors"] = {f"{PACKAGE}.patch"}  # patch -> errors -> patch
    assert _find_cycle(edges) is not None


def test_facade_keeps_the_public_names():
    for name in (
        "get_seqlen_balanced_partitions",
        "rearrange_micro_batches",
        "get_reverse_idx",
        "patch_verl",
        "VerlPatch",
        "balance_batch",
        "batch_from_dataproto",
        "batch_to_dataproto",
        "batch_from_tensordict",
        "loss_counts",
        "agg_loss",
        "LossCounts",
        "workload_from_hf_config",
        "VerlNotInstalledError",
    ):
        assert callable(getattr(facade, name)), name
