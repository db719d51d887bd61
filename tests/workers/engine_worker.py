"""Multi-process worker for tests/test_engine.py (launched by the deepspeed runner on CPU).

Modes:
  schedule  world 2, m=1, B=32 (16 micro-batches per rank per step), E=2, WarmupCosineLR: records the
            LR of every step, injects a NaN loss at one step (must be skipped and not advance the LR),
            checkpoints mid-run (``--stop_after K``) or resumes (``--resume``).
  nan       every ZeRO stage: a NaN loss on one rank skips the update on all ranks, weights stay finite.
  zero3     ZeRO-3 with unequal micro-batch counts: forward_no_grad + train_mini_batch complete.
"""

from __future__ import annotations

import argparse
import json
import math
import os

import torch
import torch.distributed as dist

import dsrl
from dsrl.checkpoint.engines import load_engines, save_engines
from dsrl.cli.check import collate, make_sequences, per_token_loss
from dsrl.cli.check_models import TinyCausalModel


def _config(stage: int, rollouts: int, E: int, out: str, sched: bool) -> dict:
    cfg = {
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": stage},
        "gradient_clipping": 0.0,
        "zero_allow_untested_optimizer": True,
        "dsrl": {
            "batch": {"prompts_per_rollout": 16, "samples_per_prompt": 2, "mini_batch_size": 32,
                      "epochs_per_rollout": E, "micro_batch_size_per_rank": 1, "loss_agg": "token-mean"},
            "run": {"rollouts": rollouts, "output_dir": out},
        },
    }
    if sched:
        cfg["scheduler"] = {"type": "WarmupCosineLR",
                            "params": {"warmup_num_steps": 3, "warmup_type": "linear",
                                       "warmup_min_ratio": 0.1, "cos_min_ratio": 0.05}}
    return cfg


def _nan_loss(model, micro):
    return per_token_loss(model, micro) * float("nan")


def run_schedule(args) -> dict:
    torch.manual_seed(0)
    eng = dsrl.initialize(TinyCausalModel(), _config(0, 4, 2, args.out, True))
    rank, world = dist.get_rank(), dist.get_world_size()
    assert eng.plan.micro_batches_per_step == 16 and eng.plan.total_optimizer_steps == 8
    start = 0
    if args.resume:
        tag, client, _ = load_engines(eng, args.out)
        assert tag is not None
        start = client["calls"]
    lrs, applied = [], []
    calls = start
    while eng.optimizer_steps < eng.plan.total_optimizer_steps:
        seqs = make_sequences(32, seed=calls)
        mine = seqs[rank * 16:(rank + 1) * 16]
        micros = [collate([s]) for s in mine]
        fn = _nan_loss if (calls == args.nan_at and rank == 1) else per_token_loss
        res = eng.train_mini_batch(micros, fn)
        calls += 1
        lrs.append(res["lr"])
        applied.append(res["step_applied"])
        if args.stop_after and eng.optimizer_steps == args.stop_after:
            save_engines(eng, args.out, f"step{eng.optimizer_steps}", client_state={"calls": calls})
            break
    finite = all(torch.isfinite(p).all() for p in eng.engine.module.parameters())
    return {"lrs": lrs, "applied": applied, "optimizer_steps": eng.optimizer_steps, "finite": bool(finite),
            "skipped": eng.skipped_steps, "world": world}


def run_nan(args) -> dict:
    out = {}
    for stage in (0, 1, 2, 3):
        torch.manual_seed(0)
        eng = dsrl.initialize(TinyCausalModel(), _config(stage, 1, 1, args.out, False))
        rank = dist.get_rank()
        seqs = make_sequences(32, seed=1)
        micros = [collate([s]) for s in seqs[rank * 16:(rank + 1) * 16]]
        with _gathered(eng, stage):
            before = [p.detach().clone() for p in eng.engine.module.parameters()]
        res = eng.train_mini_batch(micros, _nan_loss if rank == 1 else per_token_loss)
        lr_steps = eng.scheduler.steps
        with _gathered(eng, stage):
            params = [p.detach().clone() for p in eng.engine.module.parameters()]
        finite = all(torch.isfinite(p).all().item() for p in params)
        unchanged = all(torch.equal(a, b) for a, b in zip(before, params))
        # A zero-token mini-batch afterwards: zero loss, no NaN, weights unchanged.
        empty = [collate([s]) for s in make_sequences(16, seed=2, empty=True)]
        res2 = eng.train_mini_batch(empty, per_token_loss)
        with _gathered(eng, stage):
            after = [p.detach().clone() for p in eng.engine.module.parameters()]
        # Then a finite mini-batch from the same (unchanged) weights: every stage reports its gradient norm.
        res3 = eng.train_mini_batch(micros, per_token_loss)
        out[stage] = {"skipped": res["skipped_nonfinite"], "applied": res["step_applied"], "finite": finite,
                      "unchanged": unchanged, "lr_steps": lr_steps,
                      "empty_loss": res2["loss"], "empty_tokens": res2["tokens"],
                      "empty_unchanged": all(torch.equal(a, b) for a, b in zip(params, after)),
                      "grad_norm": res3["grad_norm"]}
    return out


class _gathered:
    def __init__(self, eng, stage):
        self.ctx = None
        if stage == 3:
            import deepspeed

            self.ctx = deepspeed.zero.GatheredParameters(list(eng.engine.module.parameters()))

    def __enter__(self):
        if self.ctx:
            self.ctx.__enter__()

    def __exit__(self, *exc):
        if self.ctx:
            self.ctx.__exit__(*exc)


def run_zero3(args) -> dict:
    torch.manual_seed(0)
    eng = dsrl.initialize(TinyCausalModel(), _config(3, 1, 1, args.out, False))
    rank = dist.get_rank()
    seqs = make_sequences(32, seed=3)
    mine = seqs[:5] if rank == 0 else seqs[5:32]  # 5 vs 27 sequences
    micros = [collate(mine[i:i + 4]) for i in range(0, len(mine), 4)]  # 2 vs 7 micro-batches
    grad_seen = []  # forward_no_grad runs fn without autograd: no output keeps a graph (and activations)

    def no_grad_fn(m, mb):
        out = per_token_loss(m, mb)
        grad_seen.append(torch.is_grad_enabled() or out.requires_grad)
        return out.sum().item()

    logps = eng.forward_no_grad(micros, no_grad_fn)
    res = eng.train_mini_batch(micros, per_token_loss)
    return {"n_micro": len(micros), "n_logps": len(logps), "applied": res["step_applied"],
            "fillers": res["filler_micro_batches"], "loss_finite": math.isfinite(res["loss"]),
            "no_grad_forwards": len(grad_seen), "grad_enabled_forwards": sum(grad_seen)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--nan_at", type=int, default=-1)
    p.add_argument("--stop_after", type=int, default=0)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--local_rank", type=int, default=0)
    args = p.parse_args()
    result = {"schedule": run_schedule, "nan": run_nan, "zero3": run_zero3}[args.mode](args)
    rank = dist.get_rank()
    with open(os.path.join(args.out, f"result_{args.mode}_{'resume' if args.resume else 'run'}_{rank}.json"),
              "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    from dsrl.runtime.process_exit import leave

    main()
    leave(0)  # no interpreter finalization beside gloo threads (dsrl/runtime/process_exit.py)
