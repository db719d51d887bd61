"""Who generates, keeps, sends and trains on which data: the one place that decides it.

A *replica* is the set of ranks that hold one copy of the model (its tensor-parallel peers, with
Ulysses or Megatron's CP its sequence-parallel peers, and its pipeline stages); ``view.data_parallel_rank``
is its index, ``D = view.data_parallel_size`` their number (:class:`dsrl.core.parallel.ParallelView`). The rules:

1. prompts and generation seeds are chosen per replica (``ExperienceMaker`` slices the P prompts of
   a rollout by replica and seeds from it), so every rank of a replica generates the same thing and
   runs the same sharded forwards in lockstep (the hf backend's synchronized stop,
   ``dsrl.rollout.policy.TensorPeersStop``, keeps tensor peers together even if their sampling drifted);
2. one rank per replica is its *source* (tensor and sequence rank 0, first pipeline stage). After
   generation the tensor peers adopt the source's scored samples (:func:`share_with_tensor_peers`), so
   they hold identical data even if a reward function is not deterministic, and the later log-prob forwards see
   identical shapes;
3. the rollout is the concatenation of the sources' samples in global rank order (sample ``i`` of
   the rollout is the ``i``-th in that order): tensor peers never contribute duplicates, and the
   rollout statistics count only the sources' samples (``ExperienceMaker``). Every rank learns the
   length (and encoded size) of every sample from one small all-gather
   (:meth:`RolloutIndex.gather`), enough to partition the rollout exactly as if it held all of it;
4. each mini-batch is partitioned into D parts (``dsrl.core.partition``) and every rank takes part
   ``view.data_parallel_rank`` (:func:`my_part`): the ranks of a replica get identical
   micro-batches, hence identical zero-weight fillers;
5. samples move only to where they are trained on: once the partitions of all E epochs of a rollout
   are known (the same on every rank), each sample travels once per rollout from its source to every
   other rank of every replica that trains on it in any epoch, in one all-to-all of byte buffers
   (:meth:`RolloutIndex.exchange`, :mod:`dsrl.rl.data.codec`). Every rank of a replica, tensor and
   sequence peers included, uses the source's copy (a peer receives even its own replica's samples
   rather than trusting its local copy), so rule 4 holds bit for bit. A rank receives about
   ``R/D`` samples' bytes (fewer: a source keeps its own), plus ``R`` lengths and sizes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import torch
import torch.distributed as dist

from dsrl.core.parallel import ParallelView
from dsrl.core.partition import mini_batches, partition_mini_batch
from dsrl.core.plan import BatchPlan
from dsrl.core.prompt_partition import grouped_mini_batches, prompt_micro_batches
from dsrl.rl.data.batching import Sample, collate, collate_packed
from dsrl.rl.data.codec import decode_sample, encode_sample

T = TypeVar("T")
Partition = list[list[list[int]]]  # dsrl.core.partition: partition[replica][micro_batch] -> sample indices


def is_source(view: ParallelView) -> bool:
    """Whether this rank holds its replica's canonical copy of the data (rule 2): tensor and sequence rank 0, and
    the first of its pipeline stages (every stage of a replica trains on the same samples)."""
    first_stage = view.pipeline is None or view.pipeline.stage == 0
    return view.tensor_parallel_rank == 0 and view.sequence_parallel_rank == 0 and first_stage


def share_with_tensor_peers(view: ParallelView, make: Callable[[], T]) -> T:
    """``make()`` of the tensor-parallel source, on every rank of its tensor group (rule 2); the other
    peers do not call ``make``. Without tensor parallelism: just ``make()``.

    Collective over the tensor group: every tensor peer calls it the same number of times.
    """
    if view.tensor_parallel_size <= 1:
        return make()
    group = view.tensor_parallel_group
    if group is None:
        raise ValueError(f"a view with tensor_parallel_size {view.tensor_parallel_size} but no tensor_parallel_group")
    payload = [make() if view.tensor_parallel_rank == 0 else None]
    dist.broadcast_object_list(payload, src=dist.get_global_rank(group, 0), group=group)
    return payload[0]


def my_part(view: ParallelView, per_replica: Sequence[T]) -> T:
    """This rank's share of a mini-batch partitioned into D parts (rule 4)."""
    if len(per_replica) != view.data_parallel_size:
        raise ValueError(f"a mini-batch partitioned into {len(per_replica)} parts for {view.data_parallel_size} "
                         "data-parallel replicas")
    return per_replica[view.data_parallel_rank]


