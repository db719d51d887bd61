"""The child process that runs math-verify for :class:`dsrl.tasks.verifiable.MathVerifier` (run as a script).

It imports math-verify and nothing of dsrl's, answers ``{"ready": true}`` (or ``{"error": ...}`` when math-verify is
missing), then reads one JSON request per line, ``{"pairs": [[gold, answer], ...], "soft_s": seconds}``, and writes
one line per pair, in order: ``{"ok": bool, "late": bool}``. Each pair's parse-and-compare runs under an interval
timer of ``soft_s`` seconds in this process's main thread (math-verify's own timeouts are off: their
``signal.alarm`` takes whole seconds); a pair past it is answered ``ok = false, late = true`` and the process goes on.
What the timer cannot interrupt (C code that never returns to the interpreter) the parent ends by killing this
process. It exits when its input closes, i.e. when the parent is gone.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import sys

if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)  # run as a script: this folder's modules must not shadow the standard library's

_PLAIN = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?")  # read as a plain expression, not LaTeX
_CACHE_LIMIT = 4096


class _Late(BaseException):
    """Raised by the soft timer (a BaseException: math-verify's ``except Exception`` does not swallow it)."""


def _on_alarm(signum: int, frame: object) -> None:
    raise _Late


def _write(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def main() -> int:
    logging.disable(logging.WARNING)  # math-verify logs each timeout and "timeout disabled"; the parent reports
    try:
        from math_verify import parse, verify
    except ImportError as e:
        _write({"error": f"{type(e).__name__}: {e}"})
        return 1

    def expressions(text: str) -> list:
        if _PLAIN.fullmatch(text):
            return parse(text, parsing_timeout=None)
        return parse(f"${text}$", parsing_timeout=None) or parse(text, parsing_timeout=None)

    golds: dict[str, list] = {}
    signal.signal(signal.SIGALRM, _on_alarm)
    _write({"ready": True})
    for line in sys.stdin:
        request = json.loads(line)
        soft = float(request["soft_s"])
        for gold, answer in request["pairs"]:
            ok, late = False, False
            try:
                signal.setitimer(signal.ITIMER_REAL, soft, 0.05)  # re-raised every 50 ms if something swallows it
                try:
                    if gold not in golds:
                        if len(golds) >= _CACHE_LIMIT:
                            golds.clear()
                        golds[gold] = expressions(gold)
                    ok = bool(golds[gold]) and bool(verify(golds[gold], expressions(answer), timeout_seconds=None))
                finally:
                    signal.setitimer(signal.ITIMER_REAL, 0)
            except _Late:
                late = True
            except Exception:  # a parse or comparison that fails is a wrong answer, as math-verify itself treats it
                ok = False
            _write({"ok": ok, "late": late})
    return 0


if __name__ == "__main__":
    sys.exit(main())
