"""Loss aggregation as per-token weights from global counts, policy-gradient losses, KL estimators.

The invariant (architecture §2): for a mini-batch M, every aggregation mode is a weighted token sum

    L_M = sum_{t in M} w_t * l_t

with weights that depend only on *global* counts of M (and, for seq-mean-token-mean, on the
whole sequence's valid-token count n_s), never on how M is split into micro-batches or ranks:

    token-mean               w_t = 1 / N_M
    seq-mean-token-mean      w_t = 1 / (S_M * n_s)
    seq-mean-token-sum       w_t = 1 / S_M
    seq-mean-token-sum-norm  w_t = 1 / (B * L_norm)      (Dr. GRPO; constant)

N_M = valid tokens of M, S_M = sequences of M with at least one valid token. Masked tokens always
get weight 0, and a mini-batch with no valid tokens gives all-zero weights (never 0/0).

Nothing here knows about DeepSpeed, Megatron or torch.distributed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

# The mode names have one source (dsrl.names), shared with the config models and the docs.
from dsrl.names import LOSS_AGG_MODES as MODES
from dsrl.names import SEQ_MEAN_TOKEN_MEAN, SEQ_MEAN_TOKEN_SUM, SEQ_MEAN_TOKEN_SUM_NORM, TOKEN_MEAN


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
    (several sequences in one row, see :func:`dsrl.batching.collate_packed`) carries each token's
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
    mode: str,
    micro: dict,
    counts: GlobalCounts,
    *,
    mini_batch_size: int | None = None,
    norm_length: int | None = None,
) -> torch.Tensor:
    """Per-token weights w_t ``[b, t]`` (float64) of one micro-batch under ``mode``."""
    mask = valid_mask(micro["loss_mask"])
    w = mask.to(torch.float64)
    if mode == TOKEN_MEAN:
        return w / max(counts.tokens, 1)
    if mode == SEQ_MEAN_TOKEN_MEAN:
        n_s = _per_token(sequence_valid_tokens(micro)).clamp(min=1).to(w.device)
        return w / n_s / max(counts.sequences, 1)
    if mode == SEQ_MEAN_TOKEN_SUM:
        return w / max(counts.sequences, 1)
    if mode == SEQ_MEAN_TOKEN_SUM_NORM:
        if not mini_batch_size or not norm_length:
            raise ValueError(
                "seq-mean-token-sum-norm needs mini_batch_size (B) and norm_length (L_norm): "
                "set dsrl.batch.loss_agg_norm_length or dsrl.rollout.max_new_tokens"
            )
        return w / (mini_batch_size * norm_length)
    raise ValueError(f"loss_agg {mode!r} is not one of {MODES}")


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


# --------------------------------------------------------------------------------------------
# Policy-gradient loss and KL estimators (per token; aggregation is applied by the engine)
# --------------------------------------------------------------------------------------------


def clipped_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    clip_low: float,
    clip_high: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate with separate low/high clip (DAPO clip-higher), per token.

    Returns the per-token loss ``-min(r*A, clip(r, 1-clip_low, 1+clip_high)*A)`` and per-token
    indicators: ``clip_low_frac`` (ratio clipped at the low bound and the clip is active, A<0)
    and ``clip_high_frac`` (clipped at the high bound, A>0), and ``ratio``.
    ``advantages`` may be ``[b]`` (per sequence) or ``[b, t]``.
    """
    return _clipped_surrogate(logprobs - old_logprobs, advantages, clip_low, clip_high)


