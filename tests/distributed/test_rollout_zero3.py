"""The hf and cb rollout backends under ZeRO-3 on 2 ranks (cb under dsrl's packed attention): uneven work
per rank never hangs and matches a plain module."""

from __future__ import annotations

import json

import pytest
from conftest import EXTENDED, REPO, launch


# cb under the dense mask (its default on this tiny model) runs under ZeRO-3 in tests/distributed/test_learning.py;
# the parameter gather is the same for both attentions.
@pytest.mark.parametrize("backend,cb_attention", [("hf", "auto"), pytest.param("cb", "varlen", marks=EXTENDED)])
def test_zero3_uneven_generation_matches_plain_module(tmp_path, backend, cb_attention):
    """2 ranks under ZeRO-3: rank 0 generates 3 prompts x 3 samples (12 tokens max), rank 1 one prompt
    (5 tokens max), then rank 1 none at all; no hang, every generation equals the plain module's,
    each generate call issues the same fixed collectives (the one parameter gather) on every rank, and
    identical work gives identical completions on both ranks. hf also probes why the hooks are suspended.
    cb runs under the model's attention (dense mask) and under dsrl's packed attention."""
    out = tmp_path / "report.json"
    probe = ["--hooks_probe"] if backend == "hf" else []
    launch(["tests/workers/rollout_worker.py", "--out", str(out), "--backend", backend, "--cb_attention",
            cb_attention, *probe], nprocs=2,
           timeout=240, env={"PYTHONPATH": str(REPO)})
    reports = json.loads(out.read_text())
    assert [r["rank"] for r in reports] == [0, 1]
    per_call = {rd["collectives"] for r in reports for rd in r["rounds"]}
    assert len(per_call) == 1 and per_call.pop() > 0  # one gather per call, independent of the work
    for r in reports:
        assert all(rd["equal"] and rd["training_mode_restored"] for rd in r["rounds"]), r
        assert r["partitioned_after"] and r["persistent_params"] == 0
        assert r["train_step_applied"] and r["train_loss_finite"]
        if backend == "hf":
            probe = r["hooks_probe"]
            assert probe["suspended"]["collectives"] == r["rounds"][0]["collectives"]
            assert probe["hooks_on"]["collectives"] > probe["suspended"]["collectives"]  # why hooks are suspended
    assert reports[0]["same_work"] == reports[1]["same_work"] and len(reports[0]["same_work"]) == 6
    assert reports[0]["rounds"][0]["completions"] == 9 and reports[1]["rounds"][0]["completions"] == 3
    assert reports[1]["rounds"][1]["completions"] == 0
    assert reports[0]["rounds"][0]["tokens"] != reports[1]["rounds"][0]["tokens"]
