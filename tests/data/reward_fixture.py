"""Reward functions imported by dotted path in tests/test_tasks_data.py (data.reward_fn)."""

from __future__ import annotations


def exact_batched(prompts: list[str], completions: list[str], answers: list[str]) -> list[float]:
    """Batched: 1.0 where the stripped completion equals the answer."""
    return [1.0 if c.strip() == str(a) else 0.0 for c, a in zip(completions, answers)]


def length_per_sample(prompt: str, completion: str, answer: str) -> float:
    """Per-sample (recognised by its parameter names): shorter completions score higher."""
    return 1.0 / (1.0 + len(completion))


def wrong_length(prompts: list[str], completions: list[str], answers: list[str]) -> list[float]:
    """Broken on purpose: one reward too few."""
    return [0.0] * (len(completions) - 1)


NOT_CALLABLE = 3
