"""Step 3 of :mod:`dsrl.backends.deepspeed.validation`: the optimizer DeepSpeed would build, built on a
throwaway parameter.

The type -> class mapping is DeepSpeed's own (``DeepSpeedEngine._configure_basic_optimizer``, run
through :class:`dsrl.backends.deepspeed.probe.EngineView`), and so is ZeRO's untested-optimizer rule
(``_do_optimizer_sanity_check``). A class that would JIT-compile a kernel (FusedAdam, DeepSpeedCPUAdam,
FusedLamb, Lion, ...) is never instantiated: DeepSpeed's op builder is asked whether this machine's
accelerator provides the kernel, the arguments DeepSpeed would pass are bound to the class's signature,
and the values are checked by the torch class with the same update rule where one exists. On top,
dsrl's rule: the learning rate is a finite number > 0.
"""

from __future__ import annotations

import contextlib
import copy
import difflib
import inspect
import math
from collections.abc import Iterator
from typing import Any

import torch

from dsrl.backends.deepspeed.probe import CHECK_ERRORS, EngineView, deepspeed_warnings, located
from dsrl.config import ConfigError


def _throwaway_parameter(on_gpu: bool) -> torch.nn.Parameter:
    device = "cpu"
    if on_gpu:
        from deepspeed.accelerator import get_accelerator

        device = get_accelerator().current_device_name()
    return torch.nn.Parameter(torch.zeros(2, device=device))


def _jit_optimizer_class(view: EngineView) -> tuple[type, str, dict[str, Any], type | None] | None:
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
    view = EngineView(cfg)
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
        with deepspeed_warnings() as warned:
            optimizer = _build_optimizer(ds_cfg, params, on_gpu)
    except _KernelMissing as e:
        raise ConfigError(f"ds_config optimizer.type: {e}. Fix: use Adam/AdamW (or a torch.optim type).") from None
    except (*CHECK_ERRORS, ImportError) as e:
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
            EngineView(ds_cfg)._do_optimizer_sanity_check(optimizer)
    except (AssertionError, ValueError, NotImplementedError) as e:
        stage = ds_cfg.zero_optimization_stage
        if "grad_accum_dtype" in str(e) and stage == 0:
            # dsrl asks for fp32 gradient accumulation under bf16/fp16 (ds_config.py); ZeRO-0 cannot do it.
            dtype = "bf16" if (ds.get("bf16") or {}).get("enabled") else "fp16"
            raise ConfigError(
                f"ds_config zero_optimization.stage = 0 with {dtype}: "
                "DeepSpeed's ZeRO-0 accumulates gradients only in the model's dtype, while dsrl accumulates "
                "them in fp32 for an exact mini-batch gradient (DeepSpeed: "
                f"{str(e).strip().rstrip('.')}). Fix: set zero_optimization.stage to 1 (on one device it "
                "partitions nothing), or accept low-precision accumulation with data_types.grad_accum_dtype "
                "set to the model's dtype."
            ) from None
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
    if isinstance(error, (AttributeError, AssertionError)) and not known_optimizer(name):
        return unknown_optimizer(name)

    def build(d: dict[str, Any]) -> Any:
        return _build_optimizer(ds_cfg, d["optimizer"]["params"], on_gpu)

    return located(error, {"optimizer": {"params": params}}, build,
                    during=f"building optimizer {name!r} as DeepSpeed does", start=("optimizer", "params"))


def known_optimizer(name: Any) -> bool:
    from deepspeed.runtime.config import DEEPSPEED_OPTIMIZERS

    return isinstance(name, str) and (name.lower() in DEEPSPEED_OPTIMIZERS or _torch_optimizer(name) is not None)


def _torch_optimizer(name: str) -> type | None:
    cls = getattr(torch.optim, name, None)
    return cls if isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer) else None


def unknown_optimizer(name: Any) -> ConfigError:
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
