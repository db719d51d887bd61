"""Old/ref log-probs and the entropy metric from a micro-batch's logits: dsrl's chunked, no-autograd
path (the log-softmax over row chunks, dsrl.core.logprobs) vs the previous whole-tensor float32
log-softmax, on the same bf16 logits of a real vocabulary (Qwen2's 151,936); and the training
step's log-probs (forward + backward to the logits): dsrl's chunked autograd function (softmax
recomputed per chunk in the backward) vs autograd through the whole-tensor float32 log-softmax.

Peak extra memory above the logits themselves (CUDA: max_memory_allocated; CPU: peak RSS growth of a
fresh process per method) and the median time; prints the new/old ratios.

    python bench/logprobs.py                  # CPU, [4, 256, 151936]
    python bench/logprobs.py --device cuda --rows 8 --seq 1024
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

from _common import report, table

VOCAB = 151936


def old_logprobs(logits, targets):
    import torch

    return torch.log_softmax(logits.float(), dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def old_entropy(logits, targets):
    import torch

    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)


def new_logprobs(logits, targets):
    from dsrl.core.logprobs import token_logprobs

    return token_logprobs(logits, targets)


def new_entropy(logits, targets):
    from dsrl.core.logprobs import token_entropy

    return token_entropy(logits)


METHODS = {"old log-probs": old_logprobs, "new log-probs": new_logprobs, "old entropy": old_entropy,
           "new entropy": new_entropy, "old train log-probs": old_logprobs, "new train log-probs": new_logprobs}


def one(method: str, rows: int, seq: int, device: str, repeats: int) -> dict:
    """Run in a fresh process: peak extra bytes and median seconds of ``method``."""
    import torch

    import dsrl.core.logprobs  # noqa: F401  (imported before the baseline is taken)

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(rows, seq, VOCAB, generator=g, dtype=torch.bfloat16).to(device)  # no float32 transient
    targets = torch.randint(0, VOCAB, (rows, seq), generator=g).to(device)
    fn = METHODS[method]
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    times = []
    train = "train" in method
    if train:  # the logits' gradient (same size as the logits, in both methods) is allocated up front
        logits.requires_grad_(True)
        logits.grad = torch.zeros_like(logits)
        weights = torch.randn(rows, seq, generator=g).to(device)
    with torch.set_grad_enabled(train):
        for _ in range(repeats):
            sync()
            t0 = time.perf_counter()
            out = fn(logits, targets)
            if train:
                (out * weights).sum().backward()
            sync()
            times.append(time.perf_counter() - t0)
            del out
    peak = (torch.cuda.max_memory_allocated() if device == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024) - base
    return {"peak_mib": peak / 2**20, "s": statistics.median(times)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-record", action="store_true")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        print(json.dumps(one(a.worker, a.rows, a.seq, a.device, a.repeats)))
        return
    res = {}
    for method in METHODS:
        out = subprocess.run([sys.executable, __file__, "--worker", method, "--device", a.device, "--rows",
                              str(a.rows), "--seq", str(a.seq), "--repeats", str(a.repeats)],
                             capture_output=True, text=True, check=True)
        res[method] = json.loads(out.stdout.strip().splitlines()[-1])
    logits_mib = a.rows * a.seq * VOCAB * 2 / 2**20
    rows = []
    for what in ("log-probs", "entropy", "train log-probs"):
        old, new = res[f"old {what}"], res[f"new {what}"]
        rows.append([what, f"{old['peak_mib']:.0f}", f"{new['peak_mib']:.0f}",
                     f"{new['peak_mib'] / old['peak_mib']:.2f}", f"{old['s']:.3f}", f"{new['s']:.3f}",
                     f"{new['s'] / old['s']:.2f}"])
    body = (f"bf16 logits [{a.rows}, {a.seq}, {VOCAB}] ({logits_mib:.0f} MiB) on {a.device}; log-probs of the "
            "targets (the old/ref log-prob pass) and the entropy (the metric), each alone, no autograd; train "
            "log-probs = the same with autograd, forward + backward into a preallocated logits gradient. "
            "old = float32 log-softmax of the whole tensor (autograd through it for train); new = "
            "dsrl.core.logprobs (the same log-softmax over row chunks of <= 256 MiB float32; for train, a custom "
            "autograd function that recomputes each chunk's softmax in the backward).\n\n"
            + table(["quantity", "old peak extra MiB", "new", "new/old", "old median s", "new", "new/old"], rows))
    report("Log-probs and entropy without autograd (bench/logprobs.py)", body, a.no_record)


if __name__ == "__main__":
    main()
