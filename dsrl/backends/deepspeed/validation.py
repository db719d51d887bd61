"""The DeepSpeed half of a run file, validated before any work by DeepSpeed's own classes.

:func:`validated_deepspeed_config` is what ``dsrl plan`` and ``dsrl.initialize`` call. On the ds_config
that :func:`dsrl.backends.deepspeed.config.resolve_deepspeed_config` derives (the one ``deepspeed.initialize`` will
see) it runs, in order, the code DeepSpeed itself would run, and turns every failure into a
:class:`ConfigError` naming the ds_config field, without a traceback:

1. ``deepspeed.runtime.config.DeepSpeedConfig(ds_config, mpu)``: DeepSpeed's parser, with its pydantic
   sub-models (ZeRO, offload, fp16/bf16, monitors, ...), its assertions (batch fields, bf16 + fp16) and
   its ValueErrors (communication_data_type, gradient_allreduce_op, ...). A top-level key it never
   reads, and a key of a section it reads key by key, is an error too: DeepSpeed would silently
   ignore it (a typo like ``gradient_clippping``). Without torch.distributed it takes world size 1,
   which is harmless: the resolved config has no ``train_batch_size`` to check against it.
2. ``DeepSpeedEngine._do_sanity_check``, run on that config through :class:`dsrl.backends.deepspeed.probe.EngineView`
   (no engine is built): precision supported by this machine's accelerator, a known optimizer name, param_dtype,
   LAMB's dynamic loss scale, the rules of ``managed_gradient_accumulation: false`` (overlap_comm
   only on ZeRO-2, ...).
3. The optimizer DeepSpeed would build (``DeepSpeedEngine._configure_basic_optimizer``), on a
   throwaway parameter, stepped once; then ``_do_optimizer_sanity_check`` on it (ZeRO's untested
   optimizer rule); see :mod:`dsrl.backends.deepspeed.optimizer_check`. Classes that would JIT-compile a kernel
   (FusedAdam, DeepSpeedCPUAdam, FusedLamb, Lion, ...) are not instantiated: their arguments are
   bound to their signature and the values are checked by the torch class of the same update rule
   where one exists (torch.optim.Adam/AdamW).
4. The LR schedule dsrl will build (:class:`dsrl.backends.deepspeed.schedule.PlannedScheduler`: DeepSpeed's
   ``lr_schedules`` class or a transformers named schedule) on that optimizer, with the plan's horizon.

A failure that carries no field (an AssertionError, a TypeError) is located by asking the same
DeepSpeed code again without each key: the keys whose removal makes it pass are the ones named
(:func:`dsrl.backends.deepspeed.probe.located`).
On top of DeepSpeed, dsrl rejects what DeepSpeed accepts but trains meaninglessly: an LR that is not
a finite number > 0, a schedule that produces a negative or non-finite LR, and any DeepSpeed warning
raised while building the optimizer or the schedule (DeepSpeed then silently replaced a setting).
Nothing here JIT-builds an op or needs torch.distributed.
"""

from __future__ import annotations

import collections.abc
import difflib
import logging
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
from pydantic import BaseModel, ValidationError

from dsrl.backends.deepspeed.config import resolve_deepspeed_config
from dsrl.backends.deepspeed.offload import offload_refusal
from dsrl.backends.deepspeed.optimizer_check import check_optimizer, known_optimizer, unknown_optimizer
from dsrl.backends.deepspeed.probe import (
    CHECK_ERRORS,
    SET_BY_DSRL,
    EngineView,
    deepspeed_warnings,
    located,
    passes,
    without,
)
from dsrl.backends.deepspeed.schedule import PlannedScheduler, ScheduleSpec, base_lr, schedule_spec, throwaway_optimizer
from dsrl.config import Config, ConfigError
from dsrl.config.errors import config_error

# Top-level keys DeepSpeedConfig does not read, but deepspeed.initialize or dsrl do.
_READ_ELSEWHERE = frozenset({"sequence_parallel_size", "data_parallel_size"})


