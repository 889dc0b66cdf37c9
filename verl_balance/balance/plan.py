"""``plan_balance``: which DP rank and which micro-batch every sample goes to, and why.

Invariants (each asserted by tests/balance):
- every kept sample appears in exactly one micro-batch of exactly one rank; ``skipped`` lists
  the others (only with overlong="skip"), and ``order[inverse_permutation]`` is the kept samples
  in ascending input order;
- every rank has the same number of micro-batches; a balanced plan has an empty micro-batch only
  when unavoidable;
- equal_size=True: per-rank sample (or group) counts differ by at most one;
- micro_batch_size: every micro-batch holds exactly micro_batch_size samples, except the last of
  each rank; max_token_len_per_gpu: every micro-batch of T tokens satisfies
  ceil(T / sp) <= max_token_len_per_gpu;
- a group (same group id) is never split across ranks, nor across micro-batches with
  group_scope="micro_batch";
- samples inside a micro-batch are in ascending input order; the same input gives the same plan;
- at the same micro-batch count, a balanced plan is never worse than the naive contiguous one on
  (sync_cost, max rank cost), in that order (``plan_objective``).

With a fixed cost c0 per micro-batch (0 for token and FLOPs workloads), ``sync_cost`` =
K * c0 + sum_j max_d cost(d, j) and ``lower_bound`` = max(total / dp, largest unit) +
micro_batch_bound * c0 <= sync_cost of any plan.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypedDict

import numpy as np

from verl_balance.balance.errors import (
    BalanceConfigError,
    EmptyBatchError,
    InvalidLengthError,
    OverlongSampleError,
    TooFewSamplesError,
)
from verl_balance.balance.micro_batch import (
    assign_cells_to_ranks,
    balanced_fixed_size_cells,
    balanced_per_rank_micro_batches,
    balanced_token_cap_layout,
    naive_layout,
)
from verl_balance.balance.partition import balanced_partition
from verl_balance.balance.workload import Workload, micro_batch_overhead, resolve_workload

OVERLONG_POLICIES = ("error", "skip", "truncate")
GROUP_SCOPES = ("micro_batch", "rank")


@dataclass(frozen=True)
class BalanceConfig:
    """Knobs of the balanced planner (defaults meet the targets in benchmarks/balance_bench.py)."""

    refine: bool = True  # pairwise-swap refinement after the greedy deal
    rel_tol: float = 1e-5  # stop refining a slot once its max cell is within this of its mean
    max_refine_passes: int = 16
    polish_passes: int = 8  # cross-slot swaps lowering sum_j max_d cost(d, j)


class BalanceStats(TypedDict):
    """Predicted figures of one plan, in workload units (``sync_cost`` includes the fixed cost per
    micro-batch, ``total_cost`` excludes it)."""

    num_samples: int
    num_kept: int
    num_skipped: int
    num_truncated: int
    truncated_tokens: int
    dp_size: int
    sp_size: int
    total_cost: float
    total_tokens: int
    lower_bound: float
    max_rank_cost: float
    imbalance: float
    """max rank cost / lower bound."""
    sync_cost: float
    sync_ratio: float
    """sync_cost / lower bound."""
    max_slot_ratio: float
    """Worst max/mean over ranks within one micro-batch index."""
    num_micro_batches: int
    micro_batch_bound: int
    """ceil(tokens / (dp * cap * sp)) with a per-SP-rank token cap, ceil(ceil(n / dp) / micro_batch_size) otherwise."""
    max_tokens_per_sp_rank: int
    naive_imbalance: float
    naive_sync_cost: float
    naive_sync_ratio: float
    naive_num_micro_batches: int


@dataclass(frozen=True)
class BalancePlan:
    """Per DP rank its micro-batches, each an int64 array of input sample indices (frozen)."""

    micro_batches: list[list[np.ndarray]]
    stats: BalanceStats = field(default_factory=dict)  # type: ignore[assignment]
    skipped: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    truncated: dict = field(default_factory=dict)
    cell_costs: np.ndarray | None = None  # [dp_rank, micro_idx] predicted cost (with the fixed cost per micro-batch)
    cell_tokens: np.ndarray | None = None  # [dp_rank, micro_idx] tokens (after truncation)

    @property
    def dp_size(self) -> int:
        return len(self.micro_batches)

    @property
    def num_micro_batches(self) -> int:
        """Micro-batches per rank (the same on every rank)."""
        return len(self.micro_batches[0])

    def rank_indices(self, dp_rank: int) -> np.ndarray:
        """All sample indices of one DP rank, in micro-batch order."""
        mbs = self.micro_batches[dp_rank]
        return np.concatenate(mbs) if mbs else np.zeros(0, dtype=np.int64)

    def micro_batch_sizes(self, dp_rank: int) -> list[int]:
        """Number of samples in each micro-batch of one DP rank."""
        return [len(mb) for mb in self.micro_batches[dp_rank]]

    @property
    def order(self) -> np.ndarray:
        """Concatenation of every rank's indices, rank-major then micro-batch-major."""
        return np.concatenate([self.rank_indices(r) for r in range(self.dp_size)])

    @property
    def inverse_permutation(self) -> np.ndarray:
        """inv such that order[inv] is the kept samples in ascending input order."""
        return np.argsort(self.order, kind="stable")


