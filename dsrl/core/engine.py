"""The engine seam: what the RL application needs of a training engine (:class:`TrainEngine`).

An engine holds one trained model (the policy, or the critic) with its optimizer and LR schedule, and runs the
exact step of :class:`dsrl.core.step.StepCore` on it. DeepSpeed's :class:`dsrl.backends.deepspeed.engine.RLEngine`
and megatron-core's :class:`dsrl.backends.megatron.engine.MegatronEngine` implement it; the application
(``dsrl.rl``) is written against this protocol, so the composition root alone
chooses the framework (ARCHITECTURE §4, "(engine)").

A training micro-batch's loss comes in two parts, so that an engine whose schedule owns the forward (Megatron's
pipeline schedules call a ``forward_step`` and then a loss function of its output, on the last stage only) runs
the same loss as one that does not:

- ``forward_fn(model, micro) -> output``: the forward, through the engine's wrapped model;
- ``token_loss_fn(output, micro) -> losses[b, t] | (losses, metrics)``: the per-token loss of that output
  (never reduced: the step applies the weights of ARCHITECTURE §2).

Given only ``forward_fn`` (``token_loss_fn=None``), ``forward_fn`` is the whole loss: ``loss_fn(model, micro)`` of
ARCHITECTURE §5's public ``train_mini_batch(micro_batches, loss_fn)``.

Not yet in the protocol: the weights of a sync by name, checkpoint save/load and offload/reload. The Megatron engine
has the first two (:meth:`dsrl.backends.megatron.engine.MegatronEngine.hf_weights`, ``save_checkpoint`` /
``load_checkpoint``); DeepSpeed's are reached through the modules that own them (the rollout backends,
:mod:`dsrl.checkpoint.engines`, :mod:`dsrl.backends.deepspeed.offload`). They join the protocol when the composition
root builds either engine for ``launch/train.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from dsrl.core.forwards import NoGradPasses, PolicyForwards
from dsrl.core.plan import BatchPlan
from dsrl.core.step import MicroBatch, StepResult

#: ``forward_fn(model, micro) -> output`` (the forward through the engine's model)
ForwardFn = Callable[[Any, MicroBatch], Any]
#: ``token_loss_fn(output, micro) -> losses[b, t]`` or ``(losses, {name: per-token metric [b, t]})``
TokenLossFn = Callable[[Any, MicroBatch], "torch.Tensor | tuple[torch.Tensor, dict[str, torch.Tensor]]"]


def micro_batch_loss(model: Any, micro: MicroBatch, forward_fn: ForwardFn, token_loss_fn: TokenLossFn | None) -> Any:
    """One micro-batch's per-token loss: ``token_loss_fn(forward_fn(model, micro), micro)``, or ``forward_fn(model,
    micro)`` itself when there is no ``token_loss_fn`` (then it is the whole loss function)."""
    out = forward_fn(model, micro)
    return out if token_loss_fn is None else token_loss_fn(out, micro)


@runtime_checkable
class FrozenPasses(NoGradPasses, Protocol):
    """A frozen model beside an engine's (a KL reference, a reward model), placed like it: no-grad passes in which
    every rank of a sharded placement runs the same number of forwards. A pass's ``filler`` (default: the first
    micro-batch the object ever saw) is what this rank runs, discarded, to match the others' count;
    ``filler_forwards`` counts those forwards."""

    filler_forwards: int

    def forward_no_grad(self, micro_batches: Sequence[Any], fn: Callable[[Any, Any], Any],
                        filler: Any = None) -> list[Any]:
        """``[fn(model, micro) for micro in micro_batches]`` without gradients, plus this rank's fillers."""


@runtime_checkable
class TrainEngine(PolicyForwards, NoGradPasses, Protocol):
    """A trained model behind the exact step: the forwards generation and the no-grad passes make
    (:class:`PolicyForwards`, :class:`NoGradPasses`: every rank of a sharded engine runs the same number of
    forwards), one optimizer step per mini-batch, and the state a checkpoint records beside the framework's own.

    Invariants an implementation keeps (tests/distributed/test_exactness.py, tests/unit/test_engine_seam.py):
    ``train_mini_batch`` applies exactly the gradient of the mini-batch's loss L_M (ARCHITECTURE §2) whatever the
    split into ranks and micro-batches, advances the LR schedule once per applied update and ``optimizer_steps``
    with it; ``state_dict`` / ``load_state_dict`` restore the schedule and the counters exactly."""

    plan: BatchPlan
    optimizer_steps: int

    def train_mini_batch(self, micro_batches: Sequence[MicroBatch], loss_fn: ForwardFn,
                         token_loss_fn: TokenLossFn | None = None) -> StepResult:
        """One exact optimizer step over this rank's micro-batches of a mini-batch (module docstring): ``loss_fn``
        is the forward when ``token_loss_fn`` is given, else the whole loss (ARCHITECTURE §5's public name)."""

    def frozen(self, module: torch.nn.Module, offload: Callable[[Any], Any] | None = None) -> FrozenPasses:
        """``module`` frozen (eval mode, no gradients) and placed like this engine's model, as no-grad passes run it;
        ``offload(placed)`` makes its weights' offload between passes (None: they stay on the device)."""

    def sum_over_count_group(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` summed over the ranks that own the mini-batch's tokens, each token once (one all-reduce)."""

    def state_dict(self) -> dict[str, Any]:
        """The step's own state: the LR schedule and the step counters (the model and optimizer are the
        framework's checkpoint)."""

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`'s state exactly."""


__all__ = ["ForwardFn", "FrozenPasses", "TokenLossFn", "TrainEngine", "micro_batch_loss"]
