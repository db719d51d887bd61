"""The tiny default learns on 2 CPU ranks under ZeRO-2 and ZeRO-3 (a short run of the README's job, RL alone:
without its supervised warm-up), also with the continuous-batching rollout backend (under ZeRO-3, with
rollout.cb_attention's default, which on this tiny model is the dense mask)."""

from __future__ import annotations

import json

import pytest
from conftest import EXTENDED, REPO, launch

ROLLOUTS = 40


# ZeRO-3 generation through hf is covered by tests/distributed/test_rollout_zero3.py
@pytest.mark.parametrize("stage,backend", [(2, "hf"), pytest.param(3, "cb", marks=EXTENDED)])
def test_tiny_default_reward_improves(tmp_path, stage, backend):
    out = tmp_path / "run"
    run_file = tmp_path / "run.json"
    raw = json.loads((REPO / "configs" / "tiny_grpo_cpu.json").read_text())
    raw["zero_optimization"] = {"stage": stage}
    run_file.write_text(json.dumps(raw))
    proc = launch(["launch/train.py", "--ds_config", str(run_file), "--dsrl.run.rollouts", str(ROLLOUTS),
                   "--dsrl.run.save_every", "0", "--dsrl.run.output_dir", str(out), "--dsrl.sft.steps", "0",
                   "--dsrl.run.progress_bar", "false", "--dsrl.rollout.backend", backend], nprocs=2, timeout=900)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward_mean"] for r in rows if r["event"] == "rollout"]
    assert len(rewards) == ROLLOUTS, proc.stdout[-2000:]
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert last > 2 * first and last - first > 0.05, (first, last, rewards)
    assert (out / "checkpoints" / "latest").exists()  # save_final
