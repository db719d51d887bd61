"""The RL algorithms' pieces, pure torch and no distribution: advantage estimators (group-relative: GRPO,
Dr. GRPO, RLOO, DAPO, GSPO; GAE for PPO, :mod:`.advantages`, :mod:`.gae`), sample filters (:mod:`.filters`),
the per-algorithm defaults resolved from the config (:mod:`.defaults`) and the per-token objectives
(:mod:`.losses`: clipped surrogate, KL, value loss).

May import: :mod:`dsrl.config`, :mod:`dsrl.core`; never :mod:`dsrl.rl`, :mod:`dsrl.checkpoint` or
:mod:`dsrl.cli`.
"""

from dsrl.algos.advantages import (
    ESTIMATORS,
    NORMALIZE_STD_DEFAULT,
    compute_advantages,
    group_statistics,
    valid_rewards,
)
from dsrl.algos.defaults import ResolvedAlgorithm, resolve_algorithm
from dsrl.algos.filters import overlong_filter_mask, overlong_shaping, truncated, zero_variance_groups
from dsrl.algos.gae import gae, token_rewards, whiten
from dsrl.config.names import ALGORITHM_DEFAULTS

__all__ = [
    "ALGORITHM_DEFAULTS",
    "ESTIMATORS",
    "NORMALIZE_STD_DEFAULT",
    "ResolvedAlgorithm",
    "compute_advantages",
    "gae",
    "group_statistics",
    "overlong_filter_mask",
    "overlong_shaping",
    "resolve_algorithm",
    "token_rewards",
    "truncated",
    "valid_rewards",
    "whiten",
    "zero_variance_groups",
]
