"""Which ranks of the job still run, on real processes (dsrl.runtime.peers):

- a rank's process that exited, is a zombie, or whose pid now belongs to another process has ended; a stopped one
  is frozen; a running one, or one on another host, is not reported; the sentence names role, rank and host;
- a rank declared stuck is ended only after the caller's process has exited (so the launcher sees the caller's
  status first), and only if its pid still belongs to it (planted: a pid recorded with another start time).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from dsrl.core import process_identity
from dsrl.runtime.peers import ENDED, FROZEN, Peers, Process, this_process

HOST = socket.gethostname()


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def _process(p: subprocess.Popen) -> Process:
    return Process(HOST, p.pid, process_identity.started(p.pid))


def test_ended_frozen_and_running_ranks_are_told_apart():
    me, running, stopped, dead = this_process(), _sleeper(), _sleeper(), _sleeper()
    records = [me, _process(running), _process(stopped), _process(dead), Process("elsewhere", 1, 0.0),
               Process(HOST, os.getpid(), me.started - 100.0)]  # the last: a pid that now belongs to another process
    try:
        stopped.send_signal(signal.SIGSTOP)
        dead.kill()
        dead.wait()
        time.sleep(0.2)
        peers = Peers(0, records, label=lambda r: "generator 0" if r == 2 else f"trainer {r}")
        assert peers.ended() == {2: FROZEN, 3: ENDED, 5: ENDED}
        assert peers.obituary() == (f"generator 0 (rank 2 on host {HOST}) {FROZEN}; trainer 3 (rank 3 on host "
                                    f"{HOST}) {ENDED}; trainer 5 (rank 5 on host {HOST}) {ENDED}")
        assert peers.speaks_for_host() and not Peers(1, records).speaks_for_host()
        assert Peers(0, records[:2]).obituary() is None
    finally:
        for p in (running, stopped):
            p.kill()
            p.wait()



def test_an_error_path_waits_for_a_killed_peer_to_show_as_ended():
    """A killed rank's sockets close before its process shows as gone (CI, stop 47: the gloo error arrived first and
    the message named no rank). ``obituary(wait_s)`` looks again until the exit is visible; without the wait
    (planted: ``wait_s=0``) the same moment names nobody."""
    me, victim = this_process(), _sleeper()
    try:
        peers = Peers(0, [me, _process(victim)], label=lambda r: f"trainer {r}")
        assert peers.obituary() is None  # running
        killer = subprocess.Popen([sys.executable, "-c", f"import os, signal, time; time.sleep(0.3); "
                                   f"os.kill({victim.pid}, signal.SIGKILL)"])
        assert peers.obituary(wait_s=0) is None  # the planted fault: looked too early, names no one
        assert peers.obituary(wait_s=10.0) == f"trainer 1 (rank 1 on host {HOST}) {ENDED}"
        killer.wait()
    finally:
        victim.kill()
        victim.wait()

CALLER = r"""
import json, sys, time
from dsrl.runtime.peers import Peers, Process, this_process
target = Process(*json.loads(sys.argv[1]))
print(Peers(0, [this_process(), target]).end_after_exit([1], delay_s=0.3), flush=True)
time.sleep(1.0)
"""


@pytest.mark.parametrize("same_process", [True, False])
def test_a_stuck_rank_is_ended_only_after_the_caller_exited(same_process):
    target = _sleeper()
    record = _process(target)
    if not same_process:  # planted: the recorded start time is another process's: its pid is not the rank's
        record = Process(record.host, record.pid, record.started - 100.0)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    try:
        caller = subprocess.Popen([sys.executable, "-c", CALLER, json.dumps([record.host, record.pid,
                                                                            record.started])],
                                  env=env, stdout=subprocess.PIPE, text=True)
        assert caller.stdout.readline().strip() == "[1]"
        time.sleep(0.5)
        assert target.poll() is None  # the caller still runs: nothing ended yet
        caller.wait(timeout=30)
        deadline = time.monotonic() + 30
        while target.poll() is None and time.monotonic() < deadline and same_process:
            time.sleep(0.1)
        time.sleep(0.0 if same_process else 1.5)
        assert (target.poll() == -signal.SIGKILL) if same_process else target.poll() is None
    finally:
        target.kill()
        target.wait()


def _epoch_identity(pid=None):
    """The identity dsrl used before 2026-12-07: psutil's create_time, boot time + start (planted below)."""
    try:
        return psutil.Process(pid).create_time()
    except psutil.NoSuchProcess:
        return None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the stamp counted from boot is Linux's")
@pytest.mark.parametrize("planted", [False, True])
def test_a_stepped_wall_clock_ends_no_live_process(monkeypatch, tmp_path, planted):
    """NTP steps the wall clock by 5 s, which moves Linux's boot time and so psutil's create_time: the launcher
    watch, the peers' obituary and the output lock still see their live processes alive, and still see them
    ended once they exit (planted: the epoch create_time as identity takes all three for ended; CI of
    2026-12-07 stopped a job 22 s into start-up on it)."""
    from dsrl.checkpoint import output_lock
    from dsrl.runtime import stop

    if planted:
        monkeypatch.setattr(process_identity, "started", _epoch_identity)
    launcher = _sleeper()
    try:
        time.sleep(0.1)
        stamp = process_identity.started(launcher.pid)
        lock = {"host": HOST, "pid": launcher.pid, "pid_started_since_boot": stamp}
        peers = Peers(0, [this_process(), Process(HOST, launcher.pid, stamp)])
        real_boot = psutil._pslinux.boot_time
        monkeypatch.setattr(psutil._pslinux, "boot_time", lambda: real_boot() + 5.0)
        seen_alive = (not stop._gone(launcher.pid, stamp), peers.ended() == {}, output_lock._alive(lock))
        assert seen_alive == ((False, False, False) if planted else (True, True, True))
    finally:
        launcher.kill()
        launcher.wait()
    assert stop._gone(launcher.pid, stamp) and peers.ended() == {1: ENDED} and not output_lock._alive(lock)


def test_only_a_lost_connection_waits_for_the_peer_to_show_as_ended():
    """The watchdog's messages look for an ended peer for up to ENDED_VISIBLE_S after a closed connection (stop 47),
    and look once after a plain timeout (a hung peer is running: waiting would only delay the message)."""
    from dsrl.runtime.watchdog import ENDED_VISIBLE_S, Watch

    class Looks:
        waits: list[float] = []

        def obituary(self, wait_s: float = 0.0) -> str | None:
            self.waits.append(wait_s)
            return None

    watch, looks = Watch(60.0), Looks()
    watch.peers = looks
    assert watch._ended(RuntimeError("[gloo] pair.cc:553 Connection closed by peer [127.0.0.1]:1234")) == ""
    assert watch._ended(RuntimeError("Rank 1 failed to pass monitoredBarrier in 60000 ms")) == ""
    assert looks.waits == [ENDED_VISIBLE_S, 0.0]
