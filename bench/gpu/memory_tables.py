"""The memory part of bench/gpu/measure.py's section, from bench/e2e.py's dsrl sides (``dsrl`` and
``dsrl-offload``, i.e.
``dsrl.memory.offload_states`` off and on): ``dsrl plan``'s prediction per phase against the measured peak, the
training memory left on the device as each generation starts, the offload's and the weight sync's seconds, and
the training phase's model FLOPs utilisation. Pure functions of the results (unit-tested on CPU with figures of the
right shape: tests/unit/test_bench_memory_report.py)."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: the benchmarks' shared helpers

from _common import table  # noqa: E402

# Dense bf16 tensor-core peaks (FLOP/s) from the vendors' data sheets; the first name the device's contains wins.
PEAK_BF16_FLOPS = (("H200", 989.4e12), ("H100 PCIe", 756.5e12), ("H100", 989.4e12), ("A100", 312e12),
                   ("L40S", 362.1e12))
MEASURED = {"generation": "peak_generate_mb", "logprobs": "peak_logprobs_mb", "training": "peak_train_mb"}
PLAN_GOAL = 0.15  # the goal: the plan within 15 % of the measured peak
LEFTOVER_GOAL = 1.10  # at most the bf16 weights plus 10 % on the device as generation starts
SYNC_GOAL_S = 0.3  # weight sync of the 0.5B shape, colocated


def peak_flops(device_name: str | None) -> float | None:
    for name, flops in PEAK_BF16_FLOPS:
        if device_name and name in device_name:
            return flops
    return None


def _dsrl_rows(results: dict[str, dict[str, Any]]) -> list[tuple[str, str, dict[str, Any]]]:
    from _e2e_report import DSRL_SIDES, SIDE_NAMES

    return [(backend, SIDE_NAMES[side], sides[side]) for backend, sides in results.items() for side in DSRL_SIDES
            if (sides.get(side) or {}).get("summary")]


def _mib(x: float | None) -> str:
    return "-" if x is None else f"{x:,.0f}"


def plan_table(results: dict[str, dict[str, Any]], gpu: bool) -> str:
    rows = []
    for backend, side, r in _dsrl_rows(results):
        plan = r.get("plan_memory") or {}
        for phase, key in MEASURED.items():
            predicted = (plan.get(phase) or {}).get("total_mib")
            measured = r["summary"].get(key) if gpu else None  # CPU: the process's resident set, not comparable
            ratio = measured / predicted if measured and predicted else None
            verdict = "-" if ratio is None else ("met" if abs(ratio - 1) <= PLAN_GOAL else "missed")
            rows.append([backend, side, phase, _mib(predicted), _mib(measured),
                         "-" if ratio is None else f"{ratio:.2f} ({verdict})"])
    return table(["backend", "trainer", "phase", "plan MiB", "measured peak MiB",
                  f"measured / plan (within {PLAN_GOAL:.0%})"], rows) if rows else ""


def leftover_table(results: dict[str, dict[str, Any]]) -> str:
    rows = []
    for backend, side, r in _dsrl_rows(results):
        starts = (r.get("generation_start_mib") or [])[1:]  # after a training phase (rollout 2 on)
        weights = r.get("weights_mib")
        if not starts or not weights:
            continue
        start = statistics.median(starts)
        ratio = start / weights
        rows.append([backend, side, _mib(start), _mib(weights), _mib(start - weights),
                     f"{ratio:.2f} (<= {LEFTOVER_GOAL}: {'met' if ratio <= LEFTOVER_GOAL else 'missed'})"])
    return table(["backend", "trainer", "allocated as generation starts MiB", "bf16 weights MiB",
                  "leftover MiB", "allocated / weights"], rows) if rows else ""


def traffic_table(results: dict[str, dict[str, Any]]) -> str:
    rows = []
    for backend, side, r in _dsrl_rows(results):
        s, probe = r["summary"], r.get("weight_sync_probe") or {}
        flops = peak_flops(r.get("device_name"))
        mfu = (6 * r["params"] * s["train_phase_tok_s"] / flops
               if flops and r.get("params") and s.get("train_phase_tok_s") else None)
        sync = probe.get("seconds")
        rows.append([backend, side, f"{s.get('offload_s', 0.0):.3f}", f"{s.get('reload_s', 0.0):.3f}",
                     f"{s.get('weight_sync_s', 0.0):.3f}",
                     "-" if sync is None else (f"{sync:.3f} ({probe['bytes'] / 2**20:,.0f} MiB, {probe['buckets']:.0f} "
                                               f"bucket(s); < {SYNC_GOAL_S} s: "
                                               f"{'met' if sync < SYNC_GOAL_S else 'missed'})"),
                     "-" if mfu is None else f"{mfu:.1%}"])
    return table(["backend", "trainer", "offload s", "reload s", "weight_sync_s (rows)",
                  "bucketed weight copy s", "training MFU"], rows) if rows else ""


def memory_section(results: dict[str, dict[str, Any]], gpu: bool) -> str:
    """The section's memory paragraph and tables (empty when no dsrl side finished a rollout)."""
    parts = [t for t in (plan_table(results, gpu), leftover_table(results), traffic_table(results)) if t]
    if not parts:
        return ""
    intro = ("dsrl without and with `dsrl.memory.offload_states` (docs/memory.md). `dsrl plan`'s per-phase "
             "prediction for the same run file and model against the measured peak of the phase (GPU: max "
             "allocated; the plan's generation phase is the `generate` peak, log-probs the old/reference passes, "
             "training the reward and train phases); the memory allocated as each generation starts (rollout 2 on, "
             "median) against the policy's bf16 weights; per-rollout offload and reload seconds and the rows' "
             "`weight_sync_s` (0 when the backend shares the policy's weights); the bucketed weight copy (512 MiB "
             "buckets into a second copy on the device, the fastest of three: what a colocated engine's load does "
             "at the least); training MFU = 6 x parameters x trained tokens per second of the training phase over "
             "the card's dense bf16 peak (recomputation under gradient checkpointing not counted).")
    return "\n\n".join([intro, *parts])
