"""TrainEngine: one rank of an FSDP2 + Ulysses model, its optimizer and the loss contract.

Invariants:
- Parameters are sharded by FSDP2 over the flattened ("dp", "sp") mesh of all W ranks; the
  gradient divide factor G is W (G = 1 for a single unsharded fp32 rank).
- Every SP rank of a DP group receives the same micro-batches; every rank receives the same
  number of micro-batches (checked, else a collective hangs).
- train_batch and eval_loss share _run, composed of the public micro-batch methods, so an external
  loop calling them in the same order takes the same step. Per micro-batch a rank back-propagates
  G * sum(w * l) over its token slice (loss.py); the logged loss is the exact global objective.
- Zero valid tokens in the mini-batch: no forward, no optimizer step, a warning, loss 0; the LR
  schedule still advances.
- Each gradient is reduced exactly once with factor G, whatever FSDPConfig's accumulation switches.
- A value model differs only in ``_loss_inputs``: a ``ValueLossFn`` gets ``values=`` instead of
  ``log_probs=`` / ``entropy=``.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import time
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from verl_balance.batch_keys import (
    ATTENTION_MASK_KEY,
    ENTROPY_KEY,
    INPUT_IDS_KEY,
    LOG_PROBS_KEY,
    LOSS_MASK_KEY,
    POSITION_IDS_KEY,
    SUM_PI_SQUARED_KEY,
    VALUES_KEY,
)
from verl_balance.distributed.layout import ParallelLayout
from verl_balance.distributed.ulysses import gather_and_unpad
from verl_balance.engine.config import EngineConfig, EngineConfigError
from verl_balance.engine.lora import (
    BASE_FINGERPRINT_FILE,
    BaseMismatchError,
    apply_lora,
    base_fingerprint,
    base_mismatch_message,
    read_base_fingerprint,
    save_lora_config,
)
from verl_balance.engine.materialize import buffers_to, build_sharded_model, fill_lora, shard_model
from verl_balance.engine.offload import cpu_offload_policy
from verl_balance.engine.optim import apply_optim_config, build_optimizer
from verl_balance.engine.packing import MicroBatchError, PackedMicroBatch, pack_micro_batch
from verl_balance.engine.perf import TRAIN_FLOPS_PER_FORWARD, step_perf_metrics
from verl_balance.engine.profiling import step_profiler
from verl_balance.engine.timing import MicroBatchTimes, StepTimer
from verl_balance.loss import LossFn, SFTLoss, TokenWeights, all_reduce_sum, compute_token_weights
from verl_balance.models import ModelConfig
from verl_balance.models.base import PackedCausalLM
from verl_balance.models.output_head import Temperature, token_log_probs
from verl_balance.models.value import ValueModel
from verl_balance.utils import safe_load
from verl_balance.utils.atomic_io import atomic_write_json
from verl_balance.utils.confined import check_confined

__all__ = ["TrainEngine", "token_log_probs"]

logger = logging.getLogger(__name__)

_ENGINE_STATE_FILE = "engine_state.pt"


def _flops_workload(model_config):
    """The FLOPs model of the network, or None when its config lacks the dimensions."""
    from verl_balance.balance.errors import BalanceConfigError
    from verl_balance.balance.workload import FlopsWorkload

    try:
        return FlopsWorkload.from_model_config(model_config)
    except (BalanceConfigError, TypeError, ValueError):
        return None


def _timing_metrics(times: MicroBatchTimes) -> dict:
    """This rank's step timing (engine/timing.py): per-micro-batch wall and busy seconds."""
    return {
        "micro_batch_seconds": times.wall,
        "micro_batch_busy_seconds": times.busy,
        "busy_seconds": float(sum(times.busy)),
    }


