"""The built-in verifiable rewards, ``math`` and ``exact`` (``dsrl.data.reward_fn``), batched:
``(prompts, completions, answers) -> list[float]``, 1.0 for a right final answer, else 0.0.

- :func:`math_reward`: the completion's final answer (:func:`dsrl.tasks.answers.final_answer`: the last
  ``\\boxed{}``, else after the last ``####``, else the last number) is compared with the answer column's (the last
  ``\\boxed{}``, else after ``####`` -- a whole GSM8K solution works -- else the whole text) by math-verify's
  equivalence: fractions, decimals, thousands separators, LaTeX, symbolic forms (``\\frac{1}{2}`` = ``0.5`` =
  ``1/2``; ``(x+1)^2`` = ``x^2+2x+1``). Needs the ``[math]`` extra.
- :func:`exact_reward`: the same final answers (the whole text when neither a box nor ``####`` is there) after
  :func:`dsrl.tasks.answers.normalize`, equal as strings. No extra needed.

Bounds. math-verify on hostile input (``\\boxed{9^{9^{9^9}}}``) can run for minutes, and its own timeouts use
``signal.alarm``: whole seconds, main thread only (elsewhere it raises), and a second ``alarm`` cancels the one of
whoever called it (the reward contract's own bound). So math-verify runs in a child process
(:mod:`dsrl.tasks.math_worker`), one per process that scores, started on first use: each answer gets at most
``timeout_s`` seconds (default :data:`SAMPLE_TIMEOUT_S`), first under a soft timer in the child, then, for what no
signal interrupts, by killing the child, which restarts for the rest. A late answer scores 0.0 and is logged. This
holds on any thread; the run's ``data.reward_timeout_s`` bounds each whole call on top (through
:class:`dsrl.rl.rewards.contract.RewardCaller`). Answers longer than :data:`MAX_ANSWER_CHARS` score 0.0 unchecked.
Equal (answer, final answer) pairs are compared once per process (the accuracy call repeats the reward's).
"""

from __future__ import annotations

import atexit
import collections
import importlib.util
import json
import logging
import os
import select
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

from dsrl.tasks.answers import final_answer, normalize

SAMPLE_TIMEOUT_S = 10.0  # per answer; math-verify's own defaults are 5 s to parse plus 5 s per comparison
MAX_ANSWER_CHARS = 4096
STARTUP_TIMEOUT_S = 120.0  # importing sympy and math-verify on a loaded machine
SOFT_FRACTION = 0.8  # the child's own timer fires at this share of the bound, so that it usually need not be killed
MATH_EXTRA = 'the built-in reward "math" needs math-verify. Fix: pip install -e ".[math]" (from the dsrl checkout).'
_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "math_worker.py")
_CACHE_LIMIT = 1 << 16

log = logging.getLogger("dsrl.reward")


def has_math_verify() -> bool:
    """Whether math-verify is installed (without importing it)."""
    return importlib.util.find_spec("math_verify") is not None


def _short(text: str, n: int = 60) -> str:
    s = repr(text)
    return s if len(s) <= n else s[:n] + "...'"


