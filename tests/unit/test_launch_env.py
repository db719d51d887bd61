"""dsrl.cli.launch_env without a cluster: the .deepspeed_env writer and parser, hostfile checks, CLI."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

from dsrl.cli import launch_env
from dsrl.cli.launch_env import LaunchEnvError


def base_env() -> dict[str, str]:
    """A shell environment with this checkout's dsrl importable and no DSRL_* variables."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSRL_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env["PYTHONWARNINGS"] = "ignore"
    return env


def _runner_parse(text: str) -> dict[str, str]:
    """DeepSpeed 0.19.8's reading of .deepspeed_env (runner.main + MultiNodeRunner.add_export)."""
    out = {}
    for var in text.splitlines(keepends=True):
        key, val = var.split("=", maxsplit=1)
        out[key.strip()] = val.strip()
    return out


def test_deepspeed_env_has_no_blank_or_comment_lines(tmp_path: Path) -> None:
    values = {"DS_ACCELERATOR": "cpu", "DSRL_LOG_LEVEL": "debug", "EMPTY": "", "PATH": "/a/b:/c",
              "DSRL_LIST": "a,b=c@d%e+f", "DSRL_SPACED": "two words"}
    path = launch_env.write_deepspeed_env(tmp_path, values)
    assert path == tmp_path / ".deepspeed_env"
    text = path.read_text()
    lines = text.split("\n")
    assert lines[-1] == "" and len(lines) == len(values) + 1
    for line in lines[:-1]:
        assert line.strip() and not line.lstrip().startswith("#") and "=" in line, line
    assert _runner_parse(text) == values
    assert launch_env.parse_deepspeed_env(text) == values
    assert sorted(p.name for p in tmp_path.iterdir()) == [".deepspeed_env"]  # no temp file left
    assert launch_env.format_deepspeed_env({}) == ""


@pytest.mark.parametrize("value", ["a\nb", "a\r", "x\x00", 'say "hi"', "$HOME", "`id`", "a\\b", " lead", "trail "])
def test_deepspeed_env_rejects_unsafe_values(tmp_path: Path, value: str) -> None:
    with pytest.raises(LaunchEnvError):
        launch_env.write_deepspeed_env(tmp_path, {"DSRL_X": value})
    assert not (tmp_path / ".deepspeed_env").exists()


@pytest.mark.parametrize("key", ["", "1ABC", "A-B", "A B", "A=B", "A\nB"])
def test_deepspeed_env_rejects_bad_names(key: str) -> None:
    with pytest.raises(LaunchEnvError):
        launch_env.format_deepspeed_env({key: "1"})


@pytest.mark.parametrize("text", ["A=1\n\nB=2\n", "# comment\nA=1\n", "A=1\nNOEQUALS\n", "   \n"])
def test_parse_deepspeed_env_rejects_what_crashes_the_runner(text: str) -> None:
    with pytest.raises(LaunchEnvError):
        launch_env.parse_deepspeed_env(text)


def test_merge_keeps_existing_and_refuses_broken_file(tmp_path: Path) -> None:
    launch_env.write_deepspeed_env(tmp_path, {"A": "1", "B": "2"})
    launch_env.write_deepspeed_env(tmp_path, {"B": "3", "C": "4"}, merge=True)
    assert launch_env.parse_deepspeed_env((tmp_path / ".deepspeed_env").read_text()) == {"A": "1", "B": "3", "C": "4"}
    (tmp_path / ".deepspeed_env").write_text("A=1\n# note\n")
    with pytest.raises(LaunchEnvError, match=":2:"):
        launch_env.write_deepspeed_env(tmp_path, {"B": "2"}, merge=True)


def test_collect_env_forwards_dsrl_and_defaults_only() -> None:
    environ = {"DS_ACCELERATOR": "cpu", "DSRL_LOG_LEVEL": "debug", "OMP_NUM_THREADS": "4", "HOME": "/root",
               "PYTHONPATH": "/x", "RANDOM_THING": "1"}
    got = launch_env.collect_env(environ, extra={"DSRL_EXTRA": "y"})
    assert got == {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "4", "DSRL_LOG_LEVEL": "debug", "DSRL_EXTRA": "y"}
    assert launch_env.runner_forwards("PYTHONPATH") and not launch_env.runner_forwards("DS_ACCELERATOR")


