"""verl 0.9.1's own PPO step pieces on 2 CPU Ray workers, one JSON line of results on stdout.

Runs, unmodified, what ``RayPPOTrainer.fit`` runs for one GRPO step after generation:
``_balance_batch`` -> ``_compute_old_log_prob`` -> ``compute_advantage`` -> ``_update_actor``, with
verl's ``ActorRolloutRefWorker`` (role ``actor``) in a verl ``RayWorkerGroup`` of 2 CPU workers, on a
fixed synthetic rollout batch (what the agent loop would return). The actor's engine is chosen by
``actor_rollout_ref.actor.strategy`` only. Every case has its own worker object, config and engine;
all cases' workers share the same 2 Ray processes (verl's colocated ``WorkerDict``, as in ``main_ppo``).
Used by ``test_verl_ppo_trainer.py``; run by hand with::

    export VERL_USE_EXTERNAL_MODULES=verl_balance.integrations.verl.cpu_shims.platform
    VERL_USE_EXTERNAL_MODULES+=,verl_balance.integrations.verl.autopatch
    python tests/integrations/verl_ppo_pieces_runner.py --model-dir DIR --case verl_balance:2:1 --case fsdp2:2:1
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

NUM_PROMPTS = 4
ROLLOUT_N = 2
PROMPT_LEN = 10  # left-padded prompt width
RESPONSE_LEN = 24  # right-padded response width


def ppo_config(*, model_dir: str, strategy: str, mini_batches: int, loss_agg_mode: str, sp: int):
    """verl's ``ppo_trainer`` config composed with Hydra, as ``main_ppo`` would, plus CPU-sized overrides."""
    import verl
    from hydra import compose, initialize_config_dir

    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    actor = "actor_rollout_ref.actor"
    overrides = [
        f"actor_rollout_ref.model.path={model_dir}",
        "actor_rollout_ref.model.use_remove_padding=False",
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
        f"{actor}.strategy={strategy}",
        f"{actor}.ppo_mini_batch_size={NUM_PROMPTS // mini_batches}",
        f"{actor}.use_dynamic_bsz=True",
        f"{actor}.ppo_max_token_len_per_gpu=48",
        f"{actor}.loss_agg_mode={loss_agg_mode}",
        f"{actor}.use_torch_compile=False",
        f"{actor}.fsdp_config.use_torch_compile=False",
        f"{actor}.fsdp_config.ulysses_sequence_parallel_size={sp}",
        f"+{actor}.fsdp_config.mixed_precision.param_dtype=fp32",
        f"+{actor}.fsdp_config.mixed_precision.reduce_dtype=fp32",
        f"+{actor}.fsdp_config.mixed_precision.buffer_dtype=fp32",
        f"{actor}.optim.lr=1e-3",
        f"{actor}.optim.clip_grad=1e9",
        f"actor_rollout_ref.rollout.n={ROLLOUT_N}",
        "actor_rollout_ref.rollout.temperature=0.7",
        "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True",
        "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=48",
        "algorithm.adv_estimator=grpo",
        "trainer.n_gpus_per_node=2",
        "trainer.nnodes=1",
        "trainer.device=cpu",
    ]
    if strategy == "verl_balance":
        # The documented way in: verl imports the model's external_lib in every worker before it
        # builds the engine; importing our engine module registers the backend.
        overrides.append("actor_rollout_ref.model.external_lib=verl_balance.integrations.verl.engine")
    elif strategy.startswith("verl_balance_"):  # a negative-control backend from this test folder
        overrides.append("actor_rollout_ref.model.external_lib=verl_faulty_engine")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return compose(config_name="ppo_trainer", overrides=overrides)


