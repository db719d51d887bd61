"""Scoring: the one reward formula of a rollout's samples, single completions and multi-turn trajectories alike.

A sample's reward is

    rule_reward_weight * rule reward  +  reward_model_weight * reward-model score

each term when present (``dsrl.data``):

- the rule reward of a single completion is ``data.reward_fn`` of its text (a built-in task's reward without one);
  of a multi-turn trajectory, the sum of its environment's rewards, plus ``data.reward_fn`` of its last model
  turn's text when one is set (:mod:`dsrl.rl.episodes.driver`);
- the reward-model score is a learned model's score of the whole token sequence (``data.reward_model``,
  :class:`dsrl.rl.rewards.model.RewardModel`), computed on every rank (its forwards are collective under ZeRO-3);
- the accuracy (a metric, never a reward) is the built-in task's exact match of the same text.

Every function is called with one entry per sample: the prompt, the completion's (or last turn's) text, the
prompt's answer and the row's other columns where the function names them (:mod:`dsrl.rl.rewards.contract` bounds
and checks the calls). :class:`Scorer` is the one place
that applies this; the experience maker calls it for both kinds of rounds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from dsrl.config import DataConfig
from dsrl.rl.data.batching import Sample
from dsrl.rl.rewards.contract import RewardCaller, reward_columns
from dsrl.rollout.base import Completion

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from dsrl.rl.rewards.model import RewardModel


class ScoredTrajectory(Protocol):
    """What scoring reads of a multi-turn trajectory (:class:`dsrl.rl.episodes.trajectory.Trajectory`)."""

    prompt_index: int  # its prompt's position in the round
    last_text: str  # its last model turn's text

    @property
    def reward(self) -> float:
        """Its environment's rewards summed (NaN when a call timed out)."""

    def sample(self, group: int, reward: float, accuracy: float | None = None, version: int = 0) -> Sample:
        """The trajectory as one training sample."""


@dataclass
class Scorer:
    """Scores a sampling round's completions or trajectories (module docstring). ``reward_fn`` and ``accuracy_fn``
    are the run's rule reward and accuracy (:mod:`dsrl.rl.rewards.functions`, None when absent); ``model`` the
    learned reward model (or None). :meth:`take_counts` hands the rollout statistics what the calls counted."""

    data: DataConfig
    tokenizer: PreTrainedTokenizerBase
    reward_fn: RewardCaller | None = None
    accuracy_fn: RewardCaller | None = None
    model: RewardModel | None = None

    def model_scores(self, sequences: Sequence[Sequence[int]]) -> list[float] | None:
        """The reward model's scores of ``sequences`` (token ids, prompt included), None without one. Call it on
        every rank, whatever number of sequences it holds: a sharded reward model's forwards are collective."""
        if self.model is None:
            return None
        return self.model.score([list(s) for s in sequences])

    def take_counts(self) -> tuple[int, int]:
        """(reward calls that ran out of time, reward-model filler forwards) since the last call, and reset."""
        timeouts = self.reward_fn.take_timeouts() if self.reward_fn is not None else 0
        fillers = self.model.take_filler_forwards() if self.model is not None else 0
        return timeouts, fillers

    def completions(self, indices: list[int], records: list[dict[str, Any]], completions: list[Completion], *,
                    version: int, model_scores: list[float] | None = None) -> list[list[Sample]]:
        """One group of samples per prompt of a single-turn round (``indices[i]`` is prompt i's dataset index,
        ``records[i]`` its record); each sample carries the completion's version, else ``version``."""
        if not completions:
            return []
        texts = self.tokenizer.batch_decode([c.completion_ids for c in completions], skip_special_tokens=True)
        rewards, accs = self._score([records[c.prompt_index] for c in completions], texts, None, model_scores)
        groups: list[list[Sample]] = [[] for _ in indices]
        for c, reward, acc in zip(completions, rewards, accs):
            groups[c.prompt_index].append(Sample(
                tokens=list(c.prompt_ids) + list(c.completion_ids), prompt_len=len(c.prompt_ids),
                group=indices[c.prompt_index], reward=reward, finished=bool(c.finished), accuracy=acc,
                behavior_logprobs=c.behavior_logprobs, version=version if c.version is None else c.version,
                routes=c.routes))
        return groups

    def trajectories(self, indices: list[int], records: list[dict[str, Any]], trajs: Sequence[ScoredTrajectory], *,
                     version: int, model_scores: list[float] | None = None) -> list[list[Sample]]:
        """One group of samples per prompt of a multi-turn round; each sample carries the policy ``version`` that
        generated it."""
        if not trajs:
            return []
        rewards, accs = self._score([records[t.prompt_index] for t in trajs], [t.last_text for t in trajs],
                                    [t.reward for t in trajs], model_scores)
        groups: list[list[Sample]] = [[] for _ in indices]
        for t, reward, acc in zip(trajs, rewards, accs):
            groups[t.prompt_index].append(t.sample(indices[t.prompt_index], reward, acc, version))
        return groups

    def _score(self, records: list[dict[str, Any]], texts: list[str], environment: list[float] | None,
               model_scores: list[float] | None) -> tuple[list[float], list[Any]]:
        """(reward, accuracy) per sample by the module docstring's formula; ``environment``: each trajectory's
        summed environment rewards (None for single completions)."""
        prompts = [r["prompt"] for r in records]
        answers = [r.get("answer") for r in records]
        columns = reward_columns(records)  # the rows' other columns, passed where a function names them
        rule: list[float] | None = environment
        if self.reward_fn is not None:
            called = self.reward_fn(prompts, texts, answers, columns)
            rule = ([float(y) for y in called] if environment is None
                    else [x + float(y) for x, y in zip(environment, called)])
        d = self.data
        rewards = [d.rule_reward_weight * x for x in rule] if rule is not None else [0.0] * len(texts)
        if model_scores is not None:
            rewards = [x + d.reward_model_weight * m for x, m in zip(rewards, model_scores)]
        accs = self.accuracy_fn(prompts, texts, answers, columns) if self.accuracy_fn else [None] * len(texts)
        return rewards, list(accs)