@dataclass(frozen=True)
class _PlanInputs:
    """One plan's validated inputs, after the overlong policy: what both planners start from."""

    dp_size: int
    sp_size: int
    micro_batch_size: int | None
    token_cap: int | None  # tokens per micro-batch over all SP ranks (max_token_len_per_gpu * sp_size)
    balance: bool
    equal_size: bool
    group_ids: np.ndarray | None
    config: BalanceConfig
    micro_batch_cost: float  # the workload's fixed cost per micro-batch (0 unless calibrated)
    lengths: np.ndarray  # per sample, after truncation
    lengths_kept: np.ndarray  # lengths, 0 for skipped samples
    sample_costs: np.ndarray  # per sample, 0 for skipped samples
    unit_of_sample: np.ndarray  # what the micro-batch packer may not split (atomic group or sample); -1 = skipped
    rank_unit_of_sample: np.ndarray  # what a rank takes whole (group or sample); -1 = skipped
    rank_unit_cost: np.ndarray
    skipped: np.ndarray
    truncated: dict

    @property
    def kept(self) -> np.ndarray:
        """Indices of the samples that are planned (not skipped)."""
        return np.flatnonzero(self.unit_of_sample >= 0)

    @property
    def refine_kwargs(self) -> dict:
        """Pairwise-swap refinement knobs of the micro-batch packers (refine=False: no refinement)."""
        config = self.config
        return dict(rel_tol=config.rel_tol if config.refine else np.inf, max_passes=config.max_refine_passes)

    @property
    def polish_passes(self) -> int:
        return self.config.polish_passes if self.config.refine else 0


def plan_balance(
    *,
    seq_lens,
    dp_size: int,
    sp_size: int = 1,
    micro_batch_size: int | None = None,
    max_token_len_per_gpu: int | None = None,
    balance: bool = True,
    group_ids=None,
    workload: Workload | str | None = None,
    equal_size: bool = True,
    overlong: str = "error",
    group_scope: str = "micro_batch",
    config: BalanceConfig | None = None,
) -> BalancePlan:
    """Plan DP ranks x micro-batches for one global batch (invariants: module docstring).

    group_ids: samples sharing an id stay on one rank (and one micro-batch with
    group_scope="micro_batch"); overlong: "error" | "skip" | "truncate" over the token cap."""
    _check_config(dp_size, sp_size, micro_batch_size, max_token_len_per_gpu, overlong)
    if group_scope not in GROUP_SCOPES:
        raise BalanceConfigError(f"group_scope={group_scope!r} is invalid; valid: {GROUP_SCOPES}")
    inputs = _plan_inputs(
        lengths=_check_lengths(seq_lens),
        cost_model=resolve_workload(workload),
        dp_size=dp_size,
        sp_size=sp_size,
        micro_batch_size=micro_batch_size,
        max_token_len_per_gpu=max_token_len_per_gpu,
        balance=balance,
        group_ids=group_ids,
        groups_atomic=group_ids is not None and group_scope == "micro_batch",
        equal_size=equal_size,
        overlong=overlong,
        config=config or BalanceConfig(),
    )
    if group_ids is not None and group_scope == "rank":
        return _plan_rank_scoped_groups(inputs)
    return _plan_packed_units(inputs)


