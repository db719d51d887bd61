"""``rollout.backend = "auto"`` against both backends it chooses between, in the training loop: over a grid of
workloads, dsrl's own ``Trainer.run()`` generates with ``hf`` and with ``cb`` turn about, and each cell reports the
generation seconds per rollout of each backend and what ``auto`` picks there.

    python bench/auto_grid.py                 # the CPU grid (33 cells, about 35 minutes on 2 shared cores)
    python bench/auto_grid.py --quick         # 8 of its cells, the corners (about 6 minutes)
    python bench/auto_grid.py --device cuda   # the GPU cells (bench/gpu/measure.py's auto-grid part: 0.5B shape, bf16)
    python bench/auto_grid.py --smoke --no-record   # two tiny cells, one pair each (the test suite)
    python bench/auto_grid.py --shapes tiny --concurrency 8 64 --max_new_tokens 8 32   # any sub-grid

A cell is (model shape, concurrency C, ``max_new_tokens`` L). It runs the real trainer (what ``launch/train.py``
runs: one process, ZeRO-1, GRPO on the built-in ``reverse`` task) with the benchmark's model in place of the one it
would build (bench/_common.py ``long_tailed_model``: a random-weight Qwen2 whose head gives eos a constant
probability 1/mean per step, so completion lengths are geometric and long-tailed, some cut at L, as RL completions
are). C/G prompts x G = 4 samples per rollout and ``generation_batch_size`` = all of them: every rollout is one
generate call of C concurrent sequences, the run's largest call as ``auto`` sees it. The run file names
``rollout.backend = "auto"``; the benchmark makes that backend (:class:`dsrl.rollout.auto.AutoRolloutBackend`,
which holds an ``hf`` and a ``cb`` backend on the same policy) follow a schedule instead of its rule: rollouts 1-2
are warm-ups (``hf``, then ``cb``: its manager, paged cache and first forwards), then pairs in alternating order (hf
cb, cb hf, ...), so that drift and other jobs' load fall on both alike. Everything else (training between calls,
DeepSpeed's hooks kept out of generation, the process's heap, the kept ``cb`` manager) is the training loop's own.

Per rollout the figure is ``phase_generate_s`` of the trainer's metrics rows (dsrl/runtime/phases.py). Per cell:
each backend's **median** seconds over its timed rollouts, and cb/hf as the **median of the per-pair ratios** (the
two rollouts of a pair run back to back, so a burst of load mostly hits one pair, which the median discards), with
their range. ``auto`` is :meth:`AutoRolloutBackend.decision` for the run (a pure function of the run file and the
model), and "auto/faster" the pair-ratio median of its pick over the other backend, 1.00 where it picked the faster
(the target: <= 1.10). Each generate call's process CPU seconds (every thread's; cb's caller only waits while its
generation thread works), summed per backend over the timed rollouts, give what the calls take on a core of their
own: on cores shared with other jobs a sub-second call's wall seconds mostly measure its waits for a core, so the
table shows both. Nothing asserts on time. Cells run one per process on the CPU (a fresh heap each); on a GPU
all cells share one process (one start-up: the loan's minutes are few).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from _common import SHAPES, bench_env, report, rollout_rows, run_process, table

G = 4  # samples per prompt
MEAN_LEN = {8: 12.0, 16: 12.0, 32: 12.0, 64: 16.0, 256: 32.0}  # eos probability 1/mean per step, per L
TARGET = 1.10  # auto's pick within 10 % of the faster backend
# The CPU grid: every (C, L) of the tiny model; the 26.5 M shape where one rollout stays within a minute on 2
# shared cores (at C = 512 x 64 and C >= 128 x 256, hf's generation alone takes 40 s and more per rollout, and cb
# is already 2-3x faster at the neighbouring cells); where the rule's bounds lie: 16 and 32 new tokens on the tiny
# model, 8 on the 4.2 M shape.
CPU_GRID = ([("tiny", c, m) for m in (8, 64, 256) for c in (8, 32, 128, 512)]
            + [("scaled", c, 8) for c in (8, 32, 128, 512)] + [("scaled", c, 64) for c in (8, 32, 128)]
            + [("scaled", c, 256) for c in (8, 32)]
            + [("tiny", c, m) for m in (16, 32) for c in (8, 32, 128, 512)]
            + [("mid", c, 8) for c in (8, 32, 128, 512)])
QUICK = [("tiny", 8, 8), ("tiny", 512, 8), ("tiny", 8, 64), ("tiny", 512, 256), ("mid", 8, 8), ("mid", 128, 8),
         ("scaled", 8, 8), ("scaled", 32, 64)]
SMOKE = [("tiny", 8, 8), ("tiny", 16, 16)]
GPU_SHAPE = "0.5b"
# most telling first (one process shares the part's bound): the measured cell in the loop, then the bounds it sets
GPU_GRID = [(GPU_SHAPE, 128, 256), (GPU_SHAPE, 128, 8), (GPU_SHAPE, 32, 256), (GPU_SHAPE, 512, 8),
            (GPU_SHAPE, 32, 8), (GPU_SHAPE, 512, 256)]


@dataclass
class Cell:
    """One workload of the grid."""

    shape: str
    concurrency: int  # C: sequences decoding at once (C/G prompts x G samples, one call per rollout)
    max_new_tokens: int
    mean_len: float
    pairs: int  # timed (hf, cb) pairs after the two warm-up rollouts
    device: str = "cpu"
    seed: int = 0

    @property
    def prompts(self) -> int:
        return max(1, self.concurrency // G)

    @property
    def schedule(self) -> list[str]:
        """The backend of each rollout: two warm-ups, then pairs in alternating order."""
        out = ["hf", "cb"]
        for k in range(self.pairs):
            out += ["hf", "cb"] if k % 2 == 0 else ["cb", "hf"]
        return out


def pairs_for(shape: str, c: int, mnt: int, device: str) -> int:
    """Timed pairs per cell: many where a rollout takes a fraction of a second (one burst of other jobs' load can
    double such a rollout), few where it takes tens of seconds."""
    if device != "cpu":
        return 2
    scale = {"tiny": 1, "tiny32": 1, "mid": 30, "scaled": 190}.get(shape, 190)  # ~ parameters / the tiny model's
    work = c * (16 + MEAN_LEN.get(mnt, mnt / 4)) * scale  # ~ tokens x parameters of one rollout
    return 16 if work <= 2_000 else 8 if work <= 20_000 else 4 if work <= 200_000 else 2


def run_file(cell: Cell, run_dir: str) -> dict[str, Any]:
    """A cell's run file: names ``rollout.backend = "auto"`` (the benchmark then schedules it)."""
    r = cell.prompts * G
    micro = min(r, 16)
    return {
        "zero_optimization": {"stage": 1},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-6, "torch_adam": True}},
        "gradient_clipping": 1.0,
        "steps_per_print": 1 << 30,
        "dsrl": {
            "batch": {"prompts_per_rollout": cell.prompts, "samples_per_prompt": G, "mini_batch_size": r,
                      "micro_batch_size_per_rank": micro},
            "run": {"rollouts": len(cell.schedule), "output_dir": run_dir, "seed": cell.seed, "save_final": False,
                    "progress_bar": False, "log_every": 1 << 20},
            "model": {"arch": "qwen2"},
            "data": {"task": "reverse", "size": 512, "max_prompt_tokens": 16},
            "rollout": {"backend": "auto", "max_new_tokens": cell.max_new_tokens, "temperature": 1.0,
                        "generation_batch_size": cell.prompts, "logprob_micro_batch_size": micro},
            "algorithm": {"name": "grpo"},
        },
    }


