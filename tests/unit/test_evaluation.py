"""Held-out evaluation (``dsrl.eval``) in one process: the schedule, pass@k against enumeration, the eval section's
refusals, where the prompts come from (a built-in task's held out, a dataset's test split, a file, a split), the
split of the prompts over replicas, one evaluation with a fake backend (its row, its stop, the random streams it
leaves alone), the backends' ``with_sampling`` on a tiny model, and the metrics and plot of an eval row."""

from __future__ import annotations

import itertools
import json
import random
import types
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from dsrl.config import ConfigError, DataConfig, EvalConfig, ModelConfig, RolloutConfig, load_config
from dsrl.core.parallel import ParallelView
from dsrl.rl.data.batching import Sample
from dsrl.rl.data.evalset import MIN_HELD_OUT, load_eval_prompts, prompts_per_call, replica_calls
from dsrl.rl.data.prompts import load_prompts
from dsrl.rl.evaluation import EvalProgress, EvalSchedule, EvalSettings, EvalTotals, Evaluator, eval_line, pass_at_k
from dsrl.rl.policy.tokenizer import load_tokenizer
from dsrl.rl.rewards.functions import load_accuracy_fn, load_reward_fn
from dsrl.rl.rewards.scoring import Scorer
from dsrl.rollout.base import Completion, RolloutBackend
from dsrl.runtime.context import RunContext

RUN = "configs/tiny_grpo_cpu.json"


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(ModelConfig())


def dsrl(**overrides):
    return load_config(RUN, {f"dsrl.{k}": v for k, v in overrides.items()}).dsrl


# ------------------------------------------------------------------------------------------------ schedule, pass@k


@pytest.mark.parametrize("every,rollouts,due", [
    (0, 10, []), (20, 120, [0, 20, 40, 60, 80, 100, 120]), (50, 120, [0, 50, 100, 120]), (3, 7, [0, 3, 6, 7]),
    (200, 120, [0, 120]), (1, 3, [0, 1, 2, 3])])
def test_the_schedule_is_before_the_first_every_nth_and_after_the_last(every, rollouts, due):
    s = EvalSchedule(every, rollouts)
    assert [n for n in range(-1, rollouts + 3) if s.due(n)] == due


def _pass_by_enumeration(n: int, c: int, k: int) -> float:
    """The share of the C(n, k) k-subsets of n samples (c correct) holding a correct one."""
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(samples[i] for i in s) for s in subsets) / len(subsets)


def test_pass_at_k_is_the_unbiased_estimator():
    for n in range(1, 8):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(_pass_by_enumeration(n, c, k), abs=1e-12), (n, c, k)
    assert pass_at_k(16, 3, 1) == 3 / 16 and pass_at_k(4, 1, 4) == 1.0 and pass_at_k(4, 0, 4) == 0.0
    assert 0.0 < pass_at_k(200, 1, 100) < 1.0  # exact integers: no overflow or cancellation at large n
    for bad in ((3, 4, 1), (3, 1, 4), (3, 1, 0)):
        with pytest.raises(ValueError):
            pass_at_k(*bad)


def test_totals_count_prompts_samples_and_pass_at_k():
    def s(acc, reward=1.0, n=3, finished=True):
        return Sample(tokens=[1] * (2 + n), prompt_len=2, group=0, reward=reward, accuracy=acc, finished=finished)

    t = EvalTotals()
    t.add([[s(1.0), s(0.0), s(0.0), s(0.0)], [s(0.0, float("nan"), 1, False)] * 4], k=2)
    assert (t.prompts, t.samples, t.correct, t.scored) == (2, 8, 1, 8)
    assert t.pass_sum == pytest.approx(pass_at_k(4, 1, 2)) and t.scored_prompts == 2
    assert (t.rewards, t.reward_sum, t.tokens, t.truncated) == (4, 4.0, 16, 4)
    t = EvalTotals()
    t.add([[s(None)] * 2], k=1)  # no accuracy function: nothing scored
    assert (t.scored, t.scored_prompts) == (0, 0)


# ------------------------------------------------------------------------------------------------- the section


