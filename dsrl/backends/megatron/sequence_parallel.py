"""megatron-core's sequence parallelism in the Megatron engine (``dsrl.engine.sequence_parallel``).

With it, the tensor-parallel group splits the positions of every activation outside the attention and MLP
blocks: the embedding's output is reduce-scattered along the sequence, each column-parallel linear all-gathers
its input and each row-parallel one reduce-scatters its output. The norms then see a ``1 / tp`` slice of the
positions, so their weights' gradients are partial sums that megatron-core's ``finalize_model_grads`` adds up over
the tensor group (for parameters marked ``sequence_parallel``).

What dsrl adds, and the invariants it keeps (tested against the float64 reference, tests/distributed/
test_megatron_check.py, and against the same run without it, tests/distributed/test_megatron_train.py):

- :class:`SequenceParallelRMSNorm`: megatron-core's local spec builds ``torch.nn.RMSNorm`` and refuses sequence
  parallelism there (only Transformer Engine's and Apex's norms take it); this is the same norm, with its weight
  marked so that its gradient is summed over the tensor group. :func:`layer_spec` puts it in the local spec.
- :func:`padded_length`: the split needs a length divisible by the tensor-parallel size, so a row is padded on the
  right (causal attention: the real positions never see the padding) and its outputs cut back.
- :func:`gather_positions`: the model's output (final hidden states, or a value model's values) is gathered along
  the sequence before the head, so the fused log-probs and the value loss see every position on every rank of the
  group, as without sequence parallelism. The gradient of the gathered tensor is only split back (not summed):
  every rank of the group computes the same loss on the same positions, and the vocabulary-parallel head already
  sums the hidden states' gradient over the group (a value head is replicated and whole on each rank).
"""

from __future__ import annotations

from typing import Any

import torch


class SequenceParallelRMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` (megatron-core's local norm, bit for bit) built from megatron-core's norm arguments, its
    weight marked ``sequence_parallel`` when the model is: its gradient is then summed over the tensor group by
    ``finalize_model_grads``."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **_: Any):
        super().__init__(normalized_shape=hidden_size, eps=eps)
        self.weight.sequence_parallel = bool(config.sequence_parallel)  # type: ignore[attr-defined]


def layer_spec(config: Any, pp_rank: int | None = None) -> Any:
    """The local layer spec of the HF decoder's layers (RMSNorm, q/k norms when ``config.qk_layernorm``): with
    ``config.sequence_parallel`` it is a block spec of this pipeline stage's layers whose norms (and final norm) are
    :class:`SequenceParallelRMSNorm`; without, megatron-core's local layer spec unchanged."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(qk_layernorm=config.qk_layernorm, normalization="RMSNorm")
    if not config.sequence_parallel:
        return spec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    _replace(spec, WrappedTorchNorm, SequenceParallelRMSNorm)
    layers = get_num_layers_to_build(config, vp_stage=None, pp_rank=pp_rank)
    return TransformerBlockSubmodules(layer_specs=[spec] * layers, layer_norm=SequenceParallelRMSNorm)


def _replace(spec: Any, old: type, new: type) -> None:
    """Every submodule class ``old`` of the spec tree ``spec`` (ModuleSpecs and their submodule dataclasses) made
    ``new``, in place."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    fields = getattr(spec, "__dataclass_fields__", None)
    if fields is None:
        return
    for name in fields:
        value = getattr(spec, name)
        if value is old:
            setattr(spec, name, new)
        elif isinstance(value, ModuleSpec) or hasattr(value, "__dataclass_fields__"):
            _replace(value, old, new)


def padded_length(length: int, tp: int) -> int:
    """The smallest multiple of ``tp`` that holds ``length`` positions."""
    return -(-length // tp) * tp


def pad_rows(input_ids: torch.Tensor, position_ids: torch.Tensor, tp: int,
             pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``input_ids`` and ``position_ids`` ``[b, s]`` padded on the right to :func:`padded_length` (the pad token,
    positions counting on)."""
    b, s = input_ids.shape
    extra = padded_length(s, tp) - s
    if not extra:
        return input_ids, position_ids
    ids = torch.cat([input_ids, input_ids.new_full((b, extra), pad_id)], dim=1)
    more = position_ids[:, -1:] + torch.arange(1, extra + 1, device=position_ids.device)
    return ids, torch.cat([position_ids, more], dim=1)


def gather_positions(out: torch.Tensor, group: Any, length: int) -> torch.Tensor:
    """``out`` ``[b, s / tp, ...]`` (this rank's slice of the positions, as ``GPTModel`` returns it) gathered over
    the tensor group to ``[b, length, ...]`` (the padding cut off); its gradient is split back, not summed (module
    docstring)."""
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

    whole = gather_from_sequence_parallel_region(out.transpose(0, 1).contiguous(), tensor_parallel_output_grad=False,
                                                 group=group)
    return whole.transpose(0, 1)[:, :length]


def embedding_slice(mask: torch.Tensor, out: torch.Tensor, embedding: Any) -> torch.Tensor:
    """``mask`` ``[b, s]`` of the input of ``embedding`` (megatron-core's ``VocabParallelEmbedding``), laid out as its
    output ``out``: ``[b, s, 1]`` when the lookup is whole, this rank's sequence slice ``[s / tp, b, 1]`` when the
    embedding reduce-scatters it (sequence parallelism)."""
    if not embedding.reduce_scatter_embeddings:
        return mask.unsqueeze(-1)
    rows = out.shape[0]
    start = embedding.tp_group.rank() * rows
    # contiguous: a transposed mask would give torch.where's output (and every activation after it) its layout
    return mask.t()[start:start + rows].contiguous().unsqueeze(-1)


__all__ = ["SequenceParallelRMSNorm", "embedding_slice", "gather_positions", "layer_spec", "pad_rows",
           "padded_length"]
