"""Drop-ins for ``verl.utils.seqlen_balancing``: same signatures and return values, our balancer inside.

Invariants (verl's contracts): every index appears exactly once; partitions are lists of
ascending ints; ``equal_size`` partitions have equal counts; every micro-batch's effective token
count is <= max_token_len; with a ``dp_group`` every DP rank gets the same number of
micro-batches, and every fatal condition is agreed by one all-reduce before any rank raises.
"""

from __future__ import annotations

import numpy as np
import torch

from verl_balance.balance import (
    BalanceInputError,
    OverlongSampleError,
    TooFewSamplesError,
    balanced_partition,
    plan_balance,
)
from verl_balance.balance.partition import cell_loads, fill_cells, refine_cells, sort_into_rows
from verl_balance.balance.workload import resolve_workload
from verl_balance.batch_keys import ATTENTION_MASK_KEY, INPUT_IDS_KEY
from verl_balance.integrations.verl.errors import require_verl
from verl_balance.integrations.verl.patches.karmarkar_karp import karmarkar_karp
from verl_balance.integrations.verl.patches.state import current_workload

__all__ = ["get_reverse_idx", "get_seqlen_balanced_partitions", "rearrange_micro_batches"]


def _as_1d_numbers(values, what: str) -> np.ndarray:
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().numpy()
    array = np.asarray(values)
    if array.ndim != 1:
        raise BalanceInputError(f"{what} must be one value per item (1-D), got shape {array.shape}")
    if array.size and (not np.all(np.isfinite(array.astype(np.float64))) or array.min() < 0):
        bad = int(np.flatnonzero(~np.isfinite(array.astype(np.float64)) | (array < 0))[0])
        raise BalanceInputError(f"{what}[{bad}] = {array[bad]!r}; valid: a finite value >= 0")
    return array


def get_seqlen_balanced_partitions(seqlen_list, k_partitions: int, equal_size: bool) -> list[list[int]]:
    """Drop-in for verl's function: ``k_partitions`` lists of ascending indices, balanced by sum.

    With ``equal_size`` every partition has len / k items; otherwise no partition is empty. The
    max part is never above verl's for ints and Python floats.
    """
    values = _as_1d_numbers(seqlen_list, "seqlen_list")
    n, k = len(values), int(k_partitions)
    if k < 1:
        raise BalanceInputError(f"k_partitions={k_partitions!r}; valid: an integer >= 1")
    if n < k:
        raise TooFewSamplesError(f"number of items {n} < k_partitions {k}; valid: at least k_partitions items")
    if equal_size and n % k:
        raise TooFewSamplesError(
            f"equal_size=True needs len(seqlen_list) divisible by k_partitions; got {n} items and k={k}"
        )
    parts = _balanced_parts(values.astype(np.float64), k, equal_size=bool(equal_size), exact=_exact_values(values))
    if not equal_size:
        parts = _fill_empty_parts(parts, values)
    assert np.array_equal(np.bincount(np.concatenate(parts), minlength=n), np.ones(n)), "partition lost an index"
    return [np.sort(p).tolist() for p in parts]


def _exact_values(values: np.ndarray) -> list:
    """The values as verl's Karmarkar-Karp sees them: Python ints when exact as floats, else floats."""
    if values.dtype.kind in "iub":
        return values.astype(np.int64).tolist()
    as_float = values.astype(np.float64)
    if np.all(as_float == np.floor(as_float)) and float(as_float.sum()) < 2.0**53:
        return as_float.astype(np.int64).tolist()
    return as_float.tolist()