def my_micro_batches(samples: Mapping[int, Sample] | Sequence[Sample], per_replica: Sequence[list[list[int]]],
                     view: ParallelView, pad_id: int, device: torch.device | str,
                     packed: bool = False, shared: bool = False) -> list[dict[str, torch.Tensor]]:
    """This rank's collated micro-batches of one partitioned mini-batch (``samples[i]`` is sample ``i``;
    padded rows, packed ones with ``packed``, with prompt-shared rows for the forward with ``shared``), empty
    micro-batches left out (rule 4)."""
    if packed:
        return [collate_packed([samples[i] for i in ids], pad_id, device) for ids in my_part(view, per_replica) if ids]
    return [collate([samples[i] for i in ids], pad_id, device, shared=shared)
            for ids in my_part(view, per_replica) if ids]


def needed_by_replica(partitions: Sequence[Partition], replicas: int, size: int) -> list[list[int]]:
    """For each replica, the sorted distinct sample indices it trains on in any of ``partitions``
    (the partitions of every mini-batch of one rollout, all epochs)."""
    need: list[set[int]] = [set() for _ in range(replicas)]
    for k, per_replica in enumerate(partitions):
        if len(per_replica) != replicas:
            raise ValueError(f"mini-batch {k} is partitioned into {len(per_replica)} parts for {replicas} replicas")
        for d, micros in enumerate(per_replica):
            for mb in micros:
                need[d].update(mb)
    out = [sorted(s) for s in need]
    bad = [i for s in out for i in (s[:1] + s[-1:]) if not 0 <= i < size]
    if bad:
        raise ValueError(f"sample index {bad[0]} is outside the rollout of {size} samples")
    return out


@dataclass
class RolloutIndex:
    """What every rank knows of one rollout before any sample moves (rules 3 and 5).

    ``replica_of_rank[r]`` is the replica of global rank ``r``; ``counts[r]`` the samples rank ``r``
    contributes (0 unless it is a source); ``lengths[i]`` / ``sizes[i]`` the forward length and
    encoded bytes of rollout sample ``i``. ``rank``, ``local`` and ``payloads`` are this rank's own:
    its index, its samples and (on a source with peers to feed) their encodings.
    """

    replica_of_rank: list[int]
    counts: list[int]
    lengths: np.ndarray
    sizes: np.ndarray
    groups: np.ndarray | None = None  # each sample's prompt group (Sample.group); None where not gathered
    prompt_lens: np.ndarray | None = None
    rank: int = 0
    local: list[Any] = field(default_factory=list)
    payloads: list[bytes] = field(default_factory=list)

    @property
    def size(self) -> int:
        """R: the samples of the rollout."""
        return int(sum(self.counts))

    @property
    def replicas(self) -> int:
        return len(set(self.replica_of_rank))

    @property
    def source_of_sample(self) -> np.ndarray:
        """The global rank holding each sample (rule 3: sources in global rank order)."""
        return np.repeat(np.arange(len(self.counts)), self.counts)

    @property
    def first(self) -> np.ndarray:
        """Index of each rank's first sample in the rollout."""
        return np.concatenate([[0], np.cumsum(self.counts)[:-1]]).astype(np.int64)

    @classmethod
    def from_metadata(cls, metadata: Sequence[tuple[Any, ...]], rank: int = 0,
                      local: Sequence[Any] = (), payloads: Sequence[bytes] = ()) -> RolloutIndex:
        """The index from every rank's ``(replica, is source, lengths, sizes[, groups, prompt lengths])`` in global
        rank order; non-sources' lists are ignored. Every replica ``0..D-1`` must have exactly one source."""
        replicas = [int(m[0]) for m in metadata]
        sources = [r for r, m in enumerate(metadata) if m[1]]
        per_replica = sorted(replicas[r] for r in sources)
        if per_replica != list(range(len(set(replicas)))) or set(replicas) != set(per_replica):
            raise RuntimeError(f"every replica needs exactly one source rank (tensor and sequence rank 0); got "
                               f"replicas {replicas} with sources at ranks {sources}")
        counts = [len(m[2]) if m[1] else 0 for m in metadata]
        lengths = np.asarray([x for m in metadata if m[1] for x in m[2]], dtype=np.int64)
        sizes = np.asarray([x for m in metadata if m[1] for x in m[3]], dtype=np.int64)
        if sizes.size != lengths.size:
            raise RuntimeError(f"{lengths.size} sample lengths but {sizes.size} sizes")
        groups = prompt_lens = None
        if all(len(m) > 4 for m in metadata):
            groups = np.asarray([x for m in metadata if m[1] for x in m[4]], dtype=np.int64)
            prompt_lens = np.asarray([x for m in metadata if m[1] for x in m[5]], dtype=np.int64)
        return cls(replicas, counts, lengths, sizes, groups, prompt_lens, rank, list(local), list(payloads))

    @classmethod
    def gather(cls, view: ParallelView, local: Sequence[Any]) -> RolloutIndex:
        """Collective over all ranks: one all-gather of every rank's replica index and, from the
        sources, their samples' lengths (``sample.length``) and encoded sizes (rule 3)."""
        local = list(local)
        lengths = [int(s.length) for s in local]
        groups, prompt_lens = [int(s.group) for s in local], [int(s.prompt_len) for s in local]
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return cls.from_metadata([(0, True, lengths, [0] * len(lengths), groups, prompt_lens)], 0, local)
        source = is_source(view)
        payloads = [encode_sample(s) for s in local] if source else []
        meta = (view.data_parallel_rank, source, lengths if source else [], [len(p) for p in payloads],
                groups if source else [], prompt_lens if source else [])
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, meta)
        return cls.from_metadata(gathered, dist.get_rank(), local if source else [], payloads)

    def routes(self, partitions: Sequence[Partition]) -> dict[tuple[int, int], list[int]]:
        """``(sender, receiver) -> sample indices`` (ascending), the same on every rank: every rank
        receives each sample its replica trains on in any of ``partitions`` exactly once, from that
        sample's source, unless it is that source (rule 5). Pairs with nothing to move are absent."""
        return self._routes(needed_by_replica(partitions, self.replicas, self.size))

    def _routes(self, need: list[list[int]]) -> dict[tuple[int, int], list[int]]:
        src = self.source_of_sample
        out: dict[tuple[int, int], list[int]] = {}
        for r, d in enumerate(self.replica_of_rank):
            for i in need[d]:
                s = int(src[i])
                if s != r:
                    out.setdefault((s, r), []).append(i)
        return out

    def exchange(self, partitions: Sequence[Partition], device: torch.device | str = "cpu") -> dict[int, Sample]:
        """Collective over all ranks: ``{sample index: sample}`` for every sample this rank's replica
        trains on in ``partitions`` (nothing else), after one all-to-all of encoded samples on
        ``device`` (the default process group's device: CUDA under NCCL). Its own samples stay put."""
        me, world = self.rank, len(self.replica_of_rank)
        need = needed_by_replica(partitions, self.replicas, self.size)
        first, src = int(self.first[me]), self.source_of_sample
        have = {i: self.local[i - first] for i in need[self.replica_of_rank[me]] if src[i] == me}
        if world == 1:
            return have
        routes = self._routes(need)
        send = [routes.get((me, r), []) for r in range(world)]
        recv = [routes.get((s, me), []) for s in range(world)]
        send_splits = [int(self.sizes[ids].sum()) for ids in send]
        recv_splits = [int(self.sizes[ids].sum()) for ids in recv]
        buf = np.empty(sum(send_splits), dtype=np.uint8)
        pos = 0
        for ids in send:
            for i in ids:
                p = self.payloads[i - first]
                buf[pos:pos + len(p)] = np.frombuffer(p, dtype=np.uint8)
                pos += len(p)
        out = torch.empty(sum(recv_splits), dtype=torch.uint8, device=device)
        dist.all_to_all_single(out, torch.from_numpy(buf).to(device), output_split_sizes=recv_splits,
                               input_split_sizes=send_splits)
        data = out.cpu().numpy()
        pos = 0
        for ids in recv:
            for i in ids:
                n = int(self.sizes[i])
                have[i] = decode_sample(data[pos:pos + n])
                pos += n
        return have


