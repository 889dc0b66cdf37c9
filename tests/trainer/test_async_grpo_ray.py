"""``trainer.v1.trainer_mode=separate_async`` end to end: one-step off-policy against a hand-built
reference, and the same samples and losses on 1 and 2 rollout workers.

Reference (``_reference_run``, one process, no trainer code): a fresh actor worker (same config
and seed, so the same initial weights) and a plain KV-cache rollout; for k = 0, 1, 2 the rollout
takes the weights of version max(k - 1, 0), samples batch k's prompts with the step's seeds, the
GRPO advantages come from the recorded scores, and the actor takes its PPO updates with the
rollout's own log-probs as the old log-probs. Its samples, log-probs and losses must equal the
async run's (rtol 1e-6), and its final weights the async actor's.
"""

from __future__ import annotations

import functools
import textwrap

import numpy as np
import pytest
import torch

from tests.trainer.conftest import compose_config

pytestmark = pytest.mark.slow  # Ray worker groups and a reference process

STEPS = 3
LETTER_REWARD = textwrap.dedent('''
    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        """Fraction of the response's characters that are lowercase ASCII letters."""
        return sum("a" <= c <= "z" for c in solution_str) / max(len(solution_str), 1)
''')


def _overrides(root, *, rollout_workers: int, name: str) -> list[str]:
    return [
        "trainer.device=cpu",
        "trainer.n_gpus_per_node=1",
        "trainer.logger=[jsonl]",
        "trainer.plot=false",
        "trainer.resume_mode=disable",
        "trainer.save_freq=-1",
        "trainer.test_freq=0",
        f"trainer.total_training_steps={STEPS}",
        f"trainer.default_local_dir={root / name}",
        "data.synthetic.num_train=32",
        "data.synthetic.num_val=4",
        f"data.synthetic.out_dir={root / 'data'}",
        "data.synthetic.tasks=[copy]",
        "data.synthetic.max_size=6",
        "data.max_prompt_length=32",
        "data.train_batch_size=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.optim.lr=1e-2",
        "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.rollout.response_length=8",
        f"custom_reward_function.path={root / 'letters.py'}",
        "trainer.v1.trainer_mode=separate_async",
        "trainer.v1.separate_async.parameter_sync_step=2",
        "actor_rollout_ref.rollout.nnodes=1",
        f"actor_rollout_ref.rollout.n_gpus_per_node={rollout_workers}",
    ]


def _async_run(root, *, rollout_workers: int) -> dict:
    """Train STEPS steps; record every step's prompts, rollout batch, scores and metrics."""
    from verl_balance.trainer.async_pipeline import AsyncGRPOTrainer
    from verl_balance.trainer.grpo_config import register_grpo_schema
    from verl_balance.utils.tracking import read_metrics

    register_grpo_schema()
    trainer = AsyncGRPOTrainer(
        compose_config("grpo", _overrides(root, rollout_workers=rollout_workers, name=f"r{rollout_workers}"))
    )
    record: dict = {"prompts": [], "batches": [], "scores": []}
    collect, score = trainer._collect, trainer.score

    def recording_collect(flight, metrics):
        record["prompts"].append(flight.prompts[1])
        batch = collect(flight, metrics)
        record["batches"].append(batch)
        return batch

    def recording_score(batch):
        out = score(batch)
        record["scores"].append(out[0])
        return out

    trainer._collect, trainer.score = recording_collect, recording_score
    try:
        summary = trainer.fit()
        record["actor_weights"] = trainer.actor.weight_buckets()[0]
        names = [n for bucket in record["actor_weights"]["buckets"] for n in bucket]
        record["final_state"] = trainer.actor.export_weight_bucket(names)[0]
        record["rollout_checksums"] = trainer.rollout_group.weights_checksum()
        record["worker_config"] = trainer._worker_config()
        record["workload"] = trainer.workload
        record["config"] = trainer.config
    finally:
        trainer.close()
    record["metrics"] = [r for r in read_metrics(summary["metrics"]) if r["step"] >= 1]
    return record


@pytest.fixture(scope="module")
def async_runs(ray_cluster, tmp_path_factory):
    root = tmp_path_factory.mktemp("async_grpo")
    (root / "letters.py").write_text(LETTER_REWARD)
    return {workers: _async_run(root, rollout_workers=workers) for workers in (1, 2)}


