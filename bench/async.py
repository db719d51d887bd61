"""Colocated vs disaggregated GRPO (rollout.placement, docs/async.md): the same work, side by side in one run.

    python bench/async.py                       # CPU: 2 ranks, colocated vs 1 trainer + 1 generator, k = 0, 1, 2
    python bench/async.py --rollouts 8 --no-record
    python bench/async.py --device cuda --trainers 4 --generators 4 --shape 0.5b   # a GPU node (not run yet)

Every mode runs ``launch/train.py`` on the same run file (the built-in task, the same model, prompts, P, G, B, E,
seeds; no warm-up, so every rollout is RL) and the same number of ranks: ``--trainers + --generators`` processes
colocated (each generates and trains) and disaggregated (``--generators`` only generate) with
``algorithm.max_staleness`` k = 0, 1, 2 (and TIS for k > 0). From each run's metrics.jsonl, over the rollouts after
``--skip``: wall seconds per rollout (from rank 0's ``elapsed_s``), generation seconds (the generators' reported
time; colocated: the experience phase), training seconds, the trainers' wait for samples as a fraction of the wall
time, and the generators' idle fraction. The overlap efficiency is the k = 1 wall time over max(generation,
training) of the same roles measured without overlap (k = 0); target <= 1.1.

The projection to a GPU cluster takes per-rollout phase times measured on one GPU (default: the H100 round's
0.5B-shape e2e, docs/benchmarks.md) and a stated pipeline model: each phase's time scales as 1 / devices^a;
colocated pays (G + T) / W^a, disaggregated with k >= 1 pays max(G / N_g^a, T / N_t^a) + the weight sync (bf16
weights over the sync bandwidth) at the best split N_g + N_t = W.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from _common import REPO, bench_env, report, run_process, table

SHAPES = {
    # generation and training of comparable cost on one CPU thread
    "cpu": {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
            "num_key_value_heads": 2},
    "0.5b": {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
             "num_key_value_heads": 2},
}


def run_file(args: argparse.Namespace, placement: str, k: int, tmp: Path) -> Path:
    raw = json.loads((REPO / "configs" / "tiny_grpo_cpu.json").read_text())
    d = raw["dsrl"]
    d["model"]["tiny"] = {**d["model"]["tiny"], **SHAPES[args.shape],
                          "rope_parameters": {"rope_theta": 100.0, "rope_type": "default"}}
    d["batch"].update(prompts_per_rollout=args.prompts, samples_per_prompt=args.samples, mini_batch_size=args.prompts *
                      args.samples // args.steps, max_tokens_per_micro_batch=1024)
    d["rollout"].update(max_new_tokens=args.max_new_tokens)
    d["run"].update(rollouts=args.rollouts, save_every=0, save_final=False, export_final=False, progress_bar=False)
    d["sft"] = {"steps": 0}
    raw["scheduler"]["params"]["warmup_num_steps"] = 1
    if placement == "disaggregated":
        d["rollout"].update(placement="disaggregated", generator_ranks=args.generators)
        d["algorithm"]["max_staleness"] = k
        if k:
            d["algorithm"]["rollout_correction"] = {"mode": "tis", "level": "token", "cap": 2.0}
    path = tmp / f"{placement}_{k}.json"
    path.write_text(json.dumps(raw))
    return path


def launch(path: Path, ranks: int, out: Path, device: str) -> float:
    """The job on ``ranks`` processes under DeepSpeed's launcher; its seconds."""
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(ranks), "launch/train.py",
           "--ds_config", str(path), "--dsrl.run.output_dir", str(out)]
    done = run_process(cmd, env=bench_env(device, OMP_NUM_THREADS="1"))
    if done.status != "ok":
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.output}")
    return done.seconds


def phases(out: Path, skip: int) -> dict[str, float]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if r["event"] == "rollout"]
    walls = [b["elapsed_s"] - a["elapsed_s"] for a, b in zip(rows, rows[1:])][skip:]
    tail = rows[skip + 1:]

    def med(key: str) -> float:
        return statistics.median(r[key] for r in tail)

    generation = med("generator_s") if tail[0]["generator_s"] else med("rollout_s")
    return {"wall": statistics.median(walls), "generation": generation, "train": med("train_s"),
            "wait": med("trainer_wait_s"), "idle": med("generator_idle_frac"), "publish": med("publish_s"),
            "accuracy": tail[-1]["accuracy"] or 0.0, "staleness": max(r["staleness_max"] for r in tail)}


