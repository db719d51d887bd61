"""The DeepSpeed half of a run file, validated before any work by DeepSpeed's own classes.

:func:`validated_deepspeed_config` is what ``dsrl plan`` and ``dsrl.initialize`` call. On the ds_config
that :func:`dsrl.ds_config.resolve_deepspeed_config` derives (the one ``deepspeed.initialize`` will
see) it runs, in order, the code DeepSpeed itself would run, and turns every failure into a
:class:`ConfigError` naming the ds_config field, without a traceback:

1. ``deepspeed.runtime.config.DeepSpeedConfig(ds_config, mpu)``: DeepSpeed's parser, with its pydantic
   sub-models (ZeRO, offload, fp16/bf16, monitors, ...), its assertions (batch fields, bf16 + fp16) and
   its ValueErrors (communication_data_type, gradient_allreduce_op, ...). A top-level key it never
   reads, and a key of a section it reads key by key, is an error too: DeepSpeed would silently
   ignore it (a typo like ``gradient_clippping``). Without torch.distributed it takes world size 1,
   which is harmless: the resolved config has no ``train_batch_size`` to check against it.
2. ``DeepSpeedEngine._do_sanity_check``, run on that config through :class:`_EngineView` (no engine
   is built): precision supported by this machine's accelerator, a known optimizer name, param_dtype,
   LAMB's dynamic loss scale, the rules of ``managed_gradient_accumulation: false`` (overlap_comm
   only on ZeRO-2, ...).
3. The optimizer DeepSpeed would build (``DeepSpeedEngine._configure_basic_optimizer``), on a
   throwaway parameter, stepped once; then ``_do_optimizer_sanity_check`` on it (ZeRO's untested
   optimizer rule). Classes that would JIT-compile a kernel (FusedAdam, DeepSpeedCPUAdam, FusedLamb,
   Lion, ...) are not instantiated: their arguments are bound to their signature and the values are
   checked by the torch class of the same update rule where one exists (torch.optim.Adam/AdamW).
4. The LR schedule dsrl will build (:class:`dsrl.schedule.PlannedScheduler`: DeepSpeed's
   ``lr_schedules`` class or a transformers named schedule) on that optimizer, with the plan's horizon.

A failure that carries no field (an AssertionError, a TypeError) is located by asking the same
DeepSpeed code again without each key: the keys whose removal makes it pass are the ones named.
On top of DeepSpeed, dsrl rejects what DeepSpeed accepts but trains meaninglessly: an LR that is not
a finite number > 0, a schedule that produces a negative or non-finite LR, and any DeepSpeed warning
raised while building the optimizer or the schedule (DeepSpeed then silently replaced a setting).
Nothing here JIT-builds an op or needs torch.distributed.
"""

from __future__ import annotations

import collections.abc
import contextlib
import copy
import difflib
import inspect
import json
import logging
import math
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
from pydantic import BaseModel, ValidationError

from dsrl.config import Config, ConfigError
from dsrl.config_errors import config_error
from dsrl.ds_config import resolve_deepspeed_config
from dsrl.schedule import PlannedScheduler, ScheduleSpec, base_lr, schedule_spec, throwaway_optimizer

