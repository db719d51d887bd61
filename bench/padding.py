"""Padding and rank balance of micro-batching strategies on RL-shaped length distributions.

    python bench/padding.py            # full grid (~1 min on one CPU core)
    python bench/padding.py --quick    # a few rows

For each scenario (length distribution, mini-batch size B, ranks D, max length L) it draws
mini-batches and compares, under the same activation-memory bound (a micro-batch may hold at most
T = 2 L token slots, so fixed mode uses m = T // L = 2 sequences):

  (a) fixed micro-batches of m sequences padded to the mini-batch's longest sequence;
  (b) fixed micro-batches of m sequences, each padded to its own longest;
  (c) dsrl token budget T with rank balancing (dsrl.core.partition.token_budget_micro_batches).

Columns: padded-token fraction, max/mean rank load (token slots), micro-batches per step, and the
step-cost ratio max-rank-load(a or b) / max-rank-load(c) (the compute-bound speed-up of (c)).
Targets for (c): padding <= 3 % and max/mean load <= 1.05.
"""

from __future__ import annotations

import argparse
import itertools
import time

import numpy as np
from _common import report, rl_lengths, table

from dsrl.core.partition import fixed_micro_batches, partition_stats, token_budget_micro_batches

PAD_TARGET, LOAD_TARGET = 0.03, 1.05


def fixed_global_pad(n: int, dp: int, m: int, lens: np.ndarray) -> dict:
    """(a): every micro-batch padded to the longest sequence of the whole mini-batch."""
    longest = int(lens.max())
    slots = n * longest
    return {"padding_fraction": 1 - lens.sum() / slots, "max_over_mean_load": 1.0,
            "max_rank_load": slots / dp, "micro_batches_per_step": n // (m * dp)}


def scenario(kind: str, B: int, dp: int, max_len: int, draws: int, seed: int) -> dict:
    T, m = 2 * max_len, 2
    rng = np.random.default_rng(seed)
    acc: dict[str, list] = {}
    took = []
    for _ in range(draws):
        lens = rl_lengths(B, max_len, kind, rng)
        order = rng.permutation(B).tolist()
        a = fixed_global_pad(B, dp, m, lens)
        b = partition_stats(fixed_micro_batches(order, dp, m), lens)
        t0 = time.perf_counter()
        c = partition_stats(token_budget_micro_batches(order, lens, dp, T), lens)
        took.append(time.perf_counter() - t0)
        # No partition beats max(longest sequence, mean real load) on its most loaded rank.
        acc.setdefault("bound", []).append(max(lens.max(), lens.sum() / dp) / (lens.sum() / dp))
        for name, st in (("a", a), ("b", b), ("c", c)):
            for key in ("padding_fraction", "max_over_mean_load", "micro_batches_per_step", "max_rank_load"):
                acc.setdefault(f"{name}.{key}", []).append(st[key])
    out = {k: float(np.mean(v)) for k, v in acc.items()}
    out["speedup_a"] = float(np.mean(np.array(acc["a.max_rank_load"]) / np.array(acc["c.max_rank_load"])))
    out["speedup_b"] = float(np.mean(np.array(acc["b.max_rank_load"]) / np.array(acc["c.max_rank_load"])))
    out["ms"] = 1000 * float(np.median(took))
    out["c.max_pad"] = float(np.max(acc["c.padding_fraction"]))
    out["c.max_load"] = float(np.max(acc["c.max_over_mean_load"]))
    out["bound_max"] = float(np.max(acc["bound"]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a handful of scenarios")
    ap.add_argument("--draws", type=int, default=4, help="mini-batches drawn per scenario")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-record", action="store_true", help="print only; do not append to docs/benchmarks.md")
    args = ap.parse_args()

    grid = list(itertools.product(("lognormal", "bimodal"), (256, 1024), (8, 64), (1024, 8192, 32768)))
    if args.quick:
        grid = [("lognormal", 256, 8, 8192), ("bimodal", 1024, 64, 32768), ("lognormal", 1024, 8, 1024)]
    rows, met = [], 0
    for i, (kind, B, dp, L) in enumerate(grid):
        r = scenario(kind, B, dp, L, args.draws, args.seed + i)
        ok = r["c.max_pad"] <= PAD_TARGET and r["c.max_load"] <= LOAD_TARGET
        met += ok
        verdict = "yes" if ok else ("no: longest sequence bounds load" if r["bound"] > LOAD_TARGET else "no")
        rows.append([
            kind, B, dp, L, 2 * L,
            f"{r['a.padding_fraction']:.1%}", f"{r['b.padding_fraction']:.1%}", f"{r['c.padding_fraction']:.1%}",
            f"{r['b.max_over_mean_load']:.3f}", f"{r['c.max_over_mean_load']:.3f}", f"{r['bound']:.3f}",
            f"{r['a.micro_batches_per_step']:.0f}", f"{r['c.micro_batches_per_step']:.1f}",
            f"{r['speedup_a']:.2f}x", f"{r['speedup_b']:.2f}x", f"{r['ms']:.0f}", verdict,
        ])
        print(" ".join(str(c) for c in rows[-1]), flush=True)
    headers = ["lengths", "B", "D", "max len L", "T", "pad (a)", "pad (b)", "pad (c)", "load (b)", "load (c)",
               "load bound", "mb/step (a,b)", "mb/step (c)", "cost a/c", "cost b/c", "plan ms (c)", "(c) targets met"]
    body = (
        f"{args.draws} mini-batches per row, averaged. (a) fixed m=2 padded to the mini-batch's longest, (b) fixed "
        "m=2 padded per micro-batch, (c) dsrl token budget T = 2L with rank balancing. load = max/mean rank load "
        "in token slots; load bound = max(longest sequence, mean load) / mean load, which no partition can beat; "
        "cost x/c = max rank load of x over that of (c). Targets for (c): padding <= 3 % and "
        f"load <= 1.05 in every draw: met in {met}/{len(grid)} rows.\n\n" + table(headers, rows)
    )
    report("Padding and rank balance (bench/padding.py)", body, dry_run=args.no_record)


if __name__ == "__main__":
    main()
