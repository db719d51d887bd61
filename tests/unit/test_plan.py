"""Run accounting: episodes, optimizer steps, prompt epochs and the progress-bar total agree by construction."""

from __future__ import annotations

import json
import math

import pytest
from conftest import REPO, write_json

from dsrl.cli.main import main
from dsrl.config import load_config
from dsrl.core.plan import BatchPlan


def _rloo_config(G: int, E: int = 1, B: int | str = "auto", last_rollout: str = "drop") -> dict:
    # The RLOO report: 490 prompts, one device, 4 prompts per rollout, rloo_k = 2 vs 4, 1 epoch.
    return {
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-6}},
        "dsrl": {
            "batch": {"prompts_per_rollout": 4, "samples_per_prompt": G, "mini_batch_size": B,
                      "epochs_per_rollout": E, "micro_batch_size_per_rank": 1},
            "run": {"epochs": 1, "last_rollout": last_rollout},
            "algorithm": {"name": "rloo"},
        },
    }


@pytest.mark.parametrize("G", [2, 4])
def test_rloo_report_scenario(G):
    plan = BatchPlan.from_config(load_config(_rloo_config(G)), 1, dataset_size=490)
    # 490 prompts / 4 per rollout: 122 whole rollouts; "drop" leaves 2 prompts unused.
    assert plan.rollouts == 122
    assert plan.rollout_size == 4 * G
    assert plan.episodes == 122 * 4 * G  # episodes scale with samples_per_prompt
    assert plan.prompt_epochs == pytest.approx(488 / 490)  # one prompt epoch, up to the drop rule
    assert plan.optimizer_steps_per_rollout == 1
    assert plan.total_optimizer_steps == plan.rollouts * plan.epochs_per_rollout * plan.rollout_size // 4 // G
    assert plan.loss_agg == "token-mean"


def test_rloo_episodes_double_with_samples_per_prompt_steps_follow_E_and_B():
    p2 = BatchPlan.from_config(load_config(_rloo_config(2, E=1, B=4)), 1, 490)
    p4 = BatchPlan.from_config(load_config(_rloo_config(4, E=1, B=4)), 1, 490)
    assert p4.episodes == 2 * p2.episodes
    assert p2.prompt_epochs == p4.prompt_epochs  # G does not change how many prompts are seen
    assert p2.total_optimizer_steps == 122 * 1 * 8 // 4 == 244
    assert p4.total_optimizer_steps == 122 * 1 * 16 // 4 == 488
    p4e = BatchPlan.from_config(load_config(_rloo_config(4, E=3, B=4)), 1, 490)
    assert p4e.total_optimizer_steps == 3 * p4.total_optimizer_steps
    assert p4e.episodes == p4.episodes  # epochs per rollout reuse data: no new episodes


def test_wrap_rule_covers_every_prompt():
    plan = BatchPlan.from_config(load_config(_rloo_config(2, last_rollout="wrap")), 1, 490)
    assert plan.rollouts == 123 and plan.prompt_epochs == pytest.approx(492 / 490)
    exact = BatchPlan.from_config(load_config(_rloo_config(2)), 1, 488)
    assert exact.rollouts == 122 and exact.prompt_epochs == 1.0


def test_steps_taken_by_the_loop_equal_the_plan():
    """Walk the hierarchy the way the trainer does; the number of steps taken equals the bar total."""
    from dsrl.core.partition import mini_batches

    raw = _rloo_config(4, E=2, B=8)
    raw["dsrl"]["batch"]["micro_batch_size_per_rank"] = 2
    plan = BatchPlan.from_config(load_config(raw), 2, 490)
    steps = 0
    for rollout in range(plan.rollouts):
        for mb in mini_batches(plan.rollout_size, plan.mini_batch_size, plan.epochs_per_rollout, seed=rollout):
            assert len(mb) == plan.mini_batch_size
            steps += 1
    assert steps == plan.total_optimizer_steps == 122 * 2 * 16 // 8


def test_fixed_and_token_budget_rows():
    raw = _rloo_config(4, E=2, B=8)
    raw["dsrl"]["batch"]["micro_batch_size_per_rank"] = 2
    plan = BatchPlan.from_config(load_config(raw), 2, 490)
    assert plan.micro_batches_per_step == 8 // (2 * 2)
    assert plan.deepspeed_batch_fields() == {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2,
                                              "gradient_accumulation_steps": 2}
    raw["dsrl"]["batch"].update(micro_batch_size_per_rank=None, max_tokens_per_micro_batch=256)
    tb = BatchPlan.from_config(load_config(raw), 2, 490)
    assert tb.token_budget_mode and tb.micro_batches_per_step is None
    assert tb.deepspeed_batch_fields()["gradient_accumulation_steps"] is None


def test_dsrl_plan_cli_json(tmp_path, capsys):
    """`dsrl plan --json` in-process (tests/distributed/test_cli_processes.py runs the CLI in fresh interpreters)."""
    raw = _rloo_config(4, E=2, B=8)
    raw["scheduler"] = {"type": "WarmupCosineLR", "params": {"warmup_num_steps": 10, "cos_min_ratio": 0.1}}
    path = write_json(tmp_path / "run.json", raw)
    assert main(["plan", "--ds_config", str(path), "--world_size", "2", "--dataset_size", "490", "--json",
                 "--dsrl.batch.samples_per_prompt", "2"]) == 0
    got = json.loads(capsys.readouterr().out)
    for key in ("prompts_per_rollout", "samples_per_prompt", "rollout_size", "mini_batch_size",
                "epochs_per_rollout", "optimizer_steps_per_rollout", "micro_batch_size_per_rank",
                "max_tokens_per_micro_batch", "data_parallel_size", "rollouts", "total_optimizer_steps",
                "episodes", "prompt_epochs", "train_batch_size", "train_micro_batch_size_per_gpu",
                "gradient_accumulation_steps", "lr_first_step", "lr_last_step"):
        assert key in got, key
    assert got["samples_per_prompt"] == 2 and got["rollout_size"] == 8
    assert got["total_optimizer_steps"] == 122 * 2 * 8 // 8 == 244
    assert got["episodes"] == 122 * 8
    assert got["lr_last_step"] == pytest.approx(0.1 * 3e-6)  # cosine reaches its floor at the last step
    assert got["lr_first_step"] < got["lr_last_step"] or math.isclose(got["lr_first_step"], 0.0, abs_tol=1e-9)
    # An error exits 2 and names the field.
    rc = main(["plan", "--ds_config", str(path), "--world_size", "3", "--dataset_size", "490"])
    assert rc == 2 and "dsrl.batch.prompts_per_rollout" in capsys.readouterr().err


def test_dsrl_plan_refuses_a_run_file_the_trainer_cannot_run(tmp_path, capsys):
    """A run file without an "optimizer" section plans (the batch rows are fine) but cannot train: dsrl plan refuses
    it with one sentence, as the trainer would, instead of printing a plan."""
    raw = json.loads((REPO / "configs" / "tiny_grpo_cpu.json").read_text())
    raw.pop("optimizer")
    path = write_json(tmp_path / "no_optimizer.json", raw)
    assert main(["plan", "--ds_config", str(path), "--world_size", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("configuration error") == 1 and 'no "optimizer" section' in err and "Fix: add one" in err
