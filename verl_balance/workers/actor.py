"""ActorWorker: one Ray actor process = one rank of the FSDP2 + Ulysses training engine.

Every SP rank of a DP group gets the same ``Batch`` and only SP rank 0's output returns; every rank
must receive the same number of micro-batches. Each ``update_actor`` call is exactly one optimizer step.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from verl_balance.algorithms.loss_modes import LossModeConfig, build_policy_loss
from verl_balance.algorithms.policy_loss import PolicyLossConfig
from verl_balance.batch_keys import (
    ENTROPY_KEY,
    LOG_PROBS_KEY,
    MICRO_BATCH_SIZES_KEY,
    ON_POLICY_KEY,
    ROLLOUT_LOG_PROBS_KEY,
    SUM_PI_SQUARED_KEY,
    TEMPERATURE_KEY,
    WIRE_KEYS,
)
from verl_balance.distributed.layout import ParallelLayout, init_distributed
from verl_balance.engine.config import EngineConfig
from verl_balance.engine.train_engine import TrainEngine
from verl_balance.loss import SFTLoss
from verl_balance.models.config import ModelConfig
from verl_balance.models.hf import HFModelConfig
from verl_balance.protocol import Batch
from verl_balance.single_controller import Dispatch, Worker, make_mesh_dispatch, register
from verl_balance.utils.checksums import hash_files, share_of

ACTOR_MESH = "actor"
HF_EXPORT_DIR = "hf"


@dataclass
class ActorWorkerConfig:
    """What one actor rank needs: model dims, engine settings, SP size, and the loss it trains."""

    model: ModelConfig | HFModelConfig
    """The built-in model's dimensions or the HF model directory (the same on every rank)."""
    engine: EngineConfig
    """Optimizer, loss aggregation and FSDP settings of the rank's engine."""
    sp_size: int = 1
    """Ulysses sequence-parallel degree; the DP size is the worker count divided by it."""
    policy_loss: PolicyLossConfig | None = None
    """None = SFT negative log-likelihood; a PolicyLossConfig = the PPO-clip policy loss."""
    loss_mode: LossModeConfig | None = None
    """verl's ``policy_loss.loss_mode`` and its settings (None = vanilla PPO-clip)."""
    save_hf_model: bool = False
    """``save_checkpoint`` also writes ``<path>/hf``, a Hugging Face save_pretrained directory."""
    hf_tokenizer_path: str | None = None
    """Directory whose HF tokenizer is copied into the export (None: the model directory's, if any)."""


