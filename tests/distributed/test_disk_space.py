"""A full disk during a save, a read-only checkpoint directory, and a ZeRO-0 resume on another rank count
(issue 12, items 4 and 2), on a small tmpfs (needs root: mount; skipped loudly otherwise).

1. 2 ranks, ZeRO-0, on a 1.5 MiB tmpfs: the start warns that one checkpoint (estimated) does not fit
   twice; rollout 1's checkpoint fits, rollout 2's save hits ENOSPC: the job ends with a sentence naming
   the path and the cause, the partial rollout2 is gone and rollout1 stays ``latest``;
2. the same file system remounted read-only: a resume is refused before any work, naming the directory;
3. remounted larger: 1 rank resumes the 2-rank ZeRO-0 checkpoint, saying so in one line, and finishes.
"""

from __future__ import annotations

import json
import subprocess

import pytest
from conftest import EXTENDED, REPO, launch, one_rank

pytestmark = EXTENDED  # the extended tier (tests/conftest.py)

ROLLOUTS = 3


def _mount(target, options: str) -> None:
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(target)], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"!!! DISK-FULL TEST NOT RUN: cannot mount a tmpfs here ({proc.stderr.strip()}); it needs root "
                    "with CAP_SYS_ADMIN !!!")


def _single(args: list[str]) -> subprocess.CompletedProcess:
    return one_rank(["launch/train.py", *args], timeout=300)


def test_disk_full_read_only_and_zero0_resume_on_fewer_ranks(tmp_path):
    raw = json.loads((REPO / "configs" / "tiny_grpo_cpu.json").read_text())
    raw["dsrl"]["sft"] = {"steps": 0}  # RL only (the default config's warm-up is not under test)
    raw["zero_optimization"] = {"stage": 0}
    raw["scheduler"]["params"]["warmup_num_steps"] = 2
    raw.pop("csv_monitor", None)
    raw["dsrl"]["batch"].update(prompts_per_rollout=8, samples_per_prompt=4, mini_batch_size=16)
    raw["dsrl"]["run"].update(rollouts=ROLLOUTS, save_every=1, keep_last=3, progress_bar=False)
    config = tmp_path / "run.json"
    config.write_text(json.dumps(raw))
    disk = tmp_path / "disk"
    disk.mkdir()
    _mount(disk, "size=1536k")
    try:
        out = disk / "out"
        args = ["launch/train.py", "--ds_config", str(config), "--dsrl.run.output_dir", str(out)]
        full = launch(args, nprocs=2, check=False)
        assert full.returncode != 0
        ckpt = out / "checkpoints"
        assert "one checkpoint of this model needs about" in full.stdout  # the start-up warning
        assert (f"saving checkpoint rollout2 to {ckpt / 'rollout2'} failed on rank" in full.stderr
                and "no space left on the device" in full.stderr
                and f"the previous checkpoint {ckpt / 'rollout1'} stays latest" in full.stderr), full.stderr[-3000:]
        assert "Traceback" not in full.stderr
        assert (ckpt / "latest").read_text() == "rollout1" and not (ckpt / "rollout2").exists()

        subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
        ro = _single(args[1:])
        assert ro.returncode == 2 and "is not writable (Read-only file system)" in ro.stderr, ro.stderr[-2000:]
        assert "rollout 2/" not in ro.stdout  # refused before any work

        subprocess.run(["mount", "-o", "remount,rw,size=64m", str(disk)], check=True)
        resumed = _single(args[1:])
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert ("was written on 2 data-parallel rank(s) (ZeRO-0), this run has 1; loaded directly"
                in resumed.stdout), resumed.stdout[-3000:]
        assert (ckpt / "latest").read_text() == f"rollout{ROLLOUTS}"
        rollouts = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        assert [r["rollout"] for r in rollouts if r["event"] == "rollout"] == list(range(1, ROLLOUTS + 1))
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)
