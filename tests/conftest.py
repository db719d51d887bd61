"""Shared test helpers: launch real multi-process DeepSpeed jobs on the CPU accelerator (gloo)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from dsrl import cpu_shm

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_NUM_THREADS", "1")
REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args: list[str], nprocs: int, timeout: float = 600, env: dict | None = None,
           check: bool = True, port: int | None = None, sweep_shm: bool = True) -> subprocess.CompletedProcess:
    """`deepspeed --num_gpus N ARGS...` from the repo root; a hang fails after ``timeout`` seconds.

    Afterwards any DeepSpeed CPU shm segment of the job's port is removed (dsrl unlinks its own;
    this covers workers that never reach dsrl), unless ``sweep_shm`` is False.
    """
    port = port or free_port()
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(nprocs),
           "--master_port", str(port), *args]
    # Workers import this checkout's dsrl (and tests/ helpers) whatever is installed.
    pythonpath = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    full_env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONWARNINGS": "ignore", "PYTHONPATH": pythonpath,
                **(env or {})}
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout)
    finally:
        if sweep_shm:
            for path in cpu_shm.job_segments(port):
                os.unlink(path)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}"
        )
    return proc


def write_json(path: Path, obj: dict) -> Path:
    path.write_text(json.dumps(obj, indent=1))
    return path


@pytest.fixture
def repo() -> Path:
    return REPO
