"""Trainer ranks and generator ranks under one launcher (``rollout.placement = "disaggregated"``, ARCHITECTURE §8).

The ``deepspeed`` launcher (single node or pdsh multi-node) starts W ranks; :func:`split_world` splits them
once, at start-up, before DeepSpeed sees anything:

- the first T = W - N ranks train, the last N = ``rollout.generator_ranks`` generate (rank 0, which writes
  metrics and checkpoints, is always a trainer);
- the trainers' default process group holds the trainers only, so the DeepSpeed engine's world, and its data-,
  tensor- and sequence-parallel groups, are trainer ranks, and every dsrl collective of the training loop
  runs among trainers exactly as in a colocated job of T ranks. The environment the launcher set is rewritten
  to the role's view (``RANK``, ``WORLD_SIZE``, ``LOCAL_SIZE``; the launcher's values stay in
  ``DSRL_GLOBAL_*``; ``LOCAL_RANK`` keeps choosing the device), so DeepSpeed's CPU shared-memory all-reduce
  counts only the trainers of a node;
- generators join no default group (a vLLM engine makes its own of one rank);
- two more groups span roles, built on the job's TCP store (``MASTER_ADDR:MASTER_PORT``, served by rank 0): the
  bridge (all W ranks; point to point: samples travel generator -> trainer) and the sync group (trainer 0 and
  the generators; broadcasts: control messages and weights travel trainer 0 -> generators). They are gloo
  groups with the collective bound ``run.collective_timeout_s``; every rank publishes its host, process id and
  start time in the store (:class:`dsrl.runtime.peers.Peers`), so a message about a lost or frozen rank names
  its role, rank and host, whichever side noticed it first.

Invariant: every rank calls :func:`split_world` once, with the same configuration, before any other
torch.distributed call; a colocated job gets None and nothing changes.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from dsrl.config import ConfigError, DsrlConfig
from dsrl.config.names import DISAGGREGATED
from dsrl.core import collectives, launchers, rendezvous, timeouts
from dsrl.core.errors import RunError
from dsrl.core.plan import trainer_world_size
from dsrl.runtime.peers import Peers

TRAINER, GENERATOR = "trainer", "generator"


@dataclass
class Role:
    """What this rank is in a disaggregated job and the groups that connect the roles."""

    kind: str  # TRAINER | GENERATOR
    global_rank: int
    world: int  # W: every rank of the job
    trainers: int  # T: ranks 0 .. T-1
    store: Any
    bridge: Any  # gloo group of all W ranks (point to point)
    sync: Any  # gloo group of trainer 0 and the generators (broadcast from trainer 0); None elsewhere
    peers: Peers | None = None  # every rank's host and process: who ended (dsrl.runtime.peers)
    # the generators know how the run starts: trainer 0 sent the start message
    # (dsrl.rl.disagg.remote.RemoteRolloutBackend.begin), or every rank ends on an agreed start-up error
    started: bool = False

    @property
    def generators(self) -> int:
        return self.world - self.trainers

    @property
    def role_rank(self) -> int:
        return self.global_rank if self.kind == TRAINER else self.global_rank - self.trainers

    def generator_global_rank(self, j: int) -> int:
        return self.trainers + j

    def describe(self, global_rank: int) -> str:
        """'generator 0 (rank 2 on host a)' for a rank of the job."""
        if self.peers is not None:
            return self.peers.describe(global_rank)
        return f"{_label(global_rank, self.trainers)} (rank {global_rank})"

    def obituary(self) -> str | None:
        """The ranks of this host that have ended or are frozen, named (:meth:`dsrl.runtime.peers.Peers.obituary`),
        or None."""
        return self.peers.obituary() if self.peers is not None else None

    def agree(self, problem: BaseException | None) -> None:
        """Every rank of the job, trainers and generators, shares the outcome of its checks before any work (one
        all-gather over the bridge): if any rank's ended in a ConfigError or RunError, every rank raises the same
        agreed error (:func:`dsrl.core.collectives.shared_error`: printed once, by rank 0). ``problem``: this
        rank's (None: its checks passed). A rank that ended without reaching this point is reported as such."""
        from dsrl.rl.disagg.wire import all_gather_bytes

        mine = json.dumps(collectives.outcome(problem)).encode()
        try:
            gathered = all_gather_bytes(self.bridge, mine, self.world)
        except RuntimeError as e:
            raise RunError(f"{self.describe(self.global_rank)}: another rank of the job ended before the run started "
                           "(its message, or the launcher's, says why)") from e
        err = collectives.shared_error([None if o is None else tuple(o) for o in map(json.loads, gathered)])
        if err is not None:
            self.started = True  # every rank ends on this error: there is nothing to abandon
            raise err

    def abandon(self, status: int) -> None:
        """Trainer 0, ending before it sent the start message (an error after the agreement): tell the generators
        to end with ``status`` and nothing else (trainer 0 prints why), instead of letting them find the connection
        closed. A no-op on every other rank and once the run started."""
        if self.global_rank != 0 or self.started or self.sync is None:
            return
        from dsrl.rl.disagg.wire import send_control

        self.started = True
        with contextlib.suppress(Exception):
            send_control(self.sync, {"abort": int(status)}, deadline=time.monotonic() + 10.0)


