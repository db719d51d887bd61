"""Multi-turn rollouts: trajectories generated turn by turn against an environment (``data.environment``).

:class:`EpisodeRunner` runs one sampling round of a rank's prompts:

1. turn 0: ``backend.generate(prompts, G, seed)`` (the call a single-turn round makes), one trajectory per
   completion; every later turn t: one ``backend.generate`` of the active trajectories' full token prefixes
   (prompt + model turns + observations so far), one sample each, seeded ``derived_seed(seed, t)``, so a resumed
   run regenerates the same trajectories. Finished trajectories leave the batch;
2. after each turn, each active trajectory's episode (:mod:`dsrl.rl.episodes.environment`; created by the factory before
   the first step) takes the model turn and returns an observation, a reward and whether it is done; the
   observation's tokens are appended with loss mask 0 (:mod:`dsrl.rl.episodes.trajectory`);
3. bounds: a model turn is cut where it would pass ``rollout.max_trajectory_tokens`` (the trajectory then ends,
   truncated, without a step); an episode not done after ``rollout.max_turns`` model turns ends truncated; an
   observation that would leave no room for a model token ends the trajectory truncated (logged once per round
   and counted). A truncated trajectory is handled like a completion cut at ``max_new_tokens``
   (``finished`` False: the overlong filter and shaping apply to it);
4. collective safety: every rank runs the same number of turns (one MAX all-reduce of the active count after
   each turn), so every data-parallel rank calls ``generate`` equally often (a ZeRO-3 parameter gather each), a
   rank with nothing left calling it with no prompts. Generation runs in the watch's ``generation`` phase and
   the environment in its ``environment`` phase, each ending in a monitored barrier that names a stuck rank.
   Tensor-parallel peers: only the tensor source runs the environment; the peers adopt its turn results, so
   they hold identical trajectories (:mod:`dsrl.rl.data.replica` rule 2).

Scoring is the one reward formula of :class:`dsrl.rl.rewards.scoring.Scorer`: the rule reward of a trajectory is
the sum of its environment rewards, plus ``data.reward_fn`` of its last model turn's text when one is set; the
accuracy of a built-in task is measured on that text too. The rest of the pipeline takes the samples as they are:
group advantages per prompt, the data path, token budgets (a trajectory is one sequence), the critic and KL on
model tokens only.

The run builds one runner with explicit collaborators; the experience maker
(:class:`dsrl.rl.experience.ExperienceMaker`) calls :meth:`EpisodeRunner.run` in place of a single-turn round's
``generate``; nothing here reaches back into it.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from dsrl.config import ConfigError
from dsrl.core.collectives import all_reduce_floats
from dsrl.core.parallel import ParallelView
from dsrl.core.seeds import derived_seed
from dsrl.rl.data.replica import share_with_tensor_peers
from dsrl.rl.episodes.environment import EnvironmentCaller, ObservationEncoder, Turn
from dsrl.rl.episodes.trajectory import DONE, MAX_TOKENS, MAX_TURNS, OBSERVATION_OVERFLOW, TIMEOUT, Trajectory
from dsrl.rl.rewards.contract import _short
from dsrl.rollout.base import Completion, RolloutBackend
from dsrl.runtime.context import RunContext
from dsrl.runtime.phases import PhaseClock

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger("dsrl.episodes")


@dataclass
class _TurnResult:
    """What one turn did to one trajectory: plain data, so tensor peers can adopt the source's."""

    tokens: list[int]
    logprobs: list[float] | None
    text: str
    reward: float | None  # None: no step ran (the turn was cut); NaN: the environment timed out
    observation: list[int] | None  # appended when the trajectory goes on
    ended_by: str | None
    environment_s: float
    routes: Any = None  # the turn's generate call's routes (an MoE policy), dsrl.rl.episodes.trajectory

    def apply(self, t: Trajectory) -> None:
        t.add_model_turn(self.tokens, self.logprobs, self.routes)
        t.last_text = self.text
        if self.reward is not None:
            t.rewards.append(self.reward)
        if self.observation is not None:
            t.add_observation(self.observation)
        t.ended_by = self.ended_by
        t.environment_s += self.environment_s


