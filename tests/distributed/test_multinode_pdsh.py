"""Multi-node launch through DeepSpeed's pdsh runner, on a real sshd and pdsh over loopback.

Two "nodes", ``127.0.0.1`` and ``127.0.0.2``, are served by a private sshd (see
:mod:`pdsh_cluster`); ``deepspeed --hostfile H --launcher pdsh`` opens a real ssh session to each
and starts one rank per node there. The tests check that

* the exactness self-check passes across the two nodes (ZeRO-0 and ZeRO-2, world size 2);
* the main training job gives the same per-step losses over pdsh (2 nodes x 1 slot) as with the
  single-node launcher (``--num_gpus 2``);
* an unreachable host makes the launch fail with a recognisable message within a bounded time and
  leaves no process behind, and the ``dsrl.cli.launch_env check-hosts`` preflight names it in seconds;
* settings that DeepSpeed does not forward by itself (``DS_ACCELERATOR``, ``DSRL_LOG_LEVEL``) reach
  the remote ranks through a ``.deepspeed_env`` written by :mod:`dsrl.cli.launch_env`, and nothing else
  leaks through.

Every launch runs in a temporary working directory that holds the hostfile and ``.deepspeed_env``
(the runner reads ``./.deepspeed_env`` and ``~/.deepspeed_env``; neither the repository nor ``~`` is
touched). The launcher is never sent SIGINT/SIGTERM: DeepSpeed's pdsh kill path runs ``pkill -f``
with a pattern that matches *every* DeepSpeed launch on a host, which on loopback includes other
jobs on this machine. A hung launch is killed by process group and remote processes by pid under the
private sshd instead.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import EXTENDED, REPO
from pdsh_cluster import HOSTS, UNREACHABLE_HOST, Cluster, free_port_on_hosts, pdsh_cluster

from dsrl.cli import launch_env
from dsrl.cli.launch_env import LaunchEnvError

pytestmark = EXTENDED  # the extended tier (tests/conftest.py)

TRAIN = REPO / "launch" / "train.py"
MAIN_CONFIG = REPO / "configs" / "tiny_grpo_cpu.json"
CHECK_CONFIG = REPO / "configs" / "check_cpu.json"
TOL = 1e-6

# Everything a rank must see identically on every node and in the single-node reference run.
RANK_ENV = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}

PROBE = '''\
"""Per-rank probe: join the job, then record what this rank sees in rank<R>.json."""
import json, os, sys

timeout_s = os.environ.get("DSRL_TEST_INIT_TIMEOUT_S")
if timeout_s:
    from datetime import timedelta

    import deepspeed

    deepspeed.init_distributed(timeout=timedelta(seconds=float(timeout_s)), verbose=False)
else:
    from dsrl.backends.deepspeed.engine import ensure_distributed

    ensure_distributed()
import torch.distributed as dist

keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "CROSS_RANK", "DS_ACCELERATOR", "DSRL_LOG_LEVEL",
        "DSRL_NOT_FORWARDED", "SSH_CONNECTION", "OMP_NUM_THREADS"]
out = {k: os.environ.get(k) for k in keys}
out["executable"] = os.path.realpath(sys.executable)
out["dist_world_size"] = dist.get_world_size()
rank = dist.get_rank()
with open(os.path.join(sys.argv[-1], f"rank{rank}.json"), "w") as f:
    json.dump(out, f)
dist.barrier()
'''


# --------------------------------------------------------------------------------------------
# helpers


@dataclass
class Launch:
    """The outcome of one ``deepspeed`` launch."""

    returncode: int
    stdout: str
    stderr: str
    wall_s: float

    @property
    def output(self) -> str:
        return f"{self.stdout}\n{self.stderr}"

    def tail(self, n: int = 6000) -> str:
        return f"--- stdout ---\n{self.stdout[-n:]}\n--- stderr ---\n{self.stderr[-n:]}"


def base_env() -> dict[str, str]:
    """The launching shell's environment: dsrl importable from any directory, same numerics."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSRL_")}
    env["PYTHONPATH"] = f"{REPO}{os.pathsep}{env['PYTHONPATH']}" if env.get("PYTHONPATH") else str(REPO)
    env["PYTHONWARNINGS"] = "ignore"
    env.update(RANK_ENV)
    return env


