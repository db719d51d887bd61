"""Context-parallel sharding of a micro-batch that keeps whole-sequence counts.

Megatron's context parallelism (``megatron.core.utils.get_batch_on_this_cp_rank``) cuts each
sequence into ``2 * cp`` equal chunks and gives CP rank r the chunks ``r`` and ``2*cp - 1 - r``
(load balance under causal attention). A CP rank then sees only part of every sequence, so a
per-sequence valid-token count n_s computed on the shard would be wrong for the seq-mean-* modes.

:func:`shard_for_context_parallel` cuts a micro-batch the same way *after* computing n_s on the whole
sequence and stores it as ``seq_valid_tokens`` (``[b]``), which :func:`dsrl.core.weights.sequence_valid_tokens`
prefers over the shard's own mask. Invariants:

- concatenating the shards of all CP ranks in rank order ``(r, 2cp-1-r)`` restores the sequence;
- the sum over CP ranks of each shard's valid tokens equals the whole sequence's n_s;
- ``seq_valid_tokens`` is identical on every CP rank and equals n_s of the unsharded sequence.

Pure torch: no megatron-core needed, so it is testable anywhere.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from dsrl.core.weights import sequence_valid_tokens

# Keys Megatron shards along dim 2 instead of 1 ([b, 1, s, s] masks).
_DIM2_KEYS = ("attention_mask",)


def cp_chunk_index(cp_size: int, cp_rank: int) -> tuple[int, int]:
    """The two of the ``2 * cp_size`` sequence chunks that CP rank ``cp_rank`` holds."""
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank {cp_rank} is outside [0, {cp_size})")
    return cp_rank, 2 * cp_size - 1 - cp_rank


def cut_along(value: torch.Tensor, dim: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """CP rank ``cp_rank``'s two chunks (:func:`cp_chunk_index`) of ``value`` along ``dim``, whose length is a
    multiple of ``2 * cp_size``; :func:`unshard_from_context_parallel` is its inverse."""
    s = value.shape[dim]
    view = value.reshape(*value.shape[:dim], 2 * cp_size, s // (2 * cp_size), *value.shape[dim + 1:])
    idx = torch.tensor(cp_chunk_index(cp_size, cp_rank), device=value.device)
    picked = view.index_select(dim, idx)
    return picked.reshape(*value.shape[:dim], -1, *value.shape[dim + 1:])


def _pad(value: torch.Tensor, dim: int, target: int) -> torch.Tensor:
    pad = target - value.shape[dim]
    if pad == 0:
        return value
    shape = list(value.shape)
    shape[dim] = pad
    return torch.cat([value, value.new_zeros(shape)], dim=dim)


def shard_for_context_parallel(
    micro: Mapping[str, Any],
    cp_size: int,
    cp_rank: int,
    *,
    seq_keys: Iterable[str] | None = None,
    pad: bool = False,
) -> dict[str, Any]:
    """This CP rank's shard of a whole-sequence micro-batch, carrying whole-sequence ``seq_valid_tokens``.

    ``seq_keys`` names the tensors to cut along the sequence dimension (dim 1; dim 2 for
    ``attention_mask``). By default every tensor whose dim 1 equals the length of ``loss_mask`` is
    cut, and others (per-sequence ``[b]`` values such as advantages) are copied unchanged.
    The sequence length must be a multiple of ``2 * cp_size``; with ``pad=True`` every cut tensor is
    right-padded with zeros (``loss_mask`` 0, so padded positions never count).
    """
    if "loss_mask" not in micro:
        raise KeyError("the micro-batch needs a 'loss_mask' [b, t] to be sharded for context parallelism")
    out = dict(micro)
    if "seq_valid_tokens" not in out:
        out["seq_valid_tokens"] = sequence_valid_tokens(micro).to(torch.int64)
    if cp_size == 1:
        return out
    seq_len = micro["loss_mask"].shape[1]
    if seq_keys is None:
        keys = [k for k, v in micro.items() if torch.is_tensor(v) and v.dim() >= 2 and k != "seq_valid_tokens"
                and v.shape[2 if k in _DIM2_KEYS else 1] == seq_len]
    else:
        keys = list(seq_keys)
    multiple = 2 * cp_size
    target = -(-seq_len // multiple) * multiple
    if target != seq_len and not pad:
        raise ValueError(
            f"context parallelism with cp={cp_size} cuts sequences into {multiple} equal chunks, but the "
            f"micro-batch has length {seq_len}; pad it to a multiple of {multiple} (pad=True does this with "
            f"loss_mask 0)"
        )
    for key in keys:
        value = micro[key]
        dim = 2 if key in _DIM2_KEYS else 1
        if dim == 2 and target != seq_len:
            value = _pad(value, 3, target) if value.dim() > 3 else value
        out[key] = cut_along(_pad(value, dim, target), dim, cp_size, cp_rank)
    return out


def unshard_from_context_parallel(shards: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """Inverse of the cut for one tensor, given every CP rank's shard in CP-rank order (for tests/logging)."""
    cp = len(shards)
    chunks: list[torch.Tensor | None] = [None] * (2 * cp)
    for r, shard in enumerate(shards):
        a, b = torch.chunk(shard, 2, dim=dim)
        first, second = cp_chunk_index(cp, r)
        chunks[first], chunks[second] = a, b
    return torch.cat([c for c in chunks if c is not None], dim=dim)
