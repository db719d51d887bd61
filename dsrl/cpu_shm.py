"""DeepSpeed's CPU shared-memory all-reduce segments: check the room for them, and stop them leaking.

On the CPU accelerator, when every rank is on one machine (``WORLD_SIZE == LOCAL_SIZE``),
DeepSpeed 0.19.8's communication backend builds its ``deepspeed_shm_comm`` op and each rank creates
a POSIX shared-memory segment ``/dev/shm/deepspeed_allreduce_buffer_{uid}_{MASTER_ADDR}_{MASTER_PORT}_{rank}``
of about 69 MB, then maps every peer's segment. It never unlinks them: each job leaks
``world_size × 69 MB`` of RAM-backed ``/dev/shm`` for good, named after its master port. A test
suite or a sweep that launches many jobs on fresh ports fills ``/dev/shm`` (and with it the
machine's memory) until a later job thrashes or hangs in its first collective.

:func:`release_segments` unlinks this rank's segment once every rank has mapped all of them
(after a barrier): the mappings stay valid, and the kernel frees the memory when the last process
of the job exits, even after ``kill -9``. :func:`check_room` refuses to start when ``/dev/shm``
cannot hold the segments of the job, naming the stale ones.
"""

from __future__ import annotations

import glob
import os
import shutil

SHM_DIR = "/dev/shm"
SEGMENT_PREFIX = "deepspeed_allreduce_buffer"
SEGMENT_BYTES = 69_206_024  # sizeof(struct allreduce_workspace) in DeepSpeed 0.19.8's shm.cpp


def _cpu_accelerator() -> bool:
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().device_name() == "cpu"


def segment_path(rank: int) -> str:
    """The name DeepSpeed's shm op gives rank ``rank``'s segment of this job (MASTER_ADDR/PORT)."""
    addr, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
    return os.path.join(SHM_DIR, f"{SEGMENT_PREFIX}_{os.getuid()}_{addr}_{port}_{rank}")


def job_segments(port: int | str = "*") -> list[str]:
    """Every segment in ``/dev/shm`` of this user's jobs on master port ``port`` (default: any)."""
    return sorted(glob.glob(os.path.join(SHM_DIR, f"{SEGMENT_PREFIX}_{os.getuid()}_*_{port}_*")))


def check_room(local_ranks: int) -> None:
    """Raise before the process group starts if ``/dev/shm`` cannot hold this node's segments.

    Without room a rank's segment is written short or not at all, and DeepSpeed's shm op can fault
    while setting it up; a nearly full ``/dev/shm`` also starves the machine of memory (it is RAM).
    This turns both into an error that says what to remove.
    """
    if not os.path.isdir(SHM_DIR) or not _cpu_accelerator():
        return
    free = shutil.disk_usage(SHM_DIR).free
    need = local_ranks * SEGMENT_BYTES
    if free >= need:
        return
    stale = job_segments()
    raise RuntimeError(
        f"{SHM_DIR} has {free / 2**20:.0f} MiB free, but DeepSpeed's CPU shared-memory all-reduce needs about "
        f"{need / 2**20:.0f} MiB for {local_ranks} local rank(s). {len(stale)} segment(s) named "
        f"{SHM_DIR}/{SEGMENT_PREFIX}_{os.getuid()}_* are left by earlier DeepSpeed CPU jobs (DeepSpeed never "
        f"removes them); once no such job is running, free the space with: rm {SHM_DIR}/{SEGMENT_PREFIX}_*"
    )


def release_segments() -> None:
    """Unlink this rank's shm segment once every rank of the job has mapped it (collective).

    Keeps: the job's shm all-reduce works unchanged (peers hold mappings, not names); no segment of
    this job outlives its processes. Every rank must call it at the same point, after the DeepSpeed
    communication backend exists; a second call only costs a barrier.
    """
    import torch.distributed as dist

    if not dist.is_initialized() or not _cpu_accelerator():
        return
    path = segment_path(dist.get_rank())
    dist.barrier()  # every rank has finished shm_initialize, so every peer segment is mapped
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
