"""Stopping on request: SIGTERM, Ctrl-C, or the death of the launcher, whatever reached which process.

What happens (docs/reliability.md, "Signals"):

- every rank handles SIGTERM and SIGINT itself, and a thread watches the DeepSpeed launcher processes
  above it (``deepspeed.launcher.launch`` and the ``deepspeed`` runner, or ``torchrun``): when one of
  them ends, e.g. ``kill PID`` or ``timeout`` hit the runner alone, the rank treats it as a SIGTERM;
- during start-up a request aborts at once (nothing is worth saving yet; DeepSpeed's shared-memory
  segments are removed by :func:`dsrl.backends.deepspeed.cpu_shm.arm_cleaner`'s watcher whatever happens);
- during training every rank takes the same decision at each mini-batch boundary (one all-reduce of
  three numbers): when the rest of the rollout plus a checkpoint fits in ``run.stop_grace_s`` counted
  from the request, the run finishes the rollout, commits a checkpoint and stops; otherwise it stops
  right after the mini-batch, and the last committed checkpoint stays ``latest``;
- a rank still running ``stop_grace_s`` after the request exits with status 128 + signal number; a
  second Ctrl-C interrupts at once;
- when a request arrives, a rank asks :mod:`dsrl.runtime.peers` which ranks of its host have ended (the DeepSpeed
  launcher SIGTERMs every rank as soon as one ended with a nonzero status) and names them; the ranks share that
  finding in the stop decision, and the run then ends as a run error (status 1), naming the rank, not as a stop
  on request.

DeepSpeed's launcher gives its ranks 30 s between its SIGTERM and SIGKILL, hence the 25 s default.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

from dsrl.core import collectives, process_identity
from dsrl.runtime.peers import Peers
from dsrl.runtime.peers import current as current_peers

log = logging.getLogger("dsrl.runtime.stop")
_LAUNCHER_WORDS = ("deepspeed.launcher", "torch.distributed.run", "torch.distributed.launch", "torchrun")


class StopRun(Exception):
    """Raised at a mini-batch boundary when every rank agreed to stop there."""


class InterruptedStartup(BaseException):
    """A stop request during start-up: unwind now (like KeyboardInterrupt)."""


def _looks_like_launcher(cmdline: list[str]) -> bool:
    text = " ".join(cmdline[:4])
    return any(w in text for w in _LAUNCHER_WORDS) or any(os.path.basename(a) == "deepspeed" for a in cmdline[:2])


def launcher_ancestors() -> list[tuple[int, float, str]]:
    """``(pid, start, name)`` of the launcher processes above this one, nearest first; the start is
    :func:`dsrl.core.process_identity.started`'s (counted from boot: a stepped wall clock does not move it)."""
    try:
        import psutil

        proc = psutil.Process(os.getpid()).parent()
        out = []
        while proc is not None and proc.pid > 1:
            cmd = proc.cmdline()
            if not _looks_like_launcher(cmd):
                break
            started = process_identity.started(proc.pid)
            if started is None:
                break
            out.append((proc.pid, started, " ".join(cmd[:3])))
            proc = proc.parent()
        return out
    except Exception:
        return []


def _gone(pid: int, started: float) -> bool:
    """Whether the launcher process ``pid`` that started at ``started`` (from boot) has ended: its pid is free,
    names another process, or a zombie."""
    import psutil

    if not process_identity.same(pid, started):
        return True
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
    except psutil.Error:
        return False


