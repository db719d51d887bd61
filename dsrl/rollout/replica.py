"""Generation on a replica of a policy that trains elsewhere: :class:`ReplicaSync`.

The Megatron engine's model is split over tensor and pipeline ranks and does not generate. Each rank keeps the
policy's Hugging Face model as a full replica, and a local backend (``hf``, ``cb``, ``auto``) generates with it, or
vLLM is loaded from it (its own ``sync_weights`` reads the replica after the copy: two copies of the weights).
Invariants:

- before a generation (``sync_weights``, every rank, before each rollout and each evaluation) the replica holds the
  trainer's current weights: every one of its parameters is overwritten, by Hugging Face name, from the trainer's
  weight stream (the Megatron engine's ``hf_weights``: one full tensor at a time, so no rank holds a second whole
  model); a name the replica lacks, or a parameter the stream never reaches, is an error naming it;
- the copy runs only when the trainer has stepped since the last one (its ``optimizer_steps``): an evaluation right
  before a rollout, or a backend with other sampling settings (:meth:`ReplicaSync.with_sampling`), shares the
  copy. The stream is collective (gathers over the tensor group, broadcasts over the pipeline), and the step count
  is the same on every rank, so every rank copies or none does;
- ``weight_sync_s`` and ``weight_sync_bytes`` of the last copy are added to the inner backend's own (vLLM's reload).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from dsrl.config import RolloutConfig
from dsrl.rollout.base import Completion, RolloutBackend

WeightStream = Callable[[], Iterable[tuple[str, torch.Tensor]]]


@dataclass
class _Synced:
    """What the backends of one replica share: the trainer step the replica's weights are from, the last copy's
    cost."""

    at_step: int | None = None
    timing: dict[str, float] = field(default_factory=dict)


class ReplicaSync(RolloutBackend):
    """``inner`` (generating with ``replica``) kept in step with a trainer (module docstring): ``weights()`` streams
    the trainer's weights by HF name, ``trainer_steps()`` counts its applied optimizer steps."""

    def __init__(self, inner: RolloutBackend, replica: torch.nn.Module, weights: WeightStream,
                 trainer_steps: Callable[[], int], _synced: _Synced | None = None):
        self.inner, self.replica, self.weights, self.trainer_steps = inner, replica, weights, trainer_steps
        self.synced = _synced if _synced is not None else _Synced()

    def sync_weights(self) -> None:
        step = int(self.trainer_steps())
        if self.synced.at_step != step:
            t0 = time.perf_counter()
            moved = copy_weights(self.replica, self.weights())
            self.synced.at_step = step
            self.synced.timing = {"weight_sync_s": time.perf_counter() - t0, "weight_sync_bytes": float(moved)}
        self.inner.sync_weights()

    def generate(self, prompt_ids: list[list[int]], samples_per_prompt: int, seed: int) -> list[Completion]:
        return self.inner.generate(prompt_ids, samples_per_prompt, seed)

    def returns_routes(self) -> bool:
        return self.inner.returns_routes()

    def begin(self, rollout_index: int) -> None:
        self.inner.begin(rollout_index)

    def sleep(self) -> None:
        self.inner.sleep()

    def take_timing(self) -> dict[str, float]:
        """The inner backend's timings, with the replica's copy added to its own weight sync (vLLM's reload)."""
        timing, self.synced.timing = self.synced.timing, {}
        inner = self.inner.take_timing()
        return {**inner, **{k: v + inner.get(k, 0.0) for k, v in timing.items()}}

    def close(self) -> None:
        self.inner.close()

    def with_sampling(self, rollout_cfg: RolloutConfig) -> RolloutBackend:
        return ReplicaSync(self.inner.with_sampling(rollout_cfg), self.replica, self.weights, self.trainer_steps,
                           self.synced)


@torch.no_grad()
def copy_weights(replica: torch.nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Copy every ``(name, tensor)`` of ``weights`` into ``replica``'s parameter or buffer of that name (tied
    parameters are one tensor: reached through either name); returns the bytes copied. Raises when a name is not
    the replica's, a shape differs, or a parameter of the replica was never reached (the stream would leave it
    stale). The stream is consumed to its end (it may be collective)."""
    targets = dict(replica.named_parameters(remove_duplicate=False)) | dict(replica.named_buffers())
    reached: set[int] = set()
    moved = 0
    for name, tensor in weights:
        target = targets.get(name)
        if target is None:
            raise KeyError(f"the trainer's weight {name!r} has no counterpart in the rollout model "
                           f"({type(replica).__name__}); the two models differ")
        if target.shape != tensor.shape:
            raise ValueError(f"the trainer's weight {name!r} has shape {tuple(tensor.shape)}, the rollout model's "
                             f"{tuple(target.shape)}")
        target.copy_(tensor)
        reached.add(id(target))
        moved += tensor.numel() * tensor.element_size()
    stale = [n for n, p in replica.named_parameters() if id(p) not in reached]
    if stale:
        raise RuntimeError(f"the trainer's weights never reached {len(stale)} parameters of the rollout model "
                           f"({', '.join(stale[:3])}{', ...' if len(stale) > 3 else ''}): it would generate with "
                           "stale ones")
    return moved
