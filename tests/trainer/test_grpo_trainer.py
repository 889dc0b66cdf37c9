"""The GRPO driver: balance_batch plumbing (no Ray), config errors, and short runs on CPU workers.

References are independent of the code under test: group placement is read back from the plan's
rank indices and checked against the group labels; merged outputs are compared with the same
per-row function applied to the batch in its original order; learning is judged against the
expected reward of a uniformly random policy (computed here from the tokenizer, not from the
model); the warm start is judged by greedy validation, which is a deterministic function of the
weights.
"""

from __future__ import annotations

import textwrap

import numpy as np
import pytest
import torch

from tests.trainer.conftest import compose_config, run_cli_in_process
from verl_balance.balance import FlopsWorkload
from verl_balance.models.config import ModelConfig
from verl_balance.protocol import Batch
from verl_balance.rollout import RolloutOutput
from verl_balance.trainer.config import ConfigError
from verl_balance.trainer.config.grpo import register_grpo_schema, validate_grpo
from verl_balance.trainer.grpo.trainer import merge_rollout_outputs
from verl_balance.trainer.plan_dispatch import plan_batch, run_by_plan, split_by_plan
from verl_balance.utils.tracking import read_metrics

register_grpo_schema()


def _grpo_config(overrides):
    register_grpo_schema()
    return compose_config("grpo", overrides)