# Top-level keys DeepSpeedConfig does not read, but deepspeed.initialize or dsrl do.
_READ_ELSEWHERE = frozenset({"sequence_parallel_size", "data_parallel_size"})
# Keys dsrl writes into the resolved config itself: never named as the cause of an error.
_SET_BY_DSRL = frozenset({"train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                          "managed_gradient_accumulation"})
# Failures of DeepSpeed's own checks (anything else is a bug, not a config problem, and propagates).
_CHECK_ERRORS = (AssertionError, ValueError, TypeError, KeyError, NotImplementedError, RuntimeError)


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
    with _deepspeed_warnings() as warned:
        ds_cfg = check_with_deepspeed(ds, mpu=mpu, client_optimizer=client_optimizer)
        optimizer = None
        if client_optimizer is None and ds_cfg.optimizer_name is not None:
            optimizer = check_optimizer(ds, ds_cfg, on_gpu=on_gpu)
        spec = schedule_spec(cfg, plan.total_optimizer_steps)
        check_schedule(spec, optimizer, base_lr(cfg), plan.total_optimizer_steps)
    for text in warned:  # DeepSpeed's warnings about a valid config (deprecated keys, ZeRO with an
        logging.getLogger("dsrl").warning("DeepSpeed: %s", text)  # untested optimizer) reach the user
    return ds, spec


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
    _EngineView(ds_cfg, client_optimizer)._do_sanity_check()
    return ds_cfg


def check_with_deepspeed(ds: dict[str, Any], *, mpu: Any = None, client_optimizer: Any = None) -> Any:
    """Steps 1 and 2 of the module docstring; returns the ``DeepSpeedConfig``."""
    seen: set[str] = set()
    try:
        ds_cfg = _parse(ds, mpu, seen)
    except ValidationError as e:
        raise _from_deepspeed_model(e, ds) from None
    except Exception as e:  # noqa: BLE001 - whatever DeepSpeed's parser raises on user input is reported
        raise _located(e, ds, lambda d: _parse(d, mpu)) from None
    _reject_unread_keys(ds, seen)
    name = ds_cfg.optimizer_name
    if client_optimizer is None and name is not None and not _known_optimizer(name):
        raise _unknown_optimizer(ds["optimizer"].get("type"))
    try:
        _EngineView(ds_cfg, client_optimizer)._do_sanity_check()
    except (AssertionError, ValueError, NotImplementedError) as e:
        from deepspeed.accelerator import get_accelerator

        during = f"DeepSpeed's engine check ({get_accelerator().device_name().upper()} accelerator)"
        raise _located(e, ds, lambda d: _parse_and_check(d, mpu, client_optimizer), during=during) from None
    return ds_cfg


class _EngineView:
    """Just enough of a ``DeepSpeedEngine`` for its config-only methods, without building one.

    Any attribute this class does not hold is looked up on ``DeepSpeedEngine`` and bound to the view,
    so ``view._do_sanity_check()`` runs DeepSpeed's own code on ``config`` (a ``DeepSpeedConfig``).
    """

    def __init__(self, config: Any, client_optimizer: Any = None) -> None:
        self._config = config
        self.client_optimizer = client_optimizer
        self.client_lr_scheduler = None
        self.pipeline_parallelism = False  # dsrl refuses DeepSpeed's pipeline engine (ds_config.py)
        self.has_moe_layers = False
        self.global_rank = 0

    def __getattr__(self, name: str) -> Any:
        from deepspeed.runtime.engine import DeepSpeedEngine

        attr = inspect.getattr_static(DeepSpeedEngine, name)
        if isinstance(attr, staticmethod):
            return attr.__func__
        if isinstance(attr, classmethod):
            return attr.__get__(None, DeepSpeedEngine)
        if isinstance(attr, property):
            return attr.fget(self)
        if inspect.isfunction(attr):
            return types.MethodType(attr, self)
        raise AttributeError(name)


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
        section = next((k for k in ds if k not in _SET_BY_DSRL and _passes(lambda d: _parse(d), _without(ds, (k,)))),
                       None)
    if model is None or section is None:
        where = f"ds_config {section}" if section else "ds_config"
        return ConfigError(f"{where}: DeepSpeed's {error.title} rejects it: {first['msg']} at "
                           f"{'.'.join(map(str, loc))} (value {first.get('input')!r}). Fix: correct that setting.")
    return config_error(error, model, section, lead="ds_config ", own=False)


# --------------------------------------------------------------------------------------------
# Locating a failure that names no field
# --------------------------------------------------------------------------------------------


def _without(ds: dict[str, Any], path: tuple[str, ...]) -> dict[str, Any]:
    out = copy.deepcopy(ds)
    node = out
    for key in path[:-1]:
        node = node[key]
    node.pop(path[-1], None)
    return out


def _failure(build: Callable[[dict[str, Any]], Any], ds: dict[str, Any]) -> str | None:
    """The text of what ``build(ds)`` raises, or None when it passes."""
    try:
        with _deepspeed_warnings():
            build(ds)
    except Exception as e:  # noqa: BLE001 - any failure counts
        return f"{type(e).__name__}: {e}"
    return None


def _passes(build: Callable[[dict[str, Any]], Any], ds: dict[str, Any]) -> bool:
    return _failure(build, ds) is None


def _culprits(build: Callable[[dict[str, Any]], Any], ds: dict[str, Any], failure: str,
              path: tuple[str, ...] = (), skip: frozenset[str] = _SET_BY_DSRL) -> list[str]:
    """Dotted keys under ``path`` whose removal alone makes ``build`` pass, descending into sections; if
    there are none (two independent problems), those whose removal makes ``failure`` go away."""
    for fixed in (lambda d: _passes(build, d), lambda d: _failure(build, d) != failure):
        found = _culprits_by(fixed, ds, path, skip)
        if found:
            return found
    return []


def _culprits_by(fixed: Callable[[dict[str, Any]], bool], ds: dict[str, Any], path: tuple[str, ...],
                 skip: frozenset[str]) -> list[str]:
    node: Any = ds
    for key in path:
        node = node[key]
    out: list[str] = []
    for key in list(node):
        sub = (*path, key)
        if ".".join(sub) in skip:
            continue
        if fixed(_without(ds, sub)):
            deeper = _culprits_by(fixed, ds, sub, skip) if isinstance(node[key], dict) and node[key] else []
            out.extend(deeper or [".".join(sub)])
    return out


def _value_at(ds: dict[str, Any], dotted: str) -> Any:
    node: Any = ds
    for key in dotted.split("."):
        node = node[key]
    return node


def _located(error: BaseException, ds: dict[str, Any], build: Callable[[dict[str, Any]], Any], *,
             during: str = "DeepSpeed's config parser", start: tuple[str, ...] = (),
             skip: frozenset[str] = _SET_BY_DSRL) -> ConfigError:
    """A ConfigError naming the keys of ``ds`` (under ``start``) without which ``build`` (DeepSpeed's
    code) passes."""
    text = str(error).strip().rstrip(".") or type(error).__name__
    names = _culprits(build, ds, f"{type(error).__name__}: {error}", start, skip)
    if not names:
        where = f" {'.'.join(start)}" if start else ""
        return ConfigError(f"ds_config{where}: {during} fails: {text}. Fix: correct the setting it names.")
    shown = " and ".join(f"{n} = {_value_at(ds, n)!r}" for n in names)
    sections = dict.fromkeys(n.rsplit(".", 1)[0] for n in names if "." in n)
    shown_sections = {sec: json.dumps(_value_at(ds, sec), default=repr) for sec in sections}
    context = "; ".join(f"{sec} = {text}" for sec, text in shown_sections.items()  # short sections only
                        if len(text) <= 80 and len(_value_at(ds, sec)) > 1)
    which = "it" if len(names) == 1 else "one of them"
    return ConfigError(f"ds_config {shown}{f' (in {context})' if context else ''}: {during} fails: {text}. "
                       f"Fix: change or remove {which}.")


# --------------------------------------------------------------------------------------------
# 3: the optimizer DeepSpeed would build
# --------------------------------------------------------------------------------------------


def _throwaway_parameter(on_gpu: bool) -> torch.nn.Parameter:
    device = "cpu"
    if on_gpu:
        from deepspeed.accelerator import get_accelerator

        device = get_accelerator().current_device_name()
    return torch.nn.Parameter(torch.zeros(2, device=device))


def _jit_optimizer_class(view: _EngineView) -> tuple[type, str, dict[str, Any], type | None] | None:
    """For a type DeepSpeed serves with a kernel it would JIT-compile (the mapping of
    ``_configure_basic_optimizer``): (that class, its op builder, the keyword arguments DeepSpeed adds,
    the torch class with the same update rule or None); else None (the class is built for real)."""
    name = view.optimizer_name()
    params = view.optimizer_params() or {}
    offload = view.zero_use_cpu_optimizer()
    if name in ("adam", "adamw") and not params.get("torch_adam", False):
        adam_w = name == "adamw" or params.get("adam_w_mode", True)
        twin = torch.optim.AdamW if adam_w else torch.optim.Adam
        if offload:
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            return DeepSpeedCPUAdam, "CPUAdamBuilder", {"adamw_mode": adam_w, "fp32_optimizer_states": True}, twin
        from deepspeed.ops.adam import FusedAdam

        return FusedAdam, "FusedAdamBuilder", {"adam_w_mode": adam_w}, twin
    if name == "adagrad" and offload:
        from deepspeed.ops.adagrad import DeepSpeedCPUAdagrad

        return DeepSpeedCPUAdagrad, "CPUAdagradBuilder", {}, torch.optim.Adagrad
    if name == "lamb":
        from deepspeed.ops.lamb import FusedLamb

        return FusedLamb, "FusedLambBuilder", {}, None
    if name == "lion":
        from deepspeed.ops.lion import DeepSpeedCPULion, FusedLion

        return (DeepSpeedCPULion, "CPULionBuilder", {}, None) if offload else (FusedLion, "FusedLionBuilder", {}, None)
    return None


def _kernel_available(builder_name: str) -> bool:
    """Whether this machine's accelerator provides DeepSpeed's op (asked without building it)."""
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder(builder_name)
    return builder is not None and type(builder).__name__ != "NotImplementedBuilder" and bool(
        builder.is_compatible(verbose=False))


def _build_optimizer(ds_cfg: Any, params: dict[str, Any], on_gpu: bool) -> torch.optim.Optimizer | None:
    """The optimizer DeepSpeed would build from ``ds_cfg`` with ``params`` as its ``optimizer.params``,
    stepped once on a zero gradient; None for a kernel class (checked without instantiating it)."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    cfg = copy.copy(ds_cfg)
    cfg.optimizer_params = params
    view = _EngineView(cfg)
    param = _throwaway_parameter(on_gpu)
    jit = _jit_optimizer_class(view)
    if jit is not None:
        cls, builder, added, twin = jit
        if not _kernel_available(builder):
            raise _KernelMissing(f"DeepSpeed builds optimizer.type = {view.optimizer_name()!r} as {cls.__name__}, "
                                 f"whose kernel ({builder}) this machine's accelerator does not provide")
        kwargs = {k: v for k, v in params.items() if k not in ("torch_adam", "adam_w_mode", "fp32_optimizer_states")}
        inspect.signature(cls).bind([param], **kwargs, **added)  # the arguments DeepSpeed would pass
        if twin is not None:  # the values, checked by the torch class of the same update rule
            shared = set(inspect.signature(twin).parameters) & set(kwargs)
            twin([param], **{k: kwargs[k] for k in shared})
        return None
    if view.optimizer_name() in ("muadam", "muadamw", "musgd"):
        import mup  # noqa: F401 - DeepSpeed needs it for these types (ImportError is reported)
    optimizer = DeepSpeedEngine._configure_basic_optimizer(view, [param])
    param.grad = torch.zeros_like(param)
    optimizer.step()
    optimizer.zero_grad()
    return optimizer


class _KernelMissing(Exception):
    """The optimizer type needs a DeepSpeed kernel the accelerator does not have."""


def check_optimizer(ds: dict[str, Any], ds_cfg: Any, *, on_gpu: bool) -> torch.optim.Optimizer | None:
    """Step 3 of the module docstring; returns the throwaway optimizer (None for a kernel class)."""
    section = ds.get("optimizer")
    params = section.get("params", {}) if isinstance(section, dict) else {}
    if not isinstance(params, dict):
        raise ConfigError(f"ds_config optimizer.params = {params!r} must be a JSON object of the optimizer's "
                          "arguments, e.g. {\"lr\": 1e-5}.")
    lr = params.get("lr")
    if lr is not None and (isinstance(lr, bool) or not isinstance(lr, (int, float))
                           or not math.isfinite(lr) or lr <= 0):
        raise ConfigError(
            f"ds_config optimizer.params.lr = {lr!r}: the learning rate must be a finite number > 0 "
            "(DeepSpeed would accept it and train meaninglessly or fail mid-step). Fix: set e.g. 1e-5."
        )
    try:
        with _deepspeed_warnings() as warned:
            optimizer = _build_optimizer(ds_cfg, params, on_gpu)
    except _KernelMissing as e:
        raise ConfigError(f"ds_config optimizer.type: {e}. Fix: use Adam/AdamW (or a torch.optim type).") from None
    except (*_CHECK_ERRORS, ImportError) as e:
        raise _optimizer_error(e, ds, ds_cfg, params, on_gpu) from None
    if warned:
        raise ConfigError(f"ds_config optimizer: DeepSpeed replaced a setting while building it: {warned[0]} "
                          "Fix: set it as DeepSpeed expects.")
    if optimizer is not None:
        _check_zero_support(optimizer, ds, ds_cfg)
    return optimizer


def _check_zero_support(optimizer: torch.optim.Optimizer, ds: dict[str, Any], ds_cfg: Any) -> None:
    """DeepSpeed's ``_do_optimizer_sanity_check`` on the built optimizer (ZeRO's untested-optimizer rule)."""
    try:
        with _zero_support_check_without_comm():
            _EngineView(ds_cfg)._do_optimizer_sanity_check(optimizer)
    except (AssertionError, ValueError, NotImplementedError) as e:
        stage = ds_cfg.zero_optimization_stage
        raise ConfigError(
            f"ds_config optimizer.type = {ds['optimizer'].get('type')!r} with zero_optimization.stage = {stage}: "
            f"DeepSpeed rejects this: {str(e).strip().rstrip('.')}. Fix: follow DeepSpeed's advice, use Adam/AdamW, "
            "or change zero_optimization.stage."
        ) from None


def _optimizer_error(error: BaseException, ds: dict[str, Any], ds_cfg: Any, params: dict[str, Any],
                     on_gpu: bool) -> ConfigError:
    name = ds["optimizer"].get("type")
    if isinstance(error, ImportError):
        return ConfigError(f"ds_config optimizer.type = {name!r} needs a package that is not installed ({error}). "
                           "Fix: install it or use another optimizer type.")
    if isinstance(error, (AttributeError, AssertionError)) and not _known_optimizer(name):
        return _unknown_optimizer(name)

    def build(d: dict[str, Any]) -> Any:
        return _build_optimizer(ds_cfg, d["optimizer"]["params"], on_gpu)

    return _located(error, {"optimizer": {"params": params}}, build,
                    during=f"building optimizer {name!r} as DeepSpeed does", start=("optimizer", "params"))


def _known_optimizer(name: Any) -> bool:
    from deepspeed.runtime.config import DEEPSPEED_OPTIMIZERS

    return isinstance(name, str) and (name.lower() in DEEPSPEED_OPTIMIZERS or _torch_optimizer(name) is not None)


def _torch_optimizer(name: str) -> type | None:
    cls = getattr(torch.optim, name, None)
    return cls if isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer) else None


def _unknown_optimizer(name: Any) -> ConfigError:
    from deepspeed.runtime.config import DEEPSPEED_OPTIMIZERS

    torch_names = [n for n in dir(torch.optim) if _torch_optimizer(n) is not None and n != "Optimizer"]
    close = difflib.get_close_matches(str(name), [*DEEPSPEED_OPTIMIZERS, *torch_names], n=1)
    return ConfigError(
        f"ds_config optimizer.type = {name!r} is not an optimizer DeepSpeed can build: use one of DeepSpeed's "
        f"({', '.join(DEEPSPEED_OPTIMIZERS)}, any case) or a torch.optim class name ({', '.join(torch_names)})"
        + (f"; did you mean {close[0]!r}?" if close else ".") + " Fix: correct optimizer.type."
    )


@contextlib.contextmanager
def _zero_support_check_without_comm() -> Iterator[None]:
    """DeepSpeed's is_zero_supported_optimizer asks deepspeed.comm for the rank only to log; without a
    process group (``dsrl plan``) the same list check runs without that call."""
    import deepspeed.comm as ds_comm
    from deepspeed.runtime import engine as ds_engine
    from deepspeed.runtime.zero import utils as zero_utils

    if ds_comm.is_initialized():
        yield
        return
    original = ds_engine.is_zero_supported_optimizer
    ds_engine.is_zero_supported_optimizer = lambda opt: type(opt) in zero_utils.ZERO_SUPPORTED_OPTIMIZERS
    try:
        yield
    finally:
        ds_engine.is_zero_supported_optimizer = original


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
        with _deepspeed_warnings() as warned:
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
    except _CHECK_ERRORS as e:
        raise _schedule_error(e, spec, build) from None


def _schedule_error(error: BaseException, spec: ScheduleSpec, build: Callable[[dict[str, Any]], Any]) -> ConfigError:
    if spec.source == "transformers":
        kwargs = dict(spec.params.get("scheduler_specific_kwargs") or {})
        names = [k for k in kwargs if _passes(lambda d: build({**spec.params, "scheduler_specific_kwargs": d}),
                                              {j: v for j, v in kwargs.items() if j != k})]
        where = (" and ".join(f"dsrl.scheduler.kwargs.{k} = {kwargs[k]!r}" for k in names)
                 or f"dsrl.scheduler.name = {spec.name!r}")
        return ConfigError(f"{where}: transformers rejects it: {str(error).strip()}. Fix: correct it.")
    return _located(error, {"scheduler": {"params": dict(spec.params)}},
                    lambda d: build(d["scheduler"]["params"]), during=f"building DeepSpeed's schedule {spec.name}",
                    start=("scheduler", "params"), skip=frozenset({"scheduler.params.total_num_steps"}))


# --------------------------------------------------------------------------------------------
# DeepSpeed's log
# --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _deepspeed_warnings() -> Iterator[list[str]]:
    """Collect (and keep off the console) what DeepSpeed's logger warns while the block runs."""
    from deepspeed.utils.logging import logger

    caught: list[str] = []

    def keep(record: logging.LogRecord) -> bool:
        if record.levelno >= logging.WARNING:
            caught.append(record.getMessage())
            return False
        return True

    logger.filters.insert(0, keep)  # type: ignore[arg-type]
    try:
        yield caught
    finally:
        logger.removeFilter(keep)
