"""Sample filters and reward shaping from DAPO: dynamic sampling and overlong handling.

- Dynamic sampling drops prompt groups whose rewards carry no signal (all equal), then refills the
  rollout with freshly generated groups (the trainer owns the refill loop).
- Soft overlong punishment adds a length-dependent penalty to the reward of long completions.
- The overlong filter masks out truncated completions (those that hit ``max_new_tokens`` without
  emitting eos): their loss mask is zeroed, but their rewards still enter the group statistics.
"""

from __future__ import annotations

import torch

from dsrl.algos.advantages import group_statistics


def zero_variance_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Boolean ``[P]``: True for groups whose finite rewards are all equal (no learning signal).

    Groups with fewer than two finite rewards count as zero-variance too (every advantage in them
    is 0). DAPO's dynamic sampling keeps only groups where this is False.
    """
    return group_statistics(rewards, group_size)["constant"]


def overlong_shaping(
    lengths: torch.Tensor, max_new_tokens: int, buffer: int, penalty: float = 1.0
) -> torch.Tensor:
    """DAPO soft overlong punishment, added to the reward; float32 ``lengths.shape``.

    With L = completion length in tokens (as counted against ``max_new_tokens``), L_max =
    ``max_new_tokens`` and L_buf = ``buffer``::

        0                                  if L <= L_max - L_buf
        -penalty * (L - (L_max - L_buf)) / L_buf    if L_max - L_buf < L <= L_max   (linear to -penalty)
        -penalty                           if L > L_max

    ``buffer = 0`` disables the shaping (all zeros).
    """
    if buffer < 0 or buffer > max_new_tokens:
        raise ValueError(
            f"dsrl.algorithm.overlong_buffer = {buffer} must be in [0, rollout.max_new_tokens = {max_new_tokens}]"
        )
    lengths = lengths.to(torch.float64)
    if buffer == 0:
        return torch.zeros_like(lengths, dtype=torch.float32)
    start = max_new_tokens - buffer
    over = (lengths - start).clamp(min=0.0, max=float(buffer))
    return (-penalty * over / buffer + 0.0).to(torch.float32)  # + 0.0 turns -0.0 into 0.0


def truncated(lengths: torch.Tensor, max_new_tokens: int, eos_emitted: torch.Tensor | None = None) -> torch.Tensor:
    """Boolean mask of completions cut off at ``max_new_tokens``.

    A completion is truncated when it did not emit eos; without ``eos_emitted`` the rule falls back
    to ``length >= max_new_tokens`` (which also flags a completion whose eos was the last allowed token).
    """
    if eos_emitted is not None:
        return ~eos_emitted.to(torch.bool)
    return lengths >= max_new_tokens


def overlong_filter_mask(
    lengths: torch.Tensor, max_new_tokens: int, eos_emitted: torch.Tensor | None = None
) -> torch.Tensor:
    """Boolean keep-mask for the overlong filter: False for truncated completions (zero their loss)."""
    return ~truncated(lengths, max_new_tokens, eos_emitted)