def _clipped_surrogate(log_ratio: torch.Tensor, advantages: torch.Tensor, clip_low: float,
                       clip_high: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``-min(r A, clip(r) A)`` per position from log-ratios ``[b, t]`` (clamped to +-20 before exp), with the
    clip indicators; ``advantages`` ``[b]`` or ``[b, t]``."""
    if advantages.dim() == log_ratio.dim() - 1:
        advantages = advantages.unsqueeze(-1)
    ratio = torch.exp(log_ratio.clamp(-20.0, 20.0))
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high) * advantages
    loss = -torch.minimum(unclipped, clipped)
    with torch.no_grad():
        low = ((ratio < 1.0 - clip_low) & (advantages < 0)).to(log_ratio.dtype)
        high = ((ratio > 1.0 + clip_high) & (advantages > 0)).to(log_ratio.dtype)
    return loss, {"clip_low_frac": low, "clip_high_frac": high, "ratio": ratio.detach()}


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi (Schulman's k1/k2/k3).

    k1 = log r, k2 = (log r)^2 / 2, k3 = exp(-log r) - 1 + log r, with log r = logp - logp_ref.
    k3 is unbiased and non-negative; k1 is unbiased but noisy; k2 is biased, low variance.
    """
    log_r = (logprobs - ref_logprobs).clamp(-20.0, 20.0)
    if estimator == "k1":
        return log_r
    if estimator == "k2":
        return 0.5 * log_r.square()
    if estimator == "k3":
        return torch.exp(-log_r) - 1.0 + log_r
    raise ValueError(f"kl_estimator {estimator!r} must be k1, k2 or k3")


# fp32 working set of one chunk in the no-autograd log-prob / entropy paths (old/ref log-probs, the
# entropy metric): rows are processed in chunks of at most this many bytes of fp32 logits.
LOGIT_CHUNK_BYTES = 1 << 28


def _scaled(x: torch.Tensor, temperature: float) -> torch.Tensor:
    x = x.float()
    return x / temperature if temperature != 1.0 else x


def _rows_per_chunk(vocab: int) -> int:
    """Rows of ``vocab`` logits whose float32 copy fits in ``LOGIT_CHUNK_BYTES`` (at least one)."""
    return max(1, LOGIT_CHUNK_BYTES // (4 * vocab))


def _per_row_chunked(logits: torch.Tensor, fn, *extra: torch.Tensor) -> torch.Tensor:
    """``fn(logit_rows, *extra_rows) -> [rows]`` over row chunks of ``logits`` ``[..., V]``: a float32
    ``[...]`` result without ever holding a float32 copy of all of ``logits`` (no autograd)."""
    vocab = logits.shape[-1]
    flat = logits.reshape(-1, vocab)
    flat_extra = [e.reshape(-1) for e in extra]
    out = torch.empty(flat.shape[0], dtype=torch.float32, device=logits.device)
    step = _rows_per_chunk(vocab)
    with torch.no_grad():
        for i in range(0, flat.shape[0], step):
            out[i:i + step] = fn(flat[i:i + step], *(e[i:i + step] for e in flat_extra))
    return out.reshape(logits.shape[:-1])


def _target_logprob(x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(x, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def _chunked_target_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    """log pi(target) per row chunk, no autograd: the one computation behind both paths of
    :func:`token_logprobs` (so their values agree bit for bit)."""
    return _per_row_chunked(logits, lambda x, t: _target_logprob(_scaled(x, temperature), t), targets)


class _ChunkedTargetLogprob(torch.autograd.Function):
    """log pi(target) with autograd, never holding a float32 ``[b, t, V]``: the forward runs the no-autograd
    path's per-chunk log-softmax (so its values are those of :func:`_per_row_chunked`, bit for bit) and
    saves only the logits it was given; the backward recomputes each chunk's softmax and writes
    d logp / d logits = (onehot(target) - softmax(x / T)) / T, chunk by chunk, in the logits' dtype."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
        ctx.save_for_backward(logits, targets)
        ctx.temperature = temperature
        return _chunked_target_logprobs(logits, targets, temperature)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        logits, targets = ctx.saved_tensors
        vocab, temperature = logits.shape[-1], ctx.temperature
        flat, flat_t, flat_g = logits.reshape(-1, vocab), targets.reshape(-1), grad_out.reshape(-1).float()
        grad = torch.empty_like(flat)
        step = _rows_per_chunk(vocab)
        for i in range(0, flat.shape[0], step):
            g = flat_g[i:i + step, None]
            d = torch.softmax(_scaled(flat[i:i + step], temperature), dim=-1).mul_(-g)
            d.scatter_add_(-1, flat_t[i:i + step, None], g)
            grad[i:i + step] = d.div_(temperature) if temperature != 1.0 else d
        return grad.reshape(logits.shape), None, None


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log pi(target_t | prefix) for every position, ``[b, t]``, in float32 (a log-softmax per row).

    The rows go through in chunks of ``LOGIT_CHUNK_BYTES`` of float32, so no float32 copy of all the
    logits exists, with autograd too (:class:`_ChunkedTargetLogprob`: the gradient is recomputed per
    chunk instead of being kept as a float32 ``[b, t, V]`` log-softmax). The values with and without
    autograd are the same per-row operations, bit for bit (tests/unit/test_logprob_chunks.py), so the
    first step's importance ratios are exactly 1.
    """
    if torch.is_grad_enabled() and logits.requires_grad:
        return _ChunkedTargetLogprob.apply(logits, targets, temperature)
    return _chunked_target_logprobs(logits, targets, temperature)


def _entropy(x: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(x, dim=-1)
    return -(logp.exp() * logp).sum(-1)


def token_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of the policy at every position, ``[b, t]`` (float32); without autograd (the entropy
    metric) in row chunks, as :func:`token_logprobs`."""
    if torch.is_grad_enabled() and logits.requires_grad:
        return _entropy(_scaled(logits, temperature))
    return _per_row_chunked(logits, lambda x: _entropy(_scaled(x, temperature)))


def sequence_index(loss_mask: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Which sequence of its row every position belongs to, ``[b, t]`` (long, 0-based).

    A padded row holds one sequence (all 0). A packed row (:func:`dsrl.batching.collate_packed`)
    holds several whose ``position_ids`` restart at 0: a position starts a new sequence there.
    """
    if position_ids is None:
        return torch.zeros_like(loss_mask, dtype=torch.long)
    starts = (position_ids.to(loss_mask.device) == 0).long()
    starts[..., 0] = 1
    return (starts.cumsum(-1) - 1).expand_as(loss_mask)


def sequence_mean(values: torch.Tensor, mask: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """For every position, the mean of ``values`` over the valid tokens of its sequence, ``[b, t]``.

    Sequences are the runs of equal ``index`` within a row (:func:`sequence_index`). Masked positions
    are selected away (a NaN there never reaches the mean); a sequence without valid tokens gets 0.
    The result keeps the graph: every valid token's value contributes 1/n_s to its sequence's mean.
    """
    valid = valid_mask(mask)
    b, t = values.shape
    index = index.to(values.device)
    key = (torch.arange(b, device=values.device).unsqueeze(-1) * t + index).reshape(-1)
    picked = torch.where(valid, values, torch.zeros_like(values)).reshape(-1)
    sums = torch.zeros(b * t, dtype=values.dtype, device=values.device).index_add(0, key, picked)
    ones = valid.reshape(-1).to(values.dtype)
    counts = torch.zeros(b * t, dtype=values.dtype, device=values.device).index_add(0, key, ones)
    mean = sums / counts.clamp(min=1)
    return mean[key].reshape(b, t)


def sequence_clipped_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float,
    clip_high: float,
    index: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO: the clipped surrogate on the length-normalised *sequence* likelihood ratio, per token.

    For sequence i with valid tokens T_i: ``s_i = exp(mean_{t in T_i} (log pi(y_t) - log pi_old(y_t)))``,
    ``l_i = -min(s_i A_i, clip(s_i, 1 - clip_low, 1 + clip_high) A_i)``. Every valid token of the
    sequence carries l_i, so ``seq-mean-token-mean`` aggregation (w_t = 1/(S_M n_s)) gives exactly
    ``mean_i l_i`` over the mini-batch's non-empty sequences, and the gradient flows into every token's
    log-prob through the mean. Metrics are per token: each token carries its sequence's clip indicator.
    ``index`` (:func:`sequence_index`) separates the sequences of packed rows; None = one per row. The
    mean needs the whole sequence on this rank: not for sequence/context-parallel shards.
    """
    if index is None:
        index = torch.zeros_like(logprobs, dtype=torch.long)
    return _clipped_surrogate(sequence_mean(logprobs - old_logprobs, mask, index), advantages, clip_low, clip_high)


def clipped_value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, clip: float | None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The critic's per-token loss: ``0.5 * max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2)``.

    V are the critic's new values, V_old the values of the rollout (computed before any update), R the
    GAE returns. ``clip = None`` gives the plain ``0.5 * (V - R)^2``. Aggregated by the step core like
    any per-token loss (the critic uses ``token-mean``). Metric ``vf_clip_frac``: tokens where the
    clipped term is the larger one (the clip is active).
    """
    values = values.float()
    err = (values - returns).square()
    if clip is None:
        return 0.5 * err, {"vf_clip_frac": torch.zeros_like(err)}
    moved = old_values + (values - old_values).clamp(-clip, clip)
    err_clipped = (moved - returns).square()
    with torch.no_grad():
        active = (err_clipped > err).to(err.dtype)
    return 0.5 * torch.maximum(err, err_clipped), {"vf_clip_frac": active}
