"""Mini-batches and token-budget micro-batches that keep the samples of one prompt together, for prompt-shared
forwards (``dsrl.model.share_prompts``: each distinct prompt of a micro-batch runs once, its samples' completions
after it; :mod:`dsrl.rl.data.prefix`).

Pure Python + numpy, deterministic in its arguments, like :mod:`dsrl.core.partition`, whose invariants hold here
too: every index of the mini-batch appears exactly once; every rank has the same number of micro-batches (a rank
with fewer gets trailing ``[]``); when the mini-batch holds at least D samples every rank holds one; no
micro-batch costs more than ``max_tokens`` but a single oversize sample placed alone (``allow_oversize``).

The cost of a micro-batch is that of its shared rows, padded to the longest: ``rows * longest row``, a row being one
prompt once plus each of its samples' forward positions past the prompt (:func:`dsrl.rl.data.prefix.row_length`).
The unit of placement is a prompt's samples in the mini-batch (cut into several units where one row would not fit
the budget); units go to the least-loaded rank, longest first, and within a rank into micro-batches, longest
first (first fit), two units of one prompt never in one micro-batch (the forward would join them into one row
longer than either).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dsrl.core.partition import Partition


def grouped_mini_batches(groups: Sequence[int], mini_batch_size: int, epochs: int, seed: int,
                         shuffle: bool = True) -> list[list[int]]:
    """The mini-batches of one rollout whose sample ``i`` belongs to prompt ``groups[i]``: for each pass a
    permutation of the prompts (from ``(seed, epoch)``, identity without ``shuffle``), each prompt's samples in
    rollout order, cut into consecutive mini-batches of ``mini_batch_size``. A mini-batch thus holds whole prompts
    where the sizes allow (``mini_batch_size`` a multiple of the samples per prompt)."""
    n = len(groups)
    if mini_batch_size <= 0 or n % mini_batch_size:
        raise ValueError(f"dsrl.batch.mini_batch_size = {mini_batch_size} must be positive and divide the "
                         f"rollout size {n}")
    members: dict[int, list[int]] = {}
    for i, g in enumerate(groups):
        members.setdefault(int(g), []).append(i)
    keys = list(members)
    out: list[list[int]] = []
    for epoch in range(epochs):
        rng = np.random.default_rng([int(seed) & 0xFFFFFFFF, epoch])
        order = rng.permutation(len(keys)).tolist() if shuffle else list(range(len(keys)))
        flat = [i for k in order for i in members[keys[k]]]
        out += [flat[i:i + mini_batch_size] for i in range(0, n, mini_batch_size)]
    return out


def _row(prompt_len: int, lengths: Sequence[int]) -> int:
    return prompt_len + sum(max(n - prompt_len, 0) for n in lengths)


def prompt_micro_batches(indices: Sequence[int], lengths: Sequence[int] | np.ndarray,
                         groups: Sequence[int] | np.ndarray, prompt_lens: Sequence[int] | np.ndarray, dp: int,
                         max_tokens: int, allow_oversize: bool = False) -> Partition:
    """Token-budget micro-batches of one mini-batch over ``dp`` ranks, a prompt's samples together (module
    docstring). ``lengths[i]``, ``groups[i]`` and ``prompt_lens[i]`` describe sample ``i`` (forward length, prompt
    id, prompt tokens) for the values ``i`` in ``indices``."""
    if dp <= 0:
        raise ValueError(f"dp = {dp} must be a positive number of ranks")
    if max_tokens is None or max_tokens <= 0:
        raise ValueError(f"max_tokens_per_micro_batch = {max_tokens!r} must be a positive integer")
    idx = [int(i) for i in indices]
    lens, plen = np.asarray(lengths), np.asarray(prompt_lens)
    for i in idx:
        if int(lens[i]) > max_tokens and not allow_oversize:
            raise ValueError(
                f"sequence {i} has {int(lens[i])} tokens, more than max_tokens_per_micro_batch = {max_tokens} "
                f"(dsrl.batch.max_tokens_per_micro_batch). Fix: raise max_tokens_per_micro_batch to >= {int(lens[i])}, "
                "or set dsrl.batch.allow_oversize = true to place such a sequence alone in its micro-batch.")
    members: dict[int, list[int]] = {}
    for i in idx:
        members.setdefault(int(np.asarray(groups)[i]), []).append(i)
    units: list[list[int]] = []  # a prompt's samples, cut where one row would exceed the budget
    for ids in members.values():
        unit: list[int] = []
        for i in ids:
            if unit and _row(int(plen[i]), [int(lens[j]) for j in unit + [i]]) > max_tokens:
                units.append(unit)
                unit = []
            unit.append(i)
        units.append(unit)
    while len(units) < min(dp, len(idx)):  # every rank holds a sample: split the longest unit of several
        k = max((u for u in range(len(units)) if len(units[u]) > 1), key=lambda u: _cost(units[u], lens, plen))
        unit = units.pop(k)
        units[k:k] = [unit[:len(unit) // 2], unit[len(unit) // 2:]]
    order = sorted(range(len(units)), key=lambda u: (-_cost(units[u], lens, plen), u))
    loads, per_rank = [0] * dp, [[] for _ in range(dp)]
    for u in order:  # longest first, to the least-loaded rank (the lowest index on ties)
        r = min(range(dp), key=lambda q: (loads[q], q))
        loads[r] += _cost(units[u], lens, plen)
        per_rank[r].append(units[u])
    group_of = np.asarray(groups)
    micro: list[list[list[int]]] = []
    for rank_units in per_rank:  # already longest first: first fit by padded cost
        bins: list[tuple[int, list[list[int]]]] = []  # (longest row, units)
        for unit in rank_units:
            c, g = _cost(unit, lens, plen), int(group_of[unit[0]])
            for b, (longest, held) in enumerate(bins):
                # two parts of one prompt never meet: the forward would join them into one longer row
                fits = (len(held) + 1) * max(longest, c) <= max_tokens
                if fits and all(int(group_of[h[0]]) != g for h in held):
                    bins[b] = (max(longest, c), held + [unit])
                    break
            else:
                bins.append((c, [unit]))
        micro.append([[i for unit in held for i in unit] for _, held in bins])
    count = max(len(m) for m in micro) if micro else 0
    return [m + [[] for _ in range(count - len(m))] for m in micro]


def _cost(unit: Sequence[int], lens: np.ndarray, plen: np.ndarray) -> int:
    return _row(int(plen[unit[0]]), [int(lens[i]) for i in unit])
