"""A throwaway two-"node" cluster on loopback for testing DeepSpeed's pdsh launcher for real.

:func:`pdsh_cluster` starts a private ``sshd`` that listens only on ``127.0.0.1`` and
``127.0.0.2`` (both are this machine: all of 127/8 is loopback on Linux) on a free unprivileged
port, with its own host key and its own authorised client key, all in a temporary directory. The
DeepSpeed runner then treats the two addresses as two nodes: ``pdsh`` opens a real ssh session to
each, and every rank is started by that node's own ``deepspeed.launcher.launch``.

Nothing outside the temporary directory is changed: the user's ``~/.ssh`` is never read or
written. Clients are pointed at the private sshd through an ssh config file, passed

* to ``pdsh`` via ``PDSH_SSH_ARGS_APPEND="-F <config>"`` (pdsh puts it before the host name), and
* to the runner's own plain ``ssh`` calls (the reachability pre-check ``ssh HOST hostname`` and the
  ``hostname -I`` master-address probe) via a two-line ``ssh`` wrapper that is put first on ``PATH``
  and adds the same ``-F <config>``.

The config pins the port, the client key, ``BatchMode yes``, ``ConnectTimeout`` (so an unreachable
host fails in seconds) and disables host-key checking against ``~/.ssh/known_hosts``.

Every process a "remote" command starts is a descendant of the private sshd, so
:meth:`Cluster.leftovers` finds exactly the processes this cluster launched, and teardown ends them
by pid: no name-based ``pkill`` that could hit other DeepSpeed jobs on the machine. The sshd is
always stopped when the context exits, on failure too.

If ``sshd`` or ``pdsh`` is missing they are installed with ``apt-get`` when running as root;
otherwise the calling test is skipped with a loud reason.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

HOSTS: tuple[str, str] = ("127.0.0.1", "127.0.0.2")
UNREACHABLE_HOST = "127.0.0.3"  # loopback too, but the private sshd never listens there
SSHD_CANDIDATES = ("/usr/sbin/sshd", "/usr/local/sbin/sshd")
CONNECT_TIMEOUT_S = 5


def _find_sshd() -> str | None:
    found = shutil.which("sshd")
    if found:
        return found
    return next((p for p in SSHD_CANDIDATES if os.access(p, os.X_OK)), None)


def ensure_tools() -> str:
    """Path of ``sshd``; installs openssh-server and pdsh via apt-get as root, else skips loudly."""
    sshd, pdsh = _find_sshd(), shutil.which("pdsh")
    if sshd and pdsh and shutil.which("ssh-keygen") and shutil.which("ssh"):
        return sshd
    missing = ", ".join(n for n, p in (("sshd", sshd), ("pdsh", pdsh)) if not p) or "ssh client tools"
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        pytest.skip(f"!!! MULTI-NODE PDSH TESTS NOT RUN: {missing} missing and cannot be installed here "
                    "(needs root and apt-get). Install openssh-server and pdsh to run them. !!!")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", "openssh-server", "openssh-client", "pdsh"]
    if subprocess.run(install, env=env, capture_output=True, timeout=600).returncode != 0:
        subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, timeout=600)
        proc = subprocess.run(install, env=env, capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            pytest.skip(f"!!! MULTI-NODE PDSH TESTS NOT RUN: apt-get could not install openssh-server/pdsh: "
                        f"{proc.stderr[-500:]} !!!")
    sshd = _find_sshd()
    if not sshd or not shutil.which("pdsh"):
        pytest.skip("!!! MULTI-NODE PDSH TESTS NOT RUN: sshd/pdsh still missing after apt-get install !!!")
    return sshd


def _port_free(port: int) -> bool:
    for host in HOSTS:
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                return False
    return True


def free_port_on_hosts() -> int:
    """An unprivileged TCP port that is currently free on every loopback "node" address."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind((HOSTS[0], 0))
            port = s.getsockname()[1]
        if port > 1024 and _port_free(port):
            return port
    raise RuntimeError("no free port on the loopback node addresses")


