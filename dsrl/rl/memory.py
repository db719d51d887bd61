"""Device memory between a rollout's phases (``dsrl.memory.offload_states``, docs/memory.md): one component the
loop calls at two points, whatever engines the run has.

:class:`StateOffload` holds the training engines (the policy's, the critic's) and makes the frozen models'
offloaders (the KL reference, a reward model):

- :meth:`StateOffload.release` before a rollout's generation: every training engine's optimizer states, fp32
  master weights and gradient buffers go to pinned host memory (:class:`dsrl.backends.deepspeed.offload.
  EngineStates`); :meth:`StateOffload.reload` before its training phase (and before a checkpoint is saved) brings
  them back. Both are idempotent, and no-ops when the setting is off;
- :meth:`StateOffload.frozen` gives a frozen model an offloader that keeps it off the device except during its own
  passes (:class:`dsrl.backends.deepspeed.offload.FrozenWeights`), or None when the setting is off;
- :meth:`StateOffload.record` is the rollout's ``offload_s``, ``reload_s``, ``offload_bytes`` and ``reload_bytes``
  (:mod:`dsrl.core.traffic`; collective: every rank calls it once per rollout). The fields are written with the
  setting off too (zeros), so every run's rows have the same columns.

The values never change in transit, so training is bitwise the same with the setting on or off
(tests/distributed/test_memory.py); a training step that finds a state still offloaded is refused
(:func:`dsrl.backends.deepspeed.offload.require_resident`).
"""

from __future__ import annotations

from typing import Any

from dsrl.backends.deepspeed.offload import EngineStates, FrozenWeights
from dsrl.config import MemoryConfig
from dsrl.core.traffic import TrafficMeter, traffic_record


class StateOffload:
    """The run's training engines and frozen models off the device between the phases that need them (module
    docstring). ``engines``: the RLEngines that train (the policy's first)."""

    def __init__(self, config: MemoryConfig, engines: list[Any]):
        self.enabled = config.offload_states
        self.meter = TrafficMeter()
        self.engines = [EngineStates(rl.engine, self.meter) for rl in engines] if self.enabled else []

    def frozen(self, model: Any) -> FrozenWeights | None:
        """The offloader of a frozen model (a module on the device or a ZeRO-3 engine), already off the device; None
        with the setting off."""
        if not self.enabled:
            return None
        weights = FrozenWeights(model, self.meter)
        weights.offload()
        return weights

    def add_engine(self, rl: Any) -> None:
        """One more training engine (the critic's, built after the frozen models)."""
        if self.enabled:
            self.engines.append(EngineStates(rl.engine, self.meter))

    def release(self) -> None:
        """Every training engine's states off the device (before generation)."""
        for engine in self.engines:
            engine.offload()

    def reload(self) -> None:
        """Every training engine's states back on the device (before training, before a checkpoint)."""
        for engine in self.engines:
            engine.reload()

    def record(self, device: Any, world: int) -> dict[str, float]:
        """The rollout's traffic fields (one all-reduce over the default group: every rank calls it)."""
        return traffic_record(self.meter.take().reduced(device), world)