class TrainEngine:
    """One rank of the training engine (no Ray); see the module docstring for invariants."""

    def __init__(
        self,
        *,
        model_config: ModelConfig,
        engine_config: EngineConfig,
        layout: ParallelLayout,
        model: PackedCausalLM | None = None,
    ):
        self.model_config, self.config, self.layout = model_config, engine_config, layout
        self.device = layout.device
        param_dtype = torch.bfloat16 if engine_config.param_dtype == "bfloat16" else torch.float32
        # One fp32 rank has nothing to shard, reduce or cast: FSDP2 would only add an unshard and
        # reshard per unit and micro-batch (measured ~20% of CPU step time on the small model).
        offload = cpu_offload_policy(
            engine_config.fsdp, device_type=self.device.type, log=layout.world_size == 1 or layout.rank == 0
        )
        self.sharded = layout.world_size > 1 or param_dtype != torch.float32 or offload is not None
        shard = None
        if self.sharded:
            shard = functools.partial(
                shard_model,
                mesh=layout.fsdp_mesh,
                param_dtype=param_dtype,
                reshard_after_forward=engine_config.fsdp.reshard_after_forward,
                offload_policy=offload,
            )
        if model is None:
            # Meta build, FSDP2, then only this rank's shard is allocated and filled: from the seed
            # (the same weights at every layout) or from this rank's rows of the safetensors.
            model = build_sharded_model(
                model_config,
                seed=engine_config.seed,
                sp_size=layout.sp,
                attn_impl=engine_config.attn_impl,
                device=self.device,
                shard=shard,
                lora=engine_config if engine_config.lora_rank else None,
                value_head=engine_config.model_type == "value_model",
                offload=offload is not None,
            )
        else:
            self._shard_given_model(model, shard=shard, offload=offload is not None)
        model.set_sequence_parallel_group(layout.sp_group if layout.sp > 1 else None)
        self.model = model
        # Only trainable parameters (all of them, or the LoRA adapters) get AdamW state.
        trainable = [p for p in model.parameters() if p.requires_grad]
        self.optimizer, self.scheduler = build_optimizer(trainable, config=engine_config)
        self.global_step = 0
        self.flops_workload = _flops_workload(model_config)

    def _shard_given_model(self, model: PackedCausalLM, *, shard, offload: bool) -> None:
        """A caller-built (materialized) model: LoRA applied, moved to the device, then sharded."""
        engine_config = self.config
        if isinstance(model, ValueModel) != (engine_config.model_type == "value_model"):
            raise EngineConfigError(
                f"model_type={engine_config.model_type!r} but the given model is a {type(model).__name__}; "
                "a value model is a models.value.ValueModel"
            )
        if engine_config.lora_rank:
            apply_lora(model, engine_config)
            fill_lora(model, engine_config)
        model.to(torch.device("cpu") if offload else self.device)
        if shard is not None:
            shard(model)
        if offload:
            buffers_to(model, self.device)

    @property
    def is_value_model(self) -> bool:
        """Whether this engine trains a value model (config.model_type="value_model")."""
        return self.config.model_type == "value_model"

    def _require_model_type(self, model_type: str, what: str) -> None:
        if self.config.model_type != model_type:
            raise EngineConfigError(
                f"{what} needs model_type={model_type!r}; this engine has {self.config.model_type!r}"
            )

    @property
    def gradient_divide_factor(self) -> int:
        """G: FSDP2 averages gradients over every rank of its (flattened dp x sp) mesh."""
        return self.layout.world_size

    # ------------------------------------------------------------------ micro-batch loop (public)
    # The steps of train_batch, public for a loop that drives micro-batches itself (verl's engine
    # backend in integrations/verl/engine.py); _run is built from the same calls. One train step:
    #   check_micro_batches -> zero_grad -> per micro-batch k of n: prepare_backward(is_last=k == n-1),
    #   forward_log_probs, the caller's loss, (G * local objective).backward() -> optimizer_step ->
    #   advance_schedule; forward-only passes end with reshard().
    def check_micro_batches(self, micro_batches: Sequence[Mapping[str, Tensor]]) -> None:
        """Raise MicroBatchError unless every rank has the same number (>= 1) of micro-batches and
        the SP ranks of each DP group hold identical ones in the same order.

        Collective: one all_gather over the world; call it on every rank before a step."""
        if self.layout.world_size == 1:
            if not micro_batches:
                raise MicroBatchError("need at least one micro-batch (an empty one is fine)")
            return
        fingerprint = [len(micro_batches), 0, 0]
        # The (tokens, ids) fingerprint only serves the SP-identity check.
        for k, mb in enumerate(micro_batches if self.layout.sp > 1 else ()):
            if ATTENTION_MASK_KEY not in mb or INPUT_IDS_KEY not in mb:
                continue  # pack_micro_batch names the missing key
            real = mb[ATTENTION_MASK_KEY] != 0
            fingerprint[1] += (k + 1) * int(real.sum())
            fingerprint[2] += int((mb[INPUT_IDS_KEY] * real).sum()) % 1_000_003
        mine = torch.tensor(fingerprint, dtype=torch.int64, device=self.device)
        gathered = [torch.empty_like(mine) for _ in range(self.layout.world_size)]
        dist.all_gather(gathered, mine, group=self.layout.world_group)
        everyone = torch.stack(gathered).cpu()
        counts = everyone[:, 0].tolist()
        if len(set(counts)) != 1:
            raise MicroBatchError(
                f"every rank must get the same number of micro-batches; got {counts} by global rank (use a BalancePlan)"
            )
        if counts[0] == 0:
            raise MicroBatchError("need at least one micro-batch (an empty one is fine)")
        per_dp = everyone[:, 1:].reshape(self.layout.dp, self.layout.sp, 2)
        if (per_dp != per_dp[:, :1]).any():
            raise MicroBatchError(
                "the SP ranks of a DP group must get identical micro-batches "
                "in the same order; (tokens, ids) fingerprints per rank "
                f"(dp x sp): {per_dp.tolist()}"
            )

    def pack_micro_batches(
        self, micro_batches: Sequence[Mapping[str, Tensor]], *, require_loss_mask: bool
    ) -> list[PackedMicroBatch]:
        """Wire micro-batches (right-padded (b, L) tensors) -> packed, target-aligned streams holding
        this SP rank's slice, copied to the device without waiting. No collective.
        ``require_loss_mask`` rejects a micro-batch without ``loss_mask``."""
        return self._pack(micro_batches, require_loss_mask=require_loss_mask)

    def forward_logits(self, packed: PackedMicroBatch) -> Tensor:
        """Logits [padded_len / sp, V] of this SP rank's token slice, in the parameter dtype.

        Collective (FSDP2 all-gathers, Ulysses all-to-alls): every rank of the mesh must call it once
        per micro-batch index in the same order, an empty micro-batch included."""
        return self.model(
            input_ids=packed.local(INPUT_IDS_KEY),
            position_ids=packed.local(POSITION_IDS_KEY),
            cu_seqlens=packed.cu_seqlens_padded,
            max_seqlen=packed.max_seqlen,
        )

    def forward_log_probs(
        self, packed: PackedMicroBatch, *, temperature: Temperature = 1.0, with_entropy: bool = False
    ) -> tuple[Tensor, Tensor | None]:
        """(log p(target) [padded_len / sp], entropy or None) of this SP rank's token slice at
        ``temperature`` (a float or a per-token tensor), fp32; computed in chunks of
        ``config.logits_chunk_size`` tokens (0: full logits). Collective as ``forward_logits``."""
        self._require_model_type("language_model", "forward_log_probs")
        return self.model(
            input_ids=packed.local(INPUT_IDS_KEY),
            position_ids=packed.local(POSITION_IDS_KEY),
            cu_seqlens=packed.cu_seqlens_padded,
            max_seqlen=packed.max_seqlen,
            targets=packed.local("targets"),
            temperature=temperature,
            with_entropy=with_entropy,
            logits_chunk_size=self.config.logits_chunk_size,
        )

    def forward_values(self, packed: PackedMicroBatch) -> Tensor:
        """Values [padded_len / sp] (fp32) of this SP rank's slice, target-aligned (a value model
        only). Collective as ``forward_logits``."""
        self._require_model_type("value_model", "forward_values")
        return self.model(
            input_ids=packed.local(INPUT_IDS_KEY),
            position_ids=packed.local(POSITION_IDS_KEY),
            cu_seqlens=packed.cu_seqlens_padded,
            max_seqlen=packed.max_seqlen,
        )

    def gathered_values(self, packed: PackedMicroBatch) -> Tensor:
        """Values [total_len] of the whole packed stream, gathered over the SP group, padding dropped;
        gradients flow back to each rank's slice. Collective as ``forward_values`` plus an SP all-gather."""
        return gather_and_unpad(self.forward_values(packed), group=self.layout.sp_group, length=packed.total_len)

    def gathered_log_probs(
        self, packed: PackedMicroBatch, *, temperature: Temperature = 1.0, with_entropy: bool = False
    ) -> tuple[Tensor, Tensor | None]:
        """(log p(target) [total_len], entropy [total_len] or None) of the whole packed stream,
        target-aligned, gathered over the SP group, padding dropped; gradients flow back to each
        rank's slice. Collective as ``forward_log_probs`` plus one SP all-gather per output."""
        log_probs, entropy = self.forward_log_probs(packed, temperature=temperature, with_entropy=with_entropy)
        group, length = self.layout.sp_group, packed.total_len
        log_probs = gather_and_unpad(log_probs, group=group, length=length)
        if with_entropy:
            entropy = gather_and_unpad(entropy, group=group, length=length)
        return log_probs, entropy

    def prepare_backward(self, *, is_last: bool) -> None:
        """Set FSDP2's per-micro-batch switches for the next backward (``is_last``: the step's last
        micro-batch reduces gradients and reshards).

        Call it before every micro-batch's backward with the same ``is_last`` on every rank, or
        ranks disagree on a collective and hang."""
        fsdp = self.config.fsdp
        if not self.sharded or (not fsdp.defer_gradient_sync and fsdp.reshard_after_backward):
            return
        if fsdp.defer_gradient_sync:
            self.model.set_requires_gradient_sync(is_last)
        if not fsdp.reshard_after_backward:
            self.model.set_reshard_after_backward(is_last)

    def reshard(self) -> None:
        """Free parameters left unsharded by a forward without backward. No collective; call it on
        every rank after a forward-only pass, before an optimizer step or checkpoint load."""
        fsdp = self.config.fsdp
        if fsdp.reshard_after_forward and fsdp.reshard_after_backward:
            return
        for module in self._fsdp_modules():
            module.reshard()

    def zero_grad(self) -> None:
        """Drop every gradient (set to None); local, no collective."""
        self.optimizer.zero_grad(set_to_none=True)

    def optimizer_step(self) -> dict:
        """Clip the gradient norm to optim.max_grad_norm, step the optimizer (skipped, with a warning,
        when the norm is not finite) and zero the gradients; the LR schedule does not move.
        Returns {"grad_norm": pre-clip norm, "step_skipped": bool}. Collective: every rank calls it."""
        max_norm = self.config.optim.max_grad_norm
        grad_norm = torch.nn.utils.clip_grad_norm_([p for p in self.model.parameters() if p.requires_grad], max_norm)
        if isinstance(grad_norm, DTensor):
            grad_norm = grad_norm.full_tensor()
        grad_norm = float(grad_norm)
        if not torch.isfinite(torch.tensor(grad_norm)):
            logger.warning("non-finite grad_norm=%s: optimizer step skipped", grad_norm)
            self.zero_grad()
            return {"grad_norm": grad_norm, "step_skipped": True}
        self.optimizer.step()
        self.zero_grad()
        return {"grad_norm": grad_norm, "step_skipped": False}

    def _skip_nonfinite_loss(self) -> dict:
        """The optimizer update of a step whose global loss is not finite: dropped, with a warning."""
        logger.warning("non-finite loss: optimizer step skipped")
        self.zero_grad()
        return {"grad_norm": float("nan"), "step_skipped": True}

    def advance_schedule(self) -> float:
        """Advance the LR schedule and global_step by one (also for a skipped step); returns the new
        learning rate. No collective; call it once per step on every rank."""
        self.scheduler.step()
        self.global_step += 1
        return self.scheduler.get_last_lr()[0]

    # ------------------------------------------------------------------ private seams and helpers
    def _pack(self, micro_batches, *, require_loss_mask: bool, pack=pack_micro_batch) -> list[PackedMicroBatch]:
        """Wire micro-batches -> packed streams for this rank (a testing.faults seam)."""
        return [
            pack(
                mb,
                sp_size=self.layout.sp,
                sp_rank=self.layout.sp_rank,
                device=self.device,
                require_loss_mask=require_loss_mask,
            )
            for mb in micro_batches
        ]

    def _token_weights(self, packed: Sequence[PackedMicroBatch], *, training: bool) -> TokenWeights:
        """The loss-contract weights of this rank's micro-batches (a testing.faults seam)."""
        return compute_token_weights(
            loss_masks=[p.tensors[LOSS_MASK_KEY] for p in packed],
            cu_seqlens=[p.cu_seqlens_host for p in packed],
            agg_mode=self.config.loss_agg_mode,
            loss_scale_factor=self.config.loss_scale_factor,
            dp_group=self.layout.dp_group,
        )

    def _fsdp_modules(self) -> list[FSDPModule]:
        return [m for m in self.model.modules() if isinstance(m, FSDPModule)] if self.sharded else []

    def _step_flops_and_tokens(self, packed: Sequence[PackedMicroBatch], *, training: bool) -> tuple[float, float]:
        """Model FLOPs and tokens of this rank's share; only SP rank 0 counts, so a world SUM is global."""
        if self.layout.sp_rank != 0:
            return 0.0, 0.0
        lengths = [n for p in packed for n in p.seq_lens]
        flops = 0.0
        if self.flops_workload is not None and lengths:
            factor = TRAIN_FLOPS_PER_FORWARD if training else 1.0
            flops = factor * float(self.flops_workload.cost(lengths).sum())
        return flops, float(sum(lengths))

    # ------------------------------------------------------------------ train / eval
    def _run(
        self,
        micro_batches: Sequence[Mapping[str, Tensor]],
        *,
        loss_fn: LossFn | None,
        training: bool,
        temperature: float = 1.0,
    ) -> dict:
        """One train or eval step: plan -> forward (and backward) per micro-batch -> reduce -> step."""
        step_start = time.perf_counter()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        loss_fn = loss_fn if loss_fn is not None else SFTLoss()
        packed, token_weights = self._plan_step(micro_batches, training=training)
        metrics: dict = {
            "valid_tokens": token_weights.num_tokens,
            "num_sequences": token_weights.num_sequences,
            "lr": self.scheduler.get_last_lr()[0],
        }
        if token_weights.num_tokens == 0:
            return {**metrics, **self._empty_step(training=training)}
        local_objective, metric_sums, timer = self._forward_backward_all(
            packed, token_weights.weights, loss_fn=loss_fn, training=training, temperature=temperature
        )
        if not training:
            self.reshard()
        flops, tokens = self._step_flops_and_tokens(packed, training=training)
        metrics["loss"], metric_totals, flops, tokens = self._all_reduce_step_sums(
            local_objective, metric_sums, flops=flops, tokens=tokens
        )
        metrics.update({name: total / token_weights.num_tokens for name, total in metric_totals.items()})
        metrics.update(_timing_metrics(timer.finish()))
        if training:
            # The loss is all-reduced: every rank sees the same value and skips together.
            metrics.update(self.optimizer_step() if math.isfinite(metrics["loss"]) else self._skip_nonfinite_loss())
            self.advance_schedule()
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # once per step: honest step time
        seconds = time.perf_counter() - step_start
        metrics.update(
            step_perf_metrics(
                flops=flops, tokens=tokens, seconds=seconds, world_size=self.layout.world_size, device=self.device
            )
        )
        return metrics

    def _plan_step(
        self, micro_batches: Sequence[Mapping[str, Tensor]], *, training: bool
    ) -> tuple[list[PackedMicroBatch], TokenWeights]:
        """Check the micro-batches over the mesh, pack them and weigh their tokens (loss contract)."""
        self.check_micro_batches(micro_batches)
        packed = self.pack_micro_batches(micro_batches, require_loss_mask=True)
        return packed, self._token_weights(packed, training=training)

    def _empty_step(self, *, training: bool) -> dict:
        """The step of a mini-batch with zero valid tokens: no forward, no optimizer update."""
        # Counts are global, so every rank takes this branch together (no collective skew).
        logger.warning(
            "mini-batch has zero valid (loss-mask) tokens: %s",
            "optimizer step skipped" if training else "eval loss is 0",
        )
        if training:
            self.advance_schedule()
        return {
            "loss": 0.0,
            "grad_norm": 0.0,
            "step_skipped": training,
            **_timing_metrics(MicroBatchTimes()),
        }

    def _forward_backward_all(
        self,
        packed: Sequence[PackedMicroBatch],
        weights: Sequence[Tensor],
        *,
        loss_fn: LossFn,
        training: bool,
        temperature: float,
    ) -> tuple[Tensor, dict[str, Tensor], StepTimer]:
        """Forward (and backward) every micro-batch in order; returns (local objective, metric sums, timer)."""
        local_objective = torch.zeros((), dtype=torch.float64, device=self.device)
        metric_sums: dict[str, Tensor] = {}
        timer = StepTimer(self.device)
        if training:
            self.model.train()
            self.zero_grad()
        else:
            self.model.eval()
        selections = [None] * len(packed)
        if getattr(loss_fn, "needs_batch_selection", False):
            selections = self._batch_selections(packed, loss_fn=loss_fn, temperature=temperature)
        for k, (p, w) in enumerate(zip(packed, weights)):
            if training:
                self.prepare_backward(is_last=k == len(packed) - 1)
            timer.start()
            objective, per_token_metrics = self._forward_backward(
                p, w, loss_fn=loss_fn, training=training, temperature=temperature, selection=selections[k]
            )
            timer.stop()
            local_objective += objective.detach().double()
            mask = p.local(LOSS_MASK_KEY)
            for name, value in per_token_metrics.items():
                contribution = (mask * value.detach().float()).sum().double()
                metric_sums[name] = metric_sums.get(name, 0) + contribution
        return local_objective, metric_sums, timer

    def _forward_backward(
        self,
        packed: PackedMicroBatch,
        weights: Tensor,
        *,
        loss_fn: LossFn,
        training: bool,
        temperature: float,
        selection: dict | None = None,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """One micro-batch: the local objective sum(w * l) (and, when training, backward of G times it)."""
        with torch.set_grad_enabled(training):
            outputs = self._loss_inputs(packed, loss_fn=loss_fn, temperature=temperature)
            if getattr(loss_fn, "needs_sequence_sums", False):
                outputs["sequence_sum"] = functools.partial(self.sequence_sum, packed)
            if selection is not None:
                outputs["batch_selection"] = selection
            per_token_loss, per_token_metrics = loss_fn(**outputs, inputs=packed.local_inputs())
            objective = (weights[packed.local_slice] * per_token_loss).sum()
            if training:
                (objective * float(self.gradient_divide_factor)).backward()
        return objective, per_token_metrics

    def _loss_inputs(self, packed: PackedMicroBatch, *, loss_fn, temperature: float) -> dict[str, Tensor | None]:
        """The model outputs a loss_fn receives, by config.model_type."""
        if self.is_value_model:
            return {VALUES_KEY: self.forward_values(packed)}
        needs_entropy = getattr(loss_fn, "needs_entropy", False)
        log_probs, entropy = self.forward_log_probs(packed, temperature=temperature, with_entropy=needs_entropy)
        return {LOG_PROBS_KEY: log_probs, ENTROPY_KEY: entropy}

    def _batch_selections(self, packed: Sequence[PackedMicroBatch], *, loss_fn, temperature: float) -> list[dict]:
        """A loss's mini-batch-wide token selection (clip_cov, kl_cov), per micro-batch, from a no-grad
        forward of every micro-batch. Collective: every rank runs it before the step's first forward."""
        # N, the mini-batch's loss-mask tokens: each DP group's full sequences counted once (SP rank 0)
        local = sum(float(p.tensors[LOSS_MASK_KEY].sum()) for p in packed) if self.layout.sp_rank == 0 else 0.0
        num_tokens = int(self._world_sum(torch.tensor([local], dtype=torch.float64))[0])
        with torch.no_grad():
            log_probs = [self.forward_log_probs(p, temperature=temperature)[0] for p in packed]
        return loss_fn.batch_selections(
            log_probs=log_probs,
            inputs=[p.local_inputs() for p in packed],
            sequence_sums=[functools.partial(self.sequence_sum, p) for p in packed],
            seed=self.global_step,
            num_tokens=num_tokens,
            world_sum=self._world_sum,
            world_gather=self._world_gather,
        )

    def _world_sum(self, values: Tensor) -> Tensor:
        """In-place SUM of a small tensor over the world (through the device for NCCL)."""
        if self.layout.world_size > 1:
            moved = values.to(self.device)
            dist.all_reduce(moved, op=dist.ReduceOp.SUM, group=self.layout.world_group)
            values.copy_(moved.to(values.device))
        return values

    def _world_gather(self, values: Tensor) -> tuple[Tensor, int]:
        """(every rank's equal-sized 1-D ``values`` concatenated in rank order, this rank's index)."""
        if self.layout.world_size == 1:
            return values, 0
        group = self.layout.world_group
        moved = values.to(self.device)
        out = moved.new_empty(moved.numel() * dist.get_world_size(group))
        dist.all_gather_into_tensor(out, moved, group=group)
        return out.to(values.device), dist.get_rank(group)

    def sequence_sum(self, packed: PackedMicroBatch, values: Tensor) -> Tensor:
        """Per-token values on this SP rank's slice -> the detached sum over each token's full sequence.
        Collective over the SP group."""
        bounds = packed.cu_seqlens_padded.cpu()
        ids = torch.repeat_interleave(torch.arange(len(bounds) - 1), (bounds[1:] - bounds[:-1]).long())
        ids = ids[packed.local_slice].to(values.device, non_blocking=True)
        sums = torch.zeros(len(bounds) - 1, dtype=torch.float64, device=values.device)
        sums.index_add_(0, ids, values.detach().double())
        all_reduce_sum(sums, self.layout.sp_group if self.layout.sp > 1 else None)
        return sums[ids].to(values.dtype)

    def _all_reduce_step_sums(
        self, local_objective: Tensor, metric_sums: dict[str, Tensor], *, flops: float, tokens: float
    ) -> tuple[float, dict[str, float], float, float]:
        """(loss J, {metric: global sum}, flops, tokens): one all_reduce SUM over the world of this
        rank's step sums (token slices are disjoint over the world)."""
        names = sorted(metric_sums)
        work = torch.tensor([flops, tokens], dtype=torch.float64).to(self.device, non_blocking=True)
        totals = torch.cat([torch.stack([local_objective] + [metric_sums[n] for n in names]), work])
        if self.layout.world_size > 1:  # a SUM over one rank is the identity
            dist.all_reduce(totals, op=dist.ReduceOp.SUM, group=self.layout.world_group)
        totals = totals.tolist()
        return totals[0], dict(zip(names, totals[1:-2])), totals[-2], totals[-1]

    def train_batch(
        self, micro_batches: Sequence[Mapping[str, Tensor]], *, loss_fn: LossFn | None = None, temperature: float = 1.0
    ) -> dict:
        """One optimizer step over this DP rank's micro-batches. Collective over the mesh.

        Returns loss (exact global objective J), grad_norm (before clipping), lr, valid_tokens,
        num_sequences, micro_batch_seconds / micro_batch_busy_seconds / busy_seconds, step_skipped,
        each loss_fn metric as a global loss-mask-weighted token mean, and the global perf/* figures.
        ``temperature`` divides the logits. A value model needs a ``ValueLossFn``.
        """
        self._check_loss_fn(loss_fn)
        step = self.global_step + 1
        with step_profiler(
            enabled=step in self.config.profile_steps,
            out_dir=self.config.profile_dir,
            step=step,
            rank=self.layout.rank,
            device=self.device,
        ):
            return self._run(micro_batches, loss_fn=loss_fn, training=True, temperature=temperature)

    @torch.no_grad()
    def eval_loss(
        self, micro_batches: Sequence[Mapping[str, Tensor]], *, loss_fn: LossFn | None = None, temperature: float = 1.0
    ) -> dict:
        """The training objective and metrics on these micro-batches, without backward."""
        self._check_loss_fn(loss_fn)
        return self._run(micro_batches, loss_fn=loss_fn, training=False, temperature=temperature)

    @torch.no_grad()
    def compute_log_prob(
        self,
        micro_batches: Sequence[Mapping[str, Tensor]],
        *,
        with_entropy: bool = False,
        with_sum_pi_squared: bool = False,
        temperature: float = 1.0,
    ) -> list[dict[str, Tensor]]:
        """Per micro-batch {"log_probs": (b, L)[, "entropy": (b, L)][, "sum_pi_squared": (b, L)]} on
        every rank, at ``temperature``: log_probs[i, t] = log p(token t | tokens < t) (0 at t = 0 and
        at padding); entropy and sum_pi_squared (sum of p(v)^2) of that same distribution.
        """
        self._require_model_type("language_model", "compute_log_prob")
        self.check_micro_batches(micro_batches)
        self.model.eval()
        outputs = []
        for p in self.pack_micro_batches(micro_batches, require_loss_mask=False):
            if with_sum_pi_squared:
                columns = self._gathered_head_stats(p, temperature=temperature)
            else:
                log_probs, entropy = self.gathered_log_probs(p, temperature=temperature, with_entropy=with_entropy)
                columns = {LOG_PROBS_KEY: log_probs, ENTROPY_KEY: entropy}
            if not with_entropy:
                columns.pop(ENTROPY_KEY)
            outputs.append({k: p.unpack(v) for k, v in columns.items()})
        self.reshard()
        return outputs

    def _gathered_head_stats(self, packed: PackedMicroBatch, *, temperature: Temperature) -> dict[str, Tensor]:
        """{log_probs, entropy, sum_pi_squared} [total_len] of the packed stream (no grad), gathered
        over the SP group. Collective as ``gathered_log_probs``."""
        self._require_model_type("language_model", "forward_log_probs")
        stats = self.model(
            input_ids=packed.local(INPUT_IDS_KEY),
            position_ids=packed.local(POSITION_IDS_KEY),
            cu_seqlens=packed.cu_seqlens_padded,
            max_seqlen=packed.max_seqlen,
            targets=packed.local("targets"),
            temperature=temperature,
            with_sum_pi_squared=True,
            logits_chunk_size=self.config.logits_chunk_size,
        )
        group, length = self.layout.sp_group, packed.total_len
        keys = (LOG_PROBS_KEY, ENTROPY_KEY, SUM_PI_SQUARED_KEY)
        return {k: gather_and_unpad(v, group=group, length=length) for k, v in zip(keys, stats)}

    @torch.no_grad()
    def compute_values(self, micro_batches: Sequence[Mapping[str, Tensor]]) -> list[dict[str, Tensor]]:
        """Per micro-batch {"values": (b, L)} (fp32) on every rank (a value model only): values[i, t] is
        the value head on token t - 1 (0 at t = 0 and at padding). Collective as compute_log_prob."""
        self._require_model_type("value_model", "compute_values")
        self.check_micro_batches(micro_batches)
        self.model.eval()
        outputs = []
        for p in self.pack_micro_batches(micro_batches, require_loss_mask=False):
            outputs.append({VALUES_KEY: p.unpack(self.gathered_values(p))})
        self.reshard()
        return outputs

    def _check_loss_fn(self, loss_fn) -> None:
        """A value model has no default loss (the LM default, SFTLoss, reads log-probs)."""
        if self.is_value_model and loss_fn is None:
            raise EngineConfigError(
                "model_type='value_model' needs a value loss_fn (e.g. algorithms.value_loss.ValueLoss); got None"
            )

    # ------------------------------------------------------------------ state
    def full_state_dict(self) -> dict[str, Tensor]:
        """Unsharded parameters on CPU, every rank (the model's own parameter names). Collective."""
        out = {}
        for name, value in self.model.state_dict().items():
            if isinstance(value, DTensor):
                value = value.full_tensor()
            out[name] = value.detach().cpu().clone()
        return out

    def save_hf_model(self, out: str, *, tokenizer_path: str | None = None) -> None:
        """Save the model as a Hugging Face save_pretrained directory ``out`` (fp32 safetensors).
        Collective: written by global rank 0 only; ends with a barrier."""
        from verl_balance.engine.hf_export import save_engine_model_as_hf

        save_engine_model_as_hf(
            self.model,
            model_config=self.model_config,
            out=out,
            tokenizer_path=tokenizer_path,
            group=self.layout.world_group,
        )

    def save_checkpoint(self, path: str, *, step: int, extra: dict | None = None) -> None:
        """Sharded DCP checkpoint of model + optimizer, plus scheduler/step/extra. Collective.
        With LoRA only the adapters and their optimizer state, plus base_fingerprint.json."""
        dcp.save(checkpoint_state(self.model, self.optimizer), checkpoint_id=path)
        if dist.get_rank() == 0:
            lora = getattr(self.model, "lora_config", None)
            if lora is not None:  # what verl_balance.export needs to write the adapter or merge it
                save_lora_config(lora, path)
                atomic_write_json(os.path.join(path, BASE_FINGERPRINT_FILE), engine_base_fingerprint(self), indent=1)
            torch.save(
                {
                    "step": step,
                    "global_step": self.global_step,
                    "scheduler": self.scheduler.state_dict(),
                    "extra": extra or {},
                },
                os.path.join(path, _ENGINE_STATE_FILE),
            )
        dist.barrier(group=self.layout.world_group)

    def load_checkpoint(self, path: str) -> dict:
        """Restore a save_checkpoint directory (any layout with the same W); returns `extra`.
        The optimizer and schedule follow this engine's ``optim`` config. Refused, on every rank: a
        LoRA checkpoint of another base (BaseMismatchError), one of another architecture, and any
        non-checkpoint pickle (UnsafeCheckpointError)."""
        check_checkpoint_base(self, path)
        state = checkpoint_state(self.model, self.optimizer)
        check_checkpoint_fits(path, state["model"])
        safe_load.dcp_load(state, path)  # never unpickles anything but checkpoint data
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
            options=StateDictOptions(strict=not is_lora_model(self.model)),
        )
        check_confined(path, [_ENGINE_STATE_FILE])  # a regular file of the checkpoint, not a link
        meta = safe_load.load_torch_file(os.path.join(path, _ENGINE_STATE_FILE))
        self.scheduler.load_state_dict(meta["scheduler"])
        apply_optim_config(self.optimizer, self.scheduler, config=self.config)  # a resume's new optim.* keys
        self.global_step = meta["global_step"]
        return meta["extra"]


