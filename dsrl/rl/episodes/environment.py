"""The contract of an environment (``data.environment``), enforced on every call, beside the reward function's
(:mod:`dsrl.rl.rewards.contract`).

A user names a factory, ``"pkg.module:Factory"`` or ``"path/to/file.py:Factory"``. For every sample of a rollout
(each of the G samples of a prompt) dsrl calls ``Factory(prompt, answer)`` once and gets an *episode*; after every
model turn it calls ``episode.step(turn)`` with a :class:`Turn` (the turn's text and exactly the tokens the model
generated) and gets the next step as

- a dict with ``observation`` (str, default ""), ``reward`` (a number, default 0) and ``done`` (bool, default
  False), or
- a tuple ``(observation, reward, done)``.

Rewards of one trajectory are summed (per turn and/or final: give 0 where there is none). ``done`` ends the
trajectory (its observation is then not used); otherwise the observation is tokenized by the run's tokenizer
(:class:`ObservationEncoder`) and appended with loss mask 0, and the model takes the next turn
(:mod:`dsrl.rl.episodes.driver`). An optional ``episode.close()`` is called once when the trajectory ends; an optional
``Factory.demonstration(prompt, answer) -> list[str]`` gives the model turns of a reference trajectory for the
supervised warm-up (``dsrl.sft``).

What is enforced, each as one sentence naming ``data.environment``, the sample and the fix:

- **exceptions** raised by the factory, ``step`` or ``close`` stop the run (:class:`dsrl.config.ConfigError`,
  the exception's text included): an environment that fails is a bug to fix, not a sample to mask;
- **types**: an episode without ``step``, a step result that is not such a dict or tuple, an observation that is
  not a string, a reward that is not a number or a ``done`` that is not a bool stop the run the same way. A
  non-finite reward is allowed and masks the trajectory (nothing non-finite reaches the loss);
- **time**: with ``data.environment_timeout_s`` each call (the factory, or one step) gets that long (``SIGALRM``,
  as the reward function's); a call past it ends its trajectory with reward NaN (masked), counted in the
  rollout's ``environment_timeouts`` and logged with the sample. Before each call the rank notes what it calls
  and for which sample, so a rank waiting for it says so (:mod:`dsrl.runtime.watchdog`).

The observations' token bound (``rollout.max_trajectory_tokens``) is kept by :mod:`dsrl.rl.episodes.driver`.
"""

from __future__ import annotations

import logging
import numbers
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from dsrl.config import ConfigError, DataConfig
from dsrl.rl.rewards.contract import _CallTimeout, _short, as_reward, time_limit
from dsrl.runtime.watchdog import note

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger("dsrl.environment")
FIELD = "dsrl.data.environment"
CONTRACT = ("a dict with observation (str), reward (a number) and done (bool), or a tuple (observation, reward, "
            "done)")


@dataclass(frozen=True)
class Turn:
    """One model turn as an episode's ``step`` receives it."""

    text: str  # the turn's tokens decoded by the run's tokenizer, special tokens (eos) left out
    token_ids: list[int]  # exactly the tokens the model generated in this turn (its eos or stop token included)
    index: int  # 0 for the first model turn of the trajectory
    finished: bool  # the turn ended at eos or a rollout.stop_strings token (False: cut at rollout.max_new_tokens)


@dataclass(frozen=True)
class EnvStep:
    """A step result after the contract's checks (reward None: the call ran out of time)."""

    observation: str
    reward: float | None
    done: bool


