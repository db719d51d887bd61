"""Slurm and OpenMPI launches for real, on loopback: the default job, a preemption and its resume, and the preflight.

- **Slurm**: a two-node cluster of this machine (:mod:`slurm_cluster`: slurmctld and a slurmd for each of the nodes
  ``localhost`` and this host's name). docs/multinode.md's batch script runs as written through ``sbatch``
  (``deepspeed --launcher slurm`` on the allocation), is preempted with ``scancel --signal=TERM`` (a checkpoint is
  committed within the stop grace) and resubmitted (``--resume auto`` is the default), and its metrics equal the
  single-node run's (``deepspeed --num_gpus 2``) bit for bit. A plain ``srun -N2 -n2`` does too, a 2-tasks-per-node
  probe sees the ranks Slurm gave, and a task that cannot start (its node's Python missing) ends the job within the
  preflight's bound, named by its Slurm node.
- **OpenMPI**: ``deepspeed --launcher openmpi`` over two loopback hosts served by the private sshd of
  :mod:`pdsh_cluster` (``mpirun`` starts its daemons over ssh, as on a cluster), ``MASTER_ADDR`` forwarded through
  ``.deepspeed_env``: the same metrics, SIGTERM to the ranks and a resume; an unreachable host ends the launch at
  once; a rank that cannot reach rank 0 ends the job within the bound.

Metrics are compared row by row over ``sft``, ``step`` and ``rollout`` rows without timing and peak-memory fields.
Every launch runs from a temporary directory (or writes only under one); processes are found and ended by pid.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from conftest import EXTENDED, REPO, launch
from pdsh_cluster import HOSTS, UNREACHABLE_HOST, Cluster, free_port_on_hosts, pdsh_cluster
from slurm_cluster import SlurmCluster, slurm_cluster

from dsrl.cli import launch_env

pytestmark = EXTENDED  # the extended tier (tests/conftest.py)

TRAIN = REPO / "launch" / "train.py"
CONFIG = REPO / "configs" / "tiny_grpo_cpu.json"
GATED_REWARD = f"{REPO}/tests/data/reward_fixture.py:reverse_gated_first_call"  # the task's reward; a gate on demand
# The default job, shortened: 2 warm-up steps + 5 rollouts x 2 steps = 12 optimizer steps (> the config's 10 warm-up).
JOB = ["--dsrl.run.rollouts", "5", "--dsrl.sft.steps", "2", "--dsrl.run.progress_bar", "false",
       "--dsrl.data.reward_fn", GATED_REWARD]
RANK_ENV = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
BOUND_S = 10  # the preflight's bound in the tests that make a host fail (the default is 60 s)
VOLATILE = re.compile(r"(_s|_mib)$|^peak|^generator_idle_frac$")

PROBE = '''\
import json, os, sys
from dsrl.backends.deepspeed.engine import ensure_distributed
ensure_distributed()
import torch.distributed as dist
keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE", "MASTER_ADDR", "MASTER_PORT",
        "SLURMD_NODENAME"]
out = {k: os.environ.get(k) for k in keys}
out["dist_rank"], out["dist_world_size"] = dist.get_rank(), dist.get_world_size()
with open(os.path.join(sys.argv[1], f"rank{dist.get_rank()}.json"), "w") as f:
    json.dump(out, f)
dist.barrier()
'''


# --------------------------------------------------------------------------------------------
# helpers


def metric_rows(output_dir: Path) -> list[dict]:
    """The ``sft``, ``step`` and ``rollout`` rows of a run's metrics.jsonl without timing and peak-memory fields."""
    rows = []
    for line in (output_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if row.get("event") in ("sft", "step", "rollout"):
            rows.append({k: v for k, v in row.items() if not VOLATILE.search(k)})
    return rows


def assert_same_metrics(got_dir: Path, want: list[dict]) -> None:
    got = metric_rows(got_dir)
    assert len(got) == len(want) == 2 + 5 * 2 + 5, (len(got), len(want))
    for mine, theirs in zip(got, want, strict=True):
        assert mine == theirs, {k: (mine.get(k), theirs.get(k)) for k in set(mine) | set(theirs)
                                if mine.get(k) != theirs.get(k)}


def base_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DSRL_", "SLURM_", "OMPI_"))}
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env["PYTHONWARNINGS"] = "ignore"
    env.update(RANK_ENV)
    return env


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.2)