# -- the worker: cells in one process ---------------------------------------------------------------------------


def run_cells(cells: list[Cell], out_dir: str) -> None:
    """Each cell's trainer in turn, its ``auto`` backend following the cell's schedule; writes the pick and the
    backends served to ``out_dir/cell<i>.json`` (the seconds are the metrics rows of ``out_dir/run<i>``)."""
    from _common import long_tailed_model

    import dsrl.rl.policy.model
    from dsrl.rl.trainer import Trainer
    from dsrl.rollout.auto import AutoRolloutBackend

    state: dict[str, Any] = {}

    def scheduled(self: AutoRolloutBackend, num_prompts: int, samples_per_prompt: int) -> Any:
        schedule, served = state["schedule"], state["served"]
        name = schedule[min(len(served), len(schedule) - 1)]
        served.append(name)
        if self.cb is None:
            raise RuntimeError("continuous batching is unavailable here (transformers too old?)")
        return self.cb if name == "cb" else self.hf

    generate = AutoRolloutBackend.generate

    def timed(self: AutoRolloutBackend, *args: Any, **kwargs: Any) -> Any:
        """The call's process CPU seconds (every thread's: cb generates in a thread of its own while the caller
        waits) beside its wall seconds."""
        c0, t0 = time.process_time(), time.perf_counter()
        out = generate(self, *args, **kwargs)
        state["calls"].append({"cpu_s": time.process_time() - c0, "wall_s": time.perf_counter() - t0})
        return out

    AutoRolloutBackend.choose = scheduled  # the benchmark's schedule in place of the rule, in this process only
    AutoRolloutBackend.generate = timed
    for i, cell in enumerate(cells):
        dtype = "float32" if cell.device == "cpu" else "bfloat16"
        model = long_tailed_model(cell.shape, cell.mean_len, "cpu", dtype)
        dsrl.rl.policy.model.build_model = lambda *a, model=model, **k: model  # the benchmark's model
        state.update(schedule=cell.schedule, served=[], calls=[])
        out = Path(out_dir, f"cell{i}.json")
        trainer = Trainer.from_config(run_file(cell, str(Path(out_dir, f"run{i}"))))
        backend = trainer.parts.backend
        if not isinstance(backend, AutoRolloutBackend):
            raise RuntimeError(f"the trainer built {type(backend).__name__}, not the auto backend")
        decision = backend.decision(cell.prompts, G)
        info = {"auto": decision.backend, "reason": decision.reason, "parameters": backend.num_params,
                "served": state["served"], "calls": state["calls"]}
        out.write_text(json.dumps(info))
        trainer.run()
        out.write_text(json.dumps(info))


