"""``verl_balance`` as a verl 0.9 training-engine backend (``EngineRegistry``), selected by config.

Loaded in every verl process through ``VERL_USE_EXTERNAL_MODULES`` (or ``model.external_lib``)::

    VERL_USE_EXTERNAL_MODULES=verl_balance.integrations.verl.engine
    ... engine.strategy=verl_balance engine._target_=verl_balance.integrations.verl.engine.VerlBalanceEngineConfig

``VerlBalanceEngine`` implements verl's ``BaseEngine`` contract over our ``TrainEngine``: input is
verl's no-padding TensorDict of one DP rank; micro-batches are planned by ``balance.plan_balance``
under verl's cap / size, every DP rank running the same number (a short rank runs a zero-weight
filler); output is exactly what verl's ``FSDPEngine`` returns, plus ``verl_balance/engine_*`` metrics.

The ``loss_function`` is verl's own, so loss values follow verl's conventions. The backward scales
by G / dp (= sp) to give exactly verl's gradient.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from dataclasses import dataclass, fields, replace

import numpy as np
import torch
import torch.distributed as dist

from verl_balance.batch_keys import (
    ATTENTION_MASK_KEY,
    ENTROPY_KEY,
    INPUT_IDS_KEY,
    LOG_PROBS_KEY,
    LOSS_MASK_KEY,
    RESPONSE_MASK_KEY,
    TEMPERATURE_KEY,
    VALUES_KEY,
)
from verl_balance.integrations.verl.backend.sealed_checkpoint import seal, unseal, verify_sealed
from verl_balance.integrations.verl.backend.trainer_files import verify_trainer_files
from verl_balance.integrations.verl.compat import hf_entry_identity
from verl_balance.integrations.verl.errors import require_verl

require_verl()

from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.utils.device import get_device_name  # noqa: E402
from verl.utils.py_functional import append_to_dict  # noqa: E402
from verl.workers.config import EngineConfig as VerlEngineConfig  # noqa: E402
from verl.workers.config import FSDPEngineConfig  # noqa: E402
from verl.workers.engine.base import BaseEngine, EngineRegistry  # noqa: E402

from verl_balance.balance.plan import plan_balance, sync_figures  # noqa: E402
from verl_balance.distributed.layout import ParallelLayout  # noqa: E402
from verl_balance.engine.config import (  # noqa: E402
    DEFAULT_LOGITS_CHUNK_SIZE,
    EngineConfig,
    FSDPConfig,
    KernelKeys,
    LoRAKeys,
    OptimConfig,
)
from verl_balance.engine.train_engine import TrainEngine  # noqa: E402
from verl_balance.models.attention import ATTN_IMPLS  # noqa: E402

logger = logging.getLogger(__name__)

__all__ = [
    "BACKEND",
    "VerlBalanceEngine",
    "VerlBalanceEngineConfig",
    "VerlBalanceEngineConfigError",
    "VerlBalanceValueEngine",
    "as_verl_balance_config",
    "plan_checkpoint_retention",
]

BACKEND = "verl_balance"
WORKLOADS = ("flops", "tokens")


class VerlBalanceEngineConfigError(ValueError):
    """A bad ``engine.*`` value for the verl_balance backend."""


_PARAM_DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp32": "float32", "float32": "float32"}


@dataclass
class VerlBalanceEngineConfig(FSDPEngineConfig, KernelKeys):
    """verl's ``FSDPEngineConfig`` keys (so verl's ``engine: fsdp`` YAML carries over) plus this
    backend's own; the Hydra ``_target_`` of ``engine`` for the SFT trainers.

    Read from the FSDP keys: ``ulysses_sequence_parallel_size``, ``seed``, ``reshard_after_forward``,
    ``use_no_sync_for_gradient_accumulation``, ``mixed_precision.param_dtype`` (bf16 by default),
    the ``entropy_*`` chunking keys. Offload is rejected; other FSDP-only keys do not apply."""

    strategy: str = BACKEND
    balance: bool = True
    """Plan micro-batches with verl_balance's planner (False: its naive contiguous plan)."""
    workload: str = "flops"
    """Cost model of a sample: 'flops' (the model's dimensions, quadratic attention) or 'tokens'."""
    logits_chunk_size: int | None = None
    """Tokens per chunk of the output head. null: verl's ``entropy_from_logits_chunk_size`` when
    ``entropy_from_logits_with_chunking`` or ``entropy_checkpointing`` is set, else verl_balance's
    default; 0 = unchunked."""

    def __post_init__(self):
        VerlEngineConfig.__post_init__(self)  # FSDPEngineConfig's check admits only its own strategies
        if self.strategy != BACKEND:
            raise VerlBalanceEngineConfigError(f"engine.strategy={self.strategy!r}; this config is for {BACKEND!r}")
        if self.workload not in WORKLOADS:
            raise VerlBalanceEngineConfigError(f"engine.workload={self.workload!r}; valid: {list(WORKLOADS)}")
        if self.attn_impl not in ATTN_IMPLS:
            raise VerlBalanceEngineConfigError(f"engine.attn_impl={self.attn_impl!r}; valid: {list(ATTN_IMPLS)}")
        dtype = self.param_dtype_name  # validates mixed_precision.param_dtype
        assert dtype in _PARAM_DTYPES.values()
        # grad_offload: verl main (0.10.dev) only; absent in verl 0.9.1's FSDPEngineConfig
        if self.param_offload or self.optimizer_offload or self.offload_policy or getattr(self, "grad_offload", False):
            raise VerlBalanceEngineConfigError(
                "engine.param_offload / optimizer_offload / offload_policy / grad_offload: offload "
                "is not implemented by the verl_balance backend; set them to false"
            )
        if self.logits_chunk_size == 0 and (self.entropy_from_logits_with_chunking or self.entropy_checkpointing):
            raise VerlBalanceEngineConfigError(
                "engine.logits_chunk_size=0 (unchunked head) contradicts engine.entropy_from_logits_with_chunking / "
                "entropy_checkpointing=true; set logits_chunk_size to null or a positive chunk size"
            )
        if not (isinstance(self.ulysses_sequence_parallel_size, int) and self.ulysses_sequence_parallel_size >= 1):
            raise VerlBalanceEngineConfigError(
                f"engine.ulysses_sequence_parallel_size={self.ulysses_sequence_parallel_size!r} must be an int >= 1"
            )

    @property
    def head_chunk_size(self) -> int:
        """The engine's ``logits_chunk_size`` (see the field)."""
        if self.logits_chunk_size is not None:
            return int(self.logits_chunk_size)
        if self.entropy_from_logits_with_chunking or self.entropy_checkpointing:
            return int(self.entropy_from_logits_chunk_size)
        return DEFAULT_LOGITS_CHUNK_SIZE

    @property
    def param_dtype_name(self) -> str:
        """'float32' or 'bfloat16' from ``mixed_precision.param_dtype`` (verl's default: bf16)."""
        dtype = str(dict(self.mixed_precision or {}).get("param_dtype", "bf16")).lower()
        if dtype not in _PARAM_DTYPES:
            raise VerlBalanceEngineConfigError(
                f"engine.mixed_precision.param_dtype={dtype!r}; the verl_balance backend supports "
                f"{sorted(_PARAM_DTYPES)}"
            )
        return _PARAM_DTYPES[dtype]


