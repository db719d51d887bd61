"""Reward functions imported by dotted path in tests/test_tasks_data.py (data.reward_fn)."""

from __future__ import annotations

import os
import time


def exact_batched(prompts: list[str], completions: list[str], answers: list[str]) -> list[float]:
    """Batched: 1.0 where the stripped completion equals the answer."""
    return [1.0 if c.strip() == str(a) else 0.0 for c, a in zip(completions, answers)]


def slow_exact_batched(prompts: list[str], completions: list[str], answers: list[str]) -> list[float]:
    """``exact_batched`` that takes 3 s per call: keeps the trainers busy (tests/distributed/test_async.py); each call
    first appends a line to the file named by ``DSRL_TEST_REWARD_MARK`` when set."""
    mark = os.environ.get("DSRL_TEST_REWARD_MARK")
    if mark:
        with open(mark, "a") as f:
            f.write("called\n")
    time.sleep(3.0)
    return exact_batched(prompts, completions, answers)


def length_per_sample(prompt: str, completion: str, answer: str) -> float:
    """Per-sample (recognised by its parameter names): shorter completions score higher."""
    return 1.0 / (1.0 + len(completion))


def wrong_length(prompts: list[str], completions: list[str], answers: list[str]) -> list[float]:
    """Broken on purpose: one reward too few."""
    return [0.0] * (len(completions) - 1)


NOT_CALLABLE = 3


_hung: list[bool] = []


def hang_once_on_rank1(prompt: str, completion: str, answer: str) -> float:
    """Per-sample; on rank 1 its first call never returns on its own (data.reward_timeout_s must end it)."""
    if os.environ.get("RANK") == "1" and not _hung:
        _hung.append(True)
        time.sleep(3600)
    return 1.0 / (1.0 + len(completion))


def hang_on_rank1(prompts: list[str], completions: list[str], answers: list[str]) -> list[float]:
    """Batched; never returns on rank 1 (with no reward timeout, the collective bound must end the job)."""
    if os.environ.get("RANK") == "1":
        time.sleep(3600)
    return [0.5] * len(completions)


def strings(prompts: list[str], completions: list[str], answers: list[str]) -> list[str]:
    """Broken on purpose: text instead of numbers."""
    return ["good"] * len(completions)


def reverse_gated_first_call(prompts: list[str], completions: list[str], answers: list[str]) -> list[float]:
    """The built-in reverse task's reward; with $DSRL_TEST_REWARD_GATE set, the first call of a process waits
    (up to 120 s) until that file exists, keeping the job busy while a test acts on it."""
    from dsrl.tasks import get_task

    gate = os.environ.get("DSRL_TEST_REWARD_GATE")
    if gate and not _gated:
        _gated.append(True)
        deadline = time.monotonic() + 120
        while not os.path.exists(gate) and time.monotonic() < deadline:
            time.sleep(0.1)
    return get_task("reverse").rewards(prompts, completions, answers)


_gated: list[bool] = []


def nan_batched(prompts: list[str], completions: list[str], answers: list[str]) -> list[float]:
    """Broken on purpose: NaN for every completion (every sample masked; the run trains on nothing)."""
    return [float("nan")] * len(completions)
