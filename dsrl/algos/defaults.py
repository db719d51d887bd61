"""Per-algorithm defaults for the ``dsrl.algorithm`` keys left unset (``null``) in the config.

:data:`ALGORITHM_DEFAULTS` is the single table; ``loss_agg`` is taken from
:data:`dsrl.config.ALGORITHM_LOSS_AGG`, which ``DsrlConfig.loss_agg`` already resolves, so the
two can never disagree. :func:`resolve_algorithm` fills every unset key and returns concrete values.

Sources: GRPO (DeepSeekMath; TRL/verl defaults), Dr. GRPO (Liu et al. 2025: no std division,
constant-length token-sum normalisation), RLOO (Ahmadian et al. 2024: leave-one-out baseline,
no std), DAPO (Yu et al. 2025: clip-higher 0.28, dynamic sampling, token-level loss, overlong
shaping; the overlong *filter* is an ablation there, so it stays off).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dsrl.algos.advantages import NORMALIZE_STD_DEFAULT
from dsrl.config import ALGORITHM_LOSS_AGG, AlgorithmConfig

ALGORITHM_DEFAULTS: dict[str, dict[str, Any]] = {
    name: {
        "loss_agg": ALGORITHM_LOSS_AGG[name],
        "normalize_std": NORMALIZE_STD_DEFAULT[name],
        "clip_high": 0.28 if name == "dapo" else None,  # None = same as clip_low
        "dynamic_sampling": name == "dapo",
        "overlong_filter": False,
    }
    for name in ("grpo", "dr_grpo", "rloo", "dapo")
}


@dataclass(frozen=True)
class ResolvedAlgorithm:
    """``dsrl.algorithm`` with every unset key replaced by the algorithm's default."""

    name: str
    normalize_std: bool
    clip_low: float
    clip_high: float
    dynamic_sampling: bool
    max_sampling_rounds: int
    overlong_filter: bool
    overlong_buffer: int
    overlong_penalty: float
    kl_coef: float
    kl_estimator: str
    kl_in: str
    entropy_coef: float


def resolve_algorithm(cfg: AlgorithmConfig) -> ResolvedAlgorithm:
    """Concrete algorithm settings: explicit config values win, ``None`` takes the default."""
    if cfg.name not in ALGORITHM_DEFAULTS:
        raise ValueError(f"dsrl.algorithm.name = {cfg.name!r} is not one of {', '.join(ALGORITHM_DEFAULTS)}")
    d = ALGORITHM_DEFAULTS[cfg.name]
    clip_high = cfg.clip_high if cfg.clip_high is not None else d["clip_high"]
    return ResolvedAlgorithm(
        name=cfg.name,
        normalize_std=d["normalize_std"] if cfg.normalize_std is None else bool(cfg.normalize_std),
        clip_low=cfg.clip_low,
        clip_high=cfg.clip_low if clip_high is None else clip_high,
        dynamic_sampling=d["dynamic_sampling"] if cfg.dynamic_sampling is None else bool(cfg.dynamic_sampling),
        max_sampling_rounds=cfg.max_sampling_rounds,
        overlong_filter=cfg.overlong_filter,
        overlong_buffer=cfg.overlong_buffer,
        overlong_penalty=cfg.overlong_penalty,
        kl_coef=cfg.kl_coef,
        kl_estimator=cfg.kl_estimator,
        kl_in=cfg.kl_in,
        entropy_coef=cfg.entropy_coef,
    )
