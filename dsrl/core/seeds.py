"""Seeds derived from the run seed: every random stream of a run (generation, shuffles, ranks) is a
pure function of ``run.seed`` and integers such as the rollout index, the sampling round and the replica,
so a resumed run draws exactly what an uninterrupted one would; and the fork of torch's streams a seeded call runs in
(:func:`forked_torch_rng`), so that it leaves its caller's streams untouched."""

from __future__ import annotations

import contextlib

import torch


def derived_seed(*parts: int) -> int:
    """A 63-bit seed from integers (run seed, rollout, round, rank...), stable across runs."""
    h = 0x9E3779B97F4A7C15
    for p in parts:
        h = (h ^ (int(p) + 0x9E3779B97F4A7C15 + (h << 6) + (h >> 2))) & 0x7FFFFFFFFFFFFFFF
    return h


def generation_seed(run_seed: int, rollout: int, sampling_round: int, replica: int) -> int:
    """The seed of one generation call: data-parallel replica ``replica``'s prompts of sampling round
    ``sampling_round`` (dynamic sampling draws more rounds) of rollout ``rollout`` (0-based). A colocated replica and
    the generator rank serving it make the same call with the same seed, so a resumed run regenerates the same
    completions."""
    return derived_seed(run_seed, rollout, sampling_round, replica)


EVAL_SEED_TAG = 0xE7A1  # every evaluation seed is derived with it: a stream apart from every training one


def eval_seed(run_seed: int, rollout: int, replica: int, call: int) -> int:
    """The seed of one evaluation generate call (``dsrl.eval``): data-parallel replica ``replica``'s call ``call`` of
    the evaluation after ``rollout`` rollouts. A colocated replica and the generator rank serving it make the same
    call with the same seed."""
    return derived_seed(run_seed, EVAL_SEED_TAG, rollout, replica, call)


def forked_torch_rng(device: torch.device) -> contextlib.AbstractContextManager[None]:
    """torch's random streams of the CPU and of ``device`` (its index; 0 when unset) as they were before the block
    (``torch.random.fork_rng``): a call that seeds inside it leaves its caller's streams where they were."""
    devices = [] if device.type == "cpu" else [device.index if device.index is not None else 0]
    return torch.random.fork_rng(devices=devices, device_type=device.type)
