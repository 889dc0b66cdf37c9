"""``trainer.v1.trainer_mode=separate_async`` end to end: one-step off-policy against a hand-built
reference; the same samples and losses on 1 and 2 rollout workers and on 2 and 4 trainer workers;
a run interrupted by SIGINT and resumed, and one whose rollout worker is SIGKILLed and replaced,
both equal to the uninterrupted run.

Reference (``_reference_run``, one process, no trainer code): a fresh actor worker (same config
and seed, so the same initial weights) and a plain KV-cache rollout; for k = 0 .. 3 the rollout
takes the weights of version max(k - 1, 0), samples batch k's prompts with the step's seeds, the
GRPO advantages come from the recorded scores, and the actor takes its PPO updates with the
rollout's own log-probs as the old log-probs. Its samples, log-probs and losses must equal the
async run's (rtol 1e-6), and its final weights the async actor's.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import textwrap

import numpy as np
import pytest
import torch

from tests.trainer.conftest import compose_config, run_trainer

pytestmark = pytest.mark.slow  # Ray worker groups and a reference process

STEPS = 4
LETTER_REWARD = textwrap.dedent('''
    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        """Fraction of the response's characters that are lowercase ASCII letters."""
        return sum("a" <= c <= "z" for c in solution_str) / max(len(solution_str), 1)