# ---------------------------------------------------------------------- balance_batch plumbing
def _rollout_like_batch(*, num_prompts: int, n: int, seed: int) -> Batch:
    """Prompt-major rows with lengths spread over an order of magnitude; groups = prompt index."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(3, 60, size=num_prompts * n)
    width = int(lengths.max())
    ids = torch.from_numpy(rng.integers(0, 200, size=(len(lengths), width)))
    mask = (torch.arange(width)[None, :] < torch.from_numpy(lengths)[:, None]).long()
    return Batch.from_dict(
        tensors={"input_ids": ids * mask, "attention_mask": mask, "loss_mask": mask},
        non_tensors={"prompt_index": np.repeat(np.arange(num_prompts), n)},
    )


def _row_signature(batch: Batch) -> torch.Tensor:
    """A per-row value that identifies the row (what a worker would compute for it)."""
    weights = torch.arange(1, batch["input_ids"].shape[1] + 1, dtype=torch.float64)
    return (batch["input_ids"].double() * weights).sum(1) + 1000.0 * batch["attention_mask"].sum(1)


def _fake_worker_group_call(chunks: list[Batch]) -> Batch:
    """What mesh dispatch + collect does: per-rank outputs in rank order, concatenated."""
    for chunk in chunks:
        assert sum(chunk.meta["micro_batch_sizes"]) == len(chunk)
    return Batch.concat([Batch.from_dict(tensors={"signature": _row_signature(c)}) for c in chunks])


@pytest.mark.parametrize("dp", [2, 3])
@pytest.mark.parametrize("micro, balance", [("fixed", True), ("cap", True), ("cap", False)])
def test_balance_batch_keeps_groups_on_one_rank_and_restores_row_order(dp, micro, balance):
    workload = FlopsWorkload.from_model_config(ModelConfig.preset("tiny"))
    for seed in range(4):
        batch = _rollout_like_batch(num_prompts=7, n=4, seed=seed)
        # A cap smaller than a whole group: group_scope="rank" must still keep the group on one rank.
        plan = plan_batch(
            batch,
            group_ids=batch["prompt_index"],
            group_scope="rank",
            dp_size=dp,
            sp_size=1,
            micro_batch_size=3 if micro == "fixed" else None,
            token_cap=80 if micro == "cap" else None,
            balance=balance,
            workload=workload,
        )
        groups = np.asarray(batch["prompt_index"])
        ranks_of_group = {}
        for r in range(dp):
            for g in set(groups[plan.rank_indices(r)].tolist()):
                ranks_of_group.setdefault(g, set()).add(r)
        assert sorted(ranks_of_group) == list(range(7))
        assert all(len(ranks) == 1 for ranks in ranks_of_group.values()), ranks_of_group
        merged = run_by_plan(batch, plan, _fake_worker_group_call)
        torch.testing.assert_close(merged["signature"], _row_signature(batch), rtol=0, atol=0)


def test_without_merge_the_balanced_outputs_are_out_of_order():
    """Negative control for the test above: the plan really permutes rows."""
    batch = _rollout_like_batch(num_prompts=7, n=4, seed=0)
    plan = plan_batch(
        batch,
        group_ids=batch["prompt_index"],
        group_scope="rank",
        dp_size=2,
        sp_size=1,
        micro_batch_size=None,
        token_cap=80,
        balance=True,
        workload=None,
    )
    unmerged = _fake_worker_group_call(split_by_plan(batch, plan))
    assert not torch.equal(unmerged["signature"], _row_signature(batch))


def test_merged_rollout_outputs_answer_the_right_prompts():
    def output(prompts, widths):
        n = len(widths) // prompts
        lengths = torch.tensor(widths)
        width = int(lengths.max())
        responses = torch.stack(
            [torch.cat([torch.full((w,), 10 + i), torch.full((width - w,), 0)]) for i, w in enumerate(widths)]
        )
        return RolloutOutput(
            prompt_index=np.repeat(np.arange(prompts), n),
            responses=responses,
            response_mask=(responses != 0).long(),
            response_lengths=lengths,
            finish_reasons=np.array(["stop"] * len(widths), dtype=object),
            log_probs=-(responses != 0).float(),
        )

    merged = merge_rollout_outputs(
        [output(2, [1, 3, 2, 2]), None, output(1, [5, 4])], prompt_offsets=[0, 2, 2], pad_token_id=0
    )
    assert merged.prompt_index.tolist() == [0, 0, 1, 1, 2, 2]
    assert merged.responses.shape == (6, 5)
    assert merged.response_token_lists() == [[10], [11] * 3, [12] * 2, [13] * 2, [10] * 5, [11] * 4]
    assert torch.equal(merged.response_mask.sum(1), merged.response_lengths)
    assert torch.equal(-merged.log_probs.sum(1), merged.response_lengths.float())


# ---------------------------------------------------------------------- config errors
@pytest.mark.parametrize(
    "overrides, key",
    [
        (["actor_rollout_ref.actor.loss_agg_mode=mean"], "actor_rollout_ref.actor.loss_agg_mode"),
        (["algorithm.adv_estimator=ppo"], "algorithm.adv_estimator"),
        (["actor_rollout_ref.rollout.n=1"], "actor_rollout_ref.rollout.n"),
        (["actor_rollout_ref.actor.ppo_mini_batch_size=5"], "actor_rollout_ref.actor.ppo_mini_batch_size"),
        (["actor_rollout_ref.actor.ulysses_sequence_parallel_size=3"], "ulysses_sequence_parallel_size"),
        (
            ["actor_rollout_ref.actor.ulysses_sequence_parallel_size=2", "ulysses_sequence_parallel_size=1"],
            "actor_rollout_ref.actor.ulysses_sequence_parallel_size",
        ),
        (
            ["actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=64"],
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu",
        ),
        (["actor_rollout_ref.actor.optim.lr_scheduler=linear"], "actor_rollout_ref.actor.optim.lr_scheduler"),
        (
            ["actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.kl_loss_type=k9"],
            "actor_rollout_ref.actor.kl_loss_type",
        ),
        (
            ["actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum-norm"],
            "actor_rollout_ref.actor.loss_scale_factor",
        ),
        (["balance.overlong=skip"], "balance.overlong"),
        (["actor_rollout_ref.actor.recompute_old_log_prob=never"], "actor_rollout_ref.actor.recompute_old_log_prob"),
        (["data.synthetic.tasks=[mul]"], "data.synthetic.tasks"),
        (["actor_rollout_ref.model.use_remove_padding=false"], "actor_rollout_ref.model.use_remove_padding"),
        (["trainer.resume_mode=resume_path"], "trainer.resume_from_path"),
    ],
)
def test_invalid_values_fail_naming_the_key(overrides, key):
    cfg = _grpo_config(overrides)
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        validate_grpo(cfg)


def test_default_recipe_config_is_valid():
    validate_grpo(_grpo_config([]))


def test_unknown_key_fails_at_startup_naming_it(monkeypatch, capsys):
    code, stderr = run_cli_in_process(
        "verl_balance.main_grpo",
        ["actor_rollout_ref.actor.ppo_mini_batch_sise=4"],
        monkeypatch=monkeypatch,
        capsys=capsys,
    )
    assert code != 0
    assert "ppo_mini_batch_sise" in stderr


# ---------------------------------------------------------------------- short runs (Ray)
LETTER_REWARD = textwrap.dedent('''
    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        """Fraction of the response's characters that are lowercase ASCII letters."""
        letters = sum("a" <= c <= "z" for c in solution_str)
        return {"score": letters / max(len(solution_str), 1), "acc": float(solution_str.strip() == ground_truth)}
