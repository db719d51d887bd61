"""dsrl.core.partition: mini-batches, fixed and token-budget micro-batches, rank balancing (fast, no processes)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from dsrl.config import load_config
from dsrl.core.balance import balance_ranks
from dsrl.core.partition import (
    expected_token_budget_stats,
    fixed_micro_batches,
    mini_batches,
    partition_mini_batch,
    partition_stats,
    token_budget_micro_batches,
)
from dsrl.core.plan import BatchPlan


def rl_lengths(n: int, max_len: int, seed: int = 0, tail: float = 0.0) -> np.ndarray:
    """Log-normal completion lengths plus a prompt, capped at max_len; ``tail`` = share truncated at max_len."""
    rng = np.random.default_rng(seed)
    lens = 64 + np.exp(rng.normal(np.log(max_len / 8), 1.0, n))
    lens[rng.random(n) < tail] = max_len
    return np.clip(lens, 16, max_len).astype(np.int64)


def flat(partition):
    return [i for rank in partition for mb in rank for i in mb]


def check_budget(partition, lengths, max_tokens, packed=False):
    for rank in partition:
        for mb in rank:
            if not mb:
                continue
            ls = [int(lengths[i]) for i in mb]
            cost = sum(ls) if packed else len(ls) * max(ls)
            assert cost <= max_tokens or len(mb) == 1, (mb, ls, cost, max_tokens)


# -- mini-batches ------------------------------------------------------------------------------


def test_mini_batches_cover_each_epoch_and_reshuffle():
    mbs = mini_batches(64, 16, epochs=3, seed=7)
    assert len(mbs) == 3 * 64 // 16 and all(len(mb) == 16 for mb in mbs)
    epochs = [sum(mbs[e * 4:(e + 1) * 4], []) for e in range(3)]
    assert all(sorted(ep) == list(range(64)) for ep in epochs)
    assert epochs[0] != epochs[1] != epochs[2]
    assert mini_batches(64, 16, 3, seed=7) == mbs  # deterministic
    assert mini_batches(64, 16, 3, seed=8) != mbs
    assert sum(mini_batches(8, 4, 2, seed=0, shuffle=False), []) == list(range(8)) * 2


def test_mini_batches_rejects_non_dividing_size():
    with pytest.raises(ValueError, match="mini_batch_size"):
        mini_batches(10, 4, 1, 0)


# -- fixed mode -----------------------------------------------------------------------------


def test_fixed_micro_batches_shape_and_cover():
    part = fixed_micro_batches(list(range(100, 124)), dp=3, m=2)
    assert len(part) == 3 and all(len(r) == 4 and all(len(mb) == 2 for mb in r) for r in part)
    assert sorted(flat(part)) == list(range(100, 124))


@pytest.mark.parametrize("n,dp,m", [(10, 2, 3), (12, 5, 1), (8, 3, 2)])
def test_fixed_micro_batches_errors_name_the_field(n, dp, m):
    with pytest.raises(ValueError, match="micro_batch_size_per_rank"):
        fixed_micro_batches(list(range(n)), dp, m)


# -- token budget -------------------------------------------------------------------------------


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("n,dp,max_len,budget", [(256, 8, 4096, 8192), (512, 16, 8192, 16384), (96, 4, 1024, 1024),
                                                 (1024, 64, 2048, 4096), (64, 8, 512, 700)])
def test_token_budget_invariants(n, dp, max_len, budget, packed):
    lens = rl_lengths(n, max_len, seed=n + dp, tail=0.1)
    idx = list(range(1000, 1000 + n))  # indices need not start at 0: lengths is indexed by them
    full = np.zeros(1000 + n, dtype=np.int64)
    full[1000:] = lens
    part = token_budget_micro_batches(idx, full, dp, budget, packed=packed)
    assert len(part) == dp
    assert sorted(flat(part)) == idx  # every index exactly once
    counts = {len(r) for r in part}
    assert len(counts) == 1, counts  # the same number of micro-batches on every rank
    assert all(any(r) for r in part)  # every rank holds at least one sequence when n >= dp
    check_budget(part, full, budget, packed)
    for rank in part:  # empties only at the end; within a rank lengths descend across micro-batches
        real = [mb for mb in rank if mb]
        assert rank[:len(real)] == real
        seq = [int(full[i]) for mb in real for i in mb]
        if not packed:
            assert seq == sorted(seq, reverse=True)


def test_token_budget_oversize_error_and_allow():
    lens = [10, 50, 200, 30]
    with pytest.raises(ValueError) as err:
        token_budget_micro_batches(range(4), lens, 2, max_tokens=100)
    assert "max_tokens_per_micro_batch" in str(err.value) and "allow_oversize" in str(err.value)
    assert "sequence 2" in str(err.value)
    part = token_budget_micro_batches(range(4), lens, 2, max_tokens=100, allow_oversize=True)
    alone = [mb for r in part for mb in r if 2 in mb]
    assert alone == [[2]]
    assert sorted(flat(part)) == [0, 1, 2, 3]


def test_token_budget_is_deterministic():
    lens = rl_lengths(512, 8192, seed=3, tail=0.05)
    a = token_budget_micro_batches(range(512), lens, 8, 16384, attention_coef=0.5)
    b = token_budget_micro_batches(list(range(512)), list(lens), 8, 16384, attention_coef=0.5)
    assert a == b


@pytest.mark.parametrize("n,dp", [(0, 4), (1, 4), (3, 8), (5, 5)])
def test_token_budget_fewer_sequences_than_ranks(n, dp):
    lens = [100, 7, 300, 20, 50][:n]
    part = token_budget_micro_batches(range(n), lens, dp, 400)
    assert len(part) == dp and sorted(flat(part)) == list(range(n))
    assert len({len(r) for r in part}) == 1
    assert sum(1 for r in part if any(r)) == n  # one sequence per rank at most, the rest empty
    if n:
        assert all(len(r) == 1 for r in part) and sum(1 for r in part if r == [[]]) == dp - n


def test_balance_quality_long_tail():
    """Realistic long-tailed case: 1024 sequences up to 8k tokens (5% truncated at the limit) on 16 ranks."""
    lens = rl_lengths(1024, 8192, seed=11, tail=0.05)
    part = token_budget_micro_batches(range(1024), lens, 16, 16384)
    st = partition_stats(part, lens)
    assert st["max_over_mean_load"] <= 1.05, st
    assert st["padding_fraction"] <= 0.05, st
    # fixed micro-batches under the same memory budget (m = T // max_len) pad far more
    fixed = fixed_micro_batches(list(range(1024)), 16, 16384 // 8192)
    assert partition_stats(fixed, lens)["padding_fraction"] > 2 * st["padding_fraction"]


def test_balance_ranks_kk_beats_round_robin_and_handles_scale():
    rng = np.random.default_rng(0)
    costs = rng.pareto(1.5, 4000) + 1
    rank = balance_ranks(costs, 32)
    loads = np.bincount(rank, weights=costs, minlength=32)
    rr = np.bincount(np.arange(4000) % 32, weights=costs, minlength=32)
    assert loads.max() / loads.mean() <= min(1.01, rr.max() / rr.mean())
    eq = balance_ranks(costs, 32, equal_counts=True)
    assert np.bincount(eq, minlength=32).max() <= 4000 // 32 + 1


def test_attention_coef_balances_quadratic_cost():
    lens = rl_lengths(512, 16384, seed=5, tail=0.05)
    part = token_budget_micro_batches(range(512), lens, 8, 32768, attention_coef=1.0)
    st = partition_stats(part, lens, attention_coef=1.0, max_tokens=32768)
    assert st["max_over_mean_load"] <= 1.05, st
    check_budget(part, lens, 32768)


def test_partition_stats_values():
    lens = [4, 2, 3, 3]
    st = partition_stats([[[0, 1]], [[2, 3]]], lens)
    assert st["padded_tokens"] == 8 + 6 and st["real_tokens"] == 12
    assert st["padding_fraction"] == pytest.approx(2 / 14)
    assert st["micro_batches_per_step"] == 1 and st["max_over_mean_load"] == pytest.approx(8 / 7)
    assert partition_stats([[[0, 1]], [[2, 3]]], lens, packed=True)["padding_fraction"] == 0.0


def _plan(D: int, **batch) -> BatchPlan:
    section = {"batch": {"prompts_per_rollout": 2, "samples_per_prompt": 4, "mini_batch_size": 8, **batch},
               "run": {"rollouts": 1}}
    return BatchPlan.from_config(load_config({"dsrl": section}), D)


def test_partition_mini_batch_dispatch():
    fixed = _plan(2, micro_batch_size_per_rank=2)
    assert partition_mini_batch(list(range(8)), None, fixed) == fixed_micro_batches(list(range(8)), 2, 2)
    tb = _plan(2, max_tokens_per_micro_batch=100, allow_oversize=True, balance_attention_coef=0.0)
    lens = [30, 120, 60, 10, 90, 45]
    part = partition_mini_batch(range(6), lens, tb)
    assert sorted(flat(part)) == list(range(6)) and [1] in [mb for r in part for mb in r]
    with pytest.raises(ValueError, match="allow_oversize"):
        partition_mini_batch(range(6), lens, _plan(2, max_tokens_per_micro_batch=100))


def test_expected_token_budget_stats_keys_for_cli():
    plan = SimpleNamespace(max_tokens_per_micro_batch=8192, mini_batch_size=256, data_parallel_size=8,
                           allow_oversize=False, balance_attention_coef=0.0, packing=False)
    st = expected_token_budget_stats(plan, rl_lengths(2000, 4096, seed=2).tolist(), samples=4)
    for key in ("micro_batches_per_step", "padding_fraction", "max_over_mean_load"):
        assert key in st
    assert st["micro_batches_per_step"] >= st["lower_bound_micro_batches"] >= 1
    assert 0 <= st["padding_fraction"] < 0.2


def test_planner_scale():
    """65,536 sequences over 1,024 ranks (the bench/planner.py case; its timing is reported there)."""
    lens = rl_lengths(65536, 8192, seed=1, tail=0.02)
    part = token_budget_micro_batches(range(65536), lens, 1024, 16384)
    assert sorted(flat(part)) == list(range(65536)) and len({len(r) for r in part}) == 1
    st = partition_stats(part, lens)
    assert st["max_over_mean_load"] <= 1.05 and st["padding_fraction"] <= 0.03, st
