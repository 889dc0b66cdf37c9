"""Single-rank training engine: FSDP2 + Ulysses model, micro-batch loop, optimizer, checkpoint."""

from verl_balance.engine.config import EngineConfig, EngineConfigError, FSDPConfig, OptimConfig
from verl_balance.engine.packing import MicroBatchError, PackedMicroBatch, pack_micro_batch
from verl_balance.engine.train_engine import TrainEngine, token_log_probs

__all__ = [
    "EngineConfig",
    "EngineConfigError",
    "FSDPConfig",
    "OptimConfig",
    "MicroBatchError",
    "PackedMicroBatch",
    "TrainEngine",
    "pack_micro_batch",
    "token_log_probs",
]
