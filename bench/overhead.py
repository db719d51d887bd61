"""Step-time overhead of RLEngine.train_mini_batch over a hand-written raw DeepSpeed loop.

    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 bench/overhead.py      # CPU, 2 ranks (gloo)
    python bench/overhead.py --size small --device_batch 8           # 1 GPU (or 1 CPU rank)

Both methods train the same model shape from the same weights on the same micro-batches, in the
same process, with the same ZeRO stage, optimizer and clipping:

  raw:  DeepSpeed's managed accumulation (gradient_accumulation_steps = number of micro-batches),
        loss = token mean of each micro-batch, ``engine.backward(loss); engine.step()`` per micro-batch;
  dsrl: ``RLEngine.train_mini_batch`` (one count all-gather, exact weights, N backwards, one step).

The methods alternate in interleaved repetitions (the order flips every repetition) and the
median per-repetition ratio dsrl/raw is reported. Target: <= 1.02.
"""

from __future__ import annotations

import argparse
import copy
import time

import numpy as np
from _common import build_lm, init_ranks, make_micro, per_token_nll, report, rl_lengths, table

STEP_TARGET = 1.02


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="tiny", help="model shape: tiny | small | 0.5b")
    ap.add_argument("--zero_stage", type=int, default=2)
    ap.add_argument("--micro_batches", type=int, default=4, help="micro-batches per rank per step")
    ap.add_argument("--device_batch", type=int, default=4, help="sequences per micro-batch")
    ap.add_argument("--max_len", type=int, default=256)
    ap.add_argument("--reps", type=int, default=10, help="interleaved repetitions (after 2 warm-up steps each)")
    ap.add_argument("--no-record", action="store_true", help="print only; do not append to docs/benchmarks.md")
    ap.add_argument("--local_rank", type=int, default=0)
    args = ap.parse_args()

    import deepspeed
    import torch
    import torch.distributed as dist

    import dsrl

    rank, world, gpu, dtype = init_ranks()
    m, n_micro = args.device_batch, args.micro_batches
    B = m * n_micro * world
    base = {
        "zero_optimization": {"stage": args.zero_stage},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-5, "torch_adam": True}},
        "gradient_clipping": 1.0,
    }
    if gpu:
        base["bf16"] = {"enabled": True}
        base["data_types"] = {"grad_accum_dtype": "fp32"}
        base["communication_data_type"] = "fp32"
    model = build_lm(args.size, args.max_len, dtype)
    raw_model = copy.deepcopy(model)
    run = {**copy.deepcopy(base), "dsrl": {
        "batch": {"prompts_per_rollout": world, "samples_per_prompt": B // world, "mini_batch_size": B,
                  "micro_batch_size_per_rank": m, "loss_agg": "token-mean"},
        "run": {"rollouts": 1000}, "data": {"max_prompt_tokens": 16}, "rollout": {"max_new_tokens": args.max_len},
    }}
    rl = dsrl.initialize(model, run)
    raw_cfg = {**copy.deepcopy(base), "train_micro_batch_size_per_gpu": m, "gradient_accumulation_steps": n_micro,
               "train_batch_size": B}
    raw, _, _, _ = deepspeed.initialize(model=raw_model, model_parameters=raw_model.parameters(), config=raw_cfg)

    vocab = raw_model.config.vocab_size if hasattr(raw_model, "config") else 1024
    lens = rl_lengths(B, args.max_len, "lognormal", np.random.default_rng(0)).tolist()
    mine = lens[rank * m * n_micro:(rank + 1) * m * n_micro]
    micros = [make_micro(mine[i * m:(i + 1) * m], None, vocab, seed=1000 * rank + i, device=rl.device)
              for i in range(n_micro)]
    for mb in micros:
        mb["advantages"] = mb["advantages"].to(dtype)

    def dsrl_step() -> None:
        rl.train_mini_batch(micros, per_token_nll)

    def raw_step() -> None:
        for mb in micros:
            per_tok = per_token_nll(raw, mb)
            mask = mb["loss_mask"].to(per_tok.dtype)
            loss = (per_tok * mask).sum() / mask.sum().clamp(min=1)
            raw.backward(loss)
            raw.step()

    def timed(fn) -> float:
        if gpu:
            torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        if gpu:
            torch.cuda.synchronize()
        dist.barrier()
        return time.perf_counter() - t0

    for _ in range(2):
        timed(dsrl_step)
        timed(raw_step)
    t_d, t_r, ratios = [], [], []
    for rep in range(args.reps):
        order = (dsrl_step, raw_step) if rep % 2 == 0 else (raw_step, dsrl_step)
        got = {fn: timed(fn) for fn in order}
        t_d.append(got[dsrl_step])
        t_r.append(got[raw_step])
        ratios.append(t_d[-1] / t_r[-1])
    # every rank measured the same barrier-to-barrier wall time; report rank 0's
    if rank != 0:
        return
    med = float(np.median(ratios))
    ok = "yes" if med <= STEP_TARGET else "no"
    device = torch.cuda.get_device_name(0) if gpu else "CPU"
    rows = [[device, world, args.size, args.zero_stage, f"{n_micro} x {m}", args.max_len, args.reps,
             f"{1000 * np.median(t_r):.1f}", f"{1000 * np.median(t_d):.1f}", f"{med:.3f}",
             f"{np.percentile(ratios, 25):.3f}-{np.percentile(ratios, 75):.3f}", ok]]
    headers = ["device", "ranks", "model", "ZeRO", "micro-batches x seqs", "max len", "reps", "raw ms", "dsrl ms",
               "median ratio dsrl/raw", "IQR", "<= 1.02"]
    body = ("Same model, weights and micro-batches; methods interleaved (order flipped each repetition). "
            "ms = median step time.\n\n" + table(headers, rows))
    report("Step overhead vs raw DeepSpeed (bench/overhead.py)", body, dry_run=args.no_record)


if __name__ == "__main__":
    from dsrl.runtime.process_exit import leave

    main()
    leave(0)  # no interpreter finalization beside gloo threads (dsrl/runtime/process_exit.py)
