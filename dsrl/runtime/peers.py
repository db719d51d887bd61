"""Which ranks of the job still run: a dead or frozen rank named by role, rank and host, whichever rank it is.

Every rank records its host, process id and process start time in the job's TCP store at start-up and reads
every other rank's back (:meth:`Peers.publish`, one set and W gets, once). When something goes wrong, a rank
asks :meth:`Peers.ended` which ranks of *its own host* are gone (the process ended, is a zombie, or the pid now
belongs to another process) or frozen (stopped by SIGSTOP/SIGTSTP), and :meth:`Peers.obituary` names them in one
sentence. That is what a rank needs when the DeepSpeed launcher's SIGTERM arrives: the launcher polls its ranks
every second and SIGTERMs the others as soon as one ended with a nonzero status, usually before the survivors
noticed anything, and never says which rank it was (it prints the command line of the last rank it started).
Ranks of another host are named by the ranks of that host.

:meth:`Peers.end_after_exit` ends a rank the job declared stuck (a frozen generator) just after this process
exits, from a small detached helper: the launcher then sees this rank's own exit status first (dsrl's 1, not the
killed rank's 247) and does not wait its 30 s for a process that cannot answer SIGTERM.

Invariant: nothing here is collective or blocks on another rank after :meth:`Peers.publish`; every method is
safe to call from a signal handler's context (it reads /proc through psutil, never the store).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from dsrl.core import process_identity

ENDED, FROZEN = "has ended (its process is gone)", "is frozen (its process is stopped)"


@dataclass(frozen=True)
class Process:
    """Where a rank runs: its host name, process id and process start (:func:`dsrl.core.process_identity.started`:
    seconds from its host's boot, which a stepped wall clock does not move)."""

    host: str
    pid: int
    started: float


def this_process() -> Process:
    return Process(socket.gethostname(), os.getpid(), process_identity.started() or 0.0)


class Peers:
    """Every rank's :class:`Process` (module docstring). ``label(rank)`` names a rank's role in messages
    (``"generator 0"``; default: none, the message says ``rank r on host h``)."""

    def __init__(self, rank: int, processes: list[Process], label: Callable[[int], str] | None = None):
        self.rank, self.processes, self.label = rank, processes, label

    @classmethod
    def publish(cls, store: object, rank: int, world: int, label: Callable[[int], str] | None = None,
                prefix: str = "dsrl/process") -> Peers:
        """Record this process under ``prefix/rank`` in ``store`` (a torch.distributed store) and read every
        rank's (collective in effect: each get waits for that rank's set, within the store's timeout)."""
        me = this_process()
        store.set(f"{prefix}/{rank}", json.dumps([me.host, me.pid, me.started]))  # type: ignore[attr-defined]
        processes = []
        for r in range(world):
            host, pid, started = json.loads(store.get(f"{prefix}/{r}").decode())  # type: ignore[attr-defined]
            processes.append(Process(str(host), int(pid), float(started)))
        peers = cls(rank, processes, label)
        _CURRENT[:] = [peers]
        return peers

    @classmethod
    def of_default_group(cls) -> Peers:
        """:meth:`publish` over the default process group's store (a colocated job: every rank trains)."""
        import torch.distributed as dist
        from torch.distributed.distributed_c10d import _get_default_store

        return cls.publish(_get_default_store(), dist.get_rank(), dist.get_world_size())

    @property
    def hosts(self) -> list[str]:
        return [p.host for p in self.processes]

    def describe(self, rank: int) -> str:
        """'generator 0 (rank 2 on host a)', or 'rank 2 on host a' without a label."""
        where = f"rank {rank} on host {self.processes[rank].host}" if rank < len(self.processes) else f"rank {rank}"
        return f"{self.label(rank)} ({where})" if self.label is not None else where

    def state(self, rank: int) -> str | None:
        """:data:`ENDED`, :data:`FROZEN`, or None (running, or on another host: not known here)."""
        import psutil

        proc = self.processes[rank]
        if proc.host != socket.gethostname():
            return None
        try:
            if not process_identity.same(proc.pid, proc.started):
                return ENDED
            p = psutil.Process(proc.pid)
            if p.status() in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD):
                return ENDED
            if p.status() in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP):
                return FROZEN
        except psutil.NoSuchProcess:
            return ENDED
        except psutil.Error:
            return None
        return None

    def ended(self) -> dict[int, str]:
        """The other ranks of this host that are gone or frozen, with their :meth:`state`."""
        found = {}
        for r in range(len(self.processes)):
            if r != self.rank:
                with contextlib.suppress(Exception):
                    if (state := self.state(r)) is not None:
                        found[r] = state
        return found

    def obituary(self, wait_s: float = 0.0) -> str | None:
        """'generator 0 (rank 2 on host a) has ended (its process is gone)' for every rank :meth:`ended` finds,
        or None. ``wait_s``: look again for up to this long while none is found. A killed peer's sockets close
        while the kernel is still tearing its process down, before it shows as a zombie; an error caused by the
        closed connection can arrive in that window, so the error path waits for the exit to become visible."""
        deadline = time.monotonic() + wait_s
        found = self.ended()
        while not found and time.monotonic() < deadline:
            time.sleep(0.05)
            found = self.ended()
        if not found:
            return None
        return "; ".join(f"{self.describe(r)} {state}" for r, state in sorted(found.items()))

    def speaks_for_host(self, ended: dict[int, str] | None = None) -> bool:
        """Whether this rank is the lowest rank of its host that has not ended: the one that reports this host's
        findings (so a message is printed once per host, not once per rank)."""
        ended = self.ended() if ended is None else ended
        here = self.processes[self.rank].host
        return min(r for r, p in enumerate(self.processes) if p.host == here and r not in ended) == self.rank

    def end_after_exit(self, ranks: list[int], delay_s: float = 1.5) -> list[int]:
        """SIGKILL each of ``ranks`` that runs on this host ``delay_s`` after this process has exited (module
        docstring), if its pid still belongs to it; returns the ranks that will be ended."""
        here = socket.gethostname()
        targets = [(r, self.processes[r]) for r in ranks if r != self.rank and self.processes[r].host == here]
        if not targets:
            return []
        args = json.dumps({"delay": delay_s, "targets": [[p.pid, p.started] for _, p in targets],
                           "identity": process_identity.__file__})
        try:
            helper = subprocess.Popen([sys.executable, "-c", _ENDER, args], stdin=subprocess.PIPE,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, close_fds=True,
                                      start_new_session=True)
            helper.wait()  # the intermediate exits at once; its child waits, detached, for this process's end
        except OSError:
            return []
        _KEEP.append(helper.stdin)  # the write end closes when this process exits (however it exits)
        return [r for r, _ in targets]


def current() -> Peers | None:
    """The job's :class:`Peers` in this process (the last published), or None: for the entry point's last word on
    an error that lost a peer outside any phase."""
    return _CURRENT[-1] if _CURRENT else None


_CURRENT: list[Peers] = []
_KEEP: list[object] = []
_ENDER = r"""
import json, os, signal, sys, time
for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(s, signal.SIG_IGN)
if os.fork():
    os._exit(0)
args = json.loads(sys.argv[1])
try:
    while os.read(0, 64):
        pass
except OSError:
    pass
time.sleep(args["delay"])
import importlib.util
spec = importlib.util.spec_from_file_location("process_identity", args["identity"])
identity = importlib.util.module_from_spec(spec)
spec.loader.exec_module(identity)
for pid, started in args["targets"]:
    if identity.same(pid, started):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
"""
