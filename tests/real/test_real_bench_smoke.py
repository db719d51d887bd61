"""bench/real_trl.py still runs against the current API, on the real model: a tiny version of the benchmark (1 rollout
of 2 prompts x 4 samples, 8 new tokens, 8 evaluation prompts) runs every side -- TRL's GRPOTrainer (skipped only where
trl is not importable), dsrl on one rank and on two -- evaluates them with the benchmark's own greedy evaluation and
prints its tables, without touching docs/benchmarks.md. Timing is not checked; the settings the benchmark promises
are: the same first prompt ids on both sides, the same LR at every optimizer step, a record per rollout with its
phases and peak memory, an accuracy after N rollouts and at equal wall time for each pair."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REAL

pytestmark = REAL

REPO = Path(__file__).resolve().parents[2]


def test_real_bench_smoke(tmp_path, real_model, chain_sum):
    docs = REPO / "docs" / "benchmarks.md"
    before = hashlib.sha256(docs.read_bytes()).hexdigest() if docs.exists() else None
    out = tmp_path / "real_trl.json"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    proc = subprocess.run(
        [sys.executable, "bench/real_trl.py", "--model", str(real_model), "--data", str(chain_sum), "--seeds", "0",
         "--rollouts", "1", "--save_every", "1", "--prompts", "2", "--samples", "4", "--mini_batch", "4",
         "--max_new_tokens", "8", "--eval_prompts", "8", "--eval_threads", "1", "--workdir", str(tmp_path / "work"),
         "--json", str(out), "--no-record"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    after = hashlib.sha256(docs.read_bytes()).hexdigest() if docs.exists() else None
    assert after == before, "--no-record must not write docs/benchmarks.md"
    assert "| seed | side" in proc.stdout and "acc after 1" in proc.stdout
    results = json.loads(out.read_text())
    assert results["settings"]["trl_loss_type"] == "grpo" and results["settings"]["max_new_tokens"] == 8
    assert results["initial"]["prompts"] == 8 and 0.0 <= results["initial"]["accuracy"] <= 1.0
    sides = results["seeds"]["0"]["sides"]
    have_trl = importlib.util.find_spec("trl") is not None
    if not have_trl:
        assert "not importable" in sides["trl"]["skipped"]
    ran = [s for s in ("trl", "dsrl-1", "dsrl-2") if s != "trl" or have_trl]
    for side in ran:
        r = sides[side]
        assert r["status"] == "ok", (side, r.get("error"))
        assert len(r["records"]) == 1 and r["summary"]["rollout_s"] > 0, side
        assert r["summary"]["generate_s"] > 0 and r["summary"]["logprobs_s"] > 0 and r["summary"]["peak_mb"] > 0
        assert 0.0 <= r["accuracy"]["1"] <= 1.0, side
        assert len(r["lrs"]) == 2  # 1 rollout x 8 samples / B = 4
    assert sides["dsrl-1"]["rollout_backend"] in ("hf", "cb")
    if have_trl:
        first = sides["trl"]["first_prompt"]
        assert first["trl_ids"] == first["dsrl_ids"] and "<|im_start|>assistant" in first["text"]
        assert sides["dsrl-1"]["first_line"] == sides["dsrl-2"]["first_line"] == first["file_row0"]
        for side in ("dsrl-1", "dsrl-2"):
            assert sides[side]["lrs"] == pytest.approx(sides["trl"]["lrs"], rel=1e-12), side
            wall = results["seeds"]["0"]["equal_wall"][f"trl vs {side}"]
            assert wall["rollout"] in (0, 1) and 0.0 <= wall["slow_accuracy"] <= 1.0
    leftovers = [p for p in (tmp_path / "work").rglob("*.safetensors")]
    assert not leftovers, leftovers  # the saved models are deleted once evaluated
