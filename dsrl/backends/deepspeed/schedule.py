"""The LR schedule, owned by dsrl: horizon = the plan's total optimizer steps.

Sources (at most one):
- the ds_config ``"scheduler"`` section with a DeepSpeed schedule type (WarmupLR, WarmupDecayLR,
  WarmupCosineLR, OneCycle, LRRangeTest), built from ``deepspeed.runtime.lr_schedules``;
- ``"dsrl": {"scheduler": {"name": ...}}``, a transformers named schedule (``get_scheduler``).

Invariants:
- the scheduler is never handed to DeepSpeed; :class:`PlannedScheduler.step` is called once per
  *applied* optimizer step (``engine.was_step_applied()``), so a skipped step never advances it;
- optimizer step k (1-based) runs with the schedule's value at index k-1, so step 1 uses the
  warmup start and the last planned step T uses index T-1, where decaying schedules reach their
  minimum (DeepSpeed's own classes start at index -1, one step behind; dsrl aligns them);
- an explicit horizon that disagrees with the plan is a ConfigError, as is warmup >= horizon.
"""

from __future__ import annotations

import copy
import difflib
from dataclasses import dataclass
from typing import Any

import torch

from dsrl.config import Config, ConfigError


def deepspeed_schedules() -> list[str]:
    """The schedule types DeepSpeed's own config accepts (``deepspeed.runtime.lr_schedules``)."""
    from deepspeed.runtime.lr_schedules import VALID_LR_SCHEDULES

    return list(VALID_LR_SCHEDULES)


_HORIZON_KEY = {"WarmupDecayLR": "total_num_steps", "WarmupCosineLR": "total_num_steps"}
_WARMUP_KEY = {"WarmupLR": "warmup_num_steps", "WarmupDecayLR": "warmup_num_steps",
               "WarmupCosineLR": "warmup_num_steps"}


@dataclass(frozen=True)
class ScheduleSpec:
    """A validated schedule description, independent of any optimizer."""

    source: str  # "deepspeed" | "transformers" | "constant"
    name: str
    params: dict[str, Any]


def base_lr(cfg: Config) -> float | None:
    """The optimizer LR of the ds_config, when one is given."""
    opt = cfg.ds_config.get("optimizer")
    params = opt.get("params") if isinstance(opt, dict) else None
    lr = params.get("lr") if isinstance(params, dict) else None
    if isinstance(lr, (int, float)) and not isinstance(lr, bool):
        return float(lr)
    return None


def schedule_spec(cfg: Config, total_steps: int) -> ScheduleSpec:
    """Resolve the schedule against the plan's horizon and check what needs that horizon.

    Types and values of the parameters are checked by building the schedule on a throwaway optimizer
    (:func:`dsrl.backends.deepspeed.validation.validate_schedule`); that the two schedule sources exclude each other
    is a rule of :class:`dsrl.config.Config`.
    """
    ds_sched = cfg.ds_config.get("scheduler")
    named = cfg.dsrl.scheduler
    if named.name:
        warmup = named.warmup_steps
        if warmup is None:
            warmup = round((named.warmup_ratio or 0.0) * total_steps)
        if warmup >= total_steps and warmup > 0:
            raise ConfigError(
                f"dsrl.scheduler warmup = {warmup} steps is not shorter than the plan's "
                f"{total_steps} optimizer steps. Fix: lower warmup_steps/warmup_ratio."
            )
        return ScheduleSpec(
            "transformers",
            named.name,
            {"num_warmup_steps": warmup, "num_training_steps": total_steps,
             "scheduler_specific_kwargs": dict(named.kwargs)},
        )
    if not ds_sched:
        return ScheduleSpec("constant", "constant", {})
    if not isinstance(ds_sched, dict) or "type" not in ds_sched:
        raise ConfigError('ds_config scheduler must look like {"type": "WarmupCosineLR", "params": {...}}')
    name = ds_sched["type"]
    known = deepspeed_schedules()
    if name not in known:
        close = difflib.get_close_matches(str(name), known, n=1)
        raise ConfigError(
            f"ds_config scheduler.type = {name!r} is not a DeepSpeed schedule ({', '.join(known)})"
            + (f"; did you mean {close[0]!r}?" if close else ".")
            + " Fix: use one of those, or a transformers schedule via \"dsrl\": {\"scheduler\": {\"name\": ...}}."
        )
    params = copy.deepcopy(ds_sched.get("params", {}) or {})
    if not isinstance(params, dict):
        raise ConfigError(f"ds_config scheduler.params = {params!r} must be a JSON object of {name} arguments.")
    if "last_batch_iteration" in params:
        raise ConfigError(
            "ds_config scheduler.params.last_batch_iteration: dsrl owns the schedule's position (it advances once "
            "per applied optimizer step and resumes from checkpoints). Fix: remove it."
        )
    horizon_key = _HORIZON_KEY.get(name)
    if horizon_key:
        given = params.get(horizon_key, "auto")
        if given == "auto" or given is None:
            params[horizon_key] = total_steps
        elif given != total_steps:
            raise ConfigError(
                f"ds_config scheduler.params.{horizon_key} = {given!r} disagrees with the plan's total "
                f"optimizer steps = {total_steps} (rollouts x E x R/B). Fix: remove {horizon_key} "
                f"(dsrl sets it) or set it to {total_steps}."
            )
    if name in ("WarmupLR", "WarmupDecayLR") and params.get("warmup_max_lr", "auto") == "auto":
        lr = base_lr(cfg)
        if lr is None:
            raise ConfigError(
                "ds_config scheduler.params.warmup_max_lr is unset and the ds_config has no optimizer lr. "
                "Fix: set warmup_max_lr."
            )
        params["warmup_max_lr"] = lr
    warmup_key = _WARMUP_KEY.get(name)
    if warmup_key and horizon_key:
        warm = params.get(warmup_key, 1000)
        if isinstance(warm, int) and warm >= total_steps:
            raise ConfigError(
                f"ds_config scheduler.params.{warmup_key} = {warm} is not shorter than the plan's "
                f"{total_steps} optimizer steps: the schedule would never decay. Fix: lower it."
            )
    for k, v in params.items():
        if v == "auto":
            raise ConfigError(f"ds_config scheduler.params.{k} = \"auto\": dsrl cannot derive it. Fix: set it.")
    return ScheduleSpec("deepspeed", name, params)


