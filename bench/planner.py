"""How long dsrl.core.partition takes to plan one mini-batch (pure CPU, one process).

    python bench/planner.py            # 65,536 sequences over 1,024 ranks, plus smaller cases

Every rank plans the whole mini-batch itself (no communication), so planning sits on the critical
path of each optimizer step. Target: < 1 s for 1,024 ranks x 65,536 sequences. For context each row
also times a plain sort-and-deal baseline (sequences sorted by length, dealt round-robin to ranks,
cut greedily to the budget) and reports both partitions' padding and max/mean rank load.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from _common import report, rl_lengths, table

from dsrl.core.partition import partition_stats, token_budget_micro_batches

TARGET_S = 1.0


def round_robin(lens: np.ndarray, dp: int, budget: int) -> list:
    """Baseline: deal length-sorted sequences round-robin, cut each rank greedily, pad counts."""
    order = np.argsort(-lens, kind="stable")
    out = []
    for r in range(dp):
        mine, micro, cur = order[r::dp].tolist(), [], []
        for i in mine:
            if cur and (len(cur) + 1) * lens[cur[0]] > budget:
                micro.append(cur)
                cur = []
            cur.append(i)
        out.append(micro + ([cur] if cur else []))
    n = max(len(m) for m in out)
    return [m + [[]] * (n - len(m)) for m in out]


def timed(reps: int, fn, *args) -> tuple[float, object]:
    times, result = [], None
    for _ in range(reps):
        t0 = time.perf_counter()
        result = fn(*args)
        times.append(time.perf_counter() - t0)
    return float(np.median(times)), result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3, help="repetitions per case (median reported)")
    ap.add_argument("--no-record", action="store_true", help="print only; do not append to docs/benchmarks.md")
    args = ap.parse_args()
    cases = [(1024, 64, 8192), (8192, 256, 8192), (65536, 1024, 8192), (65536, 1024, 32768)]
    rows = []
    for i, (n, dp, max_len) in enumerate(cases):
        budget = 2 * max_len
        lens = rl_lengths(n, max_len, "lognormal", np.random.default_rng(i))
        idx = list(range(n))
        t_dsrl, part = timed(args.reps, token_budget_micro_batches, idx, lens, dp, budget)
        t_rr, base = timed(args.reps, round_robin, lens, dp, budget)
        st, sb = partition_stats(part, lens), partition_stats(base, lens)
        target = f"{'yes' if t_dsrl < TARGET_S else 'no'}" if (n, dp) == (65536, 1024) else "-"
        rows.append([n, dp, max_len, budget, f"{t_dsrl:.3f}", f"{t_rr:.3f}", f"{t_dsrl / t_rr:.1f}x",
                     f"{st['padding_fraction']:.2%}", f"{sb['padding_fraction']:.2%}",
                     f"{st['max_over_mean_load']:.3f}", f"{sb['max_over_mean_load']:.3f}",
                     st["micro_batches_per_step"], sb["micro_batches_per_step"], target])
        print(" ".join(str(c) for c in rows[-1]), flush=True)
    headers = ["sequences", "ranks", "max len", "T", "dsrl s", "sort-deal s", "time ratio", "pad dsrl",
               "pad sort-deal", "load dsrl", "load sort-deal", "mb/step dsrl", "mb/step sort-deal", "< 1 s"]
    body = (f"Median of {args.reps} runs per row; log-normal lengths, budget T = 2 x max len. 'sort-deal' is the "
            "baseline described in bench/planner.py. Target: dsrl < 1 s at 65,536 x 1,024.\n\n" + table(headers, rows))
    report("Planner time (bench/planner.py)", body, dry_run=args.no_record)


if __name__ == "__main__":
    main()
