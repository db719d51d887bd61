"""CPU-only shim: lets megatron-core 0.16.1-0.19.x run on CPU with gloo (no CUDA, no Transformer Engine).

Used by the CPU demo of launch/train_megatron.py and by the tests.

megatron-core hard-codes CUDA in a few places that a CPU test reaches: the CUDA RNG tracker, grad
buffers and schedule counters allocated on ``torch.cuda.current_device()``, ``device="cuda"``
factory calls (the default causal mask), P2P synchronisation. ``install()`` redirects exactly
those to the CPU. It never changes numerics: every redirected call allocates the same tensor on
the CPU. Never import this from the ``dsrl`` package: it is for running the example and the tests without a GPU.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

_INSTALLED = False


def _cpu_device(kwargs: dict[str, Any]) -> dict[str, Any]:
    dev = kwargs.get("device")
    if dev is not None and "cuda" in str(dev):
        kwargs["device"] = "cpu"
    if kwargs.get("pin_memory"):  # a host staging buffer for a CUDA copy (the rotary table's CP cut): none here
        kwargs["pin_memory"] = False
    return kwargs


class _CpuStream:
    """What ``torch.cuda.current_stream()`` returns on the CPU: a stream on which every wait is a no-op."""

    def wait_event(self, *args: Any, **kwargs: Any) -> None:
        return None

    def wait_stream(self, *args: Any, **kwargs: Any) -> None:
        return None

    def synchronize(self) -> None:
        return None


def install() -> None:
    """Idempotently patch torch.cuda / megatron-core's CUDA-only calls for a CPU-only process."""
    global _INSTALLED
    if _INSTALLED or torch.cuda.is_available():
        return
    _INSTALLED = True
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    # torch's device context (``with torch.device("meta")``) recognises factory calls by identity, from a set it
    # builds once, at its first use: built after the wrappers below, it would hold them instead of torch's own
    # functions, so a factory call under the context would no longer take its device (transformers' from_pretrained
    # then builds a model on the CPU, takes it for one without a meta context, and leaves a Llama's rotary inv_freq
    # uninitialised). Build the set from torch's own functions first.
    from torch.utils._device import _device_constructors

    _device_constructors()
    for name in ("zeros", "empty", "ones", "tensor", "full", "arange", "randn", "rand"):
        orig = getattr(torch, name)

        def wrapped(*args: Any, _orig: Any = orig, **kwargs: Any) -> Any:
            return _orig(*args, **_cpu_device(kwargs))

        functools.update_wrapper(wrapped, orig)
        setattr(torch, name, wrapped)
    cpu_rng = lambda *a, **k: torch.get_rng_state()  # noqa: E731
    torch.cuda.get_rng_state = cpu_rng  # type: ignore[assignment]
    torch.cuda.random.get_rng_state = cpu_rng  # type: ignore[assignment]
    torch.cuda.manual_seed = lambda *a, **k: None  # type: ignore[assignment]
    torch.cuda.manual_seed_all = lambda *a, **k: None  # type: ignore[assignment]
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    torch.Tensor.cuda = lambda self, *a, **k: self  # type: ignore[assignment]
    # megatron-core >= 0.19: a grad sync first waits on the current stream for CUDA-graph events (none on the CPU)
    torch.cuda.current_stream = lambda *a, **k: _CpuStream()  # type: ignore[assignment]

    from megatron.core.tensor_parallel import random as mrandom

    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)

    # megatron-core's mixed-precision optimizer sorts the model's parameters by their CUDA type name
    # ('torch.cuda.BFloat16Tensor', ...): while it is built, a CPU tensor reports the CUDA name of its dtype
    from megatron.core.optimizer import optimizer as moptimizer

    build = moptimizer.Float16OptimizerWithFloat16Params.__init__

    def build_on_cpu(self: Any, *args: Any, **kwargs: Any) -> None:
        own_type = torch.Tensor.type

        def cuda_name(tensor: torch.Tensor, *a: Any, **k: Any) -> Any:
            name = own_type(tensor, *a, **k)
            if a or k or not isinstance(name, str) or not name.startswith("torch.") or ".cuda." in name:
                return name
            return "torch.cuda." + name[len("torch."):]

        torch.Tensor.type = cuda_name  # type: ignore[method-assign]
        try:
            build(self, *args, **kwargs)
        finally:
            torch.Tensor.type = own_type  # type: ignore[method-assign]

    moptimizer.Float16OptimizerWithFloat16Params.__init__ = build_on_cpu  # type: ignore[method-assign]
