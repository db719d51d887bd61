"""Which ranks own tokens (and count them), and by what factor the gradient reduction scales them.

One :class:`ParallelView` describes the layout one rank sees, for either backend, in the terms the
exact step (:mod:`dsrl.core.step`) needs:

- ``count_group``: the group over which per-mini-batch token/sequence counts are summed, so that
  every token is counted exactly once: data-parallel replicas plus sequence/context-parallel
  shards, never tensor-parallel peers (they hold the same tokens) and never other pipeline stages;
- ``grad_scale``: 1/f, where f is what the gradient reduction multiplies each rank's gradient by
  before summing it over ``count_group`` (DeepSpeed's mean over D replicas: f = 1/D, so the scale
  is D; Megatron: the DDP's real factor). A backend's own loss conventions (Megatron dividing by
  the micro-batch or token count) are applied by that backend on top;
- ``owns_sequences``: whether this rank counts sequences (only the first shard of each sequence; every rank when
  ``sequence_peers_hold_whole_rows``: Megatron CP run inside the model, whose count group leaves the peers out);
- ``data_parallel_size`` / ``data_parallel_rank``: the replicas holding different sequences (D of
  the plan) and this rank's replica index, which decides which data it gets;
- ``tensor_parallel_size`` / ``tensor_parallel_rank`` / ``tensor_parallel_group`` (DeepSpeed AutoTP
  or Megatron TP: peers that hold the same tokens and run every forward together),
  ``sequence_parallel_size`` / ``sequence_parallel_rank`` (DeepSpeed Ulysses or Megatron context
  parallelism), ``pipeline`` (None without pipeline stages).

With tensor parallelism the count group stays the data(-sequence)-parallel group and D =
world / (tp * sp * pp): the fields above already say so, whichever backend provides the TP.
Which rank generates, keeps and trains on which data follows from these fields in one place,
:mod:`dsrl.rl.data.replica`.

Each backend builds the view from its framework's real reduction, never assuming it: the DeepSpeed
view (:func:`dsrl.backends.deepspeed.view.deepspeed_view`) from the engine's group size, sequence
parallelism, ZeRO stage, reduce_scatter and gradient_allreduce_op; the Megatron view
(:func:`dsrl.backends.megatron.megatron_view`) from the DDP's grad buffers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist


@dataclass(frozen=True)
class PipelineView:
    """Pipeline stages: only the last one computes losses; every stage must agree on the results."""

    size: int
    is_last_stage: bool
    group: Any  # the pipeline group of this rank (ranks holding the same data at different stages)
    last_stage_global_rank: int  # the global rank that holds the losses and broadcasts them
    stage: int = 0  # this rank's stage (0: the first, which holds its replica's data: dsrl.rl.data.replica)


@dataclass(frozen=True)
class ParallelView:
    """The parallel layout one rank sees, and the gradient reduction's real factor (module docstring)."""

    count_group: Any  # torch ProcessGroup (None = the default group)
    grad_scale: float
    data_parallel_size: int  # replicas that hold different sequences (D of the plan)
    data_parallel_rank: int
    tensor_parallel_size: int = 1
    tensor_parallel_rank: int = 0
    tensor_parallel_group: Any = None  # torch ProcessGroup of this rank's tensor peers (None without TP)
    sequence_parallel_size: int = 1  # DeepSpeed Ulysses SP / Megatron CP shards of one sequence
    sequence_parallel_rank: int = 0
    # Megatron CP inside the model (dsrl.backends.megatron.context_parallel): every sequence peer holds whole rows
    # and computes the same loss, so each counts every sequence and the count group leaves the peers out
    sequence_peers_hold_whole_rows: bool = False
    pipeline: PipelineView | None = None
    description: str = ""
    count_group_size: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "count_group_size", group_size(self.count_group))

    @property
    def owns_sequences(self) -> bool:
        """Whether this rank counts sequences: only the first shard of each sequence does (every rank, when the
        sequence peers hold whole rows: its count group then holds one of them per replica)."""
        return self.sequence_parallel_rank == 0 or self.sequence_peers_hold_whole_rows

    @property
    def is_last_stage(self) -> bool:
        """Whether this rank computes losses (always, without pipeline parallelism)."""
        return self.pipeline is None or self.pipeline.is_last_stage


def group_size(group: Any) -> int:
    """Size of ``group`` (1 when torch.distributed is not running)."""
    if not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group=group)


def group_rank(group: Any) -> int:
    """This rank's index in ``group`` (0 when torch.distributed is not running)."""
    if not dist.is_available() or not dist.is_initialized():
        return 0
    return dist.get_rank(group=group)
