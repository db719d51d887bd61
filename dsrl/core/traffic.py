"""What one rollout moved between the device and the host: training state and frozen models offloaded and
reloaded (:mod:`dsrl.backends.deepspeed.offload`), in the ``rollout`` row of metrics.jsonl.

Invariants kept by :class:`TrafficMeter`:

- every offload and every reload is recorded with its seconds and its bytes where it happens (no estimate):
  ``offload_bytes`` counts the device memory the offload released (the training state's buffers that left it,
  a frozen model's weights), ``reload_bytes`` what came back into newly allocated device memory. On the CPU
  accelerator "device" and host are one memory: DeepSpeed's offload still copies the buffers into fresh host
  buffers (counted), its reload then finds them already on the "device" and moves nothing (0), while a frozen
  model's reload copies into a fresh buffer (counted);
- :meth:`TrafficMeter.take` hands over the rollout's totals and starts the next rollout at zero;
- :func:`traffic_record` writes seconds as the mean over ranks (like the phase seconds) and bytes summed over
  ranks (what the job moved), after one all-reduce (:meth:`Traffic.reduced`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from dsrl.core.collectives import all_reduce_floats


@dataclass(frozen=True)
class Moved:
    """One offload or reload: its seconds and the bytes it moved (see the module docstring)."""

    seconds: float = 0.0
    bytes: int = 0


@dataclass
class Traffic:
    """A rollout's offloads and reloads on this rank (:meth:`reduced`: summed over every rank)."""

    offload_s: float = 0.0
    offload_bytes: float = 0.0
    offloads: float = 0.0
    reload_s: float = 0.0
    reload_bytes: float = 0.0
    reloads: float = 0.0

    def reduced(self, device: Any = "cpu") -> Traffic:
        """Every field summed over the default group's ranks (one all-reduce; a no-op on one process)."""
        names = [f.name for f in dataclasses.fields(self)]
        return Traffic(**dict(zip(names, all_reduce_floats([getattr(self, n) for n in names], device=device))))


class TrafficMeter:
    """Adds up a rollout's offloads and reloads (module docstring)."""

    def __init__(self) -> None:
        self._traffic = Traffic()

    def offloaded(self, moved: Moved) -> None:
        t = self._traffic
        t.offload_s += moved.seconds
        t.offload_bytes += moved.bytes
        t.offloads += 1

    def reloaded(self, moved: Moved) -> None:
        t = self._traffic
        t.reload_s += moved.seconds
        t.reload_bytes += moved.bytes
        t.reloads += 1

    def take(self) -> Traffic:
        """This rank's totals since the last call; the meter starts again at zero."""
        out, self._traffic = self._traffic, Traffic()
        return out


def traffic_record(summed: Traffic, world: int) -> dict[str, float]:
    """The ``rollout`` row's fields from :meth:`Traffic.reduced` totals over ``world`` ranks: ``offload_s`` and
    ``reload_s`` (mean over ranks), ``offload_bytes`` and ``reload_bytes`` (summed over ranks)."""
    return {"offload_s": summed.offload_s / world, "reload_s": summed.reload_s / world,
            "offload_bytes": summed.offload_bytes, "reload_bytes": summed.reload_bytes}
