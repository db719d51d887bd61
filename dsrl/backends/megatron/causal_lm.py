"""A megatron-core ``GPTModel`` chunk with a Hugging Face causal LM's face, so that the application's forwards run on it
unchanged (:class:`GPTCausalLM`), and a value model's chunk with a token classifier's face (:class:`GPTValueModel`, the
critic's).

The application computes log-probs with :func:`dsrl.rl.policy.logprobs.forward_logprobs`: it calls a model as
``model(input_ids=, attention_mask=, position_ids=, use_cache=False)``, finds its output head through
``get_output_embeddings()`` and replaces that head's forward, for one call, by the tiled log-softmax of
:mod:`dsrl.core.logprobs`. :class:`GPTCausalLM` gives a ``GPTModel`` (wrapped in megatron-core's DDP) that face:

- its forward runs the wrapped chunk with the output layer passed through (the chunk returns its final hidden
  states ``[b, s, H]``) and then calls :class:`VocabParallelHead` on them, whose weight is this tensor-parallel
  rank's vocabulary shard (the embedding's, when the head is tied) and which is declared as that shard
  (:func:`dsrl.core.logprobs.declare_vocab_shard`): the fused log-probs combine the shards over the tensor group
  and all-reduce the hidden states' gradient, as Megatron's column-parallel output layer does;
- on a pipeline stage without the output layer the forward returns the stage's output ``[s, b, H]`` for the next
  stage (what Megatron's schedules send), and the head is None.

A lookup of the HF config's ``pad_token_id`` passes no gradient to its embedding row, as the HF model's
``nn.Embedding(padding_idx=...)`` does.

Invariants: the rows are right-padded with positions ``0 .. s-1`` (dsrl's collate), so the causal mask alone is
the attention mask and rotary positions are the sequence index; packed rows and prompt-shared rows (no
``attention_mask``, or a 4-D one) are refused. Under sequence parallelism the rows are padded to a multiple of the
tensor-parallel size and the last stage's output is gathered along the sequence before the head (every rank of the
group then runs the head on every position, as without it: :mod:`dsrl.backends.megatron.sequence_parallel`); under
context parallelism each rank runs its two chunks of every row and the output is gathered over the context group the
same way (:mod:`dsrl.backends.megatron.context_parallel`). The head's own forward (the logits path) gathers the full
vocabulary.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from dsrl.core.logprobs import VocabShard, declare_vocab_shard


class VocabParallelHead(torch.nn.Module):
    """The output head of a ``GPTModel`` as a module of its own: ``weight`` is this rank's vocabulary shard of the
    output layer (the word embeddings' when tied), ``bias`` None; ``forward(hidden[b, s, H])`` gives the full
    logits ``[b, s, V]``. Holds no parameters of its own (the model's are not registered twice)."""

    def __init__(self, gpt: Any):
        super().__init__()
        object.__setattr__(self, "_gpt", gpt)  # not a submodule: the model's parameters stay listed once
        self.bias = None

    @property
    def weight(self) -> torch.Tensor:
        """This rank's vocabulary shard; under context parallelism its gradient counted on one context rank (the
        head runs on the whole rows on each: :func:`dsrl.backends.megatron.context_parallel.counted_once`)."""
        gpt = self._gpt
        weight = (gpt.shared_embedding_or_output_weight() if gpt.share_embeddings_and_output_weights
                  else gpt.output_layer.weight)
        if gpt.config.context_parallel_size == 1:
            return weight
        from megatron.core import parallel_state as ps

        from dsrl.backends.megatron.context_parallel import counted_once

        return counted_once(weight, ps.get_context_parallel_group())

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel.mappings import (
            copy_to_tensor_model_parallel_region,
            gather_from_tensor_model_parallel_region,
        )

        group = self._gpt.output_layer.tp_group
        local = torch.nn.functional.linear(copy_to_tensor_model_parallel_region(hidden, group=group), self.weight)
        return gather_from_tensor_model_parallel_region(local, group=group) if group.size() > 1 else local


class _ChunkFace(torch.nn.Module):
    """What both faces of a ``GPTModel`` chunk share: the chunk and its HF ``config``, the unwrapped ``gpt`` (not a
    submodule: its parameters stay listed once), the pad row's lookup without gradient on the first stage, whether
    this stage is the last, and the rows it runs (right-padded with a ``[b, s]`` attention mask, positions
    ``0 .. s-1`` by default)."""

    def __init__(self, chunk: Any, config: Any):
        super().__init__()
        from megatron.core.utils import unwrap_model

        self.chunk = chunk
        self.config = config
        gpt = unwrap_model(chunk)
        object.__setattr__(self, "gpt", gpt)
        # sequence parallelism: the tensor group splits the positions (dsrl.backends.megatron.sequence_parallel)
        from megatron.core import parallel_state as ps

        self.split_group = ps.get_tensor_model_parallel_group() if gpt.config.sequence_parallel else None
        # context parallelism: the context group splits every row (dsrl.backends.megatron.context_parallel)
        self.context_group = ps.get_context_parallel_group() if gpt.config.context_parallel_size > 1 else None
        pad = getattr(config, "pad_token_id", None)
        self.pad_id = int(pad) if pad is not None else 0
        if gpt.pre_process and pad is not None:
            _padding_row_without_lookup_gradient(gpt.embedding.word_embeddings, int(pad))

    @property
    def post_process(self) -> bool:
        """Whether this pipeline stage holds the output head (the last stage)."""
        return bool(self.gpt.post_process)

    def _rows(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
              position_ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows the chunk runs and their positions, after refusing rows that are not right-padded ``[b, s]``
        ones; under sequence parallelism padded on the right to a multiple of the tensor-parallel size; under context
        parallelism to a multiple of ``2 cp`` (times that size), and cut to this context rank's two chunks."""
        if attention_mask is None or attention_mask.dim() != 2:
            raise ValueError("the Megatron engine runs right-padded rows with a [b, s] attention_mask; packed rows "
                             "and prompt-shared rows are not supported on it. Fix: set dsrl.model.packing = false "
                             "and dsrl.model.share_prompts = false.")
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        tp_split = self.split_group.size() if self.split_group is not None else 1
        cp = self.context_group.size() if self.context_group is not None else 1
        if tp_split == 1 and cp == 1:
            return input_ids, position_ids
        from dsrl.backends.megatron.context_parallel import rows_multiple
        from dsrl.backends.megatron.cp import cut_along
        from dsrl.backends.megatron.sequence_parallel import pad_rows

        input_ids, position_ids = pad_rows(input_ids, position_ids, rows_multiple(cp, tp_split), self.pad_id)
        if cp == 1:
            return input_ids, position_ids
        rank = self.context_group.rank()
        return cut_along(input_ids, 1, cp, rank), cut_along(position_ids, 1, cp, rank)

    def _whole(self, out: torch.Tensor, length: int) -> torch.Tensor:
        """The last stage's output ``[b, s, ...]`` of the ``length`` real positions: gathered over the tensor group
        under sequence parallelism (:func:`dsrl.backends.megatron.sequence_parallel.gather_positions`), then over
        the context group under context parallelism (:func:`dsrl.backends.megatron.context_parallel.gather_rows`)."""
        if self.split_group is not None:
            from dsrl.backends.megatron.sequence_parallel import gather_positions

            whole_tp = out.shape[1] * self.split_group.size()
            out = gather_positions(out, self.split_group, length if self.context_group is None else whole_tp)
        if self.context_group is not None:
            from dsrl.backends.megatron.context_parallel import gather_rows

            out = gather_rows(out, self.context_group, length)
        return out


class GPTCausalLM(_ChunkFace):
    """``chunk`` (a ``GPTModel`` wrapped in megatron-core's DDP) as a Hugging Face causal LM (module docstring).
    ``config`` is the HF model's config (the fused log-probs read its logit post-processing fields)."""

    def __init__(self, chunk: Any, config: Any):
        super().__init__(chunk, config)
        gpt = self.gpt
        head = VocabParallelHead(gpt) if gpt.post_process else None
        object.__setattr__(self, "head", head)
        if head is not None:
            group = gpt.output_layer.tp_group
            rows = gpt.output_layer.output_size_per_partition
            declare_vocab_shard(head, VocabShard(group if group.size() > 1 else None, group.rank() * rows, rows))

    def get_output_embeddings(self) -> VocabParallelHead | None:
        return self.head

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, use_cache: bool = False) -> torch.Tensor:
        """The head's output ``[b, s, ...]`` (logits, or what the fused log-probs put in their place) on the last
        stage; the stage's output hidden states ``[s, b, H]`` on an earlier one."""
        length = input_ids.shape[1]
        input_ids, position_ids = self._rows(input_ids, attention_mask, position_ids)
        if self.head is None:
            return self.chunk(input_ids=input_ids, position_ids=position_ids, attention_mask=None)
        with _output_layer_passed_through(self.gpt):
            hidden = self.chunk(input_ids=input_ids, position_ids=position_ids, attention_mask=None)
        # mixed precision: megatron-core's Float16Module hands the last stage's output back in fp32; the head takes
        # it in the weights' dtype, as megatron-core's own output layer would (a lossless round trip)
        return self.head(self._whole(hidden, length).to(self.gpt.config.params_dtype))


class GPTValueModel(_ChunkFace):
    """``chunk`` (a value model's ``GPTModel``, :func:`dsrl.backends.megatron.hf_weights.build_gpt_model` with
    ``value_head``, wrapped in megatron-core's DDP) as a Hugging Face ``AutoModelForTokenClassification`` with one
    label, the face :func:`dsrl.rl.critic.forward_values` calls: on the last stage the output's ``logits`` are the
    values ``[b, s, 1]``; an earlier stage returns its output ``[s, b, H]`` for the next, as :class:`GPTCausalLM`
    does."""

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, use_cache: bool = False) -> Any:
        from transformers.modeling_outputs import TokenClassifierOutput

        length = input_ids.shape[1]
        input_ids, position_ids = self._rows(input_ids, attention_mask, position_ids)
        out = self.chunk(input_ids=input_ids, position_ids=position_ids, attention_mask=None)
        return TokenClassifierOutput(logits=self._whole(out, length)) if self.post_process else out


def _padding_row_without_lookup_gradient(embedding: torch.nn.Module, pad_id: int) -> None:
    """Make ``embedding`` (megatron-core's vocabulary-parallel word embedding) treat ``pad_id`` as a Hugging Face
    ``nn.Embedding(padding_idx=pad_id)`` does: a lookup of it passes no gradient to its row (a tied head still trains
    the row through the logits). Without this the two engines differ wherever the pad token is an input (SmolLM2's pad
    is its end-of-turn token, inside every chat prompt)."""
    from dsrl.backends.megatron.sequence_parallel import embedding_slice

    lookup = embedding.forward

    def forward(input_: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        out = lookup(input_, *args, **kwargs)  # [b, s, H], or [s / tp, b, H] reduce-scattered (sequence parallel)
        return torch.where(embedding_slice(input_ != pad_id, out, embedding), out, out.detach())

    embedding.forward = forward


@contextlib.contextmanager
def _output_layer_passed_through(gpt: Any) -> Iterator[None]:
    """Inside the block the model's output layer returns its input unchanged, so the model returns its final hidden
    states ``[b, s, H]`` in the place of its logits (``GPTModel`` transposes them, called without labels)."""
    layer = gpt.output_layer
    layer.forward = _identity
    try:
        yield
    finally:
        del layer.forward


def _identity(hidden: torch.Tensor, weight: torch.Tensor | None = None,
              runtime_gather_output: bool | None = None) -> tuple[torch.Tensor, None]:
    return hidden, None
