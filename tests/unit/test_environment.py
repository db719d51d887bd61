"""The environment contract (issue 21, items 1 and 4; dsrl.rl.episodes.environment), its config rules and the waiting
rank's reports (dsrl.runtime.watchdog).

- every bad environment is one sentence naming data.environment, the sample and the fix: a factory that raises,
  an episode without step(), a step that raises, a result of the wrong shape or types; a hang past
  data.environment_timeout_s masks its trajectory (reward NaN), counted, with a warning naming the sample; a
  non-finite reward masks the trajectory (nothing non-finite reaches the loss);
- observations are tokenized by the run's tokenizer: as text, or through the chat template's tool message;
- config rules: turn bounds need an environment, the environment's timeout is below the collective bound, the
  token budget holds a whole trajectory, a stop string is one token; the plan shows the bounds;
- a rank waiting at a phase end names the rank it waits for, what that rank noted doing and for how long.
"""

from __future__ import annotations

import logging
import math
import time
import types

import pytest

from dsrl.config import ConfigError, DataConfig, DsrlConfig, ModelConfig, RolloutConfig
from dsrl.core.plan import BatchPlan
from dsrl.rl.episodes.environment import EnvironmentCaller, EnvStep, ObservationEncoder, Turn, load_environment
from dsrl.rl.policy.tokenizer import load_tokenizer
from dsrl.rollout.base import stop_token_ids
from dsrl.runtime import watchdog

TOK = load_tokenizer(ModelConfig())
TURN = Turn("12", [7, 8], 0, True)
WHERE = "prompt 7 ('calculator: 1*2 ='), sample 1 of 2"


def caller(step=None, factory=None, timeout_s=None) -> EnvironmentCaller:
    class Episode:
        def step(self, turn):
            return step(turn)

    return EnvironmentCaller(factory or (lambda prompt, answer: Episode()), "my_env.py:Env", timeout_s)


def run_step(env: EnvironmentCaller):
    episode, late = env.start("p", "a", WHERE)
    assert not late
    return env.step(episode, TURN, WHERE)


def test_good_results_dict_tuple_defaults():
    want = EnvStep("=3\n", 0.5, False)
    assert run_step(caller(lambda t: {"observation": "=3\n", "reward": 0.5})) == want
    assert run_step(caller(lambda t: ("=3\n", 0.5, False))) == want
    step = run_step(caller(lambda t: {"done": True}))
    assert (step.observation, step.reward, step.done) == ("", 0.0, True)
    step = run_step(caller(lambda t: (None, None, 1)))
    assert (step.observation, step.reward, step.done) == ("", 0.0, True)


def _raise(exc):
    raise exc


BAD = [
    ("factory raises", dict(factory=lambda p, a: _raise(KeyError("no sandbox"))),
     r"dsrl.data.environment = 'my_env.py:Env': the factory raised KeyError: 'no sandbox' for prompt 7 .*Fix:"),
    ("no step", dict(factory=lambda p, a: object()), r"returned <object .*no step\(turn\) method\. Fix:"),
    ("step raises", dict(step=lambda t: 1 / 0), r"step\(\) of turn 0 raised ZeroDivisionError.*prompt 7.*model turn "
                                                r"'12'.*Fix:"),
    ("a string", dict(step=lambda t: "oops"), r"returned 'oops' \(str\) for prompt 7.*Fix: return that"),
    ("observation not text", dict(step=lambda t: (5, 0.0, False)), r"the observation 5 \(int\), not a string"),
    ("reward not a number", dict(step=lambda t: {"reward": "good"}), r"the reward 'good' \(str\), not a number"),
    ("done not a bool", dict(step=lambda t: {"done": "yes"}), r"done = 'yes' \(str\), not a bool"),
    ("unknown key", dict(step=lambda t: {"obs": "x"}), r"a dict with the unknown key\(s\) obs"),
    ("two values", dict(step=lambda t: ("x", 1.0)), r"returned \('x', 1.0\) \(tuple\)"),
]


@pytest.mark.parametrize("case,kwargs,message", BAD, ids=[c[0] for c in BAD])
def test_a_bad_environment_is_one_sentence_naming_it_the_sample_and_the_fix(case, kwargs, message):
    with pytest.raises(ConfigError, match=message) as info:
        run_step(caller(**kwargs))
    assert str(info.value).count("\n") == 0


