"""Weight-sync buckets (dsrl.core.buckets): every element in exactly one segment, in order, no bucket past its
bound, segments aligned for a dtype view; whole-tensor buckets for vLLM's loader."""

from __future__ import annotations

import random

import pytest

from dsrl.core.buckets import ALIGN, bucket_bytes, bucket_size, byte_buckets, whole_buckets


@pytest.mark.parametrize("seed", range(20))
def test_byte_buckets_cover_every_element_once_within_the_bound(seed):
    rng = random.Random(seed)
    tensors = [(rng.randint(1, 300), rng.choice([1, 2, 4, 8])) for _ in range(rng.randint(1, 12))]
    bound = rng.choice([16, 24, 64, 100, 1000, 10**6])
    buckets = byte_buckets(tensors, bound)
    itemsizes = [s for _, s in tensors]
    covered = [0] * len(tensors)
    order = []
    for bucket in buckets:
        assert bucket and bucket_size(bucket, itemsizes) <= bound
        end = 0
        for seg in bucket:
            assert seg.offset % ALIGN == 0 and seg.offset >= end and seg.count > 0
            end = seg.offset + seg.count * itemsizes[seg.index]
            assert seg.start == covered[seg.index]  # in order, no gap, no overlap
            covered[seg.index] += seg.count
            order.append(seg.index)
    assert covered == [n for n, _ in tensors] and order == sorted(order)
    if bound >= sum(-(-n * s // ALIGN) * ALIGN for n, s in tensors):
        assert len(buckets) == 1


def test_whole_buckets_keep_tensors_whole_and_put_a_large_one_alone():
    assert whole_buckets([4, 4, 4], 8) == [range(0, 2), range(2, 3)]
    assert whole_buckets([4, 20, 4], 8) == [range(0, 1), range(1, 2), range(2, 3)]
    assert whole_buckets([], 8) == []
    assert bucket_bytes(0.5) == 2**19 and bucket_bytes(1e-9) == ALIGN
    with pytest.raises(ValueError):
        byte_buckets([(1, 4)], 8)