# -- the driver -------------------------------------------------------------------------------------------------


def cell_result(cell: Cell, info: dict[str, Any], rows: list[dict[str, Any]]) -> dict[str, Any]:
    """A cell's timed rollouts: per backend its generation seconds and mean completion lengths, and the pairs."""
    schedule = cell.schedule
    by_rollout = {row["rollout"] - 1: row for row in rows}  # rows count rollouts from 1
    calls = info.get("calls") or []
    seconds: dict[str, list[float]] = {"hf": [], "cb": []}
    lengths: dict[str, list[float]] = {"hf": [], "cb": []}
    pairs, cpu_pairs = [], []
    for k in range(cell.pairs):
        a, b = 2 + 2 * k, 3 + 2 * k
        if a not in by_rollout or b not in by_rollout:
            break
        pairs.append({schedule[r]: by_rollout[r]["phase_generate_s"] for r in (a, b)})
        if b < len(calls):
            cpu_pairs.append({schedule[r]: calls[r]["cpu_s"] for r in (a, b)})
        for r in (a, b):
            seconds[schedule[r]].append(by_rollout[r]["phase_generate_s"])
            lengths[schedule[r]].append(by_rollout[r]["response_len"])
    served = info.get("served") or []
    if served != schedule[:len(served)]:
        raise RuntimeError(f"the backends served {served} do not follow the schedule {schedule}")
    return {"cell": asdict(cell), "seconds": seconds, "mean_len": lengths, "pairs": pairs, "cpu_pairs": cpu_pairs,
            **{k: v for k, v in info.items() if k not in ("served", "calls")}}


def measure(cells: list[Cell], timeout: float) -> list[dict[str, Any]]:
    """``cells`` in one fresh process (at most ``timeout`` seconds): one result per cell, with ``status``."""
    with tempfile.TemporaryDirectory(prefix="auto_grid_") as tmp:
        cmd = [sys.executable, __file__, "--worker", json.dumps([asdict(c) for c in cells]), "--out", tmp]
        done = run_process(cmd, env=bench_env(cells[0].device, one_rank=True), timeout=timeout)
        status, error = done.status, (done.output.strip()[-3000:] if done.status == "failed" else "")
        wall = done.seconds
        results = []
        for i, cell in enumerate(cells):
            try:
                info = json.loads(Path(tmp, f"cell{i}.json").read_text())
            except (OSError, json.JSONDecodeError):
                info = {}
            r = cell_result(cell, info, rollout_rows(Path(tmp, f"run{i}")))
            done = len(r["pairs"]) == cell.pairs
            r.update(status="ok" if done else status if status != "ok" else "incomplete",
                     error="" if done else error, wall_s=wall / len(cells))
            results.append(r)
    return results


