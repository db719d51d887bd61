"""Rollouts that train on nothing: warned about one by one, bounded in a row, never the end of a quiet run.

A rollout *trains on nothing* when none of its optimizer steps (the policy's and, with PPO, the critic's)
was applied to a valid token: every sample was masked (a NaN reward from ``data.reward_fn`` or the
environment, a reward call past its timeout, an overlong-filtered completion), the correction (``mis``)
removed every token, or every step was skipped for a non-finite loss. Such a rollout leaves the weights
as they were, yet the run would go on, checkpoint and export as if it learned.

:class:`EmptyRollouts` keeps these invariants:

- every such rollout is announced (rank 0) with its counts: samples masked of the rollout's, why, the
  tokens that reached the loss, the optimizer steps that changed nothing;
- ``run.max_empty_rollouts`` of them in a row stop the run with one sentence (:class:`RunError`, exit
  status 1) before the rollout is checkpointed; a rollout that trains resets the count;
- a run whose rollouts all trained on nothing never ends with status 0, even when it has fewer rollouts
  than the bound: reaching its end (the plan's last rollout, or ``run.stop_after_rollouts``) raises too;
- every rank takes the same decision: the counts are global (the rollout's summed statistics and the step
  results, which carry the all-reduced token counts), so the error is ``agreed``;
- the count of empty rollouts in a row is part of the run's state (:meth:`state_dict`), so it survives a resume.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dsrl.core.errors import RunError

log = logging.getLogger("dsrl.rl.empty_rollouts")


@dataclass(frozen=True)
class RolloutOutcome:
    """What one rollout trained on (global counts, the same on every rank)."""

    samples: int  # samples of the rollout (sources only: each replica's data counted once)
    masked: int  # samples masked before training
    nonfinite_rewards: int  # samples whose reward is not finite (NaN masks a sample)
    reward_timeouts: int  # of those, reward calls past data.reward_timeout_s
    environment_timeouts: int  # trajectories masked by an environment call past data.environment_timeout_s
    truncated: int  # samples cut at the length limit (masked when algorithm.overlong_filter)
    steps: int  # optimizer steps taken (policy and critic)
    applied_with_tokens: int  # steps applied to at least one valid token
    tokens: int  # valid tokens over every step (the policy's, else the critic's)

    @classmethod
    def of(cls, totals: Any, steps: Sequence[dict[str, Any]]) -> RolloutOutcome:
        """From a rollout's summed :class:`dsrl.rl.rollout_stats.RolloutStats` and its step results (policy and
        critic; each holds the mini-batch's global token count)."""
        return cls(samples=int(totals.samples), masked=int(totals.masked_samples),
                   nonfinite_rewards=int(totals.samples - totals.finite_rewards),
                   reward_timeouts=int(totals.reward_timeouts),
                   environment_timeouts=int(totals.environment_timeouts),
                   truncated=int(totals.truncated_samples), steps=len(steps),
                   applied_with_tokens=sum(1 for r in steps if r["step_applied"] and r["tokens"] > 0),
                   tokens=int(sum(r["tokens"] for r in steps)))

    @property
    def trained(self) -> bool:
        return self.applied_with_tokens > 0

    def why(self) -> str:
        """The counts, in words: what was masked and why, what reached the loss."""
        if self.samples == 0:
            what = "it held no samples"
        elif self.masked >= self.samples:
            causes = []
            if self.nonfinite_rewards:
                timed = f", {self.reward_timeouts} of them reward calls past data.reward_timeout_s" \
                    if self.reward_timeouts else ""
                causes.append(f"{self.nonfinite_rewards} with a non-finite reward{timed}")
            if self.environment_timeouts:
                causes.append(f"{self.environment_timeouts} trajectories past data.environment_timeout_s")
            if self.truncated and self.nonfinite_rewards < self.masked:
                causes.append(f"{self.truncated} cut at the length limit (algorithm.overlong_filter masks them)")
            what = f"all {self.samples} samples were masked" + (f" ({'; '.join(causes)})" if causes else "")
        elif self.tokens == 0:
            what = (f"{self.masked} of {self.samples} samples were masked and the others have no completion token "
                    "the loss counts (empty completions, or algorithm.rollout_correction 'mis' removed them all)")
        else:
            what = f"every one of its {self.steps} optimizer steps was skipped for a non-finite loss or gradient"
        return f"{what}, so {self.tokens} tokens reached the loss and its {self.steps} optimizer steps changed nothing"

    def fix(self) -> str:
        if self.masked >= self.samples > 0 and self.nonfinite_rewards >= self.masked:
            return ("make dsrl.data.reward_fn (or the environment's rewards) return finite numbers: NaN masks a "
                    "sample")
        if self.masked >= self.samples > 0 and self.truncated:
            return "raise dsrl.rollout.max_new_tokens, or set dsrl.algorithm.overlong_filter to false"
        if self.tokens == 0:
            return "check the samples' rewards, lengths and dsrl.algorithm.rollout_correction (its cap)"
        return "lower the learning rate or look for the non-finite values in the model's loss"


class EmptyRollouts:
    """Counts rollouts that train on nothing in a row (module docstring); ``limit`` is ``run.max_empty_rollouts``."""

    def __init__(self, limit: int):
        self.limit = limit
        self.in_a_row = 0
        self.first: int | None = None  # the first rollout (1-based) of the current run of empty ones

    def observe(self, rollout: int, outcome: RolloutOutcome, *, last: bool, rank: int = 0) -> None:
        """After rollout ``rollout`` (1-based): warn when it trained on nothing; raise the agreed :class:`RunError`
        at the bound, or when it ends the run (``last``) and no rollout of the run trained."""
        if outcome.trained:
            self.in_a_row, self.first = 0, None
            return
        self.in_a_row += 1
        if self.first is None:
            self.first = rollout - self.in_a_row + 1
        which = f"rollout {rollout}" if self.in_a_row == 1 else f"rollouts {self.first} to {rollout}"
        if self.in_a_row >= self.limit:
            raise RunError(f"{which} trained on nothing ({self.in_a_row} in a row, dsrl.run.max_empty_rollouts = "
                           f"{self.limit}): in rollout {rollout} {outcome.why()}. The run stops here, before "
                           f"checkpointing it. Fix: {outcome.fix()}; then continue with --resume auto.", agreed=True)
        if last and self.in_a_row >= rollout:
            raise RunError(f"{which}, every rollout of this run, trained on nothing: in rollout {rollout} "
                           f"{outcome.why()}. The policy is unchanged, so the run ends without its final checkpoint "
                           f"and export. Fix: {outcome.fix()}.", agreed=True)
        if rank == 0:
            log.warning("rollout %d trained on nothing: %s (%d such rollout(s) in a row; the run stops at "
                        "dsrl.run.max_empty_rollouts = %d). Fix: %s.", rollout, outcome.why(), self.in_a_row,
                        self.limit, outcome.fix())

    def state_dict(self) -> dict[str, int]:
        return {"in_a_row": self.in_a_row, "first": self.first or 0}

    def load_state_dict(self, state: dict[str, int] | None) -> None:
        """Restore from a checkpoint's client state (absent in checkpoints written before it: none in a row)."""
        state = state or {}
        self.in_a_row = int(state.get("in_a_row", 0))
        self.first = int(state.get("first", 0)) or None
