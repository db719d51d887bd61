"""The base of every "dsrl" section model and the ``setting`` helper that documents a field.

Invariants kept by :class:`Section` (and so by every section):
- types are strict: no bool for a number, no string for a number, no float for an integer; numbers
  are finite; unknown keys are errors with a close-match suggestion;
- every rule that needs neither the world size, the dataset nor the ds_config is a ``Field``
  constraint or a ``model_validator`` of the section it concerns (or of
  :class:`dsrl.config.root.DsrlConfig` when it spans sections); each validator's docstring is the rule
  as docs/configuration.md states it;
- constructing any section directly (``RolloutConfig(max_new_tokens=10)``) validates it the same way
  and raises :class:`dsrl.config.ConfigError`, never a pydantic error.

The rules that need the world size live in :mod:`dsrl.core.plan`, those that need the scheduler
horizon in :mod:`dsrl.backends.deepspeed.schedule`, those that need the data files in
:mod:`dsrl.rl.data.prompts`, and the DeepSpeed half is validated by DeepSpeed's own classes
(:mod:`dsrl.backends.deepspeed.validation`).
"""

from __future__ import annotations

import contextvars
import functools
from collections.abc import Callable
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic_core import PydanticUndefined

from dsrl.config.errors import ConfigError, config_error, problems_error


def setting(default: Any = PydanticUndefined, doc: str = "", unit: str = "", **constraints: Any) -> Any:
    """A documented field: ``doc`` and ``unit`` feed docs/configuration.md and the error messages."""
    extra = {"unit": unit} if unit else None
    if isinstance(default, type):  # a mutable default: dict, list
        return Field(default_factory=default, description=doc, json_schema_extra=extra, **constraints)
    return Field(default, description=doc, json_schema_extra=extra, **constraints)


class Section(BaseModel):
    """Base of the "dsrl" sections: strict, closed, and every validation error is a ConfigError."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, validate_assignment=True)
    PATH: ClassVar[str] = "dsrl"

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as e:
            raise config_error(e, type(self), self.PATH) from None

    def __setattr__(self, name: str, value: Any) -> None:
        try:
            super().__setattr__(name, value)
        except ValidationError as e:
            raise config_error(e, type(self), self.PATH) from None


_COLLECTED: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar("dsrl_config_problems", default=None)


def collected(rule: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """Wrap a model rule (under ``@model_validator(mode="after")``) so that its ConfigError is kept with the other
    collected rules' instead of stopping them; the model's last validator, :func:`report_collected`, raises them
    together (a run file's every cross-section problem at once). The rule's docstring stays its documentation."""

    @functools.wraps(rule)
    def run(self: Any) -> Any:
        try:
            return rule(self)
        except ConfigError as e:
            found = _COLLECTED.get()
            if found is None:
                found = []
                _COLLECTED.set(found)
            found.extend(e.problems)
            return self

    return run


def start_collecting() -> None:
    """Forget problems a validation that ended abnormally left behind (call at the start of a model's validation)."""
    _COLLECTED.set(None)


def report_collected(model: Any) -> Any:
    """Raise the problems the :func:`collected` rules found (one ConfigError, every problem listed), if any."""
    found = _COLLECTED.get()
    _COLLECTED.set(None)
    if found:
        raise problems_error(found)
    return model


def exactly_one(path: str, a: str, a_value: Any, a_means: str, b: str, b_value: Any, b_means: str) -> None:
    if (a_value is None) == (b_value is None):
        raise ConfigError(
            f"{path}: set exactly one of {a} ({a_means}, got {a_value!r}) and {b} ({b_means}, got {b_value!r}). "
            "Fix: keep one and set the other to null."
        )