def rollout_batch(vocab_size: int):
    """A GRPO rollout batch as verl's agent loop returns it: left-padded prompts, right-padded
    responses, ``uid`` per prompt repeated ``n`` times, a scalar reward on each last response token."""
    import torch
    from verl import DataProto

    rng = np.random.default_rng(11)
    rows = NUM_PROMPTS * ROLLOUT_N
    prompts = torch.zeros(rows, PROMPT_LEN, dtype=torch.long)
    responses = torch.zeros(rows, RESPONSE_LEN, dtype=torch.long)
    prompt_mask = torch.zeros(rows, PROMPT_LEN, dtype=torch.long)
    response_mask = torch.zeros(rows, RESPONSE_LEN, dtype=torch.long)
    scores = torch.zeros(rows, RESPONSE_LEN)
    for p in range(NUM_PROMPTS):
        prompt_len = int(rng.integers(3, PROMPT_LEN + 1))
        prompt = torch.as_tensor(rng.integers(3, vocab_size, size=prompt_len))
        for k in range(ROLLOUT_N):
            row = p * ROLLOUT_N + k
            response_len = int(rng.integers(2, RESPONSE_LEN + 1))
            prompts[row, PROMPT_LEN - prompt_len :] = prompt
            prompt_mask[row, PROMPT_LEN - prompt_len :] = 1
            responses[row, :response_len] = torch.as_tensor(rng.integers(3, vocab_size, size=response_len))
            response_mask[row, :response_len] = 1
            scores[row, response_len - 1] = float(rng.normal())
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0) * attention_mask
    uid = np.array([f"prompt-{p}" for p in range(NUM_PROMPTS) for _ in range(ROLLOUT_N)], dtype=object)
    return DataProto.from_dict(
        tensors={
            "prompts": prompts,
            "responses": responses,
            "input_ids": torch.cat([prompts, responses], dim=1),
            "attention_mask": attention_mask,
            "position_ids": position_ids,
            "response_mask": response_mask,
            "token_level_scores": scores,
            "token_level_rewards": scores,
        },
        non_tensors={"uid": uid, "row_id": np.arange(rows)},
    )


def colocated_case_workers(worker_classes: dict, *, num_workers: int = 2) -> tuple[dict, object, object]:
    """({case key: worker group}, the fused group, its pool): one verl worker per case on each of
    ``num_workers`` Ray processes, colocated as ``RayPPOTrainer.init_workers`` colocates the actor,
    reference and critic (verl's ``create_colocated_worker_cls``). Each case keeps its own worker
    object, config and engine; the cases share the processes (and their torch.distributed world),
    so the verl/torch imports are paid once per process instead of once per case."""
    from verl.single_controller.ray import RayResourcePool, RayWorkerGroup
    from verl.single_controller.ray.base import create_colocated_worker_cls

    # main_ppo's pool for FSDP actors; verl's default of 10 CPUs per bundle does not fit a small host.
    pool = RayResourcePool([num_workers], use_gpu=False, max_colocate_count=1)
    fused = RayWorkerGroup(pool, create_colocated_worker_cls(worker_classes), device_name="cpu")
    return fused.spawn(prefix_set=list(worker_classes)), fused, pool


def run(workers, *, config, model_dir: str, strategy: str, mini_batches: int) -> dict:
    """One GRPO step's pieces on ``workers`` (this case's actor group, built from ``config``)."""
    import transformers
    from verl.trainer.ppo.metric_utils import reduce_metrics
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer, compute_advantage

    workers.init_model()

    # The trainer's own methods, on a trainer holding only what these pieces read.
    trainer = RayPPOTrainer.__new__(RayPPOTrainer)
    trainer.config = config
    trainer.actor_rollout_wg = workers
    trainer.distillation_config = None
    trainer.use_prefix_grouper = False

    vocab_size = transformers.AutoConfig.from_pretrained(model_dir).vocab_size
    batch = rollout_batch(vocab_size)
    batch.meta_info["temperature"] = config.actor_rollout_ref.rollout.temperature  # as fit() sets it
    metrics: dict = {}
    trainer._balance_batch(batch, metrics=metrics)
    batch.meta_info["global_token_num"] = batch.batch["attention_mask"].sum(-1).tolist()
    balanced_order = batch.non_tensor_batch["uid"].tolist()
    old_log_prob, _ = trainer._compute_old_log_prob(batch)
    old_log_prob.batch.pop("entropys")
    batch = batch.union(old_log_prob)
    batch = compute_advantage(
        batch,
        adv_estimator=config.algorithm.adv_estimator,
        num_repeat=config.actor_rollout_ref.rollout.n,
        norm_adv_by_std_in_grpo=config.algorithm.norm_adv_by_std_in_grpo,
        config=config.algorithm,
    )
    actor_metrics = trainer._update_actor(batch).meta_info["metrics"]
    by_row = np.argsort(batch.non_tensor_batch["row_id"])  # the batch is in balanced order now
    mask = batch.batch["response_mask"].bool()
    old_log_probs = [batch.batch["old_log_probs"][i][mask[i]].tolist() for i in by_row.tolist()]
    return {
        "strategy": strategy,
        "mini_batches": mini_batches,
        "balanced_uids": balanced_order,
        "old_log_probs": [x for row in old_log_probs for x in row],  # in rollout row order
        "pg_loss": [float(x) for x in _flat(actor_metrics["actor/pg_loss"])],
        "grad_norm": [float(x) for x in _flat(actor_metrics["actor/grad_norm"])],
        "reduced": {k: float(v) for k, v in reduce_metrics(actor_metrics).items() if _is_number(v)},
        "balance_metrics": {k: float(v) for k, v in metrics.items() if _is_number(v)},
    }


