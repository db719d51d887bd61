"""When a run saves and ends: the pure stop policy, and what a stop on request says.

:class:`StopPolicy` decides once, after each rollout, from plain numbers (no clock, no collective, no I/O):

- **save** a checkpoint of the rollout when it is a multiple of ``run.save_every``, the plan's last (with
  ``run.save_final``), the last of this invocation by ``run.stop_after_rollouts``, or a stop was requested (every
  rank agreed on it, :meth:`dsrl.runtime.stop.StopControl.decide`);
- **end** this invocation after it when it is the plan's last rollout, the last by ``run.stop_after_rollouts``, or
  a stop was requested; ``early`` when it ends before the plan's last;
- ``final``: the plan's last rollout or the invocation's bound was reached (a request aside): the point where a
  run that trained on nothing at all must not end quietly (:class:`dsrl.rl.empty_rollouts.EmptyRollouts`).

:func:`report_stop` says where a stop left the run; a stop because a rank of the job had ended is a run error
naming that rank, raised on every rank.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from dsrl.checkpoint.commit import latest_complete_tag
from dsrl.config import RunConfig
from dsrl.core.errors import RunError
from dsrl.runtime.peers import Peers
from dsrl.runtime.stop import StopControl

log = logging.getLogger("dsrl.rl.trainer")


@dataclass(frozen=True)
class AfterRollout:
    """What the stop policy decided after one rollout (module docstring)."""

    save: bool
    end: bool
    early: bool
    final: bool


@dataclass(frozen=True)
class StopPolicy:
    """``rollouts``: the plan's; ``stop_after``, ``save_every``, ``save_final``: ``run``'s settings."""

    rollouts: int
    stop_after: int | None
    save_every: int
    save_final: bool

    @classmethod
    def of(cls, run: RunConfig, rollouts: int) -> StopPolicy:
        return cls(rollouts, run.stop_after_rollouts, run.save_every, run.save_final)

    def after_rollout(self, rollout: int, start: int, requested: bool) -> AfterRollout:
        """After rollout ``rollout`` (rollouts trained so far) of an invocation that started at ``start``;
        ``requested``: every rank agreed on a stop request."""
        last = rollout == self.rollouts
        bound = self.stop_after is not None and rollout - start >= self.stop_after
        periodic = bool(self.save_every) and rollout % self.save_every == 0
        return AfterRollout(save=periodic or (last and self.save_final) or bound or requested,
                            end=last or bound or requested, early=(bound or requested) and not last,
                            final=last or bound)


def report_stop(stop: StopControl, peers: Peers, ckpt_dir: str, *, rank: int, optimizer_steps: int,
                rollout: int, mid_rollout: bool) -> None:
    """Say where a stop on request left the run (rank 0). A stop because a rank of the job had ended (the
    launcher's SIGTERM after a rank died, :mod:`dsrl.runtime.stop`) raises a run error naming that rank, on every
    rank. ``rollout``: rollouts trained so far."""
    latest = latest_complete_tag(ckpt_dir)
    where = (f"at optimizer step {optimizer_steps}, a mini-batch boundary inside rollout {rollout + 1} (the rest of "
             "it and a checkpoint did not fit in run.stop_grace_s)"
             if mid_rollout else f"after rollout {rollout} with a committed checkpoint")
    last = os.path.join(ckpt_dir, latest) if latest else "none"
    if stop.peer_ended:
        who = (stop.ended or peers.obituary()
               or "a rank of another host has ended (named in the messages of that host's ranks)")
        raise RunError(f"{who}; the launcher stopped the job ({stop.reason}) and the run stopped {where}; the last "
                       f"committed checkpoint is {last}; resume with --resume auto once every rank is healthy",
                       agreed=True)
    if rank == 0:
        log.warning("stopped on request (%s) %s; the last committed checkpoint is %s; continue with --resume auto",
                    stop.reason, where, last)
