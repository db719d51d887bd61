"""Per-token log-probs of a Megatron ``GPTModel`` with its vocabulary-parallel output layer fused into the tiled
log-softmax of :mod:`dsrl.core.logprobs` (no ``[s, b, V / tp]`` logits).

Inside ``with fused_output_layer(model, targets):`` the model's output layer (a ``ColumnParallelLinear`` whose
weight holds this tensor-parallel rank's slice of the padded vocabulary) computes, instead of logits, the
statistics ``[s, b, STATS]`` (log pi(target), entropy, target gap) of every position with
:func:`dsrl.core.logprobs.head_stats` and a :class:`dsrl.core.logprobs.VocabShard` over its tensor-parallel
group: the row maxima and sums are combined with two all-reduces per chunk, and the hidden states' gradient is
all-reduced in the backward (what the layer's own input region does). Called without labels, ``GPTModel``
returns them transposed as ``[b, s, STATS]``, in the place of its logits; its output weight (shared with the
embedding or not) is whatever the model passes the layer. The padded vocabulary's extra rows take part in the
softmax, as in Megatron's own vocabulary-parallel cross entropy.

Invariants: the layer runs exactly once per forward on hidden states ``[s, b, H]`` that match ``targets``
``[b, s]``; under sequence parallelism (hidden states ``[s / tp, b, H]``, split along the sequence) they are first
gathered over the tensor group, as the layer's own forward gathers them, and the gradient is split back; pipeline
stages without the output layer run unchanged. No other thread runs the model during the block.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch

from dsrl.backends.megatron.sequence_parallel import gather_sequence
from dsrl.core.logprobs import VocabShard, head_stats


@contextlib.contextmanager
def fused_output_layer(model: Any, targets: torch.Tensor, *, temperature: float = 1.0, entropy: bool = False,
                       entropy_grad: bool = False, vocab_parallel: bool = True) -> Iterator[None]:
    """Inside the block, ``model`` (a ``GPTModel``, possibly wrapped by DDP or Float16Module) returns the statistics
    ``[b, s, STATS]`` of ``targets`` ``[b, s]`` instead of logits when called without labels (module docstring).
    ``vocab_parallel=False`` combines nothing over the tensor group (each rank's slice alone): wrong under tensor
    parallelism; it exists to show that the tests catch a missing all-reduce."""
    from megatron.core.utils import unwrap_model

    gpt = unwrap_model(model)
    layer = gpt.output_layer if gpt.post_process else None
    if layer is None:  # an earlier pipeline stage: nothing to replace
        yield
        return
    size = layer.output_size_per_partition
    group = layer.tp_group
    shard = VocabShard(group if vocab_parallel else None, group.rank() * size, size) if group.size() > 1 else None
    calls: list[int] = []
    bias = layer.bias if not layer.skip_bias_add else None
    options = {"temperature": temperature, "entropy": entropy, "entropy_grad": entropy_grad, "shard": shard}
    layer.forward = functools.partial(_stats_forward, layer, targets=targets, bias=bias, calls=calls, options=options)
    try:
        yield
    finally:
        del layer.forward


def _stats_forward(layer: Any, hidden: torch.Tensor, weight: torch.Tensor | None = None,
                   runtime_gather_output: bool | None = None, *, targets: torch.Tensor, bias: torch.Tensor | None,
                   calls: list[int], options: dict[str, Any]) -> tuple[torch.Tensor, None]:
    """The output layer's replaced forward: ``([s, b, STATS], None)`` in the place of ``(logits, bias)``."""
    if calls:
        raise RuntimeError("the output layer ran twice in one forward inside fused_output_layer (e.g. multi-token "
                           "prediction); dsrl's fused log-probs need exactly one call")
    calls.append(1)
    if layer.sequence_parallel:  # [s / tp, b, H]: gathered along the sequence, as the layer's own forward does;
        # its gradient split back, not summed: the vocabulary shard's already sums it over the group
        hidden = gather_sequence(hidden, layer.tp_group)
    s, b = hidden.shape[:2]
    if targets.shape != (b, s):
        raise RuntimeError(f"fused_output_layer got targets {tuple(targets.shape)} for hidden states "
                           f"{tuple(hidden.shape)} (expected [b, s] = [{b}, {s}])")
    rows = hidden.reshape(s * b, hidden.shape[-1])
    stats = head_stats(rows, layer.weight if weight is None else weight, targets.t().reshape(-1), bias, **options)
    return stats.view(s, b, stats.shape[-1]), None
