"""Resume through verl's own trainers with ``strategy=verl_balance`` (issue 49, item 3).

A run stopped after a save and started again with the same command (``trainer.resume_mode=auto``)
resumes from the saved step and logs the steps and losses of an uninterrupted run: verl's
``sft_trainer`` (torchrun environment, DP2) and ``main_ppo`` (legacy ``RayPPOTrainer`` and the v1
``PPOTrainer``). Each stopped run saves at step 1 with ``dataloader_num_workers=2`` and the resumed
run has 0: the condition of the issue's ``AssertionError: State doesn't contain key '_num_yielded'``
(torchdata loads only the layout it saved; ``test_verl_loader_state.py`` shows that error on the same
state), which ``autopatch``'s loader (``patches/loader_state.py``) converts. Step 1 is mid-epoch, so
the resumed loader must continue the epoch: restarting it would train step 2 on step 1's prompts.

The stopped run differs from the uninterrupted one only in ``trainer.total_training_steps`` (verl's
default learning rate schedule is constant) and the loader's worker count. A planted payload in the
loader state verl unpickles after our engine's load is refused by the engine before it can run.
"""

from __future__ import annotations

import re
import shutil

import pytest

from tests._verl import VERL_SKIP_REASON

pytest.importorskip("verl", reason=VERL_SKIP_REASON)
pytest.importorskip("pyarrow", reason="writing the parquet data sets needs pyarrow")

from tests.integrations.test_verl_loader_state import PlantedPayload  # noqa: E402
from tests.integrations.test_verl_main_ppo import (  # noqa: E402
    AUTOPATCH,
    add_stop_tokens,
    run_main_ppo,
    write_gsm8k_like_parquet,
)
from tests.integrations.verl_sft_ranks import run_verl_sft  # noqa: E402

RESUME = ("trainer.save_freq=1", "trainer.resume_mode=auto", "trainer.total_epochs=2")
STOP_AFTER_SAVE = ("trainer.total_training_steps=1",)  # 2 steps an epoch: step 1 is mid-epoch
STEPS = 3
# verl's v1 trainer under full_determinism gives all n samples of a prompt one request id (one draw):
# one sample per prompt, advantages from REINFORCE++'s batch whitening (GRPO's would all be 0).
V1 = (
    "trainer.use_v1=True",
    "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
    "actor_rollout_ref.rollout.n=1",
    "algorithm.adv_estimator=reinforce_plus_plus",
)
PPO_KEYS = ("actor/pg_loss", "actor/grad_norm", "critic/score/mean", "response_length/mean")
PPO_ABS = {"actor/pg_loss": 1e-6}
"""GRPO's pg_loss is a mean of O(1) terms whose group-normalised advantages cancel to ~1e-7, so its fp32
rounding is absolute (CI measured 2.2e-7 between two equal runs); grad_norm keeps rel 1e-5."""


# ---------------------------------------------------------------------------------------------
# verl.trainer.sft_trainer (torchrun environment on warm gloo ranks, DP2)
# ---------------------------------------------------------------------------------------------


def _sft_overrides(root, model_dir: str, name: str, *extra: str) -> list[str]:
    return [
        f"data.train_files={root / 'train.parquet'}",
        "data.train_batch_size=8",
        "data.max_length=256",
        "data.max_token_len_per_gpu=256",
        "data.use_dynamic_bsz=True",
        f"model.path={model_dir}",
        "model.use_remove_padding=False",
        "+model.override_config.attn_implementation=sdpa",
        "engine.strategy=verl_balance",
        "engine._target_=verl_balance.integrations.verl.engine.VerlBalanceEngineConfig",
        "engine.use_torch_compile=False",
        "+engine.mixed_precision.param_dtype=fp32",
        "optim.lr=1e-3",
        "trainer.device=cpu",
        "trainer.logger=[console]",
        "trainer.total_epochs=1",
        f"trainer.default_local_dir={root / name}",
        "trainer.save_freq=1",
        "trainer.test_freq=-1",
        "trainer.resume_mode=auto",
        *extra,
    ]


def _sft_steps(console: str) -> dict[int, tuple[float, float]]:
    """{step: (train/loss, train/grad_norm)} from verl's console logger (printed at full precision)."""
    pattern = r"step:(\d+) - .*?train/loss:([0-9.eE+-]+) - .*?train/grad_norm:([0-9.eE+-]+)"
    return {int(s): (float(loss), float(norm)) for s, loss, norm in re.findall(pattern, console)}


