"""The policy as generation backends see it: unwrapped, its parameters whole for the call, outside its training
wrapper's hooks, its tensor peers kept in step, and its own generation settings hidden.

Shared by every backend that generates with (or copies weights from) the trainer's policy: ``hf``,
``cb`` and ``vllm``'s weight sync. Invariants:
- a backend is given a plain module or a wrapped policy (:class:`dsrl.core.forwards.PolicyForwards`: the
  :class:`dsrl.RLEngine`); :func:`gathered_for_generation` enters the wrapper's generation scope, which holds the
  full parameters on this rank for its block with no collective and no wrapper hook inside it (ZeRO-3: one
  all-gather on entry, one release on exit; DeepSpeed's engine hooks are out of the module under every stage, so
  no forward of a generation synchronizes the device), so every data-parallel rank must enter it the same number
  of times;
- :func:`neutral_generation_config` hides the model's own ``generation_config`` so only dsrl's rollout
  settings shape the sampling;
- :class:`TensorPeersStop` ends a row on every AutoTP peer at the same step;
- a LoRA policy (a PEFT model, ``dsrl.model.lora``) is seen as the transformers model PEFT wraps, whose layers
  carry the adapters: ``hf``/``cb`` generate through the adapted model, and :func:`generation_weights` gives a
  backend with its own copy of the weights (``vllm``) the merged weights ``W + (alpha/r) B A`` under the plain
  model's names, computed beside the trained tensors, which are never modified.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from dsrl.core.forwards import PolicyForwards


def unwrap(policy_or_module: Any) -> tuple[torch.nn.Module, PolicyForwards | None]:
    """(the torch module, the wrapped policy or None) for a wrapped policy (:class:`dsrl.core.forwards.PolicyForwards`,
    e.g. a :class:`dsrl.RLEngine`) or a plain module; a PEFT model is replaced by the transformers model it wraps (its
    layers hold the adapters)."""
    if isinstance(policy_or_module, PolicyForwards):
        return peft_inner(policy_or_module.module), policy_or_module
    if hasattr(policy_or_module, "zero_optimization_stage"):
        raise TypeError("a rollout backend takes the dsrl.RLEngine (what dsrl.initialize returns), not the "
                        "DeepSpeedEngine inside it: generation must run outside the engine's hooks (RLEngine."
                        "generation_scope). Fix: pass the RLEngine, or a plain torch module.")
    if isinstance(policy_or_module, torch.nn.Module):
        return peft_inner(policy_or_module), None
    raise TypeError(f"expected a dsrl.RLEngine or a torch module, got {type(policy_or_module)}")


def peft_inner(module: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside a PEFT model (the module itself otherwise). PEFT injects its adapter layers
    into that model in place, so it computes with the adapters, and it holds every parameter of the PEFT model."""
    get_base = getattr(module, "get_base_model", None)
    return get_base() if hasattr(module, "peft_config") and callable(get_base) else module


_ADAPTER_PARTS = frozenset({"lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector"})


def _is_lora_layer(module: torch.nn.Module) -> bool:
    return (hasattr(module, "base_layer") and callable(getattr(module, "get_delta_weight", None))
            and hasattr(module, "lora_A"))


def _is_saved_copy(module: torch.nn.Module) -> bool:
    """A PEFT ``modules_to_save`` wrapper: a frozen ``original_module`` and a trained copy per adapter."""
    return hasattr(module, "original_module") and isinstance(getattr(module, "modules_to_save", None),
                                                              torch.nn.ModuleDict)


def _computing_copy(wrapper: torch.nn.Module) -> str:
    """The sub-module a ``modules_to_save`` wrapper computes with: its adapter's trained copy, or the original when
    adapters are disabled (the same rule as the wrapper's forward)."""
    active = list(getattr(wrapper, "active_adapters", []) or [])
    if wrapper.disable_adapters or not active or any(a not in wrapper.modules_to_save for a in active):
        return "original_module"
    return f"modules_to_save.{active[0]}"


