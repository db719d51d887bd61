"""One scored generation, the step experience (:mod:`dsrl.rl.experience`) and evaluation (:mod:`dsrl.rl.evaluation`)
share: a call's prompts -> completions (or multi-turn trajectories, turn by turn) -> the reward formula's scores ->
samples, grouped per prompt.

Invariants: every rank of a replica calls it (possibly with no prompts: the generate call is collective under
ZeRO-3); the learned reward model scores every rank's sequences (its forwards are collective); tensor peers adopt
their source's scored samples (:func:`dsrl.rl.data.replica.share_with_tensor_peers`, rule 2), so a reward function
runs once per replica. ``generating`` and ``scoring`` are the phases the caller times and bounds them in (the
watchdog's and the phase clock's); multi-turn episodes time their own turns.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from dsrl.core.parallel import ParallelView
from dsrl.rl.data.batching import Sample
from dsrl.rl.data.replica import share_with_tensor_peers
from dsrl.rl.episodes.driver import EpisodeRunner
from dsrl.rl.rewards.scoring import Scorer
from dsrl.rollout.base import RolloutBackend

Phase = Callable[[], contextlib.AbstractContextManager[Any]]


def scored_groups(view: ParallelView, scorer: Scorer, backend: RolloutBackend, episodes: EpisodeRunner | None,
                  indices: list[int], records: list[dict[str, Any]], prompt_ids: list[list[int]],
                  samples_per_prompt: int, seed: int, version: int, generating: Phase = contextlib.nullcontext,
                  scoring: Phase = contextlib.nullcontext) -> list[list[Sample]]:
    """The scored samples of one call's prompts (``indices``: their dataset indices, ``records`` their rows,
    ``prompt_ids`` their tokens), ``samples_per_prompt`` each, sampled with ``seed``, stamped with the policy
    ``version`` that generated them (module docstring)."""
    if episodes is not None:  # multi-turn trajectories, turn by turn (dsrl.rl.episodes.driver)
        trajs = episodes.run(records, prompt_ids, samples_per_prompt, seed, labels=indices)
        with scoring():
            scores = scorer.model_scores([t.tokens for t in trajs])
            return share_with_tensor_peers(view, lambda: scorer.trajectories(
                indices, records, trajs, version=version, model_scores=scores))
    with generating():
        completions = backend.generate(prompt_ids, samples_per_prompt, seed=seed)
    with scoring():
        scores = scorer.model_scores([list(c.prompt_ids) + list(c.completion_ids) for c in completions])
        return share_with_tensor_peers(view, lambda: scorer.completions(
            indices, records, completions, version=version, model_scores=scores))
