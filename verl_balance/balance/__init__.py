"""Pure (numpy-only) workload balancing: which DP rank and micro-batch each sample goes to.

``plan_balance`` is the entry point; ``balanced_partition`` is the bare DP partition (a drop-in
for verl's ``get_seqlen_balanced_partitions``); workloads model per-sequence cost."""

from verl_balance.balance.errors import (
    BalanceConfigError,
    BalanceInputError,
    EmptyBatchError,
    InvalidLengthError,
    OverlongSampleError,
    TooFewSamplesError,
)
from verl_balance.balance.partition import balanced_partition
from verl_balance.balance.plan import BalanceConfig, BalancePlan, BalanceStats, plan_balance
from verl_balance.balance.workload import FlopsWorkload, TokenWorkload, Workload, from_model_config

__all__ = [
    "BalanceConfig",
    "BalanceConfigError",
    "BalanceInputError",
    "BalancePlan",
    "BalanceStats",
    "EmptyBatchError",
    "FlopsWorkload",
    "InvalidLengthError",
    "OverlongSampleError",
    "TokenWorkload",
    "Workload",
    "TooFewSamplesError",
    "balanced_partition",
    "from_model_config",
    "plan_balance",
]
