"""Resume that cannot destroy a run, and damaged checkpoints (issue 12, items 1 and 3), on 2 CPU ranks.

One chain over one output directory:
1. 2 ranks train rollout 1 and stop; meanwhile a second job on the same directory is refused, naming
   the first job's host and pid;
2. a fresh start there (``--resume never``) is refused, naming ``--resume auto``, a new output_dir and
   ``--overwrite``; nothing is touched;
3. ``--resume <output dir>`` (the run's directory, not its checkpoints/) continues the run;
4. the newest checkpoint's model file is truncated: naming it explicitly fails with a sentence naming
   the file; ``--resume auto`` falls back to the previous checkpoint, says which file is damaged, and
   recomputes the lost rollout exactly (its losses equal the first attempt's, kept in
   metrics.dropped.jsonl);
5. garbage in ``latest`` is reported in a sentence and the newest complete checkpoint is used.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time

from conftest import EXTENDED, REPO, free_port, launch, node_launcher, one_rank

pytestmark = EXTENDED  # the extended tier (tests/conftest.py)

ROLLOUTS = 3


def run_file(tmp_path) -> str:
    raw = json.loads((REPO / "configs" / "tiny_grpo_cpu.json").read_text())
    raw["dsrl"]["sft"] = {"steps": 0}  # RL only (the default config's warm-up is not under test)
    raw["scheduler"]["params"]["warmup_num_steps"] = 2
    raw.pop("csv_monitor", None)
    raw["dsrl"]["batch"].update(prompts_per_rollout=8, samples_per_prompt=4, mini_batch_size=16)
    raw["dsrl"]["run"].update(rollouts=ROLLOUTS, save_every=1, keep_last=3, export_final=False, progress_bar=False)
    # The task's reward; with $DSRL_TEST_REWARD_GATE the first call waits for that file (job 1 keeps the lock).
    raw["dsrl"]["data"]["reward_fn"] = "tests/data/reward_fixture.py:reverse_gated_first_call"
    path = tmp_path / "run.json"
    path.write_text(json.dumps(raw))
    return str(path)


def single(args: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    """``python launch/train.py ARGS`` as one rank."""
    return one_rank(["launch/train.py", *args], timeout)


def rows(path, event: str) -> list[dict]:
    if not path.exists():
        return []
    return [r for r in (json.loads(x) for x in path.read_text().splitlines()) if r["event"] == event]


def test_resume_forms_lock_refusals_and_damaged_checkpoints(tmp_path):
    config = run_file(tmp_path)
    out = tmp_path / "out"
    base = ["--ds_config", config, "--dsrl.run.output_dir", str(out)]
    ckpt = out / "checkpoints"

    # 1. A second job while the first runs: refused with the first one's host and pid.
    first = subprocess.Popen(
        [*node_launcher(2, free_port()), "launch/train.py", *base, "--dsrl.run.stop_after_rollouts", "1"], cwd=REPO,
        env={**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore",
             "DSRL_TEST_REWARD_GATE": str(tmp_path / "gate")},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lock = out / ".dsrl.lock"
    deadline = time.monotonic() + 300
    while not lock.exists() and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    holder = json.loads(lock.read_text())
    second = single(base)
    assert first.poll() is None, "the first job ended before the second one reached the lock"
    (tmp_path / "gate").touch()
    log, _ = first.communicate(timeout=600)
    assert first.returncode == 0, log[-4000:]
    assert second.returncode == 2, second.stderr[-3000:]
    assert f"in use by another job: pid {holder['pid']} on host {socket.gethostname()}" in second.stderr
    assert not lock.exists()  # released at the end of the first job
    assert (ckpt / "latest").read_text() == "rollout1"

    # 2. A fresh start in the occupied directory is refused; nothing changes.
    metrics_before = (out / "metrics.jsonl").read_text()
    fresh = single([*base, "--resume", "never"])
    assert fresh.returncode == 2
    for words in ("already holds a run", "--resume auto", "--dsrl.run.output_dir", "--overwrite"):
        assert words in fresh.stderr, fresh.stderr[-2000:]
    assert (out / "metrics.jsonl").read_text() == metrics_before and (ckpt / "latest").read_text() == "rollout1"

    # 3. --resume given the run's output directory continues the run (it used to start from scratch).
    launch(["launch/train.py", *base, "--resume", str(out), "--dsrl.run.stop_after_rollouts", "1"], nprocs=2)
    assert [r["rollout"] for r in rows(out / "metrics.jsonl", "rollout")] == [1, 2]
    first_try = [(r["optimizer_step"], r["loss"]) for r in rows(out / "metrics.jsonl", "step") if r["rollout"] == 2]

    # 4. A truncated model-states file in the newest checkpoint.
    damaged = ckpt / "rollout2" / "mp_rank_00_model_states.pt"
    damaged.write_bytes(damaged.read_bytes()[:1000])
    explicit = single([*base, "--resume", str(ckpt / "rollout2")])
    assert explicit.returncode == 2, explicit.stderr[-2000:]
    assert f"checkpoint {ckpt / 'rollout2'} is damaged: {damaged} has 1000 bytes" in explicit.stderr
    assert f"--resume {ckpt / 'rollout1'}" in explicit.stderr and "Traceback" not in explicit.stderr
    proc = launch(["launch/train.py", *base, "--resume", "auto"], nprocs=2)
    assert f"{damaged} has 1000 bytes" in proc.stdout and "falling back to the previous complete checkpoint " \
        "rollout1" in proc.stdout, proc.stdout[-3000:]
    assert (ckpt / "rollout2.damaged" / "mp_rank_00_model_states.pt").exists()
    again = [(r["optimizer_step"], r["loss"]) for r in rows(out / "metrics.jsonl", "step") if r["rollout"] == 2]
    assert again == first_try  # the lost rollout recomputed exactly
    assert rows(out / "metrics.dropped.jsonl", "step")  # the first attempt's rows are kept, not deleted
    assert [r["rollout"] for r in rows(out / "metrics.jsonl", "rollout")] == [1, 2, 3]

    # 5. Garbage in `latest`: a sentence, then the newest complete checkpoint (the run is finished).
    (ckpt / "latest").write_bytes(b"\x00\xffgarbage\n")
    done = single([*base, "--resume", str(ckpt)])
    assert done.returncode == 0, done.stderr[-3000:]
    assert "is not a checkpoint tag; using the newest complete checkpoint instead" in done.stdout, done.stdout[-3000:]
    assert "already holds the finished run" in done.stdout
