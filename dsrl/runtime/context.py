"""This rank's place in a job and what watches it, built once per run: :class:`RunContext`.

The long-lived parts of a run (the experience maker, the multi-turn runner, the evaluator, the checkpointer, the
trainer's loop) share the same few collaborators: the rank and world size, the stop control, the watch that bounds
each phase's end, the clock that times phases, and the job's peers (who is still alive). The composition root
(:func:`dsrl.rl.run.parts.build_run`, ``dsrl eval``) builds one context and hands it to each part, instead of
threading the five through every constructor.

Invariants: one context per process and run; ``rank`` and ``world`` are those of the process group the run's
collectives use; the metrics writer is not in it (it is positioned after the resume, which needs the parts first,
so it is handed to what writes rows). ``RunContext()`` is one process with nothing watched (tests, single-process
tools): each part given none makes its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dsrl.runtime.peers import Peers
from dsrl.runtime.phases import PhaseClock
from dsrl.runtime.stop import StopControl
from dsrl.runtime.watchdog import NO_WATCH, PhaseWatch


@dataclass(frozen=True)
class RunContext:
    """This rank in the job (module docstring)."""

    rank: int = 0
    world: int = 1
    stop: StopControl | None = None  # None: nothing can ask the run to stop (one process, tests)
    watch: PhaseWatch = NO_WATCH  # bounds each phase's end and names a missing rank
    phases: PhaseClock = field(default_factory=PhaseClock)  # seconds, tokens and peak memory per phase
    peers: Peers | None = None  # the job's ranks and hosts (None: one process)

    def required_stop(self) -> StopControl:
        """The stop control, for a part that must have one (it saves, or ends the run on a stop)."""
        if self.stop is None:
            raise RuntimeError("this part of the run needs a RunContext with a StopControl (built by build_run)")
        return self.stop

    def required_peers(self) -> Peers:
        """The job's peers, for a part that must name them."""
        if self.peers is None:
            raise RuntimeError("this part of the run needs a RunContext with the job's Peers (built by build_run)")
        return self.peers


__all__ = ["RunContext"]
