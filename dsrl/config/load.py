"""One JSON file is the whole run: a DeepSpeed ds_config plus a top-level ``"dsrl"`` section.

This module reads that file, applies dotted command-line overrides and validates the ``"dsrl"``
section into the typed models (:class:`dsrl.config.root.DsrlConfig` and its sections). The ds_config
DeepSpeed sees is derived in :mod:`dsrl.backends.deepspeed.config` and validated by DeepSpeed's own
classes in :mod:`dsrl.backends.deepspeed.validation`.

Invariants kept here:
- every error is a :class:`ConfigError` raised *before* any work starts; its message names the
  field (as a dotted path), the offending value(s) and the fix;
- unknown keys are errors with a close-match suggestion; types are strict (see :mod:`dsrl.config.section`).
"""

from __future__ import annotations

import copy
import json
import os
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from dsrl.config import support
from dsrl.config.errors import ConfigError, config_error
from dsrl.config.root import DsrlConfig

DS_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")

__all__ = ["DS_BATCH_KEYS", "Config", "apply_overrides", "load_config", "parse_override_args", "parse_override_value"]


class Config(BaseModel):
    """A parsed run file: the user's ds_config (without "dsrl") and the validated "dsrl" section."""

    model_config = ConfigDict(extra="forbid", strict=True)

    ds_config: dict[str, Any]
    dsrl: DsrlConfig
    source: str = "<dict>"

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as e:
            raise config_error(e, type(self), "") from None

    @model_validator(mode="after")
    def _one_schedule_source(self) -> Config:
        """The LR schedule comes from the ds_config "scheduler" section or from dsrl.scheduler.name, not both."""
        if self.ds_config.get("scheduler") and self.dsrl.scheduler.name:
            raise ConfigError(
                "scheduler: both the ds_config \"scheduler\" section and dsrl.scheduler.name "
                f"({self.dsrl.scheduler.name!r}) are set. Fix: keep one."
            )
        return self

    @model_validator(mode="after")
    def _supported_combination(self) -> Config:
        """The combination of settings is one dsrl supports (placement, staleness, backend, LoRA, multi-turn, the
        critic, AutoTP, AutoEP, Ulysses, dynamic sampling): a run file that breaks rules of docs/support.md gets the
        sentence of every one, each with its fix, at once."""
        support.check(self.dsrl, self.ds_config)
        return self

    def to_dict(self) -> dict[str, Any]:
        """The full run file, as it would be written back (with overrides applied)."""
        out = copy.deepcopy(self.ds_config)
        out["dsrl"] = self.dsrl.model_dump()
        return out


# --------------------------------------------------------------------------------------------
# Reading files and overrides
# --------------------------------------------------------------------------------------------


def parse_override_value(text: str) -> Any:
    """Parse a command-line value as JSON when possible ('4', 'null', 'true', '[1,2]'), else a string."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def apply_overrides(raw: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """Set dotted keys (``dsrl.batch.samples_per_prompt``) in a copy of ``raw``."""
    out = copy.deepcopy(raw)
    for dotted, value in overrides.items():
        parts = dotted.split(".")
        if parts[0] != "dsrl" or len(parts) < 2:
            raise ConfigError(
                f"override --{dotted}: only keys of the dsrl section can be overridden "
                "(e.g. --dsrl.batch.samples_per_prompt 8); edit the JSON file for DeepSpeed keys."
            )
        node = out
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override --{dotted}: {p} is not a section")
        node[parts[-1]] = value
    return out


def parse_override_args(args: list[str]) -> dict[str, Any]:
    """``['--dsrl.a.b', '4', '--dsrl.c=x']`` -> ``{'dsrl.a.b': 4, 'dsrl.c': 'x'}``."""
    out: dict[str, Any] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--dsrl."):
            raise ConfigError(f"unknown argument {arg!r}; overrides look like --dsrl.batch.mini_batch_size 64")
        key = arg[2:]
        if "=" in key:
            key, text = key.split("=", 1)
            i += 1
        else:
            if i + 1 >= len(args):
                raise ConfigError(f"override {arg} has no value")
            text = args[i + 1]
            i += 2
        out[key] = parse_override_value(text)
    return out


def load_config(
    source: str | os.PathLike | dict[str, Any] | Config, overrides: dict[str, Any] | None = None
) -> Config:
    """Read a run file (path or dict), apply dotted overrides, validate the "dsrl" section."""
    if isinstance(source, Config):
        if not overrides:
            return source
        source = source.to_dict()
    if isinstance(source, dict):
        raw, name = source, "<dict>"
    else:
        name = os.fspath(source)
        if not os.path.isfile(name):
            raise ConfigError(f"--ds_config {name}: no such file")
        with open(name, encoding="utf-8") as f:
            try:
                raw = json.load(f)
            except json.JSONDecodeError as e:
                raise ConfigError(f"--ds_config {name} is not valid JSON: {e}") from e
    if not isinstance(raw, dict):
        raise ConfigError(f"{name}: the run file must be a JSON object")
    if overrides:
        raw = apply_overrides(raw, overrides)
    ds_config = {k: copy.deepcopy(v) for k, v in raw.items() if k != "dsrl"}
    section = raw.get("dsrl")
    if section is None:
        section = {}
    if not isinstance(section, dict):
        raise ConfigError(
            f"dsrl must be a JSON object, got {type(section).__name__} {section!r}. "
            "Fix: write the section as \"dsrl\": {\"batch\": {...}, \"run\": {...}}."
        )
    return Config(ds_config=ds_config, dsrl=DsrlConfig(**section), source=name)