''')


LAYOUTS = ((1, 1), (1, 2), (2, 1), (4, 1))
"""(trainer workers, rollout workers) of the module's runs; (1, 1) is the reference's."""


def _overrides(root, *, trainer_workers: int = 1, rollout_workers: int = 1, name: str) -> list[str]:
    return [
        "trainer.device=cpu",
        f"trainer.n_gpus_per_node={trainer_workers}",
        "trainer.logger=[jsonl]",
        "trainer.plot=false",
        "trainer.resume_mode=disable",
        "trainer.save_freq=-1",
        "trainer.test_freq=0",
        "trainer.val_before_train=false",  # no validation: every rollout is a training one
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


def _recording_trainer(overrides: list[str]):
    """An AsyncGRPOTrainer that records, per training step, its prompts, rollout batch and scores
    (``record["steps"]`` lists the step of each; a step redone after a restart appears twice)."""
    from verl_balance.trainer.config.grpo import register_grpo_schema
    from verl_balance.trainer.grpo.async_trainer import AsyncGRPOTrainer

    register_grpo_schema()
    trainer = AsyncGRPOTrainer(compose_config("grpo", overrides))
    record: dict = {"steps": [], "prompts": [], "batches": [], "scores": [], "loss_masks": []}
    collect, score = trainer._collect, trainer.score

    def recording_collect(flight, metrics):
        from verl_balance.batch_keys import LOSS_MASK_KEY

        batch = collect(flight, metrics)
        record["loss_masks"].append(batch[LOSS_MASK_KEY].clone())  # before any rollout rejection
        record["steps"].append(trainer.global_step)
        record["prompts"].append(flight.prompts[1])
        record["batches"].append(batch)
        return batch

    def recording_score(batch):
        out = score(batch)
        record["scores"].append(out[0])
        return out

    trainer._collect, trainer.score = recording_collect, recording_score
    return trainer, record


def _async_run(root, *, trainer_workers: int, rollout_workers: int) -> dict:
    """Train STEPS steps; record every step's prompts, rollout batch, scores and metrics."""
    from verl_balance.utils.tracking import read_metrics

    name = f"t{trainer_workers}r{rollout_workers}"
    overrides = _overrides(root, trainer_workers=trainer_workers, rollout_workers=rollout_workers, name=name)
    if trainer_workers > 1:  # every DP rank needs a prompt of each mini-batch: one mini-batch of 4
        overrides += [
            "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "trainer.v1.separate_async.parameter_sync_step=1",
        ]
    trainer, record = _recording_trainer(overrides)
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
def async_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("async_grpo")
    (root / "letters.py").write_text(LETTER_REWARD)
    return root


@pytest.fixture(scope="module")
def async_runs(ray_cluster, async_root):
    return {layout: _async_run(async_root, trainer_workers=layout[0], rollout_workers=layout[1]) for layout in LAYOUTS}


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
    from verl_balance.distributed.launcher import run_on_ranks

    run = async_runs[1, 1]
    record = {key: run[key] for key in ("prompts", "scores", "config", "worker_config", "workload")}
    return run_on_ranks(functools.partial(_reference_run, record=record), world=1)[0]


def test_one_step_off_policy_equals_the_hand_built_reference(async_runs, reference):
    from verl_balance.batch_keys import INPUT_IDS_KEY, LOSS_MASK_KEY, ROLLOUT_LOG_PROBS_KEY

    run = async_runs[1, 1]
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

    ours, on_policy = async_runs[1, 1]["batches"][2], reference["on_policy_batch_2"]
    same_tokens = torch.equal(ours[INPUT_IDS_KEY], on_policy[INPUT_IDS_KEY])
    assert not same_tokens or not torch.allclose(
        ours[ROLLOUT_LOG_PROBS_KEY], on_policy[ROLLOUT_LOG_PROBS_KEY], rtol=1e-4
    )


def test_every_sample_carries_the_policy_version_that_generated_it(async_runs):
    from verl_balance.batch_keys import POLICY_VERSION_KEY

    run = async_runs[1, 1]
    versions = [set(b[POLICY_VERSION_KEY].tolist()) for b in run["batches"]]
    assert versions == [{0}, {0}, {1}, {2}]  # batch k with the weights of step max(k - 1, 0)
    assert [m["off_policy/staleness_max"] for m in run["metrics"]] == [0.0, 1.0, 1.0, 1.0]
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

    one, two = async_runs[1, 1], async_runs[1, 2]
    for a, b in zip(one["batches"], two["batches"]):
        assert torch.equal(a[INPUT_IDS_KEY], b[INPUT_IDS_KEY])
        torch.testing.assert_close(a[ROLLOUT_LOG_PROBS_KEY], b[ROLLOUT_LOG_PROBS_KEY], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(
        [m["actor/pg_loss"] for m in one["metrics"]], [m["actor/pg_loss"] for m in two["metrics"]], rtol=1e-5
    )
    assert all("rollout/imbalance_measured" in m and m["rollout/imbalance_predicted"] >= 1.0 for m in two["metrics"])


def test_two_and_four_trainer_workers_give_the_same_samples_and_losses(async_runs):
    """Layout invariance on the training side: the same samples (tokens equal, log-probs rtol 1e-6)
    and losses within the parity contract's rtol 1e-5 (fp32 sums in another order per DP size)."""
    from verl_balance.batch_keys import INPUT_IDS_KEY, ROLLOUT_LOG_PROBS_KEY

    two, four = async_runs[2, 1], async_runs[4, 1]
    for k, (a, b) in enumerate(zip(two["batches"], four["batches"], strict=True)):
        assert torch.equal(a[INPUT_IDS_KEY], b[INPUT_IDS_KEY]), k
        torch.testing.assert_close(a[ROLLOUT_LOG_PROBS_KEY], b[ROLLOUT_LOG_PROBS_KEY], rtol=1e-6, atol=1e-7)
    losses = {w: [m["actor/pg_loss"] for m in async_runs[w, 1]["metrics"]] for w in (2, 4)}
    assert len(losses[2]) == STEPS and min(abs(x) for x in losses[2]) > 1e-6
    np.testing.assert_allclose(losses[2], losses[4], rtol=1e-5, atol=1e-8)  # the parity contract's fp32 rtol


def _by_step(record: dict) -> dict:
    """The batch each step trained on (the last one when a restart redid the step)."""
    return dict(zip(record["steps"], record["batches"]))


def _assert_same_run(record: dict, metrics: list[dict], expected: dict, *, loss_rtol: float = 1e-6) -> None:
    """Every step's samples and rollout log-probs equal the uninterrupted run's; the losses too (``loss_rtol``)."""
    from verl_balance.batch_keys import INPUT_IDS_KEY, ROLLOUT_LOG_PROBS_KEY

    ours, theirs = _by_step(record), _by_step(expected)
    for step, batch in ours.items():
        assert torch.equal(batch[INPUT_IDS_KEY], theirs[step][INPUT_IDS_KEY]), step
        torch.testing.assert_close(batch[ROLLOUT_LOG_PROBS_KEY], theirs[step][ROLLOUT_LOG_PROBS_KEY], rtol=1e-6, atol=0)
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    losses = [m["actor/pg_loss"] for m in metrics], [m["actor/pg_loss"] for m in expected["metrics"]]
    np.testing.assert_allclose(*losses, rtol=loss_rtol, atol=1e-9)


def test_sigint_mid_pipeline_saves_the_in_flight_batch_and_resume_continues_the_uninterrupted_curve(
    async_runs, async_root
):
    """Ctrl-C during step 2 of 4: the checkpoint records policy version 2 and batch 2, generated
    with version 1 (which no longer exists after step 2's update); the resumed run trains on it
    and generates batch 3 from its seeds. The negative control of that parity is
    ``test_one_step_off_policy_is_not_the_on_policy_schedule``: batch 2 regenerated with the
    restored (version 2) weights differs."""
    overrides = [o.replace("resume_mode=disable", "resume_mode=auto") for o in _overrides(async_root, name="sigint")]
    first, _ = _recording_trainer(overrides)
    run_trainer(first, stop_after=2)
    state = json.loads((async_root / "sigint" / "global_step_2" / "trainer_state.json").read_text())
    assert state["policy_version"] == 2
    assert state["in_flight"] == [{"step": 2, "version": 1, "file": "in_flight_2.safetensors"}]

    resumed, record = _recording_trainer(overrides)
    metrics = run_trainer(resumed)
    assert record["steps"] == [2, 3]
    _assert_same_run(record, metrics, async_runs[1, 1])


def _kill_rollout_worker_before(trainer, step: int) -> None:
    """SIGKILL rollout worker 0's process just before training step ``step`` (0-based, once)."""
    import ray

    train_step, killed = trainer.train_step, []

    def kill_then_step(prompts):
        if trainer.global_step == step and not killed:
            pid = ray.get(trainer.rollout_group.workers[0].get_rank_info.remote())["pid"]
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        return train_step(prompts)

    trainer.train_step = kill_then_step


def test_a_killed_rollout_worker_is_replaced_and_the_run_gives_the_same_samples(async_runs, async_root):
    """trainer.max_restarts=1: the rollout worker dies while batch 3 generates; the groups are
    rebuilt from the step-2 checkpoint (its in-flight batch 2 saved), steps 3 and 4 are redone
    and every sample and loss equals the uninterrupted run's."""
    from verl_balance.utils.tracking import read_metrics

    overrides = _overrides(async_root, name="killed") + ["trainer.save_freq=1", "trainer.max_restarts=1"]
    trainer, record = _recording_trainer(overrides)
    _kill_rollout_worker_before(trainer, 2)
    try:
        summary = trainer.fit()
    finally:
        trainer.close()
    assert summary["restarts"] == 1 and summary["steps"] == STEPS
    assert record["steps"][-2:] == [2, 3] and len(record["steps"]) > STEPS  # a step was redone
    _assert_same_run(record, read_metrics(summary["metrics"]), async_runs[1, 1])


def test_without_max_restarts_a_killed_rollout_worker_ends_the_run_naming_it(ray_cluster, async_root):
    from verl_balance.single_controller import WorkerDiedError

    trainer, _ = _recording_trainer(_overrides(async_root, name="killed_once") + ["trainer.max_restarts=0"])
    _kill_rollout_worker_before(trainer, 0)
    try:
        with pytest.raises(WorkerDiedError, match=r"worker rank 0 .*RolloutWorker"):
            trainer.fit()
    finally:
        trainer.close()


def test_lora_sends_the_base_once_then_only_the_adapters_and_the_rollout_merges_them(
    ray_cluster, tiny_qwen2, async_root
):
    """A LoRA actor (tiny HF qwen2, rank 4 on every Linear): the first sync carries every tensor,
    each later one only the adapters, and after the last the rollout worker generates with
    W + (alpha / r) * B @ A of each adapted module, computed here by hand from the actor's tensors."""
    from verl_balance.utils.tracking import read_metrics

    rank, alpha, steps = 4, 8, 3
    replaced = ("trainer.total_training_steps", "data.max_prompt_length")
    overrides = [o for o in _overrides(async_root, name="lora") if not o.startswith(replaced)] + [
        f"actor_rollout_ref.model.path={tiny_qwen2}",
        f"actor_rollout_ref.model.lora_rank={rank}",
        f"actor_rollout_ref.model.lora_alpha={alpha}",
        "actor_rollout_ref.actor.entropy_coeff=0.1",  # the adapters move even without reward
        "data.max_prompt_length=64",
        f"trainer.total_training_steps={steps}",
    ]
    trainer, _ = _recording_trainer(overrides)
    try:
        summary = trainer.fit()
        plan = trainer.actor.weight_buckets()[0]
        actor = trainer.actor.export_weight_bucket([n for bucket in plan["buckets"] for n in bucket])[0]
        rollout = trainer.rollout_group.weights_checksum()[0]
    finally:
        trainer.close()
    adapters = {n: t for n, t in actor.items() if ".lora_A." in n or ".lora_B." in n}
    assert adapters and len(adapters) < len(actor)
    full_bytes = sum(t.numel() * t.element_size() for t in actor.values())
    adapter_bytes = sum(t.numel() * t.element_size() for t in adapters.values())
    sent = [m["weight_sync/bytes"] for m in read_metrics(summary["metrics"]) if m["step"] >= 1]
    assert sent == [full_bytes + adapter_bytes] + [adapter_bytes] * (steps - 1)  # step 1: base, then its update

    merged, moved = {}, 0
    for name, tensor in actor.items():
        if name in adapters:
            continue
        if name.endswith(".base_layer.weight"):
            prefix = name[: -len(".base_layer.weight")]
            a, b = actor[f"{prefix}.lora_A.default.weight"], actor[f"{prefix}.lora_B.default.weight"]
            delta = (alpha / rank) * (b.double() @ a.double())
            moved += bool(delta.abs().max() > 1e-6)
            tensor = tensor.double() + delta
            name = f"{prefix}.weight"
        merged[name.replace(".base_layer.", ".")] = tensor.double()  # a wrapped Linear's bias too
    assert moved > 0  # negative control: the unmerged base would differ from the expected weights
    assert rollout["version"] == steps and rollout["names"] == sorted(merged)
    for name, tensor in merged.items():
        assert rollout["sums"][name] == pytest.approx(float(tensor.sum()), rel=1e-6, abs=1e-6), name


def test_colocate_async_draws_the_samples_and_losses_of_separate_async(async_runs, async_root):
    """trainer.v1.trainer_mode=colocate_async on the actor's own rollout: batch k+1 is submitted
    before step k's updates, so it has version k's weights: the separate run's samples, versions
    and losses (itself checked against the hand-built reference above). The losses within the parity
    contract's fp32 rtol 1e-5: the colocated actor shares the node's cores with no rollout worker, so its
    matmuls run on twice the separate trainer's threads (sums in another order; 3.8e-6 seen once)."""
    from verl_balance.batch_keys import POLICY_VERSION_KEY
    from verl_balance.utils.tracking import read_metrics

    overrides = [o for o in _overrides(async_root, name="colocate") if not o.startswith("trainer.v1.")]
    overrides += ["trainer.v1.trainer_mode=colocate_async"]
    trainer, record = _recording_trainer(overrides)
    try:
        summary = trainer.fit()
    finally:
        trainer.close()
    assert trainer.rollout_group is None
    assert [set(b[POLICY_VERSION_KEY].tolist()) for b in record["batches"]] == [{0}, {0}, {1}, {2}]
    _assert_same_run(record, read_metrics(summary["metrics"]), async_runs[1, 1], loss_rtol=1e-5)


RC_STEPS = 3
RC_KEYS = {
    "rollout_is": "token",
    "rollout_is_threshold": 2.0,
    "rollout_rs": "token_k2",
    "rollout_rs_threshold": 0.02,
}
"""The decoupled correction of the corrected run: truncated token IS weights, token-level k2 rejection."""


@pytest.fixture(scope="module")
def corrected_run(ray_cluster, async_root):
    """separate_async with verl's decoupled rollout correction (old log-probs recomputed), one
    mini-batch per step; records what each update received."""
    from verl_balance.utils.tracking import read_metrics

    replaced = ("trainer.total_training_steps", "actor_rollout_ref.actor.ppo_mini_batch_size", "trainer.v1.separate")
    overrides = [o for o in _overrides(async_root, name="rollout_corr") if not o.startswith(replaced)]
    overrides += [f"algorithm.rollout_correction.{k}={v}" for k, v in RC_KEYS.items()]
    overrides += [
        f"trainer.total_training_steps={RC_STEPS}",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "trainer.v1.separate_async.parameter_sync_step=1",
        "actor_rollout_ref.actor.recompute_old_log_prob=always",
    ]
    trainer, record = _recording_trainer(overrides)
    record["updates"] = []
    train_actor = trainer.train_actor

    def recording_update(batch, **kwargs):
        record["updates"].append({k: batch[k].clone() for k in batch.tensor_keys})
        return train_actor(batch, **kwargs)

    trainer.train_actor = recording_update
    try:
        summary = trainer.fit()
    finally:
        trainer.close()
    record["metrics"] = [r for r in read_metrics(summary["metrics"]) if r["step"] >= 1]
    return record


def test_async_decoupled_correction_trains_with_verls_weights_on_the_actors_and_rollouts_log_probs(corrected_run):
    """The IS weights and the loss mask each update received are decoupled_correction of the
    recomputed old log-probs vs the rollout's (and by hand: min(exp(old - rollout), 2) x mask);
    its rollout_corr/* metrics are logged next to the staleness ones."""
    from verl_balance.algorithms.rollout_correction import RolloutCorrectionConfig, decoupled_correction
    from verl_balance.batch_keys import LOSS_MASK_KEY, OLD_LOG_PROBS_KEY, ROLLOUT_IS_WEIGHTS_KEY, ROLLOUT_LOG_PROBS_KEY

    config = RolloutCorrectionConfig(**RC_KEYS)
    updates, metrics = corrected_run["updates"], corrected_run["metrics"]
    assert len(updates) == len(metrics) == RC_STEPS
    rejected = []
    for update, mask, logged in zip(updates, corrected_run["loss_masks"], metrics):
        old, rollout = update[OLD_LOG_PROBS_KEY], update[ROLLOUT_LOG_PROBS_KEY]
        weights, kept, expected = decoupled_correction(
            old_log_probs=old, rollout_log_probs=rollout, loss_mask=mask, config=config
        )
        torch.testing.assert_close(update[ROLLOUT_IS_WEIGHTS_KEY], weights.float(), rtol=1e-6, atol=0)
        by_hand = torch.exp(old.double() - rollout.double()).clamp(max=2.0) * mask
        torch.testing.assert_close(update[ROLLOUT_IS_WEIGHTS_KEY].double(), by_hand, rtol=1e-6, atol=1e-7)
        assert torch.equal(update[LOSS_MASK_KEY], kept)
        assert expected and set(expected) <= set(logged)
        for key, value in expected.items():
            assert logged[key] == pytest.approx(value, rel=1e-6, abs=1e-9), key
        assert {"off_policy/staleness_mean", "off_policy/is_weight_token_mean"} <= set(logged)
        rejected.append(logged["rollout_corr/rollout_rs_masked_fraction"])
    assert not torch.equal(updates[-1][OLD_LOG_PROBS_KEY], updates[-1][ROLLOUT_LOG_PROBS_KEY])  # one step stale
    assert 0 < max(rejected) < 0.5, rejected  # the rejection bites, a little


def test_async_decoupled_correction_pg_loss_is_the_is_weighted_loss_not_the_unweighted_one(corrected_run):
    """One mini-batch per step, so the update's ratio pi_theta / pi_old is 1 and verl's token-mean
    pg_loss is -sum(A w m) / sum(m) over the kept tokens; with weights all ones (negative control)
    it would differ once the batch is stale (step 0 trains on its own version's samples: w ~ 1)."""
    from verl_balance.batch_keys import ADVANTAGES_KEY, LOSS_MASK_KEY, ROLLOUT_IS_WEIGHTS_KEY

    for step, (update, logged) in enumerate(zip(corrected_run["updates"], corrected_run["metrics"])):
        mask, advantages = update[LOSS_MASK_KEY].double(), update[ADVANTAGES_KEY].double()
        weights = update[ROLLOUT_IS_WEIGHTS_KEY].double()
        weighted = float(-(advantages * weights * mask).sum() / mask.sum())
        unweighted = float(-(advantages * mask).sum() / mask.sum())
        tolerance = 1e-5 * abs(weighted) + 1e-7
        assert logged["actor/pg_loss"] == pytest.approx(weighted, rel=1e-5, abs=1e-7), step
        if step >= 1:
            assert abs(weighted - unweighted) > 10 * tolerance, (step, weighted, unweighted)