class EpisodeRunner:
    """Generates one round of trajectories (module docstring). ``view``/``device``: the policy's parallel view and
    collective device; ``context``: the run's :class:`dsrl.runtime.context.RunContext` (its watch bounds the
    environment's phases, its clock times the model's turns as the ``generate`` phase)."""

    def __init__(self, backend: RolloutBackend, tokenizer: PreTrainedTokenizerBase, env: EnvironmentCaller,
                 encoder: ObservationEncoder, max_turns: int, max_tokens: int, view: ParallelView | None = None,
                 device: torch.device | str = "cpu", context: RunContext | None = None):
        self.backend, self.tokenizer, self.env, self.encoder = backend, tokenizer, env, encoder
        self.max_turns, self.max_tokens = max_turns, max_tokens
        self.view, self.device = view, device
        self.context = context or RunContext()
        self.watch, self.phases = self.context.watch, self.context.phases
        self._episodes: dict[int, Any] = {}
        self._overflow_told = False

    def with_backend(self, backend: RolloutBackend) -> EpisodeRunner:
        """The same runner (environment, encoder, bounds, layout, watch) generating with ``backend`` (an evaluation's),
        timing its turns on a phase clock of its own (the rollouts' phase times stay the rollouts')."""
        return EpisodeRunner(backend, self.tokenizer, self.env, self.encoder, self.max_turns, self.max_tokens,
                             self.view, self.device, dataclasses.replace(self.context, phases=PhaseClock()))

    def run(self, records: list[dict], prompt_ids: list[list[int]], samples_per_prompt: int, seed: int,
            labels: list[int] | None = None) -> list[Trajectory]:
        """``len(prompt_ids) * samples_per_prompt`` trajectories grouped per prompt, like ``generate``'s
        completions. ``records[i]`` holds prompt i's ``prompt`` and ``answer`` (the factory's arguments);
        ``labels[i]`` names it in messages (its index in the prompt dataset)."""
        labels = labels if labels is not None else list(range(len(prompt_ids)))
        G = samples_per_prompt
        trajs = [Trajectory(i, list(p)) for i, p in enumerate(prompt_ids) for _ in range(G)]
        self._episodes, self._overflow_told = {}, False
        turn = 0
        while True:
            active = [k for k, t in enumerate(trajs) if t.active]
            with self.watch.phase("generation"), self.phases.phase("generate"):
                if turn == 0:  # called even with no prompts: under ZeRO-3 every rank enters the parameter gather
                    completions = self.backend.generate(prompt_ids, G, seed=seed)
                else:
                    completions = self.backend.generate([trajs[k].tokens for k in active], 1,
                                                        seed=derived_seed(seed, turn))
            if len(completions) != len(active):
                raise RuntimeError(f"the rollout backend returned {len(completions)} completions for {len(active)} "
                                   "trajectories; it broke its contract (dsrl.rollout.base)")
            with self.watch.phase("environment"):
                def advance(active=active, completions=completions, turn=turn) -> list[_TurnResult]:
                    return [self._advance(records, labels, G, k, trajs[k], c, turn)
                            for k, c in zip(active, completions)]

                results = self._share(advance)
                for k, r in zip(active, results):
                    r.apply(trajs[k])
            # After the phase's end (whose barrier names a rank stuck in its environment): every rank runs the
            # same turns.
            more = left = sum(t.active for t in trajs)
            if dist.is_initialized() and dist.get_world_size() > 1:
                more = all_reduce_floats([float(left)], dist.ReduceOp.MAX, self.device)[0]
            turn += 1
            if more == 0:
                return trajs

    def _share(self, make: Callable[[], list[_TurnResult]]) -> list[_TurnResult]:
        return make() if self.view is None else share_with_tensor_peers(self.view, make)

    def _where(self, records: list[dict], labels: list[int], G: int, k: int, t: Trajectory) -> str:
        prompt = records[t.prompt_index]["prompt"]
        return f"prompt {labels[t.prompt_index]} ({_short(prompt, 48)}), sample {k % G + 1} of {G}"

    def _advance(self, records: list[dict], labels: list[int], G: int, k: int, t: Trajectory, completion: Completion,
                 turn: int) -> _TurnResult:
        """One model turn of trajectory ``k`` and its environment step (tensor source only)."""
        self.env.take_seconds()
        tokens = list(completion.completion_ids)
        room = self.max_tokens - len(t.completion_ids)
        cut = len(tokens) > room
        tokens = tokens[:max(room, 0)]
        logprobs = completion.behavior_logprobs
        logprobs = None if logprobs is None else list(logprobs[:len(tokens)])
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        result = _TurnResult(tokens, logprobs, text, None, None, MAX_TOKENS if cut else None, 0.0,
                             completion.routes)
        if not cut:
            self._step(records, labels, G, k, t, completion, turn, result)
        if result.ended_by is not None:
            self._close(k, records, labels, G, t)
        result.environment_s = self.env.take_seconds()
        return result

    def _step(self, records: list[dict], labels: list[int], G: int, k: int, t: Trajectory, completion: Completion,
              turn: int, result: _TurnResult) -> None:
        """The environment's answer to a whole model turn, into ``result``."""
        where = self._where(records, labels, G, k, t)
        episode = self._episodes.get(k)
        if episode is None:
            record = records[t.prompt_index]
            episode, late = self.env.start(record["prompt"], record.get("answer"), where)
            if late:
                result.reward, result.ended_by = float("nan"), TIMEOUT
                return
            self._episodes[k] = episode
        step = self.env.step(episode, Turn(result.text, result.tokens, turn, bool(completion.finished)), where)
        if step.reward is None:
            result.reward, result.ended_by = float("nan"), TIMEOUT
            return
        result.reward = step.reward
        used = len(t.completion_ids) + len(result.tokens)
        if step.done:
            result.ended_by = DONE
        elif turn + 1 >= self.max_turns:
            result.ended_by = MAX_TURNS
        elif used >= self.max_tokens:
            result.ended_by = MAX_TOKENS
        else:
            obs = self.encoder.encode(step.observation)
            if used + len(obs) >= self.max_tokens:
                result.ended_by = OBSERVATION_OVERFLOW
                self._tell_overflow(where, len(obs), self.max_tokens - used)
            else:
                result.observation = obs

    def _close(self, k: int, records: list[dict], labels: list[int], G: int, t: Trajectory) -> None:
        episode = self._episodes.pop(k, None)
        if episode is not None:
            self.env.close(episode, self._where(records, labels, G, k, t))

    def _tell_overflow(self, where: str, n: int, room: int) -> None:
        if self._overflow_told:
            return
        self._overflow_told = True
        log.warning("%s: the observation for %s is %d tokens, but only %d of rollout.max_trajectory_tokens = %d are "
                    "left (at least one must stay for the model's next turn), so the trajectory ends there, truncated "
                    "(counted in observation_overflows; said once per sampling round). Fix: raise "
                    "dsrl.rollout.max_trajectory_tokens, or make the environment's observations shorter.",
                    self.env.what, where, n, room, self.max_tokens)


