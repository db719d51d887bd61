"""The Megatron engine (dsrl.backends.megatron.engine) built from a Hugging Face Llama (untied head) and Qwen2 (tied
head), on two CPU ranks (tests/workers/megatron_engine_worker.py):

- the application's fused log-probs run on it unchanged (float32 against the HF model's, every rank), and one exact
  step over an uneven split gives the float64 reference gradient of the mini-batch loss, read back in HF names, for
  token-mean and seq-mean-token-mean at TP = 2, PP = 2 and DP = 2 (a filler micro-batch);
- the default optimizer's steps keep the DP replicas equal;
- after a step, the weights streamed by HF name into a Hugging Face replica give the trainer's log-probs (TP = 2,
  PP = 2);
- the application's policy actor runs on it unchanged: its old and reference log-probs are the HF model's, its GRPO
  step applies (TP = 2, PP = 2);
- a run resumed from its dist-checkpointing checkpoint makes the saving run's next step bit for bit (TP = 2, PP = 2,
  DP = 2).

The first point is in the README suite; the others, and a planted head shard without its tensor group that fails
the first checks, are in the extended tier."""

from __future__ import annotations

import json

import pytest
from conftest import EXTENDED
from test_megatron import torchrun

pytest.importorskip("megatron.core")

LOGPROB_TOL = 1e-5  # float32, megatron-core's local layers against transformers'
GRAD_TOL = 1e-6  # float32 against the float64 reference, relative (ARCHITECTURE §2)


def _run(tmp_path, *extra: str) -> list[dict]:
    out = tmp_path / "rows.json"
    torchrun("tests/workers/megatron_engine_worker.py", 2, ["--out", str(out), *extra])
    return json.loads(out.read_text())


def test_the_megatron_engine_runs_the_applications_forwards_and_steps_exactly(tmp_path):
    cases = _run(tmp_path, "--suite", "step")
    assert {(r["arch"], r["tp"], r["pp"], r["dp"], r["mode"]) for r in cases} == {
        (a, tp, pp, dp, m) for a in ("llama", "qwen2") for tp, pp, dp in ((2, 1, 1), (1, 2, 1), (1, 1, 2))
        for m in ("token-mean", "seq-mean-token-mean")}
    for r in cases:
        assert r["logprob_error"] <= LOGPROB_TOL, r
        assert r["grad_error"] <= GRAD_TOL and r["missing"] == [], r
        assert r["optimizer_steps"] == 1 and r["schedule"] == 1 and r["is_train_engine"], r


@EXTENDED
def test_around_the_step_replicas_weight_sync_the_actor_and_resume(tmp_path):
    rows = _run(tmp_path, "--suite", "around")
    (adam,) = [r for r in rows if r.get("case") == "distributed_adam"]
    assert adam["applied"] == [True, True] and adam["schedule"] == 2, adam
    assert adam["replicas_equal"] and adam["changed"] == adam["weights"], adam
    syncs = [r for r in rows if r.get("case") == "weight_sync"]
    assert {(r["tp"], r["pp"]) for r in syncs} == {(2, 1), (1, 2)}
    for r in syncs:  # the rollout replica's log-probs are the trainer's; without the sync they would not be
        assert r["every_weight_once"] and r["logprob_error"] <= LOGPROB_TOL < 100 * LOGPROB_TOL < r["step_effect"], r
    actors = [r for r in rows if r.get("case") == "actor"]
    assert {(r["tp"], r["pp"]) for r in actors} == {(2, 1), (1, 2)}
    for r in actors:  # the application's actor, unchanged, on the engine: HF's log-probs, an on-policy step
        assert r["old_error"] <= LOGPROB_TOL and r["ref_error"] <= LOGPROB_TOL, r
        assert r["applied"] and abs(r["kl"]) <= 1e-6 and r["clipped"] == 0.0 and abs(r["loss"]) < 1e-6, r
    resumes = [r for r in rows if r.get("case") == "resume"]
    assert {(r["tp"], r["pp"], r["dp"]) for r in resumes} == {(2, 1, 1), (1, 2, 1), (1, 1, 2)}
    for r in resumes:  # bit for bit through dist-checkpointing; a resume without dsrl's schedule state is caught
        assert r["weights_equal"] and r["results_equal"] and r["planted_differs"] and r["optimizer_steps"] == 2, r


@EXTENDED
def test_a_head_shard_without_its_tensor_group_fails_both_checks(tmp_path):
    (r,) = _run(tmp_path, "--plant")
    assert r["logprob_error"] > 1e-2 and r["grad_error"] > 1e-2, r