''')


def _run_grpo(overrides) -> tuple[list[dict], dict]:
    from verl_balance.trainer.grpo.trainer import GRPOTrainer

    trainer = GRPOTrainer(_grpo_config(overrides))
    try:
        summary = trainer.fit()
    finally:
        trainer.close()
    return read_metrics(summary["metrics"]), summary


@pytest.mark.parametrize(
    "test_freq, val_before_train, validates", [(-1, True, True), (0, True, True), (5, True, True), (5, False, False)]
)
def test_val_before_train_alone_decides_the_step_0_validation(test_freq, val_before_train, validates):
    # verl's fit: `if trainer.val_before_train: validate()`, test_freq not consulted (the run with
    # test_freq=-1 is observed in tests/trainer/test_ppo_critic.py). The last case is the negative control.
    from types import SimpleNamespace

    from verl_balance.trainer.grpo.trainer import GRPOTrainer

    overrides = [f"trainer.test_freq={test_freq}", f"trainer.val_before_train={val_before_train}"]
    driver = SimpleNamespace(config=validate_grpo(_grpo_config(overrides)), evaluate=lambda: {"val/acc": 0.5})
    logged = []
    tracker = SimpleNamespace(log=lambda metrics, *, step: logged.append((step, metrics)))
    metrics = GRPOTrainer.before_training(driver, tracker)
    assert (metrics, logged) == (({"val/acc": 0.5}, [(0, {"val/acc": 0.5})]) if validates else ({}, []))


@pytest.fixture(scope="module")
def grpo_run(ray_cluster, tmp_path_factory):
    """One short GRPO run from random weights on a reward a uniform policy scores ~0.1 on."""
    root = tmp_path_factory.mktemp("grpo")
    reward_file = root / "letters.py"
    reward_file.write_text(LETTER_REWARD)
    base = [
        "trainer.device=cpu",
        "trainer.n_gpus_per_node=2",
        "trainer.logger=[jsonl]",
        "trainer.plot=false",
        "trainer.resume_mode=disable",
        "data.synthetic.num_train=256",
        "data.synthetic.num_val=8",
        f"data.synthetic.out_dir={root / 'data'}",
        "data.synthetic.tasks=[copy]",
        "data.synthetic.max_size=6",
        "data.max_prompt_length=32",
        "data.train_batch_size=8",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.rollout.n=8",
        "actor_rollout_ref.rollout.response_length=8",
        f"custom_reward_function.path={reward_file}",
    ]
    records, summary = _run_grpo(
        base
        + [
            f"trainer.default_local_dir={root / 'run'}",
            "trainer.total_training_steps=10",
            "trainer.test_freq=10",
            "trainer.save_freq=10",
            "actor_rollout_ref.actor.optim.lr=1e-2",
            "actor_rollout_ref.actor.use_dynamic_bsz=true",
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=128",
            "actor_rollout_ref.actor.use_kl_loss=true",
            "actor_rollout_ref.actor.kl_loss_coef=0.01",
        ]
    )
    return {"root": root, "base": base, "records": records, "summary": summary}


@pytest.mark.slow
def test_short_grpo_run_raises_reward_beyond_a_random_policy(grpo_run):
    train = [r for r in grpo_run["records"] if r["step"] >= 1]
    rewards = [r["critic/score/mean"] for r in train]
    assert len(rewards) == 10
    # A uniform policy over the byte tokenizer's 260 ids emits a lowercase letter with p = 26/260;
    # with 64 responses per step its mean reward stays far below 0.3.
    assert np.mean(rewards[-3:]) > 0.3, rewards
    assert np.mean(rewards[-3:]) > rewards[0] + 0.15, rewards


@pytest.mark.slow
def test_step_metrics_are_logged_under_their_names(grpo_run):
    step = grpo_run["records"][1]
    for key in (
        "critic/score/mean",
        "reward/std",
        "reward/accuracy",
        "response_length/mean",
        "response_length/max",
        "actor/pg_loss",
        "actor/pg_clipfrac",
        "actor/ppo_kl",
        "actor/kl_loss",
        "actor/entropy",
        "actor/grad_norm",
        "balance/imbalance_predicted",
        "balance/imbalance_measured",
        "timing_s/gen",
        "timing_s/old_log_prob",
        "timing_s/ref",
        "timing_s/update_actor",
        "timing_s/step",
    ):
        assert key in step and np.isfinite(step[key]), key
    assert step["actor/num_optimizer_steps"] == 2  # 8 prompts / mini-batches of 4, one epoch
    # Two mini-batches: the second update is off-policy, so the old-log-prob pass must run.
    assert step["train/old_log_prob_pass"] == 1.0
    assert "training/rollout_probs_diff_mean" in step and "training/rollout_probs_diff_max" in step
    assert "val/acc" in grpo_run["records"][0] and "val/acc" in grpo_run["records"][-1]


@pytest.mark.slow
def test_warm_start_loads_the_checkpoint_weights(grpo_run):
    """model.warm_start_path = a global_step_N engine checkpoint (the SFT trainer writes the same format).

    Greedy validation is a function of the weights only, so the warm-started run's step-0
    validation must reproduce the saved run's last validation, and differ from a cold start's.
    """
    root, records = grpo_run["root"], grpo_run["records"]
    warm, _ = _run_grpo(
        grpo_run["base"]
        + [
            f"trainer.default_local_dir={root / 'warm'}",
            "trainer.total_training_steps=1",
            "trainer.test_freq=1",
            f"actor_rollout_ref.model.warm_start_path={root / 'run' / 'global_step_10'}",
        ]
    )
    keys = ("val/reward_mean", "val/response_length/mean")
    saved_final = {k: records[-1][k] for k in keys}
    cold_initial = {k: records[0][k] for k in keys}
    warm_initial = {k: warm[0][k] for k in keys}
    assert warm_initial == pytest.approx(saved_final, abs=1e-9)
    assert warm_initial != pytest.approx(cold_initial, abs=1e-3)
