"""How a reward function takes its arguments, read once from its signature: per sample or batched, by position or by
name, and which of the dataset's other columns it wants as keyword arguments.

The rules (docs/data.md states them for users):

- **per sample or batched**: ``fn.batched`` (True/False) decides when set; else a function with a parameter named
  ``prompts``, ``completions`` or ``answers`` is batched, one whose first three parameters include ``prompt``,
  ``completion`` or ``answer`` is per sample, and any other is batched;
- **by position** (today's contract, ``(prompts, completions, answers)`` whatever the parameters are called): when
  the function has three positional parameters (or ``*args``) and no ``completions``/``completion`` parameter
  elsewhere than second;
- **by name** otherwise, when it has a parameter ``completions`` (``completion`` per sample), as TRL calls reward
  functions: ``completions=`` always, ``prompts=`` and ``answers=`` (singular per sample) where it takes them;
- **columns**: every other named parameter that can be given by keyword names a column it receives (a list for a
  batched function, one value per sample otherwise); ``**kwargs`` receives every column. Columns whose names the
  call already uses (the three arguments' own names) are not passed again. A named column parameter without a
  default that the dataset lacks is an error before any work (:func:`check_columns`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dsrl.config import ConfigError

_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
_BY_NAME = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


@dataclass(frozen=True)
class RewardParameters:
    """How one reward function is called (module docstring)."""

    per_sample: bool
    by_name: bool
    arguments: tuple[str, str, str]  # by name: the names prompts, completions, answers go by (singular per sample)
    takes: tuple[bool, bool, bool]  # by name: whether the function takes prompts, completions, answers
    columns: frozenset[str] | None  # the columns it names; None: **kwargs, every column
    required: frozenset[str]  # named columns without a default
    reserved: frozenset[str]  # names the call itself uses, never passed as a column

    def pick(self, columns: Mapping[str, Sequence[Any]]) -> dict[str, Sequence[Any]]:
        """The columns this function receives."""
        return {k: v for k, v in columns.items()
                if k not in self.reserved and (self.columns is None or k in self.columns)}

    def call(self, fn: Callable[..., Any], prompts: Any, completions: Any, answers: Any,
             columns: Mapping[str, Any]) -> Any:
        """``fn`` called with one batch (or one sample) and its picked columns."""
        if not self.by_name:
            return fn(prompts, completions, answers, **columns)
        given = {name: value for name, value, takes in zip(self.arguments, (prompts, completions, answers), self.takes)
                 if takes}
        return fn(**given, **columns)


def _per_sample(fn: Callable[..., Any], names: list[str]) -> bool:
    flag = getattr(fn, "batched", None)
    if isinstance(flag, bool):
        return not flag
    if {"prompts", "completions", "answers"} & set(names):
        return False
    return bool({"prompt", "completion", "answer"} & set(names[:3]))


def parameters_of(fn: Callable[..., Any], field_name: str = "dsrl.data.reward_fn",
                  spec: str | None = None) -> RewardParameters:
    """Read ``fn``'s signature (module docstring). A function that can take neither three positional arguments nor
    ``completions`` by name is a ConfigError naming ``field_name``."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # no signature to read (a builtin): today's positional call, no columns
        return RewardParameters(bool(getattr(fn, "batched", True) is False), False, ("", "", ""), (True,) * 3,
                                frozenset(), frozenset(), frozenset())
    names = [p.name for p in params]
    per_sample = _per_sample(fn, names)
    arguments = ("prompt", "completion", "answer") if per_sample else ("prompts", "completions", "answers")
    positional = [p for p in params if p.kind in _POSITIONAL]
    star_args = any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params)
    star_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
    completions_at = names.index(arguments[1]) if arguments[1] in names else None
    by_name = not ((len(positional) >= 3 or star_args) and completions_at in (None, 1))
    if by_name and completions_at is None:
        what = f"{field_name} = {spec!r}" if spec else field_name
        raise ConfigError(
            f"{what} takes ({', '.join(names)}): a reward function takes (prompts, completions, answers) by position, "
            f"or a parameter named {arguments[1]} and the others by name. Fix: give it those parameters.")
    if by_name:
        reserved = frozenset(arguments)
        takes = tuple(star_kwargs or a in names for a in arguments)
    else:
        reserved = frozenset(names[:3])
        takes = (True, True, True)
    named = [p for p in params if p.kind in _BY_NAME and p.name not in reserved]
    if not by_name:
        named = [p for p in named if p not in positional[:3]]
    return RewardParameters(
        per_sample=per_sample, by_name=by_name, arguments=arguments, takes=takes,  # type: ignore[arg-type]
        columns=None if star_kwargs else frozenset(p.name for p in named),
        required=frozenset(p.name for p in named if p.default is inspect.Parameter.empty),
        reserved=reserved)


def check_columns(params: RewardParameters, available: Collection[str], what: str, source: str) -> None:
    """A ConfigError when the function names, without a default, a column that ``source`` lacks."""
    missing = sorted(params.required - set(available))
    if missing:
        listed = ", ".join(repr(m) for m in missing)
        raise ConfigError(
            f"{what} takes the parameter{'s' if len(missing) > 1 else ''} {listed}, naming no column of {source} "
            f"(columns: {', '.join(available) or 'none'}). Fix: name a parameter after a column, give it a default, "
            "or take the columns as **kwargs.")