def run_deepspeed(runner_args: list[str], cwd: Path, env: dict[str, str], timeout: float,
                  cluster: Cluster | None = None) -> Launch:
    """``python -m deepspeed.launcher.runner ARGS`` in its own process group.

    On timeout the whole local group (runner, pdsh, ssh clients) gets SIGKILL, so DeepSpeed's
    SIGTERM handler with its machine-wide ``pkill -f`` never runs; remote processes are then ended
    by pid under the private sshd.
    """
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", *runner_args]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        if cluster is not None:
            cluster.kill_sessions()
        raise AssertionError(f"launch did not finish within {timeout:.0f} s: {' '.join(cmd)}\n"
                             f"{Launch(-9, out, err, timeout).tail()}") from None
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # stray pdsh/ssh clients of this launch only
    return Launch(proc.returncode, out, err, time.monotonic() - start)


def pdsh_args(hostfile: Path, *user_args: str) -> list[str]:
    return ["--hostfile", str(hostfile), "--launcher", "pdsh", "--master_addr", HOSTS[0],
            "--master_port", str(free_port_on_hosts()), *user_args]


def node_ran(launch: Launch, host: str) -> bool:
    """Whether ``host``'s node launcher reported a rank that exited successfully (pdsh prefixes
    every remote line with the host it came from)."""
    return any(line.startswith(f"{host}: ") and "exits successfully" in line for line in launch.stdout.splitlines())


def step_losses(metrics: Path) -> dict[int, float]:
    """``{optimizer_step: loss}`` from the ``"event": "step"`` records of a metrics.jsonl."""
    out = {}
    for line in metrics.read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            if rec.get("event") == "step":
                out[int(rec["optimizer_step"])] = float(rec["loss"])
    return out


# --------------------------------------------------------------------------------------------
# fixtures


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with pdsh_cluster() as c:
        yield c


@pytest.fixture
def launch_dir(tmp_path: Path, cluster: Cluster) -> Iterator[Path]:
    """A working directory holding the hostfile and a ``.deepspeed_env`` from dsrl.cli.launch_env.

    ``PATH`` is forwarded too, so remote ranks find the same ninja/compiler as local ones (a
    different ninja makes DeepSpeed rebuild its JIT op, ~40 s here).
    """
    cwd = tmp_path / "launch"
    cwd.mkdir()
    cluster.write_hostfile(cwd / "hostfile")
    launch_env.write_deepspeed_env(cwd, {**RANK_ENV, "PATH": os.environ["PATH"]})
    yield cwd
    left = cluster.wait_no_leftovers()
    if left:
        listing = cluster.describe(left)
        cluster.kill_sessions()
        pytest.fail(f"processes left behind on the nodes:\n{listing}")


# --------------------------------------------------------------------------------------------
# a) exactness self-check across two nodes


def test_check_two_nodes_pdsh(cluster: Cluster, launch_dir: Path) -> None:
    out = launch_dir / "check.json"
    res = run_deepspeed(pdsh_args(launch_dir / "hostfile", "--module", "dsrl.check", "--ds_config", str(CHECK_CONFIG),
                                  "--zero_stages", "0,2", "--splits", "uneven,pad_rank", "--json", str(out)),
                        launch_dir, cluster.env(base_env()), timeout=240, cluster=cluster)
    assert res.returncode == 0, res.tail()
    last = [ln for ln in res.stdout.splitlines() if "max relative gradient error:" in ln]
    assert len(last) == 1 and last[0].startswith(f"{HOSTS[0]}: "), res.tail()
    assert float(last[0].rsplit(":", 1)[1]) <= TOL, last[0]
    results = json.loads(out.read_text())["results"]
    assert {r["stage"] for r in results} == {0, 2} and len(results) == 2 * 4 * 2
    assert results and all(r["world_size"] == 2 for r in results), results[:2]
    assert max(r["error"] for r in results if r["method"] == "dsrl") <= TOL
    for node_rank, host in enumerate(HOSTS):
        assert f"{host}: " in res.stdout and f"node_rank={node_rank}" in res.stdout
        assert node_ran(res, host), f"no successful rank on {host}\n{res.tail()}"


