"""Driver-side pieces shared by the SFT and GRPO trainers: Ray start-up, the actor worker
group, plan -> dispatch, per-rank metric reduction and checkpoint bookkeeping.

The driver never calls torch.distributed: it plans (balance/), splits batches (protocol.py) and
talks to workers through the worker group.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import replace

import numpy as np
import ray
import torch

from verl_balance.balance import FlopsWorkload, TokenWorkload, plan_balance
from verl_balance.engine.config import EngineConfig, OptimConfig
from verl_balance.models.config import ModelConfig
from verl_balance.protocol import Batch, split_by_plan
from verl_balance.single_controller import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
from verl_balance.trainer.config import ConfigError
from verl_balance.utils.tracking import read_metrics
from verl_balance.workers.actor import ActorWorker, ActorWorkerConfig

LATEST_FILE = "latest_checkpointed_iteration.txt"
TRAINER_STATE_FILE = "trainer_state.json"


def start_ray(*, address: str | None, num_workers: int) -> None:
    """Connect to a cluster (``address``) or start an embedded one sized for the workers."""
    if ray.is_initialized():
        return
    env = {"env_vars": {"TOKENIZERS_PARALLELISM": "false"}}
    if address:
        ray.init(address=address, runtime_env=env, log_to_driver=True)
    else:
        # An embedded cluster gets one CPU slot per worker plus one for the driver's tasks, even
        # on a 2-core laptop: the workers are mostly waiting on each other's collectives.
        ray.init(num_cpus=max(num_workers + 1, os.cpu_count() or 1), include_dashboard=False,
                 runtime_env=env, log_to_driver=True)


def resolve_use_gpu(device: str) -> bool:
    """trainer.device auto|cpu|cuda -> whether workers take GPU bundles (auto: the cluster has GPUs)."""
    if device == "cpu":
        return False
    gpus = ray.cluster_resources().get("GPU", 0)
    if device == "cuda" and gpus == 0:
        raise ConfigError("trainer.device=cuda but the Ray cluster has no GPUs; use trainer.device=cpu or auto")
    return gpus > 0


MODEL_DIMENSION_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                        "num_kv_heads", "max_position_embeddings", "tie_word_embeddings")


def build_model_config(model_cfg, *, vocab_size: int) -> ModelConfig:
    """A built-in preset with the tokenizer's vocabulary and the dimensions the config sets."""
    base = ModelConfig.preset(model_cfg.name)
    overrides = {k: model_cfg[k] for k in MODEL_DIMENSION_KEYS if model_cfg.get(k) is not None}
    overrides.setdefault("vocab_size", vocab_size)
    if overrides["vocab_size"] < vocab_size:
        raise ConfigError(f"model.vocab_size={overrides['vocab_size']} is smaller than the "
                          f"tokenizer's vocabulary ({vocab_size})")
    return replace(base, **overrides)


def build_workload(name: str, model_config: ModelConfig):
    """The balancer's cost model: tokens, or FLOPs from the model's dimensions."""
    return FlopsWorkload.from_model_config(model_config) if name == "flops" else TokenWorkload()


def engine_config_from(cfg, *, total_steps: int, loss_agg_mode: str, loss_scale_factor, seed: int) -> EngineConfig:
    """EngineConfig from the recipe's optim section and the run length."""
    o = cfg.optim
    optim = OptimConfig(lr=float(o.lr), weight_decay=float(o.weight_decay), betas=[float(b) for b in o.betas],
                        clip_grad=float(o.clip_grad) if o.clip_grad else None,
                        warmup_steps_ratio=float(o.warmup_steps_ratio), lr_scheduler=o.lr_scheduler,
                        min_lr_ratio=float(o.min_lr_ratio))
    return EngineConfig(
        optim=optim, total_steps=total_steps,
        loss_agg_mode=loss_agg_mode, loss_scale_factor=loss_scale_factor,
        param_dtype=cfg.model.param_dtype, seed=seed,
    )


def build_actor_group(*, worker_config: ActorWorkerConfig, trainer_cfg, use_gpu: bool,
                      worker_cls: type = ActorWorker) -> RayWorkerGroup:
    """Place nnodes x n_gpus_per_node workers and build the sharded model on them."""
    pool = RayResourcePool(n_gpus_per_node=trainer_cfg.n_gpus_per_node, nnodes=trainer_cfg.nnodes,
                           use_gpu=use_gpu, placement_timeout_s=trainer_cfg.placement_timeout_s)
    group = RayWorkerGroup(resource_pool=pool, ray_cls_with_init=RayClassWithInitArgs(worker_cls, worker_config))
    group.init_model()
    return group


def plan_for(batch: Batch, *, dp_size: int, sp_size: int, micro_batch_size: int | None, token_cap: int | None,
             balance_cfg, workload, group_ids=None):
    """BalancePlan for one global mini-batch (balance.enable=false gives the contiguous split)."""
    seq_lens = batch["attention_mask"].sum(dim=1).cpu().numpy()
    return plan_balance(
        seq_lens=seq_lens, dp_size=dp_size, sp_size=sp_size,
        micro_batch_size=None if token_cap is not None else micro_batch_size,
        max_token_len_per_gpu=token_cap, balance=bool(balance_cfg.enable), group_ids=group_ids,
        workload=workload, overlong=balance_cfg.overlong,
    )


