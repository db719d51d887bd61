"""Which launcher started this process, and the job's ranks as torch.distributed wants them.

DeepSpeed's own launcher (one node, or pdsh over a hostfile) and torchrun give each rank ``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``. Two launchers that
DeepSpeed's runner also drives start the training script directly and give none of them:

- **Slurm** (``deepspeed --launcher slurm`` inside an allocation, or a plain ``srun`` with one task per
  rank): rank, local rank and world come from ``SLURM_PROCID``, ``SLURM_LOCALID`` and
  ``SLURM_STEP_NUM_TASKS``; the ranks of this node from ``SLURM_GTIDS``; the node from
  ``SLURMD_NODENAME``; the master address is the first node of the step (``SLURM_STEP_NODELIST``, where
  task 0 runs), the port ``$MASTER_PORT`` or one derived from the job and step ids. Only an ``srun`` step
  counts (``SLURM_STEP_ID`` set): a batch script's own shell is one process, not the job's ranks.
- **OpenMPI** (``deepspeed --launcher openmpi``, or ``mpirun``): ``OMPI_COMM_WORLD_*``. No variable of
  mpirun names rank 0's host (DeepSpeed's own discovery needs mpi4py), so ``MASTER_ADDR`` must be
  forwarded (``.deepspeed_env``, which the runner passes with ``-x``); ``MASTER_PORT`` defaults to 29500.

:func:`adopt` writes the derived variables into the environment once per process (a launcher's own
``RANK`` always wins), so DeepSpeed and every rank check downstream read one set, and returns the
:class:`Launch` that the start-up preflight (:mod:`dsrl.core.rendezvous`) uses to name a node that never
checked in, the launcher, and the fix. Pure environment reading: no process group, no DeepSpeed.
"""

from __future__ import annotations

import base64
import json
import os
import re
import socket
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass

from dsrl.core.errors import RunError

PDSH, DEEPSPEED, SLURM, OPENMPI, TORCHRUN, ENVIRONMENT, NONE = (
    "pdsh", "deepspeed", "slurm", "openmpi", "torchrun", "environment", "none")
DEFAULT_MPI_PORT = 29500  # DeepSpeed's (and torch's) default rendezvous port
_RANK_KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE", "MASTER_ADDR",
              "MASTER_PORT")


@dataclass(frozen=True)
class Launch:
    """This rank as its launcher placed it.

    ``nodes``: the job's nodes in the launcher's order with the number of ranks each was given
    (None where the launcher does not say: OpenMPI); ``node``: this rank's node, named as the launcher
    names it (a hostfile entry, a Slurm node name), so that a node that never checked in is named the
    way the user wrote it.
    """

    launcher: str
    rank: int
    local_rank: int
    world_size: int
    local_size: int
    node: str
    master_addr: str
    master_port: int
    nodes: tuple[tuple[str, int], ...] | None = None
    detail: str = ""
    problem: str = ""  # why this launch cannot work (raised by :func:`adopt` once the rank variables are exported)

    @property
    def name(self) -> str:
        """The launcher in words, for messages."""
        return {PDSH: "DeepSpeed's pdsh launcher", DEEPSPEED: "DeepSpeed's launcher", TORCHRUN: "torchrun",
                SLURM: f"Slurm's srun{f' ({self.detail})' if self.detail else ''}", OPENMPI: "OpenMPI's mpirun",
                ENVIRONMENT: "a launcher that set RANK/WORLD_SIZE", NONE: "a plain process"}[self.launcher]

    def fix(self, missing_nodes: list[str]) -> str:
        """What to do when ``missing_nodes`` (may be empty: not known) never checked in."""
        some = ", ".join(missing_nodes) or "the host"
        if self.launcher == PDSH:
            return (f"make {some} reachable by ssh from the launching node with the same Python environment and launch "
                    "directory (pdsh's own lines above say what failed; `python -m dsrl.cli.launch_env check-hosts "
                    "HOSTFILE` checks every host in seconds), or remove it from the hostfile")
        if self.launcher == SLURM:
            return (f"see srun's error for {some} above, then resubmit without it (`sbatch "
                    f"--exclude={','.join(missing_nodes) or 'HOST'}`) or have "
                    "it drained, and pass --kill-on-bad-exit=1 to srun so that a task that cannot start ends the step "
                    "at once")
        if self.launcher == OPENMPI:
            return (f"check that every host of the hostfile reaches {self.master_addr}:{self.master_port} "
                    "(MASTER_ADDR, MASTER_PORT) and has the same Python environment; mpirun's own lines above name "
                    "the host")
        return (f"check that every rank's process started and reaches {self.master_addr}:{self.master_port} "
                "(MASTER_ADDR, MASTER_PORT)")


# --------------------------------------------------------------------------------------------
# Slurm's compact lists


def expand_hostlist(text: str) -> list[str]:
    """Slurm's hostlist syntax, as ``scontrol show hostnames`` expands it: ``gpu[01-03,7],cpu-a`` ->
    ``gpu01 gpu02 gpu03 gpu7 cpu-a`` (zero padding kept; several bracket groups in one name expand as a
    product)."""
    names: list[str] = []
    for item in _split_top_level(text.strip()):
        if item:
            names.extend(_expand_one(item))
    return names


