"""Stuck rewards, bounded collectives and signals on 2 CPU ranks (issue 12, items 5 and 6).

- (a reward call that never returns on one rank is cut at ``data.reward_timeout_s``, its sample masked
  and counted: tested in test_elastic_export.py, on the ZeRO-2 chain's first run);
- without a reward timeout, the waiting rank says every ``run.wait_report_s`` which rank it waits for, which
  samples that rank's reward function is scoring and for how long; it gives up after
  ``run.collective_timeout_s`` with a sentence naming the phase (reward) and the missing rank (1), and the whole
  job ends;
- SIGTERM to the ``deepspeed`` runner alone (what ``kill PID`` and ``timeout`` do) used to leave its
  ranks training to the end of the run; now they notice, finish the rollout, commit a checkpoint and
  exit, and the output directory's lock is released.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil
from conftest import EXTENDED, REPO, free_port, launch

pytestmark = EXTENDED  # the extended tier (tests/conftest.py)


def _config(tmp_path) -> str:
    raw = json.loads((REPO / "configs" / "tiny_grpo_cpu.json").read_text())
    raw["dsrl"]["sft"] = {"steps": 0}  # RL only (the default config's warm-up is not under test)
    raw.pop("scheduler")
    raw.pop("csv_monitor", None)
    path = tmp_path / "run.json"
    path.write_text(json.dumps(raw))
    return str(path)


def _rows(out, event):
    return [r for r in (json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()) if r["event"] == event]


def test_stuck_rank_ends_the_job_naming_phase_and_rank(tmp_path):
    out = tmp_path / "out"
    start = time.monotonic()
    proc = launch(["launch/train.py", "--ds_config", _config(tmp_path), "--dsrl.run.rollouts", "1",
                   "--dsrl.run.output_dir", str(out), "--dsrl.run.progress_bar", "false",
                   "--dsrl.data.reward_fn", "tests/data/reward_fixture.py:hang_on_rank1",
                   "--dsrl.data.reward_timeout_s", "null", "--dsrl.run.collective_timeout_s", "8",
                   "--dsrl.run.wait_report_s", "2", "--dsrl.run.stop_grace_s", "2"], nprocs=2, timeout=300,
                  check=False)
    wall = time.monotonic() - start
    assert proc.returncode != 0
    reports = [ln for ln in proc.stdout.splitlines() if "rank 0 has waited" in ln]
    assert len(reports) >= 2, proc.stdout[-3000:]  # every 2 s until the bound
    assert ("at the end of the reward phase for rank 1 in reward for" in reports[0] and "calling dsrl.data.reward_fn "
            "= 'tests/data/reward_fixture.py:hang_on_rank1' for a batch of 64 samples (first completion" in reports[0]
            and "within 8 s" in reports[0]), reports[0]
    assert "rank 1 did not finish the reward phase within 8 s" in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr.split("rank 1 did not finish")[0][-2000:]
    assert wall < 240, wall  # the hanging rank sleeps for an hour


def test_sigterm_to_the_runner_alone_stops_every_rank_with_a_checkpoint(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore"}
    runner = subprocess.Popen([sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port",
                               str(free_port()), "launch/train.py", "--ds_config", _config(tmp_path),
                               "--dsrl.run.rollouts", "2000", "--dsrl.run.output_dir", str(out),
                               "--dsrl.run.progress_bar", "false"], cwd=REPO, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    job = psutil.Process(runner.pid)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not ((out / "metrics.jsonl").exists() and _rows(out, "rollout")):
            time.sleep(0.2)
        ranks = job.children(recursive=True)
        assert len(ranks) >= 3, ranks  # launch.py and its two ranks
        runner.send_signal(signal.SIGTERM)  # the runner alone: it has no handler and dies at once
        _, alive = psutil.wait_procs(ranks, timeout=60)
        assert not alive, f"ranks still running 60 s after the runner's SIGTERM: {alive}"
    finally:
        for p in job.children(recursive=True) if job.is_running() else []:
            p.kill()
        runner.kill()
    log = runner.communicate()[0]
    # Rank 0 logs; whichever rank notices the dead launcher first tells the others (dsrl.runtime.stop).
    noticed = "stop requested (the launcher" in log or "stop requested (another rank was asked to stop)" in log
    assert noticed and "with a committed checkpoint" in log, log[-3000:]
    last = _rows(out, "rollout")[-1]["rollout"]
    assert last < 2000
    tag = (out / "checkpoints" / "latest").read_text()
    assert tag == f"rollout{last}" and (out / "checkpoints" / tag / "COMPLETE").exists()
    assert not (out / ".dsrl.lock").exists()
    assert "exits with return code = 143" in log
