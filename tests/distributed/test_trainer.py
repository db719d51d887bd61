"""The main job on 2 CPU ranks: exact resume (clean stop and kill -9 mid-checkpoint), clip fractions,
accounting of the progress total, metrics.jsonl; the learning runs live in test_learning.py."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import EXTENDED, REPO, launch

ROLLOUTS = 4
BASE_ARGS = [
    "launch/train.py", "--ds_config", "configs/tiny_grpo_cpu.json",
    "--dsrl.run.rollouts", str(ROLLOUTS),
    "--dsrl.batch.prompts_per_rollout", "8", "--dsrl.batch.samples_per_prompt", "4",
    "--dsrl.batch.mini_batch_size", "16", "--dsrl.batch.epochs_per_rollout", "2",
    "--dsrl.run.save_every", "1", "--dsrl.run.keep_last", "3", "--dsrl.run.progress_bar", "false",
    "--dsrl.sft.steps", "0",
]


def _train(out, *extra, env=None, check=True):
    return launch([*BASE_ARGS, "--dsrl.run.output_dir", str(out), *extra], nprocs=2, timeout=600, env=env,
                  check=check)


def _steps(out) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["event"] == "step"]


def _final_weights(out) -> dict[str, torch.Tensor]:
    ckpt = out / "checkpoints"
    tag = (ckpt / "latest").read_text().strip()
    assert tag == f"rollout{ROLLOUTS}" and (ckpt / tag / "COMPLETE").exists()
    state = torch.load(ckpt / tag / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)
    return state["module"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("uninterrupted")
    proc = _train(out)
    return out, proc


def test_plan_accounting_and_metrics(reference):
    out, proc = reference
    steps = _steps(out)
    # E * R / B = 2 * 32 / 16 = 4 optimizer steps per rollout; the bar total is 16 and 16 were taken.
    assert [s["optimizer_step"] for s in steps] == list(range(1, 4 * ROLLOUTS + 1))
    assert "16 steps" in proc.stdout
    rollouts = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    rollouts = [r for r in rollouts if r["event"] == "rollout"]
    assert [r["rollout"] for r in rollouts] == list(range(1, ROLLOUTS + 1))
    last = rollouts[-1]
    assert last["episodes"] == ROLLOUTS * 32 and last["optimizer_step"] == 16
    for key in ("reward_mean", "reward_std", "accuracy", "response_len", "kl", "entropy", "clip_low_frac",
                "clip_high_frac", "grad_norm", "lr", "tokens_per_s", "rollout_s", "train_s", "prompt_epochs"):
        assert key in last, key
    # Phase timings and peaks (dsrl.runtime.phases): the phases this job runs, each inside the span it belongs to
    # (per rank, so also as means over ranks); no reference and no critic here, so no such phase.
    for r in rollouts:
        inside_make = r["phase_generate_s"] + r["phase_reward_s"] + r["phase_old_logprobs_s"]
        assert 0 < inside_make <= r["rollout_s"] and 0 < r["phase_train_s"] <= r["train_s"], r
        assert all(r[f"peak_{p}_mib"] > 0 for p in ("generate", "reward", "old_logprobs", "train")), r
        assert r["peak_mib"] == max(r[f"peak_{p}_mib"] for p in ("generate", "reward", "old_logprobs", "train"))
        assert r["generate_tokens_per_s"] > 0 and r["train_sequence_tokens_per_s"] > 0
        assert not {"phase_ref_logprobs_s", "phase_critic_values_s"} & set(r)
    # The ds_config csv_monitor section is honoured through DeepSpeed's monitor, under the output dir.
    assert any((out / "monitor").rglob("*.csv")), list(out.rglob("*"))


def test_clip_fraction_zero_on_first_mini_batch_only(reference):
    out, _ = reference
    steps = _steps(out)
    per_rollout = [steps[i:i + 4] for i in range(0, len(steps), 4)]
    for group in per_rollout:
        first = group[0]
        assert first["clip_low_frac"] == 0.0 and first["clip_high_frac"] == 0.0, first
    later = [s["clip_low_frac"] + s["clip_high_frac"] for g in per_rollout for s in g[1:]]
    assert max(later) > 0.0, later  # later mini-batches are off-policy


@EXTENDED
def test_exact_resume_after_clean_stop(reference, tmp_path):
    ref_out, _ = reference
    _train(tmp_path, "--dsrl.run.stop_after_rollouts", "2")
    assert len(_steps(tmp_path)) == 8
    _train(tmp_path, "--resume", "auto")
    got, want = _steps(tmp_path), _steps(ref_out)
    assert [s["loss"] for s in got] == [s["loss"] for s in want]  # bitwise on CPU
    a, b = _final_weights(tmp_path), _final_weights(ref_out)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# Killing rank 0 while it writes a checkpoint, then resuming bitwise: tests/distributed/test_ppo.py
# (test_ppo_kill_mid_checkpoint_then_resume_is_bitwise) does it with the policy and a critic, a superset of the
# GRPO case that ran here (the same commit code, plus a companion engine).


def test_zero3_kl_reference_is_partitioned_and_starts_at_zero(tmp_path):
    """KL against a frozen reference under ZeRO-3 (the reference is a sharded, optimizer-less engine)."""
    raw = json.loads((REPO / "configs" / "tiny_grpo_cpu.json").read_text())
    raw["zero_optimization"] = {"stage": 3}
    raw["scheduler"]["params"]["warmup_num_steps"] = 1  # 2 rollouts x 2 steps
    (tmp_path / "run.json").write_text(json.dumps(raw))
    out = tmp_path / "out"
    launch(["launch/train.py", "--ds_config", str(tmp_path / "run.json"), "--dsrl.run.rollouts", "2",
            "--dsrl.algorithm.kl_coef", "0.05", "--dsrl.algorithm.kl_estimator", "k3",
            "--dsrl.run.output_dir", str(out), "--dsrl.run.progress_bar", "false",
            "--dsrl.run.save_final", "false", "--dsrl.sft.steps", "0"], nprocs=2, timeout=600)
    steps = _steps(out)
    assert len(steps) == 4
    assert abs(steps[0]["kl"]) < 1e-6  # the policy equals the reference before the first update
    assert all(s["kl"] >= 0 for s in steps) and steps[-1]["kl"] > 0


def test_plain_python_local_model_dir_jsonl_prompts_and_dotted_reward(tmp_path):
    """Real use on one rank with plain ``python``: a local HF model directory (and its tokenizer),
    prompts from a local jsonl through `datasets`, a reward function given by path, run.epochs."""
    import subprocess
    import sys

    from dsrl.config import ModelConfig
    from dsrl.rl.policy.model import build_model
    from dsrl.rl.policy.tokenizer import load_tokenizer

    tok = load_tokenizer(ModelConfig())
    model = build_model(ModelConfig(arch="llama"), vocab_size=len(tok), pad_token_id=tok.pad_token_id,
                        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, on_gpu=False)
    model_dir = tmp_path / "model"
    model.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    raw = json.loads((REPO / "configs" / "tiny_grpo_cpu.json").read_text())
    raw.pop("scheduler")
    raw["dsrl"]["batch"].update(prompts_per_rollout=4, samples_per_prompt=2, mini_batch_size=4)
    raw["dsrl"]["run"] = {"epochs": 1, "output_dir": str(tmp_path / "out"), "progress_bar": False}
    raw["dsrl"]["sft"] = {"steps": 0}
    raw["dsrl"]["model"] = {"path": str(model_dir)}
    raw["dsrl"]["data"] = {"path": str(REPO / "tests" / "data" / "prompts.jsonl"), "prompt_key": "question",
                           "answer_key": "solution", "reward_fn": "tests/data/reward_fixture.py:length_per_sample"}
    (tmp_path / "run.json").write_text(json.dumps(raw))
    n_prompts = len((REPO / "tests" / "data" / "prompts.jsonl").read_text().splitlines())
    proc = subprocess.run([sys.executable, "launch/train.py", "--ds_config", str(tmp_path / "run.json")], cwd=REPO,
                          capture_output=True, text=True, timeout=600, env={**__import__("os").environ,
                                                                            "DS_ACCELERATOR": "cpu"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    rollouts = [r for r in rows if r["event"] == "rollout"]
    assert len(rollouts) == n_prompts // 4  # run.epochs = 1, last_rollout = drop
    assert rollouts[-1]["prompt_epochs"] == (n_prompts // 4) * 4 / n_prompts
    assert 0 < rollouts[0]["reward_mean"] <= 1 and rollouts[0]["accuracy"] is None  # file prompts: no accuracy


def test_dapo_dynamic_sampling_two_ranks_zero3(tmp_path):
    raw = json.loads((REPO / "configs" / "tiny_grpo_cpu.json").read_text())
    raw["zero_optimization"] = {"stage": 3}
    raw["dsrl"]["batch"].update(prompts_per_rollout=16, samples_per_prompt=4, mini_batch_size=32)
    raw["scheduler"]["params"]["warmup_num_steps"] = 1
    (tmp_path / "run.json").write_text(json.dumps(raw))
    out = tmp_path / "out"
    launch(["launch/train.py", "--ds_config", str(tmp_path / "run.json"), "--dsrl.run.rollouts", "3",
            "--dsrl.algorithm.name", "dapo", "--dsrl.algorithm.overlong_buffer", "2",
            "--dsrl.algorithm.max_sampling_rounds", "3", "--dsrl.run.output_dir", str(out),
            # exact-match reward: a random policy gets 0 almost everywhere, so most groups have zero variance
            # and dynamic sampling runs all its rounds (ranks with nothing left to generate join the gathers)
            "--dsrl.data.reward_fn", "tests/data/reward_fixture.py:exact_batched",
            "--dsrl.run.progress_bar", "false", "--dsrl.run.save_final", "false", "--dsrl.sft.steps", "0"],
           nprocs=2, timeout=600)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    rollouts = [r for r in rows if r["event"] == "rollout"]
    assert [r["optimizer_step"] for r in rollouts] == [2, 4, 6]
    assert all(r["sampling_rounds"] == 3 for r in rollouts)  # refilled up to max_sampling_rounds
    assert all(r["zero_variance_groups"] > 0.3 for r in rollouts)  # overlong shaping leaves a few varied groups
    assert all(r["episodes"] == 64 * r["rollout"] for r in rollouts)


def test_rollouts_that_train_on_nothing_are_warned_about_then_stop_the_run(tmp_path):
    """Every reward NaN: every sample is masked and no token reaches the loss. Each such rollout is warned about
    with its counts, and run.max_empty_rollouts of them in a row end the run (status 1, one sentence from one rank,
    on every rank alike) before it is checkpointed or exported; it used to end with status 0 and export the
    unchanged model. The bound is the default (3), so the same job ran on the code before the check."""
    raw = json.loads((REPO / "configs" / "tiny_grpo_cpu.json").read_text())
    raw["scheduler"]["params"]["warmup_num_steps"] = 1
    raw.pop("csv_monitor", None)
    (tmp_path / "run.json").write_text(json.dumps(raw))
    out = tmp_path / "out"
    proc = launch(["launch/train.py", "--ds_config", str(tmp_path / "run.json"), "--dsrl.run.rollouts", "4",
                   "--dsrl.batch.prompts_per_rollout", "4",
                   "--dsrl.batch.samples_per_prompt", "4", "--dsrl.batch.mini_batch_size", "8",
                   "--dsrl.data.reward_fn", "tests/data/reward_fixture.py:nan_batched", "--dsrl.run.save_every", "1",
                   "--dsrl.run.output_dir", str(out), "--dsrl.run.progress_bar", "false", "--dsrl.sft.steps", "0"],
                  nprocs=2, timeout=600, check=False)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "rollout 1 trained on nothing: all 16 samples were masked (16 with a non-finite reward), so 0 tokens " \
           "reached the loss" in proc.stdout, proc.stdout[-3000:]
    error = ("dsrl: error: rollouts 1 to 3 trained on nothing (3 in a row, dsrl.run.max_empty_rollouts = 3): in "
             "rollout 3 all 16 samples were masked")
    assert proc.stderr.count(error) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    rollouts = [r for r in rows if r["event"] == "rollout"]
    assert [(r["rollout"], r["masked_samples"], r["train_tokens"]) for r in rollouts] == [(i, 16, 0) for i in (1, 2, 3)]
    assert (out / "checkpoints" / "latest").read_text() == "rollout2"  # rollout 3, the third empty one: not saved
    assert not (out / "final_model").exists()


@pytest.mark.parametrize("extra, words", [
    (["--dsrl.batch.mini_batch_sise", "8"], "dsrl.batch.mini_batch_sise is not a known setting"),  # before the group
    (["--dsrl.run.rollouts", "3"], "warmup_num_steps = 10 is not shorter than the plan's 6 optimizer steps"),  # after
])
def test_a_configuration_error_is_printed_by_one_rank(tmp_path, extra, words):
    """Found before any work on every rank alike, printed once (it was printed by each of the 2 ranks)."""
    proc = launch(["launch/train.py", "--ds_config", "configs/tiny_grpo_cpu.json", "--dsrl.sft.steps", "0",
                   "--dsrl.run.output_dir", str(tmp_path / "out"), *extra], nprocs=2, timeout=300, check=False)
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [x for x in proc.stderr.splitlines() if x.startswith("dsrl: configuration error:")]
    assert len(lines) == 1 and words in lines[0], proc.stderr[-3000:]
