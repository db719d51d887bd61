"""Multi-turn rollouts (issue 21, items 2, 3 and 5; dsrl.rl.episodes.driver, dsrl.rl.episodes.trajectory).

- token-in/token-out: a model turn's tokens are kept exactly (eos and special tokens included, never re-tokenized
  from text); observations are appended with loss mask 0 and behavior log-prob 0.0; collate counts model tokens
  only; per-turn seeds are derived from the round's seed, finished trajectories leave the batch;
- the bounds: max_turns, the token bound cutting a model turn, an observation that does not fit (said once);
- greedy multi-turn generation gives the same trajectories on the hf and cb backends;
- scoring: the environment's rewards summed (+ data.reward_fn of the last model turn), accuracy on that turn;
- downstream: GAE skips observation tokens (equal to GAE on the model tokens alone), the KL penalty in the
  reward counts model tokens only;
- the supervised warm-up's demonstration of the calculator task shows the call, the masked tool result and the
  answer; the task's tool works and its control has none.
"""

from __future__ import annotations

import logging
import types

import pytest
import torch

from dsrl.config import DataConfig, ModelConfig, RolloutConfig
from dsrl.core.seeds import derived_seed
from dsrl.rl.critic import NO_CRITIC
from dsrl.rl.data.batching import collate
from dsrl.rl.episodes.driver import EpisodeRunner, demonstration, score_trajectories
from dsrl.rl.episodes.environment import EnvironmentCaller, ObservationEncoder
from dsrl.rl.episodes.trajectory import DONE, MAX_TOKENS, MAX_TURNS, OBSERVATION_OVERFLOW, Trajectory
from dsrl.rl.policy.tokenizer import load_tokenizer
from dsrl.rl.rewards.functions import as_batched
from dsrl.rollout.base import Completion, stop_token_ids

TOK = load_tokenizer(ModelConfig())
EOS, UNK = TOK.eos_token_id, TOK.unk_token_id
PROMPTS = [TOK("ab =")["input_ids"], TOK("c =")["input_ids"]]
RECORDS = [{"prompt": "ab =", "answer": "x"}, {"prompt": "c =", "answer": "y"}]


class Scripted:
    """A backend whose turn k of a trajectory is ``script(prefix)``; records every call."""

    def __init__(self, script):
        self.script, self.calls = script, []

    def generate(self, prompt_ids, samples_per_prompt, seed):
        self.calls.append(([list(p) for p in prompt_ids], samples_per_prompt, seed))
        out = []
        for i, p in enumerate(prompt_ids):
            for j in range(samples_per_prompt):
                tokens, finished = self.script(list(p), j)
                out.append(Completion(i, list(p), tokens, finished, [-0.5 - 0.01 * k for k in range(len(tokens))]))
        return out


class Echo:
    """An episode: answers a turn with '=<its length>\\n' (reward 0.25) until turn ``stop``, then done (reward 1)."""

    stop = 2

    def __init__(self, prompt, answer):
        self.prompt = prompt

    def step(self, turn):
        if turn.index >= self.stop or "z" in turn.text:
            return {"reward": 1.0, "done": True}
        return {"observation": f"={len(turn.token_ids)}\n", "reward": 0.25}


class ByText(Echo):
    """An episode whose observations and final reward depend on the generated text (backends must agree on it)."""

    stop = 3

    def step(self, turn):
        if turn.index >= self.stop:
            return {"reward": float(len(turn.text)), "done": True}
        return {"observation": f"={len(turn.token_ids)}{turn.text[:2]}\n", "reward": 0.1 * turn.index}


def runner(backend, factory=Echo, max_turns=4, max_tokens=64) -> EpisodeRunner:
    env = EnvironmentCaller(factory, "tests:Echo")
    return EpisodeRunner(backend, TOK, env, ObservationEncoder(TOK, False), max_turns, max_tokens)


