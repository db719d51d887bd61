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

Between the creation of a segment and that barrier a rank can be interrupted (Ctrl-C during start-up,
the launcher's SIGTERM then SIGKILL, a peer that never arrives while DeepSpeed's C++ code spins waiting
for its segment, where no Python signal handler can run). :func:`arm_cleaner` covers that window: before
the process group starts, each rank starts a tiny detached watcher process that holds the read end of
a pipe. When the rank's write end closes, because the segment was released or because the rank died
in any way, the watcher unlinks the rank's segment name and exits. It ignores SIGINT/SIGTERM/SIGHUP,
runs in its own session (a terminal's Ctrl-C does not reach it) and is re-parented away from the rank
(a launcher's process-tree kill does not find it).
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys

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


_CLEANER = r"""
import os, signal, sys
for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(s, signal.SIG_IGN)
if os.fork():
    os._exit(0)
try:
    while os.read(0, 64):
        pass
except OSError:
    pass
for path in sys.argv[1:]:
    try:
        os.unlink(path)
    except OSError:
        pass
"""


class Cleaner:
    """The watcher of one rank's segment names (module docstring); :meth:`disarm` ends it."""

    def __init__(self, paths: list[str]):
        self.paths = paths
        self._pipe = None
        try:
            proc = subprocess.Popen([sys.executable, "-S", "-c", _CLEANER, *paths], stdin=subprocess.PIPE,
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, close_fds=True,
                                    start_new_session=True)
            self._pipe = proc.stdin
            proc.wait()  # the intermediate exits at once; its child (the watcher) lives on, detached
        except OSError:
            self._pipe = None  # best effort: without a watcher the barrier-time unlink still applies

    def disarm(self) -> None:
        """Close the pipe: the watcher unlinks the (already released) names and exits."""
        if self._pipe is not None:
            try:
                self._pipe.close()
            except OSError:
                pass
            self._pipe = None


def arm_cleaner(rank: int) -> Cleaner | None:
    """Start the watcher of ``rank``'s segment before DeepSpeed creates it (CPU accelerator, all ranks on
    this machine, i.e. when DeepSpeed will create one); None otherwise."""
    if not os.path.isdir(SHM_DIR) or not _cpu_accelerator():
        return None
    return Cleaner([segment_path(rank)])
