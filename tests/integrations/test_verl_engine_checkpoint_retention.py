"""``VerlBalanceEngine.save_checkpoint(..., max_ckpt_to_keep=N)`` keeps the newest N checkpoints it
saved, as verl's FSDP checkpoint manager does (None / 0: all): deleted by global rank 0 alone, after
every rank wrote the new checkpoint, never the path just saved; the newest loads back to its weights."""

from __future__ import annotations

import functools
import os
import types

import numpy as np
import pytest

from tests._verl import VERL_SKIP_REASON

pytest.importorskip("verl", reason=VERL_SKIP_REASON)

from verl_balance.distributed.launcher import run_on_ranks  # noqa: E402
from verl_balance.integrations.verl.engine import (  # noqa: E402
    VerlBalanceEngineConfigError,
    plan_checkpoint_retention,
)

WORLD = 2


# ---------------------------------------------------------------------- bookkeeping (hand-worked)


def test_retention_keeps_the_newest_n_and_deletes_the_oldest_first(tmp_path):
    a, b, c = (str(tmp_path / f"global_step_{i}") for i in (1, 2, 3))
    kept, stale = plan_checkpoint_retention([], a, max_ckpt_to_keep=2)
    assert (kept, stale) == ([a], [])
    kept, stale = plan_checkpoint_retention(kept, b, max_ckpt_to_keep=2)
    assert (kept, stale) == ([a, b], [])
    kept, stale = plan_checkpoint_retention(kept, c, max_ckpt_to_keep=2)
    assert (kept, stale) == ([b, c], [a])
    assert plan_checkpoint_retention([a, b], c, max_ckpt_to_keep=1) == ([c], [a, b])


@pytest.mark.parametrize("keep_all", [None, 0])
def test_retention_none_or_zero_keeps_every_checkpoint(tmp_path, keep_all):
    paths = [str(tmp_path / f"global_step_{i}") for i in range(5)]
    kept = []
    for path in paths:
        kept, stale = plan_checkpoint_retention(kept, path, max_ckpt_to_keep=keep_all)
        assert stale == []
    assert kept == paths


def test_retention_never_deletes_the_path_just_saved_or_a_folder_holding_it(tmp_path):
    a, b = str(tmp_path / "global_step_1"), str(tmp_path / "global_step_2")
    # Saving b again counts once, as the newest (verl's list would hold b twice and delete it).
    assert plan_checkpoint_retention([a, b], b, max_ckpt_to_keep=1) == ([b], [a])
    # A relative spelling of a remembered path is the same path.
    rel = os.path.relpath(b)
    assert plan_checkpoint_retention([a, b], rel, max_ckpt_to_keep=2) == ([a, b], [])
    # An older save that is a parent of the new path is forgotten but not deleted.
    inner = os.path.join(a, "actor")
    assert plan_checkpoint_retention([a], inner, max_ckpt_to_keep=1) == ([inner], [])


@pytest.mark.parametrize("bad", [-1, 1.5, "2", True])
def test_retention_rejects_a_bad_max_ckpt_to_keep_naming_the_key(tmp_path, bad):
    with pytest.raises(VerlBalanceEngineConfigError, match="max_ckpt_to_keep"):
        plan_checkpoint_retention([], str(tmp_path), max_ckpt_to_keep=bad)


# ---------------------------------------------------------------------- the engine on a gloo group


def _batch(vocab: int, *, dp_rank: int, seed: int):
    """This DP rank's half of 4 variable-length SFT samples in verl's no-padding TensorDict."""
    import torch
    from verl.utils import tensordict_utils as tu

    rng = np.random.default_rng(seed)
    samples = [rng.integers(3, vocab, size=int(n)) for n in rng.integers(5, 30, size=4)][dp_rank::WORLD]
    ids = [torch.as_tensor(s) for s in samples]
    mask = [torch.cat([torch.zeros(1, dtype=torch.long), torch.ones(len(s) - 1, dtype=torch.long)]) for s in ids]
    return tu.get_tensordict(
        tensor_dict={
            "input_ids": torch.nested.as_nested_tensor(ids, layout=torch.jagged),
            "position_ids": torch.nested.as_nested_tensor([torch.arange(len(x)) for x in ids], layout=torch.jagged),
            "loss_mask": torch.nested.as_nested_tensor(mask, layout=torch.jagged),
        },
        non_tensor_dict={
            "use_remove_padding": False,
            "use_dynamic_bsz": True,
            "max_token_len_per_gpu": 64,
            "micro_batch_size_per_gpu": None,
            "temperature": 1.0,
            "global_batch_size": 4,
            "pad_mode": "no_padding",
        },
    )