@pytest.mark.parametrize("overrides,words", [
    ({"eval.samples_per_prompt": 4}, "with dsrl.eval.temperature = 0 (greedy decoding)"),
    ({"eval.top_p": 0.9}, "dsrl.eval.top_p is set but dsrl.eval.temperature = 0"),
    ({"eval.temperature": 0.7, "eval.samples_per_prompt": 2, "eval.pass_k": 3}, "dsrl.eval.pass_k = 3 is more than"),
    ({"eval.subset": "main"}, "dsrl.eval.subset = 'main' names a configuration of dsrl.eval.path"),
    ({"eval.split": "test"}, "built-in task 'reverse', which has no splits"),
    ({"data.task": None, "data.path": "tests/data/math_prompts.jsonl", "data.reward_fn": "exact",
      "eval.split": "train"}, "dsrl.eval.split = 'train' is dsrl.data.split"),
    ({"eval.every": -1}, "dsrl.eval.every = -1 is out of range"),
    ({"eval.temperature": -0.5}, "dsrl.eval.temperature = -0.5 is out of range"),
])
def test_the_eval_section_refuses_what_cannot_act(overrides, words):
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")):
        dsrl(**overrides)


def test_the_sampling_an_evaluation_generates_with():
    d = dsrl(**{"eval.every": 5, "eval.max_new_tokens": 12})
    s = d.eval_sampling
    assert (s.temperature, s.top_p, s.top_k, s.max_new_tokens) == (0.0, 1.0, 0, 12)
    assert (d.rollout.temperature, d.rollout.max_new_tokens) == (1.0, 8)  # the rollout's are untouched
    assert d.max_eval_generation_tokens == d.max_generation_tokens + 4
    d = dsrl(**{"eval.temperature": 0.6, "eval.samples_per_prompt": 8, "eval.top_k": 5})
    assert (d.eval_sampling.temperature, d.eval_sampling.top_k, d.eval_sampling.max_new_tokens) == (0.6, 5, 8)
    assert d.eval.k == 8 and EvalConfig(pass_k=2, samples_per_prompt=4, temperature=1.0).k == 2


# ------------------------------------------------------------------------------------------ where prompts come from


@pytest.mark.parametrize("task,size", [("reverse", 512), ("copy", 100), ("calculator", 64), ("add", 32)])
def test_a_tasks_held_out_prompts_are_none_of_its_training_prompts(task, size):
    d = dsrl(**{"data.task": task, "data.size": size})
    train = {r["prompt"] for r in load_prompts(d.data, d.run.seed)}
    held = load_eval_prompts(d.eval, d.data, d.run.seed)
    prompts = [r["prompt"] for r in held.records]
    assert held.overlap is None and len(prompts) >= MIN_HELD_OUT
    assert not set(prompts) & train and len(set(prompts)) == len(prompts) <= max(size, 155)
    assert held.records == load_eval_prompts(d.eval, d.data, d.run.seed).records  # a function of the run seed
    assert held.records != load_eval_prompts(d.eval, d.data, d.run.seed + 1).records


def test_where_a_task_cannot_hold_prompts_out_the_whole_space_is_evaluated_and_said():
    d = dsrl(**{"data.task": "add"})  # 512 training draws of 100 sums leave 1 unseen
    held = load_eval_prompts(d.eval, d.data, d.run.seed)
    assert len(held) == 100 and "hold 99 of them, leaving 1" in held.overlap
    assert len(load_eval_prompts(d.eval.model_copy(update={"max_prompts": 7}), d.data, d.run.seed)) == 7


