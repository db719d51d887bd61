"""Bounded waiting: no rank waits on another forever, and the job says who it waited for.

Three bounds, all on by default (docs/reliability.md):

- **joining**: the process group is created with ``run.join_timeout_s`` (else ``$DSRL_INIT_TIMEOUT_S``,
  else :data:`DEFAULT_JOIN_TIMEOUT_S`), so a node that never starts ends the job instead of
  DeepSpeed's 30-minute wait; the error says how many ranks joined;
- **every collective**: afterwards the default group's timeout is ``run.collective_timeout_s``, so no
  all-reduce, gather or barrier waits longer (gloo raises; NCCL aborts the communicator);
- **phases**: the trainer runs generation, reward, step and save inside :meth:`Watch.phase`. Each
  rank records the phase it enters in the job's TCP store, and a phase ends in a *monitored* barrier
  (gloo's ``monitored_barrier``, on a gloo side group under NCCL) that names the ranks that did not
  arrive in time. A collective that times out inside a phase is reported with the phase and each
  rank's last recorded phase. Either way the job ends with :class:`dsrl.run_errors.CollectiveTimeout`
  naming the phase and the missing rank(s).

Invariant: :meth:`Watch.phase` adds collectives only at phase ends, where every rank passes the same
number of times (the trainer calls it identically on every rank); with one rank it adds nothing.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from collections.abc import Iterator
from datetime import timedelta

import torch.distributed as dist

from dsrl import collectives
from dsrl.run_errors import CollectiveTimeout, RunError

DEFAULT_JOIN_TIMEOUT_S = 300.0
DEFAULT_COLLECTIVE_TIMEOUT_S = 1800.0  # also torch's and DeepSpeed's default
JOIN_TIMEOUT_ENV = "DSRL_INIT_TIMEOUT_S"
PHASES = ("start", "generation", "reward", "step", "save", "export")
_TIMEOUT_WORDS = ("timed out", "timeout", "connection closed by peer", "connection reset", "failed to pass")
_state: dict[str, float | None] = {"collective_timeout_s": None}


def join_timeout_s(configured: float | None = None) -> float:
    """The bound on joining the process group: the config value, else $DSRL_INIT_TIMEOUT_S, else the default."""
    if configured is not None:
        return float(configured)
    env = os.environ.get(JOIN_TIMEOUT_ENV)
    return float(env) if env else DEFAULT_JOIN_TIMEOUT_S


def set_collective_timeout(seconds: float) -> None:
    """Bound every later collective of the default group by ``seconds``."""
    if not collectives.initialized():
        return
    from torch.distributed.distributed_c10d import _set_pg_timeout

    _set_pg_timeout(timedelta(seconds=seconds), None)
    _state["collective_timeout_s"] = float(seconds)


@contextlib.contextmanager
def patience(seconds: float) -> Iterator[None]:
    """Let collectives wait up to ``seconds`` inside the block (one rank works alone while the others
    wait, e.g. a checkpoint conversion); the earlier bound is restored after."""
    before = _state["collective_timeout_s"]
    if not collectives.initialized() or (before is not None and before >= seconds):
        yield
        return
    set_collective_timeout(seconds)
    try:
        yield
    finally:
        if before is not None:
            set_collective_timeout(before)


def looks_like_timeout(exc: BaseException) -> bool:
    """Whether a collective's exception says it waited too long for (or lost) a peer."""
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(w in text for w in _TIMEOUT_WORDS)


def _missing_ranks(text: str) -> list[int]:
    m = re.search(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier", text)
    return [int(x) for x in m.group(1).replace(",", " ").split()] if m else []


class Watch:
    """Phase bookkeeping and bounded phase ends for one job (module docstring). Build it on every rank."""

    def __init__(self, timeout_s: float):
        self.timeout_s = float(timeout_s)
        self.rank, self.world = collectives.rank(), collectives.world()
        self.current = "start"
        self.group = None
        self.store = None
        if self.world > 1:
            # monitored_barrier is gloo-only: under NCCL a gloo side group carries it (collective creation).
            self.group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
            with contextlib.suppress(Exception):
                from torch.distributed.distributed_c10d import _get_default_store

                self.store = _get_default_store()
        self._mark("start")

    def _mark(self, phase: str) -> None:
        if self.store is not None:
            with contextlib.suppress(Exception):
                self.store.set(f"dsrl/phase/{self.rank}", f"{phase}@{time.time():.3f}")

    def _reports(self) -> str:
        """Each rank's last recorded phase and how long ago it entered it, read from the store."""
        if self.store is None:
            return ""
        now, parts = time.time(), []
        for r in range(self.world):
            key = f"dsrl/phase/{r}"
            try:
                if not self.store.check([key]):
                    parts.append(f"rank {r}: no report")
                    continue
                phase, stamp = self.store.get(key).decode().split("@")
                parts.append(f"rank {r} in {phase} for {now - float(stamp):.0f} s")
            except Exception:
                parts.append(f"rank {r}: unknown")
        return "; ".join(parts)

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
        try:
            dist.monitored_barrier(group=self.group, timeout=timedelta(seconds=self.timeout_s), wait_all_ranks=True)
        except RuntimeError as e:
            missing = _missing_ranks(str(e))
            if missing:
                who = ", ".join(str(r) for r in missing)
                msg = (f"rank {who} did not finish the {name} phase within {self.timeout_s:g} s of rank {self.rank} "
                       f"(dsrl.run.collective_timeout_s); last reports: {self._reports()}. The job ends here; "
                       f"the last committed checkpoint is intact (resume with --resume auto once rank {who} is "
                       "healthy).")
            else:
                msg = (f"rank {self.rank} stopped waiting at the end of the {name} phase: rank 0 reported a rank "
                       f"that did not arrive within {self.timeout_s:g} s, or rank 0 is gone; see rank 0's message.")
            raise CollectiveTimeout(msg) from e
        self._mark(f"{name} done")

    def _in_phase_message(self, name: str, exc: BaseException) -> str:
        return (f"a collective of the {name} phase did not complete on rank {self.rank} within {self.timeout_s:g} s "
                f"(dsrl.run.collective_timeout_s) or lost a peer; last reports: {self._reports()}. "
                f"({type(exc).__name__}: {str(exc).splitlines()[0][:200]})")