# ---------------------------------------------------------------------------- checkpoint contents
def is_lora_model(model) -> bool:
    return getattr(model, "lora_config", None) is not None


def trainable_state(model, model_sd: dict) -> dict:
    """``model_sd`` restricted to the trainable parameters (the adapters) of a LoRA model; whole otherwise."""
    if not is_lora_model(model):
        return model_sd
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    subset = {k: v for k, v in model_sd.items() if k in trainable}
    assert set(subset) == trainable, f"trainable without a state-dict key: {sorted(trainable - set(subset))[:5]}"
    return subset


def checkpoint_state(model, optimizer) -> dict:
    """The DCP state {"model", "optim"} of a checkpoint; with LoRA only the trainable adapters."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": trainable_state(model, model_sd), "optim": optim_sd}


def engine_base_fingerprint(engine: TrainEngine) -> dict:
    """The fingerprint of the engine's frozen base (engine/lora.py), hashed once per engine."""
    cached = getattr(engine, "_base_fingerprint", None)
    if cached is None:
        cached = base_fingerprint(engine.model_config, seed=engine.config.seed)
        engine._base_fingerprint = cached
    return cached


def check_checkpoint_fits(path: str, model_state: dict) -> None:
    """Raise ``EngineConfigError`` on every rank if the checkpoint's model keys or shapes differ from
    ``model_state`` (DCP would drop the rest silently)."""
    problems = safe_load.state_mismatch(safe_load.read_dcp_metadata(path), model_state)
    if problems:
        raise EngineConfigError(
            f"checkpoint {path!r} does not fit this model: {'; '.join(problems)}. A resume loads a checkpoint "
            "of the same architecture (model.* as when it was saved); start from another one, or change the "
            "model back"
        )


def check_checkpoint_base(engine: TrainEngine, path: str) -> None:
    """Refuse, on every rank, a LoRA checkpoint whose recorded base is not this engine's, or one
    without base_fingerprint.json. Rank 0 hashes the base; the verdict is broadcast."""
    group = engine.layout.world_group
    message = None
    if dist.get_rank(group) == 0 and is_lora_model(engine.model):
        try:
            saved = read_base_fingerprint(path)
            if saved is None:
                message = (
                    f"checkpoint {path!r} has no {BASE_FINGERPRINT_FILE}: it is not a LoRA checkpoint of this "
                    "version (its frozen base cannot be checked); resume it with the version that wrote it"
                )
            else:
                message = base_mismatch_message(path, saved, engine_base_fingerprint(engine))
        except (OSError, ValueError, TypeError, AttributeError, KeyError) as err:  # a malformed record: say so
            message = f"checkpoint {path!r}: its {BASE_FINGERPRINT_FILE} cannot be used ({err!r}); it is refused"
    box = [message]
    if dist.get_world_size(group) > 1:
        dist.broadcast_object_list(box, group=group, group_src=0)
    if box[0] is not None:
        raise BaseMismatchError(box[0])
