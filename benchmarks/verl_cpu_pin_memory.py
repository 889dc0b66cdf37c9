"""``Tensor.pin_memory`` as the identity on a host without an accelerator (peer_bench's verl rows).

verl 0.9.1's fsdp2 engine shards a forward-only (reference) model with FSDP2's
``CPUOffloadPolicy(pin_memory=True)``; pinning needs CUDA, so on a CPU-only host the reference
engine fails at start-up. Loaded into verl's processes through ``VERL_USE_EXTERNAL_MODULES``;
pinned and unpinned host memory hold the same values, so nothing else changes.
"""

from __future__ import annotations

import torch

if not torch.cuda.is_available():

    def _unpinned(self, *args, **kwargs):
        return self

    torch.Tensor.pin_memory = _unpinned
