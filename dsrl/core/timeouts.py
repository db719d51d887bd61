"""Bounds on waiting for other ranks: joining the process group and every later collective.

- **joining**: every rank checks in with rank 0 within ``run.join_timeout_s`` (else ``$DSRL_INIT_TIMEOUT_S``,
  else :data:`DEFAULT_JOIN_TIMEOUT_S`, a minute; :mod:`dsrl.core.rendezvous`), so a node that never starts ends the
  job at once, named, instead of the launcher's 10-minute or DeepSpeed's 30-minute wait;
- **every collective**: afterwards the default group's timeout is ``run.collective_timeout_s``
  (:func:`set_collective_timeout`), so no all-reduce, gather or barrier waits longer (gloo raises; NCCL
  aborts the communicator); :func:`patience` widens it for a block where one rank works alone.

Which phase a timed-out collective belonged to, and which rank was missing, is the phase watcher's
job (:mod:`dsrl.runtime.watchdog`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from datetime import timedelta

from dsrl.core import collectives

DEFAULT_JOIN_TIMEOUT_S = 60.0  # the start-up preflight's bound (dsrl.core.rendezvous)
DEFAULT_COLLECTIVE_TIMEOUT_S = 1800.0  # also torch's and DeepSpeed's default
JOIN_TIMEOUT_ENV = "DSRL_INIT_TIMEOUT_S"
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