class StopControl:
    """One per process: records stop requests and turns them into one decision shared by every rank."""

    def __init__(self, grace_s: float, poll_s: float = 1.0, before_exit: Callable[[], None] | None = None,
                 peers: Callable[[], Peers | None] = current_peers):
        """``before_exit`` runs when the grace period expires, just before the process exits (the trainer
        passes the output lock's release, so a forced exit leaves no stale lock behind). ``peers`` gives the job's
        :class:`dsrl.runtime.peers.Peers` once they exist (None before: during start-up), asked when a request
        arrives: the launcher SIGTERMs every rank as soon as one ended, and the request then names it."""
        self.grace_s = float(grace_s)
        self.before_exit = before_exit
        self.poll_s = poll_s
        self.peers = peers
        self.requested_at: float | None = None
        self.reason: str | None = None
        self.signum = 0
        self.training = False  # set by begin_training(): a request no longer aborts, it stops at a boundary
        self.decision: str | None = None  # None until a request was agreed: "finish" or "stop"
        self._previous: dict[int, Any] = {}
        self._after_run: dict[int, Any] = {}  # restore_to(): what uninstall() installs instead of _previous
        self._done = threading.Event()
        self._step_times: list[float] = []
        self.save_s = 0.0  # the last checkpoint's seconds (note_save), counted in the time a "finish" needs
        # The run is ending on its own (an error every rank agreed on, or the end): ranks that exit now have not died,
        # so a late request (the launcher's SIGTERM after the first of them exited) names nobody.
        self.ending = False
        self.ended: str | None = None  # this rank's finding, named by role, rank and host
        self.peer_ended = False  # shared by decide(): every rank then ends the run as a run error (status 1)

    # -- the run's course -------------------------------------------------------------------------
    def begin_training(self) -> None:
        """Start-up is over: a request now stops the run at the next mini-batch boundary instead of aborting."""
        self.training = True

    def end_run(self) -> None:
        """The run ends on its own (its end, or an error every rank agreed on): a request from now on names no
        ended rank."""
        self.ending = True

    def note_save(self, seconds: float) -> None:
        """How long the last checkpoint took (what finishing a rollout on request must leave room for)."""
        self.save_s = float(seconds)

    # -- requests -------------------------------------------------------------------------------
    def install(self) -> None:
        """Handle SIGTERM/SIGINT in this (main) thread and watch the launcher processes above."""
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._on_signal)
        ancestors = launcher_ancestors()
        if ancestors:
            threading.Thread(target=self._watch, args=(ancestors,), name="dsrl-launcher-watch", daemon=True).start()

    def restore_to(self, handlers: dict[int, Any]) -> None:
        """What :meth:`uninstall` installs for these signals instead of the handlers it found at :meth:`install`.
        The entry point passes a SIGTERM handler that lets it print its last word: the launcher SIGTERMs a rank as
        soon as another one exited, and between the end of the run (this control uninstalled) and the rank's
        message the default handler would end it silently."""
        self._after_run = dict(handlers)

    def uninstall(self) -> None:
        self._done.set()
        for sig, handler in self._previous.items():
            if threading.current_thread() is threading.main_thread():
                signal.signal(sig, self._after_run.get(sig, handler))
        self._previous.clear()

    def _on_signal(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if signum == signal.SIGINT and self.requested_at is not None and self.signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: now
        self.request(f"{name} received", signum)
        if not self.training:
            raise InterruptedStartup(f"{name} during start-up")

    def _watch(self, ancestors: list[tuple[int, float, str]]) -> None:
        while not self._done.wait(self.poll_s):
            for pid, started, name in ancestors:
                if _gone(pid, started):
                    self.request(f"the launcher ({name}, pid {pid}) ended", signal.SIGTERM)
                    if not self.training:
                        os.kill(os.getpid(), signal.SIGTERM)  # interrupt start-up in the main thread
                    return

    def request(self, reason: str, signum: int) -> None:
        if self.requested_at is not None:
            return
        self.requested_at, self.reason, self.signum = time.monotonic(), reason, signum
        speaks = collectives.rank() == 0
        peers = self.peers()
        if peers is not None and signum and self.training and not self.ending:
            try:
                self.ended = peers.obituary()
                speaks = speaks or (self.ended is not None and peers.speaks_for_host())
            except Exception:  # noqa: BLE001 - naming is best effort, the stop is not
                self.ended = None
            self.peer_ended = self.ended is not None
        if self.ended is not None and speaks:  # once per host (ranks of other hosts cannot see it)
            log.warning("%s; the launcher stops the job (%s): stopping at the next mini-batch boundary; a checkpoint "
                        "is committed if the rollout can finish within run.stop_grace_s = %g s", self.ended, reason,
                        self.grace_s)
        elif self.ended is None and not self.ending and (collectives.rank() == 0 or not self.training):
            log.warning("stop requested (%s): stopping at the next mini-batch boundary; a checkpoint is committed "
                        "if the rollout can finish within run.stop_grace_s = %g s", reason, self.grace_s)
        threading.Thread(target=self._expire, name="dsrl-stop-grace", daemon=True).start()

    def _expire(self) -> None:
        if self._done.wait(self.grace_s + 5.0):
            return
        log.error("rank %d: still running %g s after the stop request (%s); exiting", collectives.rank(),
                  self.grace_s, self.reason)
        if self.before_exit is not None:
            self.before_exit()
        logging.shutdown()
        os._exit(128 + (self.signum or signal.SIGTERM))

    @property
    def exit_code(self) -> int:
        """0 (no request), 1 when a rank of the job had ended (a run error), else 128 + the signal number."""
        if self.requested_at is None:
            return 0
        return 1 if self.peer_ended else 128 + self.signum

    # -- the shared decision ------------------------------------------------------------------------
    def note_step(self, seconds: float) -> None:
        self._step_times.append(seconds)

    def new_rollout(self) -> None:
        self._step_times = self._step_times[-1:]

    def decide(self, steps_left: int) -> str | None:
        """At a mini-batch boundary (collective): None (carry on), "finish" (finish the rollout, save,
        stop) or "stop" (stop now). Once "finish" is agreed it stays, without further collectives."""
        if self.decision is not None:
            return self.decision
        mean = sum(self._step_times) / len(self._step_times) if self._step_times else 0.0
        elapsed = time.monotonic() - self.requested_at if self.requested_at is not None else 0.0
        requested, elapsed, remaining, ended = collectives.max_floats(
            [1.0 if self.requested_at is not None else 0.0, elapsed, steps_left * mean + self.save_s,
             1.0 if self.peer_ended else 0.0])
        if not requested:
            return None
        if self.requested_at is None:
            self.request("another rank was asked to stop", signal.SIGTERM)
        self.peer_ended = bool(ended)
        self.decision = "finish" if elapsed + remaining <= self.grace_s else "stop"
        return self.decision
