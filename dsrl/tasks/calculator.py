"""The ``calculator`` task: a product no tiny model can compute, and a tool that can (a multi-turn environment).

Prompt ``"calculator: 347*862 ="``, answer ``"299114"``: two factors drawn uniformly from 317..999, so every
product has six digits and every trajectory has the same shape. The environment (``data.environment =
"dsrl.tasks.calculator:Calculator"``, the contract of
:mod:`dsrl.rl.episodes.environment`; this module imports nothing of
dsrl's but the task base) gives one episode per sample:

- a model turn that is exactly a tool call ``[<digits><op><digits>]`` with ``op`` one of ``+ - *`` (ended by the
  stop string ``"]"``, ``rollout.stop_strings``) is answered with the observation ``"=<result>\\n"``, reward 0, and
  the episode goes on (at most ``MAX_CALLS`` calls; after that every turn is the answer);
- any other turn is the answer: reward :func:`dsrl.tasks.base.partial_match_reward` against the product, done;
- ``demonstration(prompt, answer)`` = ``["[a*b]", answer]``: the supervised warm-up shows the call, the tool's
  result (masked) and the answer copied from it.

A solved trajectory reads ``<s>calculator: 347*862 =[347*862]=299114\\n299114</s>``: the model only has to copy
(the factors into the call, the result into the answer), which a 2-layer model learns; the product itself it
cannot compute. ``NoToolCalculator`` is the control: the same episodes with the tool switched off (every turn
is the answer, the demonstration answers at once), i.e. the same model without the tool.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Any

from dsrl.tasks.base import Task, partial_match_reward

LOW, HIGH = 317, 999  # 317 * 317 = 100489: every product has six digits
MAX_CALLS = 2
CALL = re.compile(r"\[(\d{1,7})([*+-])(\d{1,7})\]")
PROMPT = re.compile(r"\w+: (\d+)\*(\d+) =")


@dataclass(frozen=True)
class CalculatorTask(Task):
    """``"calculator: a*b ="`` -> ``str(a * b)`` with ``LOW <= a, b <= HIGH``."""

    def example(self, rng: random.Random) -> dict[str, str]:
        a, b = rng.randint(LOW, HIGH), rng.randint(LOW, HIGH)
        return {"prompt": f"{self.name}: {a}*{b} =", "answer": str(a * b)}


def evaluate(text: str) -> str | None:
    """The result of a tool call ``[a op b]`` (the whole text), or None when the text is not one."""
    m = CALL.fullmatch(text.strip())
    if not m:
        return None
    a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
    return str(a * b if op == "*" else a + b if op == "+" else a - b)


class Calculator:
    """The calculator environment's episode (module docstring); the class is the factory."""

    tool = True

    def __init__(self, prompt: str, answer: Any):
        self.answer, self.calls = str(answer), 0

    def step(self, turn: Any) -> dict[str, Any]:
        result = evaluate(turn.text) if self.tool and self.calls < MAX_CALLS else None
        if result is not None:
            self.calls += 1
            return {"observation": f"={result}\n", "reward": 0.0, "done": False}
        return {"reward": partial_match_reward(turn.text, self.answer), "done": True}

    @classmethod
    def demonstration(cls, prompt: str, answer: Any) -> list[str]:
        m = PROMPT.fullmatch(prompt)
        if not cls.tool or not m:
            return [str(answer)]
        return [f"[{m.group(1)}*{m.group(2)}]", str(answer)]


class NoToolCalculator(Calculator):
    """The control: the calculator's episodes without the tool (every turn is the answer)."""

    tool = False
