"""Every GPU measurement of dsrl in one command: each part in its own process with a time limit, parts that
cannot run here skipped with the reason, and one dated section appended to docs/benchmarks.md.

    python bench/gpu/measure.py                    # one GPU: the verdict first (<= 8 min), then every other part
    python bench/gpu/measure.py --window 530 --resume      # the same spread over calls of <= 10 minutes (the device
                                                   # tool): each call starts parts for at most 530 s and the
                                                   # next call goes on from runs/gpu_bench/state.json
    python bench/gpu/measure.py --smoke --no-record        # CPU, tiny shapes, the same parts and sides (the test suite)
    python bench/gpu/measure.py --append SECTION.md        # append a section written by --out on another machine

Parts, in the order they run (the verdict first, so a short loan still answers it):

- e2e (8 min, start-ups included): the verdict. bench/e2e.py end to end, dsrl with ``rollout.backend = "auto"``,
  with ``dsrl.memory.offload_states`` off and on, against TRL's GRPOTrainer with its defaults and through its
  DeepSpeed integration with dsrl's precision recipe, gradient checkpointing on on every side (TRL's default), 5
  rollouts per process (a failure from the second rollout on shows), each process bounded by ``E2E_SIDE_S`` so
  that the four fit (H200 figures of 2026-11-26: ~11.6 s per rollout for dsrl with hf, ~10 s for TRL, plus ~40 s
  of start-up each); a side that runs out of time reports the rollouts it finished. Its dsrl processes also
  report ``dsrl plan``'s memory prediction, the memory allocated as each generation starts, the offload's
  seconds, a bucketed weight copy and the training phase's tokens per second (MFU): the section's memory tables
  (bench/gpu/memory_tables.py);
- rollout-128 (5 min): bench/rollout.py, hf vs cb under dsrl's packed attention and under the dense mask,
  0.5B shape, bf16, C = 128, N = 512, geometric lengths of mean 64, 256 new tokens;
- e2e-hf (3 min): dsrl with ``hf`` end to end (the verdict's TRL rows are its comparison);
- auto-grid (6 min): bench/auto_grid.py --device cuda, hf vs cb in the training loop (dsrl's Trainer, 0.5B shape,
  bf16) at C = 32, 128, 512 with 8 and 256 new tokens, and what ``rollout.backend = "auto"`` picks in each cell:
  the figures that set the rule's GPU constants (dsrl/rollout/auto.py);
- e2e-cb (7 min): the end to end with continuous batching on every side;
- rollout-256 (5 min): as rollout-128 at C = 256;
- logprobs (3 min): bench/logprobs.py --device cuda, the chunked log-probs' memory and time;
- rollout-vllm (5 min), e2e-vllm (4 min): the vLLM column and dsrl's vLLM end to end, where vllm imports;
- overhead (4 min), throughput (5 min): bench/overhead.py and bench/throughput.py on the 0.5B shape;
- optim (4 min): bench/optim.py, torch's AdamW vs apex's FusedAdam (where it imports) vs DeepSpeed's;
- mismatch (3 min): bench/mismatch.py --device cuda, behavior log-probs against the trainer's;
- e2e-profile (6 min), only with ``--profile``: one profiled rollout per side (bench/_profile.py), in a part of
  its own after every timed one, so a profile can never push timed rollouts past their bound.

A part that runs past its bound is stopped (its process group killed) and reported with what it had written;
the next part goes on. The section also re-derives ``rollout.backend = "auto"`` and ``cb_attention = "auto"``
from the measured tokens/s, sets dsrl's end-to-end figures against issue 26's targets and, where dsrl is slower
or heavier than TRL, says per phase where the time and memory go (with ``--profile``: the top operators) and
what would close it. ``--smoke`` runs the same parts with the same sides on tiny shapes on the CPU and never
writes docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib.metadata
import importlib.util
import json
import os
import shlex
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: the benchmarks' shared helpers

from _common import BENCH_OUT_ENV, REPO, bench_env, machine, record, run_process, table  # noqa: E402

BUDGET_S = 25 * 60
PART_LIMIT_S = 8 * 60
SMOKE_BUDGET_S = 900  # with TRL importable: 4 + 1 + 3 end-to-end processes and 2 grid cells on 2 shared cores
SMOKE_PART_LIMIT_S = 240  # the verdict part runs four processes (two where TRL is absent)
SMOKE_EXPECTED_S = 10
STATE_DIR = REPO / "runs" / "gpu_bench"
TITLE = "GPU round: every GPU measurement (bench/gpu/measure.py)"
STALE_S = 12 * 3600  # a state older than this is not resumed
VERSIONED = ("torch", "transformers", "deepspeed", "trl", "accelerate", "datasets", "vllm", "apex", "flash_attn",
             "megatron.core")


@dataclass
class Ctx:
    smoke: bool
    device: str
    workdir: Path

    def json(self, part: str) -> str:
        return str(self.workdir / f"{part}.json")


@dataclass
class Part:
    name: str
    title: str
    gpu: Callable[[Ctx], list[str]]  # script and arguments on a GPU
    smoke: Callable[[Ctx], list[str]]  # ... and in the CPU smoke run
    bound_s: float
    expected_s: float  # what it usually takes on one H100 (--window packs calls with it)
    kind: str = "body"  # rollout | e2e | body (the sub-benchmark's report() body, collected through $DSRL_BENCH_OUT)
    needs: Callable[[Ctx], str | None] = field(default=lambda ctx: None)
    smoke_note: str = ""


def _has(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _needs_vllm(ctx: Ctx) -> str | None:
    return None if _has("vllm") else "vllm is not importable here (its wheels are larger than a device call carries)"


ROLLOUT_GPU = ["--device", "cuda", "--shapes", "0.5b", "--sequences", "512", "--max_new_tokens", "256", "--mean_len",
               "64", "--repeats", "1", "--no-record"]
ROLLOUT_SMOKE = ["--device", "cpu", "--shapes", "tiny32", "--sequences", "32", "--max_new_tokens", "8", "--mean_len",
                 "8", "--repeats", "1", "--no-record"]
E2E_ROLLOUTS = 5  # per process: the first carries warm-up costs, the medians are over the other four
E2E_SIDE_S = 112  # per process of the verdict part: four of them (start-ups included) fit in E2E_BOUND_S
E2E_BOUND_S = 8 * 60
E2E_GPU = ["--device", "cuda", "--workloads", "main", "--repeats", "1", "--rollouts", str(E2E_ROLLOUTS),
           "--gradient_checkpointing", "on", "--no-record"]
E2E_SMOKE = ["--device", "cpu", "--workloads", "main", "--shape", "tiny", "--prompts_per_rollout", "2",
             "--samples_per_prompt", "2", "--mini_batch_size", "2", "--micro_batch_size", "1", "--max_new_tokens", "4",
             "--rollouts", "2",
             "--repeats", "1", "--gradient_checkpointing", "on", "--profile_skip", "1", "--profile_window", "2",
             "--worker_timeout", "90", "--no-record"]
ALL_SIDES = ["--sides", "dsrl", "trl", "trl-ds"]
# the verdict: dsrl `auto` with dsrl.memory.offload_states off and on, TRL's two sides under their default generate
VERDICT_SIDES = ["--sides", "dsrl", "dsrl-offload", "trl", "trl-ds", "--dsrl_backends", "auto"]
AUTO_GRID_S = 330  # the auto-grid part's one process (its cells share one start-up), within the part's bound


def _rollout(name: str, gpu_c: list[int], smoke_c: list[int], backends: list[str]) -> tuple[Callable, Callable]:
    extra = ["--cb_attention", "varlen", "model"] if "cb" in backends else []  # the slow dense mask last

    def gpu(ctx: Ctx) -> list[str]:
        return ["bench/rollout.py", *ROLLOUT_GPU, "--concurrency", *map(str, gpu_c), "--backends", *backends, *extra,
                "--json", ctx.json(name)]

    def smoke(ctx: Ctx) -> list[str]:
        return ["bench/rollout.py", *ROLLOUT_SMOKE, "--concurrency", *map(str, smoke_c), "--backends", *backends,
                *extra, "--json", ctx.json(name)]

    return gpu, smoke


def _e2e(name: str, backends: list[str], gpu_extra: list[str], smoke_sides: list[str], profile: bool = False,
         smoke_extra: tuple[str, ...] = ()) -> tuple[Callable, Callable]:
    def prof(ctx: Ctx) -> list[str]:
        return ["--profile_dir", str(ctx.workdir / "profiles")] if profile else []

    def gpu(ctx: Ctx) -> list[str]:
        return ["bench/e2e.py", *E2E_GPU, "--backends", *backends, *gpu_extra, *prof(ctx), "--json",
                ctx.json(name)]

    def smoke(ctx: Ctx) -> list[str]:
        return ["bench/e2e.py", *E2E_SMOKE, *smoke_extra, "--backends", *backends, "--sides", *smoke_sides,
                *prof(ctx), "--json", ctx.json(name)]

    return gpu, smoke


def parts(profile: bool = False) -> list[Part]:
    """Every part, in the order they run (``profile``: with the profiled end-to-end part, last)."""
    r128, r128s = _rollout("rollout-128", [128], [16], ["cb"])
    r256, r256s = _rollout("rollout-256", [256], [32], ["cb"])
    rv, rvs = _rollout("rollout-vllm", [128, 256], [16], ["vllm"])
    # the verdict: dsrl `auto` with the offload off and on, TRL's sides under generate (their default): four
    # processes; dsrl with `hf` has a part of its own (e2e-hf)
    e2e, e2es = _e2e("e2e", ["auto", "hf"], [*VERDICT_SIDES, "--worker_timeout", str(E2E_SIDE_S)],
                     ["dsrl", "dsrl-offload", "trl", "trl-ds"], smoke_extra=("--dsrl_backends", "auto"))
    e_hf, e_hfs = _e2e("e2e-hf", ["hf"], ["--sides", "dsrl", "--worker_timeout", "130"], ["dsrl"])
    e_cb, e_cbs = _e2e("e2e-cb", ["cb"], [*ALL_SIDES, "--worker_timeout", "130"], ["dsrl"])
    e_v, e_vs = _e2e("e2e-vllm", ["vllm"], ["--sides", "dsrl", "trl", "--worker_timeout", "200"], ["dsrl"],
                     smoke_extra=("--shape", "tiny32"))  # vLLM's CPU kernels need head size >= 32
    # one timed rollout (its figures are not used) and then the profiled one, per side; ~40 s of start-up each
    e_p, e_ps = _e2e("e2e-profile", ["hf"], [*ALL_SIDES, "--rollouts", "1", "--worker_timeout", "70",
                                              "--profile_timeout", "85"],
                     ["dsrl", "trl", "trl-ds"], profile=True, smoke_extra=("--rollouts", "1"))
    extra = [Part("e2e-profile", "End to end vs TRL, one profiled rollout per side", e_p, e_ps, PART_LIMIT_S, 400,
                  "e2e", smoke_note="profiles only: the timed figures come from the e2e part")] if profile else []
    return [
        Part("e2e", "End to end vs TRL: the verdict", e2e, e2es, E2E_BOUND_S, 4 * E2E_SIDE_S, "e2e"),
        Part("rollout-128", "Rollout tokens/s, C = 128", r128, r128s, 300, 150, "rollout"),
        Part("e2e-hf", "End to end, dsrl with generate", e_hf, e_hfs, 180, 130, "e2e"),
        Part("auto-grid", "The auto backend in the training loop",
             lambda ctx: ["bench/auto_grid.py", "--device", "cuda", "--cell_timeout", str(AUTO_GRID_S), "--json",
                          ctx.json("auto-grid"), "--no-record"],
             lambda ctx: ["bench/auto_grid.py", "--smoke", "--json", ctx.json("auto-grid"), "--no-record"],
             AUTO_GRID_S + 30, 240),
        Part("e2e-cb", "End to end vs TRL, continuous batching", e_cb, e_cbs, 420, 270, "e2e",
             smoke_note="dsrl only in the smoke: TRL's continuous batching took ~8 s per 16 tokens and ~11 GB of "
                        "host memory on the CPU"),
        Part("rollout-256", "Rollout tokens/s, C = 256", r256, r256s, 300, 150, "rollout"),
        Part("logprobs", "Chunked log-prob memory",
             lambda ctx: ["bench/logprobs.py", "--device", "cuda", "--rows", "8", "--seq", "1024", "--no-record"],
             lambda ctx: ["bench/logprobs.py", "--device", "cpu", "--rows", "1", "--seq", "8", "--repeats", "1",
                          "--no-record"], 180, 60),
        Part("rollout-vllm", "Rollout tokens/s, vLLM", rv, rvs, 300, 180, "rollout", needs=_needs_vllm),
        Part("e2e-vllm", "End to end, dsrl with vLLM", e_v, e_vs, 240, 150, "e2e", needs=_needs_vllm),
        Part("overhead", "Step overhead vs raw DeepSpeed",
             lambda ctx: ["bench/overhead.py", "--size", "0.5b", "--max_len", "1024", "--reps", "5", "--no-record"],
             lambda ctx: ["bench/overhead.py", "--size", "tiny", "--max_len", "32", "--reps", "1", "--micro_batches",
                          "2", "--device_batch", "2", "--no-record"], 240, 90),
        Part("throughput", "Token-budget training throughput",
             lambda ctx: ["bench/throughput.py", "--size", "0.5b", "--max_len", "4096", "--steps", "3", "--no-record"],
             lambda ctx: ["bench/throughput.py", "--size", "tiny", "--max_len", "64", "--steps", "1", "--mini_batch",
                          "4", "--no-record"], 300, 120),
        Part("optim", "Optimizer step: apex / DeepSpeed FusedAdam",
             lambda ctx: ["bench/optim.py", "--device", "cuda", "--size", "0.5b", "--no-record"],
             lambda ctx: ["bench/optim.py", "--device", "cpu", "--size", "tiny", "--steps", "3", "--no-record"],
             240, 90),
        Part("mismatch", "Behavior-policy mismatch",
             lambda ctx: ["bench/mismatch.py", "--device", "cuda", "--no-record"],
             lambda ctx: ["bench/mismatch.py", "--device", "cpu", "--backends", "hf", "cb", "--dtypes", "float32",
                          "--prompts", "2", "--samples_per_prompt", "2", "--max_new_tokens", "4", "--no-record"],
             180, 60),
        *extra,
    ]


# -- running --------------------------------------------------------------------------------------------------


def run_bounded(argv: list[str], env: dict[str, str], limit: float, log: Path) -> tuple[int | None, float]:
    """Run ``argv`` in its own process group for at most ``limit`` seconds (then the whole group is killed;
    :func:`_common.run_process`); (exit code or None when stopped, seconds)."""
    done = run_process(argv, env=env, timeout=limit, log=log)
    return done.returncode, done.seconds


def part_env(ctx: Ctx, out: Path) -> dict[str, str]:
    return bench_env(ctx.device, **{BENCH_OUT_ENV: str(out)})


def collect(part: Part, ctx: Ctx, body_path: Path) -> dict[str, Any] | None:
    """The part's results: its --json file (rollout, e2e) or its report() body; None when it wrote nothing."""
    path = Path(ctx.json(part.name)) if part.kind in ("rollout", "e2e") else body_path
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def tail(path: Path, lines: int = 12) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def run_parts(state: dict[str, Any], ctx: Ctx, selected: list[Part], budget: float, part_limit: float,
              window: float | None, save: Callable[[], None]) -> bool:
    """Run the pending parts; True when none is left pending (all done, skipped or stopped)."""
    call_t0 = time.perf_counter()
    (ctx.workdir / "logs").mkdir(parents=True, exist_ok=True)
    for part in selected:
        entry = state["parts"].get(part.name)
        if entry and entry["status"] != "interrupted":
            continue
        reason = part.needs(ctx)
        if reason:
            state["parts"][part.name] = {"status": "skipped", "reason": reason, "seconds": 0.0}
            save()
            continue
        budget_left = budget - state["spent_s"]
        bound = min(part.bound_s, part_limit)
        if budget_left < 20:
            state["parts"][part.name] = {"status": "skipped", "seconds": 0.0,
                                         "reason": f"the {budget / 60:g}-minute budget was spent"}
            save()
            continue
        limit = min(bound, budget_left)
        by_window = False
        if window is not None:
            window_left = window - (time.perf_counter() - call_t0)
            retried = bool(entry)  # interrupted once by a window: this time it gets its whole bound or waits
            expected = SMOKE_EXPECTED_S if ctx.smoke else part.expected_s
            if window_left < (limit if retried else min(limit, 1.25 * expected)):
                print(f"[gpu] {part.name}: {window_left:.0f} s left in this call's window; run the same command "
                      "again to go on", flush=True)
                return False
            by_window = window_left < limit
            limit = min(limit, window_left)
        argv = part.smoke(ctx) if ctx.smoke else part.gpu(ctx)
        body_path = ctx.workdir / f"{part.name}.body.json"
        body_path.unlink(missing_ok=True)
        log = ctx.workdir / "logs" / f"{part.name}.log"
        print(f"[gpu] {part.name}: {shlex.join(['python', *argv])} (limit {limit:.0f} s)", flush=True)
        rc, seconds = run_bounded([sys.executable, *argv], part_env(ctx, body_path), limit, log)
        state["spent_s"] += seconds
        if rc is None:
            status = "interrupted" if by_window and not entry else "timeout"
        else:
            status = "ok" if rc == 0 else "failed"
        state["parts"][part.name] = {
            "status": status, "seconds": seconds, "limit_s": limit, "command": shlex.join(["python", *argv]),
            "data": collect(part, ctx, body_path), "log_tail": tail(log) if status != "ok" else "",
            "reason": part.smoke_note if ctx.smoke else "",
        }
        print(f"[gpu] {part.name}: {status} in {seconds:.0f} s (spent {state['spent_s']:.0f} of {budget:.0f} s)",
              flush=True)
        save()
        if status == "interrupted":
            return False
    return all(state["parts"].get(p.name, {}).get("status") not in (None, "interrupted") for p in selected)


