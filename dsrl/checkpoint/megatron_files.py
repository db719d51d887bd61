"""The Megatron engine's checkpoint in dsrl's atomic commit (:mod:`dsrl.checkpoint.commit`).

:class:`MegatronFiles` gives :class:`dsrl.backends.megatron.engine.MegatronEngine` the two calls the commit makes of
an engine (DeepSpeed's ``save_checkpoint(base, tag, client_state, save_latest)`` and ``load_checkpoint(dir, tag)``):

- ``<tag>/megatron/``: megatron-core's dist-checkpoint of the model, the optimizer and the engine's step state
  (every rank writes its shards);
- ``<tag>/dsrl_client.pt``: the run's client state (its position, sampler, counters), written by rank 0 atomically.

A companion engine (the critic's, a second :class:`MegatronEngine` in the same layout) writes the same two files
under ``<tag>/<name>/``. The commit then adds the per-rank files, the manifest (with the engine's layout,
:func:`dsrl.backends.megatron.checkpoint.megatron_layout`) and the ``COMPLETE`` marker as for DeepSpeed. A resume may
change the layout (tensor, pipeline and data-parallel sizes, the number of ranks): dist-checkpointing reshards on
load (:func:`dsrl.backends.megatron.checkpoint.check_layout`).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from dsrl.checkpoint.atomic_io import atomic_torch_save
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
