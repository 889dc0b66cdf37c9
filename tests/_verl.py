"""The one skip reason of the tests that need verl (the ``verl`` extra), for every test directory."""

VERL_SKIP_REASON = "verl is not installed; install the extra with: pip install 'verl-balance[verl]'"


def no_worse_than_naive(metrics: dict) -> bool:
    """The balancer's guarantee (balance/plan.py) on verl's logged ``verl_balance/*`` figures: fewer
    micro-batches than the naive contiguous plan, or as many and (sync ratio, imbalance) no worse,
    compared in that order (a tie up to summation rounding counts as equal)."""
    ours, naive = metrics["verl_balance/num_micro_batches"], metrics["verl_balance/naive_num_micro_batches"]
    if ours != naive:
        return ours < naive
    for key in ("sync_ratio", "imbalance"):
        mine, theirs = metrics[f"verl_balance/{key}"], metrics[f"verl_balance/naive_{key}"]
        if abs(mine - theirs) > 1e-9 * abs(theirs):
            return mine < theirs
    return True