# -- the section ----------------------------------------------------------------------------------------------


def versions() -> str:
    out = []
    for mod in VERSIONED:
        dist = {"flash_attn": "flash-attn", "megatron.core": "megatron-core", "apex": "apex"}.get(mod, mod)
        if not _has(mod):
            out.append(f"{dist} absent")
            continue
        try:
            out.append(f"{dist} {importlib.metadata.version(dist)}")
        except importlib.metadata.PackageNotFoundError:
            out.append(f"{dist} (version unknown)")
    return ", ".join(out)


def section(state: dict[str, Any], ctx: Ctx, selected: list[Part]) -> str:
    """The markdown body of the dated section."""
    from _e2e_report import census_table, results_table, verdict_table
    from tables import auto_section, e2e_results, rollout_cells, rollout_table, where_section

    gpu = ctx.device != "cpu"
    parts_state = state["parts"]
    rows = []
    for p in selected:
        e = parts_state.get(p.name, {"status": "not run", "seconds": 0.0})
        note = e.get("reason") or ""
        if e["status"] in ("failed", "timeout") and e.get("log_tail"):
            note = (note + " " if note else "") + "last line: " + (e["log_tail"].strip().splitlines() or [""])[-1][:160]
        rows.append([p.name, e["status"], f"{e.get('seconds', 0.0):.0f}", f"{e.get('limit_s', p.bound_s):.0f}",
                     note.replace("|", "/")])
    smoke = "Smoke run (tiny shapes, CPU): the figures mean nothing, the mechanism is what is checked. "
    head = f"Budget {state['budget_s'] / 60:g} minutes, {state['spent_s']:.0f} s spent; {versions()}."
    out = [(smoke if ctx.smoke else "") + head,
           "", table(["part", "status", "seconds", "limit s", "note"], rows)]
    cells = rollout_cells(parts_state)
    if cells:
        meta = cells[0]["meta"]
        out += ["", "#### Rollout tokens/s", "",
                f"{meta.get('device')}, {meta.get('dtype') or ('float32' if not gpu else 'bfloat16')}, "
                f"max_new_tokens {meta.get('max_new_tokens')}, geometric lengths of mean {meta.get('mean_len')}, "
                f"G = {meta.get('samples_per_prompt')}, {meta.get('repeats')} round(s), N sequences per call at "
                "concurrency C (bench/rollout.py); cb/varlen = dsrl's packed attention, cb/model = the model's "
                "(sdpa: dense mask).", "", rollout_table(cells),
                "", "#### `auto` choices re-derived", "", auto_section(cells, ctx.device)]
    results = e2e_results(parts_state)
    if results:
        first = next((parts_state[n]["data"] for n in parts_state
                      if n.startswith("e2e") and (parts_state[n].get("data") or {}).get("workload")), {})
        from e2e import Workload, describe

        wl = first.get("workload", {})
        w = Workload(**{k: v for k, v in wl.items() if k in Workload.__dataclass_fields__})
        picks = {b: p for n in parts_state for b, p in ((parts_state[n].get("data") or {}).get("auto_picks") or {}
                                                         ).items()}
        out += ["", "#### End to end vs TRL GRPOTrainer", "", describe(w, first.get("repeats", 1), gpu, picks), "",
                results_table(results, gpu)]
        verdict = verdict_table(results)
        if verdict:
            out += ["", "Against issue 26's targets (dsrl's rollouts per second over TRL's, TRL under its default "
                    "generation; peak memory against TRL + DeepSpeed's; old log-prob seconds against TRL's):", "",
                    verdict]
        census = census_table(results)
        if census:
            out += ["", "Resident memory after the first rollout, by role (MiB):", "", census]
        out += ["", "#### Where the time and memory go", "", where_section(results, gpu)]
        from memory_tables import memory_section

        memory = memory_section(results, gpu)
        if memory:
            out += ["", "#### Memory: dsrl plan against the measured peaks, offload, weight sync, MFU", "", memory]
    for p in selected:
        e = parts_state.get(p.name) or {}
        data = e.get("data")
        if p.kind == "body" and data and data.get("body"):
            out += ["", f"#### {p.title} ({data.get('title', '').split('(')[-1].rstrip(')') or p.name})", "",
                    f"Command: `{e.get('command') or data.get('command', '')}`", "", data["body"].strip()]
    return "\n".join(out) + "\n"