def _plan_inputs(
    *,
    lengths,
    cost_model,
    dp_size,
    sp_size,
    micro_batch_size,
    max_token_len_per_gpu,
    balance,
    group_ids,
    groups_atomic,
    equal_size,
    overlong,
    config,
) -> _PlanInputs:
    """Apply the overlong policy and find the units, their costs, and the feasibility of equal_size."""
    token_cap = None if max_token_len_per_gpu is None else int(max_token_len_per_gpu) * int(sp_size)
    group_of_sample = _unit_ids(group_ids, len(lengths))
    # Units are what the micro-batch packer may not split: groups, or single samples when groups
    # only have to share a rank.
    unit_of_sample = group_of_sample if groups_atomic else np.arange(len(lengths), dtype=np.int64)
    skipped, truncated = np.zeros(0, dtype=np.int64), {}
    if token_cap is not None:
        lengths, unit_of_sample, skipped, truncated = _apply_overlong(
            lengths, unit_of_sample, token_cap, int(max_token_len_per_gpu), int(sp_size), overlong, groups_atomic
        )
    kept = np.flatnonzero(unit_of_sample >= 0)
    if len(kept) == 0:
        raise EmptyBatchError(
            f"all {len(lengths)} samples were skipped as longer than the token cap {token_cap}; "
            "raise max_token_len_per_gpu or use overlong='truncate'"
        )
    rank_unit_of_sample = _rank_units(group_ids, kept, len(lengths), dp_size=dp_size, equal_size=equal_size)
    sample_costs = cost_model.cost(lengths)
    sample_costs[unit_of_sample < 0] = 0.0
    num_rank_units = int(rank_unit_of_sample.max()) + 1
    return _PlanInputs(
        dp_size=dp_size,
        sp_size=sp_size,
        micro_batch_size=micro_batch_size,
        token_cap=token_cap,
        balance=balance,
        equal_size=equal_size,
        group_ids=group_ids,
        config=config,
        micro_batch_cost=micro_batch_overhead(cost_model),
        lengths=lengths,
        lengths_kept=np.where(unit_of_sample >= 0, lengths, 0),
        sample_costs=sample_costs,
        unit_of_sample=unit_of_sample,
        rank_unit_of_sample=rank_unit_of_sample,
        rank_unit_cost=np.bincount(rank_unit_of_sample[kept], weights=sample_costs[kept], minlength=num_rank_units),
        skipped=skipped,
        truncated=truncated,
    )


def _rank_units(group_ids, kept: np.ndarray, num_samples: int, *, dp_size: int, equal_size: bool) -> np.ndarray:
    """Rank-level unit per sample (group by first appearance, or itself; -1 skipped); checks equal_size."""
    rank_unit_of_sample = np.full(num_samples, -1, dtype=np.int64)
    rank_unit_of_sample[kept] = (
        _unit_ids(np.asarray(group_ids)[kept], len(kept)) if group_ids is not None else np.arange(len(kept))
    )
    num_rank_units = int(rank_unit_of_sample.max()) + 1
    if equal_size and num_rank_units < dp_size:
        what = "groups" if group_ids is not None else "samples"
        raise TooFewSamplesError(
            f"{num_rank_units} {what} cannot be split into dp_size={dp_size} ranks with equal counts; "
            f"valid: dp_size <= {num_rank_units}, more {what}, or equal_size=False"
        )
    return rank_unit_of_sample


