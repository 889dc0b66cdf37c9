"""Driver-side pieces still shared by the SFT and GRPO trainers: config -> object builders and
plan -> dispatch (the architecture pass moves each to its own home).

The driver never calls torch.distributed: it plans (balance/), splits batches (protocol.py) and
talks to workers through the worker group.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from verl_balance.balance import FlopsWorkload, TokenWorkload, plan_balance
from verl_balance.engine.config import EngineConfig, OptimConfig
from verl_balance.models.config import ModelConfig
from verl_balance.protocol import Batch, split_by_plan
from verl_balance.trainer.config import ConfigError


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


def to_batch(tensors: dict[str, torch.Tensor], non_tensors: dict | None = None) -> Batch:
    return Batch.from_dict(tensors=tensors, non_tensors=non_tensors or {})
