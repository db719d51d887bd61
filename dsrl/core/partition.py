"""Rollout -> mini-batches -> per-rank micro-batches (fixed size or token budget, rank balancing).

Pure Python + numpy: no torch.distributed, no DeepSpeed, no Megatron. Every function is a
deterministic function of its arguments (same inputs, same partition on every rank), so each rank
can compute the whole partition locally and pick its own row without any communication.

Vocabulary (docs/ARCHITECTURE §1): a *mini-batch* is the list of sequence indices of one optimizer
step; a *partition* of it is ``partition[rank] -> [micro_batch, ...]`` with ``micro_batch`` a list of
sequence indices. Invariants of every partition returned here:

- every index of the mini-batch appears exactly once over all ranks and micro-batches;
- every rank has the **same number** of micro-batches (ZeRO-2/3 reduce on every backward; a mismatch
  hangs). In token-budget mode a rank with fewer sequences than that number gets empty micro-batches
  (``[]``) at the end of its list; the caller drops them, and :class:`dsrl.backends.deepspeed.engine.RLEngine` runs
  zero-weight filler micro-batches in their place;
- token budget: no micro-batch costs more than ``max_tokens`` tokens, where the cost is
  ``len(mb) * max(lengths in mb)`` (right-padded to its own longest) or ``sum(lengths)`` when packed,
  except that with ``allow_oversize`` a sequence longer than the budget is placed alone.

Token-budget assignment minimises the largest rank load (token slots, plus ``coef * slot_len**2 /
max_tokens`` for attention's quadratic share; ``coef`` = ``dsrl.batch.balance_attention_coef``).
It compares a few candidates and keeps the best: Karmarkar-Karp largest differencing generalised to
k ways over single sequences, and KK over whole-mini-batch *chunks* of neighbouring lengths (cut to
near-equal cost for a few micro-batch counts), each refined by a move/swap local search between the
most and least loaded ranks. Within a rank the sequences are sorted by length and cut, by dynamic
programming, into the common micro-batch count with the fewest padded tokens.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from dsrl.config import ConfigError
from dsrl.core.balance import BALANCED, balance_ranks

Partition = list[list[list[int]]]  # partition[rank][micro_batch] -> sequence indices

# The padding-minimising DP costs s*s*g per rank; above this it falls back to greedy splitting.
_DP_LIMIT = 1 << 22


def mini_batches(num_sequences: int, mini_batch_size: int, epochs: int, seed: int, shuffle: bool = True,
                 ) -> list[list[int]]:
    """The mini-batches of one rollout: for each of ``epochs`` passes, a permutation of
    ``range(num_sequences)`` cut into ``num_sequences / mini_batch_size`` consecutive mini-batches.

    Each pass uses a fresh permutation derived only from ``(seed, epoch)`` (identity order when
    ``shuffle`` is false), so every rank computes the same list. ``num_sequences`` (R) must be a
    multiple of ``mini_batch_size`` (B); the result has ``epochs * R / B`` mini-batches of B indices.
    """
    if mini_batch_size <= 0 or num_sequences % mini_batch_size:
        raise ValueError(f"dsrl.batch.mini_batch_size = {mini_batch_size} must be positive and divide the "
                         f"rollout size {num_sequences}")
    if epochs < 0:
        raise ValueError(f"epochs = {epochs} must be >= 0 (dsrl.batch.epochs_per_rollout)")
    out: list[list[int]] = []
    for epoch in range(epochs):
        rng = np.random.default_rng([int(seed) & 0xFFFFFFFF, epoch])
        order = (rng.permutation(num_sequences) if shuffle else np.arange(num_sequences)).tolist()
        out += [order[i:i + mini_batch_size] for i in range(0, num_sequences, mini_batch_size)]
    return out


def fixed_micro_batches(indices: Sequence[int], dp: int, m: int) -> Partition:
    """Fixed mode: rank r gets the r-th contiguous ``len(indices)/dp`` indices, cut into micro-batches
    of exactly ``m`` sequences; every rank runs ``len(indices) / (m * dp)`` micro-batches.

    ``len(indices)`` (B) must be a multiple of ``m * dp``; otherwise ValueError.
    """
    if dp <= 0 or m <= 0:
        raise ValueError(f"dp = {dp} and micro_batch_size_per_rank = {m} must be positive")
    n = len(indices)
    if n % (m * dp):
        raise ValueError(f"a mini-batch of {n} sequences is not a multiple of micro_batch_size_per_rank * D = "
                         f"{m} * {dp} = {m * dp}; fixed mode needs B = m * D * k (or use max_tokens_per_micro_batch)")
    idx = [int(i) for i in indices]
    per_rank = n // dp
    return [[idx[r * per_rank + j:r * per_rank + j + m] for j in range(0, per_rank, m)] for r in range(dp)]


def _split_padded(lens_list: list[np.ndarray], max_tokens: int, groups: int, init: list | None = None,
                  ) -> list[list[int]]:
    """For each descending length list, the start positions of exactly ``min(groups, len)``
    contiguous micro-batches with the fewest padded tokens (``groups`` >= each list's minimum).

    One dynamic programme over prefixes, batched over all lists (shorter lists are padded; each is
    read back at its own length): ``best_g[j] = min_i best_{g-1}[i] + (j - i) * l_i`` over feasible
    ``[i, j)``. Above ``_DP_LIMIT`` cells a list falls back to its ``init`` cut (default: the greedy
    minimum cut), then repeated splits of the micro-batch whose best split saves the most padding."""
    out: list[list[int]] = [list(range(len(ls))) for ls in lens_list]
    todo = [r for r, ls in enumerate(lens_list) if len(ls) > groups]
    if not todo:
        return out
    s = max(len(lens_list[r]) for r in todo)
    if len(todo) * s * (s + 1) * groups > _DP_LIMIT:
        for r in todo:
            start = init[r] if init and init[r] is not None else _chunk_starts(lens_list[r], max_tokens)
            out[r] = _split_padded_greedy(lens_list[r], start, groups)
        return out
    L = np.ones((len(todo), s))
    for row, r in enumerate(todo):
        L[row, : len(lens_list[r])] = lens_list[r]
    width = np.arange(s + 1)[None, None, :] - np.arange(s)[None, :, None]
    caps = np.maximum(1, max_tokens // L)[:, :, None]
    cost = np.where((width >= 1) & (width <= caps), width * L[:, :, None], np.inf)
    best = np.full((len(todo), s + 1), np.inf)
    best[:, 0] = 0.0
    choice = np.zeros((groups, len(todo), s + 1), dtype=np.int64)
    for g in range(groups):
        total = best[:, :s, None] + cost
        choice[g] = np.argmin(total, axis=1)
        best = np.take_along_axis(total, choice[g][:, None, :], axis=1)[:, 0, :]
        best[:, 0] = np.inf
    for row, r in enumerate(todo):
        starts, j = [], len(lens_list[r])
        for g in range(groups - 1, -1, -1):
            j = int(choice[g, row, j])
            starts.append(j)
        out[r] = starts[::-1]
    return out


def _split_padded_greedy(lens_desc: np.ndarray, starts: list[int], groups: int) -> list[int]:
    lens = lens_desc.astype(np.float64)
    while len(starts) < groups:
        ends = starts[1:] + [len(lens)]
        saved, cut = -1.0, 0
        for a, e in zip(starts, ends):
            if e - a >= 2:
                cuts = np.arange(a + 1, e)
                gain = (e - cuts) * (lens[a] - lens[cuts])  # the tail is padded to lens[cut] instead
                j = int(np.argmax(gain))
                if gain[j] > saved:
                    saved, cut = float(gain[j]), int(cuts[j])
        starts = sorted(starts + [cut])
    return starts


def _chunk_starts(lens_desc: np.ndarray | list[int], cap: int) -> list[int]:
    """Greedy contiguous cut of a descending length list into padded chunks costing <= ``cap``
    (the fewest possible: feasibility of ``[i, j)`` only gets easier as ``i`` grows)."""
    lens = lens_desc.tolist() if isinstance(lens_desc, np.ndarray) else lens_desc
    starts, i, n = [], 0, len(lens)
    while i < n:
        starts.append(i)
        i += cap // lens[i] or 1
    return starts


def _group_counts(lens: np.ndarray, bounds: np.ndarray, cap: int) -> list[int]:
    """``len(_chunk_starts(lens[a:b], cap))`` for every slice ``[bounds[r], bounds[r + 1])``."""
    jump = np.maximum(1, cap // lens).tolist()
    counts = []
    for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
        c = 0
        while a < b:
            a += jump[a]
            c += 1
        counts.append(c)
    return counts


def _ffd_bins(lens_desc: np.ndarray, max_tokens: int) -> list[list[int]]:
    """First-fit decreasing bin packing of positions (packed micro-batches)."""
    bins: list[list[int]] = []
    room: list[int] = []
    for p, length in enumerate(lens_desc.tolist()):
        for b, free in enumerate(room):
            if length <= free:
                bins[b].append(p)
                room[b] -= length
                break
        else:
            bins.append([p])
            room.append(max_tokens - length)
    return bins


def _split_packed(lens_desc: np.ndarray, max_tokens: int, groups: int) -> list[list[int]]:
    """Exactly ``min(groups, s)`` packed micro-batches (positions) within the budget: first-fit
    decreasing, then the bins with the most sequences are halved until the count is reached."""
    bins = _ffd_bins(lens_desc, max_tokens)
    while len(bins) < min(groups, len(lens_desc)):
        big = max(range(len(bins)), key=lambda b: (len(bins[b]), -b))
        bins.append(bins[big][1::2])
        bins[big] = bins[big][0::2]
    return sorted(bins, key=lambda bn: (-int(lens_desc[bn].sum()), bn[0]))


def _chunk_assignment(lens_desc: list[int], dp: int, per_rank: int, max_tokens: int, coef: float,
                      ) -> tuple[np.ndarray, np.ndarray] | None:
    """Rank of each (descending-sorted) position from whole-mini-batch chunks: cut the sorted list into
    at most ``dp * per_rank`` contiguous chunks of near-equal padded cost (smallest feasible cap,
    by bisection), then balance the chunks over ranks with at most ``per_rank`` each. Chunks hold
    neighbours in the global length order, so they pad far less than a rank's own sorted list."""
    target = dp * per_rank
    if len(_chunk_starts(lens_desc, max_tokens)) > target:
        return None
    lo, hi = max(1, sum(lens_desc) // target), max_tokens
    while lo < hi:
        mid = (lo + hi) // 2
        if len(_chunk_starts(lens_desc, mid)) <= target:
            hi = mid
        else:
            lo = mid + 1
    starts = _chunk_starts(lens_desc, hi)
    # Use the whole allowance: halve the costliest chunks (a uniform cap can jump past the target).
    ends = starts[1:] + [len(lens_desc)]
    heap = [(-(e - a) * lens_desc[a], a, e) for a, e in zip(starts, ends) if e - a > 1]
    heapq.heapify(heap)
    extra = []
    while heap and len(starts) + len(extra) < target:
        _, a, e = heapq.heappop(heap)
        mid = (a + e) // 2
        extra.append(mid)
        for x, y in ((a, mid), (mid, e)):
            if y - x > 1:
                heapq.heappush(heap, (-(y - x) * lens_desc[x], x, y))
    starts = np.asarray(sorted(starts + extra))
    sizes = np.diff(np.append(starts, len(lens_desc)))
    top = np.asarray(lens_desc, dtype=np.float64)[starts]
    chunk_rank = balance_ranks(sizes * top * (1.0 + coef * top / max_tokens), dp, equal_counts=True)
    return np.repeat(chunk_rank, sizes), np.repeat(np.arange(len(sizes)), sizes)


def _finish(rank: np.ndarray, lens: np.ndarray, dp: int, max_tokens: int, coef: float, packed: bool,
            chunk: np.ndarray | None = None) -> tuple[tuple[float, int, float], list[list[np.ndarray]]]:
    """Cut every rank's sequences into the common micro-batch count; returns ((max rank load, count,
    padded tokens), positions per rank per micro-batch). With ``chunk`` (a chunk id per position,
    contiguous in every rank's sorted order) the count is the most chunks on a rank, and the cut is
    never worse than the chunks themselves."""
    order = np.lexsort((np.arange(lens.size), -lens, rank))
    bounds = np.searchsorted(rank[order], np.arange(dp + 1))
    per_rank = [order[bounds[r]:bounds[r + 1]] for r in range(dp)]
    mine = [lens[p] for p in per_rank]
    if packed:
        count = max((len(_ffd_bins(ls, max_tokens)) for ls in mine if ls.size), default=0)
        cuts = [_split_packed(ls, max_tokens, count) if ls.size else [] for ls in mine]
    else:
        if chunk is None:
            count = max(_group_counts(lens[order], bounds, max_tokens), default=0)
            init = [None] * dp
        else:
            init = [np.flatnonzero(np.diff(chunk[p], prepend=-1)).tolist() for p in per_rank]
            count = max(len(st) for st in init)
        starts = _split_padded(mine, max_tokens, count, init)
        cuts = [[np.arange(a, e) for a, e in zip(st, st[1:] + [len(ls)])] for st, ls in zip(starts, mine)]
    out, worst, slots = [], 0.0, 0.0
    for pos, ls_all, groups in zip(per_rank, mine, cuts):
        if packed:
            used = np.array([ls_all[g].sum() for g in groups], dtype=np.float64)
            sq = np.array([(ls_all[g].astype(np.float64) ** 2).sum() for g in groups])
        else:  # descending order: a micro-batch's first sequence is its longest
            top = np.array([ls_all[g[0]] for g in groups], dtype=np.float64)
            used = top * np.array([len(g) for g in groups])
            sq = used * top
        slots += float(used.sum())
        worst = max(worst, float(used.sum() + coef * sq.sum() / max_tokens))
        out.append([pos[g] for g in groups])
    return (worst, count, slots), out


def token_budget_micro_batches(indices: Sequence[int], lengths: Sequence[int] | np.ndarray, dp: int, max_tokens: int,
                               allow_oversize: bool = False, attention_coef: float = 0.0, packed: bool = False,
                               ) -> Partition:
    """Token-budget micro-batches of one mini-batch over ``dp`` ranks (invariants: module docstring).

    ``lengths[i]`` is the token count of sequence ``i`` for the values ``i`` in ``indices`` (e.g. a
    length array over the whole rollout). A sequence longer than ``max_tokens`` raises ValueError
    naming ``max_tokens_per_micro_batch`` and ``allow_oversize``; with ``allow_oversize`` it is alone.
    All ranks get the same number of micro-batches, the longest sequences first; trailing ``[]``
    pad ranks with fewer sequences than that. When ``len(indices) >= dp`` every rank holds at least
    one sequence (RLEngine builds its zero-weight fillers from one). Candidate assignments: KK over
    single sequences (cost ``l + attention_coef * l**2 / max_tokens``) and, in padded mode, KK over
    chunks of neighbouring lengths for a few micro-batch counts up to the single-sequence one; the
    lowest (max rank load, count, padded tokens) wins.
    """
    if dp <= 0:
        raise ValueError(f"dp = {dp} must be a positive number of ranks")
    if max_tokens is None or max_tokens <= 0:
        raise ValueError(f"max_tokens_per_micro_batch = {max_tokens!r} must be a positive integer")
    if attention_coef < 0:
        raise ValueError(f"balance_attention_coef = {attention_coef} must be >= 0")
    idx = np.asarray([int(i) for i in indices], dtype=np.int64)
    raw = np.asarray(lengths)[idx] if idx.size else np.zeros(0, dtype=np.int64)
    if np.any(raw < 0):
        raise ValueError("sequence lengths must be >= 0")
    lens = np.maximum(raw.astype(np.int64), 1)
    if lens.size and lens.max() > max_tokens and not allow_oversize:
        p = int(np.argmax(lens > max_tokens))
        raise ValueError(
            f"sequence {int(idx[p])} has {int(lens[p])} tokens, more than max_tokens_per_micro_batch = {max_tokens} "
            f"(dsrl.batch.max_tokens_per_micro_batch). Fix: raise max_tokens_per_micro_batch to >= {int(lens[p])}, "
            "or set dsrl.batch.allow_oversize = true to place such a sequence alone in its micro-batch.")

    coef = float(attention_coef)
    costs = lens * (1.0 + coef * lens / max_tokens)
    seq_rank = balance_ranks(costs, dp)
    good_enough = float(costs.sum()) / dp * (1 + 10 * BALANCED)  # no assignment beats the mean load
    best = None
    if not packed and dp > 1 and lens.size > dp:
        order = np.lexsort((np.arange(lens.size), -lens))
        lens_desc = lens[order].tolist()
        low = -(-len(_chunk_starts(lens_desc, max_tokens)) // dp)
        by_rank = np.lexsort((-lens, seq_rank))
        high = max(_group_counts(lens[by_rank], np.searchsorted(seq_rank[by_rank], np.arange(dp + 1)), max_tokens))
        for per_rank in sorted({low, low + 1, (low + high) // 2, high}):
            found = _chunk_assignment(lens_desc, dp, per_rank, max_tokens, coef) if per_rank <= high else None
            if found is None:
                continue
            rank, chunk = np.empty_like(found[0]), np.empty_like(found[1])
            rank[order], chunk[order] = found
            if len(np.unique(rank)) < dp:  # every rank keeps at least one sequence
                continue
            cand = _finish(rank, lens, dp, max_tokens, coef, packed, chunk)
            if best is None or cand[0] < best[0]:
                best = cand
            if best[0][0] <= good_enough:
                break
    if best is None or best[0][0] > good_enough:
        cand = _finish(seq_rank, lens, dp, max_tokens, coef, packed)
        if best is None or cand[0] < best[0]:
            best = cand
    count = best[0][1]
    return [[idx[mb].tolist() for mb in micro] + [[] for _ in range(count - len(micro))] for micro in best[1]]


def partition_mini_batch(indices: Sequence[int], lengths: Sequence[int] | np.ndarray | None, plan: Any) -> Partition:
    """Partition one mini-batch over ``plan.data_parallel_size`` ranks as the :class:`dsrl.core.plan.BatchPlan`
    says: fixed micro-batches of ``micro_batch_size_per_rank``, or token-budget micro-batches of
    ``max_tokens_per_micro_batch`` (with ``allow_oversize``, ``balance_attention_coef`` and ``packing``: the
    model runs padding-free packed micro-batches)."""
    dp, m = plan.data_parallel_size, plan.micro_batch_size_per_rank
    if m is not None:
        return fixed_micro_batches(indices, dp, m)
    if lengths is None:
        raise ValueError("token-budget mode (max_tokens_per_micro_batch) needs the sequence lengths")
    return token_budget_micro_batches(indices, lengths, dp, plan.max_tokens_per_micro_batch,
                                      allow_oversize=plan.allow_oversize, attention_coef=plan.balance_attention_coef,
                                      packed=plan.packing)


def partition_stats(partition: Partition, lengths: Sequence[int] | np.ndarray, packed: bool = False,
                    attention_coef: float = 0.0, max_tokens: int | None = None) -> dict[str, Any]:
    """Cost accounting of a partition.

    A micro-batch computes ``count * longest`` token slots when padded (``sum`` when packed); the
    padded-token fraction is (slots - real tokens) / slots. A rank's load is its slots, plus
    ``attention_coef * sum(slot_length**2) / max_tokens`` when both are given. Keys:
    ``ranks, micro_batches_per_step, empty_micro_batches, sequences, real_tokens, padded_tokens,
    padding_fraction, rank_loads, max_rank_load, mean_rank_load, max_over_mean_load,
    max_micro_batch_tokens``.
    """
    lens = np.asarray(lengths)
    coef = attention_coef / max_tokens if attention_coef and max_tokens else 0.0
    loads, real, slots, biggest, empty, seqs = [], 0, 0, 0, 0, 0
    for micros in partition:
        load = 0.0
        for mb in micros:
            if not mb:
                empty += 1
                continue
            ls = lens[np.asarray(mb, dtype=np.int64)].astype(np.float64)
            used = float(ls.sum()) if packed else float(len(ls) * ls.max())
            sq = float((ls * ls).sum()) if packed else used * float(ls.max())
            seqs, real, slots = seqs + len(ls), real + int(ls.sum()), slots + int(used)
            biggest = max(biggest, int(used))
            load += used + coef * sq
        loads.append(load)
    mean = float(np.mean(loads)) if loads else 0.0
    return {"ranks": len(partition), "micro_batches_per_step": max((len(p) for p in partition), default=0),
            "empty_micro_batches": empty, "sequences": seqs, "real_tokens": real, "padded_tokens": slots,
            "padding_fraction": (slots - real) / slots if slots else 0.0, "rank_loads": loads,
            "max_rank_load": max(loads, default=0.0), "mean_rank_load": mean,
            "max_over_mean_load": max(loads) / mean if mean > 0 else 1.0, "max_micro_batch_tokens": biggest}


def expected_token_budget_stats(plan: Any, lengths: Sequence[int], samples: int | None = None,
                                seed: int = 0) -> dict[str, Any]:
    """What token-budget mode will do on a length distribution (``dsrl plan --lengths FILE``).

    Draws mini-batches of ``plan.mini_batch_size`` lengths (with replacement) from ``lengths``,
    partitions each over ``plan.data_parallel_size`` ranks with the plan's budget, and
    averages :func:`partition_stats`. Keys: ``micro_batches_per_step`` (mean per rank),
    ``micro_batches_per_step_max``, ``padding_fraction``, ``max_over_mean_load``, ``samples``,
    ``oversize_sequences`` (lengths above the budget), ``max_tokens_per_micro_batch``.
    """
    pool = np.asarray([int(x) for x in lengths], dtype=np.int64)
    if pool.size == 0:
        raise ConfigError("--lengths: the file holds no sequence lengths")
    T = int(plan.max_tokens_per_micro_batch)
    B, dp = int(plan.mini_batch_size), int(plan.data_parallel_size)
    oversize = int((pool > T).sum())
    allow, packed = bool(plan.allow_oversize), bool(plan.packing)
    if oversize and not allow:
        raise ConfigError(f"--lengths: {oversize} of {pool.size} sequences are longer than max_tokens_per_micro_batch "
                         f"= {T} (dsrl.batch.max_tokens_per_micro_batch). Fix: raise it, or set "
                         "dsrl.batch.allow_oversize = true.")
    if samples is None:
        samples = max(1, min(16, 200_000 // max(B, 1)))
    rng = np.random.default_rng(seed)
    coef = float(plan.balance_attention_coef)
    stats = []
    for _ in range(samples):
        draw = rng.choice(pool, size=B, replace=True)
        part = token_budget_micro_batches(range(B), draw, dp, T, allow, coef, packed)
        stats.append(partition_stats(part, draw, packed=packed))
    mbs = [st["micro_batches_per_step"] for st in stats]
    return {"micro_batches_per_step": float(np.mean(mbs)), "micro_batches_per_step_max": int(max(mbs)),
            "padding_fraction": float(np.mean([st["padding_fraction"] for st in stats])),
            "max_over_mean_load": float(np.mean([st["max_over_mean_load"] for st in stats])),
            "samples": samples, "oversize_sequences": oversize, "max_tokens_per_micro_batch": T,
            "mean_length": float(pool.mean()),
            "lower_bound_micro_batches": int(math.ceil(B * float(pool.mean()) / (dp * T)))}