def _plan_packed_units(inputs: _PlanInputs) -> BalancePlan:
    """Planner for samples or atomic groups: units dealt jointly to (rank, micro-batch) cells."""
    unit_of_sample, kept = inputs.unit_of_sample, inputs.kept
    num_units = int(unit_of_sample.max()) + 1
    unit_cost = np.bincount(unit_of_sample[kept], weights=inputs.sample_costs[kept], minlength=num_units)
    unit_tokens = np.bincount(unit_of_sample[kept], weights=inputs.lengths[kept], minlength=num_units).astype(np.int64)
    unit_size = np.bincount(unit_of_sample[kept], minlength=num_units)
    unit_mbs = (
        None
        if inputs.micro_batch_size is None
        else _units_per_micro_batch(unit_size, int(inputs.micro_batch_size), inputs.group_ids)
    )
    naive_rank_items = np.array_split(np.arange(num_units, dtype=np.int64), inputs.dp_size)
    naive = naive_layout(
        rank_items=naive_rank_items, tokens=unit_tokens, micro_batch_size=unit_mbs, token_cap=inputs.token_cap
    )
    naive = _expand_units(naive, unit_of_sample)
    micro_batches = naive
    if inputs.balance:
        layout = _balanced_unit_layout(inputs, unit_cost=unit_cost, unit_tokens=unit_tokens, unit_mbs=unit_mbs)
        micro_batches = _expand_units([[cell[cell >= 0] for cell in rank] for rank in layout], unit_of_sample)
    return _finished_plan(inputs, micro_batches, naive, bound_items=num_units, bound_mbs=unit_mbs)


def _balanced_unit_layout(inputs: _PlanInputs, *, unit_cost, unit_tokens, unit_mbs) -> np.ndarray:
    """layout[rank, micro, position] of unit ids (-1 = empty) for the packed-units planner."""
    if unit_mbs is not None:
        cells = balanced_fixed_size_cells(
            costs=unit_cost,
            dp_size=inputs.dp_size,
            micro_batch_size=unit_mbs,
            polish_passes=inputs.polish_passes,
            **inputs.refine_kwargs,
        )
        return assign_cells_to_ranks(cells, unit_cost)
    layout = balanced_token_cap_layout(
        costs=unit_cost,
        tokens=unit_tokens,
        dp_size=inputs.dp_size,
        token_cap=inputs.token_cap,
        equal_size=inputs.equal_size,
        polish_passes=inputs.polish_passes,
        micro_batch_cost=inputs.micro_batch_cost,
        **inputs.refine_kwargs,
    )
    # Heaviest micro-batch first: an out-of-memory shows up on the first micro-batch.
    return layout[:, np.argsort(-np.append(unit_tokens, 0)[layout].sum(axis=(0, 2)), kind="stable")]


def _plan_rank_scoped_groups(inputs: _PlanInputs) -> BalancePlan:
    """Planner for group_scope="rank": groups pick ranks, then each rank's samples are packed."""
    naive_rank_items = _expand_units(
        [np.array_split(np.arange(len(inputs.rank_unit_cost)), inputs.dp_size)], inputs.rank_unit_of_sample
    )[0]
    naive = naive_layout(
        rank_items=naive_rank_items,
        tokens=inputs.lengths_kept,
        micro_batch_size=inputs.micro_batch_size,
        token_cap=inputs.token_cap,
    )
    micro_batches = naive
    if inputs.balance:
        rank_units = balanced_partition(
            costs=inputs.rank_unit_cost,
            num_parts=inputs.dp_size,
            equal_size=inputs.equal_size,
            refine=inputs.config.refine,
            rel_tol=inputs.config.rel_tol,
        )
        micro_batches = balanced_per_rank_micro_batches(
            rank_items=_expand_units([rank_units], inputs.rank_unit_of_sample)[0],
            costs=inputs.sample_costs,
            tokens=inputs.lengths_kept,
            micro_batch_size=inputs.micro_batch_size,
            token_cap=inputs.token_cap,
            **inputs.refine_kwargs,
        )
        micro_batches = [[np.sort(mb) for mb in rank] for rank in micro_batches]
    return _finished_plan(inputs, micro_batches, naive, bound_items=len(inputs.kept), bound_mbs=inputs.micro_batch_size)


