"""Generalised advantage estimation (GAE) per token, for algorithms with a critic (ppo). Pure torch.

One completion of T tokens is an episode: action t is completion token t, state s_t the prefix before
it, ``values[t] = V(s_t)`` the critic's estimate, and the episode ends after the last token
(``V(s_T) = 0``, whether the completion emitted eos or was cut at ``max_new_tokens``). With per-token
rewards r_t (the sequence reward on the last token, plus any per-token penalty)::

    delta_t = r_t + gamma * V(s_{t+1}) - V(s_t)
    A_t     = delta_t + gamma * lam * A_{t+1}          (A_T = 0)
    R_t     = A_t + V(s_t)                              (the critic's regression target)

The valid tokens of a row (``mask``) are the episode's steps in order: a right-padded row's prefix, or the model
tokens of a multi-turn trajectory, whose observation tokens between them are not steps (ARCHITECTURE §8). An
invalid position is skipped: the step before it sees the next *valid* token's value and advantage (zero after
the last one), it gets ``A = R = 0`` itself, and its reward is not used. Computed in float64.
"""

from __future__ import annotations

import torch


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
        lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(advantages, returns)``, each ``[n, T]`` float64, for right-padded rows (module docstring)."""
    if not (rewards.shape == values.shape == mask.shape) or rewards.dim() != 2:
        raise ValueError(f"gae needs rewards, values and mask of one [n, T] shape, got {tuple(rewards.shape)}, "
                         f"{tuple(values.shape)}, {tuple(mask.shape)}")
    r, v = rewards.to(torch.float64), values.to(torch.float64)
    valid = mask.bool()
    adv = torch.zeros_like(r)
    next_value = torch.zeros(r.shape[0], dtype=torch.float64)
    next_adv = torch.zeros_like(next_value)
    for t in range(r.shape[1] - 1, -1, -1):
        delta = r[:, t] + gamma * next_value - v[:, t]
        a = delta + gamma * lam * next_adv
        keep = valid[:, t]
        adv[:, t] = torch.where(keep, a, torch.zeros_like(a))
        next_value = torch.where(keep, v[:, t], next_value)  # skipped positions pass the next step through
        next_adv = torch.where(keep, a, next_adv)
    returns = torch.where(valid, adv + v, torch.zeros_like(adv))
    return adv, returns


def token_rewards(score: list[float], lengths: list[int], penalties: list[list[float]] | None = None,
                  ends: list[int] | None = None) -> torch.Tensor:
    """Per-token rewards ``[n, max(lengths)]``: ``score[i]`` on the last token of row i (or on position
    ``ends[i]``, e.g. a trajectory's last model token), plus ``penalties[i][t]`` on every token (e.g.
    ``-kl_coef * kl_t``); zero elsewhere. A row of length 0 stays all zero."""
    width = max(lengths, default=0)
    out = torch.zeros(len(lengths), max(width, 1), dtype=torch.float64)
    for i, n in enumerate(lengths):
        if penalties is not None and n:
            out[i, :n] = torch.tensor(penalties[i][:n], dtype=torch.float64)
        if n:
            out[i, n - 1 if ends is None else ends[i]] += score[i]
    return out


def whiten(values: torch.Tensor, mask: torch.Tensor, mean: float, std: float, eps: float = 1e-8) -> torch.Tensor:
    """``(values - mean) / (std + eps)`` on valid positions, 0 elsewhere (mean/std of the whole rollout)."""
    out = (values.to(torch.float64) - mean) / (std + eps)
    return torch.where(mask.bool(), out, torch.zeros_like(out))