# --------------------------------------------------------------------------------------------
# b) main job: pdsh (2 nodes x 1 slot) equals the single-node launcher (--num_gpus 2)


def test_main_job_pdsh_matches_single_node(cluster: Cluster, launch_dir: Path, tmp_path: Path) -> None:
    if not (TRAIN.exists() and MAIN_CONFIG.exists()):
        pytest.skip("main job not available yet")
    # Two rollouts are 4 optimizer steps; keep the config's LR warmup shorter than that (dsrl refuses
    # a schedule that never decays). Both launches use this same derived config.
    config = json.loads(MAIN_CONFIG.read_text())
    warmup = config.get("scheduler", {}).get("params", {})
    if "warmup_num_steps" in warmup:
        warmup["warmup_num_steps"] = min(int(warmup["warmup_num_steps"]), 2)
    run_file = tmp_path / MAIN_CONFIG.name
    run_file.write_text(json.dumps(config, indent=1))
    job = [str(TRAIN), "--ds_config", str(run_file), "--dsrl.run.rollouts", "2", "--dsrl.sft.steps", "0"]
    multi_dir, single_dir = tmp_path / "multi", tmp_path / "single"
    multi = run_deepspeed(pdsh_args(launch_dir / "hostfile", *job, "--dsrl.run.output_dir", str(multi_dir)),
                          launch_dir, cluster.env(base_env()), timeout=300, cluster=cluster)
    assert multi.returncode == 0, multi.tail()
    for host in HOSTS:
        assert node_ran(multi, host), f"no successful rank on {host}\n{multi.tail()}"
    single = run_deepspeed(["--num_gpus", "2", "--master_port", str(free_port_on_hosts()), *job,
                            "--dsrl.run.output_dir", str(single_dir)], launch_dir, base_env(), timeout=300)
    assert single.returncode == 0, single.tail()
    got, want = step_losses(multi_dir / "metrics.jsonl"), step_losses(single_dir / "metrics.jsonl")
    assert want, f"no step records in {single_dir / 'metrics.jsonl'}"
    assert sorted(got) == sorted(want), (got, want)
    for step, loss in want.items():
        assert math.isfinite(loss)
        assert abs(got[step] - loss) <= TOL * max(abs(loss), 1e-12), (step, got[step], loss)
    print(f"per-step losses bitwise identical: {got == want}; pdsh {multi.wall_s:.1f} s, "
          f"single node {single.wall_s:.1f} s")


def test_disaggregated_job_across_two_nodes_matches_colocated(cluster: Cluster, launch_dir: Path,
                                                              tmp_path: Path) -> None:
    """rollout.placement = "disaggregated" over pdsh: the trainer on the first node, the generator on the second
    (k = 0), gives the per-step losses of a colocated single-rank job bit for bit (docs/async.md)."""
    config = json.loads(MAIN_CONFIG.read_text())
    config["scheduler"]["params"]["warmup_num_steps"] = 2
    config["dsrl"]["algorithm"]["max_staleness"] = 0
    colocated = tmp_path / "colocated.json"
    colocated.write_text(json.dumps(config))
    config["dsrl"]["rollout"].update(placement="disaggregated", generator_ranks=1)
    split = tmp_path / "split.json"
    split.write_text(json.dumps(config))
    job = ["--dsrl.run.rollouts", "3", "--dsrl.sft.steps", "2", "--dsrl.batch.prompts_per_rollout", "8",
           "--dsrl.batch.mini_batch_size", "32"]
    multi_dir, single_dir = tmp_path / "multi", tmp_path / "single"
    multi = run_deepspeed(pdsh_args(launch_dir / "hostfile", str(TRAIN), "--ds_config", str(split), *job,
                                    "--dsrl.run.output_dir", str(multi_dir)),
                          launch_dir, cluster.env(base_env()), timeout=300, cluster=cluster)
    assert multi.returncode == 0, multi.tail()
    for host in HOSTS:
        assert node_ran(multi, host), f"no successful rank on {host}\n{multi.tail()}"
    single = run_deepspeed(["--num_gpus", "1", "--master_port", str(free_port_on_hosts()), str(TRAIN), "--ds_config",
                            str(colocated), *job, "--dsrl.run.output_dir", str(single_dir)], launch_dir, base_env(),
                           timeout=300)
    assert single.returncode == 0, single.tail()
    got, want = step_losses(multi_dir / "metrics.jsonl"), step_losses(single_dir / "metrics.jsonl")
    assert want and got == want, (got, want)


