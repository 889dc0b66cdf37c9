"""Joint DP x micro-batch layouts over *units* (a sample, or a group kept together).

A layout is a cell grid ``cells[slot, part, position]`` of unit ids (-1 = empty); after
``assign_cells_to_ranks`` a slot is one micro-batch index and a part is one DP rank.

With FSDP every micro-batch ends in collectives, so each step costs
``sum_j max_d cost(d, j)`` (the synchronised cost), not ``max_d sum_j cost(d, j)``. Both are
>= lower bound = max(total / dp, largest unit). The balanced layout attacks the sum of maxima
directly: units are sorted by cost and cut into rows of ``dp`` (near-equal units); whole rows go
to micro-batch slots, and inside a slot the rows are dealt across the DP ranks and refined by
swaps (``partition.refine_cells``) until the ranks' cells in that slot are equal to a relative
tolerance. Then sum_j max_d = sum_j mean_d + (small excess per slot) = total / dp + excess;
``partition.polish_sync_cost`` then trims that excess with swaps across slots (a slot's heaviest
cell trades with any cell that has room below its own slot's maximum).

When groups only have to share a rank (``balanced_per_rank_micro_batches``), groups are first
split across ranks (``balanced_partition``) and each rank's samples are then packed into the
shared number of micro-batches, balanced within the rank and aligned across ranks by size.

Invariants:
- fixed micro_batch_size (in units): every rank has ceil(max_count / mbs) slots; slot j < last
  holds exactly ``mbs`` units on every rank, the last slot the remainder; rank unit counts
  differ by at most one (only the last slot holds the partial row);
- token cap C = max_token_len_per_gpu * sp (a micro-batch of T tokens is padded to ceil(T/sp)*sp
  and each SP rank holds ceil(T/sp), so ceil(T/sp) <= cap <=> T <= C): no cell exceeds C; the
  slot count starts at the bound ceil(total_tokens / (dp * C)) and grows by one only when the
  refined layout does not fit (it always fits at one row per slot, so the search terminates);
- the naive layout (balance=False) is contiguous in input order: rank d holds units
  array_split(range(U), dp)[d]; its micro-batches are contiguous chunks of mbs units or a
  greedy sequential fill up to C; ranks with fewer micro-batches get empty ones at the end;
- deterministic for the same input.
"""

from __future__ import annotations

import numpy as np

from verl_balance.balance.partition import (
    assign_rows_capacity,
    assign_rows_lpt,
    fill_cells,
    polish_sync_cost,
    refine_cells,
    sort_into_rows,
)