def validated_deepspeed_config(
    cfg: Config,
    plan: Any,
    *,
    on_gpu: bool,
    bf16_supported: bool | None = None,
    mpu: Any = None,
    client_optimizer: Any = None,
) -> tuple[dict[str, Any], ScheduleSpec]:
    """The ds_config for ``deepspeed.initialize`` and the LR schedule spec, both checked by DeepSpeed's
    own code (module docstring) before any work; every problem is a ConfigError naming the field."""
    ds = resolve_deepspeed_config(cfg, plan, on_gpu=on_gpu, bf16_supported=bf16_supported)
    if cfg.dsrl.model.lora is not None:
        check_lora_run(ds)
    if cfg.dsrl.memory.offload_states and (reason := offload_refusal(ds)):
        raise ConfigError(reason)
    with deepspeed_warnings() as warned:
        ds_cfg = check_with_deepspeed(ds, mpu=mpu, client_optimizer=client_optimizer)
        if client_optimizer is None and ds_cfg.optimizer_name is None:
            raise ConfigError(
                "the ds_config has no \"optimizer\" section (and no optimizer is passed to dsrl.initialize): DeepSpeed "
                "would build an engine that cannot take a step, and dsrl could not schedule its learning rate. Fix: "
                "add one, e.g. \"optimizer\": {\"type\": \"AdamW\", \"params\": {\"lr\": 1e-6}}.")
        optimizer = None
        if client_optimizer is None and ds_cfg.optimizer_name is not None:
            optimizer = check_optimizer(ds, ds_cfg, on_gpu=on_gpu)
        spec = schedule_spec(cfg, plan.total_optimizer_steps)
        check_schedule(spec, optimizer, base_lr(cfg), plan.total_optimizer_steps)
    for text in warned:  # DeepSpeed's warnings about a valid config (deprecated keys, ZeRO with an
        logging.getLogger("dsrl").warning("DeepSpeed: %s", text)  # untested optimizer) reach the user
    return ds, spec


def check_lora_run(ds_config: dict[str, Any]) -> None:
    """With ``dsrl.model.lora``: PEFT is installed. (The layouts LoRA does not run under, AutoTP and AutoEP, are
    refused with the run file: :mod:`dsrl.config.support`.)"""
    import importlib.util

    if importlib.util.find_spec("peft") is None:
        raise ConfigError("dsrl.model.lora needs Hugging Face PEFT, which is not installed. Fix: in the dsrl checkout, "
                          "pip install -e '.[lora]' (peft>=0.21,<0.22), or remove dsrl.model.lora to fine-tune every "
                          "parameter.")


def accelerator_is_gpu() -> bool:
    """Whether DeepSpeed's accelerator on this machine is a GPU (``DS_ACCELERATOR`` selects it)."""
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().device_name() != "cpu"


# --------------------------------------------------------------------------------------------
# 1 + 2: DeepSpeedConfig and the engine's config-only checks
# --------------------------------------------------------------------------------------------


class _Reads(dict):
    """A dict that records the keys DeepSpeed looks up (``seen`` holds dotted names; a section that is
    iterated or unpacked as a whole is recorded as ``section.*``). Sections are tracked one level deep."""

    def __init__(self, data: dict[str, Any], seen: set[str], prefix: str = "") -> None:
        wrap = not prefix  # sections of the top level, once
        super().__init__({k: (_Reads(v, seen, f"{k}.") if wrap and type(v) is dict else v)
                          for k, v in dict.items(data)})
        self._seen, self._prefix = seen, prefix

    def _mark(self, key: Any) -> None:
        self._seen.add(f"{self._prefix}{key}")

    def __getitem__(self, key: Any) -> Any:
        self._mark(key)
        return super().__getitem__(key)

    def get(self, key: Any, default: Any = None) -> Any:
        self._mark(key)
        return super().get(key, default)

    def __contains__(self, key: object) -> bool:
        self._mark(key)
        return super().__contains__(key)

    def pop(self, key: Any, *default: Any) -> Any:
        self._mark(key)
        return super().pop(key, *default)

    def keys(self) -> collections.abc.KeysView:  # `k in d.keys()` then goes through __contains__
        return collections.abc.KeysView(self)

    def __iter__(self) -> Iterator[Any]:
        self._mark("*")
        return super().__iter__()

    def items(self) -> Any:
        self._mark("*")
        return super().items()

    def values(self) -> Any:
        self._mark("*")
        return super().values()

    def __copy__(self) -> _Reads:
        return _Reads(dict(super().items()), self._seen, self._prefix)


