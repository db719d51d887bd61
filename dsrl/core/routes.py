"""Routes of a mixture-of-experts model as data: their format, the layout they must fit, comparing them.

A sequence's **routes** are an integer tensor ``[positions, moe_layers, top_k]`` (:data:`ROUTE_DTYPE`): row p
holds the experts that the router of every MoE layer (in model order) chose for the token at *input* position
p. A sample of n tokens has n - 1 input positions (its last token is never fed to the model): vLLM's
``routed_experts`` convention ([tokens - 1, layers, top_k]) and that of the trainer's collated ``input_ids``.
:data:`FREE` (-1) marks a position without a recorded route: there the router chooses by itself (padding,
environment tokens of a multi-turn trajectory). Recording and replaying them on a model:
:mod:`dsrl.rollout.routes`.

Pure torch; the layout is read from a transformers config object without importing transformers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

ROUTE_DTYPE = torch.int16  # expert ids up to 32767, and FREE
FREE = -1
HF_ROUTERS = ("MixtralTopKRouter", "Qwen2MoeTopKRouter", "Qwen3MoeTopKRouter")
AUTOEP_LAYER = "AutoEPMoELayer"  # DeepSpeed AutoEP's replacement of an MoE block; its router is a TokenChoiceTopKRouter


@dataclass(frozen=True)
class MoELayout:
    """The routing shape of an MoE model: routed layers, experts per layer, experts per token."""

    layers: int
    experts: int
    top_k: int

    def describe(self) -> str:
        return f"{self.layers} MoE layers x {self.experts} experts, top-{self.top_k}"


def config_layout(config: Any) -> MoELayout | None:
    """The :class:`MoELayout` a transformers config describes (Mixtral, Qwen2/Qwen3-MoE naming), None when dense.

    Qwen-MoE layers are sparse unless listed in ``mlp_only_layers`` or off the ``decoder_sparse_step`` grid."""
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    top_k = getattr(config, "num_experts_per_tok", None)
    if not experts or not top_k:
        return None
    return MoELayout(layers=len(moe_layer_indices(config)), experts=int(experts), top_k=int(top_k))


def moe_layer_indices(config: Any) -> list[int]:
    """The hidden layers of a Mixtral / Qwen-MoE config whose MLP is routed, in model order."""
    n = int(config.num_hidden_layers)
    dense = set(getattr(config, "mlp_only_layers", None) or [])
    step = int(getattr(config, "decoder_sparse_step", 1) or 1)
    return [i for i in range(n) if i not in dense and (i + 1) % step == 0]


class RouteShapeError(ValueError):
    """Routes whose shape does not fit the model or the micro-batch."""


def sequence_routes(routes: torch.Tensor, positions: int) -> torch.Tensor:
    """One sequence's routes cut or padded (with FREE) to ``positions`` rows."""
    if routes.shape[0] >= positions:
        return routes[:positions]
    pad = routes.new_full((positions - routes.shape[0], *routes.shape[1:]), FREE)
    return torch.cat([routes, pad])


def differing_pairs(a: torch.Tensor, b: torch.Tensor) -> tuple[int, int]:
    """(token-layer pairs whose *set* of experts differs, pairs compared) between two routes of equal shape; rows
    where either holds FREE are not compared."""
    if a.shape != b.shape:
        raise RouteShapeError(f"routes of shapes {tuple(a.shape)} and {tuple(b.shape)} cannot be compared")
    both = ~((a < 0).any(-1) | (b < 0).any(-1))
    same = (a.sort(-1).values == b.sort(-1).values).all(-1)
    return int((both & ~same).sum()), int(both.sum())
