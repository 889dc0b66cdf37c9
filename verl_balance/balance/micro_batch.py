"""Joint DP x micro-batch layouts over *units* (a sample, or a group kept together).

A layout is a cell grid ``cells[slot, part, position]`` of unit ids (-1 = empty); a slot is one
micro-batch index and a part one DP rank. A step costs ``sum_j max_d cost(d, j)`` (every
micro-batch ends in FSDP collectives). Token cap rule: fewest micro-batches first, then balance.

Invariants:
- fixed micro_batch_size (in units): every rank has ceil(max_count / mbs) slots, each full but the
  last; rank unit counts differ by at most one;
- token cap C = max_token_len_per_gpu * sp: no cell exceeds C; the slot count is at least
  ceil(total_tokens / (dp * C)) and at most first-fit-decreasing's; no micro-batch is emptied;
- with a fixed cost c0 per micro-batch, up to ``max_extra_slots`` more slots when that lowers
  K * c0 + sum_j max_d cost (``trade_slots_for_balance``);
- the naive layout (balance=False) is contiguous in input order, empty micro-batches at the end;
- deterministic for the same input.
"""

from __future__ import annotations

import numpy as np

from verl_balance.balance.partition import (
    assign_rows_capacity,
    assign_rows_lpt,
    balanced_partition,
    cell_loads,
    fill_cells,
    greedy_count_split,
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
    best, best_sync = None, np.inf
    # Two row-to-slot assignments: slot sums balanced, and heaviest rows together (sum_j max_d is
    # lowest when the large items share a slot: [16, 9 | 9, 1 | 1, 1] at dp=2, mbs=2 costs 18 + 1,
    # the balanced deal 17 + 9). The lower sync cost wins; a tie keeps the balanced one.
    for row_slot_of_full in (
        assign_rows_capacity(row_cost[:full_rows], capacities),
        np.repeat(np.arange(num_slots), capacities),
    ):
        row_slot = np.empty(len(rows), dtype=np.int64)
        row_slot[:full_rows] = row_slot_of_full
        if partial:
            row_slot[full_rows] = num_slots - 1
        cells = fill_cells(rows=rows, row_slot=row_slot, num_slots=num_slots, costs=costs)
        refine_cells(cells, costs, allow_moves=False, rel_tol=rel_tol, max_passes=max_passes)
        cells = polish_sync_cost(cells, costs, max_passes=polish_passes)
        sync = float(cell_loads(cells, costs).max(axis=1).sum())
        if sync < best_sync * (1 - 1e-9):
            best, best_sync = cells, sync
    return best


def balanced_token_cap_layout(
    *,
    costs: np.ndarray,
    tokens: np.ndarray,
    dp_size: int,
    token_cap: int,
    equal_size: bool,
    rel_tol: float,
    max_passes: int,
    polish_passes: int,
    joint_tries: int = 2,
    micro_batch_cost: float = 0.0,
    max_extra_slots: int = 4,
) -> np.ndarray:
    """Balanced ``layout[rank, slot, position]`` under ``token_cap``: fewest slots found, then lowest sync cost."""
    fewest = _fewest_slots_layout(
        costs, tokens, dp_size, token_cap, equal_size, rel_tol, max_passes, polish_passes, joint_tries
    )
    if micro_batch_cost <= 0 or dp_size == 1:
        return fewest
    return trade_slots_for_balance(
        fewest,
        costs=costs,
        tokens=tokens,
        dp_size=dp_size,
        token_cap=token_cap,
        equal_size=equal_size,
        micro_batch_cost=micro_batch_cost,
        max_extra_slots=max_extra_slots,
        rel_tol=rel_tol,
        max_passes=max_passes,
        polish_passes=polish_passes,
    )


def paid_sync_cost(layout: np.ndarray, costs: np.ndarray, micro_batch_cost: float) -> float:
    """Every slot's ``micro_batch_cost`` plus the slowest rank's cost in that slot, summed over slots."""
    loads = np.append(costs, 0.0)[layout].sum(axis=-1)
    return float(layout.shape[1] * micro_batch_cost + loads.max(axis=0).sum())


def trade_slots_for_balance(
    layout: np.ndarray,
    *,
    costs: np.ndarray,
    tokens: np.ndarray,
    dp_size: int,
    token_cap: int,
    equal_size: bool,
    micro_batch_cost: float,
    max_extra_slots: int,
    rel_tol: float,
    max_passes: int,
    polish_passes: int,
) -> np.ndarray:
    """``layout``, or one with up to ``max_extra_slots`` more slots when its ``paid_sync_cost`` is lower."""
    best, best_paid = layout, paid_sync_cost(layout, costs, micro_batch_cost)
    floor = float(costs.sum()) / dp_size
    for num_slots in range(layout.shape[1] + 1, layout.shape[1] + max_extra_slots + 1):
        if num_slots * micro_batch_cost + floor >= best_paid:
            break
        cells = _joint_cells(
            costs, tokens, dp_size, token_cap, num_slots, equal_size, rel_tol, max_passes, polish_passes
        )
        if cells is None:
            continue
        candidate = assign_cells_to_ranks(cells, costs)
        paid = paid_sync_cost(candidate, costs, micro_batch_cost)
        if paid < best_paid * (1 - 1e-9):
            best, best_paid = candidate, paid
    return best


def _fewest_slots_layout(
    costs, tokens, dp_size, token_cap, equal_size, rel_tol, max_passes, polish_passes, joint_tries
) -> np.ndarray:
    """The joint layout at the bound if it fits, else the polished two-stage one (or a joint one no longer)."""
    lower = max(1, -(-int(tokens.sum()) // (dp_size * token_cap)))
    cells = _joint_cells(costs, tokens, dp_size, token_cap, lower, equal_size, rel_tol, max_passes, polish_passes)
    if cells is not None:
        return assign_cells_to_ranks(cells, costs)
    two_stage = _two_stage_layout(costs, tokens, dp_size, token_cap, equal_size, rel_tol, max_passes, lower)
    if dp_size == 1:
        return two_stage
    two_stage = _match_slot_profile(two_stage, costs, tokens, token_cap, rel_tol, max(max_passes, 64))
    # Swaps keep every cell's count and moves stay inside one rank, so every rank keeps its count.
    cells = polish_sync_cost(
        two_stage.transpose(1, 0, 2).copy(),
        costs,
        tokens=tokens,
        token_cap=token_cap,
        max_passes=polish_passes,
        moves_within_part=True,
    )
    best = cells.transpose(1, 0, 2).copy()
    best_sync = cell_loads(cells, costs).max(axis=1).sum()
    # The joint layout balances better when it fits: try it at the two-stage count and below.
    for num_slots in range(lower + 1, min(best.shape[1], lower + joint_tries) + 1):
        cells = _joint_cells(
            costs, tokens, dp_size, token_cap, num_slots, equal_size, rel_tol, max_passes, polish_passes
        )
        if cells is None:
            continue
        if num_slots < best.shape[1] or cell_loads(cells, costs).max(axis=1).sum() < best_sync:
            return assign_cells_to_ranks(cells, costs)
        break
    return best


def _two_stage_layout(costs, tokens, dp_size, token_cap, equal_size, rel_tol, max_passes, lower) -> np.ndarray:
    """Ranks first, then each rank packed under the cap; ``_count_first_splits`` tried while over ``lower``."""
    refine = rel_tol < np.inf
    rank_items = (
        [np.arange(len(costs), dtype=np.int64)]
        if dp_size == 1
        else balanced_partition(costs=costs, num_parts=dp_size, equal_size=equal_size, refine=refine, rel_tol=rel_tol)
    )
    pack = dict(costs=costs, tokens=tokens, token_cap=token_cap, rel_tol=rel_tol, max_passes=max(max_passes, 64))
    two_stage = pack_ranks_under_cap(rank_items=rank_items, **pack)
    for split in _count_first_splits(costs, tokens, dp_size, equal_size, refine, rel_tol):
        if two_stage.shape[1] <= lower:
            break
        candidate = pack_ranks_under_cap(rank_items=split, **pack)
        if candidate.shape[1] < two_stage.shape[1]:
            two_stage = candidate
    return two_stage


def _count_first_splits(costs, tokens, dp_size, equal_size, refine, rel_tol):
    """Rank splits trading cost balance for fewer micro-batches, lazily; K is never above verl's."""
    if dp_size == 1:
        return
    if not np.array_equal(costs, tokens):
        yield balanced_partition(
            costs=tokens.astype(np.float64), num_parts=dp_size, equal_size=equal_size, refine=refine, rel_tol=rel_tol
        )
    yield greedy_count_split(tokens, dp_size, equal_size=equal_size)


def _joint_cells(costs, tokens, dp_size, token_cap, num_slots, equal_size, rel_tol, max_passes, polish_passes):
    """The row-based layout with exactly ``num_slots`` slots, or None if a cell breaks the cap."""
    rows = sort_into_rows(costs, dp_size)
    padded_tokens = np.append(tokens, 0)
    row_tokens = padded_tokens[rows].sum(axis=1).astype(np.float64)
    if num_slots > len(rows):
        return None
    row_slot = _pack_rows(row_tokens, num_slots, dp_size * token_cap, rel_tol, max_passes)
    if np.bincount(row_slot, weights=row_tokens, minlength=num_slots).max() > dp_size * token_cap:
        return None
    if dp_size == 1:  # a slot is one cell: nothing to deal or refine
        return _grid_from_bins(rows[:, 0][None, :], row_slot[None, :], num_slots).transpose(1, 0, 2).copy()
    extra = 0 if equal_size else max(1, len(rows) // num_slots // 4 + 1)
    cells = fill_cells(rows=rows, row_slot=row_slot, num_slots=num_slots, costs=costs, extra_width=extra)
    refine_cells(cells, costs, allow_moves=not equal_size, rel_tol=rel_tol, max_passes=max_passes)
    if padded_tokens[cells].sum(axis=-1).max() > token_cap:
        # Cost refinement may have lifted a cell over the cap: refine tokens down to the cap,
        # then cost again under the cap.
        refine_cells(
            cells,
            tokens.astype(np.float64),
            allow_moves=not equal_size,
            rel_tol=0.0,
            max_passes=max_passes,
            stop_at=token_cap,
        )
        if padded_tokens[cells].sum(axis=-1).max() > token_cap:
            return None
        refine_cells(
            cells,
            costs,
            allow_moves=not equal_size,
            rel_tol=rel_tol,
            max_passes=max_passes,
            tokens=tokens,
            token_cap=token_cap,
        )
    # With cost == tokens a swap never lifts a cell above its slot's (capped) maximum.
    same = np.array_equal(costs, tokens)
    return polish_sync_cost(
        cells,
        costs,
        tokens=None if same else tokens,
        token_cap=None if same else token_cap,
        max_passes=polish_passes,
    )


def pack_ranks_under_cap(
    *,
    rank_items: list[np.ndarray],
    costs: np.ndarray,
    tokens: np.ndarray,
    token_cap: int,
    rel_tol: float,
    max_passes: int,
) -> np.ndarray:
    """``layout[rank, micro, position]``: one shared smallest-found count K of micro-batches under
    ``token_cap``, cost-balanced, heaviest first; max_d ceil(tokens_d / cap) <= K <= the FFD count."""
    tokens = np.asarray(tokens, dtype=np.int64)
    by_tokens = _rank_matrix(rank_items, tokens)
    by_cost = _rank_matrix(rank_items, costs)
    rank_tokens = np.array([int(tokens[items].sum()) for items in rank_items])
    lower = max(1, int(-(-rank_tokens.max() // token_cap)))
    ffd_bin = np.full(by_tokens.shape, -1, dtype=np.int64)
    for rank, row in enumerate(by_tokens):
        placed = row >= 0
        ffd_bin[rank, placed] = _first_fit(tokens[row[placed]].tolist(), token_cap)
    ffd_count = ffd_bin.max(axis=1, initial=-1) + 1
    num_micro = max(1, int(ffd_count.max()))
    if len(rank_items) == 1:
        # One rank: every layout with K micro-batches costs the same step time (their sum).
        return _grid_from_bins(by_tokens, ffd_bin, num_micro)
    grid = None
    for k in range(max(lower, num_micro - 2), num_micro + 1):
        grid = _pack_at(k, by_cost, by_tokens, ffd_bin, ffd_count, costs, tokens, token_cap, max_passes)
        if grid is not None:
            break
    assert grid is not None, "first fit decreasing always fits in its own count"
    refine_cells(
        grid, costs, allow_moves=True, rel_tol=rel_tol, max_passes=max_passes, tokens=tokens, token_cap=token_cap
    )
    assert np.append(tokens, 0)[grid].sum(axis=-1).max() <= token_cap, "per-rank packing broke the token cap"
    loads = np.append(costs, 0.0)[grid].sum(axis=-1)
    heaviest_first = np.argsort(-loads, axis=1, kind="stable")
    return np.take_along_axis(grid, heaviest_first[:, :, None], axis=1)


def _match_slot_profile(layout, costs, tokens, token_cap, rel_tol, max_passes):
    """Re-balance each rank's micro-batches toward the slot maxima scaled to its total; heaviest first."""
    loads = np.append(costs, 0.0)[layout].sum(axis=-1)
    profile = loads.max(axis=0)
    if profile.sum() <= 0:
        return layout
    target = profile[None, :] * (loads.sum(axis=1, keepdims=True) / profile.sum())
    matched = layout.copy()
    refine_cells(
        matched,
        costs,
        allow_moves=True,
        rel_tol=rel_tol,
        max_passes=max_passes,
        tokens=tokens,
        token_cap=token_cap,
        offsets=-target,
    )
    if ((matched >= 0).any(axis=-1) < (layout >= 0).any(axis=-1)).any():
        return layout  # a move emptied a micro-batch: keep the flat layout (empty only when unavoidable)
    layout = matched
    loads = np.append(costs, 0.0)[layout].sum(axis=-1)
    heaviest_first = np.argsort(-loads, axis=1, kind="stable")
    return np.take_along_axis(layout, heaviest_first[:, :, None], axis=1)


def _pack_at(num_bins, by_cost, by_tokens, ffd_bin, ffd_count, costs, tokens, token_cap, max_passes):
    """``grid[rank, bin, position]`` within the cap, or None (LPT on cost, then FFD, then WFD on tokens)."""
    dp_size = by_cost.shape[0]
    lpt_bin = _greedy_pack(by_cost, tokens, costs, token_cap, num_bins, rule="lightest")
    lpt_ok = ((lpt_bin >= 0) | (by_cost < 0)).all(axis=1)
    use_ffd = ~lpt_ok & (ffd_count <= num_bins)
    items = np.where(lpt_ok[:, None], by_cost, by_tokens)
    bins = np.where(lpt_ok[:, None], lpt_bin, ffd_bin)
    repair = np.flatnonzero(~lpt_ok & ~use_ffd)
    items[repair] = -1  # filled below
    grid = _grid_from_bins(items, bins, num_bins)
    if len(repair):
        worst_fit = _greedy_pack(by_tokens[repair], tokens, costs, token_cap, num_bins, rule="emptiest")
        repaired = _grid_from_bins(by_tokens[repair], worst_fit, num_bins)
        refine_cells(
            repaired, tokens.astype(np.float64), allow_moves=True, rel_tol=0.0, max_passes=max_passes, stop_at=token_cap
        )
        if np.append(tokens, 0)[repaired].sum(axis=-1).max() > token_cap:
            return None
        width = max(grid.shape[2], repaired.shape[2])
        grid = np.pad(grid, ((0, 0), (0, 0), (0, width - grid.shape[2])), constant_values=-1)
        grid[repair] = np.pad(repaired, ((0, 0), (0, 0), (0, width - repaired.shape[2])), constant_values=-1)
    assert grid.shape[0] == dp_size
    return grid


def _rank_matrix(rank_items: list[np.ndarray], key: np.ndarray) -> np.ndarray:
    """[rank, t]: the rank's items by descending ``key`` (stable), padded with -1."""
    width = max(1, max(len(items) for items in rank_items))
    out = np.full((len(rank_items), width), -1, dtype=np.int64)
    for rank, items in enumerate(rank_items):
        out[rank, : len(items)] = items[np.argsort(-key[items], kind="stable")]
    return out


def _first_fit(sizes: list[int], capacity: int) -> list[int]:
    """The bin of each of ``sizes`` under first fit in the given order (max-segment-tree over free room)."""
    num_bins = max(1, min(len(sizes), 2 * (-(-sum(sizes) // capacity)) + 1))
    size = 1
    while size < num_bins:
        size *= 2
    tree = [-1] * (2 * size)
    tree[size : size + num_bins] = [capacity] * num_bins
    for i in range(size - 1, 0, -1):
        tree[i] = max(tree[2 * i], tree[2 * i + 1])
    out = []
    for s in sizes:
        assert tree[1] >= s, "first fit ran out of bins: an item exceeds the capacity"
        i = 1
        while i < size:
            i = 2 * i if tree[2 * i] >= s else 2 * i + 1
        out.append(i - size)
        tree[i] -= s
        i //= 2
        while i:
            left, right = tree[2 * i], tree[2 * i + 1]
            room = left if left > right else right
            if tree[i] == room:
                break  # ancestors are unchanged too
            tree[i] = room
            i //= 2
    return out


def _greedy_pack(
    items: np.ndarray, tokens: np.ndarray, costs: np.ndarray, token_cap: int, num_bins: int, *, rule: str
) -> np.ndarray:
    """The bin per entry (-1: none), ranks in step: "lightest" fitting bin, or "emptiest" even overflowing."""
    dp_size, rounds = items.shape
    room = np.full((dp_size, num_bins), float(token_cap))
    load = np.zeros((dp_size, num_bins))
    bin_of = np.full(items.shape, -1, dtype=np.int64)
    tok = np.append(tokens, 0).astype(np.float64)[items]
    cost = np.append(costs, 0.0)[items]
    ranks = np.arange(dp_size)
    for t in range(rounds):
        fits = room >= tok[:, t, None]
        if rule == "emptiest":
            chosen = room.argmax(axis=1)
            fits[:] = True
        else:
            chosen = np.where(fits, load, np.inf).argmin(axis=1)
        ok = (items[:, t] >= 0) & fits[ranks, chosen]
        r, b = ranks[ok], chosen[ok]
        room[r, b] -= tok[ok, t]
        load[r, b] += cost[ok, t]
        bin_of[ok, t] = b
    return bin_of


def _grid_from_bins(items: np.ndarray, bins: np.ndarray, num_bins: int) -> np.ndarray:
    """``grid[rank, bin, position]`` from a per-entry bin, with spare positions for refinement moves."""
    dp_size = items.shape[0]
    placed = items >= 0
    rank_of = np.broadcast_to(np.arange(dp_size)[:, None], items.shape)[placed]
    bin_of, item_of = bins[placed], items[placed]
    flat = rank_of * num_bins + bin_of
    counts = np.bincount(flat, minlength=dp_size * num_bins)
    width = int(counts.max(initial=0))
    width += max(2, width // 4)
    order = np.argsort(flat, kind="stable")
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    position = np.arange(len(flat)) - starts[flat[order]]
    grid = np.full((dp_size * num_bins, width), -1, dtype=np.int64)
    grid[flat[order], position] = item_of[order]
    return grid.reshape(dp_size, num_bins, width)


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
    """``layout[rank, slot, position]``: each slot's heaviest cell to the rank of lowest running total."""
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
    """Contiguous baseline: rank d's items in order, in chunks of ``micro_batch_size`` or filled to the cap."""
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
    """[rank][micro] item ids for a fixed DP assignment, each rank's micro-batches heaviest first."""
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
    layout = pack_ranks_under_cap(
        rank_items=rank_items,
        costs=costs,
        tokens=tokens,
        token_cap=token_cap,
        rel_tol=rel_tol,
        max_passes=max(max_passes, 64),
    )
    if dp_size > 1:
        layout = _match_slot_profile(layout, costs, tokens, token_cap, rel_tol, max(max_passes, 64))
    return [[c[c >= 0] for c in rank] for rank in layout]
