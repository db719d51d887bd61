"""Loss aggregation as per-token weights from global counts (architecture §2).

The invariant: for a mini-batch M, every aggregation mode (``loss_agg``) is a weighted token sum

    L_M = sum_{t in M} w_t * l_t

with weights that depend only on *global* counts of M (and, for seq-mean-token-mean, on the
whole sequence's valid-token count n_s), never on how M is split into micro-batches or ranks:

    token-mean               w_t = 1 / N_M
    seq-mean-token-mean      w_t = 1 / (S_M * n_s)
    seq-mean-token-sum       w_t = 1 / S_M
    seq-mean-token-sum-norm  w_t = 1 / (B * L_norm)      (Dr. GRPO; constant, L_norm = loss_agg_norm_length)

N_M = valid tokens of M, S_M = sequences of M with at least one valid token. Masked tokens always
get weight 0, and a mini-batch with no valid tokens gives all-zero weights (never 0/0).

Nothing here knows about DeepSpeed, Megatron or torch.distributed. The mode names are declared once,
in :mod:`dsrl.config.names`, and validated once, by the config models.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from dsrl.config.names import (
    LOSS_AGG_MODES,
    SEQ_MEAN_TOKEN_MEAN,
    SEQ_MEAN_TOKEN_SUM,
    SEQ_MEAN_TOKEN_SUM_NORM,
    TOKEN_MEAN,
)


@dataclass(frozen=True)
class GlobalCounts:
    """Counts of one whole mini-batch, summed over every token-owning rank and micro-batch."""

    tokens: int  # N_M
    sequences: int  # S_M (sequences with >= 1 valid token)


def valid_mask(loss_mask: torch.Tensor) -> torch.Tensor:
    """Boolean view of a loss mask (1 = token counted)."""
    return loss_mask if loss_mask.dtype == torch.bool else loss_mask != 0


def sequence_valid_tokens(micro: dict) -> torch.Tensor:
    """n_s per sequence of a micro-batch, ``[b]`` -- or per token, ``[b, t]``, for packed rows.

    Uses ``micro["seq_valid_tokens"]`` when present: under sequence/context parallelism a rank
    holds only a shard of each sequence, and n_s must be the *whole* sequence's count; a packed row
    (several sequences in one row, see :func:`dsrl.rl.data.batching.collate_packed`) carries each token's
    own sequence count ``[b, t]``.
    """
    if "seq_valid_tokens" in micro:
        return micro["seq_valid_tokens"].to(torch.float64)
    return valid_mask(micro["loss_mask"]).sum(-1, dtype=torch.float64)


def _per_token(n_s: torch.Tensor) -> torch.Tensor:
    """n_s broadcast to tokens: ``[b]`` (one sequence per row) -> ``[b, 1]``; ``[b, t]`` (packed) as is."""
    return n_s.unsqueeze(-1) if n_s.dim() == 1 else n_s


def local_counts(micro: dict, owns_sequences: bool = True) -> tuple[int, int]:
    """(valid tokens, non-empty sequences) held by this rank for one micro-batch.

    ``owns_sequences`` is False on ranks that see a shard of sequences that another rank of the
    same token-owning group also counts (e.g. non-zero sequence-parallel ranks), so that every
    sequence is counted exactly once.
    """
    tokens = int(valid_mask(micro["loss_mask"]).sum())
    if not owns_sequences:
        seqs = 0
    elif "num_sequences" in micro:  # packed rows: the collator counted the non-empty sequences
        seqs = int(micro["num_sequences"].sum())
    else:
        seqs = int((sequence_valid_tokens(micro) > 0).sum())
    return tokens, seqs


def check_micro_batch(micro: Any, i: int) -> None:
    """A micro-batch is a mapping holding a 2-D ``loss_mask`` [b, t]; anything else is a TypeError."""
    if not isinstance(micro, Mapping) or "loss_mask" not in micro:
        raise TypeError(
            f"micro-batch {i} must be a mapping of tensors with a 'loss_mask' [b, t] entry "
            f"(1 = token counted); got {type(micro).__name__} with keys "
            f"{list(micro)[:8] if isinstance(micro, Mapping) else '-'}"
        )
    mask = micro["loss_mask"]
    if not torch.is_tensor(mask) or mask.dim() != 2:
        raise TypeError(
            f"micro-batch {i}: loss_mask must be a 2-D tensor [b, t], got {getattr(mask, 'shape', mask)!r}"
        )


def zero_weight_micro_batch(micro: Mapping[str, Any], one_row: bool = False) -> dict[str, Any]:
    """A copy of ``micro`` whose every token weighs 0 and that counts no token or sequence.

    It runs the same forward/backward graph (so collectives inside it match) and contributes an
    exactly zero gradient. ``one_row`` keeps only the first row (cheapest; DeepSpeed fillers);
    without it the shapes stay equal (Megatron pipeline P2P needs that).
    """
    out = {k: (v[:1] if one_row and torch.is_tensor(v) and v.dim() > 0 else v) for k, v in micro.items()}
    for key in ("loss_mask", "seq_valid_tokens", "num_sequences"):
        if key in out:
            out[key] = torch.zeros_like(out[key])
    return out


def token_weights(
    loss_agg: str,
    micro: dict,
    counts: GlobalCounts,
    *,
    mini_batch_size: int | None = None,
    loss_agg_norm_length: int | None = None,
) -> torch.Tensor:
    """Per-token weights w_t ``[b, t]`` (float64) of one micro-batch under ``loss_agg`` (one of
    :data:`dsrl.config.names.LOSS_AGG_MODES`, validated by the config)."""
    mask = valid_mask(micro["loss_mask"])
    w = mask.to(torch.float64)
    if loss_agg == TOKEN_MEAN:
        return w / max(counts.tokens, 1)
    if loss_agg == SEQ_MEAN_TOKEN_MEAN:
        n_s = _per_token(sequence_valid_tokens(micro)).clamp(min=1).to(w.device)
        return w / n_s / max(counts.sequences, 1)
    if loss_agg == SEQ_MEAN_TOKEN_SUM:
        return w / max(counts.sequences, 1)
    if loss_agg == SEQ_MEAN_TOKEN_SUM_NORM:
        if not mini_batch_size or not loss_agg_norm_length:
            raise ValueError(
                "seq-mean-token-sum-norm needs mini_batch_size (B) and loss_agg_norm_length (L_norm): "
                "set dsrl.batch.loss_agg_norm_length or dsrl.rollout.max_new_tokens"
            )
        return w / (mini_batch_size * loss_agg_norm_length)
    raise ValueError(f"loss_agg {loss_agg!r} is not one of {LOSS_AGG_MODES}")


def weighted_sum(per_token: torch.Tensor, weights: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """sum_t w_t * l_t over valid tokens, in the loss's dtype.

    Masked positions are *selected away* (not multiplied by 0), so a NaN/inf in a padded
    position (e.g. a log-prob of a pad token) can never reach the loss or the gradient.
    """
    mask = valid_mask(mask)
    contrib = per_token * weights.to(per_token.dtype)
    return torch.where(mask, contrib, torch.zeros_like(contrib)).sum()


def masked_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """sum of values over valid tokens (masked positions selected away, never multiplied)."""
    mask = valid_mask(mask)
    return torch.where(mask, values, torch.zeros_like(values)).sum()


