"""Typed configs of one TrainEngine: the optimizer (``OptimConfig``, the recipes' ``optim``
section as it is), FSDP2 behaviour (``FSDPConfig``) and the engine itself (``EngineConfig``).

Choices are plain ``str`` fields checked in ``__post_init__`` against the module-level tuples
(OmegaConf structured configs cannot hold ``Literal``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from verl_balance.loss import WEIGHT_MODES, check_agg_mode
from verl_balance.models.attention import ATTN_IMPLS

LR_SCHEDULERS = ("constant", "cosine")
PARAM_DTYPES = ("float32", "bfloat16")
MODEL_TYPES = ("language_model", "value_model")
DEFAULT_LOGITS_CHUNK_SIZE = 1024

# Field metadata read by trainer/checkpoint/resume_policy.py: what a resumed run may change (the trainer's
# recipes nest these classes). "apply": the new value is used from the next step on.
ON_RESUME = "on_resume"
APPLY_ON_RESUME = {ON_RESUME: "apply"}
LAYOUT_ON_RESUME = {ON_RESUME: "layout"}


class EngineConfigError(ValueError):
    """A bad engine configuration value."""


@dataclass
class OptimConfig:
    """AdamW with linear warmup, then a constant or cosine learning rate (verl's SFT key names).
    Every key may change on resume (applied to the restored optimizer and schedule)."""

    lr: float = field(default=1e-5, metadata=APPLY_ON_RESUME)
    """Peak learning rate."""
    weight_decay: float = field(default=0.01, metadata=APPLY_ON_RESUME)
    """AdamW decoupled weight decay."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999], metadata=APPLY_ON_RESUME)
    """AdamW (beta1, beta2)."""
    eps: float = field(default=1e-8, metadata=APPLY_ON_RESUME)
    """AdamW epsilon."""
    clip_grad: float | None = field(default=1.0, metadata=APPLY_ON_RESUME)
    """Max global gradient norm; null (or 0) disables clipping. The norm is logged either way."""
    warmup_steps_ratio: float = field(default=0.0, metadata=APPLY_ON_RESUME)
    """Fraction of the run's optimizer steps spent in linear warmup (rounded to whole steps)."""
    lr_scheduler: str = field(default="constant", metadata=APPLY_ON_RESUME)
    """After warmup: 'constant' or 'cosine' (decays to min_lr_ratio * lr at the last step)."""
    min_lr_ratio: float = field(default=0.0, metadata=APPLY_ON_RESUME)
    """Floor of the cosine schedule as a fraction of lr."""

    def __post_init__(self) -> None:
        if self.lr_scheduler not in LR_SCHEDULERS:
            raise EngineConfigError(f"optim.lr_scheduler={self.lr_scheduler!r}; valid: {list(LR_SCHEDULERS)}")
        if not self.lr > 0:
            raise EngineConfigError(f"optim.lr={self.lr} must be > 0")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise EngineConfigError(f"optim.betas={list(self.betas)} must be two numbers in [0, 1)")
        if not 0 <= self.warmup_steps_ratio <= 1:
            raise EngineConfigError(f"optim.warmup_steps_ratio={self.warmup_steps_ratio} must be in [0, 1]")
        if not 0 <= self.min_lr_ratio <= 1:
            raise EngineConfigError(f"optim.min_lr_ratio={self.min_lr_ratio} must be in [0, 1]")
        if self.clip_grad is not None and self.clip_grad < 0:
            raise EngineConfigError(f"optim.clip_grad={self.clip_grad} must be > 0, or null/0 for no clipping")

    @property
    def max_grad_norm(self) -> float:
        """The clipping threshold, inf when clipping is off."""
        return float(self.clip_grad) if self.clip_grad else float("inf")


@dataclass
class FSDPConfig:
    """How FSDP2 shards and synchronises across the micro-batches of one step. Memory costs are per
    rank, for P parameters on W ranks (param_dtype b bytes); the defaults use the least memory.
    Gradients are reduce-scattered exactly once, with the same factor G, under every setting.
    """

    reshard_after_forward: bool = True
    """Free each unit's all-gathered parameters after its forward. False saves one all-gather per unit
    per micro-batch and costs up to P * b bytes held from forward to backward."""
    reshard_after_backward: bool = True
    """Free each unit's all-gathered parameters after its backward. False keeps them unsharded until
    the step's last backward (with reshard_after_forward=False: one all-gather per step); costs
    P * b bytes for the whole step."""
    defer_gradient_sync: bool = False
    """Accumulate unsharded gradients and reduce-scatter once, after the last micro-batch's backward.
    Saves (micro-batches - 1) reduce-scatters per step; costs 4 * P bytes for the whole step."""
    param_offload: bool = False
    """verl's key: keep the sharded parameters, gradients and AdamW state in CPU memory on CUDA
    workers (FSDP2's ``CPUOffloadPolicy``; the optimizer steps on the CPU). Saves (b + 4 + 8) * P / W
    device bytes for host-device copies every micro-batch. No effect on CPU workers (logged)."""
    optimizer_offload: bool = False
    """verl's key: the optimizer state in CPU memory; on CUDA the same policy as param_offload. No
    effect on CPU workers."""
    offload_policy: bool = False
    """verl's FSDP2 switch for the same CPUOffloadPolicy (either of the three turns it on)."""


# ---------------------------------------------------------------------- the engine's keys, one home each
# Each engine key is one field of one of these groups, named as verl names it. EngineConfig inherits
# them, and so do the recipe sections that hold them (trainer/config/sft.py, trainer/config/grpo.py),
# so a key has one name, one default and one docstring; the recipes' key maps are derived from
# the groups (trainer/config/recipe.engine_keys) and the verl backend reads LoRAKeys / KernelKeys by their names. A
# group holds no checks: EngineConfig.__post_init__ checks the values, naming the user's key.
ENGINE_FIELD = "engine_field"
"""Field metadata: the EngineConfig field a group field feeds when the names differ (fsdp_config)."""


@dataclass
class ActorKeys:
    """verl's ``actor`` keys of the engine (also the critic's, and the SFT recipe's top level)."""

    loss_agg_mode: str = "token-mean"
    """Loss aggregation: one of loss.WEIGHT_MODES (the SFT recipe accepts loss.AGG_MODES)."""
    loss_scale_factor: Optional[float] = None
    """The constant C of seq-mean-token-sum-norm (e.g. the response length)."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """The engine's optimizer and learning-rate schedule."""


@dataclass
class HeadKeys:
    """The output head's key."""

    logits_chunk_size: int = field(default=DEFAULT_LOGITS_CHUNK_SIZE, metadata=LAYOUT_ON_RESUME)
    """Tokens per chunk of the output head: log-probs, entropy and their gradients are computed chunk
    by chunk (exact), holding about logits_chunk_size x vocab fp32 values instead of tokens x vocab.
    0 = unchunked (full logits)."""


@dataclass
class FSDPKeys(HeadKeys):
    """verl's ``fsdp_config`` beside the output head's key."""

    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig, metadata={**LAYOUT_ON_RESUME, ENGINE_FIELD: "fsdp"})
    """verl's key: the engine's FSDP2 switches; the defaults use the least memory."""


