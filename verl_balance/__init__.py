"""verl_balance: layout-invariant loss and workload balancing for RL and SFT on Ray."""

__version__ = "0.1.0"