class ActorWorker(Worker):
    """Registered methods: init_model, update_actor, eval_loss, compute_log_prob, checkpoints."""

    engine_cls: type[TrainEngine] = TrainEngine
    """The engine class each rank builds (a seam for testing.faults; production uses TrainEngine)."""

    def __init__(self, config: ActorWorkerConfig) -> None:
        super().__init__()
        self.config = config
        self.engine: TrainEngine | None = None
        self.layout: ParallelLayout | None = None

    # ------------------------------------------------------------------ setup
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> dict:
        """Join the process group, build the (dp, sp) mesh and the sharded engine."""
        init_distributed()
        sp = self.config.sp_size
        if self.world_size % sp:
            raise ValueError(f"ulysses_sequence_parallel_size={sp} does not divide the {self.world_size} workers")
        self.layout = ParallelLayout(dp=self.world_size // sp, sp=sp)
        self.engine = self.engine_cls(
            model_config=self.config.model, engine_config=self.config.engine, layout=self.layout
        )
        self.register_mesh(
            ACTOR_MESH, dp_rank=self.layout.dp_rank, dp_size=self.layout.dp, is_collect=self.layout.sp_rank == 0
        )
        return {
            "rank": self.rank,
            "dp_rank": self.layout.dp_rank,
            "sp_rank": self.layout.sp_rank,
            "device": str(self.layout.device),
            "parameters": sum(p.numel() for p in self.engine.model.parameters()),
            "trainable_parameters": sum(p.numel() for p in self.engine.model.parameters() if p.requires_grad),
        }

    def _loss_fn(self, *, on_policy: bool = False):
        if self.config.policy_loss is None:
            if on_policy:
                raise ValueError(f"meta {ON_POLICY_KEY!r} is a PPO-loss setting; this worker trains the SFT loss")
            return SFTLoss()
        return build_policy_loss(self.config.policy_loss, mode=self.config.loss_mode, on_policy=on_policy)

    wire_keys: tuple[str, ...] = WIRE_KEYS
    """The batch columns handed to the engine (a subclass's loss may read more)."""

    @classmethod
    def _micro_batches(cls, batch: Batch) -> list[dict[str, torch.Tensor]]:
        """The DP chunk's micro-batches as plain tensor dicts (only wire keys travel on)."""
        sizes = batch.meta.get(MICRO_BATCH_SIZES_KEY)
        if sizes is None:
            raise ValueError(
                f"batch meta lacks {MICRO_BATCH_SIZES_KEY!r}; build DP chunks with trainer.plan_dispatch.split_by_plan"
            )
        keys = [k for k in cls.wire_keys if k in batch.tensors.keys()]
        out = []
        for part in batch.split(list(sizes)):
            out.append({k: part.tensors[k] for k in keys})
        return out

    # ------------------------------------------------------------------ compute
    @register(dispatch_mode=make_mesh_dispatch(ACTOR_MESH))
    def update_actor(self, batch: Batch) -> dict:
        """One optimizer step over this DP rank's micro-batches; metrics of this rank. With meta
        ``on_policy`` the old log-probs come from this forward.
        """
        start = time.perf_counter()
        loss_fn = self._loss_fn(on_policy=bool(batch.meta.get(ON_POLICY_KEY, False)))
        metrics = self.engine.train_batch(
            self._micro_batches(batch), loss_fn=loss_fn, temperature=batch_temperature(batch)
        )
        if getattr(loss_fn, "on_policy", False) and ROLLOUT_LOG_PROBS_KEY in batch.tensors.keys():
            # Every rank's chunk has the same columns and meta, so every rank joins this reduction.
            local = loss_fn.rollout_probs_diff_max
            value = torch.zeros((), dtype=torch.float32, device=self.layout.device)
            if local is not None:
                value = local.detach().float().reshape(()).clone()
            dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self.layout.world_group)
            if "rollout_probs_diff_mean" in metrics:  # absent when the mini-batch had no loss tokens
                metrics["rollout_probs_diff_max"] = float(value)
        metrics["step_seconds"] = time.perf_counter() - start
        metrics["dp_rank"] = self.layout.dp_rank
        return metrics

    @register(dispatch_mode=make_mesh_dispatch(ACTOR_MESH))
    def eval_loss(self, batch: Batch) -> dict:
        """The training objective on this batch without backward (same normalisation)."""
        metrics = self.engine.eval_loss(
            self._micro_batches(batch), loss_fn=self._loss_fn(), temperature=batch_temperature(batch)
        )
        metrics["dp_rank"] = self.layout.dp_rank
        return metrics

    @register(dispatch_mode=make_mesh_dispatch(ACTOR_MESH))
    def compute_log_prob(self, batch: Batch, with_entropy: bool = False, with_sum_pi_squared: bool = False) -> Batch:
        """Per-token log-probs (B, L) of this chunk's rows, in its row order (plus extras when asked)."""
        outputs = self.engine.compute_log_prob(
            self._micro_batches(batch),
            with_entropy=with_entropy,
            with_sum_pi_squared=with_sum_pi_squared,
            temperature=batch_temperature(batch),
        )
        keys = [LOG_PROBS_KEY] + [ENTROPY_KEY] * with_entropy + [SUM_PI_SQUARED_KEY] * with_sum_pi_squared
        return Batch.from_dict(tensors={k: cat_padded([o[k] for o in outputs]) for k in keys})

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def set_loss_mode(self, loss_mode: LossModeConfig | None) -> None:
        """Train the next updates with this ``policy_loss.loss_mode`` (None = vanilla PPO-clip)."""
        self.config.loss_mode = loss_mode

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def describe(self) -> dict:
        """What this rank runs (for logs and tests)."""
        return {
            "rank": self.rank,
            "dp": self.layout.dp,
            "sp": self.layout.sp,
            "dp_rank": self.layout.dp_rank,
            "sp_rank": self.layout.sp_rank,
            "device": str(self.layout.device),
            "model": self.config.model.to_dict(),
            "engine": asdict(self.config.engine),
            "loss_mode": None if self.config.loss_mode is None else asdict(self.config.loss_mode),
            "num_threads": torch.get_num_threads(),
        }

    # ------------------------------------------------------------------ state
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, path: str, step: int, extra: dict | None = None) -> None:
        """Sharded checkpoint under ``path`` (collective); with ``config.save_hf_model`` also ``<path>/hf``."""
        os.makedirs(path, exist_ok=True)
        self.engine.save_checkpoint(path, step=step, extra=extra)
        if self.config.save_hf_model:
            self.export_hf(os.path.join(path, HF_EXPORT_DIR))

    def export_hf(self, out: str) -> None:
        """Write the model as an HF directory ``out``. Collective; rank 0 writes."""
        # One tensor gathered at a time; rank 0 streams bounded safetensors files (no full model).
        self.engine.save_hf_model(out, tokenizer_path=self.config.hf_tokenizer_path)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> dict:
        """Restore ``save_checkpoint(path)``; returns the saved ``extra`` dict."""
        return self.engine.load_checkpoint(path)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def hash_checkpoint_files(self, path: str, sizes: dict[str, int]) -> dict[str, dict]:
        """This rank's share of the files ``sizes`` names, hashed: ``{name: {"size", "xxh3_128"}}``."""
        return hash_files(path, share_of(sizes, rank=self.rank, world=self.world_size))


def batch_temperature(batch: Batch) -> float:
    """The sampling temperature of on-policy rows (meta "temperature", verl's key); 1 otherwise."""
    return float(batch.meta.get(TEMPERATURE_KEY, 1.0))


def cat_padded(parts: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate (b_i, L_i) tensors along rows, right-padding to the widest L with zeros."""
    width = max(p.shape[1] for p in parts)
    return torch.cat([torch.nn.functional.pad(p, (0, width - p.shape[1])) for p in parts], dim=0)