def _finished_plan(inputs: _PlanInputs, micro_batches, naive, *, bound_items, bound_mbs) -> BalancePlan:
    """The plan with its cell figures and stats (``naive``: the contiguous plan, for naive_*)."""
    overhead = inputs.micro_batch_cost
    cell_costs = _cell_sums(micro_batches, inputs.sample_costs) + overhead
    cell_tokens = _cell_sums(micro_batches, inputs.lengths_kept.astype(np.float64)).astype(np.int64)
    naive_costs = cell_costs if not inputs.balance else _cell_sums(naive, inputs.sample_costs) + overhead
    if inputs.balance and _naive_is_better(cell_costs, naive_costs, micro_batches, naive):
        micro_batches, cell_costs = naive, naive_costs
        cell_tokens = _cell_sums(micro_batches, inputs.lengths_kept.astype(np.float64)).astype(np.int64)
    if inputs.token_cap is not None:
        assert cell_tokens.max() <= inputs.token_cap, "balancer produced a micro-batch over the token cap"
    return BalancePlan(
        micro_batches=micro_batches,
        stats=_stats(
            inputs,
            cell_costs=cell_costs,
            cell_tokens=cell_tokens,
            naive_costs=naive_costs,
            naive_micro=len(naive[0]),
            bound_items=bound_items,
            bound_mbs=bound_mbs,
        ),
        skipped=inputs.skipped,
        truncated=inputs.truncated,
        cell_costs=cell_costs,
        cell_tokens=cell_tokens,
    )


def _check_config(dp_size, sp_size, micro_batch_size, max_token_len_per_gpu, overlong) -> None:
    for key, value in (("dp_size", dp_size), ("sp_size", sp_size)):
        if not isinstance(value, (int, np.integer)) or value < 1:
            raise BalanceConfigError(f"{key}={value!r} is invalid; valid: an integer >= 1")
    if (micro_batch_size is None) == (max_token_len_per_gpu is None):
        raise BalanceConfigError(
            f"give exactly one of micro_batch_size (got {micro_batch_size!r}) and "
            f"max_token_len_per_gpu (got {max_token_len_per_gpu!r})"
        )
    for key, value in (("micro_batch_size", micro_batch_size), ("max_token_len_per_gpu", max_token_len_per_gpu)):
        if value is not None and (not isinstance(value, (int, np.integer)) or value < 1):
            raise BalanceConfigError(f"{key}={value!r} is invalid; valid: an integer >= 1")
    if overlong not in OVERLONG_POLICIES:
        raise BalanceConfigError(f"overlong={overlong!r} is invalid; valid: {OVERLONG_POLICIES}")


def _check_lengths(seq_lens) -> np.ndarray:
    raw = np.asarray(seq_lens)
    if raw.ndim != 1:
        raise InvalidLengthError(f"seq_lens must be one length per sample (1-D); got shape {raw.shape}")
    if raw.size == 0:
        raise EmptyBatchError("seq_lens is empty; a plan needs at least one sample")
    if raw.dtype.kind not in "iub":
        bad = np.flatnonzero(~np.isfinite(raw.astype(np.float64)) | (raw != np.round(raw)))
        if raw.dtype.kind != "f" or len(bad):
            i = int(bad[0]) if len(bad) else 0
            raise InvalidLengthError(
                f"sample {i} has length {raw[i].item()!r}; valid: a non-negative integer token count"
            )
    lengths = raw.astype(np.int64)
    negative = np.flatnonzero(lengths < 0)
    if len(negative):
        i = int(negative[0])
        raise InvalidLengthError(
            f"sample {i} has negative length {lengths[i]} ({len(negative)} negative in total); "
            "valid: a non-negative integer token count"
        )
    return lengths


def _unit_ids(group_ids, num_samples: int) -> np.ndarray:
    """Unit id per sample: the sample itself, or its group numbered by first appearance."""
    if group_ids is None:
        return np.arange(num_samples, dtype=np.int64)
    groups = np.asarray(group_ids)
    if groups.shape != (num_samples,):
        raise BalanceConfigError(
            f"group_ids has shape {groups.shape}; valid: one id per sample, shape ({num_samples},)"
        )
    _, first, inverse = np.unique(groups, return_index=True, return_inverse=True)
    rank_by_first = np.empty(len(first), dtype=np.int64)
    rank_by_first[np.argsort(first, kind="stable")] = np.arange(len(first))
    return rank_by_first[inverse.ravel()]