def as_verl_balance_config(engine_config) -> VerlBalanceEngineConfig:
    """The backend's config from a verl engine config (an ``FSDPEngineConfig`` is copied field by field)."""
    if isinstance(engine_config, VerlBalanceEngineConfig):
        return engine_config
    if not isinstance(engine_config, FSDPEngineConfig):
        raise VerlBalanceEngineConfigError(
            f"engine config is a {type(engine_config).__name__}; strategy={BACKEND!r} needs an FSDPEngineConfig "
            "or engine._target_=verl_balance.integrations.verl.engine.VerlBalanceEngineConfig"
        )
    kwargs = {
        f.name: getattr(engine_config, f.name)
        for f in fields(FSDPEngineConfig)
        if f.init and not f.name.startswith("_") and f.name != "strategy"
    }
    return VerlBalanceEngineConfig(**kwargs)


def _defer_gradient_sync(engine_config) -> bool:
    """verl's ``use_no_sync_for_gradient_accumulation``; absent (verl >= 0.10) means True."""
    return bool(getattr(engine_config, "use_no_sync_for_gradient_accumulation", True))


def _our_engine_config(engine_config: VerlBalanceEngineConfig, optimizer_config, *, model_config=None) -> EngineConfig:
    """verl's engine + optimizer (+ model LoRA) configs -> verl_balance's EngineConfig."""
    scheduler = (
        getattr(optimizer_config, "lr_scheduler_type", None)
        or getattr(optimizer_config, "warmup_style", None)
        or "constant"
    )
    total = getattr(optimizer_config, "total_training_steps", None)
    warmup_ratio = getattr(optimizer_config, "lr_warmup_steps_ratio", 0.0) or 0.0
    warmup_steps = getattr(optimizer_config, "lr_warmup_steps", None)
    if warmup_steps is not None and warmup_steps > 0:
        if not (total and total > 0):
            raise VerlBalanceEngineConfigError(
                f"optim.lr_warmup_steps={warmup_steps} needs optim.total_training_steps > 0 (got {total})"
            )
        warmup_ratio = warmup_steps / total
    optim = OptimConfig(
        lr=float(optimizer_config.lr),
        weight_decay=float(optimizer_config.weight_decay),
        betas=list(optimizer_config.betas),
        clip_grad=optimizer_config.clip_grad,
        warmup_steps_ratio=float(warmup_ratio),
        lr_scheduler=scheduler,
        min_lr_ratio=float(getattr(optimizer_config, "min_lr_ratio", None) or 0.0),
    )
    fsdp = FSDPConfig(
        reshard_after_forward=engine_config.reshard_after_forward,
        defer_gradient_sync=_defer_gradient_sync(engine_config),
    )
    return EngineConfig(
        optim=optim,
        fsdp=fsdp,
        total_steps=total if total and total > 0 else None,
        param_dtype=engine_config.param_dtype_name,
        seed=engine_config.seed,
        logits_chunk_size=engine_config.head_chunk_size,
        **{f.name: getattr(engine_config, f.name) for f in fields(KernelKeys)},
        **_lora_keys(model_config),
    )