def _lower_bound(costs: np.ndarray, k: int, *, equal_size: bool) -> float:
    """A lower bound on any k-way partition's max part."""
    n = len(costs)
    total = float(costs.sum())
    mean = total / k
    if np.all(costs == np.floor(costs)) and total < 2.0**53:
        mean = float(-(-int(total) // k))
    if n == 0:
        return mean
    bound = max(mean, float(costs.max()), -(-n // k) * float(costs.min()))
    if n > k:
        top = -np.partition(-costs, k)[: k + 1]
        bound = max(bound, float(np.sort(top)[:2].sum()))
    if equal_size and n > k:  # removing the largest item only raises the others' order statistics
        others = n // k - 1
        smallest = np.partition(costs, others - 1)[:others] if others else costs[:0]
        bound = max(bound, float(costs.max()) + float(smallest.sum()))
    return bound


def _balanced_parts(
    costs: np.ndarray,
    k: int,
    *,
    equal_size: bool,
    exact: list | None = None,
    tokens: np.ndarray | None = None,
    token_cap: int | None = None,
) -> list[np.ndarray]:
    """verl's own Karmarkar-Karp partition refined by ``balance``'s pairwise swaps within a
    deterministic work budget; the max part never exceeds Karmarkar-Karp's (so never worse than
    verl's). For many free-size items a largest-to-lightest deal is tried first and kept when it
    reaches ``_lower_bound``. With ``tokens`` and ``token_cap`` no swap breaks the cap."""
    rows = -(-len(costs) // k)
    extra = 0 if equal_size else max(1, rows // 4)
    bound = _lower_bound(costs, k, equal_size=equal_size)
    dealt = None
    if not equal_size and len(costs) > _LPT_FIRST_ITEMS and tokens is None:
        dealt = fill_cells(
            rows=sort_into_rows(costs, k),
            row_slot=np.zeros(rows, dtype=np.int64),
            num_slots=1,
            costs=costs,
            extra_width=extra,
        )
        refine_cells(dealt, costs, allow_moves=True, rel_tol=0.0, stop_at=bound)
        if cell_loads(dealt, costs).max() <= bound:
            return [c[c >= 0] for c in dealt[0]]
    seed = karmarkar_karp(costs.tolist() if exact is None else exact, k, equal_size)
    cells = np.full((1, k, max(len(p) for p in seed) + extra), -1, dtype=np.int64)
    for part_index, part in enumerate(seed):
        cells[0, part_index, : len(part)] = part
    refine_cells(
        cells,
        costs,
        allow_moves=not equal_size,
        rel_tol=1e-5,
        max_passes=_refine_passes(len(costs), k, cells.shape[2]),
        stop_at=bound,
        tokens=tokens,
        token_cap=token_cap,
    )
    if dealt is not None and cell_loads(dealt, costs).max() < cell_loads(cells, costs).max():
        cells = dealt
    return [c[c >= 0] for c in cells[0]]


# Work budget of the refinement, in element operations of its pair search (a pass costs a fixed
# overhead of ~_PASS_OVERHEAD elements plus pairs * width^2): a pass count, not a clock, so the
# same input always gives the same partition. Sized so that copy-of-Karmarkar-Karp + refinement
# stays within ~1 ms of verl's Karmarkar-Karp alone (ours is 3-8x faster; the saving grows with n).
_PASS_OVERHEAD = 8_000
_BUDGET_BASE = 25_000
_BUDGET_PER_ITEM = 200
_LPT_FIRST_ITEMS = 2048
_SEED_MAX_ITEMS = 2048  # micro-batch seeds: free-size Karmarkar-Karp grows ~n^1.7


def _refine_passes(n: int, k: int, width: int) -> int:
    # Dense pair search: width^2 per pair; the sorted search (wide cells) ~ width * log(width).
    pass_work = _PASS_OVERHEAD + (k // 2) * width * min(width, 64)
    return int(max(1, min(64, (_BUDGET_BASE + _BUDGET_PER_ITEM * n) // pass_work)))


def _fill_empty_parts(parts: list[np.ndarray], values: np.ndarray) -> list[np.ndarray]:
    """Give each empty partition the cheapest item of the part with the most items (verl asserts none is empty)."""
    parts = [p.copy() for p in parts]
    for i, part in enumerate(parts):
        if len(part):
            continue
        donor = max(range(len(parts)), key=lambda j: (len(parts[j]), -j))
        cheapest = parts[donor][np.argmin(values[parts[donor]])]
        parts[donor] = parts[donor][parts[donor] != cheapest]
        parts[i] = np.array([cheapest], dtype=np.int64)
    return parts


def get_reverse_idx(idx_map):
    """Drop-in for verl's function: ``out[idx_map[i]] = i`` (a list); raises unless idx_map is a
    permutation of 0..n-1."""
    idx = np.asarray(idx_map.tolist() if isinstance(idx_map, torch.Tensor) else list(idx_map), dtype=np.int64)
    n = len(idx)
    if n and (idx.min() < 0 or idx.max() >= n or np.unique(idx).size != n):
        raise BalanceInputError(f"idx_map must be a permutation of 0..{n - 1}; got {idx.tolist()[:16]}...")
    reverse = np.empty(n, dtype=np.int64)
    reverse[idx] = np.arange(n)
    return reverse.tolist()


def _effective_seq_lens(batch) -> np.ndarray:
    input_ids = batch[INPUT_IDS_KEY]
    if getattr(input_ids, "is_nested", False):
        return input_ids.offsets().diff().cpu().numpy().astype(np.int64)
    return batch[ATTENTION_MASK_KEY].sum(dim=1).cpu().numpy().astype(np.int64)


def _reduce_device(group) -> torch.device:
    import torch.distributed as dist

    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _split_heaviest(micro: list[list[int]], costs: np.ndarray, unit: int) -> list[list[int]]:
    """Split the costliest micro-batch with >= 2 units in two (the cap still holds)."""
    candidates = [i for i, mb in enumerate(micro) if len(mb) >= 2 * unit]
    assert candidates, "caller checked that there are at least as many units as micro-batches"
    heaviest = max(candidates, key=lambda i: (costs[micro[i]].sum(), -i))
    members = np.asarray(micro[heaviest], dtype=np.int64).reshape(-1, unit)
    order = np.argsort(-costs[members].sum(axis=1), kind="stable")
    first, second = members[order[0::2]].ravel(), members[order[1::2]].ravel()
    micro = micro[:heaviest] + micro[heaviest + 1 :]
    return micro + [sorted(first.tolist()), sorted(second.tolist())]


def rearrange_micro_batches(
    batch,
    max_token_len,
    dp_group=None,
    num_batches_divided_by=None,
    same_micro_num_in_dp=True,
    min_num_micro_batch=None,
    use_dynamic_bsz_balance=True,
    force_group_size=1,
    *,
    workload=None,
):
    """Drop-in for verl's function: split a TensorDict into token-capped micro-batches.

    Returns ``(micro_batches, micro_bsz_idx)`` like verl. Every micro-batch holds <= max_token_len
    effective tokens; ``force_group_size`` consecutive samples stay together. With ``dp_group`` and
    ``same_micro_num_in_dp`` the count is the DP group's maximum, rounded up to
    ``num_batches_divided_by``, at least ``min_num_micro_batch``. ``workload`` (keyword only):
    None/"tokens" or a FlopsWorkload; default ``state.current_workload()``.
    """
    require_verl()
    cost_model = resolve_workload(workload if workload is not None else current_workload())
    seq_lens = _effective_seq_lens(batch)
    unit = int(force_group_size)
    if unit < 1 or len(seq_lens) % unit:
        raise BalanceInputError(f"batch size {len(seq_lens)} must be divisible by force_group_size={force_group_size}")
    max_token_len = int(max_token_len)
    local_micro = _fewest_capped_micro_batches(seq_lens, unit, max_token_len, cost_model)
    target = _agreed_micro_batch_count(
        seq_lens,
        unit,
        max_token_len,
        local_count=len(local_micro),
        dp_group=dp_group if same_micro_num_in_dp else None,
        min_num_micro_batch=min_num_micro_batch,
        num_batches_divided_by=num_batches_divided_by,
    )
    costs = cost_model.cost(seq_lens)
    micro = _micro_batches_at_count(seq_lens, costs, target, max_token_len, unit, local_micro)
    if use_dynamic_bsz_balance:
        # verl's order: heaviest first, then the light ones moved to both ends (pipeline bubbles).
        micro.sort(key=lambda mb: (costs[mb].sum(), mb[0] if mb else 0), reverse=True)
        micro = micro[::2][::-1] + micro[1::2]

    from verl.utils import tensordict_utils as tu

    return [tu.index_select_tensor_dict(batch, mb) for mb in micro], micro


def _fewest_capped_micro_batches(seq_lens, unit, max_token_len, cost_model) -> list[list[int]]:
    """This rank's plan: the fewest capped micro-batches, balanced; [] when empty or a group is over the cap."""
    num_units = len(seq_lens) // unit
    if not num_units or seq_lens.reshape(num_units, unit).sum(axis=1).max() > max_token_len:
        return []
    plan = plan_balance(
        seq_lens=seq_lens,
        dp_size=1,
        max_token_len_per_gpu=max_token_len,
        group_ids=None if unit == 1 else np.repeat(np.arange(num_units), unit),
        workload=cost_model,
        equal_size=False,
    )
    return [mb.tolist() for mb in plan.micro_batches[0] if len(mb)]


def _agreed_micro_batch_count(
    seq_lens, unit, max_token_len, *, local_count, dp_group, min_num_micro_batch, num_batches_divided_by
) -> int:
    """The micro-batch count every rank uses; raises on every rank alike if any rank cannot meet it."""
    import torch.distributed as dist

    num_units = len(seq_lens) // unit
    target = max(local_count, int(min_num_micro_batch or 0))
    longest_unit = int(seq_lens.reshape(num_units, unit).sum(axis=1).max()) if num_units else 0
    fewest_units = num_units
    if dist.is_available() and dist.is_initialized() and dp_group is not None:
        # One MAX all-reduce agrees on the count and on every fatal condition, so either all DP
        # ranks raise or none does (a lone raise would leave the others hanging in the next collective).
        agreed = torch.tensor([target, longest_unit, -fewest_units], dtype=torch.int64, device=_reduce_device(dp_group))
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=dp_group)
        target, longest_unit, fewest_units = int(agreed[0]), int(agreed[1]), -int(agreed[2])
    if num_batches_divided_by:
        target = -(-target // int(num_batches_divided_by)) * int(num_batches_divided_by)
    if longest_unit > max_token_len:
        what = "sample" if unit == 1 else f"group of {unit} samples"
        raise OverlongSampleError(
            f"a {what} on some DP rank has {longest_unit} tokens > max_token_len={max_token_len}; "
            "valid: raise ppo_max_token_len_per_gpu (max_token_len = per-GPU cap * sp size)"
        )
    if target > fewest_units:
        raise TooFewSamplesError(
            f"{target} micro-batches are needed on every DP rank, but some rank has only {fewest_units} "
            f"{'samples' if unit == 1 else 'groups'}; valid: a larger batch or a larger max_token_len"
        )
    return target


def _micro_batches_at_count(seq_lens, costs, target, max_token_len, unit, local_micro) -> list[list[int]]:
    """Exactly ``target`` capped micro-batches: ours, or verl's choice when its heaviest is lighter."""
    micro = local_micro
    if len(micro) < target:
        micro = _micro_batches_for_count(seq_lens, costs, target, max_token_len, unit, micro)
    seeded = _seeded_micro_batches(seq_lens, costs, target, max_token_len, unit)
    if seeded is not None and max(costs[mb].sum() for mb in seeded) < max(costs[mb].sum() for mb in micro):
        micro = seeded
    assert len(micro) == target and sorted(sum(micro, [])) == list(range(len(seq_lens))), "lost an index"
    assert all(seq_lens[mb].sum() <= max_token_len for mb in micro), "micro-batch over max_token_len"
    return micro


def _seeded_micro_batches(seq_lens, costs, target, cap, unit) -> list[list[int]] | None:
    """``target`` micro-batches from ``_balanced_parts``, or None if they break the cap or one is empty."""
    if target < 1 or len(seq_lens) // unit < target or len(seq_lens) // unit > _SEED_MAX_ITEMS:
        return None
    unit_costs = costs.reshape(-1, unit).sum(axis=1)
    unit_tokens = seq_lens.reshape(-1, unit).sum(axis=1)
    parts = _balanced_parts(unit_costs, target, equal_size=False, tokens=unit_tokens, token_cap=cap)
    micro = [sorted((part[:, None] * unit + np.arange(unit)).ravel().tolist()) for part in parts]
    if any(not mb for mb in micro) or any(seq_lens[mb].sum() > cap for mb in micro):
        return None
    return micro


def _micro_batches_for_count(seq_lens, costs, target, cap, unit, fallback) -> list[list[int]]:
    """Exactly ``target`` non-empty capped micro-batches."""
    unit_costs = costs.reshape(-1, unit).sum(axis=1)
    parts = _fill_empty_parts(balanced_partition(costs=unit_costs, num_parts=target, equal_size=False), unit_costs)
    micro = [sorted((part[:, None] * unit + np.arange(unit)).ravel().tolist()) for part in parts]
    if all(seq_lens[mb].sum() <= cap for mb in micro):
        return micro
    micro = list(fallback) if fallback else [list(range(len(seq_lens)))]
    while len(micro) < target:
        micro = _split_heaviest(micro, costs, unit)
    return micro
