"""PPO with a critic in our own trainer (``main_grpo algorithm.adv_estimator=gae``).

Config checks (no Ray): the critic keys only with gae, null critic keys taking the actor's values,
the critic's engine config built from its own keys. Short runs on CPU workers: the critic's
metrics are logged and finite, the actor waits for trainer.critic_warmup, the critic is in the
checkpoint (under critic/, in the checksum manifest), and a run stopped by Ctrl-C and resumed
gives the uninterrupted run's next-step metrics (actor and critic). The explained variance is
checked against verl's own formula on the logged values.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from tests.trainer.conftest import compose_config, run_trainer
from verl_balance.trainer.config import ConfigError
from verl_balance.trainer.config.grpo import register_grpo_schema, validate_grpo

register_grpo_schema()


def _config(overrides):
    register_grpo_schema()
    return compose_config("grpo", overrides)


# ---------------------------------------------------------------------- config (no Ray)
@pytest.mark.parametrize(
    "overrides, keys",
    [
        (["critic.optim.lr=1e-3"], ["critic.optim"]),
        (["critic.cliprange_value=0.2", "critic.ppo_epochs=2"], ["critic.ppo_epochs", "critic.cliprange_value"]),
        (["trainer.critic_warmup=3"], ["trainer.critic_warmup"]),
    ],
)
def test_critic_keys_without_gae_fail_naming_them(overrides, keys):
    with pytest.raises(ConfigError) as err:
        validate_grpo(_config(overrides))
    for key in keys + ["algorithm.adv_estimator=gae"]:
        assert key in str(err.value)


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["critic.ppo_mini_batch_size=3"], "critic.ppo_mini_batch_size"),
        (["critic.cliprange_value=0"], "critic.cliprange_value"),
        (["critic.loss_agg_mode=seq-mean-token-sum-norm"], "critic.loss_scale_factor"),
        (["critic.optim.lr_scheduler=linear"], "critic.optim.lr_scheduler"),
        (["critic.use_dynamic_bsz=true", "critic.ppo_max_token_len_per_gpu=32"], "critic.ppo_max_token_len_per_gpu"),
        (["algorithm.gamma=1.5"], "algorithm.gamma"),
        (["trainer.critic_warmup=-1"], "trainer.critic_warmup"),
        (["critic.model.path=/nonexistent"], "critic.model.path"),
    ],
)
def test_invalid_critic_values_fail_naming_the_key(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        validate_grpo(_config(["algorithm.adv_estimator=gae", *overrides]))


def test_null_critic_keys_take_the_actors_values():
    config = validate_grpo(
        _config(
            [
                "algorithm.adv_estimator=gae",
                "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                "actor_rollout_ref.actor.ppo_epochs=2",
                "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean",
                "critic.ppo_micro_batch_size_per_gpu=2",
            ]
        )
    )
    c = config.critic
    assert (c.ppo_mini_batch_size, c.ppo_epochs, c.loss_agg_mode) == (4, 2, "seq-mean-token-mean")
    assert c.ppo_micro_batch_size_per_gpu == 2  # set: its own
    assert config.critic_updates_per_step == 2 * (16 // 4)
    engine = config.critic_engine_config(total_steps=5)
    assert engine.model_type == "value_model" and engine.loss_agg_mode == "seq-mean-token-mean"
    assert engine.optim.lr == 1e-5  # verl's critic default, not the recipe's actor lr
    assert engine.total_steps == 5 * config.critic_updates_per_step
    assert config.engine_config(total_steps=5).model_type == "language_model"


def test_hf_critic_with_a_builtin_actor_fails_naming_both_keys(tiny_qwen2):
    with pytest.raises(ConfigError, match="actor_rollout_ref.model.path"):
        validate_grpo(_config(["algorithm.adv_estimator=gae", f"critic.model.path={tiny_qwen2}"]))


def test_gae_accepts_one_response_per_prompt():
    """PPO with a critic needs no group (n=1 is verl's usual PPO setting); GRPO still refuses it."""
    validate_grpo(_config(["algorithm.adv_estimator=gae", "actor_rollout_ref.rollout.n=1"]))
    with pytest.raises(ConfigError, match="actor_rollout_ref.rollout.n"):
        validate_grpo(_config(["actor_rollout_ref.rollout.n=1"]))


# ---------------------------------------------------------------------- short runs (Ray)
def _train_ppo(overrides: list[str], *, stop_after: int | None = None) -> list[dict]:
    """Run the recipe (``run_trainer``: ``stop_after=k`` sends a Ctrl-C during step k)."""
    from verl_balance.trainer.grpo.trainer import GRPOTrainer

    return run_trainer(GRPOTrainer(_config(overrides)), stop_after=stop_after)


CRITIC_KEYS = (
    "critic/vf_loss",
    "critic/vf_clipfrac",
    "critic/vpred_mean",
    "critic/grad_norm",
    "critic/lr",
    "critic/vf_explained_var",
    "critic/values/mean",
    "critic/returns/mean",
)


@pytest.fixture(scope="module")
def ppo_runs(ray_cluster, tmp_path_factory):
    """A 3-step PPO run straight through, and the same run stopped by Ctrl-C after step 2 and resumed:
    each run's training-step records, and under "raw" every record (step 0: val_before_train)."""
    root = tmp_path_factory.mktemp("ppo")
    base = [
        "algorithm.adv_estimator=gae",
        "algorithm.gamma=0.99",
        "algorithm.lam=0.95",
        "trainer.device=cpu",
        "trainer.n_gpus_per_node=2",
        "trainer.logger=[jsonl]",
        "trainer.plot=false",
        "trainer.total_training_steps=3",
        "trainer.save_freq=1",
        "trainer.test_freq=-1",
        "trainer.critic_warmup=1",
        "data.synthetic.num_train=64",
        "data.synthetic.num_val=4",
        f"data.synthetic.out_dir={root / 'data'}",
        "data.synthetic.tasks=[copy]",
        "data.synthetic.max_size=6",
        "data.max_prompt_length=32",
        "data.train_batch_size=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.rollout.response_length=6",
        "actor_rollout_ref.actor.optim.lr=1e-2",
        "critic.optim.lr=1e-2",
        "critic.ppo_epochs=2",
        "critic.use_dynamic_bsz=true",
        "critic.ppo_max_token_len_per_gpu=128",
    ]
    straight = _train_ppo(base + [f"trainer.default_local_dir={root / 'straight'}", "trainer.resume_mode=disable"])
    resumed_dir = root / "resumed"
    first = _train_ppo(base + [f"trainer.default_local_dir={resumed_dir}", "trainer.resume_mode=auto"], stop_after=2)
    resumed = _train_ppo(base + [f"trainer.default_local_dir={resumed_dir}", "trainer.resume_mode=auto"])
    raw = {"straight": straight, "first": first, "resumed": resumed}
    steps = {name: [r for r in records if r["step"] >= 1] for name, records in raw.items()}
    return {"root": root, **steps, "raw": raw}


@pytest.mark.slow
def test_ppo_run_logs_finite_critic_metrics_and_waits_for_the_critic(ppo_runs):
    steps = ppo_runs["straight"]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for record in steps:
        for key in CRITIC_KEYS:
            assert key in record and np.isfinite(record[key]), (record["step"], key)
        # 2 epochs x (4 prompts / mini-batches of 2)
        assert record["critic/num_optimizer_steps"] == 4
    # trainer.critic_warmup=1: step 1 trains the critic only.
    assert "actor/pg_loss" not in steps[0]
    assert all(np.isfinite(r["actor/pg_loss"]) for r in steps[1:])
    # The critic learns: its loss moves between steps (a critic that never updates would not).
    assert len({round(r["critic/vf_loss"], 6) for r in steps}) == 3


@pytest.mark.slow
def test_val_before_train_validates_the_initial_policy_at_step_0_although_test_freq_is_off(ppo_runs):
    # verl's fit: trainer.val_before_train (default true) validates before the first step whatever
    # trainer.test_freq says; test_freq=-1 here, so no later step validates.
    straight = ppo_runs["raw"]["straight"]
    validated = [r["step"] for r in straight if any(key.startswith("val/") for key in r)]
    assert validated == [0]
    assert np.isfinite(straight[0]["val/reward_mean"]) and "actor/pg_loss" not in straight[0]
    # A resumed run does not validate again (verl does, at the resumed step): one step-0 record.
    assert [r["step"] for r in ppo_runs["raw"]["resumed"]] == [0, 1, 2, 3]


@pytest.mark.slow
def test_checkpoint_holds_the_critic_in_its_manifest(ppo_runs):
    ckpt = ppo_runs["root"] / "straight" / "global_step_3"
    assert (ckpt / "critic").is_dir()
    with open(ckpt / "checkpoint_complete.json") as f:
        manifest = json.load(f)["files"]
    critic_files = [name for name in manifest if name.startswith("critic/")]
    actor_files = [name for name in manifest if not name.startswith("critic/")]
    assert critic_files and actor_files
    on_disk = {
        os.path.relpath(os.path.join(d, n), ckpt / "critic") for d, _, names in os.walk(ckpt / "critic") for n in names
    }
    assert {name.removeprefix("critic/") for name in critic_files} == on_disk


@pytest.mark.slow
def test_ppo_resume_after_ctrl_c_continues_actor_and_critic_exactly(ppo_runs):
    straight, first, resumed = ppo_runs["straight"], ppo_runs["first"], ppo_runs["resumed"]
    assert [r["step"] for r in first] == [1, 2], "Ctrl-C must stop after the current step"
    assert [r["step"] for r in resumed] == [1, 2, 3]
    for key in ("critic/score/mean", "actor/pg_loss", "actor/grad_norm", *CRITIC_KEYS):
        np.testing.assert_allclose(resumed[2][key], straight[2][key], rtol=1e-6, err_msg=key)
    # Negative control: step 3 is not step 2 again (the state moved and the resume continued it).
    assert straight[2]["critic/vf_loss"] != pytest.approx(straight[1]["critic/vf_loss"], rel=1e-6)


def test_explained_variance_is_verls_formula():
    """value_metrics against verl's compute_data_metrics expression, written out here."""
    from verl_balance.protocol import Batch
    from verl_balance.trainer.grpo.trainer import value_metrics

    gen = torch.Generator().manual_seed(0)
    mask = (torch.rand(4, 7, generator=gen) < 0.7).float()
    values, returns = torch.randn(4, 7, generator=gen), torch.randn(4, 7, generator=gen)
    batch = Batch.from_dict(tensors={"loss_mask": mask, "values": values, "returns": returns})
    out = value_metrics(batch)
    v, r = torch.masked_select(values, mask.bool()), torch.masked_select(returns, mask.bool())
    expected = 1.0 - torch.var(r - v) / (torch.var(r) + 1e-5)
    assert out["critic/vf_explained_var"] == pytest.approx(float(expected), rel=1e-5)
    assert out["critic/values/mean"] == pytest.approx(float(v.mean()), rel=1e-5)
    assert out["critic/returns/mean"] == pytest.approx(float(r.mean()), rel=1e-5)


class _RecordingGroup:
    """Stands in for a worker group: records the warm-start loads it is asked for."""

    def __init__(self):
        self.loads = []

    def load_model_weights(self, path):
        self.loads.append(("model", path))

    def load_backbone_weights(self, path):
        self.loads.append(("backbone", path))
        return [False, False]


@pytest.mark.parametrize(
    "critic_path, lora_checkpoint, critic_loads",
    [(None, False, ["backbone"]), ("HF_DIR", False, []), (None, True, [])],
    ids=["actors-model", "own-model-dir", "lora-adapters-only"],
)
def test_critic_follows_the_actors_warm_start_unless_it_has_its_own_model(
    monkeypatch, tmp_path, critic_path, lora_checkpoint, critic_loads
):
    """verl's critic.model.path defaults to the actor's: the critic starts from the actor's warm-start
    weights; a critic with its own model directory keeps that directory's weights, and a LoRA
    warm start (adapters only) leaves the critic on the base both share."""
    from types import SimpleNamespace

    from verl_balance.engine.lora import BASE_FINGERPRINT_FILE
    from verl_balance.trainer import checkpoint
    from verl_balance.trainer.grpo.critic_role import CriticRole
    from verl_balance.trainer.grpo.trainer import GRPOTrainer

    ckpt = str(tmp_path / "global_step_4")
    os.makedirs(ckpt)
    if lora_checkpoint:
        with open(os.path.join(ckpt, BASE_FINGERPRINT_FILE), "w") as f:
            json.dump({"seed": 0}, f)
    monkeypatch.setattr(checkpoint, "verify_checkpoint", lambda path, hasher, allow_unverified: None)
    monkeypatch.setattr(checkpoint, "group_hasher", lambda group: None)
    trainer = GRPOTrainer.__new__(GRPOTrainer)
    trainer.config = SimpleNamespace(
        actor_rollout_ref=SimpleNamespace(
            model=SimpleNamespace(warm_start_path=ckpt), actor=SimpleNamespace(use_kl_loss=False)
        ),
        critic=SimpleNamespace(model=SimpleNamespace(path=critic_path)),
        trainer=SimpleNamespace(allow_unverified_checkpoint=False),
        use_reference_policy=False,
    )
    trainer.actor = _RecordingGroup()
    trainer.critic = CriticRole(config=trainer.config.critic, start=_RecordingGroup, plan=None)
    trainer.prepare_workers()
    assert trainer.actor.loads == [("model", os.path.abspath(ckpt))]
    assert trainer.critic.group.loads == [(kind, os.path.abspath(ckpt)) for kind in critic_loads]