# -------------------------------------------------------------------------------------------- demonstrations


def demonstration(env: EnvironmentCaller, tokenizer: PreTrainedTokenizerBase, encoder: ObservationEncoder,
                  stop_ids: list[int], record: dict, prompt_ids: list[int], max_tokens: int,
                  label: int = 0) -> Trajectory:
    """The reference trajectory of one prompt for the supervised warm-up: the factory's
    ``demonstration(prompt, answer)`` gives the model turns as text; each is tokenized (eos appended unless it
    ends with a stop token), stepped through a fresh episode like a rollout's turn, and the observations are
    appended with loss mask 0. Cut at ``max_tokens`` completion tokens."""
    where = f"prompt {label} ({_short(record['prompt'], 48)}), demonstration"
    demo = env.demonstration
    if demo is None:
        raise ConfigError(
            f"dsrl.sft.steps > 0 with {env.what}: the supervised warm-up shows the model whole trajectories, which "
            "the factory must describe. Fix: give the factory a demonstration(prompt, answer) method returning the "
            "model turns of a reference trajectory as a list of strings, or set dsrl.sft.steps to 0.")
    turns = env._call(demo, (record["prompt"], record.get("answer")), "demonstration()", where)[0]
    if not isinstance(turns, (list, tuple)) or not turns or not all(isinstance(x, str) for x in turns):
        raise ConfigError(f"{env.what}: demonstration() returned {_short(turns)} for {where}; it returns the model "
                          "turns of a reference trajectory as a non-empty list of strings. Fix: return that.")
    t = Trajectory(0, list(prompt_ids))
    episode, late = env.start(record["prompt"], record.get("answer"), where)
    if late:
        raise ConfigError(f"{env.what}: the factory ran past dsrl.data.environment_timeout_s for {where}, so the "
                          "supervised warm-up cannot show it. Fix: make the factory return sooner, or raise "
                          "environment_timeout_s.")
    eos = stop_ids[0]
    for i, text in enumerate(turns):
        ids = [int(x) for x in tokenizer(text, add_special_tokens=False)["input_ids"]]
        if not ids or ids[-1] not in stop_ids:
            ids.append(eos)
        t.add_model_turn(ids, [0.0] * len(ids))
        step = env.step(episode, Turn(tokenizer.decode(ids, skip_special_tokens=True), ids, i, True), where)
        if step.reward is None:  # every rank must build the same warm-up batches: a lost step cannot be skipped
            raise ConfigError(f"{env.what}: a step of the demonstration for {where} ran past "
                              "dsrl.data.environment_timeout_s, so the supervised warm-up cannot show it. Fix: make "
                              "the environment return sooner, or raise environment_timeout_s.")
        last = i == len(turns) - 1
        if step.done != last:
            raise ConfigError(
                f"{env.what}: the demonstration for {where} has {len(turns)} model turns, but the environment "
                f"{'said done after' if step.done else 'was not done after'} turn {i}. Fix: make demonstration() "
                "return exactly the turns of one episode, the last one ending it.")
        if not last:
            t.add_observation(encoder.encode(step.observation))
    env.close(episode, where)
    if len(t.completion_ids) > max_tokens:
        t.completion_ids, t.mask = t.completion_ids[:max_tokens], t.mask[:max_tokens]
    t.ended_by = DONE
    return t
