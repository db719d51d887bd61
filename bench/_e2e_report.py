"""bench/e2e.py's results as tables: per-side summaries of the workers' per-rollout records, the main table
(seconds per phase, tokens/s, peak memory, TRL/dsrl ratios) and the resident-memory census."""

from __future__ import annotations

import statistics
from typing import Any

from _common import table
from _profile import PHASES

SIDE_NAMES = {"dsrl": "dsrl", "dsrl-offload": "dsrl, offload_states", "trl": "TRL default", "trl-ds": "TRL + DeepSpeed"}
DSRL_SIDES = ("dsrl", "dsrl-offload")
# what a dsrl worker reports beside its records (bench/_e2e_workers.py run_dsrl), kept from its first process
CARRIED = ("plan_memory", "params", "weights_mib", "device_name", "generation_start_mib", "weight_sync_probe")


def summarize(records: list[dict[str, Any]], w: Any) -> dict[str, float]:
    """Medians over the rollouts after the first; peak memory is the maximum over all of them."""
    steady = records[1:] or records
    med = {k: statistics.median(r[k] for r in steady) for k in ("rollout_s", "generate_s", "logprobs_s")}
    train = [r["rollout_s"] - r["generate_s"] - r["logprobs_s"] for r in steady]
    med["train_s"] = statistics.median(train)
    med["gen_tok_s"] = statistics.median(r["completion_tokens"] / max(r["generate_s"], 1e-9) for r in steady)
    med["train_tok_s"] = statistics.median(w.epochs_per_rollout * r["sequence_tokens"] / max(t, 1e-9)
                                           for r, t in zip(steady, train))
    med["mean_len"] = statistics.mean(r["completion_tokens"] for r in steady) / w.rollout_size
    peaks = [r["peak_mb"] for r in records if r.get("peak_mb") is not None]
    med["peak_mb"] = max(peaks) if peaks else None
    for p in PHASES:
        peaks = [r.get(f"peak_{p}_mb") for r in records if r.get(f"peak_{p}_mb") is not None]
        med[f"peak_{p}_mb"] = max(peaks) if peaks else None
    med["rollouts"] = len(steady)
    for key in ("offload_s", "reload_s", "weight_sync_s", "train_phase_s"):  # dsrl's rows only
        if all(key in r for r in steady):
            med[key] = statistics.median(r[key] for r in steady)
    if all("train_phase_s" in r for r in steady):  # model FLOPs of the training phase: tokens it trained on per s
        med["train_phase_tok_s"] = statistics.median(w.epochs_per_rollout * r["sequence_tokens"]
                                                     / max(r["train_phase_s"], 1e-9) for r in steady)
    return med


def combine(runs: list[dict[str, Any]], w: Any) -> dict[str, Any]:
    """One side's runs (process repetitions) -> medians of their summaries, the first census and profile."""
    done = [r for r in runs if r["records"]]
    out: dict[str, Any] = {"status": ",".join(sorted({r["status"] for r in runs})), "processes": len(runs),
                           "seconds": sum(r["seconds"] for r in runs),
                           "errors": [r["error"] for r in runs if r.get("error")]}
    if done:
        sums = [summarize(r["records"], w) for r in done]
        out["summary"] = {k: (statistics.median(s[k] for s in sums) if sums[0][k] is not None else None)
                          for k in sums[0]}
        out["per_process_s"] = [s["rollout_s"] for s in sums]
    out["census"] = next((r["census"] for r in runs if r.get("census")), None)
    for key in CARRIED:
        value = next((r[key] for r in runs if r.get(key)), None)
        if value is not None:
            out[key] = value
    out["profile"] = next((r["profile"] for r in runs if r.get("profile")), None)
    return out


def _sec(x: float) -> str:
    """Seconds with three significant digits below 1 s (short rollouts), two decimals above."""
    return f"{x:.3g}" if abs(x) < 1 else f"{x:.2f}"