def has_rows(output_dir: Path, event: str) -> bool:
    path = output_dir / "metrics.jsonl"
    return path.exists() and f'"event": "{event}"' in path.read_text()


def assert_preempted_after_rollout_1(output_dir: Path, log: str) -> None:
    assert "stop requested (SIGTERM received)" in log, log[-4000:]
    assert "stopped on request (SIGTERM received) after rollout 1 with a committed checkpoint" in log, log[-4000:]
    ckpt = output_dir / "checkpoints"
    assert (ckpt / "latest").read_text() == "rollout1" and (ckpt / "rollout1" / "COMPLETE").exists()
    assert not (output_dir / ".dsrl.lock").exists()  # released on the way out


def run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float) -> tuple[subprocess.CompletedProcess, float]:
    """``cmd`` in its own process group (killed as a group on timeout); returns the result and the wall time."""
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"{' '.join(cmd)} did not finish within {timeout:.0f} s:\n{out[-3000:]}\n{err[-3000:]}"
                             ) from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err), time.monotonic() - start


@pytest.fixture(scope="module")
def single_node(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """The reference: the same job with DeepSpeed's single-node launcher, 2 ranks."""
    out = tmp_path_factory.mktemp("single") / "out"
    launch([str(TRAIN), "--ds_config", str(CONFIG), *JOB, "--dsrl.run.output_dir", str(out)], nprocs=2, timeout=400,
           env=RANK_ENV)
    return metric_rows(out)


# --------------------------------------------------------------------------------------------
# Slurm


def documented_batch_script() -> str:
    """docs/multinode.md's batch script, exactly as written."""
    doc = (REPO / "docs" / "multinode.md").read_text()
    return re.search(r"```bash\n(#!/bin/bash\n#SBATCH .*?)```", doc, re.S).group(1)


@pytest.fixture(scope="module")
def slurm() -> Iterator[SlurmCluster]:
    with slurm_cluster() as cluster:
        yield cluster


def sbatch(slurm: SlurmCluster, script: Path, log: Path, args: list[str], env: dict[str, str]) -> str:
    """Submit ``script ARGS`` from the repository (as the docs say), its log to ``log``; returns the job id."""
    proc = subprocess.run([slurm.tools["sbatch"], "--parsable", f"--output={log}", str(script), *args], cwd=REPO,
                          env=slurm.env(env), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().split(";")[0]


def test_slurm_batch_script_matches_single_node_and_resumes_after_preemption(slurm: SlurmCluster, tmp_path: Path,
                                                                               single_node: list[dict]) -> None:
    script = tmp_path / "train.sbatch"
    script.write_text(documented_batch_script())
    out, gate = tmp_path / "out", tmp_path / "gate"
    args = [*JOB, "--dsrl.run.output_dir", str(out)]
    # 1. preempted: the first reward call waits for the gate, so SIGTERM arrives inside rollout 1.
    first_log = tmp_path / "first.log"
    job = sbatch(slurm, script, first_log, args, {**base_env(), "DSRL_TEST_REWARD_GATE": str(gate)})
    wait_for(lambda: has_rows(out, "sft"), 300, "the warm-up rows (rollout 1 then waits for the gate)")
    assert slurm.run(slurm.tools["scancel"], "--signal=TERM", job).returncode == 0
    wait_for(lambda: "stop requested" in first_log.read_text(), 60, "the ranks to take the SIGTERM")
    gate.touch()
    assert slurm.wait_job(job, 120), first_log.read_text()[-3000:]
    first = first_log.read_text()
    assert "cmd = srun -n 2 --kill-on-bad-exit=1 --export=ALL," in first, first[-3000:]
    assert_preempted_after_rollout_1(out, first)
    assert "task 0: Exited with exit code 143" in first and "task 1: Exited with exit code 143" in first
    assert slurm.exit_code(job).startswith("143:"), slurm.exit_code(job)
    # 2. the same script again: resume auto (the default) continues from the checkpoint, bit for bit.
    second_log = tmp_path / "second.log"
    job = sbatch(slurm, script, second_log, args, base_env())
    assert slurm.wait_job(job, 300), second_log.read_text()[-3000:]
    assert slurm.exit_code(job) == "0:0", second_log.read_text()[-3000:]
    assert_same_metrics(out, single_node)


def test_plain_srun_one_task_per_rank(slurm: SlurmCluster, tmp_path: Path, single_node: list[dict]) -> None:
    # 2 nodes x 2 tasks: what each rank sees.
    (tmp_path / "probe.py").write_text(PROBE)
    probe, _ = run([slurm.tools["srun"], "-N2", "--ntasks-per-node=2", sys.executable, "-u", "probe.py",
                    str(tmp_path)], tmp_path, slurm.env(base_env()), timeout=240)
    assert probe.returncode == 0, probe.stdout[-3000:] + probe.stderr[-3000:]
    first, second = slurm.nodes
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    for rank, s in enumerate(seen):
        node = rank // 2
        assert (s["dist_rank"], s["dist_world_size"]) == (rank, 4), s
        assert (s["RANK"], s["LOCAL_RANK"], s["WORLD_SIZE"], s["LOCAL_SIZE"]) == (str(rank), str(rank % 2), "4", "2")
        assert (s["CROSS_RANK"], s["CROSS_SIZE"], s["SLURMD_NODENAME"]) == (str(node), "2", (first, second)[node])
        assert s["MASTER_ADDR"] == first and s["MASTER_PORT"] == seen[0]["MASTER_PORT"], s
    # 2 nodes x 1 task: the job, bit for bit the single-node run's.
    out = tmp_path / "out"
    job, _ = run([slurm.tools["srun"], "-N2", "-n2", "--kill-on-bad-exit=1", sys.executable, "-u", str(TRAIN),
                  "--ds_config", str(CONFIG), *JOB, "--dsrl.run.output_dir", str(out)], tmp_path,
                 slurm.env(base_env()), timeout=400)
    assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
    assert_same_metrics(out, single_node)


def test_slurm_task_that_cannot_start_ends_the_job_named(slurm: SlurmCluster, tmp_path: Path) -> None:
    """The second node's task fails to start (its node has no such Python: a node without the environment); srun
    runs without --kill-on-bad-exit, so only the preflight ends the first node's rank."""
    out = tmp_path / "out"
    args = f"-u {TRAIN} --ds_config {CONFIG} --dsrl.run.output_dir {out} --dsrl.run.join_timeout_s {BOUND_S}"
    programs = tmp_path / "programs.conf"
    programs.write_text(f"0 {sys.executable} {args}\n1 {tmp_path / 'missing' / 'python'} {args}\n")
    res, wall = run([slurm.tools["srun"], "-N2", "-n2", "--multi-prog", str(programs)], tmp_path,
                    slurm.env(base_env()), timeout=180)
    second = slurm.nodes[1]
    assert res.returncode != 0
    assert f"srun: error: {second}: task 1: Exited with exit code" in res.stderr, res.stderr[-3000:]
    sentence = [ln for ln in res.stderr.splitlines() if ln.startswith("dsrl: error: preflight:")]
    assert sentence == [f"dsrl: error: preflight: host {second} never checked in: 1 of the job's 2 ranks (rank 1) is "
                        f"missing within {BOUND_S} s (dsrl.run.join_timeout_s), launched with Slurm's srun (job "
                        f"{sentence[0].split('(job ')[1].split(')')[0]}); fix: see srun's error for {second} above, "
                        f"then resubmit without it (`sbatch --exclude={second}`) or have it drained, and pass "
                        "--kill-on-bad-exit=1 to srun so that a task that cannot start ends the step at once; nothing "
                        "was written to the output directory"], res.stderr[-3000:]
    assert not out.exists()
    assert wall < BOUND_S + 60, wall
    print(f"slurm: a node whose task cannot start ended the job {wall:.1f} s after srun started "
          f"(preflight bound {BOUND_S} s)")


# --------------------------------------------------------------------------------------------
# OpenMPI


@pytest.fixture(scope="module")
def mpi_hosts() -> Iterator[Cluster]:
    import shutil

    if not shutil.which("mpirun") or not shutil.which("ompi_info"):
        if os.geteuid() != 0 or not shutil.which("apt-get"):
            pytest.skip("!!! OPENMPI TESTS NOT RUN: mpirun missing and cannot be installed here (needs root and "
                        "apt-get). Install Debian's openmpi-bin to run them. !!!")
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        cmd = ["apt-get", "install", "-y", "-q", "--no-install-recommends", "openmpi-bin"]
        if subprocess.run(cmd, env=env, capture_output=True, timeout=900).returncode != 0:
            subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, timeout=600)
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
            if proc.returncode != 0:
                pytest.skip(f"!!! OPENMPI TESTS NOT RUN: apt-get could not install openmpi-bin: {proc.stderr[-500:]}")
    with pdsh_cluster() as cluster:
        yield cluster


def mpi_env(cluster: Cluster) -> dict[str, str]:
    env = cluster.env(base_env())  # mpirun reaches the second host through the private sshd
    if os.geteuid() == 0:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    return env


LO = "--mca btl_tcp_if_include lo --mca oob_tcp_if_include lo"  # this machine's interface (the runner's default: eth0)


def openmpi_launch(cluster: Cluster, cwd: Path, hosts: list[str], args: list[str],
                   forward: dict[str, str] | None = None) -> subprocess.Popen:
    """``deepspeed --launcher openmpi`` from ``cwd`` with a hostfile of ``hosts`` (one slot each) and the
    documented ``.deepspeed_env`` (MASTER_ADDR forwarded, and ``forward``); started, not waited for."""
    cluster.write_hostfile(cwd / "hostfile", hosts)
    launch_env.write_deepspeed_env(cwd, {**RANK_ENV, "PATH": os.environ["PATH"], "MASTER_ADDR": hosts[0],
                                         "MASTER_PORT": str(free_port_on_hosts()), **(forward or {})},
                                   launcher="openmpi")
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--hostfile", "hostfile", "--launcher", "openmpi",
           "--no_ssh_check", "--master_addr", hosts[0], "--launcher_args", LO, *args]
    return subprocess.Popen(cmd, cwd=cwd, env=mpi_env(cluster), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def finish(proc: subprocess.Popen, timeout: float) -> str:
    try:
        return proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError(f"the launch did not finish within {timeout:.0f} s:\n{proc.communicate()[0][-4000:]}"
                             ) from None


def training_ranks(cluster: Cluster, runner: subprocess.Popen) -> list[psutil.Process]:
    """The job's rank processes: under mpirun here, under orted (through the private sshd) on the other host."""
    procs = psutil.Process(runner.pid).children(recursive=True) + cluster.leftovers()
    return [p for p in procs if p.cmdline()[:3] == [sys.executable, "-u", str(TRAIN)]]


def test_openmpi_launcher_matches_single_node_and_resumes_after_sigterm(mpi_hosts: Cluster, tmp_path: Path,
                                                                       single_node: list[dict]) -> None:
    out, gate = tmp_path / "out", tmp_path / "gate"
    cwd = tmp_path / "launch"
    cwd.mkdir()
    args = [str(TRAIN), "--ds_config", str(CONFIG), *JOB, "--dsrl.run.output_dir", str(out)]
    runner = openmpi_launch(mpi_hosts, cwd, list(HOSTS), args, forward={"DSRL_TEST_REWARD_GATE": str(gate)})
    try:
        wait_for(lambda: has_rows(out, "sft"), 300, "the warm-up rows (rollout 1 then waits for the gate)")
        ranks = training_ranks(mpi_hosts, runner)
        assert len(ranks) == 2, [p.cmdline() for p in ranks]
        for p in ranks:  # a batch system's preemption signal: every rank gets SIGTERM
            p.send_signal(signal.SIGTERM)
        time.sleep(1.0)
        gate.touch()
        first = finish(runner, 120)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(runner.pid, signal.SIGKILL)
    assert "cmd = mpirun -n 2 -hostfile hostfile" in first and "-x MASTER_ADDR=127.0.0.1" in first, first[-3000:]
    assert_preempted_after_rollout_1(out, first)
    assert runner.returncode != 0
    second = finish(openmpi_launch(mpi_hosts, cwd, list(HOSTS), args), 400)
    assert "exported the final model" in second, second[-3000:]
    assert_same_metrics(out, single_node)
    assert mpi_hosts.wait_no_leftovers() == []


def test_openmpi_unreachable_host_ends_the_launch_at_once(mpi_hosts: Cluster, tmp_path: Path) -> None:
    out = tmp_path / "out"
    start = time.monotonic()
    log = finish(openmpi_launch(mpi_hosts, tmp_path, [HOSTS[0], UNREACHABLE_HOST],
                                [str(TRAIN), "--ds_config", str(CONFIG), "--dsrl.run.output_dir", str(out)]), 120)
    wall = time.monotonic() - start
    assert f"ssh: connect to host {UNREACHABLE_HOST}" in log and "unable to reliably start one or more daemons" in log
    assert not out.exists() and wall < 60, wall
    assert mpi_hosts.wait_no_leftovers() == []
    print(f"openmpi: an unreachable host ended the launch {wall:.1f} s after it started (mpirun, before any rank)")


def test_openmpi_rank_that_cannot_reach_rank_0_ends_the_job_within_the_bound(mpi_hosts: Cluster,
                                                                               tmp_path: Path) -> None:
    """mpirun (MPMD) gives rank 1 a MASTER_PORT nobody listens on, as a firewall would: rank 0 names the missing rank
    and the launcher within the bound, mpirun ends the rest, nothing is written."""
    out = tmp_path / "out"
    mpi_hosts.write_hostfile(tmp_path / "hostfile", list(HOSTS))
    port, closed = free_port_on_hosts(), free_port_on_hosts()
    job = [sys.executable, "-u", str(TRAIN), "--ds_config", str(CONFIG), "--dsrl.run.output_dir", str(out)]
    exports = [a for k, v in {**RANK_ENV, "PYTHONPATH": str(REPO), "MASTER_ADDR": HOSTS[0]}.items()
               for a in ("-x", f"{k}={v}")]
    # Rank 1 would give up after its own bound; a longer one leaves the word to rank 0.
    cmd = ["mpirun", "-hostfile", "hostfile", *LO.split(),
           "-n", "1", *exports, "-x", f"MASTER_PORT={port}", *job, "--dsrl.run.join_timeout_s", str(BOUND_S), ":",
           "-n", "1", *exports, "-x", f"MASTER_PORT={closed}", *job, "--dsrl.run.join_timeout_s", str(BOUND_S * 6)]
    res, wall = run(cmd, tmp_path, mpi_env(mpi_hosts), timeout=180)
    output = res.stdout + res.stderr
    assert res.returncode != 0
    assert ("dsrl: error: preflight: 1 of the job's 2 ranks (rank 1) is missing (those that checked in run on "
            f"{os.uname().nodename}; OpenMPI's mpirun does not say where the others were placed) within {BOUND_S} s "
            "(dsrl.run.join_timeout_s), launched with OpenMPI's mpirun; fix: check that every host of the hostfile "
            f"reaches {HOSTS[0]}:{port}") in output, output[-3000:]
    assert not out.exists() and wall < BOUND_S + 60, wall
    assert mpi_hosts.wait_no_leftovers() == []
    print(f"openmpi: a rank that cannot reach rank 0 ended the job {wall:.1f} s after mpirun started "
          f"(preflight bound {BOUND_S} s)")
