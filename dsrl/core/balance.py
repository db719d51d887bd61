"""Balancing costs across ranks: k-way Karmarkar-Karp largest differencing plus local search.

``balance_ranks(costs, k)`` returns a rank id per item and minimises (heuristically) the largest
rank's total cost. Deterministic: the same costs give the same assignment on every rank. Used by
:mod:`dsrl.core.partition` for token-budget micro-batching; pure numpy.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import Any

import numpy as np

# Singleton KK does one O(k) merge per sequence; above this many sequence*rank slots it starts from
# rank-sized blocks of consecutive lengths instead (n/k merges), which keeps 65k x 1024 under 1 s.
_SINGLETON_KK_LIMIT = 1 << 18
_LOCAL_SEARCH_ROUNDS = 4
_SWAP_LIMIT = 1 << 20  # pairs examined per local-search swap
BALANCED = 1e-3  # max/mean - 1 below which balancing stops searching


def _kk_assign(costs: np.ndarray, k: int, blocks: bool = False) -> np.ndarray:
    """Rank (0..k-1) of each item under k-way largest differencing.

    A partial solution is a k-tuple of subset loads kept sorted descending; two tuples merge by
    pairing the heaviest subset of one with the lightest of the other, and the pair with the
    largest spread (max - min) is merged first. Subset membership is tracked with a union-find
    parent array (one vectorised assignment per merge), so a merge costs O(k log k).
    """
    n = len(costs)
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    order = np.lexsort((np.arange(n), -costs))  # heaviest first, ties by position
    parent = np.arange(n, dtype=np.int64)
    if not blocks and (n * k <= _SINGLETON_KK_LIMIT or n <= k):
        # Singletons (an item index) are materialised as k-tuples only when popped; sorted order = heap order.
        heap: list[tuple[float, int, Any]] = [(-float(costs[i]), seq, i) for seq, i in enumerate(order.tolist())]
    else:
        # Start from blocks of k consecutive (similar) items, one per subset (padded with empty slots).
        pad = (-n) % k
        ids = np.concatenate([order, np.full(pad, -1, dtype=np.int64)]).reshape(-1, k)
        loads = np.concatenate([costs[order], np.zeros(pad)]).reshape(-1, k)
        heap = [(-float(loads[b, 0] - loads[b, -1]), b, (loads[b], ids[b])) for b in range(ids.shape[0])]
        heapq.heapify(heap)
    counter = len(heap)

    def materialise(entry: Any) -> tuple[np.ndarray, np.ndarray]:
        if isinstance(entry, tuple):
            return entry
        loads, gids = np.zeros(k), np.full(k, -1, dtype=np.int64)
        loads[0], gids[0] = costs[entry], entry
        return loads, gids

    while len(heap) > 1:
        a_loads, a_ids = materialise(heapq.heappop(heap)[2])
        b_loads, b_ids = materialise(heapq.heappop(heap)[2])
        b_loads, b_ids = b_loads[::-1], b_ids[::-1]
        both = (a_ids >= 0) & (b_ids >= 0)
        parent[b_ids[both]] = a_ids[both]
        ids = np.where(a_ids >= 0, a_ids, b_ids)
        loads = a_loads + b_loads
        srt = np.argsort(-loads, kind="stable")
        loads, ids = loads[srt], ids[srt]
        heapq.heappush(heap, (-float(loads[0] - loads[-1]), counter, (loads, ids)))
        counter += 1
    _, final_ids = materialise(heap[0][2])
    while not np.array_equal(parent[parent], parent):  # path compression to the roots
        parent = parent[parent]
    rank_of_root = np.full(n, -1, dtype=np.int64)
    present = final_ids >= 0
    rank_of_root[final_ids[present]] = np.nonzero(present)[0]
    return rank_of_root[parent]


def _best_move(costs: np.ndarray, hi: list[int], lo: list[int], gap: float, limit: int | None,
               ) -> tuple[float, int, int] | None:
    """(cost moved, item hi -> lo, item lo -> hi or -1) bringing two ranks' loads closest to equal;
    None if no single move or pair swap lowers their maximum."""
    if gap <= 0 or not hi:
        return None
    a, b = np.asarray(hi, dtype=np.int64), np.asarray(lo, dtype=np.int64)
    parts = []
    if limit is None or b.size < limit:
        parts.append((costs[a], a, np.full(a.size, -1)))
    if b.size and a.size * b.size <= _SWAP_LIMIT:
        parts.append(((costs[a][:, None] - costs[b][None, :]).ravel(), np.repeat(a, b.size), np.tile(b, a.size)))
    if not parts:
        return None
    d, x, y = (np.concatenate(p) for p in zip(*parts))
    score = np.where((d > 0) & (d < gap), np.abs(d - gap / 2), np.inf)  # new pair max = max(hi - d, lo + d)
    j = int(np.argmin(score))
    return (float(d[j]), int(x[j]), int(y[j])) if np.isfinite(score[j]) else None


def _local_search(costs: np.ndarray, rank: np.ndarray, k: int, rounds: int, limit: int | None = None) -> np.ndarray:
    """Improve the largest rank load by single moves or pair swaps between the most loaded rank and
    the least loaded ones; each accepted change strictly lowers the pair's maximum. With ``limit``,
    an item only moves (without a swap) to a rank holding fewer than ``limit`` items."""
    rank = rank.copy()
    loads = np.bincount(rank, weights=costs, minlength=k).astype(np.float64)
    order = np.argsort(rank, kind="stable")
    bounds = np.searchsorted(rank[order], np.arange(k + 1))
    members = [order[bounds[r]:bounds[r + 1]].tolist() for r in range(k)]
    mean = float(loads.mean())
    for _ in range(rounds * k):
        hi = int(np.argmax(loads))
        if loads[hi] <= mean * (1 + BALANCED):
            break
        for lo in np.argsort(loads, kind="stable")[:4].tolist():
            move = _best_move(costs, members[hi], members[lo], loads[hi] - loads[lo], limit)
            if move is not None:
                break
        else:
            break
        delta, x, y = move
        members[hi].remove(x)
        members[lo].append(x)
        rank[x] = lo
        if y >= 0:
            members[lo].remove(y)
            members[hi].append(y)
            rank[y] = hi
        loads[hi], loads[lo] = loads[hi] - delta, loads[lo] + delta
    return rank


def balance_ranks(costs: Sequence[float] | np.ndarray, dp: int, equal_counts: bool = False) -> np.ndarray:
    """Rank of each item so that the largest per-rank cost sum is small (KK + local search).

    ``equal_counts``: no rank gets more than ``ceil(n / dp)`` items (KK started from blocks of ``dp``
    consecutive items, one per rank; the local search then only moves into ranks below that)."""
    costs = np.asarray(costs, dtype=np.float64)
    if dp == 1 or len(costs) == 0:
        return np.zeros(len(costs), dtype=np.int64)
    rank = _kk_assign(costs, dp, blocks=equal_counts)
    limit = -(-len(costs) // dp) if equal_counts else None
    return _local_search(costs, rank, dp, _LOCAL_SEARCH_ROUNDS, limit)
