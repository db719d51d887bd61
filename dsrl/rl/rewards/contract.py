"""The contract of a reward function, enforced on every call: numbers out, one per completion, in time.

:class:`RewardCaller` wraps the user's function (per-sample or batched, by position or by name, with the dataset's
other columns where it asks for them: :mod:`dsrl.rl.rewards.signature`) as
``(prompts, completions, answers, columns=None) -> list[float]``, ``columns`` mapping each other column of the
samples' rows to its values in sample order (:func:`reward_columns` makes it from the rows), and keeps:

- **numbers**: every value must be a real number (``int``, ``float``, ``bool``, a NumPy scalar or a
  one-element tensor); anything else (a string, None, a list) is a ConfigError naming
  ``data.reward_fn``, the sample index, the completion and the value. NaN is allowed: it masks the
  sample (it contributes no token to any count and no group statistic);
- **one per completion**: another count is a ConfigError naming both counts;
- **in time**: with ``data.reward_timeout_s`` each call gets that long (per sample for a per-sample
  function, per batch for a batched one), enforced with ``SIGALRM`` in the main thread (it interrupts
  Python code and sleeps; C code that never returns to the interpreter is bounded by the collective
  bound of :mod:`dsrl.runtime.watchdog` instead). A call past the limit gives its sample(s) the reward NaN,
  i.e. masks them, and is counted (``reward_timeouts`` in metrics.jsonl) and logged with the sample.

Why mask rather than stop: a timeout is almost always a property of one input (generated code that
loops, a pathological string for a regex), which a policy under RL will produce now and then; ending a
long run for it loses far more than one masked sample, and masking keeps every count exact. A
reward function that is broken for every input is different: the trainer stops the run when a
rollout's worth of samples timed out (:func:`all_timed_out`), since nothing can be learned then.
"""

from __future__ import annotations

import contextlib
import logging
import numbers
import os
import signal
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from dsrl.config import ConfigError
from dsrl.rl.rewards.signature import RewardParameters, parameters_of
from dsrl.runtime.watchdog import note

log = logging.getLogger("dsrl.reward")


class _CallTimeout(BaseException):
    """Raised inside a reward call by the timer (a BaseException: ``except Exception`` does not swallow it)."""


@contextlib.contextmanager
def time_limit(seconds: float | None) -> Iterator[list[bool]]:
    """Interrupt the block with :class:`_CallTimeout` after ``seconds`` (re-raised every second if the
    block swallows it); the yielded list is non-empty once the limit passed. No limit outside the main
    thread or without ``seconds``."""
    fired: list[bool] = []
    if seconds is None or threading.current_thread() is not threading.main_thread():
        yield fired
        return

    def on_alarm(signum: int, frame: Any) -> None:
        fired.append(True)
        raise _CallTimeout

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds, 1.0)
    try:
        yield fired
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def as_reward(value: Any) -> float | None:
    """The float of a reward value, or None when it is not a number."""
    if isinstance(value, numbers.Real):
        return float(value)
    if hasattr(value, "numel") and hasattr(value, "item"):
        with contextlib.suppress(Exception):
            if value.numel() == 1:
                return float(value.item())
    return None


def _short(text: Any, n: int = 60) -> str:
    s = repr(text)
    return s if len(s) <= n else s[:n] + "...'"


def reward_columns(rows: Sequence[Mapping[str, Any]]) -> dict[str, list[Any]]:
    """Each column of the samples' prompt rows (``row["columns"]``, :func:`dsrl.rl.data.prompts.load_prompts`; a
    built-in task's rows give ``prompt`` and ``answer``) as a list in sample order: the ``columns`` argument of
    :meth:`RewardCaller.__call__`. Every row of one dataset has the same columns."""
    if not rows:
        return {}
    first = rows[0].get("columns")
    if first is None:
        return {"prompt": [r["prompt"] for r in rows], "answer": [r.get("answer") for r in rows]}
    return {k: [r["columns"][k] for r in rows] for k in first}