@dataclass
class CriticFSDPKeys:
    """verl's critic spelling of the engine's FSDP2 switches (``critic.fsdp``, its own section in verl)."""

    fsdp: FSDPConfig = field(default_factory=FSDPConfig, metadata=LAYOUT_ON_RESUME)
    """verl's key: the critic engine's FSDP2 switches (independent of the actor's)."""


@dataclass
class LoRAKeys:
    """verl's LoRA keys of ``model`` (its HFModelConfig's names: the verl backend reads them so)."""

    lora_rank: int = 0
    """verl's key: LoRA rank; 0 = off (full fine-tuning). > 0 (Hugging Face models only): peft LoRA
    adapters are the only trainable parameters and the only ones with optimizer state."""
    lora_alpha: float = 16.0
    """verl's key: LoRA scaling numerator (the adapter's update is lora_alpha / lora_rank * B @ A)."""
    target_modules: Any = "all-linear"
    """verl's key: 'all-linear' (every decoder Linear, not the output head) or a list of module names."""
    exclude_modules: Any = None
    """verl's key: module names (a list, or a regex string) that never get an adapter; null = none."""
    lora_adapter_path: Optional[str] = None
    """verl's key: a peft adapter directory to start from (its rank, alpha and targets are its own).
    null = new adapters drawn from the seed (B = 0)."""


@dataclass
class ModelKeys(LoRAKeys):
    """The engine keys of a recipe's ``model`` section: the parameter dtype and LoRA."""

    param_dtype: str = "float32"
    """Dtype of the parameters the engine computes in: one of engine.config.PARAM_DTYPES."""


