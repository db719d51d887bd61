"""The task interface and the shared partial-credit scorer.

A task turns a seed into prompts with reference answers and scores a decoded completion against
its answer. Invariants every task keeps:

- ``make_prompts(n, seed)`` is a pure function of ``(n, seed)`` (Python's ``random.Random``, which is
  stable across platforms and Python versions for integer seeds), and the first ``k`` prompts of
  ``make_prompts(n, seed)`` equal ``make_prompts(k, seed)``;
- ``reward`` is in [0, 1], equals 1.0 exactly when ``accuracy`` is 1.0, and gives partial credit so a
  randomly initialised model already sees reward differences inside a group;
- completions are the decoded generated text *without* special tokens; leading/trailing whitespace
  is ignored;
- ``prompt_space()`` is every distinct prompt the task can make, in a fixed order, when there are few enough to
  list (None otherwise): what a held-out evaluation picks from (:mod:`dsrl.rl.data.evalset`).
"""

from __future__ import annotations

import abc
import random
from dataclasses import dataclass

# Share of the reward given for stopping at the answer's length; the rest rewards matching characters.
LENGTH_WEIGHT = 0.25
# Credit for a character that occurs in the answer but not at this position (an exact match earns 1).
MISPLACED_CREDIT = 0.5


def partial_match_reward(
    completion: str, answer: str, length_weight: float = LENGTH_WEIGHT, misplaced: float = MISPLACED_CREDIT
) -> float:
    """Per-position character credit plus a length credit, in [0, 1]; 1.0 iff ``completion == answer``.

    With ``c = completion.strip()`` and ``a = answer``::

        credit(i) = 1 if c[i] == a[i], misplaced if c[i] occurs elsewhere in a, else 0   (i < len(a))
        chars     = sum_i credit(i) / len(a)
        length    = max(0, 1 - |len(c) - len(a)| / len(a))
        reward    = (1 - length_weight) * chars + length_weight * length

    Extra characters after the answer cost only length credit, so "learn to stop" and "learn the
    characters" are separate signals; the misplaced credit rewards emitting the right symbols before
    the right order, which is what a random model can discover first.
    """
    c = completion.strip()
    a = answer
    if not a:
        return 1.0 if not c else 0.0
    chars = sum(1.0 if x == y else (misplaced if x in a else 0.0) for x, y in zip(c, a)) / len(a)
    length = max(0.0, 1.0 - abs(len(c) - len(a)) / len(a))
    return (1.0 - length_weight) * chars + length_weight * length


def exact_match(completion: str, answer: str) -> float:
    """1.0 when the stripped completion equals the answer, else 0.0."""
    return 1.0 if completion.strip() == answer else 0.0


@dataclass(frozen=True)
class Task(abc.ABC):
    """A built-in verifiable task: deterministic prompts, a partial-credit reward, an exact accuracy."""

    name: str

    @abc.abstractmethod
    def example(self, rng: random.Random) -> dict[str, str]:
        """One ``{"prompt": str, "answer": str}`` drawn with ``rng``."""

    def make_prompts(self, n: int, seed: int) -> list[dict[str, str]]:
        """``n`` prompts, a pure function of ``(n, seed)``; prefixes agree for equal seeds."""
        if n < 0:
            raise ValueError(f"make_prompts: n = {n} must be >= 0")
        rng = random.Random(seed)
        return [self.example(rng) for _ in range(n)]

    def prompt_space(self) -> list[dict[str, str]] | None:
        """Every distinct ``{"prompt", "answer"}`` the task makes, in a fixed order, or None when the task has too many
        to list (then any draw is almost surely new)."""
        return None

    def reward(self, prompt: str, completion: str, answer: str) -> float:
        """Partial-credit reward in [0, 1] (see :func:`partial_match_reward`)."""
        return partial_match_reward(completion, str(answer))

    def accuracy(self, prompt: str, completion: str, answer: str) -> float:
        """1.0 for an exact answer (surrounding whitespace ignored), else 0.0."""
        return exact_match(completion, str(answer))

    def rewards(self, prompts: list[str], completions: list[str], answers: list[str]) -> list[float]:
        """Batched :meth:`reward`."""
        return [self.reward(p, c, a) for p, c, a in zip(prompts, completions, answers, strict=True)]

    def accuracies(self, prompts: list[str], completions: list[str], answers: list[str]) -> list[float]:
        """Batched :meth:`accuracy`."""
        return [self.accuracy(p, c, a) for p, c, a in zip(prompts, completions, answers, strict=True)]
