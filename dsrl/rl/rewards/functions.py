"""The run's reward and accuracy functions, as the reward contract wraps them.

``data.reward_fn`` (a user function, imported from ``"pkg.module:attr"`` or ``"path/to/file.py:attr"``), or the
built-in task's partial-credit reward, wrapped by :class:`dsrl.rl.rewards.contract.RewardCaller` (numbers, one per
completion, each call bounded by ``data.reward_timeout_s``); the built-in task's exact-match accuracy. Every error
is a :class:`dsrl.config.ConfigError` naming the ``dsrl.data.*`` field and the fix.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
from collections.abc import Callable
from typing import Any

from dsrl.config import ConfigError, DataConfig
from dsrl.rl.rewards.contract import RewardCaller

RewardFn = Callable[[list[str], list[str], list[Any]], list[float]]




def import_object(spec: str, field_name: str = "dsrl.data.reward_fn") -> Any:
    """Import ``"pkg.module:attr"``, ``"pkg.module.attr"`` or ``"path/to/file.py:attr"``."""
    if ":" in spec:
        module_name, attr = spec.rsplit(":", 1)
    elif "." in spec:
        module_name, attr = spec.rsplit(".", 1)
    else:
        raise ConfigError(
            f"{field_name} = {spec!r} is not a dotted path. Fix: use 'package.module:function' "
            "(or 'package.module.function', or 'path/to/file.py:function')."
        )
    try:
        if module_name.endswith(".py"):
            if not os.path.isfile(module_name):
                raise FileNotFoundError(f"no such file {module_name!r}")
            name = "dsrl_user_" + os.path.splitext(os.path.basename(module_name))[0]
            loader_spec = importlib.util.spec_from_file_location(name, module_name)
            module = importlib.util.module_from_spec(loader_spec)
            loader_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except Exception as e:  # any import failure is reported against the field
        raise ConfigError(
            f"{field_name} = {spec!r}: cannot import {module_name!r}: {type(e).__name__}: {e}. "
            "Fix: make the module importable (installed, or on PYTHONPATH) or give a .py file path."
        ) from e
    try:
        obj = getattr(module, attr)
    except AttributeError:
        raise ConfigError(f"{field_name} = {spec!r}: module {module_name!r} has no attribute {attr!r}.") from None
    if not callable(obj):
        raise ConfigError(f"{field_name} = {spec!r}: {attr!r} is a {type(obj).__name__}, not a function.")
    return obj


def _is_per_sample(fn: Callable[..., Any]) -> bool:
    """Per-sample when ``fn.batched`` is False or its parameters are named prompt/completion/answer."""
    flag = getattr(fn, "batched", None)
    if isinstance(flag, bool):
        return not flag
    try:
        names = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return False
    return bool({"prompt", "completion", "answer"} & set(names[:3]))


def as_batched(fn: Callable[..., Any], field_name: str = "dsrl.data.reward_fn", spec: str | None = None,
               timeout_s: float | None = None) -> RewardCaller:
    """Wrap ``fn`` as ``(prompts, completions, answers) -> list[float]`` that keeps the reward contract
    (:mod:`dsrl.rl.rewards.contract`: numbers, one per completion, each call within ``timeout_s``).

    ``fn`` is called once per sample when it is per-sample (see :func:`_is_per_sample`), else once
    per batch. NaN is allowed (the sample is then masked out).
    """
    return RewardCaller(fn, _is_per_sample(fn), field_name, spec=spec, timeout_s=timeout_s)


def load_reward_fn(data_cfg: DataConfig) -> RewardCaller | None:
    """The run's reward function: ``data.reward_fn`` when set; else, without an environment, the built-in task's
    partial-credit reward; else None (an environment's episodes give the rule reward,
    :mod:`dsrl.rl.episodes.driver`)."""
    if data_cfg.reward_fn:
        return as_batched(import_object(data_cfg.reward_fn), spec=data_cfg.reward_fn,
                          timeout_s=data_cfg.reward_timeout_s)
    if data_cfg.environment:
        return None
    from dsrl.tasks import get_task  # no reward_fn, no environment: DataConfig guarantees a built-in task

    return as_batched(get_task(data_cfg.task).rewards, timeout_s=data_cfg.reward_timeout_s)


def load_accuracy_fn(data_cfg: DataConfig) -> RewardCaller | None:
    """Exact-match accuracy of the built-in task (1.0 / 0.0 per sample), or None for a file."""
    if not data_cfg.task or data_cfg.path:
        return None
    from dsrl.tasks import get_task

    return as_batched(get_task(data_cfg.task).accuracies)