# --------------------------------------------------------------------------------------------
# c) an unreachable host


def test_first_host_unreachable_fails_fast(cluster: Cluster, launch_dir: Path) -> None:
    """The runner's own ssh pre-check (first host only) refuses the launch before anything starts."""
    cluster.write_hostfile(launch_dir / "hostfile", [UNREACHABLE_HOST, HOSTS[0]])
    (launch_dir / "probe.py").write_text(PROBE)
    res = run_deepspeed(pdsh_args(launch_dir / "hostfile", "probe.py", str(launch_dir)), launch_dir,
                        cluster.env(base_env()), timeout=60, cluster=cluster)
    assert res.returncode != 0, res.tail()
    assert f"host={UNREACHABLE_HOST} was not reachable via ssh" in res.stderr, res.tail()
    assert res.wall_s < 30, res.wall_s
    assert not list(launch_dir.glob("rank*.json"))


def test_later_host_unreachable_fails_bounded(cluster: Cluster, launch_dir: Path) -> None:
    """A later unreachable host is reported by pdsh at once; the started ranks give up at their
    rendezvous timeout, the launch exits non-zero and nothing is left running."""
    cluster.write_hostfile(launch_dir / "hostfile", [HOSTS[0], UNREACHABLE_HOST])
    launch_env.write_deepspeed_env(launch_dir, {"DSRL_TEST_INIT_TIMEOUT_S": "5"}, merge=True)
    (launch_dir / "probe.py").write_text(PROBE)
    res = run_deepspeed(pdsh_args(launch_dir / "hostfile", "probe.py", str(launch_dir)), launch_dir,
                        cluster.env(base_env()), timeout=90, cluster=cluster)
    assert res.returncode != 0, res.tail()
    assert f"{UNREACHABLE_HOST}: ssh: connect to host {UNREACHABLE_HOST}" in res.stderr, res.tail()
    assert f"{UNREACHABLE_HOST}: ssh exited with exit code 255" in res.stderr, res.tail()
    assert "1/2 clients joined" in res.stderr, res.tail()  # rank 0's rendezvous timed out
    assert not list(launch_dir.glob("rank*.json"))
    assert cluster.wait_no_leftovers() == []


def test_train_job_preflight_names_the_unreachable_host_without_environment_variables(cluster: Cluster,
                                                                                        launch_dir: Path) -> None:
    """The training job with a later host unreachable and no DSRL_* variable: the started rank waits in the preflight
    for the bound of its run file (run.join_timeout_s; 60 s when unset, tests/unit/test_reliability_units.py), then
    ends the job with one sentence naming the host, the launcher and the fix; the output directory is not touched and
    nothing is left running."""
    cluster.write_hostfile(launch_dir / "hostfile", [HOSTS[0], UNREACHABLE_HOST])
    config = json.loads(MAIN_CONFIG.read_text())
    config["dsrl"]["run"]["join_timeout_s"] = 8
    run_file = launch_dir / "run.json"
    run_file.write_text(json.dumps(config))
    env = cluster.env(base_env())
    assert not any(k.startswith("DSRL_") for k in env)
    out = launch_dir / "out"
    res = run_deepspeed(pdsh_args(launch_dir / "hostfile", str(TRAIN), "--ds_config", str(run_file),
                                  "--dsrl.run.output_dir", str(out)), launch_dir, env, timeout=120, cluster=cluster)
    assert res.returncode != 0, res.tail()
    sentence = [ln for ln in res.output.splitlines() if "dsrl: error: preflight:" in ln]
    assert sentence == [
        f"{HOSTS[0]}: dsrl: error: preflight: host {UNREACHABLE_HOST} never checked in: 1 of the job's 2 ranks "
        "(rank 1) is missing within 8 s (dsrl.run.join_timeout_s), launched with DeepSpeed's pdsh launcher; fix: make "
        f"{UNREACHABLE_HOST} reachable by ssh from the launching node with the same Python environment and launch "
        "directory (pdsh's own lines above say what failed; `python -m dsrl.cli.launch_env check-hosts HOSTFILE` "
        "checks every host in seconds), or remove it from the hostfile; nothing was written to the output "
        "directory"], res.tail()
    assert not out.exists()
    assert res.wall_s < 100, res.wall_s
    assert cluster.wait_no_leftovers() == []
    print(f"pdsh: an unreachable later host ended the job {res.wall_s:.1f} s after the launch (preflight bound 8 s)")


