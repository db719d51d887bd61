"""Rollouts that train on nothing (dsrl.rl.empty_rollouts): the decision, its counts and its state; the real 2-rank
job is tests/distributed/test_trainer.py::test_rollouts_that_train_on_nothing_are_warned_about_then_stop_the_run."""

from __future__ import annotations

import logging

import pytest

from dsrl.core.errors import RunError
from dsrl.rl.empty_rollouts import EmptyRollouts, RolloutOutcome
from dsrl.rl.rollout_stats import RolloutStats


def _stats(samples=16, masked=16, finite=0, timeouts=0, truncated=0) -> RolloutStats:
    return RolloutStats(samples=samples, masked_samples=masked, finite_rewards=finite, reward_timeouts=timeouts,
                        truncated_samples=truncated)


def _step(tokens: int, applied: bool = True) -> dict:
    return {"tokens": tokens, "step_applied": applied}


EMPTY = RolloutOutcome.of(_stats(), [_step(0), _step(0)])
TRAINED = RolloutOutcome.of(_stats(masked=0, finite=16), [_step(40), _step(37)])


def test_what_counts_as_training_on_nothing():
    assert not EMPTY.trained and TRAINED.trained
    assert not RolloutOutcome.of(_stats(masked=0, finite=16), [_step(40, applied=False)]).trained  # all skipped
    # The critic's warm-up: no policy step, but the critic's steps train on tokens.
    assert RolloutOutcome.of(_stats(masked=0, finite=16), [] + [_step(40)]).trained
    assert "all 16 samples were masked (16 with a non-finite reward, 4 of them reward calls past " \
           "data.reward_timeout_s), so 0 tokens reached the loss" in RolloutOutcome.of(_stats(timeouts=4),
                                                                                      [_step(0)]).why()
    overlong = RolloutOutcome.of(_stats(finite=16, truncated=16), [_step(0)])
    assert "16 cut at the length limit" in overlong.why() and "overlong_filter" in overlong.fix()
    skipped = RolloutOutcome.of(_stats(masked=0, finite=16), [_step(40, applied=False)])
    assert "skipped for a non-finite loss" in skipped.why()


def test_warned_then_stopped_at_the_bound_and_reset_by_a_rollout_that_trains(caplog):
    guard = EmptyRollouts(limit=3)
    with caplog.at_level(logging.WARNING, logger="dsrl.rl.empty_rollouts"):
        guard.observe(1, EMPTY, last=False)
        guard.observe(2, EMPTY, last=False)
        guard.observe(3, TRAINED, last=False)  # resets the count
        guard.observe(4, EMPTY, last=False)
        guard.observe(5, EMPTY, last=False)
    assert [r.getMessage().split(":")[0] for r in caplog.records] == [f"rollout {i} trained on nothing"
                                                                      for i in (1, 2, 4, 5)]
    with pytest.raises(RunError, match=r"rollouts 4 to 6 trained on nothing \(3 in a row, "
                                       r"dsrl.run.max_empty_rollouts = 3\)") as e:
        guard.observe(6, EMPTY, last=False)
    assert e.value.agreed  # every rank raises it alike: printed once


def test_a_run_whose_rollouts_all_trained_on_nothing_never_ends_quietly():
    guard = EmptyRollouts(limit=3)
    guard.observe(1, EMPTY, last=False)
    with pytest.raises(RunError, match="rollouts 1 to 2, every rollout of this run, trained on nothing"):
        guard.observe(2, EMPTY, last=True)  # fewer rollouts than the bound
    guard = EmptyRollouts(limit=3)
    guard.observe(1, TRAINED, last=False)
    guard.observe(2, EMPTY, last=True)  # the run trained before: warned, not stopped


def test_the_count_in_a_row_survives_a_resume():
    guard = EmptyRollouts(limit=3)
    guard.observe(1, EMPTY, last=False)
    guard.observe(2, EMPTY, last=False)
    resumed = EmptyRollouts(limit=3)
    resumed.load_state_dict(guard.state_dict())
    with pytest.raises(RunError, match="rollouts 1 to 3"):
        resumed.observe(3, EMPTY, last=False)
    fresh = EmptyRollouts(limit=3)
    fresh.load_state_dict(None)  # a checkpoint written before the count existed
    assert fresh.in_a_row == 0 and fresh.first is None
