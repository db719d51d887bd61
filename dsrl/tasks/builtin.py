"""The built-in tasks: ``copy``, ``reverse`` and ``add``.

All three answer in a few characters from a small alphabet, so the tiny character-level
tokenizer covers them and a randomly initialised ~100k-parameter model has something to learn
from its first rollout (see :func:`dsrl.tasks.base.partial_match_reward`).
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass

from dsrl.tasks.base import Task


@dataclass(frozen=True)
class StringTask(Task):
    """``"<name>: <s> ="`` -> ``transform(s)`` for a random string ``s`` over ``alphabet``.

    ``s`` has ``min_len``..``max_len`` characters drawn uniformly from ``alphabet``.
    """

    alphabet: str = "abcde"
    min_len: int = 1
    max_len: int = 3
    reverse: bool = False

    def example(self, rng: random.Random) -> dict[str, str]:
        n = rng.randint(self.min_len, self.max_len)
        s = "".join(rng.choice(self.alphabet) for _ in range(n))
        return {"prompt": f"{self.name}: {s} =", "answer": s[::-1] if self.reverse else s}

    def prompt_space(self) -> list[dict[str, str]]:
        """Every string of ``min_len``..``max_len`` characters of ``alphabet`` (155 for 1-3 of 5 letters)."""
        return [{"prompt": f"{self.name}: {s} =", "answer": s[::-1] if self.reverse else s}
                for n in range(self.min_len, self.max_len + 1)
                for s in ("".join(t) for t in itertools.product(self.alphabet, repeat=n))]


@dataclass(frozen=True)
class AddTask(Task):
    """``"add: a+b ="`` -> ``str(a + b)`` with ``0 <= a, b <= max_value``."""

    max_value: int = 9

    def example(self, rng: random.Random) -> dict[str, str]:
        a, b = rng.randint(0, self.max_value), rng.randint(0, self.max_value)
        return {"prompt": f"{self.name}: {a}+{b} =", "answer": str(a + b)}

    def prompt_space(self) -> list[dict[str, str]]:
        """Every pair of operands: ``(max_value + 1) ** 2`` prompts (100 for 0..9)."""
        r = range(self.max_value + 1)
        return [{"prompt": f"{self.name}: {a}+{b} =", "answer": str(a + b)} for a in r for b in r]