def test_turns_are_token_exact_masked_seeded_and_finished_ones_leave():
    # turn tokens: 'q', <unk>, eos -- <unk> decodes to nothing, so re-tokenizing the text would lose it
    backend = Scripted(lambda prefix, j: ([TOK.convert_tokens_to_ids("q"), UNK, EOS], True))
    trajs = runner(backend).run(RECORDS, PROMPTS, 2, seed=11, labels=[5, 9])
    assert len(trajs) == 4 and [t.prompt_index for t in trajs] == [0, 0, 1, 1]
    turn = [TOK.convert_tokens_to_ids("q"), UNK, EOS]
    obs = TOK("=3\n", add_special_tokens=False)["input_ids"]
    t = trajs[0]
    assert t.completion_ids == turn + obs + turn + obs + turn and t.ended_by == DONE
    assert t.mask == [1] * 3 + [0] * 3 + [1] * 3 + [0] * 3 + [1] * 3
    assert t.behavior_logprobs[3:6] == [0.0] * 3 and t.behavior_logprobs[:3] == pytest.approx([-0.5, -0.51, -0.52])
    assert (t.turns, t.tool_calls, t.reward, t.last_text) == (3, 2, 1.5, "q")
    # turn 0 generates G per prompt with the round's seed, later turns one per active prefix with derived seeds
    assert [(g, seed) for _, g, seed in backend.calls] == [(2, 11), (1, derived_seed(11, 1)), (1, derived_seed(11, 2))]
    assert backend.calls[1][0] == [trajs[k].prompt_ids + turn + obs for k in range(4)]
    sample = t.sample(group=5, reward=t.reward)
    micro = collate([sample], pad_id=0)
    model_targets = [p for p in range(len(sample.tokens) - 1) if p + 1 >= sample.prompt_len
                     and t.mask[p + 1 - sample.prompt_len]]
    assert micro["loss_mask"][0].nonzero().flatten().tolist() == model_targets
    assert sample.turn_mask == sample.completion_mask == t.mask and sample.finished
    # a trajectory that is done early leaves the batch: the next turn generates only the others
    early = Scripted(lambda prefix, j: ([TOK.convert_tokens_to_ids("z" if (j == 1 and len(prefix) < 6) else "q"),
                                         EOS], True))
    trajs = runner(early).run(RECORDS, PROMPTS, 2, seed=0)
    assert [t.turns for t in trajs] == [3, 1, 3, 1] and len(early.calls[1][0]) == 2


def test_bounds_cut_trajectories_as_truncated(caplog):
    long_turn = Scripted(lambda prefix, j: ([TOK.convert_tokens_to_ids("q")] * 5, False))
    trajs = runner(long_turn, max_turns=2).run(RECORDS[:1], PROMPTS[:1], 1, seed=0)
    assert trajs[0].ended_by == MAX_TURNS and trajs[0].turns == 2 and len(trajs[0].rewards) == 2
    trajs = runner(long_turn, max_tokens=12).run(RECORDS[:1], PROMPTS[:1], 1, seed=0)
    t = trajs[0]  # 5 + 3 (obs) + 4 of the next 5 tokens: the turn is cut, and no step runs for it
    assert t.ended_by == MAX_TOKENS and len(t.completion_ids) == 12 and t.mask[-4:] == [1] * 4
    assert len(t.rewards) == 1

    class Verbose(Echo):
        def step(self, turn):
            return {"observation": "=" + "9" * 20 + "\n", "reward": 0.0}

    with caplog.at_level(logging.WARNING, logger="dsrl.episodes"):
        trajs = runner(long_turn, factory=Verbose, max_tokens=20).run(RECORDS, PROMPTS, 2, seed=0)
    assert all(t.ended_by == OBSERVATION_OVERFLOW and t.completion_ids == [t.completion_ids[0]] * 5 for t in trajs)
    assert caplog.text.count("the observation for prompt") == 1  # said once per round
    assert "22 tokens, but only 15 of rollout.max_trajectory_tokens = 20 are left" in caplog.text
    assert "dsrl.data.environment = 'tests:Echo'" in caplog.text and "sample 1 of 2" in caplog.text
    assert "Fix: raise dsrl.rollout.max_trajectory_tokens" in caplog.text
    for t in trajs:
        assert not t.sample(0, 0.0).finished  # truncated: handled like an overlong completion