def _label(global_rank: int, trainers: int) -> str:
    """'trainer 1' or 'generator 0' for a rank of a job whose first ``trainers`` ranks train."""
    return f"{TRAINER} {global_rank}" if global_rank < trainers else f"{GENERATOR} {global_rank - trainers}"


def _launcher_env() -> tuple[int, int, str, int]:
    try:
        return (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), os.environ["MASTER_ADDR"],
                int(os.environ["MASTER_PORT"]))
    except KeyError as e:
        raise ConfigError(f"dsrl.rollout.placement = 'disaggregated' needs the launcher's {e.args[0]}: start the "
                          "job with `deepspeed --num_gpus N launch/train.py ...` (or a hostfile for several nodes)."
                          ) from None


def split_world(cfg: DsrlConfig) -> Role | None:
    """This rank's :class:`Role` (module docstring); None for a colocated job. Collective over the job."""
    if cfg.rollout.placement != DISAGGREGATED:
        return None
    if dist.is_initialized():
        raise RuntimeError("split_world must run before any process group exists")
    rank, world, addr, port = _launcher_env()
    trainers = trainer_world_size(cfg, world)
    join = timedelta(seconds=timeouts.join_timeout_s(cfg.run.join_timeout_s))
    bound = timedelta(seconds=cfg.run.collective_timeout_s)
    store = rendezvous.check_in(launchers.adopt(), join.total_seconds())  # the start-up preflight, on the job's store
    try:
        peers = Peers.publish(store, rank, world, label=lambda r: _label(r, trainers))
    except RuntimeError as e:
        if timeouts.looks_like_timeout(e):
            raise RunError(f"rank {rank}: not all {world} ranks reached {addr}:{port} within "
                           f"{join.total_seconds():g} s (dsrl.run.join_timeout_s); see the launcher's output for a "
                           "rank that never started") from e
        raise
    kind = TRAINER if rank < trainers else GENERATOR
    _rewrite_environment(rank, world, trainers, peers.hosts, kind)
    if kind == TRAINER:
        from deepspeed.accelerator import get_accelerator

        backend = get_accelerator().communication_backend_name()
        dist.init_process_group(backend, store=dist.PrefixStore("dsrl/trainers", store), rank=rank,
                                world_size=trainers, timeout=join)
    bridge = dist.ProcessGroupGloo(dist.PrefixStore("dsrl/bridge", store), rank, world, bound)
    sync = None
    if rank == 0 or kind == GENERATOR:
        index = 0 if rank == 0 else rank - trainers + 1
        sync = dist.ProcessGroupGloo(dist.PrefixStore("dsrl/sync", store), index, world - trainers + 1, bound)
    return Role(kind, rank, world, trainers, store, bridge, sync, peers)


def _rewrite_environment(rank: int, world: int, trainers: int, hosts: list[str], kind: str) -> None:
    """The launcher's rank variables as this role sees them (the originals kept as DSRL_GLOBAL_*)."""
    env = os.environ
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE"):
        if key in env:
            env[f"DSRL_GLOBAL_{key}"] = env[key]
    members = list(range(trainers)) if kind == TRAINER else list(range(trainers, world))
    mine = [r for r in members if hosts[r] == hosts[rank]]
    env["RANK"] = str(members.index(rank))
    env["WORLD_SIZE"] = str(len(members))
    env["LOCAL_SIZE"] = str(len(mine))  # LOCAL_RANK stays the launcher's: it picks this rank's device
    env["DSRL_ROLE"] = kind