def parsed_cases(cases: list[str]) -> list[tuple[str, str, int, int]]:
    """(key, strategy, mini-batches, sp) of each ``STRATEGY:MINI_BATCHES:SP`` case; the key is the case's
    method-name prefix in verl's fused worker."""
    parsed = []
    for index, case in enumerate(cases):
        strategy, mini_batches, sp = case.split(":")
        parsed.append((f"case{index}", strategy, int(mini_batches), int(sp)))
    return parsed


def run_cases(*, model_dir: str, cases: list[str], loss_agg_mode: str) -> None:
    """Print one ``RESULT`` line per ``STRATEGY:MINI_BATCHES:SP`` case, in order. Each case's engine
    is built only when its turn comes (``init_model``), after the earlier cases trained."""
    import ray
    from verl.single_controller.ray import RayClassWithInitArgs
    from verl.workers.engine_workers import ActorRolloutRefWorker

    configs, classes = {}, {}
    for key, strategy, mini_batches, sp in parsed_cases(cases):
        configs[key] = ppo_config(
            model_dir=model_dir, strategy=strategy, mini_batches=mini_batches, loss_agg_mode=loss_agg_mode, sp=sp
        )
        classes[key] = RayClassWithInitArgs(
            cls=ray.remote(ActorRolloutRefWorker), config=configs[key].actor_rollout_ref, role="actor"
        )
    groups, fused, pool = colocated_case_workers(classes)
    try:
        for case, (key, strategy, mini_batches, _) in zip(cases, parsed_cases(cases)):
            result = run(
                groups[key], config=configs[key], model_dir=model_dir, strategy=strategy, mini_batches=mini_batches
            )
            print("RESULT " + json.dumps(dict(result, case=case)), flush=True)
    finally:
        _release(fused, pool)


def _release(workers, pool) -> None:
    """Kill the worker processes and free their bundles."""
    import ray

    for handle in workers.workers:
        ray.kill(handle)
    for placement_group in pool.pgs or []:
        ray.util.remove_placement_group(placement_group)


def _flat(value) -> list:
    """verl's per-mini-batch metric value (a number, a ``Metric``, or a list of them) as floats."""
    from verl.utils.metric import Metric

    if isinstance(value, Metric):
        return [value.aggregate()]
    if isinstance(value, list | tuple):
        return [y for x in value for y in _flat(x)]
    return [value]


def _is_number(value) -> bool:
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", required=True)
    parser.add_argument(
        "--case",
        action="append",
        required=True,
        metavar="STRATEGY:MINI_BATCHES:SP",
        help="one PPO step on its own worker per case (colocated), e.g. fsdp2:2:1 or verl_balance:1:2",
    )
    parser.add_argument("--loss-agg-mode", default="token-mean")
    args = parser.parse_args()
    import ray
    from verl_ray_head import connect_runner

    # One Ray connection for all cases (the test session's cluster, or a local instance when run by
    # hand: its start-up costs as much as a case); the cases share two worker processes.
    connect_runner()
    try:
        run_cases(model_dir=args.model_dir, cases=args.case, loss_agg_mode=args.loss_agg_mode)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
