"""DeepSpeed's CPU shm all-reduce segments: dsrl jobs leave none in /dev/shm, even when killed."""

from __future__ import annotations

import os

import pytest
from conftest import free_port, launch

from dsrl import cpu_shm


def _run(mode: str) -> tuple[int, list[str]]:
    port = free_port()
    proc = launch(["tests/workers/shm_worker.py", "--mode", mode], nprocs=2, timeout=300, check=False, port=port,
                  sweep_shm=False)
    left = cpu_shm.job_segments(port)
    for path in left:  # the control's leak must not pile up across runs
        os.unlink(path)
    return proc.returncode, left


def test_plain_deepspeed_leaks_but_dsrl_jobs_do_not():
    rc, left = _run("deepspeed")
    assert rc == 0 and len(left) == 2, left  # DeepSpeed 0.19.8 leaves world_size segments behind
    rc, left = _run("dsrl")
    assert rc == 0 and left == []
    rc, left = _run("dsrl_crash")
    assert rc != 0 and left == []


def test_check_room_names_the_stale_segments(monkeypatch):
    monkeypatch.setattr(cpu_shm.shutil, "disk_usage", lambda path: type("U", (), {"free": 10 * 2**20})())
    with pytest.raises(RuntimeError, match=r"needs about 66 MiB for 1 local rank.*rm /dev/shm/deepspeed_allreduce"):
        cpu_shm.check_room(1)
    monkeypatch.setattr(cpu_shm.shutil, "disk_usage", lambda path: type("U", (), {"free": 2**40})())
    cpu_shm.check_room(8)