def _split_top_level(text: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in Slurm hostlist {text!r}")
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"unbalanced '[' in Slurm hostlist {text!r}")
    parts.append(text[start:])
    return parts


def _expand_one(item: str) -> list[str]:
    match = re.search(r"\[([^\]]*)\]", item)
    if match is None:
        return [item]
    head, tail = item[:match.start()], item[match.end():]
    out = []
    for piece in match.group(1).split(","):
        lo, _, hi = piece.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise ValueError(f"bad range {piece!r} in Slurm hostlist {item!r}")
        width = len(lo)
        for n in range(int(lo), int(hi or lo) + 1):
            out.extend(_expand_one(f"{head}{n:0{width}d}{tail}"))
    return out


def expand_tasks_per_node(text: str) -> list[int]:
    """``SLURM_STEP_TASKS_PER_NODE`` (``2(x3),1``) -> ``[2, 2, 2, 1]``."""
    out: list[int] = []
    for item in text.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", item)
        if match is None:
            raise ValueError(f"bad Slurm tasks-per-node list {text!r}")
        out.extend([int(match.group(1))] * int(match.group(2) or 1))
    return out


def slurm_port(job_id: int, step_id: int) -> int:
    """The rendezvous port of a Slurm step without ``MASTER_PORT``: 10000-29999, below Linux's ephemeral range,
    different for the steps of one job and for consecutive jobs."""
    return 10000 + (job_id % 2000) * 10 + step_id % 10


# --------------------------------------------------------------------------------------------
# detection


def _int(environ: Mapping[str, str], key: str, default: int | None = None) -> int:
    value = environ.get(key)
    if value is None or value == "":
        if default is None:
            raise KeyError(key)
        return default
    return int(value)


def deepspeed_world_info(parent_cmdline: list[str]) -> dict[str, list[int]] | None:
    """``{host: slots}`` from the ``--world_info`` argument of ``deepspeed.launcher.launch`` (this rank's
    parent), in hostfile order; None when the parent is not that launcher."""
    if not any("deepspeed.launcher.launch" in a for a in parent_cmdline[:4]):
        return None
    for arg in parent_cmdline:
        if arg.startswith("--world_info="):
            try:
                return json.loads(base64.urlsafe_b64decode(arg.split("=", 1)[1]))
            except (ValueError, TypeError):
                return None
    return None


def _parent_cmdline() -> list[str]:
    try:
        import psutil

        return psutil.Process(os.getppid()).cmdline()
    except Exception:  # noqa: BLE001 - a missing parent only loses the node names
        return []


def detect(environ: Mapping[str, str], parent_cmdline: list[str] | None = None) -> Launch:
    """The :class:`Launch` of a process with environment ``environ`` (module docstring); ``problem`` says why it
    cannot work (OpenMPI without ``MASTER_ADDR``). Raises :class:`RunError` for another MPI's variables without
    ``RANK`` (no rank to export)."""
    host = socket.gethostname()
    if "RANK" in environ and "WORLD_SIZE" in environ:
        return _preset(environ, host, parent_cmdline if parent_cmdline is not None else _parent_cmdline())
    if "OMPI_COMM_WORLD_RANK" in environ:
        return _openmpi(environ, host)
    if environ.get("SLURM_STEP_ID") and "SLURM_PROCID" in environ:
        return _slurm(environ)
    for key in ("PMI_SIZE", "MV2_COMM_WORLD_SIZE"):
        if environ.get(key, "").isdigit() and int(environ[key]) > 1:
            raise RunError(
                f"this process was started by an MPI launcher whose variables dsrl does not read ({key}="
                f"{environ[key]}, no RANK): start the job with `deepspeed --launcher openmpi`, `--launcher slurm` or "
                "pdsh, or set RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT for every rank", agreed=True)
    return Launch(NONE, 0, 0, 1, 1, host, environ.get("MASTER_ADDR", "127.0.0.1"),
                  _int(environ, "MASTER_PORT", 0))


def _preset(environ: Mapping[str, str], host: str, parent_cmdline: list[str]) -> Launch:
    rank, world = _int(environ, "RANK"), _int(environ, "WORLD_SIZE")
    local_rank = _int(environ, "LOCAL_RANK", 0)
    local_size = _int(environ, "LOCAL_SIZE", _int(environ, "LOCAL_WORLD_SIZE", world))
    addr, port = environ.get("MASTER_ADDR", "127.0.0.1"), _int(environ, "MASTER_PORT", 0)
    info = deepspeed_world_info(parent_cmdline)
    if info is not None:
        hosts = list(info)
        node_rank = _int(environ, "CROSS_RANK", 0)
        node = hosts[node_rank] if node_rank < len(hosts) else host
        nodes = tuple((h, len(slots)) for h, slots in info.items())
        launcher = PDSH if len(hosts) > 1 else DEEPSPEED
        return Launch(launcher, rank, local_rank, world, local_size, node, addr, port, nodes)
    launcher = TORCHRUN if "TORCHELASTIC_RUN_ID" in environ else ENVIRONMENT
    return Launch(launcher, rank, local_rank, world, local_size, host, addr, port)