def write_parquet(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_parquet(path)


def rows(tag: str, n: int) -> list[dict]:
    return [{"question": f"{tag} {i}: add: {i}+1 =", "answer": str(i + 1)} for i in range(n)]


def test_a_dataset_evaluates_its_test_split_a_split_or_a_file(tmp_path, tok):
    write_parquet(tmp_path / "ds" / "train-00000-of-00001.parquet", rows("train", 6))
    write_parquet(tmp_path / "ds" / "test-00000-of-00001.parquet", rows("test", 3))
    write_parquet(tmp_path / "ds" / "validation-00000-of-00001.parquet", rows("dev", 2))
    data = DataConfig(path=str(tmp_path / "ds"), prompt_key="question", reward_fn="exact",
                      prompt_template="Q: {question}")
    held = load_eval_prompts(EvalConfig(every=1), data, 0, tok)
    assert [r["prompt"] for r in held.records] == [f"Q: test {i}: add: {i}+1 =" for i in range(3)]  # data's settings
    assert "split 'test'" in held.where
    assert [r["answer"] for r in load_eval_prompts(EvalConfig(split="validation"), data, 0).records] == ["1", "2"]
    (tmp_path / "held.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows("file", 4)), encoding="utf-8")
    from_file = load_eval_prompts(EvalConfig(path=str(tmp_path / "held.jsonl"), max_prompts=2), data, 0)
    assert [r["prompt"] for r in from_file.records] == ["Q: file 0: add: 0+1 =", "Q: file 1: add: 1+1 ="]
    with pytest.raises(ConfigError, match=r"dsrl.eval.split = 'val': the training dataset .* has no such split \(it "
                                          r"has .*validation.*\)\. Fix: set dsrl.eval.split to one of them"):
        load_eval_prompts(EvalConfig(split="val"), data, 0)


def test_nothing_held_out_is_refused_naming_the_settings(tmp_path):
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows("t", 3)), encoding="utf-8")
    data = DataConfig(path=str(tmp_path / "train.jsonl"), prompt_key="question", reward_fn="exact")
    with pytest.raises(ConfigError, match=r"dsrl.eval.every = 10 but nothing held out is set to evaluate on: no "
                                          r"dsrl.eval.path or dsrl.eval.split, and the training dataset .* has no "
                                          r"'test' split .*Fix: set dsrl.eval.path .* or dsrl.eval.every to 0"):
        load_eval_prompts(EvalConfig(every=10), data, 0, asked_by="dsrl.eval.every = 10")
    with pytest.raises(ConfigError, match="the evaluation would measure the prompts the run trains on"):
        load_eval_prompts(EvalConfig(path=str(tmp_path / "train.jsonl")), data, 0)
    write_parquet(tmp_path / "two" / "train-00000-of-00001.parquet", rows("a", 2))
    write_parquet(tmp_path / "two" / "validation-00000-of-00001.parquet", rows("b", 2))
    with pytest.raises(ConfigError, match=r"dsrl.eval.split is unset and dsrl.eval.path = .* holds the splits train, "
                                          r"validation but no 'test' split"):
        load_eval_prompts(EvalConfig(path=str(tmp_path / "two")), data, 0)


def test_evaluation_prompts_are_checked_like_training_prompts(tmp_path, tok):
    (tmp_path / "e.jsonl").write_text(json.dumps({"question": "x " * 40, "answer": "1"}) + "\n", encoding="utf-8")
    data = DataConfig(path="tests/data/math_prompts.jsonl", prompt_key="question", reward_fn="exact",
                      max_prompt_tokens=16)
    with pytest.raises(ConfigError, match=r"1 of the 1 prompts of dsrl.eval.path = .* are longer than "
                                          r"dsrl.data.max_prompt_tokens = 16"):
        load_eval_prompts(EvalConfig(path=str(tmp_path / "e.jsonl")), data, 0, tok)


@pytest.mark.parametrize("n,replicas,per_call", [(40, 2, 64), (40, 3, 7), (5, 4, 1), (1, 8, 3), (13, 1, 5)])
def test_replica_calls_evaluate_each_prompt_once_in_equally_many_calls(n, replicas, per_call):
    calls = [replica_calls(n, replicas, d, per_call) for d in range(replicas)]
    assert len({len(c) for c in calls}) == 1  # every rank makes as many generate calls
    flat = [i for c in calls for part in c for i in part]
    assert sorted(flat) == list(range(n)) and all(len(part) <= per_call for c in calls for part in c)
    assert prompts_per_call(8, 8, 1) == 64 and prompts_per_call(1, 2, 8) == 1


# -------------------------------------------------------------------------------------------- one evaluation


class FakeBackend(RolloutBackend):
    """Answers each prompt with its token ids reversed (the reverse task's answer for letters), the k-th sample
    wrong when ``wrong_from`` <= k; records calls; ``with_sampling`` gives a fresh one (closed after)."""

    def __init__(self, tok, wrong_from=99, log=None):
        self.tok, self.wrong_from, self.log = tok, wrong_from, log if log is not None else []
        self.cfg = None

    def with_sampling(self, rollout_cfg):
        view = FakeBackend(self.tok, self.wrong_from, self.log)
        view.cfg = rollout_cfg
        self.log.append(("with_sampling", rollout_cfg.temperature, rollout_cfg.max_new_tokens))
        return view

    def sync_weights(self):
        self.log.append(("sync",))

    def close(self):
        self.log.append(("close",))

    def generate(self, prompt_ids, samples_per_prompt, seed):
        self.log.append(("generate", len(prompt_ids), samples_per_prompt, seed))
        torch.rand(5)  # a backend that draws: the caller's stream must not move
        out = []
        for i, p in enumerate(prompt_ids):
            text = self.tok.decode(p, skip_special_tokens=True).split(": ")[1].split(" =")[0][::-1]
            for j in range(samples_per_prompt):
                ids = self.tok(text if j < self.wrong_from else "zz", add_special_tokens=False)["input_ids"]
                out.append(Completion(i, list(p), ids + [self.tok.eos_token_id], True, [0.0] * (len(ids) + 1)))
        return out


