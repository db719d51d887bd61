"""Rollout statistics with named fields, their reduction and the rollout row of metrics.jsonl."""

from __future__ import annotations

import json
import math

from dsrl.rl.data.batching import Sample
from dsrl.rl.rollout_stats import RolloutStats
from dsrl.runtime.metrics import MetricsWriter, rollout_record


def _samples() -> list[Sample]:
    return [
        Sample(tokens=[1, 5, 6, 2], prompt_len=2, group=0, reward=1.0, accuracy=1.0),
        Sample(tokens=[1, 5, 7], prompt_len=2, group=0, reward=0.0, accuracy=0.0, finished=False),
        Sample(tokens=[1, 4, 6, 6, 2], prompt_len=2, group=1, reward=float("nan"), active=False),
    ]


def test_rollout_stats_count_named_fields_and_sum_in_one_process():
    stats = RolloutStats(groups_generated=2, groups_zero_variance=1, rollout_s=3.0)
    stats.add_samples(_samples())
    assert (stats.samples, stats.finite_rewards, stats.reward_sum, stats.reward_sq_sum) == (3, 2, 1.0, 1.0)
    assert (stats.scored_accuracy, stats.accuracy_sum) == (2, 1.0)
    assert (stats.completion_tokens, stats.masked_samples, stats.truncated_samples) == (2 + 1 + 3, 1, 1)
    assert stats.summed() == stats  # no process group: the sum over one rank is itself


def test_rollout_record_from_stats_and_steps(tmp_path):
    stats = RolloutStats(groups_generated=2, groups_zero_variance=1, rollout_s=4.0, train_s=2.0)
    stats.add_samples(_samples())
    steps = [{"loss": 0.5, "tokens": 10, "step_applied": True, "grad_norm": 2.0, "lr": 1e-3, "kl": 0.1,
              "clip_low_frac": 0.0, "clip_high_frac": 0.2},
             {"loss": -0.5, "tokens": 30, "step_applied": False, "grad_norm": float("nan"), "lr": 2e-3, "kl": 0.3,
              "clip_low_frac": 0.1, "clip_high_frac": 0.0}]
    rec = rollout_record(stats, steps, world=2, rollout=3, optimizer_step=5, rollout_size=8, prompt_epochs=0.5,
                         sampling_rounds=1, local_train_s=4.0)
    assert rec["episodes"] == 24 and rec["reward_mean"] == 0.5 and math.isclose(rec["reward_std"], 0.5)
    assert rec["accuracy"] == 0.5 and rec["response_len"] == 2.0 and rec["zero_variance_groups"] == 0.5
    assert rec["truncated_frac"] == 1 / 3 and rec["masked_samples"] == 1
    assert math.isclose(rec["kl"], (0.1 * 10 + 0.3 * 30) / 40)  # token-weighted over the steps
    assert math.isclose(rec["clip_frac"], (0.1 * 30 + 0.2 * 10) / 40)
    assert rec["grad_norm"] == 2.0 and rec["skipped_steps"] == 1 and rec["lr"] == 2e-3 and rec["loss"] == 0.0
    assert rec["train_tokens"] == 40 and rec["tokens_per_s"] == 10.0
    assert rec["rollout_s"] == 2.0 and rec["train_s"] == 1.0  # summed over 2 ranks -> per-rank mean
    writer = MetricsWriter(str(tmp_path), rank=0)
    writer.write("rollout", rec, 5)
    writer.close()
    row = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert row["event"] == "rollout" and row["reward_mean"] == 0.5