class RewardCaller:
    """``(prompts, completions, answers, columns=None) -> list[float]`` around a user function (module
    docstring)."""

    def __init__(self, fn: Callable[..., Any], params: RewardParameters | None = None,
                 field_name: str = "dsrl.data.reward_fn", spec: str | None = None, timeout_s: float | None = None):
        self.fn = fn
        self.params = params if params is not None else parameters_of(fn, field_name, spec)
        self.per_sample = self.params.per_sample
        self.what = f"{field_name} = {spec!r}" if spec else f"{field_name} ({getattr(fn, '__name__', fn)!r})"
        self.timeout_s = timeout_s
        self.timeouts = 0  # samples masked because their call ran out of time, since the last take_timeouts()
        self.__name__ = getattr(fn, "__name__", "reward_fn")
        self.__doc__ = getattr(fn, "__doc__", None)

    def take_timeouts(self) -> int:
        n, self.timeouts = self.timeouts, 0
        return n

    def _call(self, args: tuple, columns: Mapping[str, Any], where: str) -> tuple[Any, bool]:
        """``(result, timed_out)`` of one call under the time limit (what it calls and for which sample is noted
        first, for the reports of ranks that wait for this one: :mod:`dsrl.runtime.watchdog`)."""
        note(f"calling {self.what} for {where}")
        try:
            with time_limit(self.timeout_s) as fired:
                result = self.params.call(self.fn, *args, columns)
            if not fired:
                return result, False
        except _CallTimeout:
            pass
        self.timeouts += len(args[1]) if not self.per_sample else 1
        rank = os.environ.get("RANK", "0")
        log.warning("%s: the call for %s on rank %s did not return within %g s (dsrl.data.reward_timeout_s); "
                    "its reward is NaN, so the sample(s) are masked and counted in reward_timeouts", self.what, where,
                    rank, self.timeout_s)
        return None, True

    def __call__(self, prompts: list[Any], completions: list[str], answers: list[Any],
                 columns: Mapping[str, Sequence[Any]] | None = None) -> list[float]:
        """One reward per completion; ``columns``: the samples' other columns (:func:`reward_columns`), passed where
        the function names them (:mod:`dsrl.rl.rewards.signature`)."""
        if not len(prompts) == len(completions) == len(answers):
            raise ValueError(f"reward inputs differ in length: {len(prompts)} prompts, {len(completions)} "
                             f"completions, {len(answers)} answers")
        n = len(completions)
        extra = self.params.pick(columns or {})
        if any(len(v) != n for v in extra.values()):
            raise ValueError(f"reward columns differ in length from the {n} completions: "
                             f"{ {k: len(v) for k, v in extra.items()} }")
        if self.per_sample:
            out = []
            for i, args in enumerate(zip(prompts, completions, answers)):
                value, late = self._call(args, {k: v[i] for k, v in extra.items()},
                                         f"sample {i} (completion {_short(args[1])})")
                out.append(float("nan") if late else value)
        else:
            first = f" (first completion {_short(completions[0])})" if n else ""
            result, late = self._call((prompts, completions, answers), {k: list(v) for k, v in extra.items()},
                                      f"a batch of {n} samples{first}")
            if late:
                return [float("nan")] * n
            try:
                out = list(result)
            except TypeError:
                raise ConfigError(
                    f"{self.what} returned {_short(result)} ({type(result).__name__}), not a list of numbers: a "
                    f"batched reward function returns one reward per completion ({n} here). Fix: return a list, or "
                    "name the parameters prompt/completion/answer (or set fn.batched = False) for a per-sample "
                    "function.") from None
            if len(out) != n:
                raise ConfigError(f"{self.what} returned {len(out)} rewards for {n} completions. Fix: return exactly "
                                  "one reward per completion, in order.")
        values = []
        for i, v in enumerate(out):
            r = as_reward(v)
            if r is None:
                raise ConfigError(
                    f"{self.what} returned {_short(v)} ({type(v).__name__}) for sample {i} of {n} (completion "
                    f"{_short(completions[i])}, rank {os.environ.get('RANK', '0')}): a reward must be a number. "
                    "Fix: return a float per completion; float('nan') masks a sample.")
            values.append(r)
        return values


def all_timed_out(timeouts: float, rollout_size: int, what: str = "reward") -> str | None:
    """A sentence when a rollout's worth of samples timed out in one rollout (the run should stop); ``what`` is
    "reward" (``data.reward_fn``) or "environment" (``data.environment``)."""
    if rollout_size > 0 and timeouts >= rollout_size:
        name = "reward function" if what == "reward" else "environment"
        return (f"{int(timeouts)} {what} calls of this rollout (at least all {rollout_size} samples of a rollout) ran "
                f"past dsrl.data.{what}_timeout_s: the {name} is not working, so nothing can be learned. "
                f"Fix it (or raise {what}_timeout_s) and continue with --resume auto.")
    return None