def test_a_hang_is_cut_masked_counted_and_named(caplog):
    def slow(turn):
        time.sleep(30)
        return {"done": True}

    env = caller(slow, timeout_s=0.3)
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="dsrl.environment"):
        step = run_step(env)
    assert time.monotonic() - t0 < 5 and step.reward is None and step.done
    text = caplog.text
    assert "did not return within 0.3 s (dsrl.data.environment_timeout_s)" in text and "prompt 7" in text
    assert "Fix:" in text
    slow_factory = caller(factory=lambda p, a: time.sleep(30), timeout_s=0.3)
    assert slow_factory.start("p", "a", WHERE)[1] is True


def test_a_non_finite_reward_masks_the_trajectory():
    from dsrl.rl.episodes.trajectory import Trajectory
    from dsrl.rl.experience import masked_rewards

    step = run_step(caller(lambda t: {"reward": float("inf"), "done": True}))
    t = Trajectory(0, [1, 5])
    t.add_model_turn([7, 2], [-1.0, -1.0])
    t.rewards.append(step.reward)
    assert math.isnan(t.reward)
    sample = t.sample(group=0, reward=t.reward)
    assert math.isnan(float(masked_rewards([sample])[0]))


def test_load_environment_names_the_field():
    assert load_environment(DataConfig()) is None
    env = load_environment(DataConfig(task="calculator", environment="dsrl.tasks.calculator:Calculator"))
    assert env.what == "dsrl.data.environment = 'dsrl.tasks.calculator:Calculator'" and env.timeout_s == 120.0
    with pytest.raises(ConfigError, match="dsrl.data.environment = 'no_such_module:Env': cannot import"):
        load_environment(DataConfig(task="calculator", environment="no_such_module:Env"))


def test_observations_are_tokenized_as_text_or_through_the_chat_template():
    plain = ObservationEncoder(TOK, chat_template=False)
    assert plain.encode("=12\n") == TOK("=12\n", add_special_tokens=False)["input_ids"] and plain.encode("") == []
    chat = ObservationEncoder(TOK, chat_template=True)
    assert chat.text("=12") == "tool: =12\nassistant:"  # the tiny template's tool message + generation prompt
    assert TOK.bos_token_id not in chat.encode("=12")


def _dsrl(**sections) -> DsrlConfig:
    base = {"batch": {"prompts_per_rollout": 4, "samples_per_prompt": 2, "mini_batch_size": 8,
                      "micro_batch_size_per_rank": 1}, "run": {"rollouts": 1}}
    for key, value in sections.items():
        base[key] = {**base.get(key, {}), **value}
    return DsrlConfig(**base)


def test_config_rules_and_the_plan():
    with pytest.raises(ConfigError, match="dsrl.rollout.max_turns bound multi-turn .*Fix: set dsrl.data.environment"):
        _dsrl(rollout={"max_turns": 4})
    env = {"task": "calculator", "environment": "dsrl.tasks.calculator:Calculator"}
    with pytest.raises(ConfigError, match="environment_timeout_s = 120.0 is not below .*collective_timeout_s = 60"):
        _dsrl(data=env, run={"collective_timeout_s": 60.0})
    with pytest.raises(ConfigError, match=r"data.max_prompt_tokens \+ rollout.max_trajectory_tokens = 96"):
        _dsrl(data={**env, "max_prompt_tokens": 32},
              batch={"micro_batch_size_per_rank": None, "max_tokens_per_micro_batch": 64},
              rollout={"max_trajectory_tokens": 64})
    d = _dsrl(data={**env, "max_prompt_tokens": 24}, rollout={"max_turns": 3, "max_trajectory_tokens": 32,
                                                              "max_new_tokens": 10})
    assert d.multi_turn and d.max_completion_tokens == 32 and d.loss_agg_norm_length == 32
    assert d.max_generation_tokens == 24 + 32 + 10
    plan = BatchPlan.from_config(d, 2)
    assert (plan.max_turns, plan.max_trajectory_tokens) == (3, 32)
    assert any(k == "multi-turn trajectories" and "3 model turns and 32 tokens" in v for k, v in plan.describe())
    assert BatchPlan.from_config(_dsrl(), 2).max_turns is None
    with pytest.raises(ConfigError, match="stop_strings holds an empty string"):
        RolloutConfig(stop_strings=[""])


