"""Counting, on the CPU, what would stall a GPU: device synchronizations and device-to-host copies.

:class:`DeviceTraffic` counts, while active:

- ``syncs``: calls of the accelerator's ``synchronize()`` (DeepSpeed's ``get_accelerator()``, whoever calls it:
  DeepSpeed's throughput timer calls it on every forward of its engine's module once two steps have run);
- ``copies``: device-to-host transfers made by dsrl's own code (a caller frame inside the ``dsrl`` package):
  ``Tensor.cpu()``, ``.item()``, ``.tolist()``, ``.numpy()`` and ``bool``/``int``/``float``/``index`` of a tensor
  (``.to(device)`` is how dsrl uploads inputs; on the CPU its direction cannot be told, so it is not counted). On
  the CPU every tensor is a host tensor, so a transfer is told apart from host-side work by marking: the result of
  a counted transfer is marked as host memory, every tensor a torch function computes from a marked one is marked
  too (a ``TorchFunctionMode``), and reading a marked tensor or a view of it (a slice of the copy, its ``tolist()``,
  ``int()`` of its maximum) is not a transfer. Tensors dsrl builds from Python data on the host
  (``torch.tensor(list)``) are counted when read: passes measured here must not build any;
- ``where``: the dsrl source lines of the counted copies (to say what moved).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

DSRL_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "dsrl")
READS = ("cpu", "item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__")


class DeviceTraffic:
    def __init__(self) -> None:
        self.syncs = 0
        self.copies = 0
        self.where: list[str] = []

    def reset(self) -> None:
        self.syncs, self.copies, self.where = 0, 0, []

    def _from_dsrl(self) -> str | None:
        frame = sys._getframe(3)  # _from_dsrl <- _transfer <- the wrapped Tensor method <- its caller
        path = frame.f_code.co_filename
        if os.path.abspath(path).startswith(DSRL_DIR):
            return f"{os.path.relpath(path, os.path.dirname(DSRL_DIR))}:{frame.f_lineno}"
        return None

    def _transfer(self, tensor: torch.Tensor, result: Any) -> None:
        where = self._from_dsrl()
        if where is None:
            return
        if _on_host(tensor):
            return
        self.copies += 1
        self.where.append(where)
        if isinstance(result, torch.Tensor):
            _mark(result)

    @contextlib.contextmanager
    def counting(self) -> Iterator[DeviceTraffic]:
        from deepspeed.accelerator import get_accelerator

        acc = get_accelerator()
        original_sync = acc.synchronize

        def sync(*args: Any, **kwargs: Any) -> Any:
            self.syncs += 1
            return original_sync(*args, **kwargs)

        originals = {name: getattr(torch.Tensor, name) for name in READS}

        def wrap(name: str, fn: Any) -> Any:
            def read(t: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
                out = fn(t, *args, **kwargs)
                self._transfer(t, out)
                return out

            return read

        own = {name: name in vars(torch.Tensor) for name in originals}
        acc_owns = "synchronize" in vars(acc)
        acc.synchronize = sync
        for name, fn in originals.items():
            setattr(torch.Tensor, name, wrap(name, fn))
        try:
            with _HostPropagation():
                yield self
        finally:
            for name, fn in originals.items():
                if own[name]:
                    setattr(torch.Tensor, name, fn)
                else:
                    delattr(torch.Tensor, name)
            if acc_owns:
                acc.synchronize = original_sync
            else:
                del acc.synchronize


def _root(t: torch.Tensor) -> torch.Tensor:
    return t if t._base is None else t._base


def _on_host(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and getattr(_root(t), "_dsrl_on_host", False)


def _mark(t: torch.Tensor) -> None:
    """(on the CPU ``.cpu()`` returns the tensor itself, possibly a view: mark its root)"""
    _root(t)._dsrl_on_host = True


class _HostPropagation(TorchFunctionMode):
    """Marks every tensor a torch function computes from a marked (host) tensor as host memory too."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if any(_on_host(a) for a in tree_flatten((args, kwargs))[0]):
            for o in tree_flatten(out)[0]:
                if isinstance(o, torch.Tensor):
                    _mark(o)
        return out
