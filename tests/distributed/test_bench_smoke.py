"""The benchmarks still run against the current API (a merge once broke bench/e2e.py's dsrl side without any test
noticing): ``python bench/gpu/measure.py --smoke --no-record --profile`` runs every GPU benchmark part (the verdict part
first: bench/e2e.py with dsrl's ``auto`` side, memory.offload_states off and on, read from dsrl's own metrics rows,
and TRL's sides where trl imports; dsrl's ``hf`` side in a part of its own; bench/rollout.py with both cb
attentions, bench/e2e.py with continuous batching and with its profiled rollout, bench/auto_grid.py's hf-vs-cb
cells in the training loop, bench/logprobs.py, bench/overhead.py, bench/throughput.py, bench/optim.py,
bench/mismatch.py) on tiny shapes on the CPU, each in its own bounded process, and must settle every part as run or
skipped with a reason, without touching docs/benchmarks.md; bench/lora.py's smallest configuration and
bench/auto_grid.py's smoke cells run too. Timing is not checked."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import EXTENDED

pytestmark = EXTENDED  # the extended tier (tests/conftest.py)

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO / "bench" / "gpu"))


def run(args: list[str], timeout: float = 600, **extra_env: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", **extra_env}
    proc = subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    return proc


def test_gpu_bench_smoke_runs_every_part(tmp_path):
    docs = REPO / "docs" / "benchmarks.md"
    before = hashlib.sha256(docs.read_bytes()).hexdigest()
    run(["bench/gpu/measure.py", "--smoke", "--no-record", "--profile", "--workdir", str(tmp_path)], timeout=960)
    assert hashlib.sha256(docs.read_bytes()).hexdigest() == before, "--smoke must not write docs/benchmarks.md"
    state = json.loads((tmp_path / "state.json").read_text())
    parts = state["parts"]
    from measure import parts as all_parts

    assert [p.name for p in all_parts()][:2] == ["e2e", "rollout-128"]  # the verdict first, then C = 128
    assert set(parts) == {p.name for p in all_parts(profile=True)}
    for name, part in parts.items():
        assert part["status"] in ("ok", "skipped"), (name, part.get("log_tail"))
        assert part["status"] == "ok" or part["reason"], name
    for name in ("rollout-128", "rollout-256"):
        rates = parts[name]["data"]["cells"][0]["rates"]
        assert {"hf", "cb/model", "cb/varlen"} <= set(rates) and all(rates.values())
    verdict = parts["e2e"]["data"]["results"]
    # dsrl's figures: its own metrics rows (dsrl/runtime/phases.py); the verdict runs `auto` with the offload off and
    # on, e2e-hf runs `hf`
    hf = parts["e2e-hf"]["data"]["results"]["hf"]["dsrl"]
    for dsrl in (verdict["auto"]["dsrl"], verdict["auto"]["dsrl-offload"], hf):
        assert dsrl["status"] == "ok" and dsrl["summary"]["rollouts"] >= 1 and dsrl["census"]["weights"] > 0
        assert dsrl["summary"]["generate_s"] > 0 and dsrl["summary"]["logprobs_s"] > 0, dsrl["summary"]
        assert dsrl["profile"] is None  # profiles only in their own part
        assert dsrl["plan_memory"]["training"]["total_mib"] > 0 and dsrl["weight_sync_probe"]["bytes"] > 0
        assert dsrl["summary"]["train_phase_tok_s"] > 0
    offload = [verdict["auto"][side]["summary"]["offload_s"] for side in ("dsrl", "dsrl-offload")]
    assert offload[0] == 0 < offload[1], offload
    assert "dsrl runs auto" in verdict["hf"]["dsrl"]["skipped"]
    assert parts["e2e"]["data"]["auto_picks"]["auto"] in ("hf", "cb")
    assert "dsrl only" in verdict["auto"]["trl"]["skipped"]  # TRL has no auto: its default is the hf row
    for side in ("trl", "trl-ds"):  # TRL is a benchmark-only dependency: run where it imports, else skipped
        assert "summary" in verdict["hf"][side] or "not importable" in verdict["hf"][side]["skipped"]
    profiled = parts["e2e-profile"]["data"]["results"]["hf"]["dsrl"]
    assert {"generate", "logprobs", "train"} == set(profiled["profile"]["phases"])
    assert profiled["profile"]["steps"]["traced"] > 0  # the generate window was traced
    assert parts["e2e-cb"]["data"]["results"]["cb"]["dsrl"]["summary"]["rollouts"] >= 1
    assert "auto/faster" in parts["auto-grid"]["data"]["body"]  # the grid's table, from its report() body
    _check_auto_grid_smoke(tmp_path / "auto-grid.json")  # the part's own --json file
    section = (tmp_path / "section.md").read_text()
    for heading in ("#### Rollout tokens/s", "#### `auto` choices re-derived", "#### End to end vs TRL GRPOTrainer",
                    "#### Where the time and memory go", "#### Chunked log-prob memory",
                    "#### Optimizer step", "#### Token-budget training throughput",
                    "#### Memory: dsrl plan against the measured peaks"):
        assert heading in section, heading


def _check_auto_grid_smoke(path: Path) -> None:
    """bench/auto_grid.py's smoke cells (run as the GPU smoke's auto-grid part): dsrl's Trainer alternates hf and cb on
    its auto backend as scheduled, every timed pair has both backends' phase_generate_s from the metrics rows and CPU
    seconds, and auto's pick and reason come from the rule (no timing is checked)."""
    results = json.loads(path.read_text())["results"]
    assert [(r["cell"]["concurrency"], r["cell"]["max_new_tokens"]) for r in results] == [(8, 8), (16, 16)]
    for r in results:
        assert r["status"] == "ok", r.get("error")
        assert len(r["pairs"]) == len(r["cpu_pairs"]) == r["cell"]["pairs"] >= 1
        assert all(p["hf"] > 0 and p["cb"] > 0 for p in r["pairs"] + r["cpu_pairs"])
        assert r["auto"] == "hf" and "short calls" in r["reason"]  # tiny cells, 8 and 16 new tokens
        assert r["parameters"] > 0


