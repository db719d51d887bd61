"""What a checkpoint records about the policy's LoRA adapters (``dsrl.model.lora``), and the resume check on it.

A LoRA run's weights are the frozen base plus adapters, under PEFT's parameter names; a full run's are the plain
model's. Neither loads into the other, and adapters of another rank, scaling or set of target modules are
another model. So a resume must use the adapters the checkpoint was trained with.

Invariants:

- every checkpoint's ``MANIFEST.json`` holds ``"model": {"lora": <the dsrl.model.lora section> | null}``
  (:func:`record`), written at commit with the rest of the manifest;
- :func:`saved_lora` reads it back; for a checkpoint written before the record existed it falls back to the
  checkpoint's ``hf/`` folder, which holds PEFT's ``adapter_config.json`` exactly when adapters were on (their
  settings are then unknown and only on/off is checked);
- :func:`check_resume` refuses, before any model is built, a resume whose ``dsrl.model.lora`` differs from the
  checkpoint's: adapters on versus off, or another ``r``, ``alpha``, ``target_modules`` or ``modules_to_save``
  (``dropout`` acts only while training and may change). The sentence names ``dsrl.model.lora``, the saved and
  the given value, and the two ways forward: resume with the saved setting, or export the checkpoint and start a
  new run from the exported model.
"""

from __future__ import annotations

import json
import os
from typing import Any

from dsrl.checkpoint import manifest
from dsrl.config import ConfigError

HF_META = "hf"  # the checkpoint's Hugging Face metadata folder (dsrl.checkpoint.export.write_hf_meta)
ADAPTER_CONFIG = "adapter_config.json"  # PEFT's, in hf/ of a LoRA run's checkpoints
ON = "on"  # adapters were on, their settings not recorded (a checkpoint from before the record)
NOT_KNOWN = "not known"  # neither a record nor an hf/ folder tells
SHAPING = ("r", "alpha", "target_modules", "modules_to_save")  # what makes the adapters another model


def record(lora: Any) -> dict[str, Any]:
    """The manifest's ``"model"`` entry for a run's ``dsrl.model.lora`` (a LoraConfig or None)."""
    return {"lora": None if lora is None else lora.model_dump()}


def saved_lora(root: str) -> dict[str, Any] | str | None:
    """The adapters checkpoint ``root`` was trained with: the ``dsrl.model.lora`` section as recorded, or None for
    a full run; without a record, :data:`ON` when its ``hf/`` holds PEFT's adapter config, None when ``hf/``
    holds none, :data:`NOT_KNOWN` without ``hf/``."""
    doc = manifest.read(root)
    if doc is not None and isinstance(doc.get("model"), dict) and "lora" in doc["model"]:
        return doc["model"]["lora"]
    if os.path.isfile(os.path.join(root, HF_META, ADAPTER_CONFIG)):
        return ON
    return None if os.path.isdir(os.path.join(root, HF_META)) else NOT_KNOWN


def _shown(lora: dict[str, Any]) -> str:
    return "{" + ", ".join(f"{k}: {json.dumps(lora[k])}" for k in SHAPING if k in lora) + "}"


def check_resume(where: str, saved: dict[str, Any] | str | None, lora: Any) -> None:
    """Raise ConfigError when this run's ``dsrl.model.lora`` (``lora``, a LoraConfig or None) cannot continue
    checkpoint ``where``, which was trained with ``saved`` (from :func:`saved_lora`)."""
    if saved == NOT_KNOWN:
        return
    fresh = (f"or, to change it, export the checkpoint (dsrl export {where} --out DIR; merged weights) and start a "
             "new run from it with dsrl.model.path = DIR in a new dsrl.run.output_dir")
    if saved is None:
        if lora is None:
            return
        raise ConfigError(
            f"dsrl.model.lora is set, but checkpoint {where} was trained without it (every parameter trained): its "
            "weights have no adapters to load, so this run cannot continue it. Fix: remove dsrl.model.lora to "
            f"continue the run, {fresh}.")
    if lora is None:
        what = "" if saved == ON else f" = {_shown(saved)}"
        raise ConfigError(
            f"dsrl.model.lora is not set, but checkpoint {where} was trained with LoRA adapters (dsrl.model.lora"
            f"{what}): its weights are the frozen base model plus adapters and do not load into a fully trained "
            f"model. Fix: set dsrl.model.lora as it was saved to continue the run, {fresh}.")
    if saved == ON:
        return
    now = lora.model_dump()
    changed = [k for k in SHAPING if saved.get(k) != now.get(k)]
    if changed:
        diffs = "; ".join(f"dsrl.model.lora.{k} = {json.dumps(now.get(k))} where it was {json.dumps(saved.get(k))}"
                          for k in changed)
        raise ConfigError(
            f"{diffs}: checkpoint {where} was trained with dsrl.model.lora = {_shown(saved)}, and adapters of "
            f"another shape or scale are another model. Fix: resume with dsrl.model.lora as it was saved, {fresh}.")