def _lora_keys(model_config) -> dict:
    """verl's FSDP LoRA keys of ``model.*`` -> our EngineConfig's ({} without a model config);
    VerlBalanceEngineConfigError naming the verl key for a value this backend cannot honour."""
    if model_config is None:
        return {}
    rank = getattr(model_config, "lora_rank", 0) or 0
    megatron_lora = dict(getattr(model_config, "lora", None) or {})
    if not rank and (megatron_lora.get("rank") or 0) > 0:
        raise VerlBalanceEngineConfigError(
            f"model.lora.rank={megatron_lora['rank']} is verl's Megatron LoRA config; the verl_balance backend "
            "(like verl's fsdp engines) reads model.lora_rank / lora_alpha / target_modules: set those"
        )
    if not rank:
        if getattr(model_config, "lora_adapter_path", None):
            raise VerlBalanceEngineConfigError(
                f"model.lora_adapter_path={model_config.lora_adapter_path!r} is set but model.lora_rank=0; set "
                "model.lora_rank > 0 to train the adapter (its own rank is used) or remove lora_adapter_path"
            )
        return {}
    if getattr(model_config, "target_parameters", None):
        raise VerlBalanceEngineConfigError(
            f"model.target_parameters={model_config.target_parameters!r}: LoRA on nn.Parameter targets is not "
            "supported by the verl_balance backend; set it to null (target_modules names Linear modules)"
        )
    target_modules = _module_names(model_config.target_modules)
    if target_modules is None:
        raise VerlBalanceEngineConfigError(
            "model.target_modules=null: the verl_balance backend needs 'all-linear' or a list of module names"
        )
    keys = {f.name: getattr(model_config, f.name, f.default) for f in fields(LoRAKeys)}  # verl's names
    return {
        **keys,
        "lora_rank": int(rank),
        "lora_alpha": float(keys["lora_alpha"]),
        "target_modules": target_modules,
        "exclude_modules": _module_names(keys["exclude_modules"]),
    }


def _module_names(value):
    """A string, None, or a list of strings (from an OmegaConf ListConfig / tuple)."""
    if value is None or isinstance(value, str):
        return value
    return [str(v) for v in value]


def plan_checkpoint_retention(
    saved_paths: list[str], new_path: str, *, max_ckpt_to_keep: int | None
) -> tuple[list[str], list[str]]:
    """(paths to remember, paths to delete) after ``new_path`` was saved: keep the newest
    ``max_ckpt_to_keep`` (None or 0: all). A re-save counts once; ``new_path`` and its parents are
    never deleted. Pure bookkeeping."""
    if max_ckpt_to_keep is not None and (
        isinstance(max_ckpt_to_keep, bool) or not isinstance(max_ckpt_to_keep, int) or max_ckpt_to_keep < 0
    ):
        raise VerlBalanceEngineConfigError(
            f"max_ckpt_to_keep={max_ckpt_to_keep!r} (verl's trainer.max_ckpt_to_keep / max_actor_ckpt_to_keep): "
            "valid: None or 0 (keep every checkpoint) or a positive int"
        )
    new_path = os.path.abspath(new_path)
    kept = [p for p in saved_paths if p != new_path] + [new_path]
    if not max_ckpt_to_keep or len(kept) <= max_ckpt_to_keep:
        return kept, []
    oldest, kept = kept[:-max_ckpt_to_keep], kept[-max_ckpt_to_keep:]
    protected = [p for p in oldest if os.path.commonpath([p, new_path]) == p]
    if protected:
        logger.warning("not deleting old checkpoint(s) %s: they contain the one just saved, %s", protected, new_path)
    return kept, [p for p in oldest if p not in protected]


