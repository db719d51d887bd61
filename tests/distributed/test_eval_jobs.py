"""Held-out evaluation during training (``dsrl.eval``) in real multi-process jobs, and ``dsrl eval`` on what a job
wrote:

- README suite: the default job with evaluations every 2 rollouts writes eval rows at 0, 2, 4, 6 and its training
  rows are bitwise those of the same job without evaluation; ``dsrl eval`` on its final model (1 rank) gives the row
  of its last evaluation; a run stopped at an evaluation point and resumed evaluates every point once and writes the
  uninterrupted run's rows;
- extended tier: ``dsrl eval`` on 2 ranks on the job's checkpoint gives the same row; a stop request during an
  evaluation ends it between calls and the resumed run evaluates that rollout before its next one; a file-based job
  with the built-in ``math`` reward trains and evaluates with ``hf`` and ``cb``, on ZeRO-3, with LoRA and
  disaggregated (k = 1), each with the training rows of the same job without evaluation; disaggregated k = 0
  evaluates exactly as the colocated job with as many trainers; multi-turn rollouts evaluate through the
  environment.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import EXTENDED, REPO, launch, one_rank

from dsrl.tasks import verifiable

TIMING = ("_s", "peak_", "per_s", "elapsed", "idle_frac", "_mib")  # keys that measure time or memory
DEFAULT = ["launch/train.py", "--ds_config", str(REPO / "configs" / "tiny_grpo_cpu.json"), "--dsrl.run.rollouts", "6",
           "--dsrl.sft.steps", "20", "--dsrl.run.save_every", "0", "--dsrl.run.progress_bar", "false"]


def rows(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def untimed(row: dict) -> dict:
    return {k: v for k, v in row.items() if not any(t in k for t in TIMING)}


def training(out: Path) -> list[dict]:
    return [untimed(r) for r in rows(out) if r["event"] != "eval"]


def evals(out: Path) -> list[dict]:
    return [r for r in rows(out) if r["event"] == "eval"]


@pytest.fixture(scope="module")
def default_job(tmp_path_factory) -> Path:
    """The default job, 6 rollouts, evaluated every 2 (module-scoped: three tests read it)."""
    out = tmp_path_factory.mktemp("eval") / "with"
    launch([*DEFAULT, "--dsrl.eval.every", "2", "--dsrl.run.output_dir", str(out)], nprocs=2)
    return out


def test_eval_rows_at_every_point_and_training_rows_bitwise_without(default_job, tmp_path):
    got = evals(default_job)
    assert [r["rollout"] for r in got] == [0, 2, 4, 6]
    assert [r["optimizer_step"] for r in got] == [20, 24, 28, 32]  # after the warm-up's 20 steps, 2 per rollout
    for r in got:  # the reverse task's 40 held-out prompts, greedy
        assert (r["prompts"], r["samples_per_prompt"], r["pass_k"]) == (40, 1, 1)
        assert 0 <= r["accuracy"] == r["pass_at_k"] <= 1 and 0 <= r["reward_mean"] <= 1 and r["response_len"] > 0
    without = tmp_path / "without"
    launch([*DEFAULT, "--dsrl.run.output_dir", str(without)], nprocs=2)
    assert not evals(without)
    assert training(without) == training(default_job)  # evaluation changed nothing of training


SAME = ("prompts", "samples_per_prompt", "pass_k", "accuracy", "pass_at_k", "reward_mean", "response_len")


def test_dsrl_eval_on_the_final_model_gives_the_last_row(default_job, tmp_path):
    last = untimed(evals(default_job)[-1])
    config = str(REPO / "configs" / "tiny_grpo_cpu.json")
    proc = one_rank(["-m", "dsrl.cli", "eval", "--ds_config", config, "--model", str(default_job / "final_model"),
                     "--json", "--out", str(tmp_path / "one")])
    assert proc.returncode == 0, proc.stderr[-3000:]
    alone = json.loads(proc.stdout)
    assert alone == json.loads((tmp_path / "one" / "metrics.jsonl").read_text()) | {"eval_s": alone["eval_s"]}
    # the same completions: equal up to the order of the sums (1 rank here, 2 in training)
    assert {k: alone[k] for k in SAME} == pytest.approx({k: last[k] for k in SAME}, rel=1e-12), (alone, last)
    assert alone["rollout"] is None and alone["model"] == str(default_job / "final_model")


@EXTENDED
def test_dsrl_eval_on_two_ranks_on_a_checkpoint_gives_the_last_row(default_job, tmp_path):
    last = untimed(evals(default_job)[-1])
    launch(["--module", "dsrl.cli", "eval", "--ds_config", str(REPO / "configs" / "tiny_grpo_cpu.json"), "--model",
            str(default_job), "--out", str(tmp_path / "two")], nprocs=2)  # its newest checkpoint, exported by rank 0
    two = json.loads((tmp_path / "two" / "metrics.jsonl").read_text())
    assert {k: two[k] for k in SAME} == pytest.approx({k: last[k] for k in SAME}, rel=1e-12) and two["rollout"] == 6


def test_a_run_stopped_at_an_evaluation_and_resumed_evaluates_each_point_once(default_job, tmp_path):
    out = tmp_path / "parts"
    args = [*DEFAULT, "--dsrl.eval.every", "2", "--dsrl.run.output_dir", str(out)]
    launch([*args, "--dsrl.run.stop_after_rollouts", "4"], nprocs=2)
    assert [r["rollout"] for r in evals(out)] == [0, 2, 4]  # 4 evaluated before its checkpoint
    launch([*args, "--resume", "auto"], nprocs=2)
    assert [r["rollout"] for r in evals(out)] == [0, 2, 4, 6]  # 4 not again, 6 not skipped
    assert [untimed(r) for r in rows(out)] == [untimed(r) for r in rows(default_job)]


# ------------------------------------------------------------------------------------------------- extended tier

REWARD_THAT_STOPS = '''
import os, signal
from dsrl.tasks import exact_reward

def reward(prompts, completions, answers):
    """exact, and on rank 0 a SIGTERM to itself in evaluation call DSRL_TEST_STOP_AT (counted in a file)."""
    if any("held" in p for p in prompts) and os.environ.get("RANK") == "0":
        marker = os.environ["DSRL_TEST_MARKER"]
        calls = int(open(marker).read()) if os.path.exists(marker) else 0
        open(marker, "w").write(str(calls + 1))
        if calls == int(os.environ["DSRL_TEST_STOP_AT"]):
            os.kill(os.getpid(), signal.SIGTERM)
    return exact_reward(prompts, completions, answers)
'''


def add_rows(tag: str, n: int, offset: int = 0) -> list[dict]:
    return [{"question": f"{tag} add: {(i + offset) % 10}+{(3 * i + offset) % 10} =",
             "answer": f"#### {(i + offset) % 10 + (3 * i + offset) % 10}"} for i in range(n)]


def write_jsonl(path: Path, data: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in data), encoding="utf-8")
    return str(path)


def file_job(tmp_path: Path, reward: str, held: int = 16) -> list[str]:
    """A file-based job: tests/data/math_prompts.jsonl to train on, ``held`` held-out rows written here."""
    return ["launch/train.py", "--ds_config", str(REPO / "configs" / "tiny_grpo_cpu.json"), "--dsrl.data.task", "null",
            "--dsrl.data.path", str(REPO / "tests" / "data" / "math_prompts.jsonl"), "--dsrl.data.prompt_key",
            "question", "--dsrl.data.max_prompt_tokens", "24", "--dsrl.data.reward_fn", reward, "--dsrl.eval.path",
            write_jsonl(tmp_path / "held.jsonl", add_rows("held", held, 5)), "--dsrl.batch.prompts_per_rollout", "4",
            "--dsrl.batch.samples_per_prompt", "4", "--dsrl.batch.mini_batch_size", "16", "--dsrl.sft.steps", "10",
            "--dsrl.run.save_every", "0", "--dsrl.run.progress_bar", "false"]


@EXTENDED
def test_a_stop_during_an_evaluation_ends_it_and_the_resumed_run_evaluates_that_rollout_first(tmp_path):
    # 4 prompts x 4 samples per rollout on 2 ranks: evaluation calls of 8 prompts, 2 per rank per evaluation
    (tmp_path / "stopping.py").write_text(REWARD_THAT_STOPS, encoding="utf-8")
    out = tmp_path / "run"
    args = [*file_job(tmp_path, f"{tmp_path / 'stopping.py'}:reward", held=32), "--dsrl.eval.every", "2",
            "--dsrl.run.rollouts", "4", "--dsrl.run.output_dir", str(out)]
    env = {"DSRL_TEST_MARKER": str(tmp_path / "calls"), "DSRL_TEST_STOP_AT": "2"}  # evaluation 0 makes calls 0, 1
    proc = launch(args, nprocs=2, env=env, check=False)
    assert proc.returncode != 0 and "stop requested (SIGTERM received)" in proc.stdout, proc.stdout[-3000:]
    assert "the evaluation of rollout 2 ended on the stop request (1 of 2 calls done)" in proc.stdout
    assert [r["rollout"] for r in evals(out)] == [0]  # the stopped evaluation wrote nothing
    assert (out / "checkpoints" / "rollout2").is_dir()  # rollout 2 trained, committed
    launch([*args, "--resume", "auto"], nprocs=2, env={**env, "DSRL_TEST_STOP_AT": "-1"})
    assert [r["rollout"] for r in evals(out)] == [0, 2, 4]
    first = next(i for i, r in enumerate(rows(out)) if r["event"] == "eval" and r["rollout"] == 2)
    assert rows(out)[first + 1]["rollout"] == 3  # evaluated on resume, before rollout 3


VARIANTS = {  # the default file's backend and stage with LoRA; cb on ZeRO-3; generator ranks
    "lora": (["--dsrl.model.lora", '{"r": 8, "alpha": 16.0}'], 2),
    "cb-zero3": (["--dsrl.rollout.backend", "cb", "--zero_stage", "3"], 2),
    "disaggregated": (["--dsrl.rollout.placement", "disaggregated", "--dsrl.rollout.generator_ranks", "1",
                       "--dsrl.algorithm.max_staleness", "1", "--dsrl.algorithm.rollout_correction",
                       '{"mode": "tis", "level": "token", "cap": 2.0}'], 3),
}


def with_stage(args: list[str], tmp_path: Path) -> list[str]:
    """``--zero_stage N``: the run file with that ZeRO stage, written here."""
    if "--zero_stage" not in args:
        return args
    i = args.index("--zero_stage")
    run = json.loads((REPO / "configs" / "tiny_grpo_cpu.json").read_text())
    run["zero_optimization"] = {"stage": int(args[i + 1])}
    (tmp_path / "run.json").write_text(json.dumps(run))
    rest = args[:i] + args[i + 2:]
    rest[rest.index("--ds_config") + 1] = str(tmp_path / "run.json")
    return rest


@EXTENDED
@pytest.mark.skipif(not verifiable.has_math_verify(), reason='needs pip install -e ".[math]"')
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_a_math_file_job_trains_and_evaluates(variant, tmp_path):
    extra, nprocs = VARIANTS[variant]
    base = with_stage([*file_job(tmp_path, "math"), "--dsrl.run.rollouts", "4", *extra], tmp_path)
    out, without = tmp_path / "with", tmp_path / "without"
    launch([*base, "--dsrl.eval.every", "2", "--dsrl.run.output_dir", str(out)], nprocs=nprocs, timeout=900)
    got = evals(out)
    assert [r["rollout"] for r in got] == [0, 2, 4], got
    assert all(r["prompts"] == 16 and r["accuracy"] is not None and r["reward_timeouts"] == 0 for r in got), got
    assert all(r["accuracy"] == r["reward_mean"] for r in got)  # math is the reward and the accuracy
    launch([*base, "--dsrl.run.output_dir", str(without)], nprocs=nprocs, timeout=900)
    assert training(without) == training(out)


@EXTENDED
def test_disaggregated_k0_evaluates_as_the_colocated_job(tmp_path):
    args = [*DEFAULT, "--dsrl.eval.every", "3", "--dsrl.eval.temperature", "1.0", "--dsrl.eval.samples_per_prompt",
            "4", "--dsrl.eval.pass_k", "2"]
    launch([*args, "--dsrl.run.output_dir", str(tmp_path / "colocated")], nprocs=2)
    launch([*args, "--dsrl.run.output_dir", str(tmp_path / "disaggregated"), "--dsrl.rollout.placement",
            "disaggregated", "--dsrl.rollout.generator_ranks", "1", "--dsrl.algorithm.max_staleness", "0"], nprocs=3)
    colocated, disaggregated = evals(tmp_path / "colocated"), evals(tmp_path / "disaggregated")
    assert [r["rollout"] for r in colocated] == [0, 3, 6]
    assert [untimed(r) for r in disaggregated] == [untimed(r) for r in colocated]  # sampled, k = 4: same samples
    assert all(r["accuracy"] <= r["pass_at_k"] and r["reward_mean"] > 0 for r in colocated)


@EXTENDED
def test_multi_turn_rollouts_evaluate_through_the_environment(tmp_path):
    args = ["launch/train.py", "--ds_config", str(REPO / "configs" / "tiny_tool_cpu.json"), "--dsrl.run.rollouts", "2",
            "--dsrl.sft.steps", "20", "--dsrl.run.save_every", "0", "--dsrl.run.progress_bar", "false",
            "--dsrl.batch.prompts_per_rollout", "4", "--dsrl.batch.mini_batch_size", "32"]
    out, without = tmp_path / "with", tmp_path / "without"
    launch([*args, "--dsrl.eval.every", "1", "--dsrl.eval.max_prompts", "12", "--dsrl.run.output_dir", str(out)],
           nprocs=2)
    got = evals(out)
    assert [r["rollout"] for r in got] == [0, 1, 2] and all(r["prompts"] == 12 for r in got), got
    launch([*args, "--dsrl.run.output_dir", str(without)], nprocs=2)
    assert training(without) == training(out)