def test_preflight_names_unreachable_host(cluster: Cluster, launch_dir: Path) -> None:
    env = cluster.env(base_env())
    problems = launch_env.check_hosts([HOSTS[0], UNREACHABLE_HOST, HOSTS[1]], cwd=launch_dir, environ=env)
    assert list(problems) == [UNREACHABLE_HOST], problems
    assert "Connection refused" in problems[UNREACHABLE_HOST] or "exit code 255" in problems[UNREACHABLE_HOST]
    cluster.write_hostfile(launch_dir / "bad_hostfile", [UNREACHABLE_HOST])
    start = time.monotonic()
    cli = subprocess.run([sys.executable, "-m", "dsrl.cli.launch_env", "check-hosts", "bad_hostfile"], cwd=launch_dir,
                         env=env, capture_output=True, text=True, timeout=60)
    assert cli.returncode == 1 and f"host {UNREACHABLE_HOST} is not usable" in cli.stderr, cli.stderr
    assert time.monotonic() - start < 30


# --------------------------------------------------------------------------------------------
# d) environment forwarding through .deepspeed_env


def test_env_reaches_remote_ranks_via_deepspeed_env(cluster: Cluster, launch_dir: Path) -> None:
    launch_env.write_deepspeed_env(launch_dir, {"DSRL_LOG_LEVEL": "debug"}, merge=True)
    text = (launch_dir / ".deepspeed_env").read_text()
    assert all(line and "=" in line and not line.startswith("#") for line in text.split("\n")[:-1]), text
    (launch_dir / "probe.py").write_text(PROBE)
    env = cluster.env(base_env())
    env["DSRL_NOT_FORWARDED"] = "1"  # set for the launcher only: must not reach the ranks
    env.pop("DSRL_LOG_LEVEL", None)
    res = run_deepspeed(pdsh_args(launch_dir / "hostfile", "probe.py", str(launch_dir)), launch_dir, env,
                        timeout=120, cluster=cluster)
    assert res.returncode == 0, res.tail()
    for rank, host in enumerate(HOSTS):
        seen = json.loads((launch_dir / f"rank{rank}.json").read_text())
        assert seen["DS_ACCELERATOR"] == "cpu" and seen["DSRL_LOG_LEVEL"] == "debug", seen
        assert seen["DSRL_NOT_FORWARDED"] is None, seen
        assert seen["OMP_NUM_THREADS"] == "1", seen
        assert seen["dist_world_size"] == 2 and seen["WORLD_SIZE"] == "2" and seen["CROSS_RANK"] == str(rank)
        # Started through an ssh session to this node's own address.
        assert seen["SSH_CONNECTION"] and seen["SSH_CONNECTION"].split()[2] == host, seen
        assert seen["executable"] == os.path.realpath(sys.executable), seen


def test_runner_crashes_on_blank_line_in_deepspeed_env(cluster: Cluster, launch_dir: Path) -> None:
    """Why dsrl.cli.launch_env never writes a blank line: DeepSpeed's runner dies on one."""
    env_file = launch_dir / ".deepspeed_env"
    env_file.write_text(env_file.read_text() + "\n")
    with pytest.raises(LaunchEnvError, match="blank"):
        launch_env.write_deepspeed_env(launch_dir, {"DSRL_LOG_LEVEL": "info"}, merge=True)
    res = run_deepspeed(pdsh_args(launch_dir / "hostfile", "probe.py", str(launch_dir)), launch_dir,
                        cluster.env(base_env()), timeout=60, cluster=cluster)
    assert res.returncode != 0 and "not enough values to unpack" in res.stderr, res.tail()
