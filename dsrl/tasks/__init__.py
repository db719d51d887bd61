"""Built-in verifiable tasks for the embedded default run (``dsrl.data.task``), and the built-in verifiable rewards
for datasets, ``math_reward`` and ``exact_reward`` (``dsrl.data.reward_fn = "math" | "exact"``,
:mod:`dsrl.tasks.verifiable`). May import :mod:`dsrl.config` only.

Each task makes deterministic ``{"prompt", "answer"}`` pairs and scores decoded completions with
partial credit (reward in [0, 1]) and exact-match accuracy. All of them use only characters of the
shipped tiny tokenizer (digits, lower-case letters, space, punctuation).

What a randomly initialised tiny model learns, measured with a Qwen2 of hidden 64, 2 layers, 4 heads
(79k parameters), 16 prompts x 4 samples per rollout, one AdamW step per rollout (lr 3e-3, no
schedule), GRPO, temperature 1, max_new_tokens 8; mean reward over 3 seeds and a 5-rollout window:

- ``reverse`` (default): 1-3 letters from ``abcde`` reversed, e.g. ``"reverse: abc ="`` -> ``"cba"``.
  Reward 0.03 (rollouts 1-5) -> 0.10 (rollout 20) -> 0.19 (rollout 50) -> 0.32 (rollouts 100-260,
  3-7% exact). It first learns to stop after a few characters, then to emit letters of the prompt,
  then positions. At lr 1e-3 the reward reaches 0.14 at rollout 50.
- ``copy``: the same strings unchanged; same pace (0.03 -> 0.18 at rollout 50).
- ``add``: ``"add: 3+4 ="`` -> ``"7"`` with operands 0..9 (0.02 -> 0.22 at rollout 50).
- ``calculator``: ``"calculator: 347*862 ="`` -> ``"299114"``, a tool task: with the environment
  ``dsrl.tasks.calculator:Calculator`` the model calls ``[347*862]`` and copies the result
  (configs/tiny_tool_cpu.json, docs/environments.md); without the tool no tiny model gets it right.
"""

from __future__ import annotations

from dsrl.config import ConfigError
from dsrl.config.names import DEFAULT_TASK
from dsrl.tasks.base import Task, exact_match, partial_match_reward
from dsrl.tasks.builtin import AddTask, StringTask
from dsrl.tasks.calculator import CalculatorTask
from dsrl.tasks.verifiable import exact_reward, math_reward

# Keys: exactly dsrl.config.names.TASK_NAMES (the config's Literal of task names).
TASKS: dict[str, Task] = {
    "reverse": StringTask("reverse", alphabet="abcde", min_len=1, max_len=3, reverse=True),
    "copy": StringTask("copy", alphabet="abcde", min_len=1, max_len=3, reverse=False),
    "add": AddTask("add", max_value=9),
    "calculator": CalculatorTask("calculator"),
}


def get_task(name: str) -> Task:
    """The built-in task called ``name``; a ConfigError (a ValueError) naming ``dsrl.data.task`` otherwise."""
    try:
        return TASKS[name]
    except KeyError:
        raise ConfigError(
            f"dsrl.data.task = {name!r} is not a built-in task. Fix: use one of {', '.join(TASKS)}, "
            "or set dsrl.data.task to null and point dsrl.data.path at a prompts file."
        ) from None


__all__ = ["DEFAULT_TASK", "TASKS", "AddTask", "CalculatorTask", "StringTask", "Task", "exact_match", "exact_reward",
           "get_task", "math_reward", "partial_match_reward"]
