"""Frozen models that only run no-grad forwards beside the policy: the KL reference and a reward model.

:func:`frozen_engine` places such a model like the policy: under ZeRO-3 (where a full copy on every
rank would defeat the point of ZeRO-3) it becomes an optimizer-less DeepSpeed engine whose parameters
are sharded and gathered per forward; otherwise a plain module on the device. Under ZeRO-3 every rank
of the engine must therefore run the same number of forwards: :func:`equal_forwards` pads a rank's
list of inputs with discarded filler forwards up to the largest count over all ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

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
                           "steps_per_print": 1 << 30}
    for key in ("bf16", "fp16"):
        if isinstance(ds.get(key), dict):
            cfg[key] = {"enabled": bool(ds[key].get("enabled", False))}
    if isinstance(ds.get("tensor_parallel"), dict):
        # AutoTP's groups are global: an engine without them fails; the model is sharded like the policy.
        cfg["tensor_parallel"] = dict(ds["tensor_parallel"])
    engine, *_ = deepspeed.initialize(model=module, config=cfg)
    engine.eval()
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
    if is_sharded(model) and dist.is_initialized() and dist.get_world_size() > 1:
        n = torch.tensor([len(inputs)], dtype=torch.int64, device=device)
        dist.all_reduce(n, op=dist.ReduceOp.MAX)
        fillers = int(n.item()) - len(inputs)
    outs = [fn(model, x) for x in inputs]
    for _ in range(fillers):
        fn(model, filler)
    return outs, fillers