def test_scoring_sums_environment_rewards_adds_the_reward_fn_and_measures_the_last_turn():
    trajs = []
    for rewards, text in (([0.25, 1.0], "42"), ([0.0, float("nan")], "4")):
        t = Trajectory(0, [1, 5])
        t.add_model_turn([7], [-1.0])
        t.rewards, t.last_text, t.ended_by = rewards, text, DONE
        trajs.append(t)
    seen = []

    def reward_fn(prompts, completions, answers):
        seen.append(completions)
        return [0.5 for _ in completions]

    groups = score_trajectories([17], [{"prompt": "p", "answer": "42"}], trajs, reward_fn=as_batched(reward_fn),
                                accuracy_fn=as_batched(lambda p, c, a: [float(x == "42") for x in c]),
                                data=DataConfig(rule_reward_weight=2.0, reward_model_weight=1.0), version=3,
                                model_scores=[0.1, 0.1])
    (a, b), = groups
    assert seen == [["42", "4"]] and a.reward == pytest.approx(2 * (1.25 + 0.5) + 0.1) and a.accuracy == 1.0
    assert b.reward != b.reward and b.group == 17 and a.version == 3  # NaN: a timed-out step masks the sample


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_greedy_trajectories_equal_on_hf_and_cb(arch):
    from dsrl.rl.policy.model import build_model
    from dsrl.rollout.cb import ContinuousBatchingBackend
    from dsrl.rollout.hf import HFRolloutBackend

    model = build_model(ModelConfig(arch=arch, tiny={"tie_word_embeddings": False}), len(TOK), TOK.pad_token_id,
                        TOK.bos_token_id, EOS, on_gpu=False, seed=1)
    with torch.no_grad():
        model.lm_head.weight[EOS] *= 6.0  # some turns end at eos, others at max_new_tokens
    cfg = RolloutConfig.model_construct(**{**RolloutConfig(max_new_tokens=6).model_dump(), "temperature": 0.0,
                                           "generation_batch_size": 2})

    prompts = [TOK(p)["input_ids"] for p in ("ab =", "c =", "reverse: abc =")]
    records = [{"prompt": "x", "answer": "y"}] * 3
    got = {}
    for name, cls in (("hf", HFRolloutBackend), ("cb", ContinuousBatchingBackend)):
        got[name] = runner(cls(model, TOK, cfg), factory=ByText, max_turns=4, max_tokens=48).run(
            records, prompts, 2, seed=0)
    hf, cb = got["hf"], got["cb"]
    assert [(t.completion_ids, t.mask, t.ended_by, t.rewards) for t in hf] == \
           [(t.completion_ids, t.mask, t.ended_by, t.rewards) for t in cb]
    assert max(t.turns for t in hf) == 4 and DONE in {t.ended_by for t in hf}
    assert {len(t.completion_ids) for t in hf} != {len(hf[0].completion_ids)}  # turns of different lengths
    for a, b in zip(hf, cb):
        torch.testing.assert_close(torch.tensor(a.behavior_logprobs), torch.tensor(b.behavior_logprobs), atol=1e-5,
                                   rtol=0)


def test_the_calculator_demonstration_and_its_control():
    from dsrl.tasks.calculator import Calculator, NoToolCalculator

    rollout = RolloutConfig(stop_strings=["]"])
    stops = stop_token_ids(TOK, None, rollout)
    record = {"prompt": "calculator: 347*862 =", "answer": "299114"}
    prompt = TOK(record["prompt"])["input_ids"]
    env = EnvironmentCaller(Calculator, "dsrl.tasks.calculator:Calculator")
    t = demonstration(env, TOK, ObservationEncoder(TOK, False), stops, record, prompt, 32)
    text = TOK.decode(t.completion_ids)
    assert text == "[347*862]=299114\n299114</s>"  # the call ends at its stop token: no eos after it
    assert t.mask == [1] * 9 + [0] * 8 + [1] * 7 and t.ended_by == DONE
    control = EnvironmentCaller(NoToolCalculator, "dsrl.tasks.calculator:NoToolCalculator")
    t = demonstration(control, TOK, ObservationEncoder(TOK, False), stops, record, prompt, 32)
    assert TOK.decode(t.completion_ids) == "299114</s>" and t.mask == [1] * 7
    episode = NoToolCalculator(record["prompt"], record["answer"])
    assert episode.step(types.SimpleNamespace(text="[347*862]"))["done"]  # no tool: every turn is the answer