def _save_three_times(rank: int, *, model_dir: str, root: str, max_ckpt_to_keep) -> dict:
    """Train, save global_step_{1,2,3} with max_ckpt_to_keep; record what exists after each save
    (behind a barrier: rank 0 deletes after the engine's own barrier), the weights of each save, which
    rank deleted what and whether the newest save was complete when it did; then load the newest back."""
    import torch
    import torch.distributed as dist
    from verl.workers.config import FSDPOptimizerConfig, HFModelConfig
    from verl.workers.engine.base import EngineRegistry
    from verl.workers.utils.losses import sft_loss

    from verl_balance.integrations.verl import engine as verl_engine
    from verl_balance.integrations.verl.cpu_shims import platform as cpu_platform  # noqa: F401  (verl's CPU platform: get_device_name() is "cpu")

    model_config = HFModelConfig(
        path=model_dir, use_remove_padding=False, override_config={"attn_implementation": "sdpa"}
    )

    def new_engine():
        built = EngineRegistry.new(
            model_type="language_model",
            backend="verl_balance",
            model_config=model_config,
            engine_config=verl_engine.VerlBalanceEngineConfig(mixed_precision={"param_dtype": "fp32"}),
            optimizer_config=FSDPOptimizerConfig(lr=1e-2, clip_grad=1e9, total_training_steps=10),
            checkpoint_config=None,
        )
        built.initialize()
        return built

    def weights(engine) -> dict:
        return {name: t.detach().cpu().clone() for name, t in engine.get_per_tensor_param()[0]}

    deleted: list[tuple[str, bool]] = []
    real_shutil = verl_engine.shutil
    newest: list[str] = []

    def recording_rmtree(path, *args, **kwargs):
        # Every rank's DCP shard and the engine state of the newest save exist before anything goes.
        done = sorted(os.listdir(newest[-1]))
        complete = "engine_state.pt" in done and sum(f.endswith(".distcp") for f in done) == WORLD
        deleted.append((os.path.basename(path), complete))
        real_shutil.rmtree(path, *args, **kwargs)

    verl_engine.shutil = types.SimpleNamespace(rmtree=recording_rmtree)  # this module's deletions only
    engine = new_engine()
    vocab = model_config.hf_config.vocab_size
    dp_rank = engine.get_data_parallel_rank()
    loss_fn = functools.partial(sft_loss, config=None)

    def train(seed: int) -> None:
        with engine.train_mode():
            engine.train_batch(_batch(vocab, dp_rank=dp_rank, seed=seed), loss_function=loss_fn)

    out = {"exists_after_save": [], "saved_weights": []}
    names = [f"global_step_{step}" for step in (1, 2, 3)]
    for step, name in enumerate(names, start=1):
        train(seed=step)
        newest.append(os.path.join(root, name))
        engine.save_checkpoint(newest[-1], global_step=step, max_ckpt_to_keep=max_ckpt_to_keep)
        dist.barrier()
        out["exists_after_save"].append(sorted(n for n in os.listdir(root) if n.startswith("global_step_")))
        out["saved_weights"].append(weights(engine))
    out["remembered"] = [os.path.basename(p) for p in engine.saved_checkpoint_paths]

    train(seed=4)  # move away from the newest save, then load it back
    moved = weights(engine)
    engine.load_checkpoint(newest[-1])
    out["moved_away"] = any(not torch.equal(moved[k], v) for k, v in out["saved_weights"][-1].items())
    out["loaded"] = weights(engine)
    fresh = new_engine()
    fresh.load_checkpoint(newest[-1])
    out["fresh_loaded"] = weights(fresh)

    # A bad value is rejected before any collective or file is written.
    try:
        engine.save_checkpoint(os.path.join(root, "global_step_bad"), global_step=9, max_ckpt_to_keep=-1)
        out["bad_value_error"] = None
    except VerlBalanceEngineConfigError as error:
        out["bad_value_error"] = str(error)
    out["bad_dir_created"] = os.path.exists(os.path.join(root, "global_step_bad"))
    dist.barrier()
    verl_engine.shutil = real_shutil
    out["deleted"] = deleted
    return out


def _run(model_dir: str, root: str, max_ckpt_to_keep) -> list[dict]:
    return run_on_ranks(
        functools.partial(_save_three_times, model_dir=model_dir, root=root, max_ckpt_to_keep=max_ckpt_to_keep),
        world=WORLD,
    )


def _assert_equal_weights(got: dict, want: dict) -> None:
    import torch

    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert torch.equal(got[name], value), name


@pytest.mark.slow
def test_max_ckpt_to_keep_2_keeps_the_last_two_deleted_by_rank_0_after_the_save_and_the_newest_loads_back(
    model_dir, tmp_path
):
    import torch

    results = _run(model_dir, str(tmp_path), 2)
    steps = ["global_step_1", "global_step_2", "global_step_3"]
    for rank, r in enumerate(results):
        assert r["exists_after_save"] == [steps[:1], steps[:2], steps[1:]]
        assert r["remembered"] == steps[1:]
        # The three saves hold different weights, so loading the wrong one would be seen.
        assert any(not torch.equal(r["saved_weights"][1][k], v) for k, v in r["saved_weights"][2].items())
        assert r["moved_away"]
        _assert_equal_weights(r["loaded"], r["saved_weights"][-1])
        _assert_equal_weights(r["fresh_loaded"], r["saved_weights"][-1])
        assert r["bad_value_error"] is not None and "max_ckpt_to_keep=-1" in r["bad_value_error"]
        assert not r["bad_dir_created"]
        # Global rank 0 deletes, once, and only once every rank's shard of the newest save exists.
        assert r["deleted"] == ([("global_step_1", True)] if rank == 0 else [])
    assert sorted(os.listdir(tmp_path)) == steps[1:]


@pytest.mark.slow
def test_max_ckpt_to_keep_none_keeps_every_checkpoint(model_dir, tmp_path):
    results = _run(model_dir, str(tmp_path), None)
    steps = ["global_step_1", "global_step_2", "global_step_3"]
    for r in results:
        assert r["exists_after_save"] == [steps[:1], steps[:2], steps]
        assert r["deleted"] == []
        _assert_equal_weights(r["loaded"], r["saved_weights"][-1])
    assert sorted(os.listdir(tmp_path)) == steps
