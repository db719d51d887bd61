"""End-to-end GRPO, dsrl vs TRL's GRPOTrainer, side by side in one run: the same model, task, prompts,
group size, mini-batch, epochs per rollout, max new tokens, optimizer and gradient checkpointing.

    python bench/e2e.py                                     # CPU: both workloads below
    python bench/e2e.py --workloads short --repeats 5       # CPU: the short-completion workload alone
    python bench/e2e.py --device cuda --shape 0.5b --backends auto hf --sides dsrl trl trl-ds   # one GPU, bf16
    python bench/e2e.py --device cuda --backends auto hf --sides dsrl dsrl-offload trl trl-ds --dsrl_backends auto

Workloads (``--workloads``; the CPU default runs both, a GPU ``main`` only; options given on the command line
apply to every selected workload):

- ``main``: the "scaled" Qwen2 shape (26.5 M parameters), P = 8 x G = 4, 32 new tokens (a GPU: the 0.5B shape,
  P = 16 x G = 8, 256 new tokens), generation with ``hf`` on every side;
- ``short``: short completions as a toy task's run file gets them: dsrl's tiny Qwen2 shape, the ``reverse`` task,
  P = 16 x G = 4, 8 new tokens, one micro-batch per optimizer step (B = m = 16), 30 rollouts; dsrl's side twice,
  with a run file that names no ``rollout.backend`` (``default``: what a user gets, ``auto``) and with ``hf``
  pinned, against TRL's defaults (``generate``). A default that picked the slower backend for such calls shows
  here as ``default`` behind ``hf``.

Each (backend, side, repetition) runs in a fresh process (``--sides``: dsrl, ``trl`` = TRL's defaults,
``trl-ds`` = TRL through its own DeepSpeed integration with dsrl's precision recipe; each repetition runs every
(backend, side) in turn, their order rotated every repetition), on one device each (dsrl through DeepSpeed
ZeRO-1 on a world of one; ``dsrl-offload`` = dsrl with ``dsrl.memory.offload_states``: the training state on the
host outside training). ``--backends``: ``hf`` =
transformers ``generate`` on every side; ``cb`` = transformers continuous batching on every side (dsrl
``rollout.backend = "cb"``, TRL ``use_transformers_continuous_batching``); ``auto`` = dsrl's
``rollout.backend = "auto"`` (dsrl only: TRL has no such choice, its default is the ``hf`` row); ``default`` = dsrl
with a run file that names no backend (dsrl only);
``vllm`` = dsrl's vLLM backend (TRL's side not wired). A *rollout* is the same unit on every side: P prompts
x G samples generated, scored, old log-probs computed once, then E x R/B optimizer steps of B sequences in
micro-batches of m.

Where the figures come from:

- dsrl: its own ``Trainer.run()`` (what ``launch/train.py`` runs), nothing of it replaced but the model it
  builds (the benchmark's, below); the per-rollout figures are the trainer's own ``rollout`` rows of
  metrics.jsonl (dsrl/runtime/phases.py: generation, reward, old/reference log-prob and training seconds
  and peak memory per phase), read by this driver from the run directory even when the process was stopped
  at its time limit. Seconds per rollout: the difference of consecutive rows' ``elapsed_s``;
- TRL: callbacks and wrappers around its generation and no-grad log-prob calls (the rollout closes every
  E x R/B optimizer steps), synchronised with the device.

Per rollout (medians over the rollouts after the first, which carries one-time warm-up costs) the table gives:

- seconds: generate (the generation call), log-probs (the no-grad forwards for old and reference log-probs),
  train (everything else: rewards, advantages, forward/backward, optimizer steps);
- generation tokens/s = completion tokens / generate seconds; training tokens/s = E x (prompt +
  completion tokens) / train seconds;
- peak memory: GPU: ``max_memory_allocated``, per phase and over the rollout; CPU: the rollout's peak resident
  set (VmHWM, reset at each phase start on the dsrl side, at each rollout start on the TRL side);
- TRL/dsrl: TRL's rollout seconds over dsrl's (> 1 means dsrl is faster).

Gradient checkpointing (``--gradient_checkpointing``, default on: TRL's default) is set the same on every
side: dsrl's ``model.gradient_checkpointing`` (transformers' non-reentrant checkpointing) and TRL's
``gradient_checkpointing``.

The model: a random-weight Qwen2 of the named shape whose head gives the eos token a constant
probability 1/``--mean_len`` per step (bench/_common.py ``long_tailed_model``), so completion
lengths are long-tailed the way RL completions are; every side builds it with the same seed
(identical weights). Prompts come from dsrl's built-in ``reverse`` task with its tiny tokenizer (the
model's other token ids decode to nothing, so rewards are mostly the task's length credit); every side
scores with the same reward function.
Precision: fp32 on the CPU; on a GPU, dsrl's default (DeepSpeed bf16: bf16 weights, fp32 master weights
and moments, fp32 gradient accumulation), TRL's default for a bf16 checkpoint (bf16 weights updated in
place, ``bf16=True``) and, for ``trl-ds``, dsrl's recipe given to TRL as its ``deepspeed`` config.
The optimizer on every side: torch AdamW, constant LR, grad clipping 1.0, no KL term. TRL is a
benchmark-only dependency (``pip install trl==1.16.0``), never a runtime one. Nothing asserts on time.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
from dataclasses import asdict
from typing import Any

from _common import SHAPES, bench_env, report, run_process
from _e2e_report import census_table, combine, results_table, verdict_table
from _e2e_workers import DEFAULT_BACKEND, WorkerOutput, Workload, dsrl_records, run_dsrl, run_trl

__all__ = ["Workload", "describe", "main"]

SIDES = ("dsrl", "dsrl-offload", "trl", "trl-ds")
DSRL_SIDES = ("dsrl", "dsrl-offload")  # dsrl-offload: dsrl with dsrl.memory.offload_states (docs/memory.md)
BACKENDS = (DEFAULT_BACKEND, "auto", "hf", "cb", "vllm")
GPU_DEFAULTS = dict(shape="0.5b", prompts_per_rollout=16, samples_per_prompt=8, mini_batch_size=64,
                    micro_batch_size=8, max_new_tokens=256, mean_len=64.0, rollouts=5)
# name -> (what it changes in the defaults, its backends unless --backends names them)
WORKLOADS: dict[str, tuple[dict[str, Any], list[str]]] = {
    "main": ({}, ["hf"]),
    "short": (dict(shape="tiny", prompts_per_rollout=16, samples_per_prompt=4, mini_batch_size=16,
                   micro_batch_size=16, max_new_tokens=8, mean_len=12.0, rollouts=30), [DEFAULT_BACKEND, "hf"]),
}


def side_skip_reason(side: str, backend: str, dsrl_backends: list[str] | None = None) -> str | None:
    """Why ``side`` cannot run ``backend`` here (None: it can); ``dsrl_backends``: the backends dsrl's sides run
    (default: every one given)."""
    if side in DSRL_SIDES and dsrl_backends is not None and backend not in dsrl_backends:
        return f"dsrl runs {', '.join(dsrl_backends)} in this part"
    if side not in DSRL_SIDES and backend in ("auto", DEFAULT_BACKEND):
        return f"dsrl only (TRL has no {backend}; its default, generate, is the hf row)"
    if side not in DSRL_SIDES and importlib.util.find_spec("trl") is None:
        return "trl is not importable (benchmark-only: pip install trl==1.16.0)"
    if side == "trl-ds" and importlib.util.find_spec("deepspeed") is None:
        return "deepspeed is not importable"
    if backend == "vllm":
        if importlib.util.find_spec("vllm") is None:
            return "vllm is not importable"
        if side not in DSRL_SIDES:
            return ("not wired: TRL's vLLM modes load the model from a checkpoint and sync every weight, and this "
                    "benchmark's model carries an output-head bias that vLLM's Qwen2 lacks (dsrl's side sends it "
                    "as a logit bias)")
    return None


def run_worker(side: str, w: Workload, timeout: float | None = None) -> dict[str, Any]:
    """One side in a fresh process (its own peak memory, no shared state). Returns the worker's output with
    ``status``: ``ok``, ``timeout`` (ran past ``timeout`` seconds; the rollouts it finished are kept: for dsrl
    its metrics rows, read here) or ``failed`` (``error`` holds the end of its output)."""
    with tempfile.TemporaryDirectory(prefix="e2e_worker_") as tmp:
        path, run_dir = os.path.join(tmp, "out.json"), os.path.join(tmp, "run")
        # one rank; on the CPU one intra-op thread on every side (accelerate would pick its own)
        env = bench_env(w.device, one_rank=True)
        cmd = [sys.executable, __file__, "--worker", side, "--workload", json.dumps(asdict(w)), "--out", path,
               "--run_dir", run_dir]
        done = run_process(cmd, env=env, timeout=timeout)
        status, error = done.status, (done.output.strip() if done.status == "failed" else "")
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, json.JSONDecodeError):
            data = {"side": side, "records": [], "census": None, "profile": None}
        if side in DSRL_SIDES:
            data["records"] = dsrl_records(run_dir, w)
        data.update(status=status, error=error, seconds=done.seconds)
        return data


def worker_main(args: argparse.Namespace) -> None:
    w = Workload(**json.loads(args.workload))
    if w.device == "cpu":
        os.environ["DS_ACCELERATOR"] = "cpu"
    out = WorkerOutput(args.out, args.worker, w)
    if args.worker in DSRL_SIDES:
        run_dsrl(w, out, args.run_dir, offload=args.worker == "dsrl-offload")
    else:
        run_trl(w, out, deepspeed=args.worker == "trl-ds")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu", help="cpu | cuda")
    ap.add_argument("--shape", default=None, choices=list(SHAPES), help="default: scaled on CPU, 0.5b on GPU")
    ap.add_argument("--workloads", nargs="+", default=None, choices=list(WORKLOADS),
                    help="default: main and short on the CPU, main on a GPU (module docstring)")
    ap.add_argument("--backends", nargs="+", default=None, choices=list(BACKENDS),
                    help="default: each workload's own (main: hf; short: default hf); auto = dsrl's rollout.backend "
                         "auto, default = a run file naming no backend (both dsrl only)")
    ap.add_argument("--sides", nargs="+", default=["dsrl", "trl"], choices=list(SIDES),
                    help="dsrl-offload = dsrl with memory.offload_states; trl = TRL's defaults; trl-ds = TRL through "
                         "DeepSpeed with dsrl's precision recipe")
    ap.add_argument("--dsrl_backends", nargs="+", default=None, choices=list(BACKENDS),
                    help="the backends dsrl's sides run (default: every --backends one); TRL's sides run theirs")
    ap.add_argument("--repeats", type=int, default=2, help="process rounds per backend (order rotated each time)")
    for name, default in asdict(Workload()).items():
        if name not in ("shape", "device", "backend", "profile_dir", "gradient_checkpointing"):
            ap.add_argument(f"--{name}", type=type(default), default=None)
    ap.add_argument("--gradient_checkpointing", choices=["on", "off"], default="on",
                    help="on every side (default on: TRL's default)")
    ap.add_argument("--profile_dir", default="", help="profile one more rollout per process (after the timed ones, "
                    "left out of the timings; bench/_profile.py) and write a summary per side here")
    ap.add_argument("--worker_timeout", type=float, default=None, help="seconds per process for its timed "
                    "rollouts; a slower one is stopped and reported with the rollouts it finished")
    ap.add_argument("--profile_timeout", type=float, default=120.0, help="seconds a process gets beyond "
                    "--worker_timeout for its profiled rollout (with --profile_dir)")
    ap.add_argument("--json", default=None, help="also write the results here (rewritten after every process)")
    ap.add_argument("--no-record", dest="no_record", action="store_true")
    ap.add_argument("--worker", choices=list(SIDES), help=argparse.SUPPRESS)
    ap.add_argument("--workload", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--run_dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker_main(args)
        return
    gpu = args.device != "cpu"
    names = args.workloads or (["main"] if gpu else list(WORKLOADS))
    overrides = {k: v for k, v in vars(args).items() if k in asdict(Workload()) and v is not None}
    timeout = args.worker_timeout
    if timeout is not None and args.profile_dir:
        timeout += args.profile_timeout  # the profiled rollout comes after the timed ones: it cannot delay them
    runs: dict[str, dict[str, Any]] = {}
    for name in names:
        changes, backends = WORKLOADS[name]
        base = asdict(Workload())
        if gpu:
            base.update(GPU_DEFAULTS)
        base.update(changes)
        base.update(overrides)
        base["gradient_checkpointing"] = args.gradient_checkpointing == "on"
        if args.profile_dir:
            os.makedirs(args.profile_dir, exist_ok=True)
            base["profile_dir"] = os.path.abspath(args.profile_dir)
        base["device"] = args.device
        runs[name] = {"workload": base, "repeats": args.repeats, "results": {}, "auto_picks": {}}
        run_workload(runs[name], args.backends or backends, args, timeout, lambda: _dump(args.json, runs))
    _dump(args.json, runs)
    bodies = []
    for name, run in runs.items():
        w = Workload(**run["workload"])
        text = describe(w, args.repeats, gpu, run["auto_picks"]) + "\n\n" + results_table(run["results"], gpu)
        verdict = verdict_table(run["results"])
        if verdict:
            text += "\n\nAgainst the targets (docs/benchmarks.md, issue 26):\n\n" + verdict
        census = census_table(run["results"])
        if census:
            text += ("\n\nResident memory after the first rollout, by role (MiB; bench/_profile.py memory_census: "
                     "'other' = what the allocator holds beyond the weights, gradients, master weights and "
                     "optimizer state: activations' caches, DeepSpeed's buffers, fragmentation):\n\n" + census)
        bodies.append(text if len(runs) == 1 else f"**Workload `{name}`.** " + text)
    report("End to end: dsrl vs TRL GRPOTrainer (bench/e2e.py)", "\n\n".join(bodies), args.no_record)


def run_workload(run: dict[str, Any], backends: list[str], args: argparse.Namespace, timeout: float | None,
                 dump: Any) -> None:
    """Every backend of one workload, each side in its own processes: repetition by repetition, every (backend,
    side) in turn, their order rotated every repetition (no one always runs first, right after another process's
    exit), so that the machine's load falls on all of them alike. Fills ``run["results"]`` ({backend: {side:
    combine() or {"skipped": reason}}}) and ``run["auto_picks"]``."""
    results, picks = run["results"], run["auto_picks"]
    per_side: dict[tuple[str, str], list[dict[str, Any]]] = {}
    runnable: dict[str, list[str]] = {}
    for backend in backends:
        results[backend] = {}
        sides = list(args.sides)
        for side in sides:
            reason = side_skip_reason(side, backend, args.dsrl_backends)
            if reason:
                results[backend][side] = {"skipped": reason}
                print(f"{backend} {side}: skipped ({reason})", flush=True)
        runnable[backend] = [s for s in args.sides if s not in results[backend]]
    jobs = [(backend, side) for backend in backends for side in runnable[backend]]
    for rep in range(args.repeats):
        for backend, side in jobs[rep % len(jobs):] + jobs[:rep % len(jobs)] if jobs else []:
            w = Workload(**{**run["workload"], "backend": backend})
            res = run_worker(side, w, timeout)
            per_side.setdefault((backend, side), []).append(res)
            results[backend][side] = combine(per_side[(backend, side)], w)
            if res.get("auto_picks"):
                picks[backend] = res["auto_picks"]
            summary = results[backend][side].get("summary")
            print(f"{w.shape} {backend} rep {rep} {side}: {res['status']} in {res['seconds']:.0f} s, "
                  f"{len(res['records'])} rollouts; {summary}", flush=True)
            if res["status"] == "failed":
                print(res["error"][-2000:], flush=True)
            dump()
    for backend in backends:
        results[backend] = {s: results[backend][s] for s in args.sides}


def describe(w: Workload, repeats: int, gpu: bool, picks: dict[str, str] | None = None) -> str:
    """The workload paragraph of the recorded section (``picks``: what dsrl's ``auto`` ran, per backend row)."""
    import torch
    import transformers

    trl_version = "not installed"
    if importlib.util.find_spec("trl") is not None:
        import trl

        trl_version = trl.__version__
    auto = "".join(f" dsrl's `{b}` ran `{p}` here." for b, p in (picks or {}).items())
    return (f"Shape {w.shape} ({SHAPES[w.shape]['vocab']}-token vocabulary), {w.device}, "
            f"{'float32' if not gpu else 'bfloat16'}; P = {w.prompts_per_rollout} prompts x G = "
            f"{w.samples_per_prompt} = R = {w.rollout_size} sequences per rollout, B = {w.mini_batch_size}, m = "
            f"{w.micro_batch_size}, E = {w.epochs_per_rollout} ({w.steps_per_rollout} optimizer steps per rollout), "
            f"max_new_tokens = {w.max_new_tokens} (eos probability 1/{w.mean_len:g} per step), {w.rollouts} "
            f"rollouts per process, {repeats} process round(s) per backend, gradient checkpointing "
            f"{'on' if w.gradient_checkpointing else 'off'} on every side; torch {torch.__version__}, "
            f"transformers {transformers.__version__}, trl {trl_version}. Seconds per rollout are medians over "
            "rollouts 2..N of each process, then over processes; dsrl's come from its own metrics rows "
            "(dsrl/runtime/phases.py). "
            + ("TRL default = bf16 weights updated in place (bf16=True); TRL + DeepSpeed = ZeRO-1 with dsrl's "
               "recipe (bf16 weights, fp32 master weights and moments, fp32 gradient accumulation and "
               "communication); dsrl = DeepSpeed ZeRO-1 with that recipe. " if gpu else
               "float32 everywhere; TRL + DeepSpeed = TRL through DeepSpeed ZeRO-1 as dsrl runs. ")
            + "Last column: TRL's seconds per rollout over dsrl's (> 1: dsrl faster) / dsrl's peak memory over "
            "TRL's (< 1: dsrl lighter). Peak memory: "
            + ("GPU max allocated, overall and per phase." if gpu else "the rollout's peak resident set (VmHWM).")
            + auto)


def _dump(path: str | None, runs: dict[str, dict[str, Any]]) -> None:
    """The results as JSON: one workload as {"workload", "repeats", "results", "auto_picks"} (what bench/gpu/measure.py
    reads), several as {"workloads": {name: that}}."""
    if not path:
        return
    data = next(iter(runs.values())) if len(runs) == 1 else {"workloads": runs}
    with open(path + ".tmp", "w") as f:
        json.dump(data, f, indent=1)
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    main()
