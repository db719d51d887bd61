"""A dataset's rows as prompt records, every row checked before any work.

A record is ``{"prompt": text or messages, "answer": the answer column's value, "columns": the whole row}``:

- the prompt is ``data.prompt_template`` with each ``{column}`` replaced by the row's value (braces that name no
  column stay as written, and are named in one warning), else the ``data.prompt_key`` column: text, or a
  conversation, a non-empty list of ``{"role": str, "content": str}`` messages (rendered later through the
  tokenizer's chat template, :mod:`dsrl.rl.data.prompts`);
- ``answer`` is the ``data.answer_key`` column, passed to the reward function as ``answers``; with a built-in
  verifiable reward (``math``, ``exact``) it must be text or a number;
- ``columns`` keeps every column of the row, which the reward function receives where it names them
  (:mod:`dsrl.rl.rewards.signature`).

Bad input -- a missing column, a prompt that is not text or a well-formed message list, an empty prompt, an answer
of the wrong type -- is reported for the whole dataset at once: one sentence per kind of problem naming the field,
the rows (the first few and how many) and the fix, in one :class:`dsrl.config.ConfigError`.
"""

from __future__ import annotations

import collections
import logging
import numbers
from collections.abc import Sequence
from typing import Any

from dsrl.config import ConfigError, DataConfig
from dsrl.config.data import PLACEHOLDER
from dsrl.config.errors import problems_error
from dsrl.config.names import BUILTIN_REWARDS
from dsrl.rl.data.sources import DatasetSource

log = logging.getLogger("dsrl.data")
SHOWN_ROWS = 5  # rows named in a problem's sentence; the rest are counted
_SINGULAR = {"are": "is", "hold": "holds", "make": "makes"}


def _rows_text(rows: list[int]) -> str:
    shown = ", ".join(str(r) for r in rows[:SHOWN_ROWS])
    more = len(rows) - SHOWN_ROWS
    if len(rows) == 1:
        return f"row {shown}"
    return f"rows {shown}" + (f" and {more:,} more" if more > 0 else "")


def _short(value: Any, n: int = 60) -> str:
    s = repr(value)
    return s if len(s) <= n else s[:n] + "..."


def message_problem(value: Any) -> str | None:
    """Why ``value`` is not a conversation (a non-empty list of {"role": str, "content": str}), or None."""
    if not isinstance(value, list) or not value:
        return "an empty message list" if isinstance(value, list) else None
    for j, m in enumerate(value):
        if not isinstance(m, dict) or not {"role", "content"} <= set(m):
            keys = sorted(m) if isinstance(m, dict) else type(m).__name__
            return f"message {j} is {_short(m)} ({keys}), not {{'role': ..., 'content': ...}}"
        if not isinstance(m["role"], str) or not m["role"].strip():
            return f"message {j} has the role {_short(m['role'])}, not a name such as 'user'"
        if not isinstance(m["content"], str):
            return f"message {j} has the content {_short(m['content'])} ({type(m['content']).__name__}), not text"
    if not any(m["content"].strip() for m in value):
        return "every message is empty"
    return None


class _Problems:
    """Rows per kind of problem, turned into one sentence each: the field, the rows, what is wrong, the fix."""

    def __init__(self, source: DatasetSource):
        self.source = source
        self.rows: dict[tuple[str, str, str], list[int]] = collections.defaultdict(list)
        self.first: dict[tuple[str, str, str], Any] = {}

    def add(self, field: str, what: str, fix: str, row: int, example: Any = None) -> None:
        self.rows[(field, what, fix)].append(row)
        self.first.setdefault((field, what, fix), example)

    def sentences(self) -> list[str]:
        out = []
        for (field, what, fix), rows in self.rows.items():
            example = self.first[(field, what, fix)]
            shown = f" (row {rows[0]}: {example})" if example is not None else ""
            if len(rows) == 1:  # "rows ... are empty" / "row 3 ... is empty"
                verb, rest = what.split(" ", 1)
                what = f"{_SINGULAR.get(verb, verb)} {rest}"
            out.append(f"{field}: {_rows_text(rows)} of {self.source.describe()} {what}{shown}. Fix: {fix}")
        return out


