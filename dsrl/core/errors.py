"""Errors that end a run with one sentence instead of a traceback (``launch/train.py`` prints them).

:class:`ConfigError` (dsrl.config.errors) is for what is wrong before any work starts (exit status 2);
:class:`RunError` is for what goes wrong while the run works (exit status 1): a checkpoint that cannot
be written, a rank that stopped answering, a reward function that stopped answering everywhere.
"""

from __future__ import annotations


class RunError(RuntimeError):
    """A failure during the run, stated as a sentence that names what failed, where, and the way forward.

    ``agreed`` is True when every rank raised the same error at the same point (the launcher script then
    prints it from rank 0 only).
    """

    def __init__(self, message: str, agreed: bool = False):
        super().__init__(message)
        self.agreed = agreed


class CheckpointError(RunError):
    """A checkpoint could not be written or read; the message names the path and what stays ``latest``."""


class CollectiveTimeout(RunError):
    """A rank did not reach a collective (or the end of a phase) within ``run.collective_timeout_s``."""
