"""What continues a run exactly besides the engines' own state: :class:`RunState`.

Invariants:

- ``rollout`` counts the rollouts trained so far; it is also the policy version of the weights (one weight sync
  per rollout), which the checkpoint records as ``version``;
- ``calls`` counts the mini-batches trained (an optimizer step each, applied or skipped);
- the prompt stream (:class:`dsrl.rl.data.prompts.PromptSampler`) and the count of rollouts in a row that trained on
  nothing (:class:`dsrl.rl.empty_rollouts.EmptyRollouts`) are restored exactly, so a resumed run draws and decides
  what an uninterrupted one would;
- ``evaluation.last``: the last rollout evaluated (:class:`dsrl.rl.evaluation.EvalProgress`; -1 none, and in a
  checkpoint written before evaluations existed), so a resumed run neither repeats nor skips an evaluation;
- :meth:`RunState.snapshot` captures the state and this rank's random streams at a rollout boundary: a stop that
  comes after the next rollout began drawing prompts commits the boundary's snapshot, not the live state.

The keys of :meth:`RunState.state_dict` are those of the checkpoint's client state (``rollout``, ``calls``,
``sampler``, ``empty_rollouts``, ``version``, ``evaluated``), so checkpoints written before this class resume
unchanged.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import torch

from dsrl.rl.data.prompts import PromptSampler
from dsrl.rl.empty_rollouts import EmptyRollouts
from dsrl.rl.evaluation import EvalProgress


@dataclass(frozen=True)
class Snapshot:
    """The run's state (:meth:`RunState.state_dict`) and this rank's random streams at one moment."""

    state: dict[str, Any]
    rng: dict[str, Any]


@dataclass
class RunState:
    """The run's position (module docstring)."""

    sampler: PromptSampler
    empty: EmptyRollouts
    rollout: int = 0
    calls: int = 0
    evaluation: EvalProgress = field(default_factory=EvalProgress)  # shared with the run's evaluator

    def state_dict(self) -> dict[str, Any]:
        return {"rollout": self.rollout, "calls": self.calls, "sampler": self.sampler.state_dict(),
                "empty_rollouts": self.empty.state_dict(), "version": self.rollout,
                "evaluated": self.evaluation.last}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rollout = int(state["rollout"])
        self.calls = int(state["calls"])
        self.empty.load_state_dict(state.get("empty_rollouts"))
        self.evaluation.last = int(state.get("evaluated", -1))
        self.sampler.load_state_dict(state["sampler"])

    @staticmethod
    def rng_state() -> dict[str, Any]:
        """This rank's random streams (torch's CPU generator and Python's)."""
        return {"torch_rng": torch.get_rng_state(), "python_rng": random.getstate()}

    @staticmethod
    def load_rng_state(rng: dict[str, Any]) -> None:
        torch.set_rng_state(rng["torch_rng"])
        random.setstate(rng["python_rng"])

    def snapshot(self) -> Snapshot:
        return Snapshot(self.state_dict(), self.rng_state())
