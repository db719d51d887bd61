"""The router's load-balancing auxiliary loss (Switch Transformer's), as a per-token term that sums exactly.

For a mini-batch M with counted tokens T_M (``loss_mask`` 1; N_M of them), L MoE layers, E experts, top-k K:

    f_{l,e} = #{t in T_M : e in route_l(t)} / (K * N_M)     expert load (carries no gradient)
    P_{l,e} = (1 / N_M) * sum_{t in T_M} p_{t,l,e}            mean router probability
    L_aux   = (E / L) * sum_l sum_e f_{l,e} * P_{l,e}         (= 1 under uniform routing)

Since f carries no gradient, ``L_aux = sum_{t in T_M} (1 / N_M) * a_t`` with the **per-token** term

    a_t = (E / L) * sum_l sum_e f_{l,e} * p_{t,l,e}           (:func:`balance_per_token`)

so the loss is a weighted token sum like every other term of dsrl's objective (ARCHITECTURE §2): the trainer adds
``router_aux_loss_coef * a_t`` to each token's loss, which ``loss_agg`` then aggregates (under ``token-mean``
exactly ``coef * L_aux``; under the sequence modes each sequence's mean of a_t, like the KL and entropy terms).
What makes it exact under any split is that f is a statistic of the *whole* mini-batch, known before its first
forward: it is counted from the routes each micro-batch carries (:func:`expert_load`: the replayed routes under
routing replay, else the ones the trainer's own proximal forward chose) and summed over the count group once per
mini-batch. transformers' own ``load_balancing_loss_func`` pools every layer's tokens into one f and one P and
counts each of a micro-batch's unpadded tokens; this definition balances each layer on its own, over the tokens
the loss counts.

Pure torch, no distribution: the caller sums :func:`expert_load` over its count group.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch


def expert_load(routes: torch.Tensor, loss_mask: torch.Tensor, experts: int) -> torch.Tensor:
    """Counts ``[layers, experts]`` (float64) of the experts that the counted tokens of one micro-batch go to.

    ``routes`` is ``[b, t, layers, top_k]`` (positions without a route, FREE = -1, must not be counted: a counted
    token always carries its route), ``loss_mask`` ``[b, t]``."""
    counted = loss_mask.reshape(-1) != 0
    picked = routes.reshape(-1, *routes.shape[2:])[counted].to(torch.long)  # [n, layers, top_k]
    if picked.numel() and int(picked.min()) < 0:
        raise ValueError("a counted token has no route (FREE); the load-balancing loss needs every counted token's "
                         "route")
    layers = routes.shape[2]
    out = torch.zeros(layers, experts, dtype=torch.float64, device=routes.device)
    ones = torch.ones_like(picked[..., 0], dtype=torch.float64)
    for k in range(picked.shape[-1]):
        out.scatter_add_(1, picked[..., k].transpose(0, 1), ones.transpose(0, 1))
    return out


def load_fraction(counts: torch.Tensor, tokens: int, top_k: int) -> torch.Tensor:
    """f ``[layers, experts]`` from the mini-batch's summed :func:`expert_load` and N_M (0 when N_M = 0)."""
    return counts / (top_k * tokens) if tokens > 0 else torch.zeros_like(counts)


def mini_batch_load(micros: Sequence[Mapping[str, Any]], layers: int, experts: int, top_k: int,
                    sum_over_group: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """f ``[layers, experts]`` of a whole mini-batch from this rank's micro-batches (each with ``routes`` and
    ``loss_mask``): local counts and counted tokens, summed by ``sum_over_group`` over the ranks that own the
    mini-batch's tokens (once each: the step's count group), before the first forward."""
    local = torch.zeros(layers * experts + 1, dtype=torch.float64)
    for m in micros:
        local[:-1] += expert_load(m["routes"].cpu(), m["loss_mask"].cpu(), experts).reshape(-1)
        local[-1] += float((m["loss_mask"] != 0).sum())
    total = sum_over_group(local).cpu()
    return load_fraction(total[:-1].reshape(layers, experts), int(total[-1]), top_k)


def balance_per_token(probs: list[torch.Tensor], load: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """a_t ``shape`` (``[b, t]``) from each MoE layer's router probabilities ``[b * t, experts]`` and the load f
    ``[layers, experts]``; differentiable in the probabilities."""
    layers, experts = load.shape
    if len(probs) != layers:
        raise ValueError(f"router probabilities of {len(probs)} layers for a load of {layers}")
    total = None
    for p, f in zip(probs, load):
        term = p @ f.to(device=p.device, dtype=p.dtype)
        total = term if total is None else total + term
    return (total * (experts / layers)).reshape(shape)
