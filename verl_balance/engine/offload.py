"""verl's ``fsdp_config.param_offload`` / ``optimizer_offload`` / ``offload_policy`` as FSDP2's
``CPUOffloadPolicy``: which engines get it (CUDA only; CPU workers hold everything in CPU memory
already), and the start-up line naming the switches that have no effect.

With the policy, FSDP2 keeps each unit's sharded parameters, their gradients and (since the optimizer
steps on those parameters) the AdamW state in pinned CPU memory, copying a shard to the GPU for its
all-gather; the sharded parameters must be materialized on the CPU (``to_empty(device="cpu")``), the
buffers stay on the GPU.
"""

from __future__ import annotations

import logging

from verl_balance.engine.config import FSDPConfig

__all__ = ["OFFLOAD_SWITCHES", "cpu_offload_policy", "offload_requested"]

logger = logging.getLogger(__name__)

OFFLOAD_SWITCHES = ("param_offload", "optimizer_offload", "offload_policy")


def offload_requested(fsdp: FSDPConfig) -> list[str]:
    """The offload switches set in ``fsdp`` (verl's names)."""
    return [name for name in OFFLOAD_SWITCHES if getattr(fsdp, name)]


def cpu_offload_policy(fsdp: FSDPConfig, *, device_type: str, log: bool = False):
    """FSDP2's ``CPUOffloadPolicy(pin_memory=True)`` when an offload switch is on and the engine runs on
    CUDA; None otherwise. ``log``: name the switches that have no effect on a CPU engine."""
    requested = offload_requested(fsdp)
    if not requested:
        return None
    if device_type != "cuda":
        if log:
            logger.info(
                "fsdp_config.%s: no effect on %s workers (parameters and optimizer state are in CPU memory already)",
                ", fsdp_config.".join(requested),
                device_type,
            )
        return None
    from torch.distributed.fsdp import CPUOffloadPolicy

    return CPUOffloadPolicy(pin_memory=True)
