"""verl 0.9.1's own critic pieces (PPO with GAE) on 2 CPU Ray workers, one JSON line per case.

Runs, unmodified, what ``RayPPOTrainer.fit`` runs for the critic of one PPO step:
``_compute_values`` -> ``compute_advantage`` (GAE) -> ``_update_critic``, with verl's
``TrainingWorker`` (model_type ``value_model``, built as ``RayPPOTrainer.init_workers`` builds the
critic) in a verl ``RayWorkerGroup`` of 2 CPU workers, on the fixed rollout batch of
``verl_ppo_pieces_runner.py``. Each case has its own worker and engine; all cases share the same 2
Ray processes (verl's colocated ``WorkerDict``). The critic's engine is chosen by ``critic.strategy`` only. Used by
``test_verl_critic.py``. verl 0.9.1's ``TrainingWorker`` (the critic) does not import
``critic.model.external_lib``, so our backend is registered through ``VERL_USE_EXTERNAL_MODULES``
(as ``verl_balance.integrations.verl.autopatch`` also does). Run by hand with::

    M=verl_balance.integrations.verl
    VERL_USE_EXTERNAL_MODULES=$M.cpu_platform,$M.engine,verl_value_sdpa \\
    python tests/integrations/verl_critic_pieces_runner.py --model-dir CRITIC_DIR --case verl_balance:2:1
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np
from verl_ppo_pieces_runner import (
    NUM_PROMPTS,
    ROLLOUT_N,
    _flat,
    _is_number,
    _release,
    colocated_case_workers,
    parsed_cases,
    rollout_batch,
)


def critic_config(*, model_dir: str, strategy: str, mini_batches: int, loss_agg_mode: str, sp: int):
    """verl's ``ppo_trainer`` config with GAE and a critic, composed with Hydra, CPU-sized."""
    import verl
    from hydra import compose, initialize_config_dir

    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    overrides = [
        f"actor_rollout_ref.model.path={model_dir}",
        f"actor_rollout_ref.rollout.n={ROLLOUT_N}",
        "algorithm.adv_estimator=gae",
        "algorithm.gamma=0.99",
        "algorithm.lam=0.9",
        f"critic.strategy={strategy}",
        f"critic.model.path={model_dir}",
        "critic.model.use_remove_padding=False",
        f"critic.ppo_mini_batch_size={NUM_PROMPTS // mini_batches}",
        "critic.use_dynamic_bsz=True",
        "critic.ppo_max_token_len_per_gpu=48",
        f"critic.loss_agg_mode={loss_agg_mode}",
        "critic.cliprange_value=0.05",
        "critic.shuffle=False",
        f"critic.fsdp.ulysses_sequence_parallel_size={sp}",
        "critic.fsdp.use_torch_compile=False",
        "+critic.fsdp.mixed_precision.param_dtype=fp32",
        "+critic.fsdp.mixed_precision.reduce_dtype=fp32",
        "+critic.fsdp.mixed_precision.buffer_dtype=fp32",
        "critic.optim.lr=1e-3",
        "critic.optim.clip_grad=1e9",
        "trainer.n_gpus_per_node=2",
        "trainer.nnodes=1",
        "trainer.device=cpu",
    ]
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return compose(config_name="ppo_trainer", overrides=overrides)


def critic_worker_config(config):
    """The critic's ``TrainingWorkerConfig`` exactly as ``RayPPOTrainer.init_workers`` builds it."""
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.config import CriticConfig
    from verl.workers.engine_workers import TrainingWorkerConfig

    critic: CriticConfig = omega_conf_to_dataclass(config.critic)
    engine = critic.engine
    engine.infer_max_token_len_per_gpu = critic.ppo_infer_max_token_len_per_gpu
    engine.max_token_len_per_gpu = critic.ppo_max_token_len_per_gpu
    worker = TrainingWorkerConfig(
        model_type="value_model",
        model_config=critic.model,
        engine_config=engine,
        optimizer_config=critic.optim,
        checkpoint_config=critic.checkpoint,
    )
    return critic, worker