def rollout_micro_batches(local: Sequence[Sample], view: ParallelView, plan: BatchPlan, seed: int, shuffle: bool,
                          pad_id: int, device: torch.device | str) -> Iterator[list[dict[str, torch.Tensor]]]:
    """This rank's micro-batches of each of a rollout's ``E * R / B`` mini-batches, in training order (one
    optimizer step each).

    Every rank learns all R lengths (:meth:`RolloutIndex.gather`), cuts the same E reshuffled passes of
    ``plan.mini_batch_size`` samples (``seed``; ``shuffle``: ``batch.shuffle``) and partitions each across replicas
    and into micro-batches (:mod:`dsrl.core.partition`); then one all-to-all moves each sample, once per rollout,
    to the ranks that train on it (rules 3-5), before the first mini-batch is yielded."""
    index = RolloutIndex.gather(view, local)
    if plan.share_prompts:  # whole prompts per mini-batch and micro-batch (dsrl.core.prompt_partition)
        batches = grouped_mini_batches(index.groups, plan.mini_batch_size, plan.epochs_per_rollout, seed=seed,
                                       shuffle=shuffle)
        steps = [partition_mini_batch(mb, index.lengths, plan) if plan.micro_batch_size_per_rank is not None else
                 prompt_micro_batches(mb, index.lengths, index.groups, index.prompt_lens, plan.data_parallel_size,
                                      plan.max_tokens_per_micro_batch, plan.allow_oversize) for mb in batches]
    else:
        steps = [partition_mini_batch(mb, index.lengths, plan)
                 for mb in mini_batches(index.size, plan.mini_batch_size, plan.epochs_per_rollout, seed=seed,
                                        shuffle=shuffle)]
    samples = index.exchange(steps, device)
    del index
    for per_rank in steps:
        yield my_micro_batches(samples, per_rank, view, pad_id, device, plan.packing, plan.share_prompts)