def _apply_overlong(lengths, unit_of_sample, token_cap, cap_per_gpu, sp_size, policy, grouped):
    """Enforce the cap on samples and units; returns (lengths, unit ids with -1 = skipped, skipped, truncated)."""
    lengths = lengths.copy()
    unit_of_sample = unit_of_sample.copy()
    valid = f"valid: length <= max_token_len_per_gpu * sp_size = {cap_per_gpu} * {sp_size} = {token_cap}"
    over = np.flatnonzero(lengths > token_cap)
    truncated: dict[int, int] = {}
    if len(over) and policy == "error":
        i = int(over[0])
        raise OverlongSampleError(
            f"sample {i} has length {lengths[i]} > token cap ({len(over)} such samples); {valid}; "
            "or set overlong='skip'/'truncate'"
        )
    if len(over) and policy == "truncate":
        truncated = {int(i): token_cap for i in over}
        lengths[over] = token_cap
    unit_tokens = np.bincount(unit_of_sample, weights=lengths)
    over_units = np.flatnonzero(unit_tokens > token_cap)
    if len(over_units) and (policy == "error" or (policy == "truncate" and grouped)):
        u = int(over_units[0])
        members = np.flatnonzero(unit_of_sample == u)
        raise OverlongSampleError(
            f"group of samples {members.tolist()} has {int(unit_tokens[u])} tokens > token cap and a group is "
            f"never split; {valid} per group, or overlong='skip', or group_scope='rank' (groups share a rank only)"
        )
    dropped = np.isin(unit_of_sample, over_units)
    skipped = np.flatnonzero(dropped)
    # Renumber the surviving units densely, in order of first appearance.
    keep_units = np.setdiff1d(np.arange(len(unit_tokens)), over_units)
    new_id = np.full(len(unit_tokens), -1, dtype=np.int64)
    new_id[keep_units] = np.arange(len(keep_units))
    return lengths, new_id[unit_of_sample], skipped, truncated


def _units_per_micro_batch(unit_size: np.ndarray, micro_batch_size: int, group_ids) -> int:
    """Fixed micro-batch size in units; groups must all have one size that divides it."""
    if group_ids is None:
        return micro_batch_size
    sizes = np.unique(unit_size)
    if len(sizes) != 1 or micro_batch_size % int(sizes[0]):
        odd = int(np.flatnonzero(unit_size != unit_size[0])[0]) if len(sizes) != 1 else 0
        raise BalanceConfigError(
            f"micro_batch_size={micro_batch_size} with groups needs every group to have the same size dividing "
            f"it; group {odd} (by first appearance) has {int(unit_size[odd])} samples, group sizes are "
            f"{sizes.tolist()}; valid: a multiple of the common group size, or use max_token_len_per_gpu"
        )
    return micro_batch_size // int(sizes[0])


def _expand_units(unit_micro_batches, unit_of_sample) -> list[list[np.ndarray]]:
    """Unit ids per cell -> sorted sample ids per cell (samples with unit -1 are dropped)."""
    kept = np.flatnonzero(unit_of_sample >= 0)
    by_unit = kept[np.argsort(unit_of_sample[kept], kind="stable")]
    sizes = np.bincount(unit_of_sample[kept])
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    if len(by_unit) == len(sizes):  # one sample per unit
        return [[np.sort(by_unit[cell]) for cell in rank] for rank in unit_micro_batches]
    out = []
    for rank in unit_micro_batches:
        cells = []
        for cell in rank:
            counts = sizes[cell]
            flat = np.repeat(starts[cell] - np.concatenate([[0], np.cumsum(counts)[:-1]]), counts)
            cells.append(np.sort(by_unit[flat + np.arange(int(counts.sum()))]))
        out.append(cells)
    return out


def _cell_sums(unit_micro_batches, unit_values: np.ndarray) -> np.ndarray:
    """[rank, micro] sums of ``unit_values`` over each micro-batch's units."""
    dp_size, num_micro = len(unit_micro_batches), len(unit_micro_batches[0])
    flat = [cell for rank in unit_micro_batches for cell in rank]
    cell_of = np.repeat(np.arange(len(flat)), [len(c) for c in flat])
    units = np.concatenate(flat)
    return np.bincount(cell_of, weights=unit_values[units], minlength=len(flat)).reshape(dp_size, num_micro)


