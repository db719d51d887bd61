"""The vLLM rollout backend.

- On every machine: the trainer hands each rollout's generation the policy's current weights (the
  backend's ``sync_weights`` runs once per rollout, before generation), and ``rollout.backend = "vllm"``
  without vLLM fails with the install hint (tests/unit/test_models_rollout.py).
- Only where ``vllm`` imports and a CUDA GPU is present: vLLM's greedy completions equal transformers'
  ``generate`` on the same tiny model, before and after the weights change and ``sync_weights`` runs.
  Elsewhere that test is skipped with a loud ``!!! NOT RUN`` reason (it has never run in this
  repository's CI, which has no GPU; docs/rollout.md says what has and has not been run).
"""

from __future__ import annotations

import importlib.util
import types

import pytest
import torch

from dsrl.rl.experience import ExperienceMaker


def test_each_rollout_syncs_the_generator_weights_before_generating(monkeypatch):
    calls = []
    backend = types.SimpleNamespace(sync_weights=lambda: calls.append("sync"))
    policy = types.SimpleNamespace(view=types.SimpleNamespace(data_parallel_rank=0), device="cpu")
    tokenizer = types.SimpleNamespace(pad_token_id=0)
    maker = ExperienceMaker(None, None, policy, backend, tokenizer, None, None, None)
    monkeypatch.setattr(maker, "collect", lambda i: (calls.append(f"collect {i}"), ([], _Stats(), 1))[1])
    monkeypatch.setattr(maker, "score_logprobs", lambda s: None)
    monkeypatch.setattr(maker, "advantages", lambda s: None)
    monkeypatch.setattr("dsrl.rl.experience.is_source", lambda view: False)
    maker.make(0)
    maker.make(1)
    assert calls == ["sync", "collect 0", "sync", "collect 1"]


class _Stats:
    rollout_s = 0.0


def _vllm_gpu_reason() -> str | None:
    if importlib.util.find_spec("vllm") is None:
        return "vllm is not installed"
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    return None


@pytest.mark.skipif(_vllm_gpu_reason() is not None,
                    reason=f"!!! NOT RUN: the vLLM backend test needs vllm and a CUDA GPU ({_vllm_gpu_reason()})")
def test_vllm_greedy_matches_generate_and_follows_weight_sync(tmp_path):
    from dsrl.config import ModelConfig, RolloutConfig
    from dsrl.rl.models import build_model
    from dsrl.rollout.hf import HFRolloutBackend
    from dsrl.rollout.vllm import VLLMRolloutBackend

    tok = types.SimpleNamespace(eos_token_id=2, pad_token_id=0)
    model = build_model(ModelConfig(arch="qwen2", dtype="float32", tiny={"tie_word_embeddings": False}), 128, 0, 1, 2,
                        on_gpu=True, seed=0).cuda()
    # greedy (temperature 0: allowed to the backends, not in a run file)
    cfg = RolloutConfig.model_construct(**{**RolloutConfig(max_new_tokens=12).model_dump(), "temperature": 0.0})
    hf = HFRolloutBackend(model, tok, cfg)
    vl = VLLMRolloutBackend(model, tok, cfg, dtype="float32", gpu_memory_utilization=0.2, enforce_eager=True)
    prompts = [[1, 5, 9, 13], [1, 7], [1, 20, 21, 22, 23, 24]]

    def same():
        a, b = hf.generate(prompts, 2, seed=0), vl.generate(prompts, 2, seed=0)
        return [c.completion_ids for c in a] == [c.completion_ids for c in b]

    assert same()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    vl.sync_weights()
    assert same()
