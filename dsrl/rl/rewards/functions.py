"""The run's reward and accuracy functions, as the reward contract wraps them.

``data.reward_fn`` -- a built-in verifiable reward by name (``math``, ``exact``: :mod:`dsrl.tasks.verifiable`) or a
user function imported from ``"pkg.module:attr"`` or ``"path/to/file.py:attr"`` -- or the built-in task's
partial-credit reward, wrapped by :class:`dsrl.rl.rewards.contract.RewardCaller` (numbers, one per completion, each
call bounded by ``data.reward_timeout_s``, the dataset's other columns where the function names them); the accuracy
(1.0 / 0.0 per sample) of a built-in reward or task, the same function evaluation uses. Every error is a
:class:`dsrl.config.ConfigError` naming the ``dsrl.data.*`` field and the fix, raised when the run loads (the
columns a function names are checked against the dataset's then).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from collections.abc import Callable
from typing import Any

from dsrl.config import ConfigError, DataConfig
from dsrl.config.names import BUILTIN_REWARDS

RewardFn = Callable[..., list[float]]  # (prompts, completions, answers, columns=None) -> list[float]


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


def as_batched(fn: Callable[..., Any], field_name: str = "dsrl.data.reward_fn", spec: str | None = None,
               timeout_s: float | None = None) -> RewardFn:
    """Wrap ``fn`` as ``(prompts, completions, answers, columns=None) -> list[float]`` that keeps the reward contract
    (:mod:`dsrl.rl.rewards.contract`: numbers, one per completion, each call within ``timeout_s``).

    ``fn`` is called once per sample when it is per-sample, else once per batch, by position or by name, with the
    columns it names (:mod:`dsrl.rl.rewards.signature`). NaN is allowed (the sample is then masked out).
    """
    from dsrl.rl.rewards.contract import RewardCaller

    return RewardCaller(fn, field_name=field_name, spec=spec, timeout_s=timeout_s)


def builtin_reward(name: str, timeout_s: float | None = None, accuracy: bool = False) -> Callable[..., list[float]]:
    """The built-in verifiable reward ``name`` (``math``, ``exact`` or ``reasoning_gym``), batched; with ``accuracy``
    its accuracy (1.0 / 0.0: the same function for ``math`` and ``exact``, whose rewards are 1.0 / 0.0 already; a full
    score for ``reasoning_gym``, whose scorers give partial credit). ``math`` bounds each comparison by
    ``min(timeout_s, SAMPLE_TIMEOUT_S)``. Without its package (math-verify, reasoning-gym), a ConfigError naming the
    extra."""
    from dsrl.tasks import verifiable

    if name == "reasoning_gym":
        from dsrl.tasks import procedural

        if not procedural.has_reasoning_gym():
            raise ConfigError(f"dsrl.data.reward_fn = {name!r}: {procedural.GYM_EXTRA}")
        return procedural.gym_accuracy if accuracy else procedural.gym_reward
    if name == "exact":
        return verifiable.exact_reward
    if not verifiable.has_math_verify():
        raise ConfigError(f"dsrl.data.reward_fn = {name!r}: {verifiable.MATH_EXTRA}")
    limit = verifiable.SAMPLE_TIMEOUT_S if timeout_s is None else min(timeout_s, verifiable.SAMPLE_TIMEOUT_S)

    def math(prompts: list[Any], completions: list[str], answers: list[Any]) -> list[float]:
        return verifiable.math_reward(prompts, completions, answers, timeout_s=limit)

    math.batched = True  # type: ignore[attr-defined]
    return math


def _check_columns(fn: Any, data_cfg: DataConfig) -> None:
    """The columns ``fn`` names (without a default) exist in the run's prompts, before any work."""
    from dsrl.rl.data.sources import DatasetSource, column_names
    from dsrl.rl.rewards.signature import check_columns

    if not fn.params.required:
        return
    if data_cfg.path:
        source = DatasetSource.of(data_cfg)
        check_columns(fn.params, column_names(source), fn.what, source.describe())
    else:
        check_columns(fn.params, ("prompt", "answer"), fn.what, f"the built-in task {data_cfg.task!r}")


def load_reward_fn(data_cfg: DataConfig) -> RewardFn | None:
    """The run's reward function: ``data.reward_fn`` when set (a built-in name or a dotted path); else, without an
    environment, the built-in task's partial-credit reward; else None (an environment's episodes give the rule
    reward, :mod:`dsrl.rl.episodes.driver`)."""
    t = data_cfg.reward_timeout_s
    if data_cfg.reward_fn in BUILTIN_REWARDS:
        fn = as_batched(builtin_reward(data_cfg.reward_fn, t), spec=data_cfg.reward_fn, timeout_s=t)
        _check_columns(fn, data_cfg)
        return fn
    if data_cfg.reward_fn:
        fn = as_batched(import_object(data_cfg.reward_fn), spec=data_cfg.reward_fn, timeout_s=t)
        _check_columns(fn, data_cfg)
        return fn
    if data_cfg.environment:
        return None
    from dsrl.tasks import get_task  # no reward_fn, no environment: DataConfig guarantees a built-in task

    return as_batched(get_task(data_cfg.task).rewards, timeout_s=t)


def load_accuracy_fn(data_cfg: DataConfig) -> RewardFn | None:
    """Accuracy (1.0 / 0.0 per sample), the same function for training rollouts and evaluation: a built-in
    ``data.reward_fn`` itself (``math``, ``exact``), else the built-in task's exact match; None for a user function
    or an environment on a dataset."""
    if data_cfg.reward_fn in BUILTIN_REWARDS:
        t = data_cfg.reward_timeout_s
        return as_batched(builtin_reward(data_cfg.reward_fn, t, accuracy=True), spec=data_cfg.reward_fn, timeout_s=t)
    if not data_cfg.task or data_cfg.path:
        return None
    from dsrl.tasks import get_task

    return as_batched(get_task(data_cfg.task).accuracies)