def apply_truncation(batch: Batch, plan) -> Batch:
    """Cut the samples the plan truncated (overlong=truncate) to their planned length."""
    if not plan.truncated:
        return batch
    mask = batch["attention_mask"].clone()
    for index, new_len in plan.truncated.items():
        mask[int(index), int(new_len):] = 0
    out = batch.select()
    for key in out.tensor_keys:
        value = out[key]
        if key != "attention_mask" and value.shape == mask.shape:
            out[key] = value * mask.to(value.dtype)
    out["attention_mask"] = mask
    return out


def dispatch_chunks(batch: Batch, plan) -> list[Batch]:
    """Per-DP-rank chunks in the plan's micro-batch order."""
    return split_by_plan(apply_truncation(batch, plan), plan)


def reduce_rank_metrics(per_rank: list[dict], *, prefix: str) -> dict:
    """Driver-side view of one engine call: global figures and measured per-rank timing.

    Engine metrics such as loss and grad_norm are already global (all-reduced over the mesh),
    so DP rank 0's value is taken; compute time differs per rank and gives measured imbalance
    (max / mean over DP ranks of the per-rank busy seconds: compute without collective waits).
    """
    out = {}
    for key, value in per_rank[0].items():
        if isinstance(value, (int, float, bool)) and key != "dp_rank" and not key.endswith("seconds"):
            out[prefix + key] = float(value)
    busy = np.array([m.get("busy_seconds", 0.0) for m in per_rank], dtype=np.float64)
    if busy.size and busy.mean() > 0:
        out["balance/imbalance_measured"] = float(busy.max() / busy.mean())
        out["timing_s/busy_max"] = float(busy.max())
        out["timing_s/busy_mean"] = float(busy.mean())
    return out


def plan_metrics(plan) -> dict:
    """Predicted balance of the plan and of the naive contiguous split, from the plan's stats."""
    s = plan.stats
    out = {
        "balance/imbalance_predicted": float(s["imbalance"]),
        "balance/imbalance_predicted_naive": float(s["naive_imbalance"]),
        "balance/sync_ratio_predicted": float(s["sync_ratio"]),
        "balance/sync_ratio_predicted_naive": float(s["naive_sync_ratio"]),
        "balance/num_micro_batches": float(s["num_micro_batches"]),
        "balance/num_micro_batches_naive": float(s["naive_num_micro_batches"]),
    }
    if s.get("num_skipped") or s.get("num_truncated"):
        out["balance/skipped"] = float(s["num_skipped"])
        out["balance/truncated"] = float(s["num_truncated"])
    return out


# ---------------------------------------------------------------------- checkpoints
def checkpoint_dir(root: str, step: int) -> str:
    return os.path.join(root, f"global_step_{step}")


def latest_checkpoint(root: str) -> str | None:
    """The directory named by ``latest_checkpointed_iteration.txt`` under root, if complete."""
    marker = os.path.join(root, LATEST_FILE)
    if not os.path.exists(marker):
        return None
    with open(marker, encoding="utf-8") as f:
        step = int(f.read().strip())
    path = checkpoint_dir(root, step)
    return path if os.path.exists(os.path.join(path, TRAINER_STATE_FILE)) else None


def save_trainer_checkpoint(group: RayWorkerGroup, *, root: str, step: int, trainer_state: dict) -> str:
    """Workers write the sharded engine state; the driver writes its own state, then the marker.

    The marker is written last, so a stop mid-save leaves the previous checkpoint as latest.
    """
    path = checkpoint_dir(root, step)
    if os.path.exists(path):
        shutil.rmtree(path)
    group.save_checkpoint(path, step)
    with open(os.path.join(path, TRAINER_STATE_FILE), "w", encoding="utf-8") as f:
        json.dump(trainer_state, f)
    with open(os.path.join(root, LATEST_FILE), "w", encoding="utf-8") as f:
        f.write(str(step))
    return path


def load_trainer_checkpoint(group: RayWorkerGroup, path: str) -> dict:
    """Restore workers from ``path`` and return the driver's saved state."""
    if not os.path.exists(os.path.join(path, TRAINER_STATE_FILE)):
        raise ConfigError(f"trainer.resume_from_path={path!r} is not a complete checkpoint "
                          f"(no {TRAINER_STATE_FILE}); pick a global_step_N directory")
    group.load_checkpoint(path)
    with open(os.path.join(path, TRAINER_STATE_FILE), encoding="utf-8") as f:
        return json.load(f)


def truncate_metrics_after(path: str, step: int) -> None:
    """Drop records past ``step`` so a resumed run's metrics file reads as one uninterrupted curve."""
    if not os.path.exists(path):
        return
    keep = [r for r in read_metrics(path) if int(r.get("step", 0)) <= step]
    with open(path, "w", encoding="utf-8") as f:
        for record in keep:
            f.write(json.dumps(record) + "\n")


def to_batch(tensors: dict[str, torch.Tensor], non_tensors: dict | None = None) -> Batch:
    return Batch.from_dict(tensors=tensors, non_tensors=non_tensors or {})
