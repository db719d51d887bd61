"""Which process a pid names: the pid with its start counted from boot, a stamp that never moves.

psutil's ``create_time()`` is the boot time plus the process's start, and Linux's boot time (``btime`` in
``/proc/stat``) is the wall clock minus the uptime: it moves whenever the wall clock is stepped (NTP, a resumed VM).
Two readings of one live process can then differ by seconds, and a watcher that compares them takes a live
launcher for a dead one (CI, 2026-12-07: both ranks of a job took their launcher for ended 22 s into start-up
and stopped themselves). The start in clock ticks since boot (field 22 of ``/proc/PID/stat``) is what psutil
itself uses to tell a reused pid from its first owner; :func:`started` returns it in seconds. Elsewhere than Linux
it falls back to psutil's ``create_time()``.

This file imports nothing outside the standard library (and psutil off Linux): the detached helper of
:meth:`dsrl.runtime.peers.Peers.end_after_exit` loads it by path, without the package.
"""

from __future__ import annotations

import os
import sys

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def started(pid: int | None = None) -> float | None:
    """Seconds from boot to the start of process ``pid`` (default: this one), or None when there is no such
    process. Equal for every reading of one process whatever the wall clock does; compare with :func:`same`."""
    pid = os.getpid() if pid is None else int(pid)
    if pid <= 0:
        return None
    if sys.platform.startswith("linux"):
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            return None
        # The name (field 2) is in parentheses and may hold spaces or ")": split after the last ")".
        return int(stat.rsplit(b")", 1)[1].split()[19]) / _TICKS
    try:
        import psutil

        return float(psutil.Process(pid).create_time())
    except Exception:  # noqa: BLE001 - gone, or not ours to read: no identity
        return None


def same(pid: int, stamp: float | None) -> bool:
    """Whether ``pid`` still names the process whose :func:`started` was ``stamp`` (False once it ended and when
    its pid was reused)."""
    now = started(pid)
    tolerance = 0.5 / _TICKS if sys.platform.startswith("linux") else 1.0  # ticks are exact; epoch times are not
    return now is not None and stamp is not None and abs(now - float(stamp)) < tolerance
