"""The rollout data path without a process group: the sample codec (exact, generic over the fields) and
who sends which sample to whom (dsrl.rl.data.replica.RolloutIndex), with every rank played by a thread
around a fake all-to-all: data-parallel, AutoTP 2 x DP 2 and Ulysses 2 x DP 2 layouts, both rank
orders, fixed and token-budget partitions, E > 1 reshuffles."""

from __future__ import annotations

import math
import struct
import threading
from dataclasses import dataclass, field, fields
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from dsrl.core.parallel import ParallelView
from dsrl.core.partition import mini_batches, partition_mini_batch
from dsrl.rl.data import replica as replica_data
from dsrl.rl.data.batching import Sample
from dsrl.rl.data.codec import decode_sample, encode_sample
from dsrl.rl.data.replica import RolloutIndex, is_source, my_part


def _bits(x):
    """A value with its floats replaced by their bit patterns (NaN and -0.0 compare exactly)."""
    if type(x) is float:
        return ("f", struct.pack("<d", x))
    if isinstance(x, list):
        return [_bits(v) for v in x]
    if isinstance(x, torch.Tensor):
        return ("t", str(x.dtype), tuple(x.shape), x.reshape(-1).view(torch.uint8).tolist() if x.numel() else [])
    if isinstance(x, np.ndarray):
        return ("a", x.dtype.str, x.shape, x.tobytes())
    return (type(x).__name__, x)


def _same(a, b) -> bool:
    return type(a) is type(b) and all(_bits(getattr(a, f.name)) == _bits(getattr(b, f.name)) for f in fields(a))


@dataclass
class PPOSample(Sample):
    """A Sample with fields added later (as a critic would add values and returns)."""

    values: list[float] = field(default_factory=list)
    returns: torch.Tensor | None = None
    hidden: np.ndarray | None = None


def test_codec_round_trip_is_bitwise_and_generic_over_fields():
    f32 = np.float32(-1.2345678).item()
    plain = Sample(tokens=[1, 151_935, 0, 7], prompt_len=2, group=3, reward=0.1, advantage=-0.0, active=False,
                   finished=False, accuracy=None, old_logprobs=[f32, -0.0, float("-inf")],
                   ref_logprobs=[0.1, 1e-310, float("nan")])  # 0.1 and subnormals need float64
    big = Sample(tokens=[2**40, -(2**40)], prompt_len=1, group=0, reward=1.0, old_logprobs=[], ref_logprobs=None)
    huge = Sample(tokens=[2**70, 1], prompt_len=1, group=0, reward=math.inf)  # beyond int64: pickled as it is
    ppo = PPOSample(tokens=[5, 6, 7], prompt_len=1, group=1, reward=2.0, old_logprobs=[f32, f32],
                    values=[0.5, 0.25], returns=torch.tensor([1.5, -2.0], dtype=torch.bfloat16),
                    hidden=np.arange(6, dtype=np.float16).reshape(2, 3))
    empty = PPOSample(tokens=[1, 2], prompt_len=1, group=0, reward=0.0, returns=torch.empty(0, 3))
    for s in (plain, big, huge, ppo, empty):
        back = decode_sample(encode_sample(s))
        assert _same(back, s), (back, s)
    # exact float32 payloads travel in 4 bytes per value: 3 tokens (int32) + 2 log-probs (float32) + 2 values
    ints_only = Sample(tokens=list(range(1000)), prompt_len=1, group=0, reward=0.0,
                       old_logprobs=[f32] * 999, ref_logprobs=[0.1] * 999)
    assert 1000 * 4 + 999 * 4 + 999 * 8 < len(encode_sample(ints_only)) < 1000 * 4 + 999 * 12 + 600
    with pytest.raises(ValueError, match="cut or misaligned"):
        decode_sample(encode_sample(plain) + b"\0")
    with pytest.raises(TypeError, match="dataclass instance"):
        encode_sample({"tokens": [1]})


# -- routing ------------------------------------------------------------------------------------------


