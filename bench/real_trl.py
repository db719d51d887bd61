"""dsrl vs TRL 1.16 GRPOTrainer on a real pretrained model (SmolLM2-135M-Instruct, chain_sum), side by side in one run.

    python bench/real_trl.py --seeds 0 1 2 --rollouts 12          # the measurement (float32, CPU)
    python bench/real_trl.py --seeds 0 --rollouts 1 --prompts 2 --samples 4 --mini_batch 4 --eval_prompts 16 --no-record

TRL is a benchmark-only dependency, never a runtime one: ``pip install trl==1.16.0`` (it changes no installed package
of dsrl's environment; else use a separate venv); without it the TRL side is skipped, saying so.

Sides, each in a fresh process with one intra-op thread per process (bench/_common.py ``bench_env``):

- ``trl``: TRL's GRPOTrainer, one process (bench/_real_trl_workers.py ``run_trl``);
- ``dsrl-1``: ``python launch/train.py`` (one rank);
- ``dsrl-2``: ``deepspeed --num_gpus 2 launch/train.py`` (dsrl's default: 2 ranks, one thread each).

Per seed, ``trl`` and ``dsrl-1`` run at the same time (one core each: the same machine conditions until the faster
one ends), then ``dsrl-2`` alone; then the evaluation. On a quiet 2-core machine a seed of the default measurement
should take about 40 minutes (estimated from 1-rollout runs: TRL's 12 rollouts of about 2 minutes bound the pair,
dsrl-2 5-10 minutes, the evaluations of up to 6 models on 200 prompts a few), the three seeds about 2 hours. Run it on
an otherwise idle machine: another process on the cores changes every figure.

The same on every side, all read from one dsrl run file (``--run_file``, default
configs/smollm2_135m_chain_sum_cpu.json, through dsrl's own config; TRL's GRPOConfig is derived from it:
bench/_real_trl_workers.py ``settings``): the model directory (float32), the prompts and their order (TRL's dataset is
dsrl's prompt sampler's stream, unshuffled: rollout k of every side trains on the same P questions), each rendered
through the tokenizer's chat template (TRL: a conversational ``prompt`` column; dsrl: ``data.chat_template``) -- TRL's
rendering of the first prompt and the ids of its first generation call must equal dsrl's (asserted); the reward
(dsrl.tasks.procedural.gym_reward, given to TRL as a reward function of the dataset's columns); P x G samples per
rollout, mini-batch B, E = 1 (E x R/B optimizer steps per rollout), max new tokens, temperature (top_p 1, top_k 0); no
KL term; torch's AdamW with the run file's lr, betas, eps and weight decay, gradient clipping; the clip range (dsrl's
grpo default 0.2 both ways = TRL's epsilon); group advantages normalised by the group's sample std; the loss
aggregation: dsrl's grpo default ``seq-mean-token-mean`` = TRL ``loss_type="grpo"`` (each sequence's token mean,
averaged over the mini-batch); activation checkpointing off on both (faster on the CPU at this size: nothing is
recomputed, and the activations of ~65-token sequences are small; TRL's default is on).

What differs:

- the LR schedule: the run file's DeepSpeed WarmupCosineLR (linear warmup from 0.1 x lr over 2 steps, cosine to 0.1 x
  lr at the last step) has no transformers twin: transformers' warmups reach the full lr at their last warmup step,
  DeepSpeed's one step later. Both sides therefore run transformers' ``cosine_warmup_with_min_lr`` with the run file's
  warmup start (warmup_lr_rate 0.1), warmup length and floor (min_lr_rate 0.1) -- dsrl through ``dsrl.scheduler``,
  TRL through ``lr_scheduler_type`` -- so every optimizer step has the same LR on both (the JSON keeps both lists;
  ``max |lr diff|`` is printed). Its cosine phase is WarmupCosineLR's exactly (dsrl aligns DeepSpeed's schedule:
  dsrl/backends/deepspeed/schedule.py); only the second warmup step differs from the run file's (lr, not 0.55 lr).
  ``--run_file_schedule`` keeps WarmupCosineLR on dsrl's sides instead;
- the std in the advantage's denominator: dsrl adds 1e-6, TRL 1e-4;
- generation: each trainer's own default: dsrl's ``rollout.backend`` of the run file (``auto``: continuous batching
  for this workload, ``dsrl plan`` says why) with prompt-shared training forwards (``model.share_prompts``); TRL's
  transformers ``generate`` over the whole generation batch. The samples themselves differ (different random streams);
- micro-batches: dsrl packs its token budget (``max_tokens_per_micro_batch`` 2048: about 30 of these sequences);
  TRL takes ``per_device_train_batch_size`` = ``--trl_micro_batch`` (default B: one micro-batch per optimizer step, the
  nearest to dsrl's). Neither changes the objective.

Measured per side and seed:

- seconds per rollout by phase, medians over the rollouts after the first: generation; old log-probs (the no-grad
  forwards; both sides compute them: with 2 optimizer steps per rollout the second is off-policy); train = the rest
  (rewards, advantages, forward/backward, optimizer steps); the total is the loop's time for the rollout without the
  checkpoint saves this benchmark adds (dsrl: the row's ``rollout_s + train_s``, bench/_e2e_workers.py
  ``dsrl_records(loop_time=True)``; TRL: its callback's clock, restarted after a save);
- peak resident memory: the largest VmHWM over the rollouts (reset at each phase start by dsrl, each rollout start
  by TRL; start-up and saves excluded), of one process (dsrl-2: of the larger rank);
- held-out accuracy, by one evaluation that is neither framework's own (bench/_real_trl_workers.py
  ``greedy_accuracy``: transformers ``generate``, greedy, chat template, max_new_tokens as in training, batched and
  left-padded, scored by dsrl.tasks.procedural.gym_accuracy) on the test split: the initial model once, each side's
  model after N rollouts (dsrl's ``final_model``; TRL's last checkpoint) and at equal wall time: every side saves its
  model every ``--save_every`` rollouts (dsrl: run.save_every, exported with ``dsrl export``; TRL: save_steps, model
  only); for each pair (trl with dsrl-1, trl with dsrl-2) the faster side's N rollouts take T seconds (the sum of its
  rollouts' seconds), and the slower side is evaluated at its latest checkpoint whose summed seconds are <= T.

Ratios: TRL / dsrl of the seconds per rollout (> 1: dsrl faster), dsrl / TRL of the peak memory (< 1: dsrl lighter);
the mean row averages the seeds' figures and takes the ratios of those means. Nothing asserts on time.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import threading
from dataclasses import asdict
from pathlib import Path
from typing import Any

from _common import REPO, bench_env, free_port, report, rollout_rows, run_process, table
from _e2e_report import summarize
from _e2e_workers import Workload, dsrl_records
from _real_trl_workers import Spec, dsrl_run_file, evaluate_main, run_trl, settings

SIDES = ("trl", "dsrl-1", "dsrl-2")
PAIRS = (("trl", "dsrl-1"), ("trl", "dsrl-2"))
TRL_MISSING = "trl is not importable (benchmark-only: pip install trl==1.16.0)"
RENDERING = re.compile(r"the model sees each prompt as (\d+) tokens like ('(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\")")
RANK_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT")


def workload(spec: Spec, h: dict[str, Any]) -> Workload:
    """bench/e2e.py's Workload with this run's batch (what dsrl_records and summarize read)."""
    return Workload(prompts_per_rollout=h["P"], samples_per_prompt=h["G"], mini_batch_size=h["B"],
                    epochs_per_rollout=h["E"], rollouts=spec.rollouts, max_new_tokens=h["max_new_tokens"],
                    seed=spec.seed, gradient_checkpointing=False)


def run_side(side: str, spec: Spec, h: dict[str, Any], seed_dir: Path, timeout: float | None) -> dict[str, Any]:
    """One side in a fresh process; its records, LRs, checkpoints ({rollouts: directory}) and status."""
    out_dir, log = seed_dir / side, seed_dir / f"{side}.log"
    env = {k: v for k, v in bench_env("cpu").items() if k not in RANK_VARS}
    if side == "trl":
        cmd = [sys.executable, __file__, "--worker", spec.to_json(), "--out", str(seed_dir / "trl.json"),
               "--output_dir", str(out_dir)]
    else:
        run_file = seed_dir / f"{side}.json"
        run_file.write_text(json.dumps(dsrl_run_file(spec, str(out_dir)), indent=1))
        cmd = [sys.executable, "launch/train.py", "--ds_config", str(run_file)]
        if side == "dsrl-2":
            cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port",
                   str(free_port()), *cmd[1:]]
        backend = plan_backend(run_file, 2 if side == "dsrl-2" else 1, env)
    print(f"seed {spec.seed} {side}: started (log {log})", flush=True)
    done = run_process(cmd, env=env, timeout=timeout, log=log)
    res: dict[str, Any] = {"status": done.status, "process_s": done.seconds}
    if side == "trl":
        try:
            data = json.loads((seed_dir / "trl.json").read_text())
        except (OSError, json.JSONDecodeError):
            data = {"records": [], "lrs": [], "checkpoints": {}}
        res.update(records=data["records"], lrs=data["lrs"], first_prompt=data.get("first_prompt"),
                   checkpoints={int(r): p for r, p in data["checkpoints"].items()})
    else:
        res["rollout_backend"], res["first_line"] = backend, rendering_line(log)
        res["records"] = dsrl_records(str(out_dir), workload(spec, h), loop_time=True)
        res["lrs"] = [r["lr"] for r in rollout_rows(out_dir, "step")]
        saved = {r: out_dir / "checkpoints" / f"rollout{r}" for r in range(1, spec.rollouts + 1)}
        res["checkpoints"] = {r: str(p) for r, p in saved.items() if p.is_dir()}
        if (out_dir / "final_model").is_dir():
            res["checkpoints"][spec.rollouts] = str(out_dir / "final_model")
    if done.status != "ok":
        res["error"] = log.read_text()[-3000:] if log.exists() else ""
    res["cumulative_s"] = [0.0]
    for r in res["records"]:
        res["cumulative_s"].append(res["cumulative_s"][-1] + r["rollout_s"])
    if res["records"]:
        res["summary"] = summarize(res["records"], workload(spec, h))
    print(f"seed {spec.seed} {side}: {done.status} in {done.seconds:.0f} s, {len(res['records'])} rollouts", flush=True)
    if done.status != "ok":
        print(res["error"][-2000:], flush=True)
    return res


def rendering_line(log: Path) -> dict[str, Any] | None:
    """What a dsrl run's first line says the model sees (its data file's first prompt: tokens and text)."""
    found = RENDERING.search(log.read_text()) if log.exists() else None
    return {"tokens": int(found[1]), "text": ast.literal_eval(found[2])} if found else None


def check_renderings(sides: dict[str, Any]) -> None:
    """dsrl's run shows its data file's first prompt as TRL renders it (the same token count and text)."""
    trl = (sides.get("trl", {}).get("first_prompt") or {}).get("file_row0")
    for side in ("dsrl-1", "dsrl-2"):
        shown = sides.get(side, {}).get("first_line")
        if trl and shown:  # the line cuts a long prompt's text to 400 characters and "..."
            same = shown["text"] == trl["text"] or (shown["text"].endswith("...")
                                                    and trl["text"].startswith(shown["text"][:-3]))
            assert shown["tokens"] == trl["tokens"] and same, f"{side} shows its first prompt as {shown}, TRL {trl}"


def plan_backend(run_file: Path, world: int, env: dict[str, str]) -> str | None:
    """The generation backend ``dsrl plan`` says the run will use (what ``rollout.backend = "auto"`` picks)."""
    proc = subprocess.run([sys.executable, "-m", "dsrl.cli", "plan", "--ds_config", str(run_file), "--world_size",
                           str(world), "--json"], cwd=REPO, env=env, capture_output=True, text=True)
    try:
        return json.loads(proc.stdout)["rollout_backend"]
    except (json.JSONDecodeError, KeyError):
        return None


def equal_wall(fast: dict[str, Any], slow: dict[str, Any], n: int) -> dict[str, Any]:
    """The slower side's latest saved rollout count whose summed seconds are within the faster side's for ``n``."""
    budget = fast["cumulative_s"][n]
    saved = [0] + sorted(r for r in slow["checkpoints"] if r <= n and slow["cumulative_s"][r] <= budget)
    return {"seconds": budget, "rollout": saved[-1], "slow_seconds": slow["cumulative_s"][saved[-1]]}


def export(src: str, out: Path) -> str:
    """A dsrl checkpoint as a Hugging Face model directory (``dsrl export``)."""
    done = run_process([sys.executable, "-m", "dsrl.cli", "export", src, "--out", str(out), "--overwrite"],
                       env=bench_env("cpu"))
    if done.status != "ok":
        raise RuntimeError(f"dsrl export {src} failed:\n{done.output[-2000:]}")
    return str(out)


def evaluate(models: list[str], args: argparse.Namespace, spec: Spec, h: dict[str, Any], tmp: Path) -> dict:
    """Accuracy of each model directory, in one fresh process (``--eval_threads`` threads)."""
    if not models:
        return {}
    out = tmp / "eval.json"
    cmd = [sys.executable, __file__, "--evaluate", *models, "--tokenizer", spec.model, "--data", spec.data,
           "--max_new_tokens", str(h["max_new_tokens"]), "--eval_batch", str(args.eval_batch), "--out", str(out)]
    if args.eval_prompts:
        cmd += ["--eval_prompts", str(args.eval_prompts)]
    done = run_process(cmd, env=bench_env("cpu", OMP_NUM_THREADS=str(args.eval_threads)))
    if done.status != "ok":
        raise RuntimeError(f"the evaluation failed:\n{done.output[-3000:]}")
    return json.loads(out.read_text())


def run_seed(seed: int, args: argparse.Namespace, results: dict[str, Any]) -> None:
    spec = Spec(**{**results["spec"], "seed": seed})
    h, n = results["settings"], spec.rollouts
    seed_dir = Path(args.workdir, f"seed{seed}")
    if seed_dir.exists():
        shutil.rmtree(seed_dir)
    seed_dir.mkdir(parents=True)
    sides: dict[str, Any] = {s: {"skipped": TRL_MISSING} for s in args.sides
                             if s == "trl" and importlib.util.find_spec("trl") is None}
    if sides:
        print(f"seed {seed} trl: skipped ({TRL_MISSING})", flush=True)
    def run_into(side: str) -> None:
        try:
            sides[side] = run_side(side, spec, h, seed_dir, args.timeout)
        except Exception as e:  # noqa: BLE001 -- the other side and the report go on; the error is the row
            sides[side] = {"status": f"failed ({type(e).__name__}: {e})", "records": [], "checkpoints": {}}

    together = [s for s in ("trl", "dsrl-1") if s in args.sides and s not in sides]
    threads = [threading.Thread(target=run_into, args=(s,)) for s in together]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if "dsrl-2" in args.sides:
        run_into("dsrl-2")
    check_renderings(sides)
    full = {s for s, r in sides.items() if len(r.get("cumulative_s", [])) > n and n in r["checkpoints"]}
    wanted: dict[tuple[str, int], str] = {(s, n): sides[s]["checkpoints"][n] for s in full}
    walls = {}
    for a, b in PAIRS:
        if {a, b} <= full:
            fast, slow = (a, b) if sides[a]["cumulative_s"][n] <= sides[b]["cumulative_s"][n] else (b, a)
            walls[f"{a} vs {b}"] = {"faster": fast, "slower": slow, **equal_wall(sides[fast], sides[slow], n)}
            r = walls[f"{a} vs {b}"]["rollout"]
            if r:
                src = sides[slow]["checkpoints"][r]
                wanted[(slow, r)] = src if slow == "trl" or r == n else export(src, seed_dir / slow / f"export{r}")
    models = list(dict.fromkeys(wanted.values()))
    if results.get("initial") is None:
        models.append(spec.model)
    accs = evaluate(models, args, spec, h, seed_dir)
    if spec.model in accs:
        results["initial"] = accs[spec.model]
    for (side, r), path in wanted.items():
        sides[side].setdefault("accuracy", {})[r] = accs[path]["accuracy"]
    for w in walls.values():
        w["slow_accuracy"] = results["initial"]["accuracy"] if w["rollout"] == 0 else \
            sides[w["slower"]]["accuracy"][w["rollout"]]
    results["seeds"][str(seed)] = {"sides": sides, "equal_wall": walls}
    if not args.keep:  # the models are large (a dsrl checkpoint holds the optimizer state): keep logs and metrics
        for side in SIDES:
            for sub in ("checkpoints", "final_model"):
                shutil.rmtree(seed_dir / side / sub, ignore_errors=True)
            for path in (seed_dir / side).glob("checkpoint-*") if (seed_dir / side).is_dir() else []:
                shutil.rmtree(path, ignore_errors=True)
            for path in (seed_dir / side).glob("export*") if (seed_dir / side).is_dir() else []:
                shutil.rmtree(path, ignore_errors=True)


# -- the report ------------------------------------------------------------------------------------------------------


def _f(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or not b else f"{a / b:.2f}"


def side_figures(side: str, run: dict[str, Any], n: int) -> dict[str, float | None] | None:
    """One side's figures of one seed: medians per rollout, peak, accuracy after ``n`` rollouts and, for a dsrl side,
    the accuracies of it and of TRL at equal wall time."""
    r = run["sides"][side]
    s = r.get("summary")
    if not s:
        return None
    wall = run["equal_wall"].get(f"trl vs {side}")
    at = {}
    if wall:
        at = {wall["faster"]: r["accuracy"][n] if wall["faster"] == side else run["sides"]["trl"]["accuracy"][n],
              wall["slower"]: wall["slow_accuracy"]}
    return {"generate_s": s["generate_s"], "logprobs_s": s["logprobs_s"], "train_s": s["train_s"],
            "rollout_s": s["rollout_s"], "peak_mb": s["peak_mb"], "accuracy": r.get("accuracy", {}).get(n),
            "wall_side": at.get(side), "wall_trl": at.get("trl")}


def mean_figures(figs: list[dict[str, Any]]) -> dict[str, float | None]:
    return {k: (statistics.mean(f[k] for f in figs) if all(f[k] is not None for f in figs) else None)
            for k in figs[0]}


def tables(results: dict[str, Any]) -> str:
    """The main table (per seed, then the mean over seeds) and the equal-wall-time detail."""
    n = results["spec"]["rollouts"]
    rows, per_side = [], {s: [] for s in SIDES}
    for seed, run in results["seeds"].items():
        figs = {s: side_figures(s, run, n) for s in run["sides"]}
        for s in figs:
            if figs[s]:
                per_side[s].append(figs[s])
        rows += _side_rows(seed, figs, run["sides"])
    means = {s: mean_figures(f) for s, f in per_side.items() if f}
    if len(results["seeds"]) > 1:
        rows += _side_rows("mean", means, {})
    head = ["seed", "side", "generate s", "old log-probs s", "train s", "s/rollout", "TRL/side s", "peak MiB",
            "side/TRL MiB", f"acc after {n}", "acc at equal wall: side / TRL"]
    walls = [[seed, pair, w["faster"], f"{w['seconds']:.0f}",
              f"{w['slower']} @ {w['rollout']} ({w['slow_seconds']:.0f} s)",
              _f(run["sides"][w["faster"]].get("accuracy", {}).get(n), ".3f"), _f(w["slow_accuracy"], ".3f")]
             for seed, run in results["seeds"].items() for pair, w in run["equal_wall"].items()]
    out = table(head, rows)
    if walls:
        out += ("\n\nAt equal wall time: the faster side's N rollouts (summed seconds), the slower side's latest "
                "checkpoint within them (rollouts, summed seconds):\n\n"
                + table(["seed", "pair", "faster", f"its {n} rollouts s", "slower @ checkpoint",
                         f"acc faster after {n}", "acc slower at checkpoint"], walls))
    return out


def _side_rows(seed: str, figs: dict[str, Any], raw: dict[str, Any]) -> list[list[str]]:
    rows, trl = [], figs.get("trl")
    for side in SIDES:
        f = figs.get(side)
        if f is None:
            why = raw.get(side, {}).get("skipped") or raw.get(side, {}).get("status")
            if why:
                rows.append([seed, side, f"{why}"] + [""] * 8)
            continue
        partial = " (partial)" if raw.get(side, {}).get("status", "ok") != "ok" else ""
        vs_t = _ratio(trl["rollout_s"], f["rollout_s"]) if trl and side != "trl" else ""
        vs_m = _ratio(f["peak_mb"], trl["peak_mb"]) if trl and side != "trl" else ""
        wall = f"{_f(f['wall_side'], '.3f')} / {_f(f['wall_trl'], '.3f')}" if f["wall_side"] is not None else ""
        rows.append([seed, side + partial, _f(f["generate_s"]), _f(f["logprobs_s"]), _f(f["train_s"]),
                     _f(f["rollout_s"]), vs_t, _f(f["peak_mb"], ",.0f"), vs_m, _f(f["accuracy"], ".3f"), wall])
    return rows


def _shown(path: str) -> str:
    """A path as the report names it: relative to the checkout when inside it."""
    return os.path.relpath(path, REPO) if Path(path).resolve().is_relative_to(REPO) else path


def describe(results: dict[str, Any]) -> str:
    h, spec, init = results["settings"], results["spec"], results.get("initial") or {}
    diffs = []
    for run in results["seeds"].values():
        trl = run["sides"].get("trl", {}).get("lrs")
        for side in ("dsrl-1", "dsrl-2"):
            other = run["sides"].get(side, {}).get("lrs")
            if trl and other and len(trl) == len(other):
                diffs.append(max(abs(a - b) for a, b in zip(trl, other)))
    first = next((r["sides"]["trl"].get("first_prompt") for r in results["seeds"].values()
                  if r["sides"].get("trl", {}).get("first_prompt")), None)
    s = h["schedule"]
    run0 = next(iter(results["seeds"].values()), {"sides": {}})["sides"]
    picks = [f"{side} {run0[side]['rollout_backend']}" for side in ("dsrl-1", "dsrl-2")
             if run0.get(side, {}).get("rollout_backend")]
    picked = f" (dsrl plan: {', '.join(picks)})" if picks else ""
    return (f"SmolLM2-135M-Instruct ({_shown(spec['model'])}), float32, CPU, one thread per process; chain_sum "
            f"({_shown(spec['data'])}); P = {h['P']} x G = {h['G']}, B = {h['B']}, E = {h['E']} "
            f"({h['steps_per_rollout']} optimizer steps per rollout), {spec['rollouts']} rollouts, max_new_tokens "
            f"{h['max_new_tokens']}, "
            f"temperature {h['temperature']}; AdamW lr {h['lr']:g} betas {tuple(h['betas'])} eps {h['eps']:g} wd "
            f"{h['weight_decay']:g}, clip grad {h['grad_clip']:g}; LR schedule "
            + ("dsrl: the run file's WarmupCosineLR, TRL: " if spec["run_file_schedule"] else "both: ")
            + f"cosine_warmup_with_min_lr (warmup {s['warmup_steps']} steps from {s['warmup_lr_rate']:g}, floor "
            f"{s['min_lr_rate']:g}; max |lr diff| between sides {_f(max(diffs) if diffs else None, '.2e')}); clip "
            f"{h['clip_low']:g}/{h['clip_high']:g}; no KL; dsrl loss_agg {h['loss_agg']} = TRL loss_type "
            f"{h['trl_loss_type']!r}; activation checkpointing off on both; dsrl rollout.backend "
            f"{h['backend']}{picked}, share_prompts {str(h['share_prompts']).lower()}; TRL: transformers generate, "
            f"per_device_train_batch_size {spec['trl_micro_batch'] or h['B']}; checkpoints every "
            f"{spec['save_every']} rollouts. Seconds: medians over rollouts 2..N of each process. Accuracy: greedy, "
            f"{init.get('prompts', '?')} test prompts; initial model {_f(init.get('accuracy'), '.3f')}. "
            + (f"First prompt as both render it ({len(first['trl_ids'])} tokens, identical ids): "
               f"{first['text']!r}. " if first else "")
            + "Module docstring of bench/real_trl.py: what differs and how each figure is measured.")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--rollouts", type=int, default=12)
    ap.add_argument("--save_every", type=int, default=2, help="rollouts between saved models (equal-wall accuracy)")
    ap.add_argument("--sides", nargs="+", default=list(SIDES), choices=list(SIDES))
    ap.add_argument("--model", default="models/SmolLM2-135M-Instruct")
    ap.add_argument("--data", default="data/chain_sum", help="a dsrl prepare-data directory (train, test parquet)")
    ap.add_argument("--run_file", default="configs/smollm2_135m_chain_sum_cpu.json")
    ap.add_argument("--prompts", type=int, default=None, help="P (default: the run file's)")
    ap.add_argument("--samples", type=int, default=None, help="G (default: the run file's)")
    ap.add_argument("--mini_batch", type=int, default=None, help="B (default: the run file's)")
    ap.add_argument("--max_new_tokens", type=int, default=None, help="default: the run file's")
    ap.add_argument("--trl_micro_batch", type=int, default=None, help="TRL's per_device_train_batch_size (default B)")
    ap.add_argument("--run_file_schedule", action="store_true", help="dsrl keeps the run file's WarmupCosineLR")
    ap.add_argument("--eval_prompts", type=int, default=None, help="the first N test questions (default: all)")
    ap.add_argument("--eval_batch", type=int, default=50)
    ap.add_argument("--eval_threads", type=int, default=2, help="threads of the evaluation process (runs alone)")
    ap.add_argument("--timeout", type=float, default=None, help="seconds per training process")
    ap.add_argument("--workdir", default="runs/real_trl", help="run directories, logs and checkpoints")
    ap.add_argument("--keep", action="store_true", help="keep every saved model (default: deleted once evaluated)")
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--no-record", dest="no_record", action="store_true")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--output_dir", help=argparse.SUPPRESS)
    ap.add_argument("--evaluate", nargs="+", help=argparse.SUPPRESS)
    ap.add_argument("--tokenizer", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        run_trl(Spec(**json.loads(args.worker)), args.out, args.output_dir)
        return
    if args.evaluate:
        evaluate_main(args.evaluate, args.tokenizer, args.data, args.eval_prompts, args.max_new_tokens,
                      args.eval_batch, args.out)
        return
    absolute = lambda p: p if os.path.isabs(p) else str(REPO / p)  # noqa: E731
    spec = Spec(model=absolute(args.model), data=absolute(args.data), run_file=absolute(args.run_file),
                rollouts=args.rollouts, save_every=args.save_every, prompts_per_rollout=args.prompts,
                samples_per_prompt=args.samples, mini_batch_size=args.mini_batch, max_new_tokens=args.max_new_tokens,
                trl_micro_batch=args.trl_micro_batch, run_file_schedule=args.run_file_schedule)
    args.workdir = absolute(args.workdir)
    results: dict[str, Any] = {"spec": asdict(spec), "settings": settings(spec), "initial": None, "seeds": {}}
    for seed in args.seeds:
        run_seed(seed, args, results)
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    report("Real model: dsrl vs TRL GRPOTrainer (bench/real_trl.py)", describe(results) + "\n\n" + tables(results),
           args.no_record)


if __name__ == "__main__":
    main()
