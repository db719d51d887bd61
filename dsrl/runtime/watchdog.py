"""Bounded phases: the job says which rank it waited for, in which phase.

The bounds on joining and on every collective are :mod:`dsrl.core.timeouts`' (docs/reliability.md).
On top of them, **phases**: the trainer runs generation, reward, step and save inside :meth:`Watch.phase`. Each
  rank records the phase it enters in the job's TCP store, and a phase ends in a *monitored* barrier
  (gloo's ``monitored_barrier``, on a gloo side group under NCCL) that names the ranks that did not
  arrive in time. A collective that times out inside a phase is reported with the phase and each
  rank's last recorded phase. Either way the job ends with :class:`dsrl.core.errors.CollectiveTimeout`
  naming the phase and the missing rank(s).

Invariant: :meth:`Watch.phase` adds collectives only at phase ends, where every rank passes the same
number of times (the trainer calls it identically on every rank); with one rank it adds nothing.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Iterator
from datetime import timedelta

import torch.distributed as dist

from dsrl.core import collectives
from dsrl.core.errors import CollectiveTimeout, RunError
from dsrl.core.timeouts import looks_like_timeout

PHASES = ("start", "generation", "reward", "step", "save", "export")


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