def test_stop_strings_are_single_tokens():
    rollout = RolloutConfig(stop_strings=["]", ")"])
    assert stop_token_ids(TOK, None, rollout) == [TOK.eos_token_id, TOK.convert_tokens_to_ids("]"),
                                                  TOK.convert_tokens_to_ids(")")]
    with pytest.raises(ConfigError, match=r"stop_strings entry '\]\]' is 2 tokens .*Fix: use a string"):
        stop_token_ids(TOK, None, RolloutConfig(stop_strings=["]]"]))


class FakeStore:
    def __init__(self):
        self.data: dict[str, bytes] = {}

    def set(self, key, value):
        self.data[key] = value.encode() if isinstance(value, str) else value

    def get(self, key):
        return self.data[key]

    def check(self, keys):
        return all(k in self.data for k in keys)


def test_a_waiting_rank_names_the_busy_rank_its_sample_and_how_long(caplog):
    store = FakeStore()
    ranks = []
    for r in range(3):
        w = object.__new__(watchdog.Watch)
        w.timeout_s, w.report_s, w.rank, w.world, w.store, w.group, w.current = 600.0, 30.0, r, 3, store, None, "x"
        ranks.append(w)
    now = time.time()
    store.set("dsrl/phase/1", f"reward@{now - 42}")
    ranks[1].note("calling dsrl.data.reward_fn = 'r.py:f' for sample 3 (completion 'abc')")
    store.set("dsrl/doing/1", f"{now - 41}@" + store.get("dsrl/doing/1").decode().split("@", 1)[1])
    store.set("dsrl/phase/0", f"reward end@{now - 35}")
    store.set("dsrl/phase/2", f"reward end@{now - 30}")
    with caplog.at_level(logging.WARNING, logger="dsrl.watchdog"):
        ranks[2]._report_waiting("reward", now - 30)  # not the lowest waiting rank: silent
        assert caplog.text == ""
        ranks[0]._report_waiting("reward", now - 35)
    text = caplog.text
    assert "rank 0 has waited 35 s at the end of the reward phase for rank 1 in reward for 42 s, calling " \
           "dsrl.data.reward_fn = 'r.py:f' for sample 3 (completion 'abc') for 41 s" in text, text
    assert "within 600 s" in text
    # A note left from an earlier phase is not shown as what the rank does now.
    store.set("dsrl/phase/1", f"reward@{now - 5}")
    assert ranks[0]._describe(1, now) == "rank 1 in reward for 5 s"
    watchdog._ACTIVE[:] = [ranks[1]]
    try:
        watchdog.note("calling x")
        assert store.get("dsrl/doing/1").decode().endswith("@calling x")
    finally:
        watchdog._ACTIVE.clear()
    watchdog.note("nothing happens without a multi-rank watch")


def test_rollout_record_has_the_trajectory_columns():
    from dsrl.rl.episodes.trajectory import DONE, MAX_TURNS, Trajectory
    from dsrl.rl.rollout_stats import RolloutStats
    from dsrl.runtime.metrics import rollout_record

    samples = []
    for turns, ended in ((2, DONE), (3, MAX_TURNS)):
        t = Trajectory(0, [1, 4])
        for k in range(turns):
            t.add_model_turn([7, 8], [-1.0, -1.0])
            if k < turns - 1:
                t.add_observation([60, 9, 5])
        t.ended_by, t.environment_s = ended, 0.5
        samples.append(t.sample(group=0, reward=1.0))
    stats = RolloutStats()
    stats.add_samples(samples)
    rec = rollout_record(stats, [], world=2, rollout=1, optimizer_step=1, rollout_size=2, prompt_epochs=0.1,
                         sampling_rounds=1, local_train_s=1.0)
    assert rec["turns_per_trajectory"] == 2.5 and rec["tool_calls_per_trajectory"] == 1.5
    assert rec["observation_tokens_per_trajectory"] == 4.5 and rec["response_len"] == 5.0
    assert rec["environment_s"] == 0.5 and rec["turn_limit_frac"] == 0.5 and rec["truncated_frac"] == 0.5
    single = RolloutStats()
    single.add_samples([types.SimpleNamespace(reward=1.0, accuracy=None, model_tokens=3, active=True, finished=True,
                                              turn_mask=None)])
    assert "turns_per_trajectory" not in rollout_record(single, [], world=1, rollout=1, optimizer_step=1,
                                                        rollout_size=1, prompt_epochs=0.1, sampling_rounds=1,
                                                        local_train_s=1.0)