def make_records(rows: Any, data_cfg: DataConfig, source: DatasetSource) -> list[dict[str, Any]]:
    """The records of ``rows`` (a ``datasets.Dataset``) in their order, or one ConfigError with every problem."""
    f = DataConfig.PATH  # the prompt settings are dsrl.data's, whichever section named the dataset
    columns = list(rows.column_names)
    template = data_cfg.prompt_template
    named = list(dict.fromkeys(PLACEHOLDER.findall(template))) if template else []
    used = [c for c in named if c in columns]
    problems: list[str] = []
    if template and not used:
        problems.append(f"{f}.prompt_template = {template!r} names no column of {source.describe()} (columns: "
                        f"{', '.join(columns)}). Fix: put a column's name in braces, e.g. {{{columns[0]}}}.")
    elif not template and data_cfg.prompt_key not in columns:
        problems.append(f"{f}.prompt_key = {data_cfg.prompt_key!r}: no such column in {source.describe()} (columns: "
                        f"{', '.join(columns)}). Fix: set {f}.prompt_key to one of them.")
    if data_cfg.answer_key not in columns:
        problems.append(f"{f}.answer_key = {data_cfg.answer_key!r}: no such column in {source.describe()} (columns: "
                        f"{', '.join(columns)}). Fix: set {f}.answer_key to one of them (the reward function "
                        "receives it as answers; a run scored by a reward model alone needs one too).")
    if problems:
        raise problems_error(problems)
    unknown = ["{" + c + "}" for c in named if c not in used]
    if template and unknown:
        log.warning("%s.prompt_template: %s name%s no column of %s and stay%s as written", f, ", ".join(unknown),
                    "s" if len(unknown) == 1 else "", source.describe(), "s" if len(unknown) == 1 else "")
    table = _decoded(rows, source)
    return _check_rows(table, data_cfg, source, used)


def _decoded(rows: Any, source: DatasetSource) -> list[dict[str, Any]]:
    try:  # datasets decodes text lazily: invalid UTF-8 surfaces here
        return rows.to_list()
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"{source.field}.path = {source.path!r} is not valid UTF-8 ({e.reason}: byte "
            f"{e.object[e.start:e.start + 1]!r} in {bytes(e.object[max(e.start - 20, 0):e.start + 10])!r}). "
            "Fix: re-encode the file as UTF-8, e.g. iconv -f latin1 -t utf-8.") from None


def _render(template: str, row: dict[str, Any], used: Sequence[str]) -> str:
    text = template
    for c in used:
        value = row[c]
        text = text.replace("{" + c + "}", value if isinstance(value, str) else str(value))
    return text


_MESSAGES = ('write each prompt as a list of {"role": ..., "content": ...} messages with text content, or point '
             "prompt_key at a text column.")


def _check_rows(table: list[dict[str, Any]], data_cfg: DataConfig, source: DatasetSource,
                used: Sequence[str]) -> list[dict[str, Any]]:
    f, key, akey = DataConfig.PATH, data_cfg.prompt_key, data_cfg.answer_key
    builtin = data_cfg.reward_fn in BUILTIN_REWARDS
    found = _Problems(source)
    records: list[dict[str, Any]] = []
    for i, row in enumerate(table):
        if data_cfg.prompt_template:
            where = f"{f}.prompt_template"
            bad = [c for c in used if isinstance(row[c], bool) or not isinstance(row[c], (str, numbers.Real))]
            for c in bad:
                found.add(where, f"hold a {type(row[c]).__name__} in the column {c!r}",
                          "put text or numbers in that column, or leave it out of the template.", i, _short(row[c]))
            prompt: Any = _render(data_cfg.prompt_template, row, used) if not bad else ""
            if not bad and not prompt.strip():
                found.add(where, "make an empty prompt", "fill in those rows, or put text around the placeholders.", i)
        else:
            where = f"{f}.prompt_key = {key!r}"
            prompt = row[key]
            if isinstance(prompt, str):
                if not prompt.strip():
                    found.add(where, "are empty", "remove those rows or fill them in.", i)
            elif isinstance(prompt, list):
                why = message_problem(prompt)
                if why:
                    found.add(where, "hold a malformed message list", _MESSAGES, i, why)
            else:
                found.add(where, "hold neither text nor a message list",
                          "point prompt_key at a text column or a column of message lists, or build the prompt with "
                          "prompt_template.", i, f"{type(prompt).__name__} {_short(prompt)}")
        answer = row[akey]
        if builtin:
            where = f"{f}.answer_key = {akey!r}"
            if isinstance(answer, bool) or not isinstance(answer, (str, numbers.Real)):
                found.add(where, "hold an answer that is neither text nor a number",
                          f"the built-in reward {data_cfg.reward_fn!r} compares text or numbers: convert the column, "
                          "or remove those rows.", i, f"{type(answer).__name__} {_short(answer)}")
            elif isinstance(answer, str) and not answer.strip():
                found.add(where, "hold an empty answer", "remove those rows or fill in their answers.", i)
        records.append({"prompt": prompt, "answer": answer, "columns": row})
    problems = found.sentences()
    if problems:
        raise problems_error(problems)
    return records