class FakeStop:
    def __init__(self, after):
        self.after, self.calls = after, 0

    def decide(self, steps_left):
        self.calls += 1
        return "finish" if self.calls > self.after else None


def evaluator(tok, backend, d=None, stop=None, per_call=16, metrics=None, samples_path=None):
    d = d or dsrl(**{"eval.every": 2})
    prompts = load_eval_prompts(d.eval, d.data, d.run.seed)
    scorer = Scorer(d.data, tok, load_reward_fn(d.data), load_accuracy_fn(d.data))
    return Evaluator(EvalSettings.of(d, rollouts=6), prompts, backend, scorer, tok, ParallelView(None, 1.0, 1, 0),
                     torch.device("cpu"), per_call, context=RunContext(stop=stop), metrics=metrics,
                     progress=EvalProgress(),
                     samples_path=samples_path)


def test_log_samples_writes_the_first_prompts_completions(tok, tmp_path):
    path = tmp_path / "eval_samples.jsonl"
    evaluator(tok, FakeBackend(tok), dsrl(**{"eval.every": 2, "eval.log_samples": 3}), samples_path=str(path)).run(4)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["prompt_index"] for r in rows] == [0, 1, 2] and all(r["rollout"] == 4 for r in rows)
    assert all(r["completion"] and r["accuracy"] == 1.0 and r["prompt"] for r in rows)
    evaluator(tok, FakeBackend(tok), samples_path=str(tmp_path / "none.jsonl")).run(4)  # log_samples 0: no file
    assert not (tmp_path / "none.jsonl").exists()


def test_one_evaluation_its_row_calls_and_untouched_random_streams(tok):
    log = []
    ev = evaluator(tok, FakeBackend(tok, log=log))
    random.seed(3)
    torch.manual_seed(3)
    np.random.seed(3)
    before = (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy())
    row = ev.evaluate_if_due(0, optimizer_step=20)
    assert torch.equal(torch.get_rng_state(), before[0]) and random.getstate() == before[1]
    assert (np.random.get_state()[1] == before[2]).all()
    assert row["accuracy"] == row["pass_at_k"] == row["reward_mean"] == 1.0
    assert (row["rollout"], row["optimizer_step"], row["prompts"], row["samples_per_prompt"], row["pass_k"]) == (
        0, 20, 40, 1, 1)
    assert log[0] == ("with_sampling", 0.0, 8) and log[1] == ("sync",) and log[-1] == ("close",)
    assert [e[1] for e in log if e[0] == "generate"] == [16, 16, 8]  # calls of at most per_call prompts
    assert ev.evaluate_if_due(0) is None and ev.evaluate_if_due(1) is None  # ran already / not due
    assert ev.progress.last == 0 and ev.evaluate_if_due(2)["prompts"] == 40
    assert "eval at rollout 2/6: 40 prompts x 1 | acc 1.000 | pass@1 1.000" in eval_line(row | {"rollout": 2}, 6)


def test_pass_at_k_and_accuracy_of_sampled_evaluations(tok):
    d = dsrl(**{"eval.every": 2, "eval.temperature": 1.0, "eval.samples_per_prompt": 4, "eval.pass_k": 2})
    row = evaluator(tok, FakeBackend(tok, wrong_from=1), d).run(4)
    assert row["accuracy"] == 0.25 and row["pass_at_k"] == pytest.approx(pass_at_k(4, 1, 2)) == 0.5
    assert row["reward_mean"] < 1.0 and (row["samples_per_prompt"], row["pass_k"]) == (4, 2)


def test_a_stop_request_ends_an_evaluation_between_calls_and_it_stays_due(tok):
    log = []
    ev = evaluator(tok, FakeBackend(tok, log=log), stop=FakeStop(after=2))
    assert ev.evaluate_if_due(4) is None
    assert [e[0] for e in log].count("generate") == 2 and log[-1] == ("close",)  # the backend is released
    assert ev.progress.last == -1 and ev.schedule.due(4)  # resume runs it


def test_the_eval_row_goes_to_metrics_and_the_monitor(tmp_path, tok):
    from dsrl.runtime.metrics import MetricsWriter

    events = []
    monitor = types.SimpleNamespace(enabled=True, write_events=events.extend)
    ev = evaluator(tok, FakeBackend(tok), metrics=MetricsWriter(str(tmp_path), 0, monitor))
    ev.evaluate_if_due(0, optimizer_step=7)
    row = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert row["event"] == "eval" and row["accuracy"] == 1.0
    assert ("dsrl/eval/accuracy", 1.0, 7) in events and ("dsrl/eval/pass_at_k", 1.0, 7) in events