class MathVerifier:
    """math-verify's equivalence of (gold, answer) strings in a child process, each pair bounded (module docstring).
    Thread-safe; one child per instance, started on first use and ended by :meth:`close` (or at exit)."""

    def __init__(self, soft_fraction: float | None = SOFT_FRACTION):
        self.soft_fraction = soft_fraction  # None: no soft timer in the child (only the kill bounds a pair)
        self.late = 0  # answers past their bound, since the start
        self._proc: subprocess.Popen | None = None
        self._buf = b""
        self._lock = threading.Lock()
        self._cache: collections.OrderedDict[tuple[str, str], bool] = collections.OrderedDict()
        atexit.register(self.close)

    def close(self) -> None:
        """End the child (a later call starts a new one)."""
        proc, self._proc, self._buf = self._proc, None, b""
        if proc is not None:
            proc.kill()
            proc.wait()
            for stream in (proc.stdin, proc.stdout):
                stream.close()

    def _start(self) -> subprocess.Popen:
        if not has_math_verify():
            raise ImportError(MATH_EXTRA)
        self._proc = subprocess.Popen([sys.executable, _WORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        try:
            reply = self._read_line(time.monotonic() + STARTUP_TIMEOUT_S)
        except EOFError:
            reply = None
        if reply is None or "ready" not in reply:
            self.close()
            raise ImportError(f"{MATH_EXTRA} (its checker process answered {reply!r})")
        return self._proc

    def _read_line(self, deadline: float) -> dict | None:
        """The child's next reply, or None past ``deadline``; raises EOFError when the child is gone."""
        fd = self._proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                raise EOFError("the math-verify process ended")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def equivalent(self, pairs: Sequence[tuple[str, str]], timeout_s: float = SAMPLE_TIMEOUT_S) -> list[bool]:
        """Whether each ``(gold, answer)`` is equivalent under math-verify; a pair past ``timeout_s`` is False."""
        out: list[bool | None] = [self._cache.get(p) for p in pairs]
        todo = list(dict.fromkeys(p for p, o in zip(pairs, out) if o is None))
        if todo:
            with self._lock:
                try:
                    found = self._check(todo, timeout_s)
                except BaseException:  # an outer bound or a stop interrupted a request: the child is mid-way
                    self.close()
                    raise
                for p, ok in found.items():
                    self._cache[p] = ok
                    if len(self._cache) > _CACHE_LIMIT:
                        self._cache.popitem(last=False)
            out = [found[p] if o is None else o for p, o in zip(pairs, out)]
        return [bool(o) for o in out]

    def _check(self, todo: list[tuple[str, str]], timeout_s: float) -> dict[tuple[str, str], bool]:
        found: dict[tuple[str, str], bool] = {}
        soft = timeout_s * self.soft_fraction if self.soft_fraction else 1e9
        while len(found) < len(todo):
            rest = todo[len(found):]
            proc = self._proc or self._start()
            proc.stdin.write((json.dumps({"pairs": rest, "soft_s": soft}) + "\n").encode())
            proc.stdin.flush()
            for pair in rest:
                try:
                    reply = self._read_line(time.monotonic() + timeout_s)
                except EOFError:
                    reply = None
                if reply is None:  # past the bound where no signal reaches (or the child died): end it, go on
                    self.close()
                    self._late(pair, timeout_s, "the math-verify process was ended")
                    found[pair] = False
                    break
                if reply["late"]:
                    self._late(pair, timeout_s, "stopped by its timer")
                found[pair] = bool(reply["ok"])
        return found

    def _late(self, pair: tuple[str, str], timeout_s: float, how: str) -> None:
        self.late += 1
        log.warning("math reward: comparing the answer %s with %s took longer than %g s (%s); it scores 0.0",
                    _short(pair[1]), _short(pair[0]), timeout_s, how)


_VERIFIER = MathVerifier()


def _gold(answer: Any) -> str | None:
    if isinstance(answer, bool) or answer is None:
        return None
    if isinstance(answer, (int, float)):
        return repr(answer) if isinstance(answer, float) else str(answer)
    return final_answer(answer, fallback="text") if isinstance(answer, str) else None


def math_reward(prompts: Sequence[Any], completions: Sequence[str], answers: Sequence[Any], *,
                timeout_s: float = SAMPLE_TIMEOUT_S) -> list[float]:
    """1.0 where the completion's final answer equals the answer column's under math-verify, else 0.0 (module
    docstring); each comparison takes at most ``timeout_s`` seconds, on any thread."""
    if len(completions) != len(answers):
        raise ValueError(f"math_reward: {len(completions)} completions but {len(answers)} answers")
    pairs: list[tuple[str, str] | None] = []
    for completion, answer in zip(completions, answers):
        gold, found = _gold(answer), final_answer(completion or "", fallback="number")
        usable = gold and found and len(gold) <= MAX_ANSWER_CHARS and len(found) <= MAX_ANSWER_CHARS
        pairs.append((gold, found) if usable else None)
    checked = [p for p in pairs if p is not None]
    if not checked:
        return [0.0] * len(pairs)
    verdicts = iter(_VERIFIER.equivalent(checked, timeout_s))
    return [float(next(verdicts)) if p is not None else 0.0 for p in pairs]


def exact_reward(prompts: Sequence[Any], completions: Sequence[str], answers: Sequence[Any]) -> list[float]:
    """1.0 where the normalized final answers are equal strings, else 0.0 (module docstring)."""
    if len(completions) != len(answers):
        raise ValueError(f"exact_reward: {len(completions)} completions but {len(answers)} answers")
    out = []
    for completion, answer in zip(completions, answers):
        gold, found = _gold(answer), final_answer(completion or "", fallback="text")
        out.append(float(bool(gold) and bool(found) and normalize(gold) == normalize(found)))
    return out


math_reward.batched = True  # type: ignore[attr-defined]
exact_reward.batched = True  # type: ignore[attr-defined]
