"""The float64 reference every exactness claim is checked against: a mini-batch's loss from its definition.

ARCHITECTURE §2's table, written directly over the mini-batch's sequences (each row of each micro-batch is one
sequence; its tokens count where its mask is 1), with no use of dsrl's own weights or counts:

- ``token-mean``: sum of l_t over every counted token / the number of counted tokens;
- ``seq-mean-token-mean``: the mean over sequences with at least one counted token of (sum of their l_t / n_s);
- ``seq-mean-token-sum``: the mean over those sequences of the sum of their l_t;
- ``seq-mean-token-sum-norm`` (Dr. GRPO): sum of l_t / (``mini_batch_size`` x ``norm_length``).

A mini-batch without a counted token has loss 0 (its gradient is zero, never 0/0). :func:`reference_gradient` is the
gradient of that loss in float64 by parameter name, what the self-check (``dsrl.check``), the multi-process tests
and the GPU checks compare an applied update with (:func:`dsrl.cli.check_measures.relative_error`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from dsrl.config.names import SEQ_MEAN_TOKEN_MEAN, SEQ_MEAN_TOKEN_SUM, SEQ_MEAN_TOKEN_SUM_NORM, TOKEN_MEAN


def mini_batch_loss(per_token: Sequence[torch.Tensor], masks: Sequence[torch.Tensor], loss_agg: str, *,
                    mini_batch_size: int, norm_length: int) -> torch.Tensor:
    """The mini-batch loss (module docstring) in float64 from each micro-batch's per-token losses ``[b, t]`` and
    masks ``[b, t]`` (1 where a token counts)."""
    sums = torch.cat([(lt.double() * m.to(torch.float64)).sum(-1) for lt, m in zip(per_token, masks)])
    n_s = torch.cat([m.to(torch.float64).sum(-1) for m in masks])
    nonempty = n_s > 0
    if loss_agg == TOKEN_MEAN:
        return sums.sum() / n_s.sum().clamp(min=1)
    if loss_agg in (SEQ_MEAN_TOKEN_MEAN, SEQ_MEAN_TOKEN_SUM):
        per_seq = sums[nonempty] / n_s[nonempty] if loss_agg == SEQ_MEAN_TOKEN_MEAN else sums[nonempty]
        return per_seq.mean() if per_seq.numel() else sums.sum() * 0
    if loss_agg == SEQ_MEAN_TOKEN_SUM_NORM:
        return sums.sum() / (mini_batch_size * norm_length)
    raise ValueError(f"unknown loss_agg {loss_agg!r}")


def reference_gradient(model: torch.nn.Module, micro_batches: Sequence[Mapping[str, Any]],
                       per_token_loss: Callable[[torch.nn.Module, Mapping[str, Any]], torch.Tensor], loss_agg: str, *,
                       mini_batch_size: int, norm_length: int,
                       mask_key: str = "loss_mask") -> dict[str, torch.Tensor]:
    """d(mini-batch loss)/d(parameter) in float64 by name (zeros for a parameter the loss does not reach), for a
    model already in float64 (or whatever precision the caller chose), over every micro-batch of every replica in
    one process; ``per_token_loss(model, micro)`` gives ``[b, t]`` losses, ``micro[mask_key]`` the counted tokens."""
    model.zero_grad(set_to_none=True)
    losses = [per_token_loss(model, mb) for mb in micro_batches]
    loss = mini_batch_loss(losses, [mb[mask_key] for mb in micro_batches], loss_agg,
                           mini_batch_size=mini_batch_size, norm_length=norm_length)
    loss.backward()
    return {n: p.grad.detach().double().clone() if p.grad is not None else torch.zeros_like(p, dtype=torch.float64)
            for n, p in model.named_parameters()}
