"""How ``dsrl.check`` (:mod:`dsrl.cli.check`) compares dsrl's update with the float64 reference: full parameters
gathered on every rank, the worst relative error over parameter tensors, the tensor it comes from, and the
least-squares factor between the two updates (1 when exact; a planted bug shows as another factor)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch


def full_parameters(engine: Any) -> dict[str, torch.Tensor]:
    """Full (unpartitioned, unsharded) float64 copies of the module's parameters by their model names,
    on every rank (ZeRO-3 partitions, AutoTP shards and AutoEP experts reassembled)."""
    from dsrl.backends.deepspeed.autoep import full_parameters as gathered

    return gathered(engine)


def relative_error(update: Mapping[str, torch.Tensor] | Sequence[torch.Tensor],
                   ref: Mapping[str, torch.Tensor] | Sequence[torch.Tensor],
                   only: Callable[[str], bool] = lambda name: True) -> float:
    """max over parameter tensors of ||g - g_ref|| / ||g_ref|| (absolute when g_ref = 0); tensors are
    matched by name (mappings) or by position (sequences)."""
    if not (isinstance(update, Mapping) and isinstance(ref, Mapping)):  # by position (parameters() order)
        update = {str(i): t for i, t in enumerate(update.values() if isinstance(update, Mapping) else update)}
        ref = {str(i): t for i, t in enumerate(ref.values() if isinstance(ref, Mapping) else ref)}
    if update.keys() != ref.keys():
        raise RuntimeError(f"parameter names differ from the reference: {sorted(update.keys() ^ ref.keys())}")
    worst = 0.0
    for name, r in ref.items():
        if not only(name):
            continue
        u = update[name]
        denom = r.norm().item()
        err = (u - r).norm().item()
        worst = max(worst, err / denom if denom > 0 else err)
    return worst


def global_relative_error(update: Mapping[str, torch.Tensor], ref: Mapping[str, torch.Tensor]) -> float:
    """||g - g_ref|| / ||g_ref|| over all parameters as one vector: a real model's measure (``dsrl.check --model
    DIR``), whose small tensors with strongly cancelling gradients (a norm's weight summed over every token) differ
    by float32 summation order alone far more than the update as a whole."""
    err = sum(float((update[n] - r).pow(2).sum()) for n, r in ref.items())
    den = sum(float(r.pow(2).sum()) for r in ref.values())
    return (err / den) ** 0.5 if den > 0 else err ** 0.5


def worst_parameter(update: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> str:
    """The name of the parameter with the largest relative error (for the report)."""
    return max(ref, key=lambda n: relative_error({n: update[n]}, {n: ref[n]}))


def update_ratio(update: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    """The least-squares factor f with update ~= f * reference over all parameters (1 when exact)."""
    num = sum(float((update[n] * r).sum()) for n, r in ref.items())
    den = sum(float((r * r).sum()) for r in ref.values())
    return num / den if den > 0 else 1.0


def is_expert(name: str) -> bool:
    """Whether a (Hugging Face) parameter name is an MoE expert weight."""
    return ".experts." in name
