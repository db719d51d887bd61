"""dsrl.model.share_prompts on 2 CPU ranks: with one mini-batch per rollout (B = R, so the split into micro-batches
cannot change which samples a step sees) the first step of the job with shared rows equals the padded job's to
float rounding -- loss, gradient norm, entropy -- with the same token counts, in fewer positions."""

from __future__ import annotations

import json

import pytest
from conftest import REPO, launch, write_json

ARGS = ["launch/train.py", "--dsrl.run.rollouts", "1",
        "--dsrl.batch.prompts_per_rollout", "8", "--dsrl.batch.samples_per_prompt", "4",
        "--dsrl.batch.mini_batch_size", "32", "--dsrl.sft.steps", "0", "--dsrl.run.progress_bar", "false"]


def _rows(out, event: str) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["event"] == event]


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    raw = json.loads((REPO / "configs" / "tiny_grpo_cpu.json").read_text())
    raw.pop("scheduler")  # one optimizer step: a constant LR
    run_file = write_json(tmp_path_factory.mktemp("run_file") / "run.json", raw)
    out = {}
    for share in ("false", "true"):
        out[share] = tmp_path_factory.mktemp(f"share_{share}")
        launch([*ARGS, "--ds_config", str(run_file), "--dsrl.run.output_dir", str(out[share]),
                "--dsrl.model.share_prompts", share], nprocs=2, timeout=600)
    return out


def test_the_first_step_with_shared_rows_equals_the_padded_one(jobs):
    padded, shared = _rows(jobs["false"], "step")[0], _rows(jobs["true"], "step")[0]
    assert padded["tokens"] == shared["tokens"]  # the same counted tokens (the normalization's N_M)
    for key in ("loss", "grad_norm", "entropy"):
        assert abs(padded[key] - shared[key]) <= 1e-5 * max(abs(padded[key]), 1e-3), key
    first = _rows(jobs["false"], "rollout")[0], _rows(jobs["true"], "rollout")[0]
    assert first[0]["reward_mean"] == first[1]["reward_mean"]  # the same rollout was trained on
