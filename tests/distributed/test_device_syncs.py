"""No device synchronization where a GPU should run ahead, counted on the CPU (ARCHITECTURE §4 last rule, §7).

On 2 ranks under ZeRO 1-3, after two optimizer steps (from then on DeepSpeed's throughput timer, when on,
synchronizes on every forward of its engine's module): ``hf`` and ``cb`` generation and the old/reference log-prob
pass synchronize the device zero times; dsrl's device-to-host copies do not grow with the decode steps of a
generation, and a log-prob pass's results leave the device once whatever its number of micro-batches. A
continuous-batching backend keeps one manager for the run, and its greedy completions equal ``generate``'s after
each of several optimizer steps (ZeRO-3: over freshly gathered weights each call). With the timer turned on by the
user, training forwards are counted (the counter sees what it must); planted: with the engine's hooks left on the
module inside generation and no-grad passes, those passes synchronize (the guard fails).
"""

from __future__ import annotations

import json

import pytest
from conftest import REPO, launch


def run(tmp_path, stage: int, *flags: str) -> list[dict]:
    out = tmp_path / "report.json"
    launch(["tests/workers/sync_worker.py", "--out", str(out), "--stage", str(stage), *flags], nprocs=2, timeout=600,
           env={"PYTHONPATH": str(REPO)})
    return json.loads(out.read_text())


# ZeRO-2 runs with DeepSpeed's throughput timer turned on by the user: training forwards synchronize (counted: the
# counter sees what it must), generation and no-grad passes still do not (the engine's hooks are out of the way).
@pytest.mark.parametrize("stage,timer_on", [(1, False), (2, True), (3, False)])
def test_generation_and_logprob_passes_never_synchronize(tmp_path, stage, timer_on):
    for r in run(tmp_path, stage, *(["--timer_on"] if timer_on else [])):
        assert r["optimizer_steps"] >= 2, r
        for backend in ("hf", "cb"):
            short, long = r[f"{backend}_2"], r[f"{backend}_6"]
            assert short["syncs"] == long["syncs"] == 0, (backend, r)
            assert short["copies"] == long["copies"], (backend, short, long)  # none per decode step
        one, many = r["logprobs_1"], r["logprobs_16"]
        assert one["micro_batches"] > many["micro_batches"]
        assert one["syncs"] == many["syncs"] == 0, r
        # Per pass (old, reference): at most one count exchange before the first forward (it decides the filler
        # forwards) and one copy of the results, whatever the number of micro-batches.
        assert one["copies"] == many["copies"] <= 4, (one, many)
        assert (r["training"]["syncs"] > 0) == timer_on, r  # dsrl's ds_config turns the timer off by default
        assert all(r["greedy_equal"]) and r["greedy_changed"], r  # the kept manager sees every step
        assert (r["cb_calls"], r["cb_managers"]) == (3, 1), r


def test_planted_engine_hooks_inside_generation_are_counted(tmp_path):
    """The guard fails when generation and no-grad passes run the engine's hooks with the timer on."""
    for r in run(tmp_path, 1, "--timer_on", "--hooks_kept"):
        assert r["hf_6"]["syncs"] > r["hf_2"]["syncs"] > 0
        assert r["cb_6"]["syncs"] > 0 and r["logprobs_1"]["syncs"] > r["logprobs_16"]["syncs"] > 0
