"""The Megatron engine's checkpoint in dsrl's atomic commit (:mod:`dsrl.checkpoint.commit`).

:class:`MegatronFiles` gives :class:`dsrl.backends.megatron.engine.MegatronEngine` the two calls the commit makes of
an engine (DeepSpeed's ``save_checkpoint(base, tag, client_state, save_latest)`` and ``load_checkpoint(dir, tag)``):

- ``<tag>/megatron/``: megatron-core's dist-checkpoint of the model, the optimizer and the engine's step state
  (every rank writes its shards);
- ``<tag>/dsrl_client.pt``: the run's client state (its position, sampler, counters), written by rank 0 atomically.

A companion engine (the critic's, a second :class:`MegatronEngine` in the same layout) writes the same two files
under ``<tag>/<name>/``. The commit then adds the per-rank files, the manifest (with :func:`megatron_layout`) and
the ``COMPLETE`` marker as for DeepSpeed. A resume needs the layout the checkpoint was written with (tensor, pipeline
and data-parallel sizes): resharding on load is not built yet, and a changed layout is refused with the sizes.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from dsrl.checkpoint.atomic_io import atomic_torch_save
from dsrl.config import ConfigError
from dsrl.core import collectives

ENGINE_DIR, CLIENT_FILE = "megatron", "dsrl_client.pt"


class MegatronFiles:
    """A :class:`MegatronEngine` as the commit saves and loads it (module docstring)."""

    def __init__(self, engine: Any):
        self.engine = engine

    def save_checkpoint(self, save_dir: str, tag: str, client_state: dict[str, Any] | None = None,
                        save_latest: bool = False) -> None:
        path = os.path.join(save_dir, tag)
        self.engine.save_checkpoint(os.path.join(path, ENGINE_DIR))
        if collectives.rank() == 0:
            atomic_torch_save(client_state or {}, os.path.join(path, CLIENT_FILE))

    def load_checkpoint(self, load_dir: str, tag: str) -> tuple[str, dict[str, Any]]:
        path = os.path.join(load_dir, tag)
        self.engine.load_checkpoint(os.path.join(path, ENGINE_DIR))
        return path, torch.load(os.path.join(path, CLIENT_FILE), weights_only=False)


def megatron_layout(engine: Any) -> dict[str, Any]:
    """What the manifest records of a Megatron engine's layout."""
    view = engine.view
    return {"engine": "megatron", "tensor_model_parallel_size": view.tensor_parallel_size,
            "pipeline_model_parallel_size": view.pipeline.size if view.pipeline is not None else 1,
            "data_parallel_size": view.data_parallel_size, "world_size": collectives.world()}


def check_same_layout(saved: dict[str, Any] | None, engine: Any, where: str) -> None:
    """Refuse a checkpoint of another engine, or of this engine on another layout, naming both."""
    now = megatron_layout(engine)
    if saved is None or saved.get("engine") != "megatron":
        raise ConfigError(f"checkpoint {where} was not written by the Megatron engine (dsrl.engine.kind = "
                          "'megatron'). Fix: resume with the engine that wrote it, or start a new "
                          "dsrl.run.output_dir.")
    keys = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "data_parallel_size")
    changed = [f"{k} {saved.get(k)} -> {now[k]}" for k in keys if saved.get(k) != now[k]]
    if changed:
        raise ConfigError(f"checkpoint {where} was written on another Megatron layout ({', '.join(changed)}); "
                          "resuming on another layout is not built yet. Fix: resume with the sizes and the number "
                          "of ranks it was written with.")
