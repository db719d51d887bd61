"""megatron-core's sequence parallelism in the Megatron engine (``dsrl.engine.sequence_parallel``).

With it, the tensor-parallel group splits the positions of every activation outside the attention and MLP
blocks: the embedding's output is reduce-scattered along the sequence, each column-parallel linear all-gathers
its input and each row-parallel one reduce-scatters its output. The norms then see a ``1 / tp`` slice of the
positions, so their weights' gradients are partial sums that megatron-core's ``finalize_model_grads`` adds up over
the tensor group (for parameters marked ``sequence_parallel``).

What dsrl adds, and the invariants it keeps (tested against the float64 reference, tests/distributed/
test_megatron_check.py, and against the same run without it, tests/distributed/test_megatron_train.py):

- :class:`SequenceParallelNorm`: megatron-core's local spec builds torch's ``RMSNorm`` / ``LayerNorm`` and refuses
  sequence parallelism there (only Transformer Engine's and Apex's norms take it); this is the same norm, with its
  parameters marked so that their gradients are summed over the tensor group. :func:`sequence_parallel_spec` puts
  it in a local spec (the engine's, :func:`dsrl.backends.megatron.hf_weights.layer_spec`, or a user's own GPTModel in
  a loop of their own).
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


class SequenceParallelNorm:
    """megatron-core's local norm (``WrappedTorchNorm``: torch's ``LayerNorm`` or ``RMSNorm`` by
    ``config.normalization``, bit for bit) built from megatron-core's norm arguments, its parameters marked
    ``sequence_parallel`` when the model is: their gradients are then summed over the tensor group by
    ``finalize_model_grads``."""

    def __new__(cls, config: Any, hidden_size: int, eps: float = 1e-5, **_: Any) -> torch.nn.Module:
        kinds = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}
        if config.normalization not in kinds:
            raise ValueError(f"sequence parallelism with normalization = {config.normalization!r}: dsrl's local "
                             f"norm builds {' and '.join(kinds)}")
        norm = kinds[config.normalization](normalized_shape=hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = bool(config.sequence_parallel)
        return norm


def sequence_parallel_spec(spec: Any, config: Any, pp_rank: int | None = None) -> Any:
    """``spec`` (a layer spec of megatron-core's local modules, e.g. ``get_gpt_layer_local_spec()``) for a model of
    ``config``: with ``config.sequence_parallel``, a block spec of this pipeline stage's layers (``pp_rank``; None:
    the current one) whose norms and final norm are :class:`SequenceParallelNorm` (megatron-core's local norm refuses
    sequence parallelism); without, ``spec`` unchanged. Pass it to ``GPTModel(transformer_layer_spec=...)``."""
    if not config.sequence_parallel:
        return spec
    import copy

    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    spec = copy.deepcopy(spec)
    replace_modules(spec, WrappedTorchNorm, SequenceParallelNorm)
    if pp_rank is None and config.pipeline_model_parallel_size == 1:
        pp_rank = 0  # one stage: no parallel state needed to know which
    layers = get_num_layers_to_build(config, vp_stage=None, pp_rank=pp_rank)
    return TransformerBlockSubmodules(layer_specs=[spec] * layers, layer_norm=SequenceParallelNorm)


def replace_modules(spec: Any, old: type, new: type) -> None:
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
            replace_modules(value, old, new)


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


def gather_sequence(part: torch.Tensor, group: Any) -> torch.Tensor:
    """``part`` ``[s / tp, ...]`` (this rank's slice of the positions, sequence first) gathered over the tensor group
    to ``[s, ...]``; its gradient is split back, not summed (module docstring): what the head sees of every position
    on every rank, whether dsrl's face or the fused output layer of a user's loop runs it."""
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

    return gather_from_sequence_parallel_region(part, tensor_parallel_output_grad=False, group=group)


def gather_positions(out: torch.Tensor, group: Any, length: int) -> torch.Tensor:
    """``out`` ``[b, s / tp, ...]`` (this rank's slice of the positions, as ``GPTModel`` returns it) gathered over
    the tensor group to ``[b, length, ...]`` (the padding cut off) by :func:`gather_sequence`."""
    return gather_sequence(out.transpose(0, 1).contiguous(), group).transpose(0, 1)[:, :length]


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


__all__ = ["SequenceParallelNorm", "embedding_slice", "gather_positions", "gather_sequence", "pad_rows",
           "padded_length", "replace_modules", "sequence_parallel_spec"]