def write_outputs(body: str, ctx: Ctx, out_dir: str | None, command: str, state: dict[str, Any]) -> Path:
    stamp = _dt.datetime.now().strftime("%Y-%m-%d %H:%M")
    text = f"\n### {TITLE} ({stamp})\n\nCommand: `{command}`  \nMachine: {machine()}\n\n{body.rstrip()}\n"
    path = ctx.workdir / "section.md"
    path.write_text(text)
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        Path(out_dir, "section.md").write_text(text)
        Path(out_dir, "state.json").write_text(json.dumps(state, indent=1))
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, about 2 minutes; never records")
    ap.add_argument("--no-record", dest="no_record", action="store_true", help="print; do not append the section")
    ap.add_argument("--parts", nargs="+", default=None, help="only these parts (default: all, in order)")
    ap.add_argument("--budget", type=float, default=None, help=f"seconds for all parts (default {BUDGET_S}; "
                    f"smoke {SMOKE_BUDGET_S})")
    ap.add_argument("--part_limit", type=float, default=None, help=f"seconds per part at most (default "
                    f"{PART_LIMIT_S}; smoke {SMOKE_PART_LIMIT_S})")
    ap.add_argument("--window", type=float, default=None, help="stop starting parts after this many seconds of this "
                    "call; --resume goes on (for machines lent in calls of <= 10 minutes)")
    ap.add_argument("--profile", action="store_true", help="also run e2e-profile (last): one profiled rollout per "
                    "end-to-end side, for the top operators of 'where the time and memory go'")
    ap.add_argument("--resume", action="store_true", help=f"go on from {STATE_DIR.relative_to(REPO)}/state.json "
                    "when it is there (and fresh)")
    ap.add_argument("--workdir", default=None, help=f"state, logs and part outputs (default: "
                    f"{STATE_DIR.relative_to(REPO)}; a fresh temporary folder with --smoke)")
    ap.add_argument("--out", default=None, help="also write section.md and state.json here after every call")
    ap.add_argument("--append", default=None, help="append this section file (from --out) to docs/benchmarks.md "
                    "and exit")
    args = ap.parse_args()
    if args.append:
        from _common import RESULTS

        text = Path(args.append).read_text()
        if f"### {TITLE}" not in text:
            raise SystemExit(f"{args.append} is not a section written by bench/gpu/measure.py (no '### {TITLE}' line)")
        with open(RESULTS, "a", encoding="utf-8") as f:
            f.write(text if text.startswith("\n") else "\n" + text)
        print(f"appended {args.append} to {RESULTS.relative_to(REPO)}")
        return
    import torch

    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("bench/gpu/measure.py measures a GPU and none is visible here (torch.cuda.is_available() is "
                         "False); on a CPU machine run: python bench/gpu/measure.py --smoke --no-record")
    all_parts = parts(profile=args.profile)
    names = [p.name for p in all_parts]
    unknown = sorted(set(args.parts or []) - set(names))
    if unknown:
        raise SystemExit(f"--parts {' '.join(unknown)}: unknown; the parts are {', '.join(names)}")
    selected = [p for p in all_parts if args.parts is None or p.name in args.parts]
    budget = args.budget or (SMOKE_BUDGET_S if args.smoke else BUDGET_S)
    part_limit = min(args.part_limit or (SMOKE_PART_LIMIT_S if args.smoke else PART_LIMIT_S), PART_LIMIT_S)
    workdir = (Path(args.workdir) if args.workdir else
               Path(tempfile.mkdtemp(prefix="gpu_smoke_")) if args.smoke else STATE_DIR)
    workdir.mkdir(parents=True, exist_ok=True)
    ctx = Ctx(smoke=args.smoke, device="cpu" if args.smoke else "cuda", workdir=workdir)
    state_path = workdir / "state.json"
    state: dict[str, Any] | None = None
    if args.resume and state_path.exists():
        old = json.loads(state_path.read_text())
        if time.time() - old.get("started", 0) < STALE_S and old.get("budget_s") == budget:
            state = old
            print(f"[gpu] resuming: {len(old['parts'])} part(s) already settled, {old['spent_s']:.0f} s spent",
                  flush=True)
    if state is None:
        state = {"started": time.time(), "budget_s": budget, "spent_s": 0.0, "parts": {}}

    def save() -> None:
        tmp = state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=1))
        os.replace(tmp, state_path)

    save()
    done = run_parts(state, ctx, selected, budget, part_limit, args.window, save)
    body = section(state, ctx, selected)
    command = "python bench/gpu/measure.py" + (" " + shlex.join(sys.argv[1:]) if sys.argv[1:] else "")
    path = write_outputs(body, ctx, args.out, command, state)
    if not done:
        print(body)
        pending = [p.name for p in selected if state["parts"].get(p.name, {}).get("status") in (None, "interrupted")]
        print(f"[gpu] not finished: {', '.join(pending)} pending; the section so far is in {path}", flush=True)
        return
    if args.smoke or args.no_record:
        print(body)
        return
    record(TITLE, command, body)


if __name__ == "__main__":
    main()