def projection(args: argparse.Namespace) -> list[list]:
    """Per-rollout seconds on W devices under the pipeline model (module docstring)."""
    G, T, a = args.project_generate, args.project_train, args.scaling
    S = 2 * args.project_params / (args.sync_gbps * 1e9)  # bf16 weights over the sync links
    rows = []
    for W in (8, 64, 512):
        colocated = (G + T) / W ** a
        best = min((max(G / n ** a, T / (W - n) ** a) + S, n) for n in range(1, W))
        rows.append([W, f"{colocated:.3f}", f"{best[0]:.3f}", f"{best[1]}/{W - best[1]}",
                     f"{colocated / best[0]:.2f}x"])
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trainers", type=int, default=1)
    ap.add_argument("--generators", type=int, default=1)
    ap.add_argument("--ks", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--rollouts", type=int, default=12)
    ap.add_argument("--skip", type=int, default=2, help="rollouts left out of the medians (start-up)")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--steps", type=int, default=2, help="optimizer steps per rollout")
    ap.add_argument("--max_new_tokens", type=int, default=16)
    ap.add_argument("--shape", default="cpu", choices=list(SHAPES))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--project_generate", type=float, default=6.06,
                    help="projection: generation seconds per rollout on one device (default: the H100 round's "
                         "Qwen2.5-0.5B-shape e2e, docs/benchmarks.md)")
    ap.add_argument("--project_train", type=float, default=3.97,
                    help="projection: log-prob + training seconds per rollout on one device (H100 round: 0.91 + 3.06)")
    ap.add_argument("--project_params", type=float, default=0.494e9, help="projection: model parameters")
    ap.add_argument("--sync_gbps", type=float, default=50.0, help="projection: weight-sync bandwidth, GB/s")
    ap.add_argument("--scaling", type=float, default=0.9, help="projection: phase time ~ 1 / devices^a")
    ap.add_argument("--no-record", dest="no_record", action="store_true")
    args = ap.parse_args()
    ranks = args.trainers + args.generators
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="dsrl-async-bench-") as tmp:
        tmp_path = Path(tmp)
        modes = [("colocated", 0)] + [("disaggregated", k) for k in args.ks]
        for placement, k in modes:
            name = "colocated" if placement == "colocated" else f"disaggregated k={k}"
            total = launch(run_file(args, placement, k, tmp_path), ranks, tmp_path / name.replace(" ", "_"),
                           args.device)
            results[name] = {**phases(tmp_path / name.replace(" ", "_"), args.skip), "total": total}
            print(name, {k2: round(v, 4) for k2, v in results[name].items()}, flush=True)
    base = results["colocated"]["wall"]
    rows = [[name, f"{r['wall']:.3f}", f"{r['generation']:.3f}", f"{r['train']:.3f}",
             f"{r['wait'] / r['wall']:.0%}" if name != "colocated" else "-",
             f"{r['idle']:.0%}" if name != "colocated" else "-", int(r["staleness"]), f"{base / r['wall']:.2f}x",
             f"{r['accuracy']:.2f}"] for name, r in results.items()]
    body = (f"{args.device}; {ranks} ranks ({args.trainers} trainer(s) + {args.generators} generator(s) when "
            f"disaggregated; every rank generates and trains when colocated); shape {args.shape} "
            f"({SHAPES[args.shape]}); P = {args.prompts}, G = {args.samples}, {args.steps} optimizer steps per "
            "rollout, "
            f"{args.max_new_tokens} new tokens, no warm-up; medians over rollouts {args.skip + 2}-{args.rollouts}. "
            "wall = seconds per rollout on rank 0; generation = the generators' seconds per rollout (colocated: the "
            "experience phase of every rank); train = the optimizer steps; wait = the trainers' wait for samples / "
            "wall; idle = the generators' time waiting for weights / (idle + generation).\n\n")
    body += table(["mode", "wall s", "generation s", "train s", "trainer wait", "generator idle", "staleness",
                   "speed", "accuracy"], rows)
    if "disaggregated k=0" in results and "disaggregated k=1" in results:
        k0, k1 = results["disaggregated k=0"], results["disaggregated k=1"]
        busy = k0["wall"] - k0["wait"]  # the trainer's own time per rollout (wait is in seconds): experience + steps
        alone = max(k0["generation"], busy)
        body += (f"\n\nOverlap efficiency: the k = 1 wall time over max(the generator's generation, the trainer's busy "
                 f"time = wall - wait) measured without overlap (k = 0): {k1['wall']:.3f} / "
                 f"max({k0['generation']:.3f}, "
                 f"{busy:.3f}) = **{k1['wall'] / alone:.2f}** (target <= 1.1).")
        body += (f"\n\nProjection, not a measurement: a rollout of {args.project_generate:g} s generation and "
                 f"{args.project_train:g} s log-probs + training on one device, each phase scaling as 1/devices^"
                 f"{args.scaling:g}; colocated runs both on all W devices, disaggregated (k >= 1) runs them at once "
                 f"on the best split plus a weight sync of 2 x {args.project_params:.3g} bytes at {args.sync_gbps:g} "
                 "GB/s. The model has no straggler or engine-switch term (the published speed-ups come largely from "
                 "those), so it bounds what overlap alone buys:\n\n")
        body += table(["devices W", "colocated s/rollout", "disaggregated k=1 s/rollout", "N_g/N_t", "speed-up"],
                      projection(args))
    report("Asynchronous training: colocated vs disaggregated (bench/async.py)", body, args.no_record)


if __name__ == "__main__":
    main()
