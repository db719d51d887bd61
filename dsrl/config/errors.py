"""ConfigError, and pydantic ValidationErrors turned into ConfigErrors a person can act on.

Invariant: every message names the field as a dotted path (``dsrl.batch.mini_batch_size``), the
value given and the fix; a pydantic dump or a traceback never reaches the user. Error types met in
dsrl's models are translated one by one (missing, extra_forbidden, literal_error, *_type, the range
errors, value_error from a model's own rules); any other type still gets the path and the value.
"""

from __future__ import annotations

import difflib
import enum
import types
import typing
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo


class ConfigError(ValueError):
    """A configuration problem, reported before any work starts. The message names field and fix.

    ``problems``: each problem's own sentence (one for a single problem); :func:`problems_error` makes one error of
    several, so a run file's every problem is reported at once. ``agreed`` is True when every rank raised the same
    error (``launch/train.py`` then prints it from rank 0 only): set by :func:`dsrl.core.collectives.on_rank0` and
    :func:`dsrl.core.collectives.agree`."""

    agreed: bool = False

    def __init__(self, message: str, problems: list[str] | None = None):
        super().__init__(message)
        self.problems = problems or [message]


def problems_error(messages: list[str]) -> ConfigError:
    """One ConfigError for several problems (each sentence once, in order): the sentence itself for one, else
    "N problems:" and a list."""
    unique = list(dict.fromkeys(messages))
    if len(unique) == 1:
        return ConfigError(unique[0])
    return ConfigError(f"{len(unique)} problems:\n" + "\n".join(f"  - {m}" for m in unique), unique)


_RANGE_OPS = {"gt": ">", "ge": ">=", "lt": "<", "le": "<="}
_TYPE_WORDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string",
               dict: "a JSON object", list: "a JSON list"}
_RANGE_ERRORS = {"greater_than": "gt", "greater_than_equal": "ge", "less_than": "lt", "less_than_equal": "le"}


def _constraints(metadata: list[Any]) -> dict[str, Any]:
    out = {}
    for m in metadata:
        for key in _RANGE_OPS:
            if getattr(m, key, None) is not None:
                out[key] = getattr(m, key)
    return out


def range_text(base: Any, bounds: dict[str, Any]) -> str:
    """'a positive integer', 'a number >= 0 and < 10', ... for a type and its bounds."""
    if base is int and bounds == {"gt": 0}:
        return "a positive integer"
    words = _TYPE_WORDS.get(base, getattr(base, "__name__", str(base)))
    limits = " and ".join(f"{_RANGE_OPS[k]} {v}" for k, v in bounds.items())
    return f"{words} {limits}".strip()


def describe_type(ann: Any, metadata: list[Any] | None = None) -> str:
    """Plain words for a type annotation: 'a positive integer or 'auto'', ''hf' | 'vllm'', 'null'..."""
    origin = typing.get_origin(ann)
    if ann is type(None):
        return "null"
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(ann))
    if origin in (Union, types.UnionType):  # field-level bounds apply to the numeric members
        return " or ".join(describe_type(a, metadata) for a in typing.get_args(ann))
    if origin is Annotated:
        base, *meta = typing.get_args(ann)
        inner = [m for x in meta for m in (x.metadata if isinstance(x, FieldInfo) else [x])]
        return describe_type(base, inner)
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return "a JSON object"
    base = origin if origin in (dict, list) else ann
    return range_text(base, _constraints(metadata or []))


def literal_choices(ann: Any) -> list[Any]:
    """Every Literal value allowed by an annotation (through unions and Annotated)."""
    if typing.get_origin(ann) is Literal:
        return list(typing.get_args(ann))
    if typing.get_origin(ann) in (Union, types.UnionType, Annotated):
        return [c for a in typing.get_args(ann) for c in literal_choices(a)]
    return []


def model_in(ann: Any) -> type[BaseModel] | None:
    """The pydantic model an annotation holds (itself, or a member of an Optional/Union/Annotated)."""
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return ann
    if typing.get_origin(ann) in (Union, types.UnionType, Annotated):
        for arg in typing.get_args(ann):
            found = model_in(arg)
            if found is not None:
                return found
    return None


def _locate(model: type[BaseModel], loc: tuple[Any, ...]) -> tuple[list[str], FieldInfo | None, type | None]:
    """Field names along ``loc`` (union-member tags after a leaf field are dropped), the leaf field
    and the model that owns it. An unknown key (extra_forbidden) ends the path as given."""
    parts: list[str] = []
    info: FieldInfo | None = None
    owner: type | None = None
    cls: type | None = model
    for item in loc:
        if cls is None:
            break
        fields = cls.model_fields
        if isinstance(item, str) and item in fields:
            parts.append(item)
            info, owner = fields[item], cls
            cls = model_in(info.annotation)
        else:
            parts.append(str(item))
            info, owner, cls = None, cls, None
    return parts, info, owner