def _parse(ds: dict[str, Any], mpu: Any = None, seen: set[str] | None = None) -> Any:
    """DeepSpeed's own parse of ``ds`` (as deepspeed.initialize does it)."""
    from deepspeed.runtime.config import DeepSpeedConfig

    return DeepSpeedConfig(_Reads(ds, seen if seen is not None else set()), mpu=mpu)


def _parse_and_check(ds: dict[str, Any], mpu: Any = None, client_optimizer: Any = None) -> Any:
    ds_cfg = _parse(ds, mpu)
    EngineView(ds_cfg, client_optimizer)._do_sanity_check()
    return ds_cfg


def check_with_deepspeed(ds: dict[str, Any], *, mpu: Any = None, client_optimizer: Any = None) -> Any:
    """Steps 1 and 2 of the module docstring; returns the ``DeepSpeedConfig``."""
    seen: set[str] = set()
    try:
        ds_cfg = _parse(ds, mpu, seen)
    except ValidationError as e:
        raise _from_deepspeed_model(e, ds) from None
    except Exception as e:  # noqa: BLE001 - whatever DeepSpeed's parser raises on user input is reported
        raise located(e, ds, lambda d: _parse(d, mpu)) from None
    _reject_unread_keys(ds, seen)
    name = ds_cfg.optimizer_name
    if client_optimizer is None and name is not None and not known_optimizer(name):
        raise unknown_optimizer(ds["optimizer"].get("type"))
    try:
        EngineView(ds_cfg, client_optimizer)._do_sanity_check()
    except (AssertionError, ValueError, NotImplementedError) as e:
        from deepspeed.accelerator import get_accelerator

        during = f"DeepSpeed's engine check ({get_accelerator().device_name().upper()} accelerator)"
        raise located(e, ds, lambda d: _parse_and_check(d, mpu, client_optimizer), during=during) from None
    return ds_cfg


def _reject_unread_keys(ds: dict[str, Any], seen: set[str]) -> None:
    """Keys DeepSpeed never looked at would be ignored silently: a typo, or a setting of another version."""
    top = [k for k in seen if "." not in k]
    for key, value in ds.items():
        if key not in seen and key not in _READ_ELSEWHERE:
            close = difflib.get_close_matches(key, top, n=1)
            raise ConfigError(
                f"ds_config {key} is not a setting DeepSpeed reads (it would be ignored silently)"
                + (f"; did you mean {close[0]}?" if close else ".") + " Fix: rename or remove it."
            )
        inner = [k.split(".", 1)[1] for k in seen if k.startswith(f"{key}.")]
        if isinstance(value, dict) and inner and "*" not in inner:  # a section DeepSpeed reads key by key
            for sub in value:
                if sub not in inner:
                    close = difflib.get_close_matches(sub, inner, n=1)
                    raise ConfigError(
                        f"ds_config {key}.{sub} is not a setting DeepSpeed reads (it would be ignored silently)"
                        + (f"; did you mean {key}.{close[0]}?" if close else ".") + " Fix: rename or remove it."
                    )


def _deepspeed_model(name: str) -> type[BaseModel] | None:
    """The DeepSpeed pydantic model class called ``name`` (a ValidationError's title)."""
    from deepspeed.runtime.config_utils import DeepSpeedConfigModel

    todo = [DeepSpeedConfigModel]
    while todo:
        cls = todo.pop()
        if cls.__name__ == name:
            return cls
        todo.extend(cls.__subclasses__())
    return None


def _walk(node: Any, loc: tuple[Any, ...]) -> bool:
    for item in loc:
        if not isinstance(node, dict) or item not in node:
            return False
        node = node[item]
    return True


