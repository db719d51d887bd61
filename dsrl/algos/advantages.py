"""Group-relative advantage estimators: GRPO, Dr. GRPO, RLOO, DAPO, GSPO. Pure torch, no distribution.

(PPO's advantages come from a critic's values by GAE: :mod:`dsrl.algos.gae`.)

Layout: ``rewards`` is a flat ``[P*G]`` tensor in which the ``G`` samples of each prompt are
contiguous (prompt ``p`` owns ``rewards[p*G:(p+1)*G]``). The result has the same layout.

Estimators (``mean`` and ``std`` are over the finite rewards of the sample's group):

    grpo      A_i = (r_i - mean) / (std + eps)        normalize_std default True
    dapo      A_i = (r_i - mean) / (std + eps)        normalize_std default True (same as grpo)
    gspo      A_i = (r_i - mean) / (std + eps)        normalize_std default True (same as grpo)
    dr_grpo   A_i =  r_i - mean                        normalize_std default False (Dr. GRPO drops it)
    rloo      A_i =  r_i - mean_{j != i} r_j           = n/(n-1) * (r_i - mean); needs G >= 2

Setting ``normalize_std`` explicitly overrides the default for any estimator (for rloo it divides
the leave-one-out advantage by the group std + eps).

``std`` is the *sample* standard deviation (Bessel-corrected, divisor n - 1), the convention of
TRL's ``GRPOTrainer`` and verl (``torch.std`` with its default ``correction=1``).

Rules that always hold:

- **Zero-variance groups** (all finite rewards equal, including groups with fewer than two finite
  rewards) give advantage exactly 0.0 for every member, never a rounding residue divided by eps.
- **Non-finite rewards** (NaN, +-inf: a failed verifier) get advantage exactly 0.0 and are
  ``False`` in :func:`valid_rewards`; the trainer zeroes their loss mask. They are left out of
  their group's statistics: ``n`` above is the number of finite rewards in the group.
- Statistics are computed in float64; the result has the rewards' floating dtype (float32 for
  integer or boolean rewards).
"""

from __future__ import annotations

import torch

from dsrl.config.names import ALGORITHM_DEFAULTS, GROUP_RELATIVE_ALGORITHMS

ESTIMATORS = GROUP_RELATIVE_ALGORITHMS
# Divide by the group std unless AlgorithmConfig.normalize_std says otherwise.
NORMALIZE_STD_DEFAULT = {name: ALGORITHM_DEFAULTS[name]["normalize_std"] for name in ESTIMATORS}


def valid_rewards(rewards: torch.Tensor) -> torch.Tensor:
    """Boolean ``[P*G]``: True where the reward is finite. Invalid samples must be loss-masked."""
    return torch.isfinite(rewards)


def _grouped(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be a flat [P*G] tensor, got shape {tuple(rewards.shape)}")
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group size G = {group_size!r} must be a positive integer (dsrl.batch.samples_per_prompt)")
    if rewards.numel() % group_size != 0:
        raise ValueError(
            f"{rewards.numel()} rewards do not split into groups of G = {group_size} "
            "(dsrl.batch.samples_per_prompt); the rollout must hold whole groups"
        )
    return rewards.view(-1, group_size)


def group_statistics(rewards: torch.Tensor, group_size: int) -> dict[str, torch.Tensor]:
    """Per-group statistics over the finite members, float64, each ``[P]``.

    ``count`` (finite members n), ``mean``, ``std`` (sample std, 0 when n < 2), ``sum`` and
    ``constant`` (True when the finite members are all equal or n < 2).
    """
    g = _grouped(rewards, group_size).to(torch.float64)
    finite = torch.isfinite(g)
    x = torch.where(finite, g, torch.zeros_like(g))
    n = finite.sum(1).to(torch.float64)
    total = x.sum(1)
    mean = total / n.clamp(min=1)
    dev = torch.where(finite, g - mean.unsqueeze(1), torch.zeros_like(g))
    var = dev.square().sum(1) / (n - 1).clamp(min=1)
    std = torch.where(n >= 2, var.sqrt(), torch.zeros_like(var))
    big = torch.where(finite, g, torch.full_like(g, -torch.inf)).amax(1)
    small = torch.where(finite, g, torch.full_like(g, torch.inf)).amin(1)
    constant = (n < 2) | (big == small)
    return {"count": n, "mean": mean, "std": std, "sum": total, "constant": constant}


def compute_advantages(
    name: str,
    rewards: torch.Tensor,
    group_size: int,
    normalize_std: bool | None = None,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Advantages ``[P*G]`` of estimator ``name`` for contiguous groups of ``group_size`` (module doc).

    ``normalize_std=None`` takes the estimator's default (:data:`NORMALIZE_STD_DEFAULT`).
    Raises ValueError for an unknown estimator, a malformed rewards tensor, or rloo with G < 2.
    """
    if name not in ESTIMATORS:
        raise ValueError(f"dsrl.algorithm.name = {name!r} is not a group-relative estimator ({', '.join(ESTIMATORS)}); "
                         "ppo's advantages come from dsrl.algos.gae")
    if name == "rloo" and group_size < 2:
        raise ValueError(
            f"rloo needs at least 2 samples per prompt (leave-one-out baseline), got G = {group_size}. "
            "Fix: set dsrl.batch.samples_per_prompt >= 2."
        )
    out_dtype = rewards.dtype if rewards.is_floating_point() else torch.float32
    g = _grouped(rewards, group_size).to(torch.float64)
    stats = group_statistics(rewards, group_size)
    finite = torch.isfinite(g)
    n, mean = stats["count"].unsqueeze(1), stats["mean"].unsqueeze(1)
    centred = g - mean
    if name == "rloo":
        # r_i - (S - r_i)/(n - 1) = n/(n - 1) * (r_i - mean); n < 2 groups are constant (zeroed below).
        centred = centred * n / (n - 1).clamp(min=1)
    if NORMALIZE_STD_DEFAULT[name] if normalize_std is None else normalize_std:
        centred = centred / (stats["std"].unsqueeze(1) + eps)
    keep = finite & ~stats["constant"].unsqueeze(1)
    adv = torch.where(keep, centred, torch.zeros_like(centred))
    return adv.reshape(-1).to(out_dtype)
