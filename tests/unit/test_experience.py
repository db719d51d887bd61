"""One rollout's experience and the policy actor's log-prob verb, built from their constructors with fakes.

- the experience maker syncs the generating weights once per rollout before generating (and lets a backend with
  memory of its own sleep after it), draws this replica's
  share of the prompt stream, seeds each call with :func:`dsrl.core.seeds.generation_seed`, scores through the one
  reward formula, asks the actor for log-probs and gives group advantages (a planted seed or a planted second sync
  fails the test);
- GAE and the KL penalty in the reward count a trajectory's model tokens only (the experience maker's GAE, the
  actor's KL-in-reward);
- scoring: the one formula for single completions (rule reward, reward model, accuracy).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from dsrl.algos import resolve_algorithm
from dsrl.config import AlgorithmConfig, DataConfig, ModelConfig, RolloutConfig
from dsrl.core.parallel import ParallelView
from dsrl.core.seeds import generation_seed
from dsrl.rl.data.batching import PassBatches, Sample
from dsrl.rl.data.prompts import PromptSource
from dsrl.rl.episodes.trajectory import Trajectory
from dsrl.rl.experience import ExperienceMaker, ExperienceSettings
from dsrl.rl.policy.actor import ActorSettings, PolicyActor
from dsrl.rl.policy.tokenizer import load_tokenizer
from dsrl.rl.rewards.functions import as_batched, load_accuracy_fn, load_reward_fn
from dsrl.rl.rewards.scoring import Scorer
from dsrl.rollout.base import Completion, RolloutBackend

TOK = load_tokenizer(ModelConfig())
VIEW = ParallelView(count_group=None, grad_scale=1.0, data_parallel_size=1, data_parallel_rank=0)


class Plan:
    """The two numbers of a plan the experience maker reads."""

    prompts_per_rank = 2
    samples_per_prompt = 2


class FakeActor:
    """The actor's log-prob verb without a model: log pi_old = -1 on every completion token."""

    view, device, has_reference = VIEW, torch.device("cpu"), False

    def __init__(self):
        self.passes = 0

    def pass_batches(self, samples: list[Sample], pad_id: int) -> PassBatches:
        return PassBatches.of(samples, 4, pad_id)

    def add_logprobs(self, batches: PassBatches, *, with_routes: bool = False, kl_in_reward: bool = True) -> None:
        self.passes += 1
        for g in batches.groups:
            for s in g:
                s.old_logprobs = [-1.0] * s.completion_len


class Answering(RolloutBackend):
    """Sample k of a prompt answers its reference answer when k is even, else "x"; records syncs and seeds."""

    def __init__(self, records: list[dict], calls: list):
        self.records, self.calls = records, calls

    def sync_weights(self) -> None:
        self.calls.append("sync")

    def sleep(self) -> None:
        self.calls.append("sleep")

    def generate(self, prompt_ids, samples_per_prompt, seed):
        self.calls.append(("generate", seed))
        by_prompt = {tuple(TOK(r["prompt"])["input_ids"]): r["answer"] for r in self.records}
        out = []
        for i, p in enumerate(prompt_ids):
            for k in range(samples_per_prompt):
                text = by_prompt[tuple(p)] if k % 2 == 0 else "x"
                ids = TOK(text, add_special_tokens=False)["input_ids"] + [TOK.eos_token_id]
                out.append(Completion(i, list(p), ids, True, [-1.0] * len(ids)))
        return out


def _maker(calls: list, data: DataConfig | None = None) -> tuple[ExperienceMaker, FakeActor]:
    data = data or DataConfig(task="reverse", size=8)
    prompts = PromptSource.load(data, 2, 0, "drop", TOK)
    settings = ExperienceSettings(AlgorithmConfig(name="grpo"), RolloutConfig(), data, seed=0, max_completion_tokens=8)
    actor = FakeActor()
    scorer = Scorer(data, TOK, load_reward_fn(data), load_accuracy_fn(data))
    maker = ExperienceMaker(settings, Plan(), actor, Answering(prompts.records, calls), prompts, scorer,
                            resolve_algorithm(settings.algorithm), TOK.pad_token_id)
    return maker, actor


def test_a_rollout_syncs_then_generates_scores_and_gives_group_advantages():
    calls: list = []
    maker, actor = _maker(calls)
    for rollout in (0, 1):
        samples, stats, rounds = maker.make(rollout)
        assert rounds == 1 and len(samples) == 4 and stats.samples == 4 and actor.passes == rollout + 1
        assert [s.accuracy for s in samples] == [1.0, 0.0, 1.0, 0.0]
        for g in (samples[:2], samples[2:]):  # GRPO: (r - mean) / std within each prompt's group
            r = torch.tensor([s.reward for s in g], dtype=torch.float64)
            want = ((r - r.mean()) / (r.std() + 1e-6)).tolist()
            assert [s.advantage for s in g] == pytest.approx(want, abs=1e-5) and g[0].advantage > 0
        assert all(s.old_logprobs == [-1.0] * s.completion_len and s.version == rollout for s in samples)
    seeds = [("generate", generation_seed(0, r, 0, 0)) for r in (0, 1)]
    assert calls == ["sync", seeds[0], "sleep", "sync", seeds[1], "sleep"]  # asleep from generation to the next sync


