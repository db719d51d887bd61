"""Weight sync in buckets of bounded size (``dsrl.memory.weight_sync_bucket_mib``): how a model's tensors are cut
into the steps of one sync, so that neither side ever holds a second whole copy of the model.

Two cuts, both deterministic functions of the tensors' sizes (both sides of a sync compute the same one):

- :func:`byte_buckets`: the tensors, in order, laid end to end in a byte stream and cut into buckets of at most
  ``bound`` bytes; a tensor may straddle buckets (the generator ranks' wire, :mod:`dsrl.rl.disagg.wire`, where a
  bucket is one flat buffer). Each segment starts at a byte offset aligned to :data:`ALIGN` inside its bucket, so
  it can be viewed as its dtype;
- :func:`whole_buckets`: consecutive whole tensors whose bytes sum to at most ``bound``; a single tensor larger
  than the bound forms a bucket of its own (a loader that takes named tensors, vLLM's, cannot take part of one).

Invariant: every element of every tensor lies in exactly one segment, in order, and no bucket exceeds ``bound``
bytes (:func:`byte_buckets`) or holds more than one tensor when it does (:func:`whole_buckets`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

MIB = 2**20
ALIGN = 16  # bytes: any dtype's element size divides it


def bucket_bytes(mib: float) -> int:
    """The bound in bytes of ``dsrl.memory.weight_sync_bucket_mib`` (at least :data:`ALIGN` bytes)."""
    return max(ALIGN, int(mib * MIB))


@dataclass(frozen=True)
class Segment:
    """Elements ``[start, start + count)`` of tensor ``index`` (its flattened view), at byte ``offset`` of a bucket."""

    index: int
    start: int
    count: int
    offset: int


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def byte_buckets(tensors: Sequence[tuple[int, int]], bound: int) -> list[list[Segment]]:
    """``tensors``: (element count, element size) in order. The buckets as lists of segments (module docstring);
    each bucket's size is the end of its last segment. ``bound`` must hold at least one element of every tensor
    (any bound >= 16 bytes does)."""
    if bound < ALIGN:
        raise ValueError(f"a bucket bound of {bound} bytes is below {ALIGN}")
    buckets: list[list[Segment]] = []
    current: list[Segment] = []
    used = 0
    for index, (numel, itemsize) in enumerate(tensors):
        start = 0
        while start < numel:
            offset = _align(used)
            room = (bound - offset) // itemsize if offset < bound else 0
            if room <= 0:
                buckets.append(current)
                current, used, offset = [], 0, 0
                room = bound // itemsize
            count = min(room, numel - start)
            current.append(Segment(index, start, count, offset))
            used = offset + count * itemsize
            start += count
    if current:
        buckets.append(current)
    return buckets


def bucket_size(bucket: Sequence[Segment], itemsizes: Sequence[int]) -> int:
    """The bytes a bucket of :func:`byte_buckets` spans."""
    last = bucket[-1]
    return last.offset + last.count * itemsizes[last.index]


def whole_buckets(sizes: Sequence[int], bound: int) -> list[range]:
    """Consecutive tensors (by their byte ``sizes``) in buckets of at most ``bound`` bytes; one tensor larger than
    ``bound`` alone in its bucket. Returns the index ranges."""
    out: list[range] = []
    start, used = 0, 0
    for i, n in enumerate(sizes):
        if i > start and used + n > bound:
            out.append(range(start, i))
            start, used = i, 0
        used += n
    if start < len(sizes):
        out.append(range(start, len(sizes)))
    return out