class EnvironmentCaller:
    """The user's factory behind the contract (module docstring). ``spec`` names it in messages."""

    def __init__(self, factory: Callable[..., Any], spec: str, timeout_s: float | None = None):
        self.factory, self.spec, self.timeout_s = factory, spec, timeout_s
        self.what = f"{FIELD} = {spec!r}"
        self.seconds = 0.0  # spent inside the environment's calls, since the last take_seconds()

    def take_seconds(self) -> float:
        s, self.seconds = self.seconds, 0.0
        return s

    @property
    def demonstration(self) -> Callable[..., Any] | None:
        """The factory's optional ``demonstration(prompt, answer) -> list[str]``."""
        fn = getattr(self.factory, "demonstration", None)
        return fn if callable(fn) else None

    def _call(self, fn: Callable[..., Any], args: tuple, call: str, where: str) -> tuple[Any, bool]:
        """``(result, timed_out)`` of one guarded call; an exception is a ConfigError naming the sample."""
        note(f"calling {self.what} {call} for {where}")
        t0 = time.perf_counter()
        try:
            with time_limit(self.timeout_s) as fired:
                result = fn(*args)
            if not fired:
                return result, False
        except _CallTimeout:
            pass
        except ConfigError:
            raise
        except Exception as e:
            raise ConfigError(
                f"{self.what}: {call} raised {type(e).__name__}: {str(e)[:300]} for {where} (rank "
                f"{os.environ.get('RANK', '0')}). Fix: make the environment handle this input (an error a tool "
                "reports belongs in the observation), then resume with --resume auto.") from e
        finally:
            self.seconds += time.perf_counter() - t0
        log.warning("%s: %s for %s on rank %s did not return within %g s (dsrl.data.environment_timeout_s), so it "
                    "was given up: the trajectory ends with reward NaN (masked) and is counted in "
                    "environment_timeouts. Fix: make the environment return sooner, or raise environment_timeout_s.",
                    self.what, call, where, os.environ.get("RANK", "0"), self.timeout_s)
        return None, True

    def start(self, prompt: str, answer: Any, where: str) -> tuple[Any, bool]:
        """``(episode, timed_out)`` for one sample."""
        episode, late = self._call(self.factory, (prompt, answer), "the factory", where)
        if not late and not callable(getattr(episode, "step", None)):
            raise ConfigError(
                f"{self.what} returned {_short(episode)} ({type(episode).__name__}) for {where}, which has no "
                "step(turn) method. Fix: make the factory return an episode object with step(turn) returning "
                f"{CONTRACT}.")
        return episode, late

    def step(self, episode: Any, turn: Turn, where: str) -> EnvStep:
        """The checked result of ``episode.step(turn)`` (reward None: timed out)."""
        call = f"step() of turn {turn.index}"
        where_turn = f"{where}, model turn {_short(turn.text)}"
        result, late = self._call(episode.step, (turn,), call, where_turn)
        if late:
            return EnvStep("", None, True)
        return self._checked(result, call, where_turn)

    def close(self, episode: Any, where: str) -> None:
        """``episode.close()`` when it has one (an exception stops the run like any other call's)."""
        fn = getattr(episode, "close", None)
        if callable(fn):
            self._call(fn, (), "close()", where)

    def _checked(self, result: Any, call: str, where: str) -> EnvStep:
        def bad(what: str) -> ConfigError:
            return ConfigError(
                f"{self.what}: {call} returned {what} for {where} (rank {os.environ.get('RANK', '0')}); a step "
                f"returns {CONTRACT}. Fix: return that (a non-finite reward masks the trajectory).")

        if isinstance(result, dict):
            unknown = set(result) - {"observation", "reward", "done"}
            if unknown:
                raise bad(f"a dict with the unknown key(s) {', '.join(sorted(map(str, unknown)))}")
            obs, reward, done = result.get("observation", ""), result.get("reward", 0.0), result.get("done", False)
        elif isinstance(result, (tuple, list)) and len(result) == 3:
            obs, reward, done = result
        else:
            raise bad(f"{_short(result)} ({type(result).__name__})")
        if obs is None:
            obs = ""
        if not isinstance(obs, str):
            raise bad(f"the observation {_short(obs)} ({type(obs).__name__}), not a string")
        value = 0.0 if reward is None else as_reward(reward)
        if value is None:
            raise bad(f"the reward {_short(reward)} ({type(reward).__name__}), not a number")
        if not (isinstance(done, (bool, np.bool_)) or (isinstance(done, numbers.Integral) and done in (0, 1))):
            raise bad(f"done = {_short(done)} ({type(done).__name__}), not a bool")
        return EnvStep(obs, value, bool(done))


def load_environment(data_cfg: DataConfig) -> EnvironmentCaller | None:
    """The run's environment behind its contract, or None without ``data.environment`` (imported when the run
    starts, so a wrong path fails before any work)."""
    if not data_cfg.environment:
        return None
    from dsrl.rl.rewards.functions import import_object

    factory = import_object(data_cfg.environment, FIELD)
    return EnvironmentCaller(factory, data_cfg.environment, data_cfg.environment_timeout_s)


class ObservationEncoder:
    """Observation text -> tokens, by the run's tokenizer: the text itself (no special tokens added), or with
    ``data.chat_template`` the chat template's rendering of a ``tool`` message followed by the next generation
    prompt (the difference between a conversation rendered with and without it, so the template's own separators
    and special tokens are kept). The model's tokens are never re-tokenized: only observations pass here."""

    ROLE = "tool"

    def __init__(self, tokenizer: PreTrainedTokenizerBase, chat_template: bool):
        self.tokenizer, self.chat_template = tokenizer, chat_template
        self._before: str | None = None

    def text(self, observation: str) -> str:
        """The text whose tokens follow the model's turn."""
        if not self.chat_template or not observation:
            return observation
        tok = self.tokenizer
        convo = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]
        try:
            if self._before is None:
                self._before = tok.apply_chat_template(convo, tokenize=False)
            after = tok.apply_chat_template(convo + [{"role": self.ROLE, "content": observation}], tokenize=False,
                                            add_generation_prompt=True)
        except Exception as e:
            raise ConfigError(
                f"dsrl.data.chat_template = true: the tokenizer's chat template cannot render an observation as a "
                f"{self.ROLE!r} message ({type(e).__name__}: {str(e)[:200]}). Fix: use a template with a tool role, "
                "or set dsrl.data.chat_template to false and format observations in the environment.") from e
        if not after.startswith(self._before):
            raise ConfigError(
                f"dsrl.data.chat_template = true: the tokenizer's chat template renders a conversation differently "
                f"once a {self.ROLE!r} message follows, so an observation cannot be appended to the tokens generated "
                "so far. Fix: set dsrl.data.chat_template to false and format observations in the environment.")
        return after[len(self._before):]

    def encode(self, observation: str) -> list[int]:
        text = self.text(observation)
        if not text:
            return []
        return [int(t) for t in self.tokenizer(text, add_special_tokens=False)["input_ids"]]
