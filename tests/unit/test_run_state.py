"""The run's parts that decide and remember, without a launcher (dsrl.rl.run).

- the stop policy: save / end / early / final after each rollout, from plain numbers (the plan's last rollout,
  ``run.stop_after_rollouts``, ``run.save_every``, ``run.save_final``, an agreed stop request);
- the run state: ``state_dict`` / ``load_state_dict`` round trip through a checkpoint's bytes continues the prompt
  stream, the counters and the count of empty rollouts exactly; a snapshot keeps the boundary while the live state
  moves on; the random streams come back with the snapshot.
"""

from __future__ import annotations

import io
import random

import pytest
import torch

from dsrl.config import RunConfig
from dsrl.rl.data.prompts import PromptSampler
from dsrl.rl.empty_rollouts import EmptyRollouts, RolloutOutcome
from dsrl.rl.run.state import RunState
from dsrl.rl.run.stopping import AfterRollout, StopPolicy

POLICY = StopPolicy(rollouts=10, stop_after=None, save_every=4, save_final=True)


@pytest.mark.parametrize(("policy", "rollout", "start", "requested", "want"), [
    (POLICY, 3, 0, False, AfterRollout(save=False, end=False, early=False, final=False)),
    (POLICY, 4, 0, False, AfterRollout(save=True, end=False, early=False, final=False)),  # run.save_every
    (POLICY, 10, 0, False, AfterRollout(save=True, end=True, early=False, final=True)),  # the plan's last
    (StopPolicy(10, None, 0, False), 10, 0, False, AfterRollout(save=False, end=True, early=False, final=True)),
    (POLICY, 5, 0, True, AfterRollout(save=True, end=True, early=True, final=False)),  # a stop request
    (POLICY, 10, 0, True, AfterRollout(save=True, end=True, early=False, final=True)),  # requested at the last one
    (StopPolicy(10, 3, 0, True), 5, 2, False, AfterRollout(save=True, end=True, early=True, final=True)),  # bound
    (StopPolicy(10, 3, 0, True), 4, 2, False, AfterRollout(save=False, end=False, early=False, final=False)),
    (StopPolicy(10, 20, 0, True), 10, 0, False, AfterRollout(save=True, end=True, early=False, final=True)),
    (StopPolicy(10, 2, 0, True), 10, 8, False, AfterRollout(save=True, end=True, early=False, final=True)),
])
def test_the_stop_policy(policy, rollout, start, requested, want):
    assert policy.after_rollout(rollout, start, requested) == want


def test_the_stop_policy_reads_the_run_section():
    run = RunConfig(rollouts=12, stop_after_rollouts=5, save_every=6, save_final=False)
    assert StopPolicy.of(run, 12) == StopPolicy(12, 5, 6, False)


def _state() -> RunState:
    return RunState(PromptSampler(13, 5, seed=11), EmptyRollouts(limit=3))


def _through_a_checkpoint(state: dict) -> dict:
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def test_the_run_state_round_trip_continues_exactly():
    live = _state()
    for _ in range(3):
        live.sampler.next_indices()
    empty = RolloutOutcome(samples=8, masked=8, nonfinite_rewards=8, reward_timeouts=0, environment_timeouts=0,
                           truncated=0, steps=1, applied_with_tokens=0, tokens=0)
    live.empty.observe(2, empty, last=False)
    live.rollout, live.calls, live.evaluation.last = 3, 7, 2
    saved = _through_a_checkpoint(live.state_dict())
    assert set(saved) == {"rollout", "calls", "sampler", "empty_rollouts", "version", "evaluated"}
    assert saved["version"] == 3 and saved["evaluated"] == 2
    resumed = _state()
    progress = resumed.evaluation  # the evaluator's, shared: restored in place
    resumed.load_state_dict(saved)
    assert resumed.state_dict() == live.state_dict() and progress.last == 2
    assert [resumed.sampler.next_indices() for _ in range(4)] == [live.sampler.next_indices() for _ in range(4)]
    assert resumed.empty.in_a_row == live.empty.in_a_row == 1


def test_a_checkpoint_from_before_evaluations_resumes_with_none_evaluated():
    saved = {k: v for k, v in _state().state_dict().items() if k != "evaluated"}
    resumed = _state()
    resumed.evaluation.last = 5
    resumed.load_state_dict(saved)
    assert resumed.evaluation.last == -1


def test_a_snapshot_keeps_the_boundary_and_the_random_streams():
    state = _state()
    random.seed(5)
    torch.manual_seed(5)
    boundary = state.snapshot()
    drawn = state.sampler.next_indices()  # the next rollout draws its prompts, then a stop comes
    want = (torch.rand(3), random.random())
    assert state.state_dict() != boundary.state
    resumed = _state()
    resumed.load_state_dict(_through_a_checkpoint(boundary.state))
    RunState.load_rng_state(_through_a_checkpoint(boundary.rng))
    assert resumed.sampler.next_indices() == drawn  # the interrupted rollout draws the same prompts again
    got = (torch.rand(3), random.random())
    assert torch.equal(got[0], want[0]) and got[1] == want[1]


def test_a_resumed_sampler_with_other_data_is_refused():
    state = _state()
    other = RunState(PromptSampler(14, 5, seed=11), EmptyRollouts(limit=3))
    from dsrl.config import ConfigError

    with pytest.raises(ConfigError, match="num_prompts"):
        other.load_state_dict(state.state_dict())
