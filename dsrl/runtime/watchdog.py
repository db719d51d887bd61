"""Bounded phases: the job says which rank it waited for, in which phase.

The bounds on joining and on every collective are :mod:`dsrl.core.timeouts`' (docs/reliability.md).
On top of them, **phases**: the trainer runs generation, reward, step and save inside :meth:`Watch.phase`. Each
  rank records the phase it enters in the job's TCP store, and a phase ends in a *monitored* barrier
  (gloo's ``monitored_barrier``, on a gloo side group under NCCL) that names the ranks that did not
  arrive in time. A collective that times out inside a phase is reported with the phase and each
  rank's last recorded phase. Either way the job ends with :class:`dsrl.core.errors.CollectiveTimeout`
  naming the phase and the missing rank(s), and first the ranks of this host whose process has ended or is
  stopped, by role, rank and host (:mod:`dsrl.runtime.peers`).

**What a rank is doing**: inside a phase, the code that calls user functions (a reward function, an
environment: :mod:`dsrl.rl.rewards.contract`, :mod:`dsrl.rl.episodes.environment`) records before each call what it
calls
and for which sample (:func:`note`, one store write). While a rank waits at a phase end, a thread of that rank
says every ``run.wait_report_s`` seconds, until the collective bound ends the job, which rank it waits for,
what that rank is doing and for how long (only the lowest waiting rank speaks, so a large job prints one line
per interval, not one per rank).

Invariant: :meth:`Watch.phase` adds collectives only at phase ends, where every rank passes the same
number of times (the trainer calls it identically on every rank); with one rank it adds nothing.
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Protocol

import torch.distributed as dist

from dsrl.core import collectives
from dsrl.core.errors import CollectiveTimeout, RunError
from dsrl.core.timeouts import looks_like_timeout
from dsrl.runtime.peers import Peers

ENDED_VISIBLE_S = 3.0
"""How long an error path that lost a connection looks for a peer's ended process before it names none
(:meth:`Peers.obituary`)."""
LOST_CONNECTION = ("connection closed", "connection reset", "broken pipe", "connection refused")
PHASES = ("start", "generation", "environment", "reward", "step", "save", "export")


class PhaseWatch(Protocol):
    """What runs a phase of the job: :class:`Watch` (bounded phase ends), or :data:`NO_WATCH` (one process, tests)."""

    def phase(self, name: str) -> contextlib.AbstractContextManager[None]:
        """Run the block as phase ``name``."""


class _NoWatch:
    """A :class:`PhaseWatch` that bounds nothing."""

    def phase(self, name: str) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()


NO_WATCH: PhaseWatch = _NoWatch()
log = logging.getLogger("dsrl.watchdog")
_ACTIVE: list[Watch] = []  # the job's Watch with more than one rank (what note() records into)


def note(doing: str) -> None:
    """Record what this rank is about to do (e.g. ``"calling dsrl.data.reward_fn for sample 3 (...)"``), for the
    waiting ranks' reports and the timeout message. A no-op without a multi-rank :class:`Watch`."""
    if _ACTIVE:
        _ACTIVE[-1].note(doing)


