"""DeepSpeed's module hooks, and the forwards that run outside them.

A ``DeepSpeedEngine`` registers a forward pre-hook and a post-hook on the module it wraps (its forward prologue and
epilogue: the throughput timer, forward timers, the flops profiler, ZeRO-3's external-parameter flags), and under
ZeRO-3 a gather/release hook pair on every sub-module. They run on *every* forward of the module, also those made for
generation (``generate``, continuous batching: one forward per decode step) or a no-grad log-prob pass. With no
training dataloader given (dsrl gives none), the prologue starts the throughput timer, which synchronizes the device
on every forward once two optimizer steps have run (ARCHITECTURE §7): inside generation that removes the CPU/GPU
overlap and invalidates a CUDA graph being captured. dsrl turns that timer off in the ds_config it builds
(:mod:`dsrl.backends.deepspeed.config`), and runs every forward that is not a training step outside the engine's
hooks (ARCHITECTURE §4, last rule):

- :func:`generation_scope`: for the block, the engine's prologue/epilogue hooks are out of the module; under ZeRO-3
  the full parameters are gathered once on entry (one all-gather, every data-parallel rank must enter it equally
  often) and released on exit, with ZeRO-3's per-module hooks out too, so no collective runs inside the block;
- :func:`no_grad_scope`: for the block, the engine's prologue/epilogue hooks are out of the module; ZeRO-3's
  per-module hooks stay (each forward gathers its layers as in training, so ranks must run equally many forwards),
  and the modules are marked "in forward" once for the block, which is what the prologue does per forward (ZeRO-3
  then still discovers parameters a module reads from another module).

Hooks are taken out of their modules' hook dictionaries and put back in their original order afterwards, so
hooks registered by others keep their places and the engine's handles stay valid (:func:`suspended_hooks`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch


@contextlib.contextmanager
def suspended_hooks(handles: Iterable[Any]) -> Iterator[None]:
    """Take the hooks of ``handles`` (``torch.utils.hooks.RemovableHandle``) out of their modules for the block and
    put them back afterwards in their original order; hooks added by others during the block are kept, after them."""
    handles = [h for h in handles if h is not None]
    ids = {h.id for h in handles}
    saved: dict[int, tuple[dict, list[tuple[int, Any]]]] = {}
    for h in handles:  # a with_kwargs pre-hook's id also sits in a flag dict of its module, which may stay
        d = h.hooks_dict_ref()
        if d is None:
            continue
        if id(d) not in saved:
            saved[id(d)] = (d, list(d.items()))
        d.pop(h.id, None)
    try:
        yield
    finally:
        for d, items in saved.values():
            current = dict(d)
            known = dict(items)
            restored = [(k, v) for k, v in items if k in ids or k in current]
            added = [(k, v) for k, v in current.items() if k not in known]
            d.clear()
            d.update(restored + added)


def engine_hooks(engine: Any) -> list[Any]:
    """The handles of the hooks a DeepSpeedEngine put on the module it wraps (forward prologue and epilogue, and the
    AutoTP input check while it is still installed)."""
    return [getattr(engine, name, None) for name in
            ("module_forward_pre_hook", "module_forward_post_hook", "first_dataloader_check")]


def _zero3_offload(engine: Any) -> Any:
    """The DeepSpeedZeRoOffload object that owns the ZeRO-3 module hooks."""
    opt = getattr(engine, "optimizer", None)
    offload = getattr(opt, "parameter_offload", opt)
    if offload is None or not hasattr(offload, "forward_hooks"):
        raise RuntimeError("ZeRO-3 engine without a parameter-offload object holding its module hooks; this "
                           "DeepSpeed version is not supported for generation")
    return offload


def zero3_hooks(engine: Any) -> list[Any]:
    """The handles of ZeRO-3's per-module gather/release hooks (and its top-level pre-forward hook)."""
    offload = _zero3_offload(engine)
    return [*offload.forward_hooks, *offload.backward_hooks, getattr(offload, "fwd_pre_hook", None)]


def suspended_zero3_hooks(engine: Any) -> contextlib.AbstractContextManager[None]:
    """ZeRO-3's module hooks out of the modules for the block (see :func:`suspended_hooks`)."""
    return suspended_hooks(zero3_hooks(engine))


def is_zero3(engine: Any) -> bool:
    return engine.zero_optimization_stage() == 3


@contextlib.contextmanager
def generation_scope(engine: Any) -> Iterator[None]:
    """The full parameters on this rank for the block, no collective and no engine hook inside it (module
    docstring). Under ZeRO-3: one all-gather on entry and one release on exit (collective: every data-parallel rank
    must enter the block the same number of times)."""
    with contextlib.ExitStack() as stack:
        if is_zero3(engine):
            import deepspeed

            stack.enter_context(deepspeed.zero.GatheredParameters(list(engine.module.parameters())))
            stack.enter_context(suspended_zero3_hooks(engine))
        stack.enter_context(suspended_hooks(engine_hooks(engine)))
        yield


@contextlib.contextmanager
def no_grad_scope(engine: Any) -> Iterator[None]:
    """Forwards in the block run without the engine's prologue/epilogue hooks (module docstring); ZeRO-3's per-module
    gathers stay, with the modules marked "in forward" for the whole block."""
    with suspended_hooks(engine_hooks(engine)), _in_forward(engine):
        yield


@contextlib.contextmanager
def _in_forward(engine: Any) -> Iterator[None]:
    """What the engine's prologue/epilogue do around each forward under ZeRO-3 weight partitioning, once for the
    block: ZeRO-3 discovers parameters a module reads from another module only while this flag is set."""
    if not engine.zero_optimization_partition_weights():
        yield
        return
    from deepspeed.runtime.zero.parameter_offload import ZeROOrderedDict, ensure_zero_ordered_dict

    modules: list[torch.nn.Module] = list(engine.module.modules())
    for m in modules:
        ensure_zero_ordered_dict(m)
        m._parameters._in_forward = True
    try:
        yield
    finally:
        for m in modules:
            if isinstance(m._parameters, ZeROOrderedDict):
                m._parameters._in_forward = False