class PlannedScheduler:
    """Wraps a schedule so that it advances exactly once per applied optimizer step."""

    def __init__(self, spec: ScheduleSpec, optimizer: torch.optim.Optimizer):
        self.spec = spec
        self.optimizer = optimizer
        self.steps = 0  # applied optimizer steps so far
        if spec.source == "deepspeed":
            from deepspeed.runtime import lr_schedules

            cls = getattr(lr_schedules, spec.name)
            # Start at index 0 directly: step 1 runs with the schedule's first value. (Starting at -1 and
            # stepping once gives the same LRs, but DeepSpeed's warmup schedules warn about index -1.)
            self.inner = cls(optimizer, **spec.params, last_batch_iteration=0)
            self.inner.step(0)
        elif spec.source == "transformers":
            from transformers import get_scheduler

            self.inner = get_scheduler(spec.name, optimizer, **spec.params)
        else:
            self.inner = None

    def step(self) -> None:
        """Advance after an *applied* optimizer step (never after a skipped one)."""
        self.steps += 1
        if self.inner is not None:
            self.inner.step()

    def current_lr(self) -> float:
        """The LR the next optimizer step will use (first param group)."""
        lr = self.optimizer.param_groups[0]["lr"]
        return float(lr.item() if torch.is_tensor(lr) else lr)

    def state_dict(self) -> dict[str, Any]:
        return {
            "spec": {"source": self.spec.source, "name": self.spec.name},
            "steps": self.steps,
            "inner": self.inner.state_dict() if self.inner is not None else None,
            "lrs": [float(g["lr"]) for g in self.optimizer.param_groups],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore position and LRs; never re-applies steps (no double count on resume)."""
        if state["spec"]["name"] != self.spec.name:
            raise ConfigError(
                f"resume: the checkpoint's schedule is {state['spec']['name']!r} but the config asks for "
                f"{self.spec.name!r}. Fix: resume with the original scheduler settings."
            )
        self.steps = int(state["steps"])
        if self.inner is not None and state["inner"] is not None:
            self.inner.load_state_dict(state["inner"])
        for group, lr in zip(self.optimizer.param_groups, state["lrs"]):
            group["lr"] = lr


def lr_curve(spec: ScheduleSpec, lr: float, steps: list[int]) -> list[float]:
    """LR used by each given (1-based) optimizer step, simulated on a throwaway optimizer.

    The throwaway is a torch Adam (OneCycle cycles its betas; SGD has none and DeepSpeed would warn).
    """
    sched = PlannedScheduler(spec, throwaway_optimizer(lr))
    out, done = [], 1
    for k in sorted(steps):
        while done < k:
            sched.step()
            done += 1
        out.append(sched.current_lr())
    return out


def throwaway_optimizer(lr: float, optimizer: torch.optim.Optimizer | None = None) -> torch.optim.Optimizer:
    """A one-parameter optimizer to simulate a schedule on: a copy of ``optimizer`` (its settings, not its
    state) or a torch Adam with ``lr``. It has taken one (empty) step, as a schedule expects."""
    if optimizer is None:
        opt: torch.optim.Optimizer = torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    else:
        opt = copy.deepcopy(optimizer)
        opt.zero_grad(set_to_none=True)
    opt.step()  # no gradient: changes nothing, but torch then accepts scheduler steps without a warning
    return opt
