"""Final answers: where a completion (or an answer column) states its answer, and the normal form ``exact`` compares.

:func:`final_answer` reads, in this order:

1. the content of the last complete ``\\boxed{...}`` (or ``\\fbox{...}``), braces nested to any depth
   (``\\{`` and ``\\}`` are literal braces and do not nest); an unclosed one (a completion cut by the token limit)
   is skipped;
2. else the text after the last ``####`` (GSM8K's marker), its first non-empty line; a number at its start is
   taken alone (``#### $1,200 dollars`` -> ``1,200``);
3. else, for a completion (``fallback="number"``), the last number of the text (``1,234``, ``-3.5``, ``3/4``);
   for an answer column (``fallback="text"``), the whole text: a bare ``\\frac{1}{2}`` or ``72`` is the answer.

Every function here runs in time linear in the text (one regular-expression scan without nested quantifiers over
the same characters, and one pass over the braces), so a hostile completion costs no more than its length.
"""

from __future__ import annotations

import re
import unicodedata
from typing import Literal

_BOX_OR_BRACE = re.compile(r"\\(?:boxed|fbox)\s*\{|\\[{}]|[{}]")
_NUMBER = re.compile(r"(?<![\w.])-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?")
_LEADING_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?(?=$|\s|[.,;:!?)%])")
_GSM8K_MARK = "####"


def last_boxed(text: str) -> str | None:
    """The content of the last complete ``\\boxed{...}``/``\\fbox{...}`` in ``text`` (the one that closes last), or
    None."""
    if "\\boxed" not in text and "\\fbox" not in text:
        return None
    stack: list[int | None] = []  # per open brace: where a box's content starts, or None for a plain group
    found: tuple[int, int] | None = None
    for m in _BOX_OR_BRACE.finditer(text):
        token = m.group()
        if token.startswith("\\") and len(token) == 2:  # \{ or \}: a literal brace
            continue
        if token == "}":
            if stack:
                start = stack.pop()
                if start is not None:
                    found = (start, m.start())
            continue
        stack.append(m.end() if token != "{" else None)
    return None if found is None else text[found[0]:found[1]].strip()


def after_marker(text: str) -> str | None:
    """What follows the last ``####``: its first non-empty line, a leading number alone, or None."""
    at = text.rfind(_GSM8K_MARK)
    if at < 0:
        return None
    for line in text[at + len(_GSM8K_MARK):].splitlines():
        line = line.strip()
        if line:
            bare = line.removeprefix("\\$").removeprefix("$").strip()
            m = _LEADING_NUMBER.match(bare)
            return m.group() if m else line.rstrip(".").strip() or None
    return None


def last_number(text: str) -> str | None:
    """The last number in ``text`` (``1,234``, ``-3.5``, ``3/4``), or None."""
    last = None
    for m in _NUMBER.finditer(text):
        last = m
    return None if last is None else last.group()


def final_answer(text: str, fallback: Literal["number", "text"] = "number") -> str | None:
    """The answer ``text`` states (module docstring), or None when it states none."""
    for found in (last_boxed(text), after_marker(text)):
        if found:
            return found
    if fallback == "number":
        return last_number(text)
    return text.strip() or None


def normalize(text: str) -> str:
    """The form ``exact`` compares: Unicode NFKC, case folded, runs of whitespace as one space, no surrounding
    whitespace and no final period."""
    text = " ".join(unicodedata.normalize("NFKC", text).casefold().split())
    return text.removesuffix(".").strip()
