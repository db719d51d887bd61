"""What is the Megatron engine's own in saving and loading (ARCHITECTURE §4): the layout a checkpoint records
(:func:`megatron_layout`), what a resume on another layout may do (:func:`check_layout`), and the model's tensors
read whole from a dist-checkpoint (:func:`model_tensors`, ``dsrl export``). The engine writes and reads its
dist-checkpoint itself (:meth:`dsrl.backends.megatron.engine.MegatronEngine.save_checkpoint`); dsrl's atomic commit
holds it (:mod:`dsrl.checkpoint.megatron_files`)."""

from __future__ import annotations

import os
from typing import Any

import torch

from dsrl.backends.megatron.deps import require_megatron
from dsrl.config import ConfigError
from dsrl.core import collectives


def megatron_layout(engine: Any) -> dict[str, Any]:
    """What the manifest records of a Megatron engine's layout."""
    view = engine.view
    return {"engine": "megatron", "tensor_model_parallel_size": view.tensor_parallel_size,
            "pipeline_model_parallel_size": view.pipeline.size if view.pipeline is not None else 1,
            "context_parallel_size": view.sequence_parallel_size, "data_parallel_size": view.data_parallel_size,
            "world_size": collectives.world()}


def check_layout(saved: dict[str, Any] | None, engine: Any, where: str) -> str | None:
    """Refuse a checkpoint another engine wrote, naming it. A checkpoint of this engine on another layout (tensor,
    pipeline, context or data-parallel sizes, so also another number of ranks) loads: megatron-core's dist-checkpointing
    stores every tensor with its global shape and reshards the model and the optimizer on load. Returns what to tell
    the user then (None: the same layout)."""
    now = megatron_layout(engine)
    if saved is None or saved.get("engine") != "megatron":
        raise ConfigError(f"checkpoint {where} was not written by the Megatron engine (dsrl.engine.kind = "
                          "'megatron'). Fix: resume with the engine that wrote it, or start a new "
                          "dsrl.run.output_dir.")
    keys = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
            "data_parallel_size")
    changed = [f"{k} {saved.get(k, 1)} -> {now[k]}" for k in keys if saved.get(k, 1) != now[k]]
    if not changed:
        return None
    return (f"checkpoint {where} was written on another Megatron layout ({', '.join(changed)}): megatron-core's "
            "dist-checkpointing resharded the model and the optimizer state to this one (elastic resume); each "
            "rank's random state is restored only where that rank existed before")


def model_tensors(megatron_dir: str) -> dict[str, torch.Tensor]:
    """The model's tensors of a dist-checkpoint (``<tag>/megatron/``), each whole (the shards of every tensor and
    pipeline rank joined by megatron-core's loader; the optimizer's state is not read). Collective over the running
    process group; run alone (``dsrl export``), it loads in a process group of its own, of one rank."""
    require_megatron()
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    def load() -> dict[str, torch.Tensor]:
        import dataclasses
        import warnings

        saved = dist_checkpointing.load_tensors_metadata(megatron_dir)
        # every rank reads every tensor whole: one main replica (rank 0's), the others its replicas
        wanted = {k: dataclasses.replace(v, replica_id=dist.get_rank()) for k, v in saved.items()
                  if not k.startswith("optimizer.")}
        with warnings.catch_warnings():  # megatron-core 0.16.1 calls torch's deprecated DCP load_state_dict
            warnings.filterwarnings("ignore", message=".*load_state_dict.* is deprecated", category=FutureWarning)
            loaded = dist_checkpointing.load(wanted, megatron_dir)
        return {k: v for k, v in loaded.items() if k in wanted}

    if dist.is_initialized():
        return load()
    import tempfile

    with tempfile.TemporaryDirectory(prefix="dsrl-export-") as scratch:
        dist.init_process_group("gloo", store=dist.FileStore(os.path.join(scratch, "store"), 1), rank=0,
                                world_size=1)
        try:
            return load()
        finally:
            dist.destroy_process_group()
