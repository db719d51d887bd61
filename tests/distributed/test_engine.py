"""RLEngine on 2 CPU ranks: scheduler takeover (closed form, skipped steps, resume), NaN safety on
every ZeRO stage, zero-token mini-batches, and ZeRO-3 with unequal micro-batch counts."""

from __future__ import annotations

import json
import math

from conftest import launch

LR, WARMUP, WMIN, CMIN, TOTAL = 0.1, 3, 0.1, 0.05, 8


def closed_form(step: int) -> float:
    """WarmupCosineLR (linear warmup) at optimizer step ``step`` (1-based): its value at index step-1."""
    i = step - 1
    if i < WARMUP:
        return LR * (WMIN + (1 - WMIN) * i / WARMUP)
    progress = (i - WARMUP + 1) / (TOTAL - WARMUP)
    return LR * (CMIN + (1 - CMIN) * (1 + math.cos(math.pi * progress)) / 2)


def _result(out, mode, tag, rank=0):
    return json.loads((out / f"result_{mode}_{tag}_{rank}.json").read_text())


def _worker(out, mode, *extra, nprocs=2):
    return launch(["tests/workers/engine_worker.py", "--mode", mode, "--out", str(out), *extra], nprocs=nprocs,
                  timeout=600)


def test_scheduler_closed_form_skip_and_resume(tmp_path):
    full, part = tmp_path / "full", tmp_path / "part"
    full.mkdir()
    part.mkdir()
    # Uninterrupted run with a NaN injected at call 4: 9 calls, 8 applied steps.
    _worker(full, "schedule", "--nan_at", "4")
    r = _result(full, "schedule", "run")
    assert r["world"] == 2 and r["optimizer_steps"] == TOTAL and r["skipped"] == 1 and r["finite"]
    assert r["applied"] == [True] * 4 + [False] + [True] * 4
    applied_lrs = [lr for lr, ok in zip(r["lrs"], r["applied"]) if ok]
    expected = [closed_form(k) for k in range(1, TOTAL + 1)]
    assert all(math.isclose(a, b, rel_tol=1e-12) for a, b in zip(applied_lrs, expected)), (applied_lrs, expected)
    assert r["lrs"][4] == r["lrs"][5]  # the skipped step did not advance the schedule
    after_warmup = applied_lrs[WARMUP:]
    assert all(a >= b for a, b in zip(after_warmup, after_warmup[1:]))
    assert min(applied_lrs) == applied_lrs[-1] and math.isclose(applied_lrs[-1], LR * CMIN, rel_tol=1e-12)
    # Stop after 3 applied steps (checkpoint), resume in fresh processes: the same curve continues.
    _worker(part, "schedule", "--stop_after", "3")
    first = _result(part, "schedule", "run")
    _worker(part, "schedule", "--resume", "--nan_at", "4")
    second = _result(part, "schedule", "resume")
    assert first["lrs"] + second["lrs"] == r["lrs"]
    assert second["optimizer_steps"] == TOTAL


def test_nan_never_reaches_weights_and_zero_token_batches(tmp_path):
    _worker(tmp_path, "nan")
    for rank in (0, 1):
        res = _result(tmp_path, "nan", "run", rank)
        for stage in ("0", "1", "2", "3"):
            r = res[stage]
            assert r["skipped"] and not r["applied"] and r["finite"] and r["unchanged"], (stage, r)
            assert r["lr_steps"] == 0, (stage, r)  # the skipped step did not advance the schedule
            assert r["empty_tokens"] == 0 and r["empty_loss"] == 0.0 and r["empty_unchanged"], (stage, r)
        # every stage reports the norm of the same gradient (ZeRO-0's computed by dsrl, DeepSpeed keeps none)
        norms = [res[stage]["grad_norm"] for stage in ("0", "1", "2", "3")]
        assert all(n > 0 and abs(n - norms[3]) <= 1e-6 * norms[3] for n in norms), norms


def test_zero3_unequal_micro_batch_counts(tmp_path):
    _worker(tmp_path, "zero3")
    r0, r1 = _result(tmp_path, "zero3", "run", 0), _result(tmp_path, "zero3", "run", 1)
    assert (r0["n_micro"], r1["n_micro"]) == (2, 7)
    assert r0["n_logps"] == 2 and r1["n_logps"] == 7
    assert r0["fillers"] == 5 and r1["fillers"] == 0
    assert r0["applied"] and r1["applied"] and r0["loss_finite"]
    # Log-prob forwards (fillers included: 7 on both ranks) run without autograd.
    assert r0["no_grad_forwards"] == r1["no_grad_forwards"] == 7
    assert r0["grad_enabled_forwards"] == r1["grad_enabled_forwards"] == 0