def test_gae_skips_observation_tokens():
    from dsrl.algos.gae import gae

    g = torch.Generator().manual_seed(0)
    mask = torch.tensor([[1, 1, 0, 0, 1, 0, 1, 0], [0, 1, 1, 1, 0, 0, 0, 0]], dtype=torch.bool)
    rewards = torch.randn(2, 8, generator=g, dtype=torch.float64)
    values = torch.randn(2, 8, generator=g, dtype=torch.float64)
    adv, ret = gae(rewards, values, mask, 0.9, 0.8)
    for i in range(2):
        keep = mask[i]
        a, r = gae(rewards[i, keep][None], values[i, keep][None], torch.ones(1, int(keep.sum()), dtype=torch.bool),
                   0.9, 0.8)
        torch.testing.assert_close(adv[i, keep], a[0])
        torch.testing.assert_close(ret[i, keep], r[0])
        assert (adv[i, ~keep] == 0).all() and (ret[i, ~keep] == 0).all()


def test_experience_gae_and_kl_penalty_use_model_tokens_only():
    from dsrl.core.parallel import ParallelView
    from dsrl.rl.experience import ExperienceMaker

    t = Trajectory(0, [1, 5])
    t.add_model_turn([7, 8], [-1.0, -1.0])
    t.add_observation([60, 9])
    t.add_model_turn([9], [-1.0])
    s = t.sample(group=0, reward=1.0)
    s.values = [0.5, 0.25, 9.0, 9.0, 0.125]  # the values at observation tokens must not enter
    s.old_logprobs, s.ref_logprobs = [-1.0, -1.0, -5.0, -5.0, -1.0], [-1.5, -1.0, -1.0, -1.0, -1.0]
    maker = object.__new__(ExperienceMaker)
    maker.d = types.SimpleNamespace(algorithm=types.SimpleNamespace(kl_in="reward", kl_coef=0.5, gamma=1.0, lam=1.0))
    maker.ref_model, maker.algo = object(), types.SimpleNamespace(normalize_std=False)
    maker.view = ParallelView(count_group=None, grad_scale=1.0, data_parallel_size=1, data_parallel_rank=0)
    maker.policy = types.SimpleNamespace(device="cpu")
    maker.gae_advantages([s])
    kl = [0.5, 0.0, 0.0]  # k1 = old - ref on the model tokens
    model_rewards = [-0.5 * kl[0], -0.5 * kl[1], -0.5 * kl[2] + 1.0]
    values = [0.5, 0.25, 0.125]
    want = [sum(model_rewards[k:]) - values[k] for k in range(3)]  # gamma = lam = 1: A_t = sum of rewards - V_t
    assert s.token_advantages[:2] + s.token_advantages[4:] == pytest.approx(want)
    assert s.token_advantages[2:4] == [0.0, 0.0] and s.returns[2:4] == [0.0, 0.0]


def test_the_kl_penalty_in_the_reward_sums_model_tokens_only():
    from dsrl.rl.experience import ExperienceMaker
    from dsrl.runtime.phases import PhaseClock

    t = Trajectory(0, [1, 5])
    t.add_model_turn([7, 8], [-1.0, -1.0])
    t.add_observation([60, 9, 9])
    t.add_model_turn([9], [-1.0])
    s = t.sample(group=0, reward=1.0)
    policy_model, ref_model = object(), object()

    def logprob_fn(model, micro):  # log pi_old = -1 everywhere; log pi_ref = -1.5 on model tokens, -9 elsewhere
        out = torch.full(micro["targets"].shape, -1.0)
        if model is ref_model:
            out = torch.where(micro["loss_mask"] > 0, torch.tensor(-1.5), torch.tensor(-9.0))
        return out

    maker = object.__new__(ExperienceMaker)
    maker.d = types.SimpleNamespace(rollout=types.SimpleNamespace(logprob_micro_batch_size=4),
                                    algorithm=types.SimpleNamespace(kl_in="reward", kl_coef=0.5))
    maker.policy = types.SimpleNamespace(device="cpu",
                                         forward_no_grad=lambda micros, fn: [fn(policy_model, m) for m in micros])
    maker.pad_id, maker.critic, maker.phases = 0, NO_CRITIC, PhaseClock()
    maker.ref_model = types.SimpleNamespace(forward_no_grad=lambda micros, fn: [fn(ref_model, m) for m in micros])
    maker._logprob_fn = lambda: logprob_fn
    maker.score_logprobs([s])
    assert s.reward == pytest.approx(1.0 - 0.5 * 3 * 0.5)  # k1 = 0.5 on each of the 3 model tokens, none elsewhere
