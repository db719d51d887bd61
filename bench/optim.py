"""Optimizer step time: torch's AdamW (foreach; fused on a GPU), NVIDIA apex's FusedAdam where it imports, and
DeepSpeed's FusedAdam (built on first use) on the same fp32 parameters and gradients.

    python bench/optim.py                         # CPU, tiny shape: torch's AdamW only (the others need a GPU)
    python bench/optim.py --device cuda --size 0.5b

The parameters are a Qwen2 of the named shape (bench/_common.py MODEL_SIZES) in float32, as DeepSpeed's bf16
recipe steps them (its fp32 master weights), with random gradients; the same lr, betas, eps and weight decay for
every optimizer. Per optimizer: 2 warm-up steps, then the median of ``--steps`` timed steps (synchronised with
the device). Also printed: whether dsrl would hand apex's FusedAdam to DeepSpeed here
(``dsrl.backends.deepspeed.apex``: ``model.apex = "auto"``, a ds_config AdamW without ``torch_adam``) and, for
DeepSpeed's FusedAdam, how long its build (or load from the extension cache) took. Nothing asserts on time.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from _common import build_lm, report, table

HYPER = {"lr": 1e-5, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}


def optimizers(device: str) -> dict[str, tuple[Any, str]]:
    """name -> (factory(params) or None, note: why not run, or a remark)."""
    import torch

    from dsrl.backends.deepspeed.apex import apex_fused_adam

    gpu = device.startswith("cuda")
    out: dict[str, tuple[Any, str]] = {
        "torch AdamW (foreach)": (lambda ps: torch.optim.AdamW(ps, foreach=True, **HYPER), ""),
        "torch AdamW (fused)": ((lambda ps: torch.optim.AdamW(ps, fused=True, **HYPER)) if gpu else None,
                                "" if gpu else "needs a GPU here"),
    }
    fused = apex_fused_adam() if gpu else None
    out["apex FusedAdam"] = ((lambda ps: fused(ps, adam_w_mode=True, **HYPER)) if fused is not None else None,
                             "" if fused is not None else
                             ("needs a GPU" if not gpu else "apex (with its CUDA extension) is not importable"))
    if gpu:
        def deepspeed_fused(ps: list[Any]) -> Any:
            from deepspeed.ops.adam import FusedAdam

            return FusedAdam(ps, adam_w_mode=True, **HYPER)

        out["DeepSpeed FusedAdam"] = (deepspeed_fused, "")
    else:
        out["DeepSpeed FusedAdam"] = (None, "needs a GPU")
    return out


def time_steps(make: Any, params: list[Any], steps: int, sync: Any) -> tuple[float, float]:
    """(seconds to build the optimizer, median seconds per step)."""
    t0 = time.perf_counter()
    opt = make(params)
    built = time.perf_counter() - t0
    times = []
    for i in range(steps + 2):
        sync()
        t0 = time.perf_counter()
        opt.step()
        sync()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    del opt
    return built, statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default=None, help="cpu | cuda (default: cuda when available)")
    ap.add_argument("--size", default=None, help="model shape: tiny | small | 0.5b (default: 0.5b on GPU, tiny on CPU)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--no-record", dest="no_record", action="store_true")
    args = ap.parse_args()

    import torch

    from dsrl.backends.deepspeed.apex import apex_adam_reason

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    size = args.size or ("0.5b" if device.startswith("cuda") else "tiny")
    gpu = device.startswith("cuda")
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    model = build_lm(size, 128, torch.float32).to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    g = torch.Generator(device=device).manual_seed(0)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g, device=device) * 1e-3
    n = sum(p.numel() for p in params)
    rows, base = [], None
    for name, (make, note) in optimizers(device).items():
        if make is None:
            rows.append([name, "-", "-", "-", f"not run: {note}"])
            continue
        try:
            built, step = time_steps(make, params, args.steps, sync)
        except Exception as e:  # noqa: BLE001 - a kernel that cannot build here is a result, not a crash
            rows.append([name, "-", "-", "-", f"failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}"])
            continue
        base = base or step
        rows.append([name, f"{1000 * step:.2f}", f"{step / base:.2f}", f"{built:.1f}", note])
        print(rows[-1], flush=True)
    ds = {"optimizer": {"type": "AdamW", "params": {"lr": HYPER["lr"]}}}
    reason = apex_adam_reason(ds, "auto", gpu, None)
    body = (f"{device}, {size} shape ({n / 1e6:.1f} M fp32 parameters with random gradients), lr/betas/eps/weight "
            f"decay {HYPER['lr']}/{HYPER['betas']}/{HYPER['eps']}/{HYPER['weight_decay']}, median of {args.steps} "
            "steps after 2 warm-up steps; x = step time over the first row's; build s = the optimizer's "
            "construction (DeepSpeed's FusedAdam: its kernel's build or load from the extension cache). dsrl with "
            "model.apex = 'auto' and a ds_config AdamW here: "
            + ("apex's FusedAdam would be used." if reason is None else f"DeepSpeed's own optimizer ({reason}).")
            + "\n\n" + table(["optimizer", "ms/step", "x", "build s", "note"], rows))
    report("Optimizer step: torch AdamW vs apex / DeepSpeed FusedAdam (bench/optim.py)", body, args.no_record)


if __name__ == "__main__":
    main()