def _ratio(pairs: list[dict[str, float]], auto: str, total: bool = False) -> dict[str, Any] | None:
    """cb/hf as the median of the per-pair ratios (``total``: the ratio of the summed seconds), the per-pair range,
    and auto's pick over the other backend (1.00 where the pick is the faster)."""
    ratios = [p["cb"] / p["hf"] for p in pairs if p.get("hf")]
    if not ratios:
        return None
    ratio = sum(p["cb"] for p in pairs) / sum(p["hf"] for p in pairs) if total else statistics.median(ratios)
    best = "cb" if ratio < 1 else "hf"
    return {"cb_over_hf": ratio, "range": (min(ratios), max(ratios)), "best": best,
            "auto_over_best": 1.0 if auto == best else max(ratio, 1 / ratio)}


def summarize(result: dict[str, Any]) -> dict[str, Any] | None:
    """Per backend the median wall seconds; wall and CPU cb/hf with auto's pick over the faster (None without a
    timed pair or a pick)."""
    if not result["pairs"] or "auto" not in result:
        return None
    s = result["seconds"]
    return {"hf": statistics.median(s["hf"]), "cb": statistics.median(s["cb"]), "auto": result["auto"],
            "wall": _ratio(result["pairs"], result["auto"]), "cpu": _ratio(result.get("cpu_pairs", []),
                                                                          result["auto"], total=True),
            "len": statistics.mean(result["mean_len"]["hf"] + result["mean_len"]["cb"]),
            "pairs": len(result["pairs"])}


def _fmt(r: dict[str, Any] | None) -> tuple[str, str]:
    if r is None:
        return "-", "-"
    over = f"{r['auto_over_best']:.2f}" + ("" if r["auto_over_best"] <= TARGET else " (missed)")
    return f"{r['cb_over_hf']:.2f} ({r['range'][0]:.2f}-{r['range'][1]:.2f})", over


def grid_table(results: list[dict[str, Any]]) -> str:
    rows = []
    for r in results:
        c = r["cell"]
        s = summarize(r)
        params = f"{r['parameters'] / 1e6:.2g} M" if r.get("parameters") else "-"
        head = [c["shape"], params, c["concurrency"], c["max_new_tokens"]]
        if s is None:
            rows.append(head + [r["status"]] + [""] * 8)
            continue
        wall, wall_over = _fmt(s["wall"])
        cpu, cpu_over = _fmt(s["cpu"])
        rows.append(head + [f"{s['len']:.1f}", f"{s['hf']:.3f}", f"{s['cb']:.3f}", wall, cpu, str(s["pairs"]),
                            s["auto"], wall_over, cpu_over])
    return table(["shape", "params", "C", "L", "mean len", "hf s", "cb s", "cb/hf wall (range)", "cb/hf CPU (range)",
                  "pairs", "auto", "auto/faster wall", "auto/faster CPU"], rows)


def cells_of(args: argparse.Namespace) -> list[Cell]:
    if args.smoke:
        triples = SMOKE
    elif args.device != "cpu":
        triples = GPU_GRID
    elif args.quick:
        triples = QUICK
    elif args.shapes or args.concurrency or args.max_new_tokens:
        triples = [(s, c, m) for s in (args.shapes or ["tiny", "scaled"]) for m in (args.max_new_tokens or [8, 64, 256])
                   for c in (args.concurrency or [8, 32, 128, 512])]
    else:
        triples = CPU_GRID
    pairs = 1 if args.smoke else args.pairs
    return [Cell(s, c, m, MEAN_LEN.get(m, m / 4), pairs or pairs_for(s, c, m, args.device), args.device)
            for s, c, m in triples]


