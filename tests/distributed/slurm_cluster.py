"""A throwaway two-node Slurm cluster on loopback for testing Slurm launches for real.

:func:`slurm_cluster` starts, all under a temporary directory and on free unprivileged ports:

* a private ``munged`` (its own key and socket; Slurm is pointed at it with ``AuthInfo=socket=...``);
* ``slurmctld`` and two ``slurmd`` daemons (``slurmd -N``), one per node: ``localhost`` at ``127.0.0.1`` and this
  machine's host name at ``127.0.0.2``. Both names resolve here, so the master address dsrl derives from a step's
  first node works as on a real cluster; every task runs on this machine, but Slurm places, numbers and signals
  them as on two nodes (``SLURMD_NODENAME``, ``SLURM_NODEID``, ``SLURM_GTIDS`` differ).

The configuration is the one known to work on these machines: ``ProctrackType=proctrack/linuxproc``,
``TaskPlugin=task/none``, no accounting, state/spool/logs in the temporary directory, daemons started with
``-f``. Clients (``srun``, ``sbatch``, ``scancel``, ``squeue``, ``scontrol``) reach it through ``SLURM_CONF`` in
:meth:`SlurmCluster.env`; the machine's own ``/etc/slurm`` and ``/etc/munge`` are never read or written.

Teardown cancels the cluster's jobs, waits for them, then stops every daemon by the pid it wrote; nothing is killed
by name. If Slurm or munge is missing they are installed with ``apt-get`` (Debian's ``slurm-wlm`` and ``munge``)
when running as root; otherwise the calling test is skipped with a loud reason.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

TOOLS = ("slurmctld", "slurmd", "srun", "sbatch", "scancel", "squeue", "scontrol", "sinfo", "munged")
SBIN = ("/usr/sbin", "/usr/local/sbin")


def _which(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    return next((f"{d}/{name}" for d in SBIN if os.access(f"{d}/{name}", os.X_OK)), None)


def ensure_tools() -> dict[str, str]:
    """Paths of the Slurm and munge programs; installs ``slurm-wlm`` and ``munge`` via apt-get as root, else skips."""
    found = {t: _which(t) for t in TOOLS}
    if all(found.values()):
        return found  # type: ignore[return-value]
    missing = ", ".join(t for t, p in found.items() if not p)
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        pytest.skip(f"!!! SLURM TESTS NOT RUN: {missing} missing and cannot be installed here (needs root and "
                    "apt-get). Install Debian's slurm-wlm and munge to run them. !!!")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", "slurm-wlm", "munge"]
    if subprocess.run(install, env=env, capture_output=True, timeout=900).returncode != 0:
        subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, timeout=600)
        proc = subprocess.run(install, env=env, capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            pytest.skip(f"!!! SLURM TESTS NOT RUN: apt-get could not install slurm-wlm/munge: {proc.stderr[-500:]} !!!")
    found = {t: _which(t) for t in TOOLS}
    if not all(found.values()):
        pytest.skip(f"!!! SLURM TESTS NOT RUN: {', '.join(t for t, p in found.items() if not p)} still missing after "
                    "apt-get install !!!")
    return found  # type: ignore[return-value]


def _free_ports(n: int) -> list[int]:
    ports: list[int] = []
    while len(ports) < n:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in ports and port > 1024:
            ports.append(port)
    return ports


@dataclass
class SlurmCluster:
    """A running private Slurm cluster and what a client needs to reach it."""

    root: Path
    conf: Path
    nodes: tuple[str, str]
    tools: dict[str, str]

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """Environment for running Slurm's clients (and jobs: ``sbatch``/``srun`` export it) against this cluster."""
        env = dict(os.environ if base is None else base)
        env["SLURM_CONF"] = str(self.conf)
        return env

    def run(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run(list(args), env=self.env(), capture_output=True, text=True, timeout=timeout)

    def jobs(self) -> list[str]:
        """Ids of the jobs still pending or running."""
        out = self.run(self.tools["squeue"], "-h", "-o", "%i").stdout
        return [j for j in out.split() if j]

    def wait_job(self, job: str, timeout: float) -> bool:
        """Wait until ``job`` left the queue; False if it is still there after ``timeout``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if job not in self.jobs():
                return True
            time.sleep(0.3)
        return False

    def exit_code(self, job: str) -> str:
        """A finished job's ``ExitCode`` (``status:signal``) as ``scontrol show job`` reports it."""
        out = self.run(self.tools["scontrol"], "show", "job", "-o", job).stdout
        return next((f.split("=", 1)[1] for f in out.split() if f.startswith("ExitCode=")), "?")

    def cancel_all(self, timeout: float = 60) -> None:
        jobs = self.jobs()
        if jobs:
            self.run(self.tools["scancel"], *jobs)
            deadline = time.monotonic() + timeout
            while self.jobs() and time.monotonic() < deadline:
                time.sleep(0.3)


def _write_conf(root: Path, munge_socket: Path, nodes: tuple[str, str], ports: list[int]) -> Path:
    ctld, node_a, node_b = ports
    host = socket.gethostname()
    conf = root / "slurm.conf"
    (root / "plugstack.conf").write_text("")
    for sub in ("state", "log", *(f"spool/{n}" for n in nodes)):
        (root / sub).mkdir(parents=True, exist_ok=True)
    conf.write_text(
        "ClusterName=dsrltest\n"
        f"SlurmctldHost={host}(127.0.0.1)\n"
        f"SlurmctldPort={ctld}\n"
        f"SlurmdPort={node_a}\n"
        "AuthType=auth/munge\nCredType=cred/munge\n"
        f"AuthInfo=socket={munge_socket}\n"
        "SlurmUser=root\nSlurmdUser=root\n"
        f"StateSaveLocation={root}/state\n"
        f"SlurmdSpoolDir={root}/spool/%n\n"
        f"SlurmctldPidFile={root}/slurmctld.pid\n"
        f"SlurmdPidFile={root}/slurmd.%n.pid\n"
        f"SlurmctldLogFile={root}/log/slurmctld.log\n"
        f"SlurmdLogFile={root}/log/slurmd.%n.log\n"
        f"PlugStackConfig={root}/plugstack.conf\n"
        "ProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\nSwitchType=switch/none\nMpiDefault=none\n"
        "SchedulerType=sched/builtin\nSelectType=select/cons_tres\nSelectTypeParameters=CR_Core\n"
        "ReturnToService=2\nSlurmctldTimeout=30\nSlurmdTimeout=30\nInactiveLimit=0\nKillWait=30\nMinJobAge=600\n"
        "JobCompType=jobcomp/none\nJobAcctGatherType=jobacct_gather/none\n"
        "AccountingStorageType=accounting_storage/none\nMailProg=/bin/true\n"
        # This order (slurmd refuses the other: "Duplicated NodeHostName"); allocations list them sorted by name.
        f"NodeName={nodes[1]} NodeHostname={host} NodeAddr=127.0.0.2 Port={node_b} CPUs=2 State=UNKNOWN\n"
        f"NodeName={nodes[0]} NodeHostname={host} NodeAddr=127.0.0.1 Port={node_a} CPUs=2 State=UNKNOWN\n"
        f"PartitionName=test Nodes={nodes[0]},{nodes[1]} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES\n")
    return conf


def _stop_pid_file(path: Path, timeout: float = 15) -> None:
    """Stop the daemon whose pid ``path`` holds (SIGTERM, then SIGKILL), if it still runs."""
    with contextlib.suppress(OSError, ValueError, psutil.Error):
        proc = psutil.Process(int(path.read_text().split()[0]))
        proc.terminate()
        try:
            proc.wait(timeout)
        except psutil.TimeoutExpired:
            proc.kill()


@contextlib.contextmanager
def slurm_cluster(startup_timeout: float = 60.0) -> Iterator[SlurmCluster]:
    """Start the private cluster; yields a :class:`SlurmCluster`; always stops it on exit."""
    tools = ensure_tools()
    host = socket.gethostname()
    try:
        resolvable = all(socket.gethostbyname(n) for n in ("localhost", host)) and host != "localhost"
    except OSError:
        resolvable = False
    if not resolvable:
        pytest.skip(f"!!! SLURM TESTS NOT RUN: this machine's host name {host!r} does not resolve (or is "
                    "'localhost'); the two-node loopback cluster names its nodes 'localhost' and the host name !!!")
    root = Path(tempfile.mkdtemp(prefix="dsrl-slurm-"))
    nodes = ("localhost", host)
    munge_socket = root / "munge.sock"
    started: list[Path] = []
    cluster = None
    try:
        key = root / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        subprocess.run([tools["munged"], "--force", f"--socket={munge_socket}", f"--key-file={key}",
                        f"--pid-file={root / 'munged.pid'}", f"--log-file={root / 'munged.log'}",
                        f"--seed-file={root / 'munged.seed'}"], check=True, capture_output=True, timeout=30)
        started.append(root / "munged.pid")
        conf = _write_conf(root, munge_socket, nodes, _free_ports(3))
        subprocess.run([tools["slurmctld"], "-f", str(conf)], check=True, capture_output=True, timeout=30)
        started.append(root / "slurmctld.pid")
        for node in nodes:
            subprocess.run([tools["slurmd"], "-f", str(conf), "-N", node], check=True, capture_output=True, timeout=30)
            started.append(root / f"slurmd.{node}.pid")
        cluster = SlurmCluster(root, conf, nodes, tools)
        deadline = time.monotonic() + startup_timeout
        while True:
            states = cluster.run(tools["sinfo"], "-h", "-N", "-o", "%N %t").stdout.split()
            if states.count("idle") == 2:
                break
            if time.monotonic() > deadline:
                log = "\n".join(p.read_text()[-1500:] for p in (root / "log").glob("*.log"))
                raise RuntimeError(f"the loopback Slurm cluster did not come up ({states}):\n{log}")
            time.sleep(0.3)
        # The nodes in allocation order (task 0 runs on the first), as a 2-node step reports them.
        probe = cluster.run(tools["srun"], "-N2", "-n2", "-l", "printenv", "SLURMD_NODENAME", timeout=120)
        placed = dict(line.split(": ", 1) for line in probe.stdout.strip().splitlines())
        if probe.returncode != 0 or sorted(placed) != ["0", "1"]:
            raise RuntimeError(f"a 2-node step failed on the loopback Slurm cluster: {probe.stdout}{probe.stderr}")
        cluster.nodes = (placed["0"].strip(), placed["1"].strip())
        yield cluster
    finally:
        if cluster is not None:
            with contextlib.suppress(Exception):
                cluster.cancel_all()
        for pid_file in reversed(started):
            _stop_pid_file(pid_file)
        shutil.rmtree(root, ignore_errors=True)