@EngineRegistry.register(model_type="language_model", backend=BACKEND, device=["cpu", "cuda"])
class VerlBalanceEngine(BaseEngine):
    """verl ``BaseEngine`` over verl_balance's ``TrainEngine``, driven through its public micro-batch
    API only (the calls ``TrainEngine.train_batch`` is made of)."""

    def __init__(
        self, model_config, engine_config: VerlBalanceEngineConfig, optimizer_config, checkpoint_config=None, **kwargs
    ):
        super().__init__()
        engine_config = as_verl_balance_config(engine_config)
        self.model_config, self.engine_config = model_config, engine_config
        self.optimizer_config, self.checkpoint_config = optimizer_config, checkpoint_config
        world = dist.get_world_size()
        sp = engine_config.ulysses_sequence_parallel_size
        if world % sp:
            raise VerlBalanceEngineConfigError(
                f"engine.ulysses_sequence_parallel_size={sp} does not divide the world size {world}"
            )
        self.layout = ParallelLayout(dp=world // sp, sp=sp, device_type=get_device_name())
        self.engine: TrainEngine | None = None
        self.mode = None
        # Absolute paths this engine saved, oldest first (verl's CheckpointManager.previous_saved_paths).
        self.saved_checkpoint_paths: list[str] = []

    # ------------------------------------------------------------------ setup
    def initialize(self):
        """Build the sharded model and optimizer (verl's HF directory, our HF adapter)."""
        from verl_balance.models.hf import HFModelConfig

        path = self.model_config.local_path or self.model_config.path
        ours = HFModelConfig.from_pretrained(
            path, enable_gradient_checkpointing=bool(getattr(self.model_config, "enable_gradient_checkpointing", False))
        )
        self.engine = TrainEngine(
            model_config=ours,
            layout=self.layout,
            engine_config=_our_engine_config(self.engine_config, self.optimizer_config, model_config=self.model_config),
        )
        if self.engine_config.workload == "tokens":
            self.engine.flops_workload = None
        self.module = self.engine.model

    @property
    def is_param_offload_enabled(self) -> bool:
        return False

    @property
    def is_optimizer_offload_enabled(self) -> bool:
        return False

    def train_mode(self, **kwargs):
        """Context: the model in train mode (no offload to undo)."""
        return _ModeCtx(self, "train")

    def eval_mode(self, **kwargs):
        """Context: the model in eval mode."""
        return _ModeCtx(self, "eval")

    def to(self, device: str, model: bool = True, optimizer: bool = True, grad: bool = True):
        """Move the model and/or optimizer state to 'cpu' or back to the device; a no-op on CPU."""
        from verl.utils.fsdp_utils import (
            load_fsdp_model_to_gpu,
            load_fsdp_optimizer,
            offload_fsdp_model_to_cpu,
            offload_fsdp_optimizer,
        )

        device_name = get_device_name()
        if device == "device":
            device = device_name
        if device not in (device_name, "cpu"):
            raise VerlBalanceEngineConfigError(f"engine.to(device={device!r}); valid: 'cpu', {device_name!r}, 'device'")
        if device_name == "cpu" or self.engine_config.forward_only:
            return
        if device == "cpu":
            if model:
                offload_fsdp_model_to_cpu(self.engine.model)
            if optimizer:
                offload_fsdp_optimizer(self.engine.optimizer)
        else:
            if model:
                load_fsdp_model_to_gpu(self.engine.model)
            if optimizer:
                load_fsdp_optimizer(self.engine.optimizer, self.layout.device)

    # ------------------------------------------------------------------ groups
    def get_data_parallel_rank(self):
        """This rank's index in the DP group."""
        return self.layout.dp_rank

    def get_data_parallel_size(self):
        """Number of DP groups (world / sp)."""
        return self.layout.dp

    def get_data_parallel_group(self):
        """The process group of the ranks with this SP rank (disjoint samples)."""
        return self.layout.dp_group

    def get_context_parallel_group(self):
        """The Ulysses SP group."""
        return self.layout.sp_group

    def is_mp_src_rank_with_outputs(self):
        """SP rank 0 of each DP group reports (every SP rank holds the same outputs)."""
        return self.layout.sp_rank == 0

    # ------------------------------------------------------------------ optimizer
    def optimizer_zero_grad(self):
        """Clear gradients."""
        self.engine.zero_grad()

    def optimizer_step(self):
        """Clip, step (skipped on a non-finite norm, on every rank together); returns the pre-clip norm."""
        return self.engine.optimizer_step()["grad_norm"]

    def lr_scheduler_step(self):
        """Advance the LR schedule one step; returns the new learning rate."""
        return self.engine.advance_schedule()

    # ------------------------------------------------------------------ micro-batches
    def _plan(self, data) -> tuple[list[list[int]], dict]:
        """This rank's micro-batches (ascending row indices) in run order, the DP-agreed count and the
        plan's metrics (collective over DP)."""
        lengths = data[INPUT_IDS_KEY].offsets().diff().cpu().numpy()
        micro = self._agreed_micro_batches(data, lengths)
        workload = self.engine.flops_workload
        sample_cost = workload.cost(lengths) if workload is not None else lengths.astype(np.float64)
        planned_cost = np.array([float(sample_cost[m].sum()) for m in micro])
        # FSDP synchronises micro-batch j of every DP rank: running each rank's micro-batches from the
        # most to the least expensive lines up similar costs in the same slot (results do not depend
        # on the order; the loss is a sum over micro-batches).
        order = np.argsort(-planned_cost, kind="stable")
        metrics = self._sync_metrics(planned_cost, planned_cost[order])
        metrics["verl_balance/engine_num_micro_batches"] = len(micro)
        return [micro[k] for k in order], metrics

    def _agreed_micro_batches(self, data, lengths: np.ndarray) -> list[list[int]]:
        """This rank's planned micro-batches, padded to the DP group's maximum count (one all-reduce)."""
        use_dynamic_bsz = tu.get_non_tensor_data(data=data, key="use_dynamic_bsz", default=True)
        cap = size = None
        if use_dynamic_bsz:
            cap = int(tu.get_non_tensor_data(data=data, key="max_token_len_per_gpu", default=None))
        else:
            size = int(tu.get_non_tensor_data(data=data, key="micro_batch_size_per_gpu", default=None))
        plan = plan_balance(
            seq_lens=lengths,
            dp_size=1,
            sp_size=self.layout.sp,
            micro_batch_size=size,
            max_token_len_per_gpu=cap,
            balance=self.engine_config.balance,
            workload=self.engine.flops_workload if self.engine.flops_workload else "tokens",
        )
        micro = [sorted(int(i) for i in mb) for mb in plan.micro_batches[0] if len(mb)]
        count = torch.tensor([len(micro)], device=self.layout.device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=self.layout.dp_group)
        target = int(count.item())
        # Splitting a micro-batch never breaks the token cap; a rank with fewer rows than the agreed
        # count runs zero-weight fillers (empty lists) so that it joins every FSDP collective.
        while len(micro) < target and max(len(m) for m in micro) > 1:
            k = max(range(len(micro)), key=lambda j: len(micro[j]))
            half = len(micro[k]) // 2
            micro[k : k + 1] = [micro[k][:half], micro[k][half:]]
        return micro + [[] for _ in range(target - len(micro))]

    def _sync_metrics(self, planned_cost: np.ndarray, run_cost: np.ndarray) -> dict:
        """The DP imbalance and per-slot sync ratio of the planned and run order (one all-gather over DP)."""
        mine = torch.tensor(np.stack([planned_cost, run_cost]), dtype=torch.float64, device=self.layout.device)
        gathered = [torch.empty_like(mine) for _ in range(self.layout.dp)]
        dist.all_gather(gathered, mine, group=self.layout.dp_group)
        costs = torch.stack(gathered).cpu().numpy()  # [dp, (planned order, run order), micro]
        rank_total = costs[:, 0].sum(-1)
        dp_imbalance, _, _ = sync_figures(costs[:, 0], float(rank_total.mean()))
        _, _, planned_order_sync_ratio = sync_figures(costs[:, 0], float(rank_total.max()))
        _, _, sync_ratio = sync_figures(costs[:, 1], float(rank_total.max()))
        return {
            "verl_balance/engine_dp_imbalance": dp_imbalance,
            "verl_balance/engine_planned_order_sync_ratio": planned_order_sync_ratio,
            "verl_balance/engine_sync_ratio": sync_ratio,
        }

    def _model_output(self, micro_batch, *, calculate_entropy: bool) -> dict:
        """Forward one micro-batch; jagged log-probs (and entropy) in verl's alignment: position t
        holds log p(x[t+1] | x[<=t]), 0 at each sample's last position."""
        engine = self.engine
        ids = micro_batch[INPUT_IDS_KEY]
        lengths = ids.offsets().diff().cpu()
        input_ids = torch.nested.to_padded_tensor(ids, 0).cpu()
        attention_mask = (torch.arange(input_ids.shape[1])[None, :] < lengths[:, None]).long()
        (packed,) = engine.pack_micro_batches(
            [{INPUT_IDS_KEY: input_ids, ATTENTION_MASK_KEY: attention_mask}], require_loss_mask=False
        )
        temperature = tu.get_non_tensor_data(data=micro_batch, key=TEMPERATURE_KEY, default=1.0)
        if isinstance(temperature, torch.Tensor):
            temperature = packed.local_per_sample(temperature.float(), padding=1.0)
        else:
            temperature = float(temperature)
        # The engine's own log-probs (chunked output head: no [T, V] logits), gathered over SP.
        log_probs, entropy = engine.gathered_log_probs(packed, temperature=temperature, with_entropy=calculate_entropy)
        offsets = packed.cu_seqlens.to(log_probs.device)
        # Ours predict the next token at every position but each sample's last (loss mask 0 there);
        # verl holds 0 at that position.
        keep = torch.ones(packed.total_len, device=log_probs.device)
        keep[offsets[1:] - 1] = 0
        out = {LOG_PROBS_KEY: torch.nested.nested_tensor_from_jagged(log_probs * keep, offsets)}
        if calculate_entropy:
            out[ENTROPY_KEY] = torch.nested.nested_tensor_from_jagged(entropy, offsets)
        return out

    def _global_loss_tokens(self, data) -> float:
        """verl's ``batch_num_tokens``: loss-mask tokens of the mini-batch, summed over the DP group."""
        mask = data[LOSS_MASK_KEY] if LOSS_MASK_KEY in data.keys() else data[RESPONSE_MASK_KEY]
        local = mask.values().sum() if mask.is_nested else mask.sum()
        total = local.to(self.layout.device, torch.float32).reshape(1)
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self.get_data_parallel_group())
        return total.item()

    def _backward_scale(self) -> float:
        """G / dp: verl's loss undoes an average over dp only; ours is over dp * sp."""
        return self.engine.gradient_divide_factor / self.layout.dp

    def forward_backward_batch(self, data, loss_function, forward_only=False):
        """Plan, forward (and backward) every micro-batch with verl's ``loss_function``; verl's output dict."""
        tu.assign_non_tensor(data, sp_size=self.layout.sp)
        return_model_output = tu.get_non_tensor_data(data=data, key="return_model_output", default=False)
        calculate_entropy = bool(tu.get_non_tensor_data(data=data, key="calculate_entropy", default=False))
        dp_group = self.get_data_parallel_group()
        tu.assign_non_tensor(data, batch_num_tokens=self._global_loss_tokens(data), dp_size=self.layout.dp)
        micro, balance_metrics = self._plan(data)
        backward_scale = self._backward_scale()
        model = self.engine.model
        model.train(not forward_only)
        losses, metrics, outputs = [], {}, {}
        for k, rows in enumerate(micro):
            is_filler = not rows
            micro_batch = tu.index_select_tensor_dict(data, rows if rows else [0]).to(self.layout.device)
            if not forward_only:
                self.engine.prepare_backward(is_last=k == len(micro) - 1)
            with torch.set_grad_enabled(not forward_only):
                model_output = self._model_output(micro_batch, calculate_entropy=calculate_entropy)
                if loss_function is not None:
                    loss, mb_metrics = loss_function(model_output=model_output, data=micro_batch, dp_group=dp_group)
                else:
                    assert forward_only, "forward_only must be True when loss_function is None"
                    loss, mb_metrics = torch.zeros(()), {}
                if is_filler:
                    loss = loss * 0.0
                if not forward_only:
                    (loss * backward_scale).backward()
            if is_filler:
                continue
            losses.append(float(loss.detach()))
            append_to_dict(metrics, mb_metrics)  # verl's own merge (keeps its Metric aggregation types)
            if forward_only or return_model_output:
                for key, value in model_output.items():
                    outputs.setdefault(key, []).extend(t.detach() for t in value.unbind())
        if forward_only:
            self.engine.reshard()
        order = [i for rows in micro for i in rows]
        restore = np.argsort(np.asarray(order, dtype=np.int64), kind="stable")
        model_output = {
            key: torch.nested.as_nested_tensor([values[i] for i in restore], layout=torch.jagged)
            for key, values in outputs.items()
        }
        for key, value in balance_metrics.items():
            metrics[key] = [value]
        return {"model_output": model_output, "loss": losses, "metrics": metrics}

    # ------------------------------------------------------------------ weights and checkpoints
    def get_per_tensor_param(self, layered_summon=False, base_sync_done=False, **kwargs):
        """(generator of (HF name, full tensor), peft config dict or None): unsharded weights for the
        rollout's weight sync, as verl's FSDP engine gives them. Collective.

        Without LoRA: every weight; None. With LoRA: ``model.lora.merge=True``: merged weights, None;
        ``base_sync_done=False``: the base weights under peft's ``base_layer`` names and the peft
        config; ``base_sync_done=True``: the adapters only (peft adapter-file keys, on the host) and
        the peft config. ``layered_summon`` changes memory, not the result."""
        lora = getattr(self.engine.model, "lora_config", None)
        if lora is None:
            state = self.engine.full_state_dict()
            device = self.layout.device
            return ((name, tensor.to(device, non_blocking=True)) for name, tensor in state.items()), None
        return self._lora_per_tensor_param(lora, layered_summon=layered_summon, base_sync_done=base_sync_done)

    def _lora_per_tensor_param(self, lora, *, layered_summon: bool, base_sync_done: bool):
        """``get_per_tensor_param`` of a LoRA model (see there)."""
        from verl.utils.fsdp_utils import replace_lora_wrapper

        from verl_balance.engine.lora import base_name, is_lora_name, merged_state_dict, peft_key

        if layered_summon and not base_sync_done:
            raise ValueError(  # verl's own check and message (collect_lora_params)
                "To use layered_summon, you must make sure base-model is preloaded in vllm, e.g. let "
                "rollout.load_format=safetensors"
            )
        state = self.engine.full_state_dict()
        if dict(getattr(self.model_config, "lora", None) or {}).get("merge", False):
            device = self.layout.device
            merged = merged_state_dict(state, lora)
            return ((name, tensor.to(device, non_blocking=True)) for name, tensor in merged.items()), None
        if base_sync_done:
            params = {peft_key(name): tensor for name, tensor in state.items() if is_lora_name(name)}
        else:
            params = {
                replace_lora_wrapper(base_name(name), lora): tensor
                for name, tensor in state.items()
                if not is_lora_name(name)
            }
        return iter(params.items()), lora.to_dict()

    def get_per_tensor_param_shard(self, **kwargs):
        """(generator of (name, this rank's flat local bf16 shard, ShardSpec), None): verl's sharded
        export for delta checkpoint engines; nothing is gathered. Base weights only."""
        from verl_balance.integrations.verl.backend.shards import local_param_shards

        if getattr(self.engine.model, "lora_config", None) is not None:
            raise NotImplementedError(
                "get_per_tensor_param_shard (verl's delta weight sync) exports full weights only; with "
                "model.lora_rank > 0 use a checkpoint engine that syncs through get_per_tensor_param"
            )
        return local_param_shards(self.engine.model, device=self.layout.device), None

    def get_per_tensor_param_delta_shard(self, **kwargs):
        """verl's delta export: per weight, the elements changed since the last export, in HF coordinates."""
        try:
            from verl.workers.engine.utils import hf_delta_export

            entry_identity = hf_entry_identity()
        except ImportError as err:
            raise NotImplementedError(
                "get_per_tensor_param_delta_shard needs verl's delta weight sync (verl >= 0.9.1, "
                "verl.workers.engine.utils.hf_delta_export); the installed verl lacks it"
            ) from err
        self._delta_shard_snap = getattr(self, "_delta_shard_snap", {})
        gen, _ = self.get_per_tensor_param_shard()
        return hf_delta_export(gen, self._delta_shard_snap, entry_identity), None

    def disable_adapter(self):
        """Context: forwards use the base model alone; the adapters are untouched."""
        return _adapters_disabled(self.engine.model)

    def save_checkpoint(self, local_path, hdfs_path=None, global_step=0, max_ckpt_to_keep=None, **kwargs):
        """Sharded DCP checkpoint of model + optimizer + scheduler under ``local_path`` (collective).

        Keeps the newest ``max_ckpt_to_keep`` paths this engine saved (None or 0: all); older ones
        are deleted by global rank 0 only after every rank finished writing the new one.
        """
        if hdfs_path is not None:
            raise NotImplementedError(f"verl_balance engine: hdfs_path={hdfs_path!r} is not supported")
        # Checked before any collective: every rank gets the same value, so every rank raises together.
        kept, stale = plan_checkpoint_retention(
            self.saved_checkpoint_paths, local_path, max_ckpt_to_keep=max_ckpt_to_keep
        )
        os.makedirs(local_path, exist_ok=True)
        unseal(local_path)  # a save stopped half-way never looks complete
        self.engine.save_checkpoint(local_path, step=int(global_step), extra={"global_step": int(global_step)})
        self._save_export_files(local_path, step=int(global_step))
        seal(local_path, step=int(global_step), group=self.layout.world_group)
        self.saved_checkpoint_paths = kept
        if dist.get_rank() == 0:
            for path in stale:
                _remove_checkpoint_dir(path, max_ckpt_to_keep=max_ckpt_to_keep)

    def _save_export_files(self, local_path: str, *, step: int) -> None:
        """Write ``huggingface/`` (if ``hf_model`` is in save_contents) and always ``trainer_state.json``."""
        from verl_balance.integrations.verl.backend.checkpoint_files import HF_DIR, save_contents, write_trainer_state
        from verl_balance.models.hf import HFModelConfig

        ours = self.engine.model_config
        if "hf_model" in save_contents(self.checkpoint_config):
            tokenizer = getattr(self.model_config, "tokenizer_path", None) or ours.path
            self.engine.save_hf_model(os.path.join(local_path, HF_DIR), tokenizer_path=tokenizer)
        kind = "hf" if isinstance(ours, HFModelConfig) else "builtin"
        write_trainer_state(local_path, step=step, model_config={"kind": kind, **ours.to_dict()})

    def load_checkpoint(self, local_path, hdfs_path=None, del_local_after_load=False, **kwargs):
        """Restore ``save_checkpoint(local_path)`` (collective) after verifying its completeness record,
        checksums and data-loader state files; nothing but checkpoint data is unpickled."""
        if hdfs_path is not None:
            raise NotImplementedError(f"verl_balance engine: hdfs_path={hdfs_path!r} is not supported")
        if del_local_after_load:
            raise NotImplementedError("verl_balance engine: del_local_after_load=True is not supported")
        verify_sealed(local_path, group=self.layout.world_group)
        verify_trainer_files(local_path, group=self.layout.world_group)
        return self.engine.load_checkpoint(local_path)


