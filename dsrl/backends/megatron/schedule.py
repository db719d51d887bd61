"""Driving Megatron's ``OptimizerParamScheduler`` from dsrl's plan, in an explicit unit.

``OptimizerParamScheduler`` counts whatever ``step(increment)`` is given. dsrl fixes the unit:

- ``"optimizer_steps"`` (default): one per applied optimizer step; warmup/decay horizons are in
  optimizer steps (the plan's ``total_optimizer_steps``);
- ``"samples"``: Megatron-LM's convention (``num_microbatches * micro_batch_size * dp`` per
  iteration): the number of sequences of the mini-batch, counted once over all data-parallel
  replicas (zero-weight fillers excluded); horizons are optimizer steps times ``mini_batch_size``.

It is never advanced per micro-batch, only after an ``optimizer.step()`` that reports
``update_successful``. ``OptimizerParamScheduler.load_state_dict`` *adds* the saved ``num_steps`` to
the current count; :meth:`SchedulerDriver.load_state_dict` resets the count first, so a resumed run
sits at exactly the saved position however often it is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dsrl.backends.megatron.deps import require_megatron

OPTIMIZER_STEPS = "optimizer_steps"
SAMPLES = "samples"
UNITS = (OPTIMIZER_STEPS, SAMPLES)


def check_unit(unit: str) -> str:
    if unit not in UNITS:
        raise ValueError(
            f"schedule_unit {unit!r} must be one of {UNITS}; the schedule is never advanced per micro-batch"
        )
    return unit


def build_param_scheduler(
    optimizer: Any,
    *,
    total_optimizer_steps: int,
    max_lr: float,
    min_lr: float = 0.0,
    warmup_steps: int = 0,
    init_lr: float = 0.0,
    decay_style: str = "cosine",
    unit: str = OPTIMIZER_STEPS,
    samples_per_step: int | None = None,
    start_wd: float = 0.0,
    end_wd: float = 0.0,
) -> Any:
    """An ``OptimizerParamScheduler`` whose horizon is the plan's, expressed in ``unit``.

    ``total_optimizer_steps`` and ``warmup_steps`` are in optimizer steps (as in :class:`dsrl.BatchPlan`);
    with ``unit="samples"`` they are multiplied by ``samples_per_step`` (the plan's ``mini_batch_size``).
    ``min_lr`` is always set (megatron-core 0.16.1 raises a TypeError in ``get_lr`` when it is None).
    """
    require_megatron()
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    check_unit(unit)
    if total_optimizer_steps <= 0:
        raise ValueError(f"total_optimizer_steps must be positive, got {total_optimizer_steps}")
    if not 0 <= warmup_steps < total_optimizer_steps:
        raise ValueError(f"warmup_steps {warmup_steps} must lie in [0, total_optimizer_steps={total_optimizer_steps})")
    per = 1
    if unit == SAMPLES:
        if not samples_per_step:
            raise ValueError("unit='samples' needs samples_per_step (the plan's mini_batch_size)")
        per = int(samples_per_step)
    for group in optimizer.param_groups:  # get_megatron_optimizer sets these; plain torch optimizers do not
        group.setdefault("max_lr", max_lr)
        group.setdefault("min_lr", min_lr)
    return OptimizerParamScheduler(
        optimizer,
        init_lr=init_lr,
        max_lr=max_lr,
        min_lr=min_lr,
        lr_warmup_steps=warmup_steps * per,
        lr_decay_steps=total_optimizer_steps * per,
        lr_decay_style=decay_style,
        start_wd=start_wd,
        end_wd=end_wd,
        wd_incr_steps=total_optimizer_steps * per,
        wd_incr_style="constant",
    )


@dataclass
class SchedulerDriver:
    """Steps an ``OptimizerParamScheduler`` once per applied optimizer step, in ``unit``."""

    scheduler: Any
    unit: str = OPTIMIZER_STEPS

    def __post_init__(self) -> None:
        check_unit(self.unit)
        for name in ("step", "state_dict", "load_state_dict", "num_steps"):
            if not hasattr(self.scheduler, name):
                raise TypeError(
                    f"the scheduler must be megatron.core's OptimizerParamScheduler (or alike: step(increment), "
                    f"num_steps, state_dict); {type(self.scheduler).__name__} has no {name!r}"
                )

    def increment(self, global_samples: int) -> int:
        """What one applied step adds: 1, or the mini-batch's global sample count."""
        return 1 if self.unit == OPTIMIZER_STEPS else int(global_samples)

    def after_optimizer_step(self, update_successful: bool, global_samples: int) -> int:
        """Advance only after a successful update; returns the increment applied (0 when skipped)."""
        if not update_successful:
            return 0
        inc = self.increment(global_samples)
        self.scheduler.step(increment=inc)
        return inc

    @property
    def position(self) -> int:
        return int(self.scheduler.num_steps)

    def state_dict(self) -> dict[str, Any]:
        return {"unit": self.unit, "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("unit", self.unit) != self.unit:
            raise ValueError(
                f"the checkpoint's schedule counts {state['unit']!r} but this run counts {self.unit!r}; resuming "
                f"would misplace the learning rate. Use the same schedule_unit."
            )
        # OptimizerParamScheduler.load_state_dict calls step(increment=saved num_steps): additive.
        # Reset first so the position is the saved one, not saved + whatever was stepped before.
        self.scheduler.num_steps = 0
        self.scheduler.load_state_dict(state["scheduler"])