@torch.no_grad()
def generation_weights(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The weights ``module`` computes with, as ``(name, tensor)`` pairs of its ``state_dict`` (tied heads
    included). For a model carrying LoRA adapters (:func:`peft_inner` of a PEFT model): the plain model's names,
    each adapted layer's weight ``W + sum over its active adapters of get_delta_weight`` (a new tensor: ``W`` and
    the adapters are untouched; disabled adapters add nothing), the copy a ``modules_to_save`` wrapper computes
    with, no adapter tensors. Under ZeRO-3 call it inside :func:`gathered_for_generation`. All at once: a LoRA
    model's merged weights are then a second copy of its adapted layers; :func:`iter_generation_weights` makes
    them one at a time."""
    return list(iter_generation_weights(module))


@torch.no_grad()
def iter_generation_weights(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """:func:`generation_weights`, in the same order, each merged weight computed only when it is reached (a
    consumer that drops each tensor after use never holds more than one merged weight of this generator)."""
    state = module.state_dict()
    layers = {name: m for name, m in module.named_modules() if _is_lora_layer(m)}
    wrappers = {name: _computing_copy(m) for name, m in module.named_modules() if _is_saved_copy(m)}
    if not layers and not wrappers:
        for name, t in state.items():
            yield name, t.detach()
        return
    out: dict[str, torch.Tensor] = {}
    for key, t in state.items():
        parts = key.split(".")
        if _ADAPTER_PARTS.intersection(parts):
            continue
        owner = next((w for w in wrappers if key.startswith(f"{w}.")), None)
        if owner is not None:  # keep only the copy the wrapper computes with, under the wrapped module's name
            inner = key[len(owner) + 1:]
            if not inner.startswith(f"{wrappers[owner]}."):
                continue
            key = f"{owner}.{inner[len(wrappers[owner]) + 1:]}"
        out[key.replace(".base_layer.", ".")] = t.detach()
    merges: dict[str, tuple[torch.nn.Module, list[str]]] = {}
    for name, layer in layers.items():
        if layer.disable_adapters or getattr(layer, "merged", False):
            continue  # the base layer alone computes (disabled), or already holds the delta (merged)
        active = [a for a in layer.active_adapters if a in layer.lora_A or a in getattr(layer, "lora_embedding_A", {})]
        if active:
            merges[f"{name}.weight"] = (layer, active)
    for key, weight in out.items():
        if key in merges:
            layer, active = merges[key]
            delta = sum(layer.get_delta_weight(a) for a in active)
            weight = (weight + delta.to(weight.dtype)).detach()
        yield key, weight


@contextlib.contextmanager
def gathered_for_generation(module: torch.nn.Module, policy: PolicyForwards | None) -> Iterator[None]:
    """Full parameters of ``module`` on this rank for the block, with no collective and no wrapper hook inside it:
    the wrapped policy's :meth:`~dsrl.core.forwards.PolicyForwards.generation_scope` (collective on entry and exit
    under ZeRO-3: every data-parallel rank must enter the same number of times); nothing to do for a plain module."""
    if policy is None:
        yield
        return
    with policy.generation_scope():
        yield


def tensor_parallel_group(policy: PolicyForwards | None) -> Any:
    """The tensor-parallel group of a wrapped policy (None without tensor parallelism, or for a plain module)."""
    if policy is None or policy.view.tensor_parallel_size <= 1:
        return None
    return policy.view.tensor_parallel_group


class TensorPeersStop:
    """A ``transformers`` stopping criterion: a row is done on every tensor peer as soon as it produced
    an end-of-sequence token on any of them (a MAX all-reduce of the per-row flags over ``group``)."""

    def __init__(self, eos: list[int], group: Any):
        self.eos, self.group = eos, group

    def __call__(self, input_ids: torch.Tensor, scores: Any = None, **kwargs: Any) -> torch.Tensor:
        import torch.distributed as dist

        last = input_ids[:, -1]
        done = torch.isin(last, torch.tensor(self.eos, device=last.device)).to(torch.int32)
        dist.all_reduce(done, op=dist.ReduceOp.MAX, group=self.group)
        return done.bool()


@contextlib.contextmanager
def neutral_generation_config(module: torch.nn.Module) -> Iterator[None]:
    """Hide the model's own generation_config so only dsrl's settings shape the sampling."""
    from transformers import GenerationConfig

    if not hasattr(module, "generation_config"):
        yield
        return
    saved = module.generation_config
    module.generation_config = GenerationConfig()
    try:
        yield
    finally:
        module.generation_config = saved
