"""The verl integration's modules never import the facade, and the facade keeps the public names.

Import cycles anywhere in the package (function-level imports included) are ``tests/test_import_graph.py``'s.
"""

from __future__ import annotations

import ast
import pathlib

import verl_balance.integrations.verl as facade

PACKAGE = "verl_balance.integrations.verl"
ROOT = pathlib.Path(facade.__file__).parent


def _module_level_edges() -> dict[str, set[str]]:
    """Module -> integration modules it imports at module level (lazy imports inside functions excluded)."""
    edges = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join([PACKAGE, *(parts[:-1] if parts[-1] == "__init__" else parts)])
        deps = set()
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(PACKAGE):
                deps.add(node.module)
        edges[name] = deps
    return edges


def test_integration_modules_skip_the_facade():
    edges = _module_level_edges()
    assert len(edges) >= 8, sorted(edges)  # the split happened
    for module, deps in edges.items():
        if module != PACKAGE:
            assert PACKAGE not in deps, f"{module} imports the facade"


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
        "RayWorkerGroup",
    ):
        assert callable(getattr(facade, name)), name