def _missing_ranks(text: str) -> list[int]:
    m = re.search(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier", text)
    return [int(x) for x in m.group(1).replace(",", " ").split()] if m else []


class Watch:
    """Phase bookkeeping and bounded phase ends for one job (module docstring). Build it on every rank."""

    def __init__(self, timeout_s: float, report_s: float = 30.0, peers: Peers | None = None):
        """``peers``: the job's :class:`dsrl.runtime.peers.Peers`, so that a message about a lost peer names the ranks
        of this host that ended."""
        self.timeout_s = float(timeout_s)
        self.report_s = float(report_s)
        self.rank, self.world = collectives.rank(), collectives.world()
        self.current = "start"
        self.group = None
        self.store = None
        self.peers = peers
        if self.world > 1:
            # monitored_barrier is gloo-only: under NCCL a gloo side group carries it (collective creation).
            self.group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
            with contextlib.suppress(Exception):
                from torch.distributed.distributed_c10d import _get_default_store

                self.store = _get_default_store()
            _ACTIVE[:] = [self]
        self._mark("start")

    def _mark(self, phase: str) -> None:
        if self.store is not None:
            with contextlib.suppress(Exception):
                self.store.set(f"dsrl/phase/{self.rank}", f"{phase}@{time.time():.3f}")

    def note(self, doing: str) -> None:
        """Record what this rank is doing now (module docstring); never raises."""
        if self.store is not None:
            with contextlib.suppress(Exception):
                self.store.set(f"dsrl/doing/{self.rank}", f"{time.time():.3f}@{doing}")

    def _read(self, key: str) -> str | None:
        if self.store is None or not self.store.check([key]):
            return None
        return self.store.get(key).decode()

    def _state(self, r: int) -> tuple[str, float, str | None, float] | None:
        """Rank ``r``'s (phase mark, when it was set, what it noted doing since then or None, when) from the store."""
        mark = self._read(f"dsrl/phase/{r}")
        if mark is None:
            return None
        phase, stamp = mark.rsplit("@", 1)
        doing = None if phase.endswith((" end", " done")) else self._read(f"dsrl/doing/{r}")  # at a barrier: idle
        if doing is not None:
            when, what = doing.split("@", 1)
            if float(when) >= float(stamp):  # noted inside its current phase, not left over from an earlier one
                return phase, float(stamp), what, float(when)
        return phase, float(stamp), None, 0.0

    def _describe(self, r: int, now: float) -> str:
        """'rank 1 in reward for 31 s, calling ... for 31 s' (or what is known of rank ``r``)."""
        try:
            state = self._state(r)
        except Exception:
            return f"rank {r}: unknown"
        if state is None:
            return f"rank {r}: no report"
        phase, stamp, what, when = state
        text = f"rank {r} in {phase} for {now - stamp:.0f} s"
        return text + (f", {what} for {now - when:.0f} s" if what else "")

    def _reports(self) -> str:
        """Each rank's last recorded phase, how long ago it entered it and what it noted doing, from the store."""
        if self.store is None:
            return ""
        now = time.time()
        return "; ".join(self._describe(r, now) for r in range(self.world))

    def _report_waiting(self, name: str, since: float) -> None:
        """One report of a rank waiting at the end of phase ``name`` (module docstring): the lowest waiting rank
        names every rank that has not reached the phase end, with what it is doing."""
        try:
            marks = {r: self._state(r) for r in range(self.world)}
        except Exception:
            return
        waiting = [r for r, st in marks.items() if st is not None and st[0] in (f"{name} end", f"{name} done")]
        busy = [r for r in range(self.world) if r not in waiting]
        if not busy or not waiting or min(waiting) != self.rank:
            return
        now = time.time()
        log.warning("rank %d has waited %.0f s at the end of the %s phase for %s; the job ends if %s not there "
                    "within %g s of the first rank (dsrl.run.collective_timeout_s)", self.rank, now - since, name,
                    "; ".join(self._describe(r, now) for r in busy), "it is" if len(busy) == 1 else "they are",
                    self.timeout_s)

    @contextlib.contextmanager
    def _reporting(self, name: str) -> Iterator[None]:
        """Report every ``report_s`` seconds from a thread while the block waits (module docstring)."""
        if self.store is None or self.report_s >= self.timeout_s:
            yield
            return
        stop, since = threading.Event(), time.time()

        def loop() -> None:
            while not stop.wait(self.report_s):
                self._report_waiting(name, since)

        thread = threading.Thread(target=loop, name="dsrl-wait-report", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join(timeout=5.0)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Run the block as phase ``name``; end it in a monitored barrier (see the module docstring)."""
        if self.world == 1:
            yield
            return
        before, self.current = self.current, name
        self._mark(name)
        try:
            yield
        except RuntimeError as e:
            if not isinstance(e, RunError) and looks_like_timeout(e):
                raise CollectiveTimeout(self._in_phase_message(name, e)) from e
            raise
        else:
            self.arrive(name)
        finally:
            self.current = before

    def arrive(self, name: str) -> None:
        """A barrier that names the ranks missing after ``timeout_s`` (collective)."""
        if self.world == 1:
            return
        self._mark(f"{name} end")
        try:
            with self._reporting(name):
                dist.monitored_barrier(group=self.group, timeout=timedelta(seconds=self.timeout_s),
                                       wait_all_ranks=True)
        except RuntimeError as e:
            missing = _missing_ranks(str(e))
            if missing:
                who = ", ".join(str(r) for r in missing)
                msg = (f"{self._ended(e)}rank {who} did not finish the {name} phase within {self.timeout_s:g} s of "
                       f"rank {self.rank} (dsrl.run.collective_timeout_s); last reports: {self._reports()}. The job "
                       f"ends here; the last committed checkpoint is intact (resume with --resume auto once rank {who} "
                       "is healthy).")
            elif self.rank == 0 or "connection" in str(e).lower():  # a peer's connection closed: it is gone
                msg = (f"{self._ended(e)}rank {self.rank} lost a peer at the end of the {name} phase "
                       f"({str(e).splitlines()[0][:160]}); last reports: {self._reports()}. The job ends here; the "
                       "last committed checkpoint is intact (resume with --resume auto once every rank is healthy).")
            else:
                msg = (f"{self._ended(e)}rank {self.rank} stopped waiting at the end of the {name} phase: rank 0 "
                       f"reported a rank that did not arrive within {self.timeout_s:g} s, or rank 0 is gone; see rank "
                       "0's message.")
            raise CollectiveTimeout(msg) from e
        self._mark(f"{name} done")

    def _ended(self, error: BaseException) -> str:
        """'trainer 1 (rank 1 on host a) has ended (its process is gone); ' for the ranks of this host that ended, or
        nothing (dsrl.runtime.peers). After a closed connection (``error``), a peer's exit may not be visible yet:
        look for up to :data:`ENDED_VISIBLE_S`."""
        lost = any(word in str(error).lower() for word in LOST_CONNECTION)
        try:
            found = (self.peers.obituary(wait_s=ENDED_VISIBLE_S if lost else 0.0)
                     if self.peers is not None else None)
        except Exception:  # noqa: BLE001 - naming is best effort
            found = None
        return f"{found}; " if found else ""

    def _in_phase_message(self, name: str, exc: BaseException) -> str:
        return (f"{self._ended(exc)}a collective of the {name} phase did not complete on rank {self.rank} within "
                f"{self.timeout_s:g} s (dsrl.run.collective_timeout_s) or lost a peer; last reports: "
                f"{self._reports()}. ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})")
