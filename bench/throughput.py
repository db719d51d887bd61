"""Training throughput (valid tokens per second) of fixed vs token-budget micro-batches.

    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 bench/throughput.py             # CPU, tiny Qwen2, ZeRO-2
    deepspeed --num_gpus 1 bench/throughput.py --size 0.5b --max_len 4096     # 1 GPU, 0.5B shape, bf16

A randomly initialised transformers Qwen2 model is trained through ``dsrl.initialize`` +
``RLEngine.train_mini_batch`` under ZeRO-2 on mini-batches with RL-shaped lengths (the same draws
for every method). Methods, under the same activation-memory bound T = budget_factor * max_len
token slots per micro-batch:

  (a) fixed micro-batches of m = T // max_len sequences, padded to the mini-batch's longest;
  (b) fixed micro-batches of m sequences, each padded to its own longest;
  (c) dsrl token budget T with rank balancing (dsrl.core.partition).

Methods alternate step by step (order rotated every step). Reported: median valid tokens/s per
method (valid = real sequence tokens of the whole mini-batch, all ranks) and the ratios c/a, c/b.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from _common import build_lm, init_ranks, make_micro, per_token_nll, report, rl_lengths, table

from dsrl.core.partition import fixed_micro_batches, token_budget_micro_batches


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="tiny", help="model shape: tiny | small | 0.5b (bf16 on GPU)")
    ap.add_argument("--lengths", default="lognormal", help="lognormal | bimodal")
    ap.add_argument("--mini_batch", type=int, default=None, help="sequences per optimizer step (all ranks)")
    ap.add_argument("--max_len", type=int, default=None)
    ap.add_argument("--budget_factor", type=int, default=2, help="T = factor * max_len token slots per micro-batch")
    ap.add_argument("--steps", type=int, default=4, help="measured steps per method (after 1 warm-up each)")
    ap.add_argument("--zero_stage", type=int, default=2)
    ap.add_argument("--methods", default="a,b,c")
    ap.add_argument("--no-record", action="store_true", help="print only; do not append to docs/benchmarks.md")
    ap.add_argument("--local_rank", type=int, default=0)
    args = ap.parse_args()

    import torch
    import torch.distributed as dist

    import dsrl

    rank, world, gpu, dtype = init_ranks()
    max_len = args.max_len or (4096 if gpu else 512)
    B = args.mini_batch or (64 * world if gpu else 16 * world)
    T = args.budget_factor * max_len
    m = T // max_len
    if B % (m * world):
        raise SystemExit(f"--mini_batch {B} must be a multiple of m * ranks = {m} * {world}")
    model = build_lm(args.size, max_len, dtype)
    if gpu and args.size == "0.5b":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    vocab = model.config.vocab_size
    cfg = {
        "zero_optimization": {"stage": args.zero_stage},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-6, "torch_adam": True}},
        "gradient_clipping": 1.0,
        "dsrl": {
            "batch": {"prompts_per_rollout": world, "samples_per_prompt": B // world, "mini_batch_size": B,
                      "max_tokens_per_micro_batch": T, "loss_agg": "token-mean"},
            "run": {"rollouts": 1000}, "data": {"max_prompt_tokens": 16},
            "rollout": {"max_new_tokens": max_len - 16},
        },
    }
    if gpu:
        cfg["bf16"] = {"enabled": True}
    rl = dsrl.initialize(model, cfg)

    def micro_batches(method: str, step: int) -> tuple[list[dict], int]:
        rng = np.random.default_rng(step)  # the same draw on every rank and for every method
        lens = rl_lengths(B, max_len, args.lengths, rng)
        order = rng.permutation(B).tolist()
        if method == "c":
            part = token_budget_micro_batches(order, lens, world, T)
        else:
            part = fixed_micro_batches(order, world, m)
        pad_to = int(lens.max()) if method == "a" else None
        out = [make_micro([int(lens[i]) for i in mb], pad_to, vocab, seed=step * 100003 + mb[0], device=rl.device)
               for mb in part[rank] if mb]
        for mb in out:
            mb["advantages"] = mb["advantages"].to(dtype)
        return out, int(lens.sum())

    def run_step(method: str, step: int) -> tuple[float, int]:
        micros, valid = micro_batches(method, step)
        if gpu:
            torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        rl.train_mini_batch(micros, per_token_nll)
        if gpu:
            torch.cuda.synchronize()
        dist.barrier()
        return time.perf_counter() - t0, valid

    methods = args.methods.split(",")
    for meth in methods:
        run_step(meth, 10_000)  # warm-up (allocator, kernels, buckets)
    rates: dict[str, list[float]] = {meth: [] for meth in methods}
    for step in range(args.steps):
        rot = step % len(methods)
        for meth in methods[rot:] + methods[:rot]:
            seconds, valid = run_step(meth, step)
            rates[meth].append(valid / seconds)
            if rank == 0:
                print(f"step {step} ({meth}): {seconds:.3f} s, {valid / seconds:,.0f} valid tokens/s", flush=True)
    if rank != 0:
        return
    med = {meth: float(np.median(r)) for meth, r in rates.items()}
    device = torch.cuda.get_device_name(0) if gpu else "CPU"
    row = [device, world, args.size, str(dtype).replace("torch.", ""), args.zero_stage, args.lengths, B, max_len, T,
           args.steps]
    row += [f"{med[meth]:,.0f}" for meth in methods]
    ratios = [f"{med['c'] / med[x]:.2f}x" for x in ("a", "b") if x in med and "c" in med]
    headers = ["device", "ranks", "model", "dtype", "ZeRO", "lengths", "B", "max len", "T", "steps"]
    headers += [f"tok/s ({meth})" for meth in methods] + [f"c/{x}" for x in ("a", "b") if x in med and "c" in med]
    body = ("Valid (unpadded) tokens per second, median over steps; methods interleaved step by step on the same "
            f"mini-batches. (a) fixed m={m} padded to the mini-batch's longest, (b) fixed m={m} padded per "
            "micro-batch, (c) dsrl token budget T with rank balancing.\n\n" + table(headers, [row + ratios]))
    report("Training throughput (bench/throughput.py)", body, dry_run=args.no_record)


if __name__ == "__main__":
    from dsrl.runtime.process_exit import leave

    main()
    leave(0)  # no interpreter finalization beside gloo threads (dsrl/runtime/process_exit.py)
