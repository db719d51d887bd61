"""The contract between a trained policy and the forwards that are not training steps.

Generation (every rollout backend that runs on the trained weights) and the no-grad passes (old and reference
log-probs, values, scores) run the policy's module many times between optimizer steps. A training wrapper
(DeepSpeed's engine: :class:`dsrl.backends.deepspeed.engine.RLEngine`) says how through :class:`PolicyForwards`,
so that a rollout backend needs no knowledge of the wrapper (ARCHITECTURE §4: every forward that generation or
a no-grad pass makes on the policy runs outside the wrapper's hooks, and no pass synchronizes the device more than
once at its end). A plain ``torch.nn.Module`` needs no scope: it has no wrapper.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol, runtime_checkable

import torch

from dsrl.core.parallel import ParallelView


@runtime_checkable
class PolicyForwards(Protocol):
    """A wrapped policy as generation and no-grad passes see it."""

    @property
    def module(self) -> torch.nn.Module:
        """The wrapped module (the model whose forwards the scopes below cover)."""

    @property
    def device(self) -> torch.device:
        """Where the module's inputs go."""

    @property
    def view(self) -> ParallelView:
        """The parallel layout (tensor peers generate together)."""

    def generation_scope(self) -> AbstractContextManager[None]:
        """For the block: the full parameters on this rank, no collective inside it and none of the wrapper's hooks
        on any forward. Entering and leaving may be collective (a sharded wrapper gathers and releases), so every
        data-parallel rank enters it the same number of times."""

    def no_grad_scope(self) -> AbstractContextManager[None]:
        """For the block: forwards run without the wrapper's per-forward hooks (no timers, no device
        synchronization); a sharded wrapper still gathers its parameters per forward, so every rank of its group
        runs the same number of forwards."""


@runtime_checkable
class NoGradPasses(Protocol):
    """A model as a no-grad pass runs it (the policy's engine, a frozen KL reference, the policy with its LoRA
    adapters disabled): ``forward_no_grad(micro_batches, fn)`` returns ``[fn(model, micro) for micro in
    micro_batches]`` without gradients, every rank of a sharded model running the same number of forwards."""

    def forward_no_grad(self, micro_batches: Sequence[Any], fn: Callable[[Any, Any], Any]) -> list[Any]:
        """The pass's outputs, one per micro-batch, in order."""
