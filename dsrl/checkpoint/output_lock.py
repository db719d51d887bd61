"""The lock that keeps two jobs out of one output directory.

Rank 0 of a job creates ``<output_dir>/.dsrl.lock`` with ``O_CREAT | O_EXCL`` (atomic on local file
systems and on NFSv3+), holding its host name, pid and the pid's start time. Only rank 0 takes it,
so a shared file system seen by every node holds exactly one lock per job.

- A second job finds the file and is refused with the first job's host and pid.
- A lock of this host whose process is gone (or whose pid now belongs to another process, told by the
  start time) is stale: it is taken over, and the start says so.
- A lock of another host cannot be checked from here; the message names the file to delete when that
  job is known to be gone (e.g. its node crashed).
- The lock is removed when the run ends (also on exceptions, via ``atexit``); a ``kill -9`` leaves a
  stale lock that the next start on the same host takes over.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import socket
import time
from typing import Any

from dsrl.config import ConfigError
from dsrl.core import process_identity

LOCK_NAME = ".dsrl.lock"
_held: list[OutputLock] = []


def release_all() -> None:
    """Release every lock this process holds (before an exit that skips ``atexit``)."""
    for lock in list(_held):
        lock.release()


def _alive(info: dict[str, Any]) -> bool:
    """Whether the lock's process still runs on this host (same pid *and* same start, counted from boot: a wall
    clock stepped since the lock was taken does not make its live holder look stale). A lock written before the
    start was recorded this way counts as held while its pid exists."""
    pid = int(info.get("pid", -1))
    if pid <= 0 or process_identity.started(pid) is None:
        return False
    recorded = info.get("pid_started_since_boot")
    return recorded is None or process_identity.same(pid, recorded)


class OutputLock:
    """A held lock on one output directory (see the module docstring)."""

    def __init__(self, path: str, info: dict[str, Any], taken_over: str | None):
        self.path = path
        self.info = info
        self.taken_over = taken_over
        self._released = False
        _held.append(self)
        atexit.register(self.release)

    @staticmethod
    def read(path: str) -> dict[str, Any] | None:
        try:
            with open(path, encoding="utf-8") as f:
                info = json.load(f)
            return info if isinstance(info, dict) else {}
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {}  # being written right now, or garbage

    @classmethod
    def acquire(cls, output_dir: str) -> OutputLock:
        """Take the lock of ``output_dir`` or raise ConfigError naming its holder."""
        path = os.path.join(output_dir, LOCK_NAME)
        host = socket.gethostname()
        info = {"host": host, "pid": os.getpid(), "pid_started_since_boot": process_identity.started(),
                "started": time.strftime("%Y-%m-%d %H:%M:%S")}
        taken_over = None
        for _ in range(20):
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = cls.read(path)
                if holder is None:
                    continue  # removed in between: try again
                if not holder:  # unreadable: a writer is between create and write, or it is garbage
                    if time.time() - _mtime(path) < 10:
                        time.sleep(0.2)
                        continue
                    holder = {"host": "?", "pid": "?"}
                if (holder.get("host") == host and not _alive(holder)) or holder.get("host") == "?":
                    taken_over = (f"took over the stale lock {path} of pid {holder.get('pid')} on {holder.get('host')}"
                                  f" (started {holder.get('started', '?')}), which is no longer running")
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(path)
                    continue
                raise ConfigError(
                    f"dsrl.run.output_dir = {output_dir!r} is in use by another job: pid {holder.get('pid')} on host "
                    f"{holder.get('host')}, started {holder.get('started', '?')} (lock file {path}). Fix: wait for "
                    "that job to end or stop it, or use another --dsrl.run.output_dir. If that job is gone (its "
                    f"node crashed), delete {path}.") from None
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(info, f)
                f.flush()
                os.fsync(f.fileno())
            if cls.read(path) == info:
                return cls(path, info, taken_over)
        raise ConfigError(f"could not take the lock {path} (other jobs keep changing it); try again.")

    def release(self) -> None:
        """Remove the lock if it is still this job's."""
        if self._released:
            return
        self._released = True
        if self in _held:
            _held.remove(self)
        if self.read(self.path) == self.info:
            with contextlib.suppress(OSError):
                os.unlink(self.path)


def _mtime(path: str) -> float:
    try:
        return os.path.getmtime(path)
    except OSError:
        return 0.0
