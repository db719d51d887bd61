"""Worker for tests/test_cpu_shm.py: start DeepSpeed's CPU process group, then exit or crash.

Modes: ``deepspeed`` (plain ``deepspeed.init_distributed``: the control, which leaks), ``dsrl``
(``dsrl.engine.ensure_distributed``), ``dsrl_crash`` (as ``dsrl``, then rank 1 kills itself).
"""

from __future__ import annotations

import argparse
import os
import signal

import torch
import torch.distributed as dist


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["deepspeed", "dsrl", "dsrl_crash"], required=True)
    p.add_argument("--local_rank", type=int, default=0)
    args = p.parse_args()
    if args.mode == "deepspeed":
        import deepspeed

        deepspeed.init_distributed(verbose=False)
    else:
        from dsrl.engine import ensure_distributed

        ensure_distributed()
    t = torch.ones(4)
    dist.all_reduce(t)  # the job still communicates after its segments are unlinked
    assert t.tolist() == [float(dist.get_world_size())] * 4
    if args.mode == "dsrl_crash" and dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


if __name__ == "__main__":
    main()
