"""A continuous-batching manager kept across generate calls (:class:`dsrl.rollout.cb.ContinuousBatchingBackend`).

transformers lets a manager stop with its batch processor kept (``stop(keep_for_next_session=True)``): the paged
cache, the static batch buffers and the CUDA graphs captured for each padded shape, which the next call replays
instead of capturing again. Invariants of the reuse:
- a kept manager serves a call only when the call's cache geometry and attention are the ones it was built for
  (:class:`Session` key) and, when it uses CUDA graphs, every parameter and buffer of the model still lives where
  the graphs read it: optimizer updates in place are seen by the next replay, storage that moved (a ZeRO-3 gather
  allocates the full parameters anew) means a new manager and a new capture;
- a capture that fails is an error naming its cause (:func:`warmup_or_raise`, :func:`capture_hint`): transformers
  logs a failed warm-up capture and goes on, after which every request of the manager fails.
"""

from __future__ import annotations

import logging
from typing import Any

import torch


class Session:
    """A manager kept between calls: its geometry/attention key, and (with CUDA graphs) where every parameter's
    storage was when its graphs were captured, since a graph reads the weights at those addresses: in-place
    optimizer updates are seen, storage that moved (a ZeRO-3 gather allocates anew) means capturing again."""

    def __init__(self, key: tuple, attention: str | None, manager: Any, model_attn: str | None):
        self.key, self.attention, self.manager, self.model_attn = key, attention, manager, model_attn
        self.pointers: list[int] | None = None

    def uses_graphs(self) -> bool:
        return any(self.manager.continuous_batching_config.cuda_graph_booleans)

    def remember_weights(self, module: torch.nn.Module) -> None:
        self.pointers = _storage_pointers(module) if self.uses_graphs() else None

    def weights_moved(self, module: torch.nn.Module) -> bool:
        return self.pointers is not None and self.pointers != _storage_pointers(module)


def _storage_pointers(module: torch.nn.Module) -> list[int]:
    return [p.data_ptr() for p in module.parameters()] + [b.data_ptr() for b in module.buffers()]


CAPTURE_FAILED = "Failed to warm up"  # what transformers' model runner logs when a warm-up capture raised


def warmup_or_raise(manager: Any) -> None:
    """``manager.warmup()`` (builds the paged cache and captures the CUDA graphs), raising where transformers only
    logs that a capture failed and goes on: its graph memory pool then stays marked as recording and every later
    request of the manager fails, so a failed capture is an error naming its cause, never a silent slow path."""
    failures: list[str] = []

    class _Failures(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if CAPTURE_FAILED in record.getMessage():
                failures.append(record.getMessage().split("\n")[0])

    logger = logging.getLogger("transformers.generation.continuous_batching.model_runner")
    handler = _Failures(logging.WARNING)
    logger.addHandler(handler)
    try:
        manager.warmup()
    finally:
        logger.removeHandler(handler)
    if failures:
        raise RuntimeError(f"continuous batching could not capture its CUDA graphs while warming up ({failures[0]})"
                           f"{capture_hint(failures[0])}")


def capture_hint(error: Any) -> str:
    """The likely cause, when a continuous-batching failure comes from a CUDA-graph capture."""
    text = str(error or "")
    if not any(s in text for s in ("capture", "mempool", "MemPool", "graph", CAPTURE_FAILED)):
        return ""
    return ("; a CUDA-graph capture failed: a device synchronization or a host copy inside the captured forward "
            "invalidates it (e.g. DeepSpeed's throughput timer, which dsrl turns off, or a forward hook that reads a "
            "device value). Fix: remove what synchronizes inside the model's forward, or set rollout.backend = 'hf'")