def _openmpi(environ: Mapping[str, str], host: str) -> Launch:
    rank, world = _int(environ, "OMPI_COMM_WORLD_RANK"), _int(environ, "OMPI_COMM_WORLD_SIZE")
    addr = environ.get("MASTER_ADDR", "")
    problem = "" if addr else (
        f"rank {rank} was started by OpenMPI's mpirun without MASTER_ADDR, and mpirun names no host for the "
        "rendezvous (`deepspeed --launcher openmpi` does not pass --master_addr on): add MASTER_ADDR=<the "
        "hostfile's first host> (and MASTER_PORT) to .deepspeed_env, which the runner forwards with -x "
        "(`python -m dsrl.cli.launch_env write --set MASTER_ADDR=HOST --merge`), or pass -x MASTER_ADDR=HOST to "
        "mpirun")
    return Launch(OPENMPI, rank, _int(environ, "OMPI_COMM_WORLD_LOCAL_RANK", 0), world,
                  _int(environ, "OMPI_COMM_WORLD_LOCAL_SIZE", 1), environ.get("PMIX_HOSTNAME", host), addr,
                  _int(environ, "MASTER_PORT", DEFAULT_MPI_PORT), problem=problem)


def _slurm(environ: Mapping[str, str]) -> Launch:
    rank = _int(environ, "SLURM_PROCID")
    world = _int(environ, "SLURM_STEP_NUM_TASKS", _int(environ, "SLURM_NTASKS", 1))
    hosts = expand_hostlist(environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST", ""))
    counts = expand_tasks_per_node(environ["SLURM_STEP_TASKS_PER_NODE"]) \
        if environ.get("SLURM_STEP_TASKS_PER_NODE") else []
    nodes = tuple(zip(hosts, counts, strict=True)) if hosts and len(hosts) == len(counts) else None
    gtids = [g for g in environ.get("SLURM_GTIDS", "").split(",") if g]
    job, step = _int(environ, "SLURM_JOB_ID", 0), _int(environ, "SLURM_STEP_ID", 0)
    addr = environ.get("MASTER_ADDR") or (hosts[0] if hosts else "127.0.0.1")
    port = _int(environ, "MASTER_PORT", slurm_port(job, step))
    return Launch(SLURM, rank, _int(environ, "SLURM_LOCALID", 0), world, len(gtids) or 1,
                  environ.get("SLURMD_NODENAME") or socket.gethostname(), addr, port, nodes,
                  f"job {job} step {step}")


def rank_variables(launch: Launch, environ: Mapping[str, str]) -> dict[str, str]:
    """The torch.distributed variables a Slurm or OpenMPI rank lacks (none for launchers that set them)."""
    if launch.launcher not in (SLURM, OPENMPI):
        return {}
    out: dict[str, object] = {"RANK": launch.rank, "LOCAL_RANK": launch.local_rank, "WORLD_SIZE": launch.world_size,
                              "LOCAL_SIZE": launch.local_size, "MASTER_PORT": launch.master_port}
    if launch.master_addr:
        out["MASTER_ADDR"] = launch.master_addr
    if launch.launcher == SLURM:
        out["CROSS_RANK"] = _int(environ, "SLURM_NODEID", 0)
        out["CROSS_SIZE"] = _int(environ, "SLURM_STEP_NUM_NODES", _int(environ, "SLURM_NNODES", 1))
    return {k: str(v) for k, v in out.items()}


_ADOPTED: list[Launch] = []


def adopt(environ: MutableMapping[str, str] | None = None) -> Launch:
    """Detect this process's launch (once per process) and export the rank variables it lacks (module
    docstring). A plain process becomes rank 0 of 1 on a free local port. Raises :class:`RunError` (agreed: every
    rank meets it alike, after its rank variables are exported) for a launch that cannot work."""
    if _ADOPTED and environ is None:
        return _ADOPTED[0]
    env = os.environ if environ is None else environ
    launch = detect(env)
    if launch.launcher == NONE:
        port = launch.master_port or _free_port()
        launch = Launch(NONE, 0, 0, 1, 1, launch.node, launch.master_addr, port)
        env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_SIZE="1")
        env.setdefault("MASTER_ADDR", launch.master_addr)
        env["MASTER_PORT"] = str(port)
    env.update(rank_variables(launch, env))
    if launch.problem:
        raise RunError(launch.problem, agreed=True)
    if environ is None:
        _ADOPTED.append(launch)
    return launch


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_threads_per_rank(local_size: int, environ: Mapping[str, str] | None = None) -> int | None:
    """The intra-op threads each rank of a CPU job uses: the cores this process may run on divided among the
    ``local_size`` ranks of its host (at least one), so that ranks do not fight over cores (two ranks of 2 threads
    on a 2-core host train at under half the speed of two of 1). None when ``OMP_NUM_THREADS`` is set: the user
    chose."""
    environ = os.environ if environ is None else environ
    if environ.get("OMP_NUM_THREADS"):
        return None
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, local_size))
