"""The dated section bench/gpu/measure.py appends: its parts' results turned into tables, the ``auto`` choices
re-derived from the measured tokens/s, and where dsrl's time and memory go next to TRL's (from bench/_profile.py's
summaries). Pure functions of the parts' JSON, so the section can be rebuilt from a saved state."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: the benchmarks' shared helpers

from _common import table  # noqa: E402

MIN_GAP = 0.10  # a phase "costs more" when it is at least 10 % (and 0.05 s / 5 % of memory) above the other side


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


# -- rollout --------------------------------------------------------------------------------------------------


def rollout_cells(parts: dict[str, Any]) -> list[dict[str, Any]]:
    """Every (shape, C) cell measured by the rollout parts, with the part that measured it and its settings."""
    out = []
    for name, part in parts.items():
        data = part.get("data") or {}
        if not name.startswith("rollout") or "cells" not in data:
            continue
        for cell in data["cells"]:
            out.append({**cell, "part": name, "meta": data.get("meta", {})})
    return out


def rollout_table(cells: list[dict[str, Any]]) -> str:
    names = sorted({n for c in cells for n in c["rates"] if n != "hf"}, key=lambda n: (n != "vllm", n))
    rows = []
    for c in cells:
        hf = c["rates"].get("hf", [])
        lens = c["lengths"].get("hf") or [n for v in c["lengths"].values() for n in v]
        row = [c["part"], c["shape"], f"{c['params_m']:.1f} M", c["C"], c["N"],
               f"{statistics.mean(lens):.1f}" if lens else "-", f"{_median(hf):,.0f}" if hf else "-"]
        for n in names:
            rates = c["rates"].get(n, [])
            if not rates or not hf:
                row.append("-" if not rates else f"{_median(rates):,.0f}")
                continue
            ratios = [b / a for a, b in zip(hf, rates)]
            row.append(f"{_median(rates):,.0f} ({_median(ratios):.2f}x)")
        rows.append(row)
    heads = ["part", "shape", "params", "C", "N", "mean len (hf)", "hf tok/s"] + [f"{n} tok/s (x hf)" for n in names]
    return table(heads, rows)


def auto_rows(cells: list[dict[str, Any]], device: str) -> tuple[list[list[Any]], list[str]]:
    """``rollout.backend = "auto"`` and ``cb_attention = "auto"`` per measured cell under dsrl's rules
    (dsrl.rollout.auto / dsrl.rollout.cb), next to what the measurements say is fastest; disagreements listed.
    Must run on the machine that measured (the rules ask it whether PyTorch's flash kernel is there)."""
    import torch

    from dsrl.rollout.auto import GenerationWorkload, choose_backend
    from dsrl.rollout.cb import cb_attention_implementation, is_flash

    rows, flags = [], []
    for c in cells:
        meta = c["meta"]
        dev = torch.device(device)
        dtype = getattr(torch, meta.get("dtype") or ("float32" if device == "cpu" else "bfloat16"))
        attn = meta.get("attn") or "sdpa"
        params = int(c["params_m"] * 1e6)
        chosen_attn = cb_attention_implementation("auto", attn, dev, dtype, params, c["C"])
        att = "varlen" if (is_flash(chosen_attn) and chosen_attn != attn) else "model"
        new_tokens = int(meta.get("max_new_tokens") or 128)  # bench/rollout.py's default
        backend = choose_backend(GenerationWorkload(dev.type, attn, chosen_attn, params, c["C"], new_tokens)).backend
        auto_pick = "hf" if backend == "hf" else f"cb/{att}"
        rates = {n: _median(r) for n, r in c["rates"].items() if r}
        options = {n: v for n, v in rates.items() if n == "hf" or n.startswith("cb/")}
        best = max(options, key=options.get) if options else "-"
        cb_opts = {n: v for n, v in options.items() if n.startswith("cb/")}
        best_cb = max(cb_opts, key=cb_opts.get) if cb_opts else "-"
        fastest = max(rates, key=rates.get) if rates else "-"
        verdict = []
        if auto_pick in options and best != auto_pick:
            verdict.append(f"backend: {best} {options[best] / options[auto_pick]:.2f}x auto's {auto_pick}")
        if f"cb/{att}" in cb_opts and best_cb != f"cb/{att}":
            verdict.append(f"cb_attention: {best_cb.split('/')[1]} {cb_opts[best_cb] / cb_opts[f'cb/{att}']:.2f}x "
                           f"auto's {att}")
        where = f"{c['shape']} C={c['C']}"
        flags += [f"{where}: {v}" for v in verdict]
        rows.append([c["shape"], c["C"], dev.type, str(dtype).removeprefix("torch."), attn, auto_pick, att,
                     best, best_cb.split("/")[-1], fastest, "; ".join(verdict) or "agrees"])
    return rows, flags


def auto_section(cells: list[dict[str, Any]], device: str) -> str:
    if not cells:
        return "No rollout figures, so nothing to re-derive."
    rows, flags = auto_rows(cells, device)
    text = ("What dsrl's fixed rules pick for these cells (dsrl/rollout/auto.py `choose_backend`, dsrl/rollout/"
            "cb.py `cb_attention_implementation`) against the fastest measured option; the rules are not changed "
            "here.\n\n" + table(["shape", "C", "device", "dtype", "attention", "backend auto picks",
                                  "cb_attention auto picks", "fastest of hf/cb", "fastest cb attention",
                                  "fastest overall", "verdict"], rows))
    if flags:
        text += "\n\nDisagreements (measured option over auto's pick): " + "; ".join(flags) + "."
    else:
        text += "\n\nThe rules agree with every measured cell."
    return text


# -- end to end -----------------------------------------------------------------------------------------------


PROFILE_PART = "e2e-profile"


def e2e_results(parts: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """{backend: {side: results}} of every end-to-end part; the profile part only adds its profiles to the timed
    parts' entries (its own single rollout is never a timing)."""
    out: dict[str, dict[str, Any]] = {}
    for name, part in parts.items():
        data = part.get("data") or {}
        if name.startswith("e2e") and name != PROFILE_PART and "results" in data:
            for backend, sides in data["results"].items():  # side by side: the verdict's TRL rows, e2e-hf's dsrl
                merged = out.setdefault(backend, {})
                for side, r in sides.items():
                    if side not in merged or "skipped" in merged[side]:
                        merged[side] = r
    profiled = (parts.get(PROFILE_PART, {}).get("data") or {}).get("results") or {}
    for backend, sides in profiled.items():
        for side, r in sides.items():
            timed = out.get(backend, {}).get(side)
            if timed is not None and "skipped" not in timed and r.get("profile"):
                timed["profile"] = r["profile"]
    return out


def _phase_seconds(s: dict[str, Any]) -> dict[str, float]:
    return {"generate": s["generate_s"], "logprobs": s["logprobs_s"], "train": s["train_s"]}


def _top(profile: dict[str, Any] | None, phase: str, gpu: bool, k: int = 3) -> str:
    if not profile:
        return "-"
    p = profile["phases"][phase]
    key = "top_device" if gpu and p["top_device"] else "top_cpu"
    return ", ".join(f"{name} {ms:.0f} ms" if ms >= 1 else f"{name} {ms:.2f} ms" for name, ms, _ in p[key][:k]) or "-"


def where_section(results: dict[str, dict[str, Any]], gpu: bool) -> str:
    """Per backend: dsrl against each TRL side phase by phase (seconds, peak memory, busy fraction, top
    operators of the profiled rollout), and what the figures say would close each gap where dsrl is behind."""
    from _e2e_report import DSRL_SIDES, SIDE_NAMES

    blocks = []
    for backend, sides in results.items():
        d = sides.get("dsrl", {})
        if not d.get("summary"):
            continue
        others = {k: v for k, v in sides.items() if k not in DSRL_SIDES and v.get("summary")}
        if not others:
            continue
        rows = []
        for phase in ("generate", "logprobs", "train"):
            row = [phase, f"{_phase_seconds(d['summary'])[phase]:.2f}"]
            for r in others.values():
                row.append(f"{_phase_seconds(r['summary'])[phase]:.2f}")
            if gpu:
                row += [_fmt_mb(d["summary"].get(f"peak_{phase}_mb"))] + [
                    _fmt_mb(r["summary"].get(f"peak_{phase}_mb")) for r in others.values()]
            prof = d.get("profile")
            busy = prof["phases"][phase]["busy_fraction"] if prof else None
            row.append("-" if busy is None else f"{busy:.0%}")
            row.append(_top(prof, phase, gpu))
            for r in others.values():
                row.append(_top(r.get("profile"), phase, gpu))
            rows.append(row)
        heads = ["phase", "dsrl s"] + [f"{SIDE_NAMES[s]} s" for s in others]
        if gpu:
            heads += ["dsrl peak MiB"] + [f"{SIDE_NAMES[s]} peak MiB" for s in others]
        heads += ["dsrl device busy"] + ["dsrl top ops"] + [f"{SIDE_NAMES[s]} top ops" for s in others]
        notes = gap_notes(d, others, gpu)
        blocks.append(f"`{backend}`:\n\n" + table(heads, rows) + ("\n\n" + "\n".join(notes) if notes else ""))
    if not blocks:
        return "No end-to-end pair finished, so there is nothing to compare."
    return ("Phase by phase, per rollout (seconds: medians of the timed rollouts; peak: the phase's largest "
            "allocation; device busy and top operators: the profiled rollout, generation sampled over a window of "
            "decode steps, bench/_profile.py).\n\n" + "\n\n".join(blocks))


def _fmt_mb(x: float | None) -> str:
    return "-" if x is None else f"{x:,.0f}"


def gap_notes(d: dict[str, Any], others: dict[str, dict[str, Any]], gpu: bool) -> list[str]:
    """One line per phase and resource where dsrl is behind a TRL side, with the figure that explains it and
    what would close it."""
    from _e2e_report import SIDE_NAMES

    notes = []
    ds, dprof = d["summary"], d.get("profile")
    for side, r in others.items():
        ts, name = r["summary"], SIDE_NAMES[side]
        if ds["rollout_s"] <= ts["rollout_s"] * (1 + MIN_GAP / 2) and ds["peak_mb"] <= ts["peak_mb"] * 1.05:
            notes.append(f"- against {name}: dsrl is not behind ({ds['rollout_s']:.2f} vs {ts['rollout_s']:.2f} s "
                         f"per rollout, {ds['peak_mb']:,.0f} vs {ts['peak_mb']:,.0f} MiB peak).")
            continue
        for phase, dt in _phase_seconds(ds).items():
            tt = _phase_seconds(ts)[phase]
            if dt - tt > max(0.05, MIN_GAP * tt):
                notes.append(f"- {phase} vs {name}: {dt:.2f} vs {tt:.2f} s. " + _closing(phase, dprof, r, gpu))
        if ds["peak_mb"] > ts["peak_mb"] * 1.05:
            notes.append(f"- peak memory vs {name}: {ds['peak_mb']:,.0f} vs {ts['peak_mb']:,.0f} MiB. "
                         + _memory_closing(d, r, gpu))
    return notes


def _closing(phase: str, dprof: dict[str, Any] | None, other: dict[str, Any], gpu: bool) -> str:
    busy = dprof["phases"][phase]["busy_fraction"] if dprof else None
    if phase == "generate":
        if busy is not None and busy < 0.5:
            return (f"The GPU is busy {busy:.0%} of the traced decode steps: generation is bound by the host "
                    "(launches, Python); continuous batching with CUDA graphs (`cb`, packed attention) or vLLM "
                    "removes most of that, a faster `generate` cannot.")
        return "Both sides run the same transformers generation; compare the top operators above."
    if phase == "logprobs":
        if other["summary"]["logprobs_s"] == 0:
            return ("TRL skips the old log-prob pass when each batch is trained on once (it reuses the training "
                    "forward's detached log-probs); dsrl always scores them (rollout correction and the exact "
                    "ratio need them); skipping it in that case would close the gap.")
        return ("Compare the top operators: the pass is a no-grad forward over every rollout sequence; a larger "
                "`rollout.logprob_micro_batch_size` (fewer forwards) or the packed micro-batches (`model.packing`) "
                "shorten it.")
    hint = ("DeepSpeed's fp32 master-weight update and fp32 gradient accumulation (the same recipe on the TRL "
            "+ DeepSpeed side) and dsrl's exact normalisation pass")
    return f"Train covers the forward/backward, {hint}; the top operators above say which dominates."


def _memory_closing(d: dict[str, Any], other: dict[str, Any], gpu: bool) -> str:
    dc, tc = d.get("census") or {}, other.get("census") or {}
    parts = []
    for role in ("weights", "gradients", "master weights", "optimizer state", "other"):
        if role in dc and role in tc and dc[role] - tc[role] > 0.05 * max(dc.get("allocated", 1.0), 1.0):
            parts.append(f"{role} {dc[role]:,.0f} vs {tc[role]:,.0f} MiB")
    where = ""
    if gpu:
        peaks = {p: (d["summary"].get(f"peak_{p}_mb") or 0) - (other["summary"].get(f"peak_{p}_mb") or 0)
                 for p in ("generate", "logprobs", "train")}
        phase = max(peaks, key=peaks.get)
        where = f" The largest peak difference is in {phase} (+{peaks[phase]:,.0f} MiB)."
    resident = ("Resident between rollouts: " + "; ".join(parts) + ".") if parts else ""
    fix = (" fp32 master weights and moments are the precision recipe (TRL + DeepSpeed carries them too); a "
           "larger peak in a phase points at that phase's transient tensors (logits, caches).")
    return (resident + where + fix).strip()