def describe(device: str) -> str:
    import torch
    import transformers

    threads = os.environ.get("OMP_NUM_THREADS", "1") if device == "cpu" else "-"
    return (f"{device}, {'float32' if device == 'cpu' else 'bfloat16'}, torch {torch.__version__}, transformers "
            f"{transformers.__version__}, {threads} torch thread(s). Each cell: dsrl's Trainer (ZeRO-1, GRPO, "
            f"`reverse` prompts of <= 16 tokens), C/{G} prompts x G = {G} samples per rollout in one generate call "
            "of C sequences, L = max_new_tokens, eos probability 1/mean per step (mean "
            + ", ".join(f"{m:g} at L = {n}" for n, m in MEAN_LEN.items()) + "); 2 warm-up rollouts (hf, cb), then "
            "hf and cb in alternating pairs. hf s / cb s: median `phase_generate_s` (the trainer's metrics rows) "
            "over each backend's timed rollouts; cb/hf: median of the per-pair ratios (range over pairs); auto: "
            "what `rollout.backend = \"auto\"` picks for the run; auto/faster: the pair-ratio median of its pick "
            "over the other backend, 1.00 where it picked the faster. cb/hf CPU: the generate calls' process CPU "
            "seconds (every thread's: cb generates on a thread of its own while the caller waits, ~2 ms of its "
            "CPU), summed over the timed rollouts of each backend (the per-pair range beside it): what the calls "
            "take on a core of their own, where the wall seconds of sub-second calls on shared cores mostly measure "
            "waits for a core; summed because completion lengths are sampled, so single rollouts vary with them.")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu", help="cpu | cuda")
    ap.add_argument("--shapes", nargs="+", default=None, choices=list(SHAPES), help="a sub-grid: these shapes ...")
    ap.add_argument("--concurrency", nargs="+", type=int, default=None, help="... these C ...")
    ap.add_argument("--max_new_tokens", nargs="+", type=int, default=None, help="... and these L")
    ap.add_argument("--pairs", type=int, default=None, help="timed (hf, cb) pairs per cell (default: by cell size)")
    ap.add_argument("--quick", action="store_true", help="8 cells of the CPU grid: its corners")
    ap.add_argument("--smoke", action="store_true", help="two tiny cells, one pair each (never records)")
    ap.add_argument("--cell_timeout", type=float, default=600.0, help="seconds per cell (on a GPU: for all cells)")
    ap.add_argument("--json", default=None, help="also write the results here (rewritten after every cell)")
    ap.add_argument("--no-record", dest="no_record", action="store_true")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        cells = [Cell(**c) for c in json.loads(args.worker)]
        if cells[0].device == "cpu":
            os.environ["DS_ACCELERATOR"] = "cpu"
        run_cells(cells, args.out)
        return
    cells = cells_of(args)
    groups = [cells] if args.device != "cpu" else [[c] for c in cells]  # GPU: one start-up for every cell
    results: list[dict[str, Any]] = []
    t0 = time.perf_counter()
    for group in groups:
        for r in measure(group, args.cell_timeout):
            results.append(r)
            c, s = r["cell"], summarize(r)
            line = (f"hf {s['hf']:.3f} s, cb {s['cb']:.3f} s, cb/hf wall {_fmt(s['wall'])[0]} CPU "
                    f"{_fmt(s['cpu'])[0]}, auto {s['auto']} (over the faster: wall {_fmt(s['wall'])[1]}, CPU "
                    f"{_fmt(s['cpu'])[1]})" if s else r["status"] + (": " + r["error"][-600:] if r["error"] else ""))
            print(f"[{time.perf_counter() - t0:.0f} s] {c['shape']} C={c['concurrency']} L={c['max_new_tokens']}: "
                  f"{line}", flush=True)
        if args.json:
            tmp = args.json + ".tmp"
            Path(tmp).write_text(json.dumps({"device": args.device, "results": results}, indent=1))
            os.replace(tmp, args.json)
    body = describe(args.device) + "\n\n" + grid_table(results)
    summaries = [summarize(r) for r in results]
    met = {m: sum(1 for s in summaries if s and s[m] and s[m]["auto_over_best"] <= TARGET) for m in ("wall", "cpu")}
    body += (f"\n\nauto within {TARGET - 1:.0%} of the faster backend in {met['wall']} of {len(results)} cells by "
             f"wall seconds, {met['cpu']} by CPU seconds; {time.perf_counter() - t0:.0f} s in all.")
    report("The auto backend in the training loop: hf vs cb over a grid (bench/auto_grid.py)", body,
           args.no_record or args.smoke)


if __name__ == "__main__":
    main()