def _listening(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


@dataclass
class Cluster:
    """A running private sshd plus everything a client needs to reach it."""

    root: Path
    port: int
    ssh_config: Path
    bin_dir: Path
    sshd: subprocess.Popen
    hosts: tuple[str, ...] = HOSTS
    log: Path = field(default_factory=Path)

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """Environment for running ``deepspeed``/``pdsh``/``ssh`` against this cluster."""
        env = dict(os.environ if base is None else base)
        env["PATH"] = f"{self.bin_dir}{os.pathsep}{env.get('PATH', '')}"
        env["PDSH_RCMD_TYPE"] = "ssh"
        env["PDSH_SSH_ARGS_APPEND"] = f"-F {self.ssh_config}"
        return env

    def write_hostfile(self, path: Path, hosts: Sequence[str] | None = None, slots: int = 1) -> Path:
        """A DeepSpeed hostfile with one ``HOST slots=N`` line per host."""
        path.write_text("".join(f"{h} slots={slots}\n" for h in (hosts or self.hosts)))
        return path

    def ssh(self, host: str, command: str, timeout: float = 30) -> subprocess.CompletedProcess:
        """Run ``command`` on ``host`` through the private sshd."""
        return subprocess.run(["ssh", "-F", str(self.ssh_config), host, command], capture_output=True,
                              text=True, timeout=timeout, env=self.env())

    def leftovers(self) -> list[psutil.Process]:
        """Processes still running under the private sshd (remote sessions and what they started)."""
        try:
            return [p for p in psutil.Process(self.sshd.pid).children(recursive=True) if p.is_running()
                    and p.status() != psutil.STATUS_ZOMBIE]
        except psutil.NoSuchProcess:
            return []

    def wait_no_leftovers(self, timeout: float = 15.0) -> list[psutil.Process]:
        """Wait until no remote process is left; returns whatever is still alive after ``timeout``."""
        deadline = time.monotonic() + timeout
        left = self.leftovers()
        while left and time.monotonic() < deadline:
            time.sleep(0.2)
            left = self.leftovers()
        return left

    def kill_sessions(self) -> None:
        """End every process started through this sshd, by pid (children first, then sessions)."""
        procs = self.leftovers()
        for p in reversed(procs):
            with contextlib.suppress(psutil.Error):
                p.terminate()
        _, alive = psutil.wait_procs(procs, timeout=5)
        for p in alive:
            with contextlib.suppress(psutil.Error):
                p.kill()

    def describe(self, procs: Sequence[psutil.Process]) -> str:
        out = []
        for p in procs:
            with contextlib.suppress(psutil.Error):
                out.append(f"{p.pid}: {' '.join(p.cmdline())[:200]}")
        return "\n".join(out)


def _write_configs(root: Path, port: int) -> tuple[Path, Path, Path]:
    host_key, client_key = root / "ssh_host_ed25519_key", root / "client_ed25519"
    for key in (host_key, client_key):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "dsrl-pdsh-test", "-f", str(key)],
                       check=True, capture_output=True, timeout=60)
    authorized = root / "authorized_keys"
    authorized.write_text(Path(f"{client_key}.pub").read_text())
    authorized.chmod(0o600)
    sshd_config = root / "sshd_config"
    listen = "".join(f"ListenAddress {h}:{port}\n" for h in HOSTS)
    sshd_config.write_text(
        f"{listen}"
        f"HostKey {host_key}\n"
        f"AuthorizedKeysFile {authorized}\n"
        f"PidFile {root / 'sshd.pid'}\n"
        "PermitRootLogin prohibit-password\n"
        "PubkeyAuthentication yes\n"
        "PasswordAuthentication no\n"
        "KbdInteractiveAuthentication no\n"
        "StrictModes no\n"
        "UsePAM no\n"
        "X11Forwarding no\n"
        "AllowTcpForwarding no\n"
        "AllowAgentForwarding no\n"
        "PermitTunnel no\n"
        "PrintMotd no\n"
        "MaxStartups 64\n"
        "LogLevel ERROR\n"
    )
    ssh_config = root / "ssh_config"
    ssh_config.write_text(
        "Host *\n"
        f"  Port {port}\n"
        f"  IdentityFile {client_key}\n"
        "  IdentitiesOnly yes\n"
        "  BatchMode yes\n"
        "  PasswordAuthentication no\n"
        "  StrictHostKeyChecking no\n"
        "  UserKnownHostsFile /dev/null\n"
        "  GlobalKnownHostsFile /dev/null\n"
        f"  ConnectTimeout {CONNECT_TIMEOUT_S}\n"
        "  LogLevel ERROR\n"
    )
    bin_dir = root / "bin"
    bin_dir.mkdir()
    real_ssh = shutil.which("ssh") or "/usr/bin/ssh"
    wrapper = bin_dir / "ssh"
    wrapper.write_text(f'#!/bin/sh\nexec {real_ssh} -F {ssh_config} "$@"\n')
    wrapper.chmod(0o755)
    return sshd_config, ssh_config, bin_dir


@contextlib.contextmanager
def pdsh_cluster(startup_timeout: float = 20.0) -> Iterator[Cluster]:
    """Start the private loopback sshd; yields a :class:`Cluster`; always stops it on exit."""
    sshd_bin = ensure_tools()
    if os.geteuid() == 0:
        # sshd run as root needs its privilege-separation directory (normally made by the service unit).
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="dsrl-pdsh-"))
    proc: subprocess.Popen | None = None
    try:
        port = free_port_on_hosts()
        sshd_config, ssh_config, bin_dir = _write_configs(root, port)
        check = subprocess.run([sshd_bin, "-t", "-f", str(sshd_config)], capture_output=True, text=True, timeout=30)
        if check.returncode != 0:
            raise RuntimeError(f"sshd rejected the test config: {check.stderr}")
        log = root / "sshd.log"
        with open(log, "wb") as log_fd:
            proc = subprocess.Popen([sshd_bin, "-D", "-e", "-f", str(sshd_config)], stdout=log_fd,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + startup_timeout
        while not all(_listening(h, port) for h in HOSTS):
            if proc.poll() is not None:
                raise RuntimeError(f"sshd exited ({proc.returncode}): {log.read_text()[-2000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"sshd did not listen on {HOSTS} port {port}: {log.read_text()[-2000:]}")
            time.sleep(0.1)
        cluster = Cluster(root=root, port=port, ssh_config=ssh_config, bin_dir=bin_dir, sshd=proc, log=log)
        probe = cluster.ssh(HOSTS[1], f"{sys.executable} -c 'import sys; print(sys.executable)'")
        if probe.returncode != 0:
            raise RuntimeError(f"ssh to the private sshd failed: {probe.stderr}\n{log.read_text()[-2000:]}")
        yield cluster
    finally:
        if proc is not None:
            with contextlib.suppress(psutil.Error):
                Cluster(root=root, port=0, ssh_config=root, bin_dir=root, sshd=proc).kill_sessions()
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        shutil.rmtree(root, ignore_errors=True)