def _from_deepspeed_model(error: ValidationError, ds: dict[str, Any]) -> ConfigError:
    """A ValidationError of one of DeepSpeed's section models, with the section's ds_config key found."""
    first = error.errors(include_url=False)[0]
    loc = tuple(first["loc"])
    model = _deepspeed_model(error.title)
    if _walk(ds, loc):  # a model over several top-level keys (the monitors)
        section: str | None = ""
    else:
        section = next((k for k, v in ds.items() if isinstance(v, dict) and _walk(v, loc)), None)
    if section is None:  # e.g. a missing field: the section whose removal makes the error go away
        section = next((k for k in ds if k not in SET_BY_DSRL and passes(lambda d: _parse(d), without(ds, (k,)))),
                       None)
    if model is None or section is None:
        where = f"ds_config {section}" if section else "ds_config"
        return ConfigError(f"{where}: DeepSpeed's {error.title} rejects it: {first['msg']} at "
                           f"{'.'.join(map(str, loc))} (value {first.get('input')!r}). Fix: correct that setting.")
    return config_error(error, model, section, lead="ds_config ", own=False)


# --------------------------------------------------------------------------------------------
# 4: the LR schedule
# --------------------------------------------------------------------------------------------


# Steps whose LR is checked one by one (about 3 us each); a longer run is checked over its first ones.
MAX_CHECKED_STEPS = 1_000_000


def check_schedule(spec: ScheduleSpec, optimizer: torch.optim.Optimizer | None, lr: float | None,
                   total_steps: int) -> None:
    """Step 4 of the module docstring: build the schedule on a throwaway copy of the optimizer (a torch
    Adam when DeepSpeed's would be a kernel class or the user passes one) and read the LR of every step."""
    if spec.source == "constant":
        return

    def build(params: dict[str, Any]) -> list[float]:
        opt = throwaway_optimizer(lr if lr is not None else 1.0, optimizer)
        with deepspeed_warnings() as warned:
            sched = PlannedScheduler(ScheduleSpec(spec.source, spec.name, params), opt)
            lrs = [sched.current_lr()]
            for _ in range(min(total_steps, MAX_CHECKED_STEPS) - 1):
                sched.step()
                lrs.append(sched.current_lr())
        if warned:  # DeepSpeed replaced a setting it could not use (e.g. an unknown warmup_type)
            raise ValueError(f"DeepSpeed warned: {warned[0]}")
        bad = next(((k, v) for k, v in enumerate(lrs, 1) if not math.isfinite(v) or v < 0), None)
        if bad is not None:  # DeepSpeed would apply it: a negative LR ascends the loss, NaN poisons weights
            raise ValueError(f"it gives optimizer step {bad[0]} the learning rate {bad[1]!r}; every step needs a "
                             "finite LR >= 0")
        return lrs

    try:
        build(dict(spec.params))
    except CHECK_ERRORS as e:
        raise _schedule_error(e, spec, build) from None


def _schedule_error(error: BaseException, spec: ScheduleSpec, build: Callable[[dict[str, Any]], Any]) -> ConfigError:
    if spec.source == "transformers":
        kwargs = dict(spec.params.get("scheduler_specific_kwargs") or {})
        names = [k for k in kwargs if passes(lambda d: build({**spec.params, "scheduler_specific_kwargs": d}),
                                              {j: v for j, v in kwargs.items() if j != k})]
        where = (" and ".join(f"dsrl.scheduler.kwargs.{k} = {kwargs[k]!r}" for k in names)
                 or f"dsrl.scheduler.name = {spec.name!r}")
        return ConfigError(f"{where}: transformers rejects it: {str(error).strip()}. Fix: correct it.")
    return located(error, {"scheduler": {"params": dict(spec.params)}},
                    lambda d: build(d["scheduler"]["params"]), during=f"building DeepSpeed's schedule {spec.name}",
                    start=("scheduler", "params"), skip=frozenset({"scheduler.params.total_num_steps"}))