@dataclass
class KernelKeys:
    """Engine keys the verl backend's ``engine`` config shares by name (no recipe key sets them)."""

    attn_impl: str = "auto"
    """The packed-attention implementation: one of models.attention.ATTN_IMPLS."""


ENGINE_KEY_GROUPS = (ActorKeys, HeadKeys, FSDPKeys, CriticFSDPKeys, LoRAKeys, ModelKeys, KernelKeys)
"""Every group; a field declared in one of them is an engine key (trainer/config/recipe.engine_keys)."""


@dataclass
class EngineConfig(KernelKeys, ModelKeys, HeadKeys, ActorKeys):
    """Settings of TrainEngine: the key groups above plus what the trainer supplies."""

    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    """FSDP2's switches (a recipe's ``fsdp_config``)."""
    model_type: str = "language_model"
    """What the engine trains: 'language_model' (LossFn gets ``log_probs=``) or 'value_model' (a
    scalar head per token, the critic; its loss gets ``values=``)."""
    total_steps: int | None = None
    """Optimizer steps of the run (the schedule's length); None without a schedule that needs it."""
    seed: int = 0
    """Seed of the initial weights and new LoRA adapters (the recipes pass trainer.seed)."""
    profile_steps: list[int] = field(default_factory=list)
    """1-based train steps to trace with torch.profiler on every rank, into profile_dir; empty = never."""
    profile_dir: str = "profile"
    """Directory of the traces: <profile_dir>/step_<N>/rank_<R>.trace.json (Chrome/Perfetto)."""

    def __post_init__(self) -> None:
        check_agg_mode(self.loss_agg_mode, valid=WEIGHT_MODES)
        if self.model_type not in MODEL_TYPES:
            raise EngineConfigError(f"model_type={self.model_type!r}; valid: {list(MODEL_TYPES)}")
        if self.model_type == "value_model" and self.lora_rank:
            raise EngineConfigError(
                f"lora_rank={self.lora_rank} with model_type='value_model': LoRA on the value model is not "
                "supported yet; set lora_rank=0 for the critic"
            )
        if isinstance(self.lora_rank, bool) or not isinstance(self.lora_rank, int) or self.lora_rank < 0:
            raise EngineConfigError(f"lora_rank={self.lora_rank!r} must be an int >= 0 (0 = LoRA off)")
        if self.lora_rank and not self.lora_alpha > 0:
            raise EngineConfigError(f"lora_alpha={self.lora_alpha!r} must be > 0")
        if self.lora_adapter_path and not self.lora_rank:
            raise EngineConfigError(
                f"lora_adapter_path={self.lora_adapter_path!r} is set but lora_rank=0 (LoRA off); set lora_rank > 0 "
                "to train the adapter (its own rank is used) or remove lora_adapter_path"
            )
        if self.optim.lr_scheduler == "cosine" and not self.total_steps:
            raise EngineConfigError("optim.lr_scheduler='cosine' needs total_steps > 0")
        if self.param_dtype not in PARAM_DTYPES:
            raise EngineConfigError(f"param_dtype={self.param_dtype!r}; valid: {list(PARAM_DTYPES)}")
        if self.attn_impl not in ATTN_IMPLS:
            raise EngineConfigError(f"attn_impl={self.attn_impl!r}; valid: {list(ATTN_IMPLS)}")
        if self.loss_agg_mode == "seq-mean-token-sum-norm" and not (
            self.loss_scale_factor and self.loss_scale_factor > 0
        ):
            raise EngineConfigError(
                "loss_agg_mode='seq-mean-token-sum-norm' needs loss_scale_factor > 0 (the constant C)"
            )
        if isinstance(self.logits_chunk_size, bool) or not (
            isinstance(self.logits_chunk_size, int) and self.logits_chunk_size >= 0
        ):
            raise EngineConfigError(
                f"logits_chunk_size={self.logits_chunk_size!r} must be an int >= 1 (tokens per chunk), or 0 = unchunked"
            )
        bad_steps = [s for s in self.profile_steps if int(s) < 1]
        if bad_steps:
            raise EngineConfigError(f"profile_steps={list(self.profile_steps)}: steps are 1-based, got {bad_steps}")

    @property
    def warmup_steps(self) -> int:
        """Whole warmup steps: optim.warmup_steps_ratio of total_steps."""
        return int(round(self.optim.warmup_steps_ratio * (self.total_steps or 0)))