def _fmt(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _field_doc(info: FieldInfo | None) -> str:
    return f" ({info.description})" if info is not None and info.description else ""


def _message(errors: list[dict[str, Any]], model: type[BaseModel], prefix: str, own: bool) -> tuple[str, str]:
    """(dotted path, message) for the errors pydantic reported at one location. ``own``: the model is
    dsrl's, whose rules (model validators) write complete messages themselves."""
    parts, info, owner = _locate(model, errors[0]["loc"])
    path = ".".join([prefix, *parts]) if prefix else ".".join(parts)
    path = path or "the run file"
    kinds = {e["type"] for e in errors}
    err = errors[0]
    value = err.get("input")
    ann = info.annotation if info is not None else None
    expected = describe_type(ann, info.metadata) if info is not None else ""

    for e in errors:  # a model's own rule (a validator) already wrote the whole message
        if e["type"] in ("value_error", "assertion_error"):
            cause = (e.get("ctx") or {}).get("error")
            text = str(cause) if cause is not None else e["msg"]
            return path, text if own else f"{path} = {_fmt(e.get('input'))}: {text}. Fix: change {path}."
    if "extra_forbidden" in kinds:
        known = list(owner.model_fields) if owner is not None else []
        parent, key = path.rsplit(".", 1) if "." in path else ("", path)
        close = difflib.get_close_matches(key, known, n=1)
        listed = ", ".join(known[:12]) + (f" (and {len(known) - 12} more)" if len(known) > 12 else "")
        hint = f"; did you mean {parent}.{close[0]}?" if close else f"; known keys: {listed}."
        return path, f"{path} is not a known setting{hint} Fix: rename or remove it."
    if "missing" in kinds:
        return path, f"{path} is required{_field_doc(info)}. Fix: set {path}."
    if kinds <= {"model_type", "dict_type", "model_attributes_type"}:
        return path, (f"{path} must be a JSON object, got {type(value).__name__} {_fmt(value)}. "
                      f"Fix: write {path} as {{\"key\": value, ...}}.")
    choices = literal_choices(ann) if ann is not None else []
    range_errors = [e for e in errors if e["type"] in _RANGE_ERRORS]
    if range_errors:  # the value had the right type but is out of range (for a union: on that branch)
        return path, (f"{path} = {_fmt(value)} is out of range{_field_doc(info)}: expected {expected}. "
                      f"Fix: set {path} to {expected}.")
    if kinds == {"literal_error"}:
        close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        return path, (f"{path} = {_fmt(value)} is not one of {', '.join(repr(c) for c in choices)}{hint}. "
                      f"Fix: use one of those{_field_doc(info)}.")
    if "enum" in kinds:
        allowed = (err.get("ctx") or {}).get("expected", "")
        if isinstance(ann, type) and issubclass(ann, enum.Enum):  # each value once (enums may alias)
            allowed = ", ".join(repr(v) for v in dict.fromkeys(m.value for m in ann))
        return path, f"{path} = {_fmt(value)} is not one of {allowed}. Fix: use one of those{_field_doc(info)}."
    if "finite_number" in kinds:
        return path, f"{path} = {_fmt(value)} must be a finite number{_field_doc(info)}. Fix: set a finite value."
    if any(k.endswith("_type") or k.endswith("_parsing") or k in ("int_from_float", "union_tag_invalid")
           for k in kinds):
        return path, (f"{path} = {_fmt(value)} has the wrong type ({type(value).__name__}): expected {expected}"
                      f"{_field_doc(info)}. Fix: set {path} to {expected}.")
    return path, f"{path} = {_fmt(value)} is invalid: {err['msg']}{_field_doc(info)}."


def config_error(error: ValidationError, model: type[BaseModel], prefix: str = "dsrl", *,
                 lead: str = "", own: bool = True) -> ConfigError:
    """One ConfigError for a ValidationError of ``model`` whose fields live under ``prefix``.

    ``lead`` starts every message (e.g. ``"ds_config "``); ``own=False`` for another library's model
    (DeepSpeed's), whose validator messages get the path and the value prepended.
    """
    groups: dict[tuple[str, ...], list[dict[str, Any]]] = {}
    for e in error.errors(include_url=False):
        parts, _, _ = _locate(model, e["loc"])
        groups.setdefault(tuple(parts), []).append(e)
    messages = []
    for errs in groups.values():
        causes = [(e.get("ctx") or {}).get("error") for e in errs if e["type"] == "value_error"]
        several = next((c.problems for c in causes if isinstance(c, ConfigError) and len(c.problems) > 1), None)
        texts = several if own and several else [_message(errs, model, prefix, own)[1]]
        messages += [lead + text for text in texts]
    return problems_error(messages)