# ------------------------------------------------------------------------------------- the backends' with_sampling


PAD, BOS, EOS = 0, 1, 2
TOK = types.SimpleNamespace(eos_token_id=EOS, pad_token_id=PAD)
PROMPTS = [[BOS, 5, 6, 7, 3, 4], [BOS, 4], [BOS, 3, 5, 3]]


def test_with_sampling_generates_greedily_on_the_same_weights():
    from dsrl.rl.policy.model import build_model
    from dsrl.rollout.cb import CallBounds, ContinuousBatchingBackend
    from dsrl.rollout.hf import HFRolloutBackend

    model = build_model(ModelConfig(), 32, PAD, BOS, EOS, on_gpu=False, seed=0)
    train = RolloutConfig(max_new_tokens=6, temperature=1.0)
    greedy = RolloutConfig.model_construct(**{**train.model_dump(), "temperature": 0.0, "max_new_tokens": 9})
    want = HFRolloutBackend(model, TOK, greedy).generate(PROMPTS, 1, seed=0)
    assert all(len(c.completion_ids) == 9 or c.finished for c in want)
    for run_backend in (HFRolloutBackend(model, TOK, train),
                        ContinuousBatchingBackend(model, TOK, train, bounds=CallBounds(8, 12))):
        view = run_backend.with_sampling(greedy)
        assert type(view) is type(run_backend) and view is not run_backend and view.module is model
        assert view.cfg.temperature == 0.0 and run_backend.cfg.temperature == 1.0
        got = view.generate(PROMPTS, 1, seed=123)
        assert [c.completion_ids for c in got] == [c.completion_ids for c in want]
        view.close()
    cb_view = ContinuousBatchingBackend(model, TOK, train, bounds=CallBounds(8, 12)).with_sampling(greedy)
    assert cb_view.bounds == CallBounds(8, 15)  # as many sequences, each 3 tokens longer
    cb_view.generate(PROMPTS, 1, seed=0)
    assert cb_view._session is not None
    cb_view.close()
    assert cb_view._session is None  # its paged cache is released


def test_a_backend_without_other_sampling_says_so():
    with pytest.raises(NotImplementedError, match="cannot generate with other sampling settings"):
        FakeBackend.__mro__[1].with_sampling(types.SimpleNamespace(), RolloutConfig())


# ------------------------------------------------------------------------------------------------------- the plot


def test_the_plot_has_an_eval_panel(tmp_path):
    pytest.importorskip("matplotlib")
    from dsrl.runtime.plot import plot_run

    base = {"optimizer_step": 1, "reward_mean": 0.1, "accuracy": 0.0, "entropy": 1.0, "loss": 0.0}
    lines = [{"event": "step", "rollout": 1, "call": 1, "optimizer_step": 1, "lr": 1e-3}]
    lines += [{"event": "rollout", "rollout": r, **base} for r in (1, 2)]
    lines += [{"event": "eval", "rollout": r, "prompts": 40, "samples_per_prompt": 4, "pass_k": 4, "accuracy": 0.1 * r,
               "pass_at_k": 0.2 * r, "reward_mean": 0.3} for r in (0, 2)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = plot_run(str(tmp_path))
    assert Path(out).stat().st_size > 1000


# -------------------------------------------------------------------------------------------------------- the docs


def test_docs_evaluation_md_shows_what_the_code_does(tok):
    import re

    from conftest import REPO

    doc = (REPO / "docs" / "evaluation.md").read_text(encoding="utf-8")
    blocks = [json.loads(b) for b in re.findall(r"```json\n(.*?)```", doc, re.S)]
    run_file, row = blocks
    d = load_config(RUN, {f"dsrl.eval.{k}": v for k, v in run_file["dsrl"]["eval"].items()}).dsrl
    assert d.eval.every == 20
    shown = evaluator(tok, FakeBackend(tok)).run(0, optimizer_step=0)
    assert set(row) == {"event", *shown}  # the documented row has exactly the row's keys
    table = re.search(r"## Settings\n\n(.*?)\n\n", doc, re.S).group(1)
    keys = {k for cell in re.findall(r"^\| (`[^|]*`) \|", table, re.M) for k in re.findall(r"`(\w+)`", cell)}
    assert keys == set(EvalConfig.model_fields)
    for config in re.findall(r"--ds_config (\S+)", doc):
        assert (REPO / config).is_file(), config