def _views(dp: int, tp: int = 1, sp: int = 1, replica_major: bool = True) -> list[ParallelView]:
    """One view per global rank; ``replica_major``: the ranks of a replica are consecutive."""
    peers = tp * sp
    out = []
    for r in range(dp * peers):
        d, k = (r // peers, r % peers) if replica_major else (r % dp, r // dp)
        out.append(ParallelView(count_group=None, grad_scale=float(dp), data_parallel_size=dp, data_parallel_rank=d,
                                tensor_parallel_size=tp, tensor_parallel_rank=k % tp, sequence_parallel_size=sp,
                                sequence_parallel_rank=k // tp))
    return out


def _replica_samples(d: int, per: int, rng: np.random.Generator) -> list[Sample]:
    out = []
    for j in range(per):
        n, p = int(rng.integers(4, 40)), 3
        out.append(Sample(tokens=rng.integers(0, 1000, n).tolist(), prompt_len=p, group=d * 100 + j // 2,
                          reward=float(rng.random()), advantage=float(rng.standard_normal()),
                          old_logprobs=rng.standard_normal(n - p).astype(np.float32).tolist(),
                          ref_logprobs=rng.standard_normal(n - p).tolist()))
    return out


class FakeAllToAll:
    """``dist.all_to_all_single`` for ranks played by threads (rank = thread-local ``me``)."""

    def __init__(self, world: int):
        self.barrier = threading.Barrier(world)
        self.inputs: dict[int, tuple[torch.Tensor, list[int]]] = {}
        self.local = threading.local()
        self.received: dict[int, int] = {}

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes):
        me = self.local.me
        self.inputs[me] = (input, input_split_sizes)
        self.barrier.wait()
        parts = []
        for src in sorted(self.inputs):
            buf, splits = self.inputs[src]
            start = sum(splits[:me])
            parts.append(buf[start:start + splits[me]])
            assert splits[me] == output_split_sizes[src], (src, me)
        output.copy_(torch.cat(parts))
        self.received[me] = sum(output_split_sizes)
        self.barrier.wait()


def _run(views: list[ParallelView], partitions, locals_: list[list[Sample]], monkeypatch):
    """Every rank's RolloutIndex.exchange, in threads; returns (index of rank 0, per-rank results, fake)."""
    world = len(views)
    meta, payloads = [], []
    for v, loc in zip(views, locals_):
        enc = [encode_sample(s) for s in loc] if is_source(v) else []
        payloads.append(enc)
        meta.append((v.data_parallel_rank, is_source(v), [s.length for s in loc] if is_source(v) else [],
                     [len(p) for p in enc]))
    fake = FakeAllToAll(world)
    monkeypatch.setattr(replica_data, "dist", SimpleNamespace(all_to_all_single=fake.all_to_all_single))
    results: list = [None] * world
    errors: list = []

    def play(r: int):
        fake.local.me = r
        try:
            idx = RolloutIndex.from_metadata(meta, r, locals_[r] if is_source(views[r]) else [], payloads[r])
            results[r] = idx.exchange(partitions, "cpu")
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
            fake.barrier.abort()

    threads = [threading.Thread(target=play, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    if errors:
        raise errors[0]
    return RolloutIndex.from_metadata(meta), results, fake


LAYOUTS = [  # (dp, tp, sp, replica_major, epochs, mode)
    (2, 1, 1, True, 2, "fixed"),
    (3, 1, 1, True, 3, "tokens"),
    (2, 2, 1, True, 2, "tokens"),  # AutoTP 2 x DP 2
    (2, 2, 1, False, 3, "fixed"),
    (2, 1, 2, True, 2, "tokens"),  # Ulysses 2 x DP 2
    (2, 1, 2, False, 1, "tokens"),
]


@pytest.mark.parametrize("dp,tp,sp,replica_major,epochs,mode", LAYOUTS)
def test_each_rank_receives_exactly_its_replicas_samples_from_the_source(dp, tp, sp, replica_major, epochs, mode,
                                                                         monkeypatch):
    rng = np.random.default_rng(dp * 100 + tp * 10 + sp + epochs)
    views = _views(dp, tp, sp, replica_major)
    per, B = 6, 6 * dp // 2  # two mini-batches per epoch
    source_data = {d: _replica_samples(d, per, rng) for d in range(dp)}
    locals_ = []
    for v in views:
        mine = source_data[v.data_parallel_rank]
        if not is_source(v):  # a peer's own copy differs (e.g. a non-deterministic log-prob): it must not be used
            mine = [Sample(**{**s.__dict__, "old_logprobs": [x + 1.0 for x in s.old_logprobs]}) for s in mine]
        locals_.append(mine)
    # The old path's rollout: the sources' samples in global rank order (replica_data rule 3).
    rollout = [s for v in views if is_source(v) for s in source_data[v.data_parallel_rank]]
    lengths = np.asarray([s.length for s in rollout])
    plan = (SimpleNamespace(data_parallel_size=dp, micro_batch_size_per_rank=1) if mode == "fixed" else
            SimpleNamespace(data_parallel_size=dp, micro_batch_size_per_rank=None, max_tokens_per_micro_batch=64,
                            allow_oversize=False, balance_attention_coef=0.0, packing=False))
    steps = [partition_mini_batch(mb, lengths, plan) for mb in mini_batches(len(rollout), B, epochs, seed=7)]
    index, results, fake = _run(views, steps, locals_, monkeypatch)
    assert index.size == len(rollout) and list(index.lengths) == list(lengths)
    routes = index.routes(steps)
    src = index.source_of_sample
    for r, (v, have) in enumerate(zip(views, results)):
        needed = {i for per_rank in steps for mb in my_part(v, per_rank) for i in mb}
        assert set(have) == needed  # nothing it does not train on
        for per_rank in steps:  # the old path's micro-batches, bit for bit (the source's copy, never a peer's own)
            for mb in my_part(v, per_rank):
                assert all(_same(have[i], rollout[i]) for i in mb)
        got = [i for (s, dst), ids in routes.items() if dst == r for i in ids]
        assert sorted(got) == sorted(i for i in needed if src[i] != r)  # each needed sample once, own ones never
        assert all(src[i] == s for (s, dst), ids in routes.items() for i in ids)  # only sources send
        assert fake.received[r] == int(index.sizes[got].sum())
    for d in range(dp):  # the ranks of a replica receive the same samples
        members = [r for r, v in enumerate(views) if v.data_parallel_rank == d]
        assert len({tuple(sorted(results[r])) for r in members}) == 1
    if epochs > 1:  # reshuffles: a replica trains on more distinct samples than one epoch's share, each sent once
        assert any(len(results[r]) > len(rollout) // dp for r in range(len(views)))


def test_layout_and_partition_errors():
    with pytest.raises(RuntimeError, match="exactly one source"):
        RolloutIndex.from_metadata([(0, True, [3], [10]), (0, True, [4], [10])])
    with pytest.raises(RuntimeError, match="exactly one source"):
        RolloutIndex.from_metadata([(0, True, [3], [10]), (1, False, [], [])])
    index = RolloutIndex.from_metadata([(0, True, [3, 5], [10, 12]), (1, True, [4, 4], [11, 11])])
    assert index.replicas == 2 and list(index.source_of_sample) == [0, 0, 1, 1] and list(index.first) == [0, 2]
    with pytest.raises(ValueError, match="partitioned into 1 parts for 2 replicas"):
        index.routes([[[[0, 1, 2, 3]]]])
    with pytest.raises(ValueError, match="sample index 4 is outside the rollout of 4"):
        index.routes([[[[0, 4]], [[1]]]])


def test_single_process_keeps_its_samples_without_a_collective():
    single = ParallelView(count_group=None, grad_scale=1.0, data_parallel_size=1, data_parallel_rank=0)
    samples = _replica_samples(0, 4, np.random.default_rng(0))
    index = RolloutIndex.gather(single, samples)
    assert index.size == 4 and list(index.lengths) == [s.length for s in samples]
    have = index.exchange([[[[2, 0]]], [[[1]]]])
    assert set(have) == {0, 1, 2} and all(have[i] is samples[i] for i in have)
