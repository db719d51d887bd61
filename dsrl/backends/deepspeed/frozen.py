"""Frozen models that only run no-grad forwards beside the policy: the KL reference and a reward model.

:func:`frozen_engine` places such a model like the policy: under ZeRO-3 (where a full copy on every
rank would defeat the point of ZeRO-3) it becomes an optimizer-less DeepSpeed engine whose parameters
are sharded and gathered per forward; otherwise a plain module on the device. Under ZeRO-3 every rank
of the engine must therefore run the same number of forwards: :func:`equal_forwards` pads a rank's
list of inputs with discarded filler forwards up to the largest count over all ranks. Such an engine is built
with DeepSpeed's throughput timer off and runs its forwards outside its own hooks
(:func:`dsrl.backends.deepspeed.hooks.no_grad_scope`): no forward synchronizes the device.
:class:`FrozenModel` is the no-grad pass of the KL reference, with the contract of
:meth:`dsrl.backends.deepspeed.engine.RLEngine.forward_no_grad`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from dsrl.backends.deepspeed.autotp import declare_vocab_shard_of
from dsrl.backends.deepspeed.hooks import no_grad_scope

T = TypeVar("T")


def frozen_engine(module: torch.nn.Module, rl: Any, device: Any) -> Any:
    """``module`` (eval mode, no grads) partitioned like the policy ``rl`` under ZeRO-3, else moved to ``device``."""
    module.eval()
    module.requires_grad_(False)
    if rl.zero_stage != 3:
        return module.to(device)
    import deepspeed

    ds = rl.engine.config if isinstance(getattr(rl.engine, "config", None), dict) else {}
    zero = ds.get("zero_optimization") if isinstance(ds.get("zero_optimization"), dict) else {}
    # Partitioned like the policy: its ZeRO-3 parameter settings (persistence threshold, prefetch, parameter
    # offload), not its optimizer's.
    params = {k: v for k, v in zero.items() if k.startswith("stage3_") or k == "offload_param"}
    cfg: dict[str, Any] = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {**params, "stage": 3},
                           "steps_per_print": 1 << 30, "timers": {"throughput": {"enabled": False}}}
    for key in ("bf16", "fp16"):
        if isinstance(ds.get(key), dict):
            cfg[key] = {"enabled": bool(ds[key].get("enabled", False))}
    if isinstance(ds.get("tensor_parallel"), dict):
        # AutoTP's groups are global: an engine without them fails; the model is sharded like the policy.
        cfg["tensor_parallel"] = dict(ds["tensor_parallel"])
    engine, *_ = deepspeed.initialize(model=module, config=cfg)
    engine.eval()
    declare_vocab_shard_of(engine.module)  # sharded like the policy's head under AutoTP (the fused log-probs)
    return engine


def is_sharded(model: Any) -> bool:
    """Whether ``model`` is a ZeRO-3 engine (every rank must then run the same number of forwards)."""
    return hasattr(model, "zero_optimization_stage") and model.zero_optimization_stage() == 3


@torch.no_grad()
def equal_forwards(model: Any, inputs: Sequence[T], fn: Callable[[Any, T], Any], filler: T,
                   device: Any = "cpu") -> tuple[list[Any], int]:
    """``([fn(model, x) for x in inputs], fillers)``: when ``model`` is sharded, this rank then runs
    ``fn(model, filler)`` (discarded) ``fillers`` times, up to the forward count of the rank with the most
    inputs. The counts are exchanged (one MAX all-reduce over all ranks) *before* the first forward: a
    sharded forward is itself collective, so no rank may enter the count exchange while another forwards."""
    fillers = 0
    sharded = is_sharded(model)
    if sharded and dist.is_initialized() and dist.get_world_size() > 1:
        n = torch.tensor([len(inputs)], dtype=torch.int64, device=device)
        dist.all_reduce(n, op=dist.ReduceOp.MAX)
        fillers = int(n.item()) - len(inputs)
    with no_grad_scope(model) if sharded else contextlib.nullcontext():
        outs = [fn(model, x) for x in inputs]
        for _ in range(fillers):
            fn(model, filler)
    return outs, fillers


class FrozenModel:
    """A frozen model beside the policy (a module, or a ZeRO-3 engine from :func:`frozen_engine`) as a no-grad pass
    runs it: ``forward_no_grad(micros, fn)`` returns ``[fn(model, micro) for micro in micros]``, with every rank of a
    sharded model running the same number of forwards (:func:`equal_forwards`; the filler is the first micro-batch
    this object ever saw, unless the pass names its own) outside the engine's hooks, counting those fillers in
    ``filler_forwards``. With ``offload`` (:class:`dsrl.backends.deepspeed.offload.
    FrozenWeights`, ``dsrl.memory.offload_states``) the weights are on the device only during the pass."""

    def __init__(self, model: Any, device: Any, offload: Any = None):
        self.model, self.device, self.offload = model, device, offload
        self._filler: Any = None
        self.filler_forwards = 0  # forwards this rank ran only to match other ranks' counts (ZeRO-3)

    def forward_no_grad(self, micro_batches: Sequence[T], fn: Callable[[Any, T], Any], filler: T | None = None
                        ) -> list[Any]:
        micros = list(micro_batches)
        if filler is None:
            if micros and self._filler is None:
                self._filler = micros[0]
            filler = self._filler
        if filler is None and is_sharded(self.model):
            raise RuntimeError("a sharded frozen model's first no-grad pass found no micro-batch on this rank, so it "
                               "cannot run the filler forwards the other ranks' gathers need; give every rank at "
                               "least one sequence in the first rollout")
        with self.offload.for_pass() if self.offload is not None else contextlib.nullcontext():
            outs, fillers = equal_forwards(self.model, micros, fn, filler, self.device)
        self.filler_forwards += fillers
        return outs
