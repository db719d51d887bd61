"""megatron-core's context parallelism in the Megatron engine (``dsrl.engine.context_parallel_size``), without
Transformer Engine.

With context parallelism the ``cp`` ranks of a context group split every row's positions: Megatron's load-balanced
cut gives rank ``r`` the chunks ``r`` and ``2 cp - 1 - r`` of ``2 cp`` equal chunks (:mod:`dsrl.backends.megatron.cp`),
and megatron-core's rotary embedding already takes those chunks' positions. Only the attention needs every position:
megatron-core's local layer spec refuses context parallelism there (its ``DotProductAttention`` asserts
``context_parallel_size == 1``; only Transformer Engine's attention takes it). What dsrl adds, and the invariants it
keeps (tested against the float64 reference, tests/distributed/test_megatron_check.py):

- :class:`ContextParallelAttention`: the keys and values of the context group are all-gathered (their gradient
  reduce-scattered: a key's gradient is the sum over every rank's queries) and put in sequence order, and this
  rank's queries attend to them under the causal mask of their global positions, through megatron-core's own
  ``DotProductAttention`` (the same scale, softmax and masking). This is Transformer Engine's
  ``cp_comm_type = "all_gather"`` scheme (Llama 3's), not the ring of point-to-point exchanges: the whole keys and
  values of a row are on each rank for one layer at a time. :func:`context_parallel_spec` puts it in a local spec.
- The engine's model face (:mod:`dsrl.backends.megatron.causal_lm`) cuts each row for its context rank
  (:func:`dsrl.backends.megatron.cp.cut_along`, the cut of a user's micro-batches, after padding the row on the
  right to a multiple of ``2 cp``; causal attention: the real positions never see the padding) and gathers the last
  stage's output back to whole rows before the head
  (:func:`gather_rows`), its gradient split back, not summed. Every rank of the context group then computes the same
  loss on the same tokens, as tensor peers do: the token counts exclude the context group
  (:class:`dsrl.backends.megatron.step.MegatronRLStep` with ``context_parallel_in_model``), and the sum of the
  context ranks' gradients (megatron-core's DDP reduces over data x context) is the whole gradient, each position's
  path counted once. The head and the loss run on every position on every context rank, so the head's weight takes
  its gradient from the group's first rank only (:func:`counted_once`).
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from dsrl.backends.megatron.cp import cut_along, unshard_from_context_parallel


def rows_multiple(cp: int, tp_split: int = 1) -> int:
    """The multiple a row's length is padded to: ``2 cp`` chunks under context parallelism (none without it), each of
    a length that the tensor group splits again under sequence parallelism (``tp_split``: the tensor-parallel size
    then, else 1)."""
    return (2 * cp if cp > 1 else 1) * tp_split


def global_positions(local_length: int, cp: int, rank: int, device: Any = None) -> torch.Tensor:
    """The sequence positions of the ``local_length`` rows that context rank ``rank`` holds (its two chunks)."""
    return cut_along(torch.arange(local_length * cp, device=device), 0, cp, rank)


def in_sequence_order(gathered: torch.Tensor, cp: int) -> torch.Tensor:
    """The rank-ordered all-gather of every context rank's two chunks (sequence first) put in sequence order."""
    return unshard_from_context_parallel(list(gathered.chunk(cp, dim=0)), dim=0)


def gather_rows(part: torch.Tensor, group: Any, length: int) -> torch.Tensor:
    """``part`` ``[b, s / cp, ...]`` (this context rank's two chunks, batch first) gathered over the context group to
    ``[b, length, ...]`` in sequence order (the padding cut off). Its gradient is split back, not summed: every
    context rank computes the same loss on the whole rows (module docstring)."""
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

    seq_first = part.transpose(0, 1).contiguous()
    gathered = gather_from_sequence_parallel_region(seq_first, tensor_parallel_output_grad=False, group=group)
    return in_sequence_order(gathered, group.size())[:length].transpose(0, 1)


class _CountedOnce(torch.autograd.Function):
    """Identity; the gradient passes on the group's first rank only (zeros elsewhere)."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.first = group.rank() == 0
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return (grad if ctx.first else torch.zeros_like(grad)), None


def counted_once(weight: torch.Tensor, group: Any) -> torch.Tensor:
    """``weight`` for a layer that runs on the whole rows after :func:`gather_rows` (the output head): every context
    rank computes its full gradient, and megatron-core's DDP sums the gradients over the context group, so only the
    group's first rank passes it on (a tied head's embedding still gets every rank's lookup gradient, which is a
    partial sum over that rank's positions)."""
    return _CountedOnce.apply(weight, group)


class ContextParallelAttention(torch.nn.Module):
    """Causal core attention over the context group, built from megatron-core's core-attention arguments (a
    drop-in for ``DotProductAttention`` in a local layer spec; module docstring). ``forward`` takes this rank's
    queries ``[s / cp, b, np, hn]`` and keys and values ``[s / cp, b, ng, hn]`` and returns ``[s / cp, b, np * hn]``."""

    def __init__(self, config: Any, layer_number: int, attn_mask_type: Any, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection: Any = None):
        super().__init__()
        from megatron.core import parallel_state as ps
        from megatron.core.transformer.dot_product_attention import DotProductAttention
        from megatron.core.transformer.enums import AttnMaskType

        whole = copy.copy(config)  # the attention itself sees whole rows: megatron-core's, with its CP assert passed
        whole.context_parallel_size = 1
        self.inner = DotProductAttention(whole, layer_number, AttnMaskType.arbitrary, attention_type,
                                         attention_dropout=attention_dropout, softmax_scale=softmax_scale,
                                         pg_collection=pg_collection)
        self.config = config
        self.cp_group = ps.get_context_parallel_group()

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
                attn_mask_type: Any = None, attention_bias: Any = None, packed_seq_params: Any = None) -> torch.Tensor:
        from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

        if attention_mask is not None or packed_seq_params is not None:
            raise ValueError("context-parallel attention runs causal rows without a mask or packed sequences")
        group, local = self.cp_group, query.shape[0]
        cp = group.size()
        whole_key, whole_value = (
            in_sequence_order(gather_from_sequence_parallel_region(t.contiguous(), tensor_parallel_output_grad=True,
                                                                   group=group), cp) for t in (key, value))
        positions = global_positions(local, cp, group.rank(), key.device)
        masked = (torch.arange(local * cp, device=key.device)[None, :] > positions[:, None])[None, None]
        return self.inner(query, whole_key, whole_value, masked, attention_bias=attention_bias)


def context_parallel_spec(spec: Any, config: Any) -> Any:
    """``spec`` (a layer spec of megatron-core's local modules, or a block spec of them) with its core attention
    :class:`ContextParallelAttention` when ``config.context_parallel_size > 1``; else ``spec`` unchanged."""
    if config.context_parallel_size == 1:
        return spec
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from dsrl.backends.megatron.sequence_parallel import replace_modules

    spec = copy.deepcopy(spec)
    replace_modules(spec, DotProductAttention, ContextParallelAttention)
    return spec


__all__ = ["ContextParallelAttention", "context_parallel_spec", "counted_once", "gather_rows", "global_positions",
           "in_sequence_order", "rows_multiple"]
