"""The benchmarks still run against the current API (a merge once broke bench/e2e.py's dsrl side without
any test noticing): the smallest configuration of each generation/e2e benchmark, in a subprocess, with
``--no-record`` (nothing is appended to docs/benchmarks.md). Timing is not checked."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def run(args: list[str], timeout: float = 300, **extra_env: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", **extra_env}
    proc = subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


def test_rollout_bench_runs_both_cb_attentions():
    out = run(["bench/rollout.py", "--shapes", "tiny", "--concurrency", "16", "--sequences", "16",
               "--max_new_tokens", "8", "--repeats", "1", "--no-record"]).stdout
    assert "cb model/hf" in out and "cb varlen/hf" in out


def test_e2e_bench_dsrl_worker_runs(tmp_path):
    """The dsrl side of bench/e2e.py (TRL's side needs trl, a benchmark-only dependency)."""
    workload = {"shape": "tiny", "prompts_per_rollout": 2, "samples_per_prompt": 2, "mini_batch_size": 4,
                "micro_batch_size": 2, "max_new_tokens": 4, "rollouts": 2, "backend": "cb"}
    out = tmp_path / "records.json"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    run(["bench/e2e.py", "--worker", "dsrl", "--workload", json.dumps(workload), "--out", str(out)],
        MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    records = json.loads(out.read_text())
    assert len(records) == 2 and all(r["rollout_s"] > 0 and r["completion_tokens"] > 0 for r in records)


def test_lora_bench_runs():
    """bench/lora.py's smallest configuration (LoRA vs full on the tiny shape, ZeRO-2, one spawned rank)."""
    pytest.importorskip("peft", reason="PEFT is not installed (pip install 'dsrl[lora]')")
    out = run(["bench/lora.py", "--shape", "tiny", "--ranks", "1", "--zero_stages", "2", "--steps", "2", "--seq_len",
               "16", "--micro", "2", "--accum", "1", "--no-record"]).stdout
    assert "optimizer state LoRA/full" in out and "| ZeRO-2 | lora |" in out
