"""The experience maker hands each rollout's generation the policy's current weights: the backend's
``sync_weights`` runs once per rollout, before generation, and its ``sleep`` once after it (a vLLM engine frees its
memory there until the next sync). (``rollout.backend = "vllm"`` without vLLM fails with
the install hint: tests/unit/test_models_rollout.py; vLLM itself: the tests/vllm tier.)"""

from __future__ import annotations

import types

from dsrl.rl.experience import ExperienceMaker
from dsrl.rl.rollout_stats import RolloutStats
from dsrl.rollout.base import RolloutBackend


class _Recording(RolloutBackend):
    """A backend keeping the contract (dsrl.rollout.base) that records its weight syncs."""

    def __init__(self, calls: list[str]):
        self.calls = calls

    def generate(self, prompt_ids, samples_per_prompt, seed):
        return []

    def sync_weights(self) -> None:
        self.calls.append("sync")

    def sleep(self) -> None:
        self.calls.append("sleep")


def test_each_rollout_syncs_the_generator_weights_before_generating(monkeypatch):
    calls = []
    backend = _Recording(calls)
    policy = types.SimpleNamespace(view=types.SimpleNamespace(data_parallel_rank=0), device="cpu")
    tokenizer = types.SimpleNamespace(pad_token_id=0)
    maker = ExperienceMaker(None, None, policy, backend, tokenizer, None, None, None)
    monkeypatch.setattr(maker, "collect", lambda i: (calls.append(f"collect {i}"), ([], RolloutStats(), 1))[1])
    monkeypatch.setattr(maker, "score_logprobs", lambda s: None)
    monkeypatch.setattr(maker, "correct_off_policy", lambda s, stats: None)
    monkeypatch.setattr(maker, "advantages", lambda s: None)
    monkeypatch.setattr("dsrl.rl.experience.is_source", lambda view: False)
    maker.make(0)
    maker.make(1)
    assert calls == ["sync", "collect 0", "sleep", "sync", "collect 1", "sleep"]
