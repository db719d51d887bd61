"""Token-budget micro-batches from dsrl.core.partition keep the mini-batch gradient exact: the exactness
self-check (`dsrl.check --splits token_budget`) on 2 CPU ranks, ZeRO-0 and ZeRO-3, all four loss_agg
modes, relative error <= 1e-6 against the single-process float64 reference."""

from __future__ import annotations

import json

from conftest import launch, write_json

TOL = 1e-6


def test_token_budget_split_is_exact(tmp_path):
    cfg = write_json(tmp_path / "run.json", {
        "zero_optimization": {"stage": 0},
        "dsrl": {"batch": {"prompts_per_rollout": 4, "samples_per_prompt": 2, "mini_batch_size": 8,
                           "max_tokens_per_micro_batch": 64}, "run": {"rollouts": 1},
                 "data": {"max_prompt_tokens": 16}},  # T = 64 holds the longest sequence, 16 + 16 tokens
    })
    out = tmp_path / "results.json"
    proc = launch(["--module", "dsrl.check", "--ds_config", str(cfg), "--zero_stages", "0,3",
                   "--splits", "token_budget", "--method", "dsrl,naive", "--json", str(out)], nprocs=2, timeout=600)
    summary = [ln for ln in proc.stdout.splitlines() if ln.startswith("max relative gradient error:")]
    assert len(summary) == 1, proc.stdout[-3000:]
    results = json.loads(out.read_text())["results"]
    exact = [r for r in results if r["method"] == "dsrl"]
    assert len(exact) == 2 * 4 and all(r["split"] == "token_budget" and r["world_size"] == 2 for r in exact)
    assert max(r["error"] for r in exact) <= TOL, exact
    # the same uneven micro-batches with a per-micro-batch mean are measurably wrong
    assert all(r["error"] > 1e-3 for r in results if r["method"] == "naive"), results