def _naive_is_better(cell_costs, naive_costs, micro_batches, naive) -> bool:
    """True when the contiguous plan, no emptier at the same count, has a lower (sync, max rank) cost."""
    if naive_costs.shape != cell_costs.shape:
        return False
    empty = sum(len(cell) == 0 for rank in micro_batches for cell in rank)
    if sum(len(cell) == 0 for rank in naive for cell in rank) > empty:
        return False
    # Equal up to summation order counts as a tie (the balanced plan stays): 1e-9 relative.
    for theirs, ours in zip(plan_objective(naive_costs), plan_objective(cell_costs)):
        if abs(theirs - ours) > 1e-9 * max(abs(ours), 1e-300):
            return theirs < ours
    return False


def plan_objective(cell_costs: np.ndarray) -> tuple[float, float]:
    """(sync cost, max rank cost): what the planner lowers once the micro-batch count is set."""
    return float(cell_costs.max(axis=0).sum()), float(cell_costs.sum(axis=1).max())


def sync_figures(cell_costs: np.ndarray, lower_bound: float) -> tuple[float, float, float]:
    """(max rank cost / bound, sum_j max_d cost, that / bound); ratios are 1 for an all-zero batch."""
    rank_max = float(cell_costs.sum(axis=1).max())
    sync = float(cell_costs.max(axis=0).sum())
    if lower_bound <= 0:
        return 1.0, sync, 1.0
    return rank_max / lower_bound, sync, sync / lower_bound


def _stats(
    inputs: _PlanInputs, *, cell_costs, cell_tokens, naive_costs, naive_micro, bound_items, bound_mbs
) -> BalanceStats:
    sample_costs, dp_size, sp_size, token_cap = inputs.sample_costs, inputs.dp_size, inputs.sp_size, inputs.token_cap
    total_tokens = int(inputs.lengths_kept.sum())
    num_samples, skipped, truncated = len(inputs.lengths), inputs.skipped, inputs.truncated
    total = float(sample_costs.sum())
    if token_cap is not None:
        bound = max(1, -(-total_tokens // (dp_size * token_cap)))
    else:
        items_per_rank = -(-bound_items // dp_size)
        bound = max(1, -(-items_per_rank // bound_mbs))
    # Every plan has at least `bound` micro-batches, each paying the fixed cost on every rank.
    lower_bound = max(total / dp_size, float(inputs.rank_unit_cost.max())) + bound * inputs.micro_batch_cost
    imbalance, sync, sync_ratio = sync_figures(cell_costs, lower_bound)
    naive_imbalance, naive_sync, naive_sync_ratio = sync_figures(naive_costs, lower_bound)
    per_sp_rank = -(-cell_tokens // sp_size)
    slot = cell_costs
    slot_mean = slot.mean(axis=0)
    slot_ratio = np.divide(slot.max(axis=0), slot_mean, out=np.ones_like(slot_mean), where=slot_mean > 0)
    return BalanceStats(
        num_samples=num_samples,
        num_kept=num_samples - len(skipped),
        num_skipped=len(skipped),
        num_truncated=len(truncated),
        truncated_tokens=int(sum(truncated.values())) if truncated else 0,
        dp_size=dp_size,
        sp_size=sp_size,
        total_cost=total,
        total_tokens=total_tokens,
        lower_bound=lower_bound,
        max_rank_cost=float(cell_costs.sum(axis=1).max()),
        imbalance=imbalance,
        sync_cost=sync,
        sync_ratio=sync_ratio,
        max_slot_ratio=float(slot_ratio.max()),
        num_micro_batches=cell_costs.shape[1],
        micro_batch_bound=bound,
        max_tokens_per_sp_rank=int(per_sp_rank.max()),
        naive_imbalance=naive_imbalance,
        naive_sync_cost=naive_sync,
        naive_sync_ratio=naive_sync_ratio,
        naive_num_micro_batches=naive_micro,
    )