@EngineRegistry.register(model_type="value_model", backend=BACKEND, device=["cpu", "cuda"])
class VerlBalanceValueEngine(VerlBalanceEngine):
    """verl's critic (``model_type="value_model"``) on verl_balance, planned and stepped as
    ``VerlBalanceEngine``.

    ``model_output`` is ``{"values": jagged}`` as verl's ``FSDPEngineWithValueHead`` returns it:
    position t holds the head on token t (no shift)."""

    def initialize(self):
        """Build the sharded value model and its optimizer from verl's critic model directory."""
        from verl_balance.models.hf import HFModelConfig

        path = self.model_config.local_path or self.model_config.path
        ours = HFModelConfig.from_pretrained(
            path, enable_gradient_checkpointing=bool(getattr(self.model_config, "enable_gradient_checkpointing", False))
        )
        config = replace(_our_engine_config(self.engine_config, self.optimizer_config), model_type="value_model")
        self.engine = TrainEngine(model_config=ours, layout=self.layout, engine_config=config)
        if self.engine_config.workload == "tokens":
            self.engine.flops_workload = None
        self.module = self.engine.model

    def _model_output(self, micro_batch, *, calculate_entropy: bool) -> dict:
        """Forward one micro-batch; values as a jagged tensor (see the class docstring)."""
        ids = micro_batch[INPUT_IDS_KEY]
        lengths = ids.offsets().diff().cpu()
        input_ids = torch.nested.to_padded_tensor(ids, 0).cpu()
        attention_mask = (torch.arange(input_ids.shape[1])[None, :] < lengths[:, None]).long()
        (packed,) = self.engine.pack_micro_batches(
            [{INPUT_IDS_KEY: input_ids, ATTENTION_MASK_KEY: attention_mask}], require_loss_mask=False
        )
        values = self.engine.gathered_values(packed)
        return {VALUES_KEY: torch.nested.nested_tensor_from_jagged(values, packed.cu_seqlens.to(values.device))}

    def get_per_tensor_param(self, layered_summon=False, base_sync_done=False, **kwargs):
        """A critic's weights never go to a rollout."""
        raise NotImplementedError("verl_balance value model: a critic has no rollout weights to sync")


