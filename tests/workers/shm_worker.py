"""Worker for tests/test_cpu_shm.py: start DeepSpeed's CPU process group, then exit or crash.

Modes: ``deepspeed`` (plain ``deepspeed.init_distributed``: the control, which leaks), ``dsrl``
(``dsrl.backends.deepspeed.engine.ensure_distributed``), ``dsrl_crash`` (as ``dsrl``, then rank 1 kills itself),
``dsrl_slow_rank1`` (rank 1 reaches DeepSpeed's shm set-up 120 s late, so rank 0 waits inside it
with its segment created: the window an interrupted start-up falls into) and
``dsrl_slow_rank1_unwatched`` (the same without dsrl's segment watcher: the control, which leaks).
"""

from __future__ import annotations

import argparse
import os
import signal

import torch
import torch.distributed as dist


def _delay_shm_setup_on_rank1(watched: bool) -> None:
    import importlib
    import time

    ds_torch = importlib.import_module("deepspeed.comm.torch")  # (``import deepspeed.comm.torch as`` gives torch)

    build = ds_torch.build_shm_op

    class Late:
        def __init__(self, op):
            self.op = op

        def __getattr__(self, name):
            return getattr(self.op, name)

        def initialize(self, world, rank):
            print(f"rank {rank}: in shm set-up", flush=True)
            if rank == 1:
                time.sleep(120)
            return self.op.initialize(world, rank)

    ds_torch.build_shm_op = lambda: Late(build())
    if not watched:
        from dsrl.backends.deepspeed import cpu_shm

        cpu_shm.arm_cleaner = lambda rank: None


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["deepspeed", "dsrl", "dsrl_crash", "dsrl_slow_rank1",
                                      "dsrl_slow_rank1_unwatched"], required=True)
    p.add_argument("--local_rank", type=int, default=0)
    args = p.parse_args()
    if args.mode == "deepspeed":
        import deepspeed

        deepspeed.init_distributed(verbose=False)
    else:
        if args.mode.startswith("dsrl_slow_rank1"):
            _delay_shm_setup_on_rank1(watched=args.mode == "dsrl_slow_rank1")
        from dsrl.backends.deepspeed.engine import ensure_distributed

        ensure_distributed()
    t = torch.ones(4)
    dist.all_reduce(t)  # the job still communicates after its segments are unlinked
    assert t.tolist() == [float(dist.get_world_size())] * 4
    if args.mode == "dsrl_crash" and dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


if __name__ == "__main__":
    from dsrl.runtime.process_exit import leave

    main()
    leave(0)  # no interpreter finalization beside gloo threads (dsrl/runtime/process_exit.py); DeepSpeed's leak
    # in the plain mode comes from its start-up, not from how the process ends
