"""verl's delta-weight-sync BaseEngine methods (verl 0.9.1 and main 0.10.dev) on the verl_balance
engine, under the installed verl (0.9.1 in CI; main in a session with its snapshot):
``get_per_tensor_param_shard`` yields each rank's local FSDP2 shard whose reassembly is
``get_per_tensor_param``'s full tensor, and, where the installed verl has its delta weight sync,
``prime_delta_snapshots`` + ``get_per_tensor_param_delta_shard`` report exactly the elements that
changed. The removed ``use_no_sync_for_gradient_accumulation`` key is feature-detected."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import numpy as np
import pytest

from tests._verl import VERL_SKIP_REASON

pytest.importorskip("verl", reason=VERL_SKIP_REASON)

from verl_balance.distributed.launcher import run_on_ranks  # noqa: E402


def _has_delta_sync() -> bool:
    try:
        from verl.workers.engine.utils import hf_delta_export  # noqa: F401
    except ImportError:
        return False
    return True


def _shard_run(rank: int, *, model_dir: str) -> dict:
    """Our engine on a world of 2: every local shard with its spec, the full weights, and (with verl's
    delta sync) the delta after one element of the first weight was changed."""
    import torch
    from verl.workers.config import FSDPOptimizerConfig, HFModelConfig
    from verl.workers.engine.base import EngineRegistry

    from verl_balance.integrations.verl import engine as verl_engine
    from verl_balance.integrations.verl.cpu_shims import platform as cpu_platform  # noqa: F401  (importing installs it on CPU)

    precision = {"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"}
    engine = EngineRegistry.new(
        model_type="language_model",
        backend="verl_balance",
        model_config=HFModelConfig(path=model_dir, use_remove_padding=False),
        engine_config=verl_engine.VerlBalanceEngineConfig(mixed_precision=precision),
        optimizer_config=FSDPOptimizerConfig(lr=1e-2, total_training_steps=1),
        checkpoint_config=None,
    )
    engine.initialize()
    gen, peft = engine.get_per_tensor_param_shard()
    shards = {
        name: (
            local.float().numpy().copy(),
            str(local.dtype),
            spec.full_shape,
            [(type(p).__name__, getattr(p, "dim", None)) for p in spec.placements or ()],
        )
        for name, local, spec in gen
    }
    full, _ = engine.get_per_tensor_param()
    result = {"peft": peft, "shards": shards, "full": {n: t.to(torch.bfloat16).float().numpy() for n, t in full}}
    if _has_delta_sync():
        engine.prime_delta_snapshots()
        result["unchanged"] = [int(entry[2].sum()) for entry in engine.get_per_tensor_param_delta_shard()[0]]
        name, param = next(iter(engine.engine.model.state_dict().items()))
        with torch.no_grad():
            param.to_local().view(-1)[1] += 1.0  # element 1 of this rank's shard
        entries = list(engine.get_per_tensor_param_delta_shard()[0])
        result["changed"] = {e[0][0][0]: (e[3].tolist(), e[4].float().tolist()) for e in entries if int(e[2].sum())}
        result["changed_name"], result["local_len"] = name, param.to_local().numel()
    return result


@functools.cache
def _ranks(model_dir: str) -> list:
    return run_on_ranks(functools.partial(_shard_run, model_dir=model_dir), world=2)


@pytest.mark.slow
def test_local_shards_reassemble_to_the_full_weights_and_are_disjoint(model_dir):
    ranks = _ranks(model_dir)
    assert ranks[0]["peft"] is None
    full = ranks[0]["full"]
    assert set(ranks[0]["shards"]) == set(full)
    for name, tensor in full.items():
        (local0, dtype, shape, placements), (local1, *_) = ranks[0]["shards"][name], ranks[1]["shards"][name]
        assert dtype == "torch.bfloat16" and tuple(shape) == tensor.shape
        if placements == [("Shard", 0)]:  # FSDP2: dim-0 rows split over the two ranks
            rows = tensor.reshape(tensor.shape[0], -1)
            half = -(-tensor.shape[0] // 2)
            np.testing.assert_array_equal(local0, rows[:half].reshape(-1), err_msg=name)
            np.testing.assert_array_equal(local1, rows[half:].reshape(-1), err_msg=name)
        else:
            np.testing.assert_array_equal(local0, tensor.reshape(-1), err_msg=name)
    assert any(ranks[0]["shards"][n][3] == [("Shard", 0)] for n in full), "no weight was sharded"


@pytest.mark.slow
def test_delta_shard_reports_exactly_the_changed_elements(model_dir):
    ranks = _ranks(model_dir)
    if "unchanged" not in ranks[0]:
        pytest.skip("the installed verl has no delta weight sync (verl.workers.engine.utils.hf_delta_export)")
    assert all(count == 0 for count in ranks[0]["unchanged"])
    name = ranks[0]["changed_name"]
    # element 1 of each rank's dim-0 shard: flat index 1 on rank 0, local_len + 1 on rank 1
    for rank, expected_index in ((0, 1), (1, ranks[0]["local_len"] + 1)):
        changed = ranks[rank]["changed"]
        # the tiny model ties lm_head to the embedding: both HF names share the changed storage
        assert name in changed and set(changed) <= {name, "lm_head.weight"}, sorted(changed)
        for indices, values in changed.values():
            assert indices == [expected_index] and len(values) == 1, (rank, indices)


def test_gradient_sync_deferral_reads_verl_0_9_key_and_defaults_as_verl_main():
    from verl_balance.integrations.verl.engine import _defer_gradient_sync

    assert _defer_gradient_sync(SimpleNamespace(use_no_sync_for_gradient_accumulation=False)) is False
    assert _defer_gradient_sync(SimpleNamespace(use_no_sync_for_gradient_accumulation=True)) is True
    assert _defer_gradient_sync(SimpleNamespace()) is True  # verl main: the key is gone, the sync always deferred
