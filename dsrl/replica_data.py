"""Who generates, keeps and trains on which data: the one place that decides it.

A *replica* is the set of ranks that hold one copy of the model (its tensor-parallel peers and,
with Ulysses, its sequence-parallel peers); ``view.data_parallel_rank`` is its index, ``D =
view.data_parallel_size`` their number (:class:`dsrl.parallel.ParallelView`). The rules:

1. prompts and generation seeds are chosen per replica (``ExperienceMaker`` slices the P prompts of
   a rollout by replica and seeds from it), so every rank of a replica generates the same thing and
   runs the same sharded forwards in lockstep (the hf backend's synchronized stop,
   ``dsrl.rollout.hf.TensorPeersStop``, keeps tensor peers together even if their sampling drifted);
2. one rank per replica is its *source* (tensor and sequence rank 0). After generation the tensor
   peers adopt the source's scored samples (:func:`share_with_tensor_peers`), so they hold identical
   data even if a reward function is not deterministic, and the later log-prob forwards see
   identical shapes;
3. the rollout every rank trains on is the concatenation of the sources' samples in global rank
   order (:func:`gather_rollout`): tensor peers never contribute duplicates, and the rollout
   statistics count only the sources' samples (``ExperienceMaker``);
4. each mini-batch is partitioned into D parts (``dsrl.partition``) and every rank takes part
   ``view.data_parallel_rank`` (:func:`my_part`): the ranks of a replica get identical
   micro-batches, hence identical zero-weight fillers.

A future point-to-point data path must keep these rules: same prompts and seeds per replica,
identical micro-batches for the ranks of a replica, every sample counted once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import torch.distributed as dist

from dsrl.parallel import ParallelView

T = TypeVar("T")


def is_source(view: ParallelView) -> bool:
    """Whether this rank holds its replica's canonical copy of the data (rule 2)."""
    return view.tensor_parallel_rank == 0 and view.sequence_parallel_rank == 0


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


def gather_rollout(view: ParallelView, local: Sequence[T]) -> list[T]:
    """The whole rollout on every rank: the sources' samples, concatenated in global rank order (rule 3).

    Collective over all ranks (one all-gather of Python objects).
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return list(local)
    mine = list(local) if is_source(view) else []
    parts: list[list[T]] = [None] * dist.get_world_size()  # type: ignore[list-item]
    dist.all_gather_object(parts, mine)
    return [s for part in parts for s in part]


def my_part(view: ParallelView, per_replica: Sequence[T]) -> T:
    """This rank's share of a mini-batch partitioned into D parts (rule 4)."""
    if len(per_replica) != view.data_parallel_size:
        raise ValueError(f"a mini-batch partitioned into {len(per_replica)} parts for {view.data_parallel_size} "
                         "data-parallel replicas")
    return per_replica[view.data_parallel_rank]
