"""Per-token objectives: the PPO clipped surrogate (token and sequence level), KL estimators, the
critic's clipped value loss. Aggregation over tokens is never done here: the step applies the weights of
:mod:`dsrl.core.weights` to what these functions return."""

from __future__ import annotations

import torch

from dsrl.core.weights import valid_mask


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


def sequence_index(loss_mask: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Which sequence of its row every position belongs to, ``[b, t]`` (long, 0-based).

    A padded row holds one sequence (all 0). A packed row (:func:`dsrl.rl.data.batching.collate_packed`)
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