def balanced_fixed_size_cells(
    *, costs: np.ndarray, dp_size: int, micro_batch_size: int, rel_tol: float, max_passes: int, polish_passes: int
) -> np.ndarray:
    """Balanced layout where every micro-batch holds exactly ``micro_batch_size`` units (last: rest)."""
    num_units = len(costs)
    rows = sort_into_rows(costs, dp_size)
    full_rows, partial = divmod(num_units, dp_size)
    max_count = full_rows + (partial > 0)
    num_slots = max(1, -(-max_count // micro_batch_size))
    capacities = np.full(num_slots, micro_batch_size, dtype=np.int64)
    capacities[-1] = full_rows - (num_slots - 1) * micro_batch_size
    row_cost = np.append(costs, 0.0)[rows].sum(axis=1)
    row_slot = np.empty(len(rows), dtype=np.int64)
    row_slot[:full_rows] = assign_rows_capacity(row_cost[:full_rows], capacities)
    if partial:
        row_slot[full_rows] = num_slots - 1
    cells = fill_cells(rows=rows, row_slot=row_slot, num_slots=num_slots, costs=costs)
    refine_cells(cells, costs, allow_moves=False, rel_tol=rel_tol, max_passes=max_passes)
    return polish_sync_cost(cells, costs, max_passes=polish_passes)


def balanced_token_cap_cells(
    *,
    costs: np.ndarray,
    tokens: np.ndarray,
    dp_size: int,
    token_cap: int,
    equal_size: bool,
    rel_tol: float,
    max_passes: int,
    polish_passes: int,
) -> np.ndarray:
    """Balanced layout where no cell holds more than ``token_cap`` tokens, fewest slots found."""
    rows = sort_into_rows(costs, dp_size)
    padded_tokens = np.append(tokens, 0)
    row_tokens = padded_tokens[rows].sum(axis=1).astype(np.float64)
    num_slots = max(1, -(-int(tokens.sum()) // (dp_size * token_cap)))
    while True:
        row_slot = _pack_rows(row_tokens, num_slots, dp_size * token_cap, rel_tol, max_passes)
        extra = 0 if equal_size else max(1, len(rows) // num_slots // 4 + 1)
        cells = fill_cells(rows=rows, row_slot=row_slot, num_slots=num_slots, costs=costs, extra_width=extra)
        refine_cells(cells, costs, allow_moves=not equal_size, rel_tol=rel_tol, max_passes=max_passes)
        if padded_tokens[cells].sum(axis=-1).max() <= token_cap:
            # With cost == tokens a swap never lifts a cell above its slot's (capped) maximum.
            same = np.array_equal(costs, tokens)
            return polish_sync_cost(
                cells, costs, tokens=None if same else tokens, token_cap=None if same else token_cap,
                max_passes=polish_passes,
            )
        # One row per slot always fits (every unit <= cap), so this loop ends by num_slots == rows.
        assert num_slots < len(rows), "token cap unsatisfiable with one row per slot"
        num_slots += 1


def _pack_rows(row_tokens: np.ndarray, num_slots: int, slot_cap: int, rel_tol: float, max_passes: int) -> np.ndarray:
    """Rows -> slots by LPT on tokens; if a slot overflows, refine slot totals by row swaps/moves."""
    row_slot = assign_rows_lpt(row_tokens, num_slots)
    slot_tokens = np.bincount(row_slot, weights=row_tokens, minlength=num_slots)
    if slot_tokens.max() <= slot_cap or num_slots == 1:
        return row_slot
    # Rows become items of a single refinement problem whose parts are the slots (free counts).
    row_ids = np.arange(len(row_tokens))
    by_slot = np.lexsort((row_ids, row_slot))
    counts = np.bincount(row_slot, minlength=num_slots)
    width = int(counts.max()) + max(1, int(counts.max()) // 2)
    grid = np.full((1, num_slots, width), -1, dtype=np.int64)
    position = row_ids - np.repeat(np.concatenate([[0], np.cumsum(counts)[:-1]]), counts)
    grid[0, row_slot[by_slot], position] = by_slot
    refine_cells(grid, row_tokens, allow_moves=True, rel_tol=0.0, max_passes=max_passes, stop_at=slot_cap)
    slot_of = np.empty(len(row_tokens), dtype=np.int64)
    slots, _ = np.nonzero(grid[0] >= 0)
    slot_of[grid[0][grid[0] >= 0]] = slots
    return slot_of


def assign_cells_to_ranks(cells: np.ndarray, costs: np.ndarray) -> np.ndarray:
    """Permute parts within each slot so that DP rank totals are balanced too.

    Slot by slot, the slot's heaviest cell goes to the rank with the lowest running total.
    Returns ``layout[rank, slot, position]``. Per-slot cell costs (hence the synchronised cost)
    are unchanged."""
    num_slots, dp_size, _ = cells.shape
    if dp_size == 1:
        return cells.transpose(1, 0, 2).copy()
    loads = np.append(costs, 0.0)[cells].sum(axis=-1)
    layout = np.empty((dp_size, num_slots, cells.shape[2]), dtype=np.int64)
    rank_totals = np.zeros(dp_size)
    for slot in range(num_slots):
        heaviest_first = np.argsort(-loads[slot], kind="stable")
        lightest_rank_first = np.argsort(rank_totals, kind="stable")
        layout[lightest_rank_first, slot] = cells[slot, heaviest_first]
        rank_totals[lightest_rank_first] += loads[slot, heaviest_first]
    return layout


def naive_layout(
    *, rank_items: list[np.ndarray], tokens: np.ndarray, micro_batch_size: int | None, token_cap: int | None
) -> list[list[np.ndarray]]:
    """Contiguous baseline: rank d keeps ``rank_items[d]`` in order; its micro-batches are contiguous
    chunks of ``micro_batch_size`` items or a greedy sequential fill up to ``token_cap`` tokens."""
    per_rank: list[list[np.ndarray]] = []
    for chunk in rank_items:
        if micro_batch_size is not None:
            bounds = list(range(0, len(chunk), micro_batch_size)) + [len(chunk)]
        else:
            cumulative = np.concatenate([[0], np.cumsum(tokens[chunk])])
            bounds = [0]
            while bounds[-1] < len(chunk):
                # Furthest end such that the tokens from bounds[-1] up to it fit the cap.
                end = int(np.searchsorted(cumulative, cumulative[bounds[-1]] + token_cap, side="right")) - 1
                bounds.append(max(end, bounds[-1] + 1))
        per_rank.append([chunk[a:b] for a, b in zip(bounds[:-1], bounds[1:]) if b > a])
    num_micro = max(1, max(len(m) for m in per_rank))
    empty = np.zeros(0, dtype=np.int64)
    return [m + [empty] * (num_micro - len(m)) for m in per_rank]


def balanced_per_rank_micro_batches(
    *,
    rank_items: list[np.ndarray],
    costs: np.ndarray,
    tokens: np.ndarray,
    micro_batch_size: int | None,
    token_cap: int | None,
    rel_tol: float,
    max_passes: int,
) -> list[list[np.ndarray]]:
    """Micro-batches for a fixed DP assignment (groups kept on one rank, not in one micro-batch).

    Each rank is one slot of a cell grid whose parts are its micro-batches: the rank's items are
    dealt largest-to-lightest and refined, so its micro-batches are near-equal in cost; then each
    rank's micro-batches are sorted by cost (descending) so that index j pairs like-sized
    micro-batches across ranks. With ``micro_batch_size`` the counts are exact (mbs, ..., rest,
    the rest last); with ``token_cap`` the micro-batch count is shared and grown until every
    micro-batch fits. Returns [rank][micro] arrays of item ids.
    """
    dp_size = len(rank_items)
    if micro_batch_size is not None:
        num_micro = max(1, max(-(-len(items) // micro_batch_size) for items in rank_items))
        layout = []
        for items in rank_items:
            order = items[np.argsort(-costs[items], kind="stable")]
            capacities = np.zeros(num_micro, dtype=np.int64)
            full, rest = divmod(len(items), micro_batch_size)
            capacities[:full] = micro_batch_size
            if rest:
                capacities[full] = rest
            cell_of = assign_rows_capacity(costs[order], capacities)
            width = max(1, int(capacities.max()))
            grid = np.full((1, num_micro, width), -1, dtype=np.int64)
            by_cell = np.lexsort((np.arange(len(order)), cell_of))
            position = np.arange(len(order)) - np.repeat(np.concatenate([[0], np.cumsum(capacities)[:-1]]), capacities)
            grid[0, cell_of[by_cell], position] = order[by_cell]
            # Swaps keep counts, so only the micro-batches holding exactly mbs items are refined
            # together; the partial one stays last.
            if full > 1:
                refine_cells(grid[:, :full], costs, rel_tol=rel_tol, max_passes=max_passes)
            loads = np.append(costs, 0.0)[grid[0, :full]].sum(axis=-1)
            full_order = np.argsort(-loads, kind="stable")
            cells = [grid[0, c] for c in full_order] + [grid[0, c] for c in range(full, num_micro)]
            layout.append([c[c >= 0] for c in cells])
        return layout
    padded_tokens = np.append(tokens, 0)
    num_micro = max(1, max(-(-int(tokens[items].sum()) // token_cap) for items in rank_items))
    while True:
        rows, row_slot = [], []
        for rank, items in enumerate(rank_items):
            order = items[np.argsort(-costs[items], kind="stable")]
            padded = np.full(-(-len(order) // num_micro) * num_micro, -1, dtype=np.int64)
            padded[: len(order)] = order
            rows.append(padded.reshape(-1, num_micro))
            row_slot.append(np.full(len(rows[-1]), rank, dtype=np.int64))
        rows_all = np.concatenate(rows) if rows else np.zeros((0, num_micro), dtype=np.int64)
        slots_all = np.concatenate(row_slot)
        extra = max(1, rows_all.shape[0] // max(dp_size, 1) // 4 + 1)
        grid = fill_cells(rows=rows_all, row_slot=slots_all, num_slots=dp_size, costs=costs, extra_width=extra)
        refine_cells(grid, costs, allow_moves=True, rel_tol=rel_tol, max_passes=max_passes)
        cell_tokens = padded_tokens[grid].sum(axis=-1)
        if cell_tokens.max() <= token_cap:
            break
        # One item per micro-batch always fits (every item <= cap), so this ends.
        assert num_micro < max(len(items) for items in rank_items), "token cap unsatisfiable"
        num_micro += 1
    loads = np.append(costs, 0.0)[grid].sum(axis=-1)
    layout = []
    for rank in range(dp_size):
        cells = grid[rank, np.argsort(-loads[rank], kind="stable")]
        layout.append([c[c >= 0] for c in cells])
    return layout
