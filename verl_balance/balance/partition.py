"""Balanced multi-way partition of weighted items, vectorised over many independent problems.

Cell grid ``cells[s, p, w]``: slot ``s`` (an independent problem), part ``p`` (e.g. one DP rank),
position ``w``; entries are item ids or -1 (empty).

Invariants:
- every item id appears exactly once in the grid; refinement never changes slot membership;
- with equal counts part counts inside a slot differ by at most one; swaps keep every count;
- a swap strictly lowers the larger of its two loads, so a slot's maximum load never increases;
- deterministic: stable sorts only, no randomness.
"""

from __future__ import annotations

import heapq

import numpy as np


def descending_order(costs: np.ndarray) -> np.ndarray:
    """Item ids by descending cost (quantised to 31 bits), ties by ascending id."""
    n = len(costs)
    assert n < 2**32
    top = float(costs.max(initial=0.0))
    levels = 2**31 - 1
    quantised = np.zeros(n, dtype=np.int64) if top <= 0 else np.floor(costs * (levels / top)).astype(np.int64)
    keys = ((levels - quantised) << 32) | np.arange(n, dtype=np.int64)
    return np.sort(keys) & 0xFFFFFFFF


def sort_into_rows(costs: np.ndarray, num_parts: int) -> np.ndarray:
    """Item ids by descending cost in rows of ``num_parts``, the last padded with -1: (ceil(n / parts), parts)."""
    n = len(costs)
    order = descending_order(costs)
    num_rows = -(-n // num_parts)
    rows = np.full(num_rows * num_parts, -1, dtype=np.int64)
    rows[:n] = order
    return rows.reshape(num_rows, num_parts)


def fill_cells(
    *, rows: np.ndarray, row_slot: np.ndarray, num_slots: int, costs: np.ndarray, extra_width: int = 0
) -> np.ndarray:
    """``cells[slots, parts, most rows + extra_width]``: each slot's rows dealt largest to the lightest part."""
    num_rows, num_parts = rows.shape
    by_slot = np.argsort(row_slot, kind="stable")
    slot_sorted = row_slot[by_slot]
    rows_per_slot = np.bincount(row_slot, minlength=num_slots)
    starts = np.concatenate([[0], np.cumsum(rows_per_slot)[:-1]])
    position = np.empty(num_rows, dtype=np.int64)
    position[by_slot] = np.arange(num_rows) - starts[slot_sorted]
    rounds = int(rows_per_slot.max(initial=0))
    width = max(rounds + extra_width, 1)
    cells = np.full((num_slots, num_parts, width), -1, dtype=np.int64)
    loads = np.zeros((num_slots, num_parts))
    padded_costs = np.append(costs, 0.0)  # index -1 -> cost 0
    # Round t deals the t-th row of every slot at once (rows of a slot stay in descending order).
    by_round = np.lexsort((np.arange(num_rows), position))
    round_bounds = np.searchsorted(position[by_round], np.arange(rounds + 1))
    for t in range(rounds):
        row_ids = by_round[round_bounds[t] : round_bounds[t + 1]]
        slots = row_slot[row_ids]
        lightest_first = np.argsort(loads[slots], axis=1, kind="stable")
        items = rows[row_ids]
        cells[slots[:, None], lightest_first, t] = items
        # Each (slot, part) receives at most one item per round: plain fancy-index add is exact.
        loads[slots[:, None], lightest_first] += padded_costs[items]
    return cells


def cell_loads(cells: np.ndarray, costs: np.ndarray) -> np.ndarray:
    """Sum of item costs per (slot, part)."""
    return np.append(costs, 0.0)[cells].sum(axis=-1)


def refine_cells(
    cells: np.ndarray,
    costs: np.ndarray,
    *,
    allow_moves: bool = False,
    rel_tol: float = 1e-5,
    max_passes: int = 64,
    stop_at: float | None = None,
    tokens: np.ndarray | None = None,
    token_cap: float | None = None,
    offsets: np.ndarray | None = None,
) -> np.ndarray:
    """Pairwise-swap refinement of ``cells`` in place; returns ``cells``. With ``token_cap`` a grid that
    fits the cap keeps fitting it; ``offsets[slot, part]`` is added to every load."""
    num_slots, num_parts, _ = cells.shape
    if num_parts < 2 or cells.size == 0:
        return cells
    grid = _SwapGrid.of(cells, costs, tokens=tokens, token_cap=token_cap, offsets=offsets)
    half = num_parts // 2
    slot_ids = np.repeat(np.arange(num_slots), half)
    shift, failed_shifts = 0, 0
    for _ in range(max_passes):
        pairs = _pairs_over_threshold(grid.loads, slot_ids, half, shift, rel_tol=rel_tol, stop_at=stop_at)
        if pairs is None:
            break
        pair_slot, heavy, light = pairs
        gap = grid.loads[pair_slot, heavy] - grid.loads[pair_slot, light]
        best_score, best_a, best_b = grid.best_swaps(pair_slot, heavy, light, gap, allow_moves=allow_moves)
        # Only a strict decrease of the pair's maximum counts (score < gap / 2 <=> new max < old max).
        apply = np.isfinite(best_score) & (best_score < gap / 2.0 * (1.0 - 1e-12))
        if not apply.any():
            # No pair improves: try the next pairing of heavy parts with light ones.
            failed_shifts += 1
            if failed_shifts >= max(1, min(half, 4)):
                break
            shift = (shift + 1) % max(half, 1)
            continue
        failed_shifts, shift = 0, 0
        grid.swap(pair_slot[apply], heavy[apply], light[apply], best_a[apply], best_b[apply])
    return cells


def _pairs_over_threshold(loads, slot_ids, half, shift, *, rel_tol, stop_at):
    """(slot, heavy, light) pairs, i-th heaviest with (i + shift)-th lightest, over the threshold; or None."""
    num_parts = loads.shape[1]
    threshold = loads.sum(axis=1) / num_parts * (1.0 + rel_tol)  # the mean; np.mean's overhead is 5x
    if stop_at is not None:
        threshold = np.maximum(threshold, stop_at)
    by_load = np.argsort(loads, axis=1, kind="stable")
    light = (np.roll(by_load[:, :half], -shift, axis=1) if shift else by_load[:, :half]).ravel()
    heavy = by_load[:, ::-1][:, :half].ravel()
    # Only parts above the tolerance are worth pairing: the objective is each slot's maximum.
    over = loads[slot_ids, heavy] > threshold[slot_ids]
    if not over.any():
        return None
    return slot_ids[over], heavy[over], light[over]


class _SwapGrid:
    """refine_cells' working state: the caller's ``cells`` (in place) with costs, loads and tokens in step."""

    def __init__(self, cells, values, loads, tok_values, tok_loads, token_cap) -> None:
        self.cells, self.values, self.valid, self.loads = cells, values, cells >= 0, loads
        self.tok_values, self.tok_loads, self.token_cap = tok_values, tok_loads, token_cap

    @classmethod
    def of(cls, cells, costs, *, tokens, token_cap, offsets) -> _SwapGrid:
        values = np.append(costs, 0.0)[cells]
        loads = values.sum(axis=-1) + (0.0 if offsets is None else offsets)
        if tokens is None or token_cap is None:
            return cls(cells, values, loads, None, None, None)
        tok_values = np.append(np.asarray(tokens, dtype=np.float64), 0.0)[cells]
        return cls(cells, values, loads, tok_values, tok_values.sum(axis=-1), token_cap)

    def best_swaps(self, pair_slot, heavy, light, gap, *, allow_moves):
        """Per pair: (score, heavy position, light position) of the swap closest to gap / 2 (inf: none)."""
        a = self.values[pair_slot, heavy]  # (pairs, width)
        a_valid = self.valid[pair_slot, heavy]
        b_usable = self.valid[pair_slot, light] | allow_moves
        b = np.where(self.valid[pair_slot, light], self.values[pair_slot, light], 0.0)
        if self.token_cap is not None:
            return _best_swaps_capped(
                a,
                a_valid,
                b,
                b_usable,
                gap,
                self.tok_values[pair_slot, heavy],
                self.tok_values[pair_slot, light],
                self.token_cap - self.tok_loads[pair_slot, heavy],
                self.token_cap - self.tok_loads[pair_slot, light],
            )
        width = self.cells.shape[2]
        search = _best_swaps_dense if len(heavy) * width * width <= 200_000 else _best_swaps_sorted
        return search(a, a_valid, b, b_usable, gap)

    def swap(self, s_i, h_i, l_i, pa, pb) -> None:
        """Swap cells[s, h, pa] with cells[s, l, pb] for every chosen pair; update the loads."""
        cells, values = self.cells, self.values
        item_a, item_b = cells[s_i, h_i, pa].copy(), cells[s_i, l_i, pb].copy()
        val_a, val_b = values[s_i, h_i, pa].copy(), values[s_i, l_i, pb].copy()
        cells[s_i, h_i, pa], cells[s_i, l_i, pb] = item_b, item_a
        values[s_i, h_i, pa], values[s_i, l_i, pb] = val_b, val_a
        self.valid[s_i, h_i, pa], self.valid[s_i, l_i, pb] = item_b >= 0, item_a >= 0
        self.loads[s_i, h_i] += val_b - val_a
        self.loads[s_i, l_i] += val_a - val_b
        if self.token_cap is not None:
            tok_values, tok_loads = self.tok_values, self.tok_loads
            tok_a, tok_b = tok_values[s_i, h_i, pa].copy(), tok_values[s_i, l_i, pb].copy()
            tok_values[s_i, h_i, pa], tok_values[s_i, l_i, pb] = tok_b, tok_a
            tok_loads[s_i, h_i] += tok_b - tok_a
            tok_loads[s_i, l_i] += tok_a - tok_b


def _best_swaps_capped(a, a_valid, b, b_usable, gap, ta, tb, room_heavy, room_light, chunk_elems=1_000_000):
    """``_best_swaps_dense`` restricted to swaps keeping both cells within their token room."""
    num_pairs, width = a.shape
    best_score = np.full(num_pairs, np.inf)
    best_a = np.zeros(num_pairs, dtype=np.int64)
    best_b = np.zeros(num_pairs, dtype=np.int64)
    step = max(1, chunk_elems // max(1, width * width))
    for lo in range(0, num_pairs, step):
        sl = slice(lo, lo + step)
        tok_delta = ta[sl, :, None] - tb[sl, None, :]
        fits = (-tok_delta <= room_heavy[sl, None, None]) & (tok_delta <= room_light[sl, None, None])
        score, i, j = _best_swaps_dense(a[sl], a_valid[sl], b[sl], b_usable[sl], gap[sl], allowed=fits)
        best_score[sl], best_a[sl], best_b[sl] = score, i, j
    return best_score, best_a, best_b


def _best_swaps_dense(a, a_valid, b, b_usable, gap, allowed=None):
    """Per pair: (score = |a_i - b_j - gap / 2| or inf, i, j) over 0 < a_i - b_j < gap (and ``allowed``)."""
    num_pairs, width = a.shape
    delta = a[:, :, None] - b[:, None, :]
    half_gap = (gap / 2.0)[:, None, None]
    usable = a_valid[:, :, None] & b_usable[:, None, :] & (delta > 0) & (delta < 2.0 * half_gap)
    if allowed is not None:
        usable &= allowed
    score = np.where(usable, np.abs(delta - half_gap), np.inf).reshape(num_pairs, -1)
    flat = score.argmin(axis=1)
    return score[np.arange(num_pairs), flat], flat // width, flat % width


def _best_swaps_sorted(a, a_valid, b, b_usable, gap):
    """``_best_swaps_dense``'s result in O(width log width) per pair, by one batched searchsorted."""
    num_pairs, width = a.shape
    big = float(max(np.abs(a).max(initial=0.0), np.abs(b).max(initial=0.0), 1.0)) * 4.0 + 1.0
    keys = np.where(b_usable, b, big)  # unusable entries sort last and are never within the gap
    b_order = np.argsort(keys, axis=1, kind="stable")
    b_sorted = np.take_along_axis(keys, b_order, axis=1)
    span = big + 3.0
    offset = (np.arange(num_pairs) * span)[:, None]
    haystack = (b_sorted + 1.0 + offset).ravel()
    query = np.clip(a - gap[:, None] / 2.0, -1.0, big + 1.0) + 1.0 + offset
    pos = np.searchsorted(haystack, query.ravel()).reshape(num_pairs, width) - np.arange(num_pairs)[:, None] * width
    rows = np.arange(num_pairs)
    best_score = np.full(num_pairs, np.inf)
    best_a = np.zeros(num_pairs, dtype=np.int64)
    best_b = np.zeros(num_pairs, dtype=np.int64)
    for candidate in (pos - 1, pos):
        j = np.clip(candidate, 0, width - 1)
        b_val = np.take_along_axis(b_sorted, j, axis=1)
        delta = a - b_val
        usable = a_valid & (b_val < big) & (delta > 0) & (delta < gap[:, None])
        score = np.where(usable, np.abs(delta - gap[:, None] / 2.0), np.inf)
        col = score.argmin(axis=1)
        s = score[rows, col]
        better = s < best_score
        best_score = np.where(better, s, best_score)
        best_a = np.where(better, col, best_a)
        best_b = np.where(better, b_order[rows, j[rows, col]], best_b)
    return best_score, best_a, best_b


def assign_rows_lpt(row_weights: np.ndarray, num_slots: int) -> np.ndarray:
    """The slot of every row (descending order), each to the lightest slot; ties to the lowest index."""
    heap = [(0.0, s) for s in range(num_slots)]
    slot_of = np.empty(len(row_weights), dtype=np.int64)
    for r, w in enumerate(row_weights.tolist()):
        load, s = heapq.heappop(heap)
        slot_of[r] = s
        heapq.heappush(heap, (load + w, s))
    return slot_of


def assign_rows_capacity(row_weights: np.ndarray, capacities: np.ndarray) -> np.ndarray:
    """The slot of every row, dealt round by round to slots with room (``capacities.sum() == len(rows)``)."""
    assert int(capacities.sum()) == len(row_weights)
    remaining = capacities.astype(np.int64).copy()
    loads = np.zeros(len(capacities))
    slot_of = np.empty(len(row_weights), dtype=np.int64)
    pos = 0
    while pos < len(row_weights):
        open_slots = np.flatnonzero(remaining > 0)
        take = min(len(open_slots), len(row_weights) - pos)
        chosen = open_slots[np.argsort(loads[open_slots], kind="stable")][:take]
        slot_of[pos : pos + take] = chosen
        loads[chosen] += row_weights[pos : pos + take]
        remaining[chosen] -= 1
        pos += take
    return slot_of


def balanced_partition(
    *, costs, num_parts: int, equal_size: bool = True, refine: bool = True, rel_tol: float = 1e-5
) -> list[np.ndarray]:
    """One sorted int64 array per part of ids 0..n-1, near-equal in cost; equal_size: sizes differ by <= 1."""
    costs = np.asarray(costs, dtype=np.float64)
    rows = sort_into_rows(costs, num_parts)
    extra = 0 if equal_size else max(1, rows.shape[0] // 4)
    single_slot = np.zeros(len(rows), dtype=np.int64)
    cells = fill_cells(rows=rows, row_slot=single_slot, num_slots=1, costs=costs, extra_width=extra)
    if refine:
        refine_cells(cells, costs, allow_moves=not equal_size, rel_tol=rel_tol)
    return [np.sort(c[c >= 0]) for c in cells[0]]


def greedy_count_split(sizes, num_parts: int, *, equal_size: bool = True) -> list[np.ndarray]:
    """Largest first, each item to the least-loaded part with count room (ties: lower part), unrefined;
    <= ceil(n / num_parts) per part (equal_size: +-1)."""
    sizes = np.asarray(sizes).tolist()
    most = -(-len(sizes) // num_parts)
    # Parts that may reach `most` items; with equal_size the others stop one short.
    ceil_left = (len(sizes) % num_parts or num_parts) if equal_size else num_parts
    members: list[list[int]] = [[] for _ in range(num_parts)]
    heap = [(0, p) for p in range(num_parts)]
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        total, p = heapq.heappop(heap)
        while len(members[p]) == most or (len(members[p]) == most - 1 and ceil_left == 0):
            total, p = heapq.heappop(heap)  # full for good: a part's room never comes back
        members[p].append(i)
        ceil_left -= len(members[p]) == most
        heapq.heappush(heap, (total + sizes[i], p))
    return [np.sort(np.array(m, dtype=np.int64)) for m in members]


def polish_sync_cost(
    cells: np.ndarray,
    costs: np.ndarray,
    *,
    tokens: np.ndarray | None = None,
    token_cap: int | None = None,
    max_passes: int = 16,
    partners: int = 16,
    moves_within_part: bool = False,
) -> np.ndarray:
    """Lower ``sum_s max_p load(s, p)`` in place by swaps between any two cells, across slots too;
    keeps counts and ``token_cap`` and never empties a cell."""
    num_slots, num_parts, _ = cells.shape
    if num_slots < 2 or num_parts < 2:
        return cells
    padded_costs = np.append(costs, np.nan)  # empty positions never match (NaN comparisons are False)
    padded_tokens = None if tokens is None else np.append(tokens, 0).astype(np.float64)
    partners = min(partners, num_slots * num_parts - 1)
    for _ in range(max_passes):
        values = padded_costs[cells]
        loads = np.nan_to_num(values).sum(axis=-1)
        heavy, partner, partner_room, excess = _slack_partners(loads, partners)
        usable, delta = _usable_swaps(values, heavy, partner, partner_room, moves_within_part)
        if token_cap is not None:
            usable &= _swaps_within_cap(padded_tokens[cells], heavy, partner, token_cap)
        # Gain min(delta, excess); among equal gains the smallest delta keeps the partner's slack.
        score = np.where(usable, np.minimum(delta, excess[:, None, None, None]) - 1e-9 * delta, -np.inf)
        if not _apply_best_swaps(cells, score.reshape(num_slots, -1), heavy, partner):
            break
    return cells


def _slack_partners(loads: np.ndarray, partners: int):
    """(heavy part per slot, partner ids (S, K), partner room (S, K), excess over the second maximum (S,))."""
    num_slots, num_parts = loads.shape
    slot_range = np.arange(num_slots)
    by_load = np.sort(loads, axis=1)
    heavy = loads.argmax(axis=1)
    top, second = by_load[:, -1], by_load[:, -2]
    # Room of every cell as a partner of slot s's heavy cell: up to its own slot's maximum,
    # or up to the second maximum inside slot s; the heavy cell itself has none.
    room = np.broadcast_to((top[:, None] - loads).reshape(1, -1), (num_slots, num_slots * num_parts)).copy()
    room[slot_range[:, None], slot_range[:, None] * num_parts + np.arange(num_parts)] = second[:, None] - loads
    room[slot_range, slot_range * num_parts + heavy] = -1.0
    partner = np.argsort(-room, axis=1, kind="stable")[:, :partners]  # (S, K) flat cell ids
    return heavy, partner, np.take_along_axis(room, partner, axis=1), top - second


def _usable_swaps(values, heavy, partner, partner_room, moves_within_part):
    """(usable (S, K, W, W), delta = a_i - b_j): positive moves of cost within the partner's room."""
    num_slots, num_parts, width = values.shape
    a = values[np.arange(num_slots), heavy]  # (S, W)
    b = values.reshape(-1, width)[partner]  # (S, K, W)
    if moves_within_part:
        # A move may not empty the heavy cell (a micro-batch is empty only when unavoidable).
        keeps_an_item = (~np.isnan(a)).sum(axis=1) > 1
        movable = ((partner % num_parts) == heavy[:, None]) & keeps_an_item[:, None]
        b = np.where(np.isnan(b) & movable[:, :, None], 0.0, b)
    delta = a[:, None, :, None] - b[:, :, None, :]  # (S, K, W, W)
    return (delta > 0) & (delta <= partner_room[:, :, None, None]), delta


def _swaps_within_cap(tok, heavy, partner, token_cap):
    """(S, K, W, W): the swap leaves both cells within ``token_cap`` tokens (tok: per position)."""
    num_slots, num_parts, width = tok.shape
    slot_range = np.arange(num_slots)
    cell_tok = tok.sum(axis=-1).reshape(-1)
    tok_delta = tok[slot_range, heavy][:, None, :, None] - tok.reshape(-1, width)[partner][:, :, None, :]
    return (cell_tok[slot_range * num_parts + heavy][:, None, None, None] - tok_delta <= token_cap) & (
        cell_tok[partner][:, :, None, None] + tok_delta <= token_cap
    )


def _apply_best_swaps(cells, score, heavy, partner) -> bool:
    """Apply each slot's best positive swap, best first, at most one per slot touched; True if any."""
    num_slots, num_parts, width = cells.shape
    partners = partner.shape[1]
    flat = score.argmax(axis=1)
    best = score[np.arange(num_slots), flat]
    applied = False
    touched = np.zeros(num_slots, dtype=bool)
    for s in np.argsort(-best, kind="stable"):
        if not best[s] > 0:
            break
        k, pos_a, pos_b = np.unravel_index(flat[s], (partners, width, width))
        ps, pp = divmod(int(partner[s, k]), num_parts)
        if touched[s] or touched[ps]:
            continue
        touched[s] = touched[ps] = True
        h = heavy[s]
        cells[s, h, pos_a], cells[ps, pp, pos_b] = cells[ps, pp, pos_b], cells[s, h, pos_a]
        applied = True
    return applied
