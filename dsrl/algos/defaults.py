"""Per-algorithm defaults for the ``dsrl.algorithm`` keys left unset (``null``) in the config.

The table itself is :data:`dsrl.config.names.ALGORITHM_DEFAULTS` (one source for the config models, the
loss aggregation default ``DsrlConfig.loss_agg``, the advantage estimators and the docs);
:func:`resolve_algorithm` fills every unset key and returns concrete values.
"""

from __future__ import annotations

from dataclasses import dataclass

from dsrl.config import AlgorithmConfig
from dsrl.config.names import ALGORITHM_DEFAULTS


@dataclass(frozen=True)
class ResolvedAlgorithm:
    """``dsrl.algorithm`` with every unset key replaced by the algorithm's default."""

    name: str
    normalize_std: bool
    clip_low: float
    clip_high: float
    ratio_level: str
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
    """Concrete algorithm settings: explicit config values win, ``None`` takes the default.

    ``cfg`` is a validated :class:`AlgorithmConfig`, so ``cfg.name`` is a key of the table.
    """
    d = ALGORITHM_DEFAULTS[cfg.name]
    clip_low = cfg.clip_low if cfg.clip_low is not None else d["clip_low"]
    clip_high = cfg.clip_high if cfg.clip_high is not None else d["clip_high"]
    return ResolvedAlgorithm(
        name=cfg.name,
        normalize_std=d["normalize_std"] if cfg.normalize_std is None else bool(cfg.normalize_std),
        clip_low=clip_low,
        clip_high=clip_low if clip_high is None else clip_high,
        ratio_level=cfg.ratio_level or d["ratio_level"],
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