def test_a_part_past_its_bound_is_killed_with_its_children(tmp_path):
    from measure import run_bounded

    pid_file = tmp_path / "child.pid"
    script = ("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; "
              f"time.sleep(60)']); open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(60)")
    rc, seconds = run_bounded([sys.executable, "-c", script], dict(os.environ), 1.5, tmp_path / "log")
    assert rc is None and seconds < 30
    child = int(pid_file.read_text())
    deadline = time.time() + 10
    while time.time() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        raise AssertionError("the part's child process survived its bound")


def test_auto_rederivation_flags_disagreements():
    from tables import auto_rows

    meta = {"device": "cpu", "dtype": "float32", "attn": None}
    agree = {"shape": "scaled", "params_m": 26.5, "C": 128, "meta": meta,
             "rates": {"hf": [100.0], "cb/model": [200.0], "cb/varlen": [300.0]}}
    rows, flags = auto_rows([agree], "cpu")
    assert rows[0][5] == "cb/varlen" and rows[0][-1] == "agrees" and not flags
    # planted: hf measured fastest where the rule picks cb, and the dense mask faster than packing
    disagree = {**agree, "rates": {"hf": [500.0], "cb/model": [400.0], "cb/varlen": [250.0]}}
    rows, flags = auto_rows([disagree], "cpu")
    assert any("backend: hf 2.00x" in f for f in flags) and any("cb_attention: model 1.60x" in f for f in flags)


def test_lora_bench_runs():
    """bench/lora.py's smallest configuration (LoRA vs full on the tiny shape, ZeRO-2, one spawned rank)."""
    pytest.importorskip("peft", reason="PEFT is not installed (in the dsrl checkout: pip install -e '.[lora]')")
    out = run(["bench/lora.py", "--shape", "tiny", "--ranks", "1", "--zero_stages", "2", "--steps", "2", "--seq_len",
               "16", "--micro", "2", "--accum", "1", "--no-record"], timeout=300).stdout
    assert "optimizer state LoRA/full" in out and "| ZeRO-2 | lora |" in out
