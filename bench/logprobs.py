"""The log-prob passes at a real vocabulary and hidden size (Qwen2-0.5B's head: 151,936 x 896, bf16): the path
dsrl took before the fused head vs the fused one.

- before: the output head over every position gives bf16 logits [b, t, V], then the chunked log-softmax (row
  chunks of <= 256 MiB float32, an autograd function recomputing each chunk's softmax in the backward, the
  entropy metric in a second chunked pass): the code as it was, kept in this benchmark only;
- fused: ``dsrl.core.logprobs.head_stats`` over the completion positions only (the head fused into the tiled
  log-softmax: at most one chunk of [rows, V] logits, log-probs and entropy from the same chunks, the backward
  recomputing vocabulary blocks), as ``dsrl.rl.policy.logprobs.forward_logprobs`` runs it.

Two passes, each method in a fresh process on the same hidden states, head weight and targets: the old/ref
log-prob pass (no autograd) and the training step (log-probs with autograd and the entropy metric, forward +
backward into the hidden states and the weight). Peak extra memory above the inputs (CUDA:
max_memory_allocated; CPU: peak RSS growth) and the median time; prints fused/before ratios. Target: the
log-prob pass's peak extra memory <= 0.25x.

    python bench/logprobs.py                  # CPU, hidden [2, 256, 896], half of each row completion
    python bench/logprobs.py --device cuda --rows 8 --seq 1024
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time

from _common import bench_env, report, run_process, table

VOCAB, HIDDEN = 151936, 896
BEFORE_CHUNK_BYTES = 1 << 28  # the float32 rows per chunk of the path before the fused head


# -- the path before the fused head (kept here only) ---------------------------------------------------------
def _before_rows() -> int:
    return max(1, BEFORE_CHUNK_BYTES // (4 * VOCAB))


def _before_logprobs(logits, targets, temperature: float = 1.0):
    """Per-row-chunk float32 log-softmax of logits [n, V], gathered at the targets (no autograd)."""
    import torch

    out = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
    step = _before_rows()
    with torch.no_grad():
        for i in range(0, logits.shape[0], step):
            x = logits[i:i + step].float() / temperature
            out[i:i + step] = torch.log_softmax(x, -1).gather(-1, targets[i:i + step, None]).squeeze(-1)
    return out


def _before_entropy(logits):
    import torch

    out = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
    step = _before_rows()
    with torch.no_grad():
        for i in range(0, logits.shape[0], step):
            logp = torch.log_softmax(logits[i:i + step].float(), -1)
            out[i:i + step] = -(logp.exp() * logp).sum(-1)
    return out


def _before_autograd():
    import torch

    class ChunkedTargetLogprob(torch.autograd.Function):
        @staticmethod
        def forward(ctx, logits, targets):
            ctx.save_for_backward(logits, targets)
            return _before_logprobs(logits, targets)

        @staticmethod
        def backward(ctx, grad_out):
            logits, targets = ctx.saved_tensors
            grad = torch.empty_like(logits)
            step = _before_rows()
            for i in range(0, logits.shape[0], step):
                g = grad_out[i:i + step, None].float()
                d = torch.softmax(logits[i:i + step].float(), dim=-1).mul_(-g)
                d.scatter_add_(-1, targets[i:i + step, None], g)
                grad[i:i + step] = d
            return grad, None

    return ChunkedTargetLogprob


# -- the two passes, each method ------------------------------------------------------------------------------
def before_pass(x):
    import torch.nn.functional as F

    logits = F.linear(x["hidden"].reshape(-1, HIDDEN), x["weight"])  # the head over every position
    return _before_logprobs(logits, x["targets"].reshape(-1)).view(x["targets"].shape)[:, x["prompt"]:]


def fused_pass(x):
    from dsrl.core.logprobs import LOGPROB, head_stats

    p = x["prompt"]
    rows = x["hidden"][:, p:].reshape(-1, HIDDEN)
    return head_stats(rows, x["weight"], x["targets"][:, p:].reshape(-1))[:, LOGPROB]


def before_train(x):
    import torch.nn.functional as F

    logits = F.linear(x["hidden"].reshape(-1, HIDDEN), x["weight"])
    targets = x["targets"].reshape(-1)
    logp = _before_autograd().apply(logits, targets).view(x["targets"].shape)
    entropy = _before_entropy(logits.detach())  # the metric
    loss = (logp[:, x["prompt"]:] * x["weights"]).sum()
    loss.backward()
    return entropy


def fused_train(x):
    from dsrl.core.logprobs import ENTROPY, LOGPROB, head_stats

    p = x["prompt"]
    rows = x["hidden"][:, p:].reshape(-1, HIDDEN)
    stats = head_stats(rows, x["weight"], x["targets"][:, p:].reshape(-1), entropy=True)
    (stats[:, LOGPROB] * x["weights"].reshape(-1)).sum().backward()
    return stats[:, ENTROPY].detach()


METHODS = {"before pass": before_pass, "fused pass": fused_pass, "before train": before_train,
           "fused train": fused_train}


def one(method: str, rows: int, seq: int, device: str, repeats: int) -> dict:
    """Run in a fresh process: peak extra bytes and median seconds of ``method``."""
    import torch

    import dsrl.core.logprobs  # noqa: F401  (imported before the baseline is taken)

    g = torch.Generator().manual_seed(0)
    train = "train" in method
    # made in bf16 directly: a float32 transient would raise the RSS high-water mark the CPU baseline is read from
    x = {"hidden": torch.randn(rows, seq, HIDDEN, generator=g, dtype=torch.bfloat16).to(device),
         "weight": torch.randn(VOCAB, HIDDEN, generator=g, dtype=torch.bfloat16).mul_(0.02).to(device),
         "targets": torch.randint(0, VOCAB, (rows, seq), generator=g).to(device), "prompt": seq // 2,
         "weights": torch.randn(rows, seq - seq // 2, generator=g).to(device)}
    if train:
        x["hidden"].requires_grad_(True)
        x["weight"].requires_grad_(True)
    fn = METHODS[method]
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    times = []
    with torch.set_grad_enabled(train):
        for _ in range(repeats):
            sync()
            t0 = time.perf_counter()
            out = fn(x)
            sync()
            times.append(time.perf_counter() - t0)
            del out
            x["hidden"].grad = x["weight"].grad = None
    peak = (torch.cuda.max_memory_allocated() if device == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024) - base
    return {"peak_mib": peak / 2**20, "s": statistics.median(times)}


def _ratio(new: float, old: float) -> str:
    return f"{new / old:.2f}" if old > 0 else "n/a (nothing measured: too small a shape)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rows", type=int, default=2)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--no-record", action="store_true")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        print(json.dumps(one(a.worker, a.rows, a.seq, a.device, a.repeats)))
        return
    res = {}
    for method in METHODS:
        done = run_process([sys.executable, __file__, "--worker", method, "--device", a.device, "--rows", str(a.rows),
                            "--seq", str(a.seq), "--repeats", str(a.repeats)], env=bench_env(a.device))
        if done.status != "ok":
            raise SystemExit(f"the {method} worker failed:\n{done.output}")
        res[method] = json.loads(next(line for line in reversed(done.output.splitlines()) if line.startswith("{")))
    logits_mib = a.rows * a.seq * VOCAB * 2 / 2**20
    rows = []
    for what, label in (("pass", "old/ref log-prob pass"), ("train", "training step (+ entropy metric)")):
        old, new = res[f"before {what}"], res[f"fused {what}"]
        rows.append([label, f"{old['peak_mib']:.0f}", f"{new['peak_mib']:.0f}",
                     _ratio(new["peak_mib"], old["peak_mib"]), f"{old['s']:.3f}", f"{new['s']:.3f}",
                     _ratio(new["s"], old["s"])])
    from dsrl.core.logprobs import LOGIT_CHUNK_BYTES

    body = (f"bf16 hidden states [{a.rows}, {a.seq}, {HIDDEN}] and head weight [{VOCAB}, {HIDDEN}] on {a.device}; "
            f"the second half of each row is completion ({a.rows * (a.seq - a.seq // 2)} positions). before = the "
            f"head over every position (bf16 logits {logits_mib:.0f} MiB), then the chunked float32 log-softmax "
            f"(<= {BEFORE_CHUNK_BYTES >> 20} MiB chunks; in training an autograd function recomputing each chunk's "
            "softmax, and the entropy metric in a second chunked pass). fused = dsrl.core.logprobs.head_stats on the "
            f"completion positions only (two float32 buffers of <= {LOGIT_CHUNK_BYTES >> 20} MiB per chunk; in "
            "training log-probs and entropy from the same chunks, the backward recomputing vocabulary blocks). "
            "Peak extra memory includes, in training, the weight's and hidden states' gradients (the same in both). "
            "Target: the log-prob pass's peak extra memory <= 0.25x.\n\n"
            + table(["pass", "before peak extra MiB", "fused", "fused/before", "before median s", "fused",
                     "fused/before"], rows))
    report("Log-prob passes: full logits vs the fused output head (bench/logprobs.py)", body, a.no_record)


if __name__ == "__main__":
    main()
