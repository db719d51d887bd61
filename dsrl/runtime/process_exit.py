"""Ending a distributed process without interpreter finalization.

On the CPU accelerator (gloo) a process group's worker thread (``pt_gloo_runloop``) drops its reference to a
finished asynchronous collective (ZeRO's parameter all-gathers) a moment after the caller's ``wait()`` returned.
When that is the last reference, the work's destructor releases Python tensors and must take the GIL; if the
interpreter is finalizing by then, CPython ends the thread with ``pthread_exit``, whose forced unwind meets a
``noexcept`` C++ frame: ``terminate called without an active exception`` and exit status -6 (or -11) *after*
all the work was done. Seen in up to half of the 2-rank ZeRO-3 jobs on a busy 2-core machine (torch 2.13;
``dist.destroy_process_group()`` first does not prevent it: the groups' threads are not joined).

:func:`leave` is how an entry point ends: it flushes logging and the standard streams, runs the caller's
clean-ups and calls ``os._exit``, so finalization never starts while those threads live. Invariant: everything a
run writes is closed (metrics, checkpoints, exports) before ``leave`` is called; ``leave`` itself writes nothing.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Callable, Iterable


def leave(code: int | None, cleanups: Iterable[Callable[[], None]] = ()) -> None:
    """End the process with exit status ``code`` (``None`` = 0) without interpreter finalization."""
    for cleanup in cleanups:
        with contextlib.suppress(Exception):
            cleanup()
    wandb = sys.modules.get("wandb")  # a DeepSpeed wandb monitor's run would otherwise end at atexit
    if wandb is not None and getattr(wandb, "run", None) is not None:
        with contextlib.suppress(Exception):
            wandb.finish()
    with contextlib.suppress(Exception):
        logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(0 if code is None else int(code))