def test_cli_write_and_check(tmp_path: Path) -> None:
    env = {**base_env(), "DSRL_LOG_LEVEL": "warning"}
    proc = subprocess.run([sys.executable, "-m", "dsrl.cli.launch_env", "write", "--out", str(tmp_path),
                           "--set", "DSRL_RUN=abc"], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    got = launch_env.parse_deepspeed_env((tmp_path / ".deepspeed_env").read_text())
    assert got["DSRL_LOG_LEVEL"] == "warning" and got["DSRL_RUN"] == "abc" and got["DS_ACCELERATOR"] == "cpu"
    bad = subprocess.run([sys.executable, "-m", "dsrl.cli.launch_env", "write", "--out", str(tmp_path),
                          "--set", "DSRL_RUN=$(id)"], env=env, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "DSRL_RUN" in bad.stderr
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# two nodes\nnode-a slots=2\n\nnode-b slots=2\n")
    ok = subprocess.run([sys.executable, "-m", "dsrl.cli.launch_env", "check-hostfile", str(hostfile)], env=env,
                        capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and "node-b: slots=2 global ranks 2..3" in ok.stdout, ok.stdout + ok.stderr


def test_hostfile_validation() -> None:
    hosts = launch_env.parse_hostfile("# cluster\nnode-a slots=8\n\nnode-b   slots=8  # spare\n")
    assert hosts == {"node-a": 8, "node-b": 8}
    assert launch_env.global_ranks({"a": 2, "b": 3}) == {"a": [0, 1], "b": [2, 3, 4]}
    for bad, why in [("a slots=1\na slots=2\n", "twice"), ("a slot=1\n", "HOST slots=N"), ("a\n", "HOST slots=N"),
                     ("a slots=0\n", "at least 1"), ("", "no 'HOST"), ("localhost slots=1\nb slots=1\n", "localhost")]:
        with pytest.raises(LaunchEnvError, match=why):
            launch_env.parse_hostfile(bad)


def test_values_the_shell_free_launchers_would_mangle_are_refused(tmp_path: Path) -> None:
    """Measured on the loopback Slurm cluster (DeepSpeed 0.19.8, Slurm 22.05): a .deepspeed_env value ``x y`` reached
    the ranks of ``deepspeed --launcher slurm`` as ``"x y"`` (the runner's quotes, kept by srun) and ``a,b`` as ``a``
    (srun's --export list is cut at commas); mpirun -x, without a shell either, keeps the quotes too."""
    for launcher in ("slurm", "openmpi"):
        with pytest.raises(LaunchEnvError, match=f"double quotes; --launcher {launcher} passes them on literally"):
            launch_env.write_deepspeed_env(tmp_path, {"DSRL_A": "x y"}, launcher=launcher)
    with pytest.raises(LaunchEnvError, match="comma.*--export=ALL"):
        launch_env.write_deepspeed_env(tmp_path, {"DSRL_B": "a,b"}, launcher="slurm")
    assert not (tmp_path / ".deepspeed_env").exists()
    launch_env.write_deepspeed_env(tmp_path, {"DSRL_A": "x y", "DSRL_B": "a,b"})  # pdsh: the remote shell unquotes
    launch_env.write_deepspeed_env(tmp_path, {"DSRL_B": "a,b", "MASTER_ADDR": "node-0"}, launcher="openmpi")
    check = subprocess.run([sys.executable, "-m", "dsrl.cli.launch_env", "check-env", str(tmp_path / ".deepspeed_env"),
                            "--launcher", "slurm"], env=base_env(), capture_output=True, text=True, timeout=60)
    assert check.returncode == 2 and "DSRL_B" in check.stderr and "comma" in check.stderr, check.stderr