def _reference_run(rank: int, *, record: dict) -> dict:
    """The one-step off-policy schedule by hand (see the module docstring); rank 0 of a world of 1."""
    from verl_balance.algorithms import compute_advantages
    from verl_balance.batch_keys import (
        ADVANTAGES_KEY,
        INDEX_KEY,
        LOSS_MASK_KEY,
        OLD_LOG_PROBS_KEY,
        ON_POLICY_KEY,
        PROMPT_IDS_KEY,
        PROMPT_INDEX_KEY,
        ROLLOUT_LOG_PROBS_KEY,
        TEMPERATURE_KEY,
    )
    from verl_balance.rollout import build_rollout, build_rollout_batch
    from verl_balance.trainer.plan_dispatch import plan_batch, split_by_plan
    from verl_balance.workers.actor_rollout import ActorRolloutWorker, sampling_seed

    config, worker_config = record["config"], record["worker_config"]
    r, actor_cfg = config.actor_rollout_ref.rollout, config.actor_rollout_ref.actor
    worker = ActorRolloutWorker(worker_config)
    worker.init_model()
    rollout = build_rollout(worker_config.model, backend="kv_cache", pad_token_id=worker_config.pad_token_id)
    versions = [worker.engine.full_state_dict()]

    def sample(weights: dict, k: int):
        """Batch k's prompts sampled with ``weights`` and step k's seeds (a plain rollout engine)."""
        rollout.update_weights(weights)
        prompts, step_seed = record["prompts"][k], sampling_seed(config.trainer.seed, k)
        output = rollout.generate(
            [list(p) for p in prompts[PROMPT_IDS_KEY]],
            n=r.n,
            temperature=r.temperature,
            top_p=r.top_p,
            max_response_length=r.response_length,
            stop_token_ids=worker_config.stop_token_ids,
            seeds=[sampling_seed(step_seed, int(i)) for i in prompts[INDEX_KEY]],
        )
        return build_rollout_batch(
            prompts=list(prompts[PROMPT_IDS_KEY]), output=output, pad_token_id=worker_config.pad_token_id
        )

    out = {"batches": [], "pg_loss": []}
    for k in range(STEPS):
        batch = sample(versions[max(k - 1, 0)], k)
        out["batches"].append(batch)
        batch[OLD_LOG_PROBS_KEY] = batch[ROLLOUT_LOG_PROBS_KEY].clone()
        batch[ADVANTAGES_KEY] = compute_advantages(
            adv_estimator="grpo",
            scores=torch.from_numpy(record["scores"][k]),
            index=batch[PROMPT_INDEX_KEY],
            loss_mask=batch[LOSS_MASK_KEY],
        ).advantages
        batch = batch.select(batch_keys=[key for key in batch.tensor_keys if key != ROLLOUT_LOG_PROBS_KEY])
        losses = []
        prompt_of_row = np.asarray(batch[PROMPT_INDEX_KEY])
        for m in range(config.data.train_batch_size // actor_cfg.ppo_mini_batch_size):
            mini = batch.index_select(np.flatnonzero(prompt_of_row // actor_cfg.ppo_mini_batch_size == m))
            mini.meta[ON_POLICY_KEY] = False
            mini.meta[TEMPERATURE_KEY] = float(r.temperature)
            plan = plan_batch(
                mini,
                dp_size=1,
                sp_size=1,
                micro_batch_size=actor_cfg.ppo_micro_batch_size_per_gpu,
                token_cap=None,
                balance=True,
                workload=record["workload"],
                group_ids=mini[PROMPT_INDEX_KEY],
                group_scope="rank",
            )
            losses.append(worker.update_actor(split_by_plan(mini, plan)[0])["pg_loss"])
        out["pg_loss"].append(float(np.mean(losses)))
        versions.append(worker.engine.full_state_dict())
    out["final_state"] = versions[-1]
    # the on-policy schedule's batch 2 (weights of version 2, as sync mode would use): the negative control
    out["on_policy_batch_2"] = sample(versions[2], 2)
    return out


@pytest.fixture(scope="module")
def reference(async_runs):
    from verl_balance.testing.multiprocess import run_on_ranks

    run = async_runs[1]
    record = {key: run[key] for key in ("prompts", "scores", "config", "worker_config", "workload")}
    return run_on_ranks(functools.partial(_reference_run, record=record), world=1)[0]


def test_one_step_off_policy_equals_the_hand_built_reference(async_runs, reference):
    from verl_balance.batch_keys import INPUT_IDS_KEY, LOSS_MASK_KEY, ROLLOUT_LOG_PROBS_KEY

    run = async_runs[1]
    for k in range(STEPS):
        ours, ref = run["batches"][k], reference["batches"][k]
        assert torch.equal(ours[INPUT_IDS_KEY], ref[INPUT_IDS_KEY]), k
        assert torch.equal(ours[LOSS_MASK_KEY], ref[LOSS_MASK_KEY]), k
        torch.testing.assert_close(ours[ROLLOUT_LOG_PROBS_KEY], ref[ROLLOUT_LOG_PROBS_KEY], rtol=1e-6, atol=1e-7)
    losses = [m["actor/pg_loss"] for m in run["metrics"]]
    assert min(abs(x) for x in losses) > 1e-6, losses  # the updates learn something (non-zero advantages)
    np.testing.assert_allclose(losses, reference["pg_loss"], rtol=1e-6, atol=1e-8)
    for name, value in reference["final_state"].items():
        torch.testing.assert_close(run["final_state"][name], value, rtol=1e-6, atol=1e-8)


def test_one_step_off_policy_is_not_the_on_policy_schedule(async_runs, reference):
    """Negative control: batch 2 sampled with version 2's weights (the on-policy schedule) differs
    from the recorded batch 2, so the comparison above tells the two schedules apart."""
    from verl_balance.batch_keys import INPUT_IDS_KEY, ROLLOUT_LOG_PROBS_KEY

    ours, on_policy = async_runs[1]["batches"][2], reference["on_policy_batch_2"]
    same_tokens = torch.equal(ours[INPUT_IDS_KEY], on_policy[INPUT_IDS_KEY])
    assert not same_tokens or not torch.allclose(
        ours[ROLLOUT_LOG_PROBS_KEY], on_policy[ROLLOUT_LOG_PROBS_KEY], rtol=1e-4
    )


def test_every_sample_carries_the_policy_version_that_generated_it(async_runs):
    from verl_balance.batch_keys import POLICY_VERSION_KEY

    run = async_runs[1]
    versions = [set(b[POLICY_VERSION_KEY].tolist()) for b in run["batches"]]
    assert versions == [{0}, {0}, {1}]  # batch k with the weights of step max(k - 1, 0)
    assert [m["off_policy/staleness_max"] for m in run["metrics"]] == [0.0, 1.0, 1.0]
    assert all(m["off_policy/dropped_rows"] == 0 for m in run["metrics"])


def test_rollout_workers_hold_the_actor_weights_after_the_last_sync(async_runs):
    for run in async_runs.values():
        expected = sum(float(t.double().sum()) for t in run["final_state"].values())
        for answer in run["rollout_checksums"]:
            assert answer["version"] == STEPS
            assert answer["names"] == sorted(run["final_state"])
            assert answer["sum"] == pytest.approx(expected, rel=1e-12)
        m = run["metrics"][-1]
        assert m["weight_sync/bytes"] == sum(t.numel() * t.element_size() for t in run["final_state"].values())


def test_one_and_two_rollout_workers_give_the_same_samples_and_losses(async_runs):
    from verl_balance.batch_keys import INPUT_IDS_KEY, ROLLOUT_LOG_PROBS_KEY

    one, two = async_runs[1], async_runs[2]
    for a, b in zip(one["batches"], two["batches"]):
        assert torch.equal(a[INPUT_IDS_KEY], b[INPUT_IDS_KEY])
        torch.testing.assert_close(a[ROLLOUT_LOG_PROBS_KEY], b[ROLLOUT_LOG_PROBS_KEY], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(
        [m["actor/pg_loss"] for m in one["metrics"]], [m["actor/pg_loss"] for m in two["metrics"]], rtol=1e-5
    )
    assert all("rollout/imbalance_measured" in m and m["rollout/imbalance_predicted"] >= 1.0 for m in two["metrics"])