def _remove_checkpoint_dir(path: str, *, max_ckpt_to_keep: int) -> None:
    """Delete an old checkpoint directory; a failure is logged (the training run goes on)."""
    if not os.path.exists(path):
        logger.info("old checkpoint %s is already gone", path)
        return
    logger.info("removing old checkpoint %s (max_ckpt_to_keep=%d)", path, max_ckpt_to_keep)
    try:
        shutil.rmtree(path)
    except OSError as error:
        logger.warning("could not remove old checkpoint %s: %s", path, error)


@contextlib.contextmanager
def _adapters_disabled(model):
    """Set peft's per-layer ``disable_adapters`` flag for the block (requires_grad untouched);
    VerlBalanceEngineConfigError for a model without adapters."""
    from peft.tuners.lora import LoraLayer

    layers = [m for m in model.modules() if isinstance(m, LoraLayer)]
    if not layers:
        raise VerlBalanceEngineConfigError(
            "disable_adapter (verl's reference policy in the actor, ref_in_actor) needs LoRA: model.lora_rank > 0"
        )
    before = [m._disable_adapters for m in layers]
    for m in layers:
        m._disable_adapters = True
    try:
        yield
    finally:
        for m, flag in zip(layers, before):
            m._disable_adapters = flag


class _ModeCtx:
    """verl's train_mode/eval_mode context: sets the module mode; resets on exit (nothing offloaded)."""

    def __init__(self, engine: VerlBalanceEngine, mode: str):
        self.engine, self.mode = engine, mode

    def __enter__(self):
        self.engine.mode = self.mode
        self.engine.engine.model.train(self.mode == "train")
        return self.engine

    def __exit__(self, exc_type, exc, tb):
        self.engine.mode = None
        return False
