"""Off-policy correction of the rollout policy's mismatch (ARCHITECTURE §8): truncated or masked importance
sampling, per token or per sequence, and the mismatch measured whatever the setting.

A completion token t was sampled from the behavior policy mu (the rollout backend's weights *and kernels*,
possibly older weights under asynchronous training), while the loss is built on the trainer's proximal
log-probs pi_old. With log w_t = log pi_old,t - log mu_t (detached), ``algorithm.rollout_correction``:

- ``none``: the loss is untouched (every weight 1, nothing masked);
- ``tis`` (truncated importance sampling): the token's per-token loss is multiplied by
  w~_t = min(w_t, C) (``level = "token"``), or every token of a sequence by w~ = min(exp(sum_t log w_t), C)
  (``level = "sequence"``); truncated tokens still count in N_M / S_M;
- ``mis`` (masked importance sampling): a token whose w_t leaves [1/C, C] (``token``), or every token of a
  sequence whose exp(sum_t log w_t) leaves it (``sequence``), is removed from ``loss_mask`` before the counts
  are taken: it neither counts nor contributes, exactly like an overlong-filtered token.

Only the tokens the loss would count (model tokens of an active sample) enter a weight or a sum. The
aggregation of §2 is unchanged: the step applies w_t (§2) to w~_t * l_t. Everything is computed in float64
from the float32 log-probs; ``log w`` is clamped at +-700 before ``exp`` so no weight overflows.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from dsrl.config.names import CORRECTION_MIS, CORRECTION_NONE, CORRECTION_TIS, SEQUENCE_LEVEL

_LOG_CLAMP = 700.0


@dataclass
class Mismatch:
    """Sums over the counted tokens of some samples, for the rollout's metrics (added up over ranks)."""

    tokens: float = 0.0  # counted tokens with a behavior log-prob
    abs_diff_sum: float = 0.0  # sum |log pi_old - log mu|
    kl_sum: float = 0.0  # sum of the k3 estimate of KL(mu || pi_old) (samples are from mu)
    weight_max: float = 0.0  # the largest untruncated weight (a maximum over ranks, not a sum)
    truncated: float = 0.0  # tokens whose weight tis capped
    masked: float = 0.0  # tokens mis removed from the loss

    def add(self, other: Mismatch) -> None:
        self.tokens += other.tokens
        self.abs_diff_sum += other.abs_diff_sum
        self.kl_sum += other.kl_sum
        self.weight_max = max(self.weight_max, other.weight_max)
        self.truncated += other.truncated
        self.masked += other.masked


@dataclass(frozen=True)
class Corrected:
    """One sample's correction: ``weights`` w~ per completion token (None: all 1), ``keep`` per completion
    token (None: the loss mask is unchanged; else False where mis removed the token), and its mismatch."""

    weights: list[float] | None
    keep: list[bool] | None
    mismatch: Mismatch


def _exp(x: float) -> float:
    return math.exp(min(max(x, -_LOG_CLAMP), _LOG_CLAMP))


def correct(old_logprobs: Sequence[float], behavior_logprobs: Sequence[float], counted: Sequence[bool],
            mode: str, level: str, cap: float) -> Corrected:
    """The correction of one sample from its per-completion-token proximal and behavior log-probs; ``counted``
    marks the tokens the loss counts (the others get weight 1, are never masked and enter no sum)."""
    if not (len(old_logprobs) == len(behavior_logprobs) == len(counted)):
        raise ValueError(f"one sample's proximal ({len(old_logprobs)}), behavior ({len(behavior_logprobs)}) and "
                         f"counted ({len(counted)}) per-token lists differ in length")
    log_w = [float(o) - float(b) for o, b in zip(old_logprobs, behavior_logprobs)]
    idx = [i for i, c in enumerate(counted) if c]
    m = Mismatch(tokens=float(len(idx)))
    for i in idx:
        m.abs_diff_sum += abs(log_w[i])
        m.kl_sum += _exp(log_w[i]) - 1.0 - log_w[i]  # k3 with log r = log mu - log pi_old
        m.weight_max = max(m.weight_max, _exp(log_w[i]))
    if mode == CORRECTION_NONE or not idx:
        return Corrected(None, None, m)
    lo, hi = -math.log(cap), math.log(cap)
    n = len(log_w)
    if level == SEQUENCE_LEVEL:
        total = sum(log_w[i] for i in idx)
        if mode == CORRECTION_TIS:
            w = _exp(total)
            truncated = w > cap
            m.truncated = float(len(idx)) if truncated else 0.0
            value = min(w, cap)
            return Corrected([value if c else 1.0 for c in counted], None, m)
        keep_all = lo <= total <= hi
        m.masked = 0.0 if keep_all else float(len(idx))
        return Corrected(None, [keep_all or not c for c in counted], m)
    if mode == CORRECTION_TIS:
        weights = [1.0] * n
        for i in idx:
            w = _exp(log_w[i])
            m.truncated += float(w > cap)
            weights[i] = min(w, cap)
        return Corrected(weights, None, m)
    if mode == CORRECTION_MIS:
        keep = [True] * n
        for i in idx:
            keep[i] = lo <= log_w[i] <= hi
            m.masked += float(not keep[i])
        return Corrected(None, keep, m)
    raise ValueError(f"rollout_correction.mode {mode!r} is not one of none, tis, mis")
