"""Asking DeepSpeed's own code about a ds_config without building an engine.

- :class:`EngineView`: just enough of a ``DeepSpeedEngine`` to run its config-only methods
  (``_do_sanity_check``, ``_configure_basic_optimizer``, ``_do_optimizer_sanity_check``) on a
  ``DeepSpeedConfig``;
- :func:`located`: a failure of DeepSpeed's code that names no field (an AssertionError, a TypeError)
  turned into a :class:`ConfigError` naming the keys without which the same code passes;
- :func:`deepspeed_warnings`: what DeepSpeed's logger warns while a block runs, collected instead of
  printed.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import json
import logging
import types
from collections.abc import Callable, Iterator
from typing import Any

from dsrl.config import ConfigError

# Keys dsrl writes into the resolved config itself: never named as the cause of an error.
SET_BY_DSRL = frozenset({"train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                         "managed_gradient_accumulation"})
# Failures of DeepSpeed's own checks (anything else is a bug, not a config problem, and propagates).
CHECK_ERRORS = (AssertionError, ValueError, TypeError, KeyError, NotImplementedError, RuntimeError)


class EngineView:
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


@contextlib.contextmanager
def deepspeed_warnings() -> Iterator[list[str]]:
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


def without(ds: dict[str, Any], path: tuple[str, ...]) -> dict[str, Any]:
    out = copy.deepcopy(ds)
    node = out
    for key in path[:-1]:
        node = node[key]
    node.pop(path[-1], None)
    return out


def _failure(build: Callable[[dict[str, Any]], Any], ds: dict[str, Any]) -> str | None:
    """The text of what ``build(ds)`` raises, or None when it passes."""
    try:
        with deepspeed_warnings():
            build(ds)
    except Exception as e:  # noqa: BLE001 - any failure counts
        return f"{type(e).__name__}: {e}"
    return None


def passes(build: Callable[[dict[str, Any]], Any], ds: dict[str, Any]) -> bool:
    return _failure(build, ds) is None


def _culprits(build: Callable[[dict[str, Any]], Any], ds: dict[str, Any], failure: str,
              path: tuple[str, ...] = (), skip: frozenset[str] = SET_BY_DSRL) -> list[str]:
    """Dotted keys under ``path`` whose removal alone makes ``build`` pass, descending into sections; if
    there are none (two independent problems), those whose removal makes ``failure`` go away."""
    for fixed in (lambda d: passes(build, d), lambda d: _failure(build, d) != failure):
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
        if fixed(without(ds, sub)):
            deeper = _culprits_by(fixed, ds, sub, skip) if isinstance(node[key], dict) and node[key] else []
            out.extend(deeper or [".".join(sub)])
    return out


def _value_at(ds: dict[str, Any], dotted: str) -> Any:
    node: Any = ds
    for key in dotted.split("."):
        node = node[key]
    return node


def located(error: BaseException, ds: dict[str, Any], build: Callable[[dict[str, Any]], Any], *,
             during: str = "DeepSpeed's config parser", start: tuple[str, ...] = (),
             skip: frozenset[str] = SET_BY_DSRL) -> ConfigError:
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