def test_the_first_two_rollouts_draw_the_prompt_stream_in_order():
    calls: list = []
    maker, _ = _maker(calls)
    twin = PromptSource.load(DataConfig(task="reverse", size=8), 2, 0, "drop", TOK)
    for rollout in (0, 1):
        samples, _, _ = maker.make(rollout)
        assert sorted({s.group for s in samples}) == sorted(twin.next_indices())


def test_gae_and_the_kl_penalty_in_the_reward_count_model_tokens_only():
    t = Trajectory(0, [1, 5])
    t.add_model_turn([7, 8], [-1.0, -1.0])
    t.add_observation([60, 9])
    t.add_model_turn([9], [-1.0])
    s = t.sample(group=0, reward=1.0)
    s.values = [0.5, 0.25, 9.0, 9.0, 0.125]  # the values at observation tokens must not enter
    s.old_logprobs, s.ref_logprobs = [-1.0, -1.0, -5.0, -5.0, -1.0], [-1.5, -1.0, -1.0, -1.0, -1.0]
    algorithm = AlgorithmConfig(name="ppo", kl_in="reward", kl_coef=0.5, gamma=1.0, lam=1.0)
    data = DataConfig(task="reverse", size=8)
    settings = ExperienceSettings(algorithm, RolloutConfig(), data, seed=0, max_completion_tokens=8)
    actor = FakeActor()
    actor.has_reference = True
    maker = ExperienceMaker(settings, Plan(), actor, Answering([], []), PromptSource.load(data, 2, 0, "drop", TOK),
                            Scorer(data, TOK), dataclasses.replace(resolve_algorithm(algorithm), normalize_std=False),
                            TOK.pad_token_id)
    maker.gae_advantages([s])
    kl = [0.5, 0.0, 0.0]  # k1 = old - ref on the model tokens
    model_rewards = [-0.5 * kl[0], -0.5 * kl[1], -0.5 * kl[2] + 1.0]
    values = [0.5, 0.25, 0.125]
    want = [sum(model_rewards[k:]) - values[k] for k in range(3)]  # gamma = lam = 1: A_t = sum of rewards - V_t
    assert s.token_advantages[:2] + s.token_advantages[4:] == pytest.approx(want)
    assert s.token_advantages[2:4] == [0.0, 0.0] and s.returns[2:4] == [0.0, 0.0]


class Passes:
    """A model as a no-grad pass runs it: ``fn(self, micro)`` per micro-batch."""

    view, device = VIEW, torch.device("cpu")

    def forward_no_grad(self, micros, fn):
        return [fn(self, m) for m in micros]


def test_the_actor_subtracts_the_kl_of_model_tokens_from_the_reward():
    t = Trajectory(0, [1, 5])
    t.add_model_turn([7, 8], [-1.0, -1.0])
    t.add_observation([60, 9, 9])
    t.add_model_turn([9], [-1.0])
    s = t.sample(group=0, reward=1.0)
    policy, reference = Passes(), Passes()

    def logprob_fn(model, micro):  # log pi_old = -1 everywhere; log pi_ref = -1.5 on model tokens, -9 elsewhere
        out = torch.full(micro["targets"].shape, -1.0)
        if model is reference:
            out = torch.where(micro["loss_mask"] > 0, torch.tensor(-1.5), torch.tensor(-9.0))
        return out

    settings = ActorSettings(AlgorithmConfig(kl_in="reward", kl_coef=0.5), temperature=1.0, logprob_micro_batch_size=4)
    actor = PolicyActor(policy, None, settings, reference=reference)
    actor._logprob_fn = lambda: logprob_fn
    actor.add_logprobs(actor.pass_batches([s], TOK.pad_token_id))
    assert s.reward == pytest.approx(1.0 - 0.5 * 3 * 0.5)  # k1 = 0.5 on each of the 3 model tokens, none elsewhere
    assert s.ref_logprobs[2:5] == [-9.0, -9.0, -9.0]  # the observation tokens' reference log-probs are computed...
    s2 = t.sample(group=0, reward=1.0)
    actor.add_logprobs(actor.pass_batches([s2], TOK.pad_token_id), kl_in_reward=False)  # ...with a critic: no penalty
    assert s2.reward == 1.0


def test_the_one_reward_formula_for_single_completions():
    records = [{"prompt": "p", "answer": "42"}]
    ids = [TOK("42", add_special_tokens=False)["input_ids"], TOK("4", add_special_tokens=False)["input_ids"]]
    completions = [Completion(0, [1, 2], c, True, None, version=None) for c in ids]
    rule = as_batched(lambda prompts, completions, answers: [float(c == a) for c, a in zip(completions, answers)])
    accuracy = as_batched(lambda prompts, completions, answers: [0.5 for _ in completions])
    scorer = Scorer(DataConfig(rule_reward_weight=2.0, reward_model_weight=3.0), TOK, rule, accuracy)
    (a, b), = scorer.completions([9], records, completions, version=4, model_scores=[0.25, -1.0])
    assert (a.reward, b.reward) == (2.0 + 0.75, -3.0) and a.accuracy == 0.5 and a.group == 9 and b.version == 4
    (a, b), = Scorer(DataConfig(), TOK).completions([9], records, completions, version=4)
    assert (a.reward, b.reward, a.accuracy) == (0.0, 0.0, None)  # no rule reward, no model: 0, no accuracy
    nan = as_batched(lambda prompts, completions, answers: [float("nan") for _ in completions])
    (a, _), = Scorer(DataConfig(), TOK, nan).completions([9], records, completions, version=0)
    assert math.isnan(a.reward)
