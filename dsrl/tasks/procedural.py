"""Procedural tasks from reasoning-gym (the ``[real]`` extra): generated datasets with train and test disjoint by
construction, and the task's own scorer as the built-in reward ``"reasoning_gym"``.

Generation (:func:`generate_splits`, used by ``dsrl prepare-data``): reasoning-gym's generator for the task is drawn
in rounds (seeds ``seed``, ``seed + 1``, ...); every question goes to the split that a hash of its text chooses
(SHA-256, a fixed share of the hash space for the test split), so one question can never be in both splits whatever
the seeds and sizes. Both splits are draws from the generator's own distribution: the hash is blind to difficulty,
and a question the generator repeats is kept as often as it comes (keeping each question once would skew both
splits towards the larger part of the question space -- for chain sums of 1-2 digits, 2-digit sums, and the more so
the more rows are drawn, so a 2,000-row train split would be harder than a 200-row test split). A task whose
question space gives one split nothing is refused with what it made.

Each row holds ``question`` (the prompt), ``answer`` (the task's answer, a string), ``task`` (the reasoning-gym
dataset name) and ``metadata`` (the entry's metadata as JSON text, which some scorers read).

The reward (:func:`gym_reward`): the task's own ``score_answer(answer, entry)`` (reasoning-gym's scores are in
[0, 1]; many give partial credit) on the completion's answer: the text inside the last ``<answer>...</answer>``
(reasoning-gym's format), else the last ``\\boxed{}``, else what follows the last ``####`` (the ``math`` reward's
reading), else the last number where the task's answer is a number, else the whole completion, which the scorer
reads as it is. Accuracy (:func:`gym_accuracy`) is 1.0 where that score is 1.0 (a chain sum's scorer also gives
partial credit, ``len(gold) / len(answer)``, to an answer that contains the right number: "184" for 84 scores 0.67).
Why not reasoning-gym's tags alone: a small instruct model never writes them unasked (SmolLM2-135M-Instruct: none in
256 samples), so every reward would be 0 and nothing would be learned; the fallback reads the answer as stated.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re
from collections.abc import Callable, Sequence
from functools import cache
from typing import Any

from dsrl.config import ConfigError
from dsrl.tasks.answers import after_marker, last_boxed, last_number

GYM_EXTRA = 'reasoning-gym is not installed. Fix: pip install -e ".[real]" (from the dsrl checkout).'
MAX_ROUNDS = 16  # generator rounds that must fill both splits
_ANSWER_TAG = re.compile(r"<answer>\s?(.*?)\s?</answer>", re.DOTALL)
_NUMBER = re.compile(r"[-+]?\d[\d,]*(\.\d+)?")  # a gold answer that is a number


def has_reasoning_gym() -> bool:
    """Whether reasoning-gym is installed (without importing it)."""
    return importlib.util.find_spec("reasoning_gym") is not None


def _gym() -> Any:
    if not has_reasoning_gym():
        raise ConfigError(GYM_EXTRA)
    import reasoning_gym

    return reasoning_gym


def in_test_split(question: str, test_share: float) -> bool:
    """Whether ``question`` belongs to the test split: its SHA-256 read as a number in [0, 1) is below
    ``test_share``. A function of the text alone: the splits are disjoint by construction."""
    digest = hashlib.sha256(question.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64 < test_share


def generate_splits(task: str, train_size: int, test_size: int, seed: int = 0,
                    options: dict[str, Any] | None = None) -> dict[str, list[dict[str, str]]]:
    """``{"train": rows, "test": rows}`` of reasoning-gym's ``task`` with ``options`` (its config's fields), disjoint
    and each without repeats (module docstring)."""
    gym = _gym()
    if task not in gym.factory.DATASETS:
        raise ConfigError(f"reasoning-gym has no task {task!r}. Fix: use one of "
                          f"{', '.join(sorted(gym.factory.DATASETS))}.")
    share = test_size / (train_size + test_size)
    want = {"train": train_size, "test": test_size}
    splits: dict[str, list[dict[str, str]]] = {"train": [], "test": []}
    distinct: set[str] = set()
    round_size = max(1000, 2 * (train_size + test_size))
    for r in range(MAX_ROUNDS):
        try:
            dataset = gym.create_dataset(task, size=round_size, seed=seed + r, **(options or {}))
        except (TypeError, AssertionError, ValueError) as e:
            raise ConfigError(f"reasoning-gym task {task!r} refuses the options {options or {}}: "
                              f"{type(e).__name__}: {e}. Fix: use the fields of its config class.") from None
        for entry in dataset:
            question = entry["question"]
            distinct.add(question)
            split = "test" if in_test_split(question, share) else "train"
            if len(splits[split]) < want[split]:
                splits[split].append({"question": question, "answer": str(entry["answer"]), "task": task,
                                      "metadata": json.dumps(entry.get("metadata") or {}, sort_keys=True,
                                                             default=str)})
        if all(len(splits[s]) >= want[s] for s in want):
            return splits
    raise ConfigError(
        f"reasoning-gym task {task!r} with {options or {}} has {len(distinct)} distinct questions in "
        f"{MAX_ROUNDS * round_size} draws, and its {len(splits['train'])} train and {len(splits['test'])} test rows "
        f"fall short of {train_size} + {test_size}: the split by hash gives one split too few of them. Fix: widen "
        "the task's options (--option), or ask for a test split nearer its share.")


@cache
def _scorer(task: str) -> Callable[[str | None, dict[str, Any]], float]:
    gym = _gym()
    try:
        return gym.get_score_answer_fn(task)
    except ValueError:
        raise ConfigError(f"the reward 'reasoning_gym' got the task {task!r}, which reasoning-gym does not know. "
                          "Fix: write the rows with dsrl prepare-data (the task column names the generator).") from None


def completion_answer(completion: str, gold: str) -> str | None:
    """The answer a completion states (module docstring): inside its last ``<answer>`` tags, else its last box,
    else what follows its last ``####``, else its last number where ``gold`` is a number, else the whole completion
    (the task's scorer then reads it whole)."""
    tagged = _ANSWER_TAG.findall(completion)
    if tagged:
        return tagged[-1].strip()
    for found in (last_boxed(completion), after_marker(completion)):
        if found:
            return found
    if _NUMBER.fullmatch(gold.strip()):
        return last_number(completion)
    return completion.strip() or None


def gym_reward(prompts: Sequence[Any], completions: Sequence[str], answers: Sequence[Any], task: Sequence[str],
               metadata: Sequence[str]) -> list[float]:
    """reasoning-gym's own score of each completion's answer, in [0, 1] (module docstring). ``task`` and
    ``metadata`` are the dataset's columns of those names (dsrl passes the columns a reward function names)."""
    if not len(completions) == len(answers) == len(task) == len(metadata):
        raise ValueError(f"gym_reward: {len(completions)} completions, {len(answers)} answers, {len(task)} tasks and "
                         f"{len(metadata)} metadata")
    out = []
    for prompt, completion, answer, name, meta in zip(prompts, completions, answers, task, metadata):
        gold = str(answer)
        entry = {"question": prompt, "answer": gold, "metadata": json.loads(meta) if isinstance(meta, str) else meta}
        score = _scorer(name)(completion_answer(completion or "", gold), entry)
        out.append(min(max(float(score), 0.0), 1.0))
    return out


def gym_accuracy(prompts: Sequence[Any], completions: Sequence[str], answers: Sequence[Any], task: Sequence[str],
                 metadata: Sequence[str]) -> list[float]:
    """1.0 where :func:`gym_reward` is 1.0 (a right answer in full), else 0.0."""
    return [float(s >= 1.0) for s in gym_reward(prompts, completions, answers, task, metadata)]


gym_reward.batched = True  # type: ignore[attr-defined]
gym_accuracy.batched = True  # type: ignore[attr-defined]