def _fmt(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def results_table(results: dict[str, dict[str, Any]], gpu: bool) -> str:
    """The markdown table of :func:`main`'s results ({backend: {side: combine() or {"skipped": reason}}})."""
    rows = []
    for backend, sides in results.items():
        base = sides.get("dsrl", {}).get("summary")
        for side, r in sides.items():
            if "skipped" in r:
                rows.append([backend, SIDE_NAMES[side], f"skipped: {r['skipped']}"] + [""] * 9)
                continue
            s = r.get("summary")
            if s is None:
                why = ("ran past its time limit before finishing a rollout" if "timeout" in r["status"]
                       else f"{r['status']}: {(r['errors'] or [''])[0].strip().splitlines()[-1:]}")
                rows.append([backend, SIDE_NAMES[side], why] + [""] * 9)
                continue
            peaks = ("/".join(_fmt(s[f"peak_{p}_mb"], ",.0f") for p in PHASES) if gpu else "-")
            vs = ""
            if side not in DSRL_SIDES and base is not None:
                vs = f"{s['rollout_s'] / base['rollout_s']:.2f} / {_ratio(base['peak_mb'], s['peak_mb'])}"
            note = " (partial)" if r["status"] != "ok" else ""
            rows.append([backend, SIDE_NAMES[side] + note, _sec(s["rollout_s"]), _sec(s["generate_s"]),
                         _sec(s["logprobs_s"]), _sec(s["train_s"]), f"{s['gen_tok_s']:,.0f}",
                         f"{s['train_tok_s']:,.0f}", f"{s['mean_len']:.1f}", _fmt(s["peak_mb"], ",.0f"), peaks, vs])
    return table(["backend", "trainer", "s/rollout", "generate s", "log-probs s", "train s", "gen tok/s",
                  "train tok/s", "mean len", "peak MiB", "peak MiB gen/lp/train", "TRL/dsrl time / dsrl/TRL mem"],
                 rows)


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or not b else f"{a / b:.2f}"


# the GPU targets: dsrl's rollouts per second over TRL's defaults' and over TRL + DeepSpeed's
SPEED_TARGETS = {"trl": 1.5, "trl-ds": 1.2}


def verdict_table(results: dict[str, dict[str, Any]]) -> str:
    """Every dsrl row (each backend it ran) against TRL's sides under TRL's default generation (the ``hf`` rows):
    rollouts per second over TRL's against the speed target, and the memory (<= TRL + DeepSpeed's peak) and old
    log-prob (<= TRL default's seconds) targets. Empty when no pair finished."""
    trl = {side: (results.get("hf", {}).get(side) or {}).get("summary") for side in SPEED_TARGETS}
    rows = []
    for backend, sides in results.items():
        for dsrl_side in DSRL_SIDES:
            d = (sides.get(dsrl_side) or {}).get("summary")
            if d:
                label = f"dsrl `{backend}`" + (", offload_states" if dsrl_side == "dsrl-offload" else "")
                rows += [_verdict_row(label, d, side, trl[side], target) for side, target in SPEED_TARGETS.items()
                         if trl[side]]
    if not rows:
        return ""
    return table(["dsrl", "against", "s/rollout dsrl / TRL", "rollouts/s dsrl over TRL", "peak MiB dsrl / TRL",
                  "old log-probs s dsrl / TRL"], rows)


def _verdict_row(label: str, d: dict[str, Any], side: str, t: dict[str, Any], target: float) -> list[str]:
    speed = t["rollout_s"] / d["rollout_s"]
    row = [label, SIDE_NAMES[side], f"{_sec(d['rollout_s'])} / {_sec(t['rollout_s'])}",
           f"{speed:.2f}x (>= {target}x: {'met' if speed >= target else 'missed'})"]
    if side == "trl-ds":
        met = d["peak_mb"] is not None and t["peak_mb"] is not None and d["peak_mb"] <= t["peak_mb"]
        row.append(f"{_fmt(d['peak_mb'], ',.0f')} / {_fmt(t['peak_mb'], ',.0f')} (<=: {'met' if met else 'missed'})")
    else:
        row.append("-")
    if side == "trl":
        met = d["logprobs_s"] <= t["logprobs_s"]
        row.append(f"{_sec(d['logprobs_s'])} / {_sec(t['logprobs_s'])} (<=: {'met' if met else 'missed'})")
    else:
        row.append("-")
    return row


def census_table(results: dict[str, dict[str, Any]]) -> str:
    """Resident memory by role after the first rollout, per backend and side (MiB)."""
    roles = ["weights", "gradients", "master weights", "optimizer state", "other", "allocated"]
    rows = []
    for backend, sides in results.items():
        for side, r in sides.items():
            c = r.get("census")
            if c:
                rows.append([backend, SIDE_NAMES[side]] + [_fmt(c.get(k), ",.1f") for k in roles])
    return table(["backend", "trainer", *roles], rows) if rows else ""