@pytest.fixture(scope="module")
def sft_runs(tmp_path_factory, model_dir):
    """Uninterrupted 3 steps; 1 step (saved, 2 loader workers); the same command again to 3 steps (0
    workers); that checkpoint directory with a payload planted in the newest ``data_1.pt``, run again."""
    import torch

    from tests._chat import write_chat_parquet

    root = tmp_path_factory.mktemp("verl_sft_resume")
    write_chat_parquet(root / "train.parquet", rows=32)  # 4 steps an epoch
    workers = ("data.num_workers=0",)

    def run(name: str, *extra: str) -> str:
        return run_verl_sft(_sft_overrides(root, model_dir, name, *extra), nproc=2, cwd=str(root))

    out = {"uninterrupted": _sft_steps(run("full", f"trainer.total_training_steps={STEPS}", *workers))}
    out["stopped"] = _sft_steps(run("resumed", "trainer.total_training_steps=1", "data.num_workers=2"))
    out["resumed"] = _sft_steps(run("resumed", f"trainer.total_training_steps={STEPS}", *workers))
    shutil.copytree(root / "resumed", root / "planted")
    marker = root / "payload_ran"
    planted = root / "planted" / f"global_step_{STEPS}" / "data_1.pt"
    torch.save({"_num_yielded": 1, "x": PlantedPayload(str(marker))}, planted)
    try:
        run("planted", f"trainer.total_training_steps={STEPS + 1}", *workers)
        out["planted"] = "the run went on"
    except Exception as err:  # the rank's error, as run_on_ranks reports it
        out["planted"] = str(err)
    out["payload_ran"] = marker.exists()
    return out


@pytest.mark.slow
def test_verls_sft_trainer_resumed_after_a_save_logs_the_uninterrupted_steps_and_losses(sft_runs):
    full, stopped, resumed = sft_runs["uninterrupted"], sft_runs["stopped"], sft_runs["resumed"]
    assert sorted(full) == [1, 2, 3] and sorted(stopped) == [1] and sorted(resumed) == [2, 3]
    assert stopped[1] == pytest.approx(full[1], rel=1e-6)
    for step in (2, 3):
        assert resumed[step] == pytest.approx(full[step], rel=1e-6), (step, resumed, full)
    assert full[2] != pytest.approx(full[1], rel=1e-3)  # the steps differ: equality above is not vacuous


@pytest.mark.slow
def test_a_payload_planted_in_the_sft_loader_state_is_refused_by_the_engine_before_it_runs(sft_runs):
    assert "data_1.pt" in sft_runs["planted"] and "weights_only=False" in sft_runs["planted"], sft_runs["planted"]
    assert not sft_runs["payload_ran"]


# ---------------------------------------------------------------------------------------------
# verl.trainer.main_ppo, legacy RayPPOTrainer and v1 PPOTrainer (subprocesses on the session's Ray cluster)
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ppo_workspace(tmp_path_factory, ray_head):
    from verl_balance.models.tiny_hf import write_tiny_model

    root = tmp_path_factory.mktemp("verl_main_ppo_resume")
    model_dir = str(root / "tiny_qwen2")
    write_tiny_model(model_dir, family="qwen2")
    add_stop_tokens(model_dir)
    data = str(root / "train.parquet")
    write_gsm8k_like_parquet(data, num_prompts=8)
    return {"root": str(root), "model_dir": model_dir, "data": data, "ray_address": ray_head}


def _ppo_trio(workspace: dict, name: str, trainer: tuple[str, ...]) -> dict:
    """{"uninterrupted", "stopped", "resumed"}: {step: metrics} of the three main_ppo runs."""

    def run(run_name: str, *extra: str) -> dict:
        overrides = (*trainer, *RESUME, *extra)
        return run_main_ppo(
            workspace, strategy="verl_balance", name=run_name, extra_modules=AUTOPATCH, extra_overrides=overrides
        )["steps"]

    return {
        "uninterrupted": run(f"{name}_full", f"trainer.total_training_steps={STEPS}"),
        "stopped": run(f"{name}_resumed", *STOP_AFTER_SAVE, "data.dataloader_num_workers=2"),
        "resumed": run(f"{name}_resumed", f"trainer.total_training_steps={STEPS}"),
    }


@pytest.fixture(scope="module")
def legacy_runs(ppo_workspace):
    return _ppo_trio(ppo_workspace, "legacy", ())


@pytest.fixture(scope="module")
def v1_runs(ppo_workspace):
    pytest.importorskip("transfer_queue", reason="verl's v1 trainer needs TransferQueue (in the verl extra)")
    return _ppo_trio(ppo_workspace, "v1", V1)


def _assert_resumed_equals_uninterrupted(runs: dict) -> None:
    full, stopped, resumed = runs["uninterrupted"], runs["stopped"], runs["resumed"]
    assert sorted(full) == [1, 2, 3] and sorted(stopped) == [1] and sorted(resumed) == [2, 3], runs
    for step, metrics in [(1, stopped[1]), (2, resumed[2]), (3, resumed[3])]:
        for key in PPO_KEYS:
            assert metrics[key] == pytest.approx(full[step][key], rel=1e-5, abs=PPO_ABS.get(key, 1e-7)), (step, key)
    # Not vacuous: step 2 trains other prompts (other scores) than step 1, and the policy moved.
    assert full[2]["critic/score/mean"] != pytest.approx(full[1]["critic/score/mean"], rel=1e-3)
    assert full[2]["actor/grad_norm"] != pytest.approx(full[1]["actor/grad_norm"], rel=1e-3)


@pytest.mark.slow
def test_main_ppo_legacy_trainer_resumed_after_a_save_logs_the_uninterrupted_steps_and_losses(legacy_runs):
    _assert_resumed_equals_uninterrupted(legacy_runs)


@pytest.mark.slow
def test_main_ppo_v1_trainer_resumed_after_a_save_logs_the_uninterrupted_steps_and_losses(v1_runs):
    _assert_resumed_equals_uninterrupted(v1_runs)
