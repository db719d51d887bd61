"""`dsrl plan` as users run it, in fresh interpreters (the in-process catalogue is tests/unit/test_bad_run_files.py):
a bad run file exits 2 with one message and no traceback, and every file in configs/ plans without any warning
with DeepSpeed's accelerator auto-detected."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

from conftest import REPO

BASE = json.loads((REPO / "configs" / "tiny_grpo_cpu.json").read_text(encoding="utf-8"))


def _with(path: str, value) -> dict:
    raw = json.loads(json.dumps(BASE))
    *parents, leaf = path.split(".")
    node = raw
    for key in parents:
        node = node[key]
    node[leaf] = value
    return raw


def test_real_cli_exit_code_and_no_traceback(tmp_path):
    """The contract end to end: exit status 2, one message on stderr, nothing on stdout, no traceback."""
    for field, value in [("optimizer.params.lr", math.nan), ("zero_optimization.stage", 4)]:
        path = tmp_path / "run.json"
        path.write_text(json.dumps(_with(field, value)))
        proc = subprocess.run([sys.executable, "-m", "dsrl.cli", "plan", "--ds_config", str(path), "--world_size", "2"],
                              cwd=REPO, capture_output=True, text=True, timeout=300)
        text = proc.stdout + proc.stderr
        assert proc.returncode == 2, text
        assert "Traceback" not in text and field in text and proc.stdout == "", text


def test_every_shipped_config_plans_without_a_warning():
    """`dsrl plan` on each file in configs/ (one interpreter, DeepSpeed's accelerator auto-detected as a user
    would run it) prints the plan and no warning at all."""
    configs = sorted(str(p) for p in (REPO / "configs").glob("*.json"))
    assert configs
    code = ("import sys; from dsrl.cli.main import main\n"
            "for c in sys.argv[1:]:\n"
            "    assert main(['plan', '--ds_config', c, '--world_size', '2']) == 0, c\n")
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    proc = subprocess.run([sys.executable, "-c", code, *configs], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env=env)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text
    assert text.count("dsrl plan for") == len(configs), text
    assert "warn" not in text.lower(), text