def run(workers, *, config, critic, model_dir: str, strategy: str) -> dict:
    """One PPO step's critic pieces on ``workers`` (this case's critic group, built from ``config``)."""
    from functools import partial

    import transformers
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer, compute_advantage
    from verl.workers.utils.losses import value_loss

    workers.reset()
    workers.set_loss_fn(partial(value_loss, config=critic))

    trainer = RayPPOTrainer.__new__(RayPPOTrainer)
    trainer.config = config
    trainer.critic_wg = workers

    batch = rollout_batch(transformers.AutoConfig.from_pretrained(model_dir).vocab_size)
    batch.meta_info["temperature"] = config.actor_rollout_ref.rollout.temperature  # as fit() sets it
    batch.meta_info["global_token_num"] = batch.batch["attention_mask"].sum(-1).tolist()
    batch = batch.union(trainer._compute_values(batch))
    batch = compute_advantage(
        batch,
        adv_estimator=config.algorithm.adv_estimator,
        gamma=config.algorithm.gamma,
        lam=config.algorithm.lam,
        num_repeat=config.actor_rollout_ref.rollout.n,
        config=config.algorithm,
    )
    critic_metrics = trainer._update_critic(batch).meta_info["metrics"]
    mask = batch.batch["response_mask"].bool()
    values = [batch.batch["values"][i][mask[i]].tolist() for i in range(len(batch))]
    return {
        "strategy": strategy,
        "values": [x for row in values for x in row],
        "returns_sum": float(batch.batch["returns"][mask].sum()),
        "vf_loss": [float(x) for x in _flat(critic_metrics["critic/vf_loss"])],
        "grad_norm": [float(x) for x in _flat(critic_metrics["critic/grad_norm"])],
        "vf_clipfrac": [float(x) for x in _flat(critic_metrics["critic/vf_clipfrac"])],
        "metric_keys": sorted(critic_metrics),
        "reduced": {k: float(np.mean(_flat(v))) for k, v in critic_metrics.items() if _numbers(v)},
    }


def run_cases(*, model_dir: str, cases: list[str], loss_agg_mode: str) -> None:
    """Print one ``RESULT`` line per ``STRATEGY:MINI_BATCHES:SP`` case, in order; every case has its
    own critic worker, all colocated on the same 2 Ray processes (``colocated_case_workers``)."""
    import ray
    from verl.single_controller.ray import RayClassWithInitArgs
    from verl.workers.engine_workers import TrainingWorker

    configs, critics, classes = {}, {}, {}
    for key, strategy, mini_batches, sp in parsed_cases(cases):
        configs[key] = critic_config(
            model_dir=model_dir, strategy=strategy, mini_batches=mini_batches, loss_agg_mode=loss_agg_mode, sp=sp
        )
        critics[key], worker_config = critic_worker_config(configs[key])
        classes[key] = RayClassWithInitArgs(cls=ray.remote(TrainingWorker), config=worker_config)
    groups, fused, pool = colocated_case_workers(classes)
    try:
        for case, (key, strategy, _, _) in zip(cases, parsed_cases(cases)):
            result = run(groups[key], config=configs[key], critic=critics[key], model_dir=model_dir, strategy=strategy)
            print("RESULT " + json.dumps(dict(result, case=case)), flush=True)
    finally:
        _release(fused, pool)


def _numbers(value) -> bool:
    try:
        return all(_is_number(x) for x in _flat(value))
    except Exception:
        return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", required=True, help="a *ForTokenClassification (num_labels=1) directory")
    parser.add_argument("--case", action="append", required=True, metavar="STRATEGY:MINI_BATCHES:SP")
    parser.add_argument("--loss-agg-mode", default="token-mean")
    args = parser.parse_args()
    import ray
    from verl_ray_head import connect_runner

    # One Ray connection for all cases (the test session's cluster, or a local instance when run by
    # hand); the cases share two worker processes.
    connect_runner()
    try:
        run_cases(model_dir=args.model_dir, cases=args.case, loss_agg_mode=args.loss_agg_mode)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
