"""Atomic checkpoints around DeepSpeed's ``save_checkpoint`` / ``load_checkpoint``.

DeepSpeed writes ``latest`` from rank 0 before the other ranks have finished their shards, with a
plain ``open('w')``. dsrl instead commits a checkpoint in this order:

1. rank 0 removes a stale, incomplete directory of the same tag; barrier;
2. every rank: ``engine.save_checkpoint(dir, tag, client_state={"dsrl": ...}, save_latest=False)``
   (it ends in a barrier), then each *companion* engine (a critic beside the policy) into
   ``dir/tag/<name>/`` the same way, then writes its own ``dsrl_rank{r}.pt`` (per-rank state such as RNG
   streams and data cursors) via temp file + ``os.replace`` and fsyncs the files it wrote; barrier;
3. rank 0 writes the ``COMPLETE`` marker, then ``latest`` via temp file + ``os.replace``, fsyncing
   both and the directory; barrier.

So ``latest`` only ever names a tag whose every shard (companions' included) and marker exist: a crash (even kill -9) at
any point leaves the previous complete checkpoint as the one ``load`` resumes from. On load, a
``latest`` that names an incomplete tag is ignored in favour of the newest complete one.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
from typing import Any

import torch
import torch.distributed as dist

COMPLETE = "COMPLETE"
# Fault injection (tests): rank 0 kills itself with SIGKILL mid-save of the tag named by this variable.
FAULT_KILL_ENV = "DSRL_FAULT_KILL_DURING_SAVE"
LATEST = "latest"


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _fsync_path(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_bytes(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the whole new one."""
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_path(os.path.dirname(os.path.abspath(path)))


def atomic_torch_save(obj: Any, path: str) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    torch.save(obj, tmp)
    _fsync_path(tmp)
    os.replace(tmp, path)


def is_complete(save_dir: str, tag: str) -> bool:
    return os.path.isfile(os.path.join(save_dir, tag, COMPLETE))


def _tag_order(tag: str) -> tuple[int, str]:
    nums = re.findall(r"\d+", tag)
    return (int(nums[-1]) if nums else -1, tag)


def complete_tags(save_dir: str) -> list[str]:
    """Complete checkpoint tags in ``save_dir``, oldest first (by the last number in the tag)."""
    if not os.path.isdir(save_dir):
        return []
    tags = [t for t in os.listdir(save_dir) if os.path.isdir(os.path.join(save_dir, t)) and is_complete(save_dir, t)]
    return sorted(tags, key=_tag_order)


def latest_complete_tag(save_dir: str) -> str | None:
    """The tag ``latest`` names if that checkpoint is complete, else the newest complete tag."""
    latest = os.path.join(save_dir, LATEST)
    if os.path.isfile(latest):
        with open(latest, encoding="utf-8") as f:
            tag = f.read().strip()
        if tag and is_complete(save_dir, tag):
            return tag
    tags = complete_tags(save_dir)
    return tags[-1] if tags else None


def save(
    engine: Any,
    save_dir: str,
    tag: str,
    dsrl_state: dict[str, Any],
    rank_state: dict[str, Any] | None = None,
    keep_last: int | None = None,
    companions: dict[str, tuple[Any, dict[str, Any]]] | None = None,
) -> str:
    """Save a DeepSpeed engine checkpoint plus dsrl's state, committed atomically (module doc).

    ``dsrl_state`` (rank 0's copy is kept under ZeRO-0/1/2) goes into DeepSpeed's client state
    under the single key ``"dsrl"``; ``rank_state`` is written per rank to ``dsrl_rank{r}.pt``;
    ``companions`` maps a name to ``(engine, its dsrl state)``, saved under ``tag/<name>/`` in the same
    commit. Returns the checkpoint directory. Must be called on every rank.
    """
    rank = _rank()
    path = os.path.join(save_dir, tag)
    if rank == 0:
        os.makedirs(save_dir, exist_ok=True)
        if os.path.isdir(path) and not is_complete(save_dir, tag):
            shutil.rmtree(path)  # leftovers of a crashed save of the same tag
    _barrier()
    engine.save_checkpoint(save_dir, tag=tag, client_state={"dsrl": dsrl_state}, save_latest=False)
    for name, (other, other_state) in (companions or {}).items():
        other.save_checkpoint(path, tag=name, client_state={"dsrl": other_state}, save_latest=False)
    if rank_state is not None:
        atomic_torch_save(rank_state, os.path.join(path, f"dsrl_rank{rank}.pt"))
    for name in os.listdir(path):
        _fsync_path(os.path.join(path, name))
    if rank == 0 and os.environ.get(FAULT_KILL_ENV) == tag:
        os.kill(os.getpid(), signal.SIGKILL)  # fault injection for tests: die with shards written, uncommitted
    _barrier()
    if rank == 0:
        atomic_write_bytes(os.path.join(path, COMPLETE), tag.encode())
        atomic_write_bytes(os.path.join(save_dir, LATEST), tag.encode())
        if keep_last:
            prune(save_dir, keep_last)
    _barrier()
    return path


def prune(save_dir: str, keep_last: int) -> None:
    """Delete all but the newest ``keep_last`` complete checkpoints (rank 0 only)."""
    current = latest_complete_tag(save_dir)
    tags = complete_tags(save_dir)
    for tag in tags[:-keep_last]:
        if tag != current:
            shutil.rmtree(os.path.join(save_dir, tag), ignore_errors=True)


def load(engine: Any, load_dir: str, tag: str | None = None, companions: dict[str, Any] | None = None,
         **kwargs: Any) -> tuple[str | None, dict, dict | None]:
    """Load the newest complete checkpoint (or ``tag``), and each companion engine from ``tag/<name>/``.

    Returns ``(tag, dsrl_state, rank_state)``, the companions' dsrl states under
    ``dsrl_state["companions"][name]``; ``(None, {}, None)`` when there is none.
    """
    tag = tag or latest_complete_tag(load_dir)
    if tag is None:
        return None, {}, None
    if not is_complete(load_dir, tag):
        raise FileNotFoundError(f"checkpoint {os.path.join(load_dir, tag)} is incomplete (no {COMPLETE} marker)")
    path, client_state = engine.load_checkpoint(load_dir, tag=tag, **kwargs)
    if path is None:
        raise FileNotFoundError(f"DeepSpeed could not load checkpoint {os.path.join(load_dir, tag)}")
    state = dict((client_state or {}).get("dsrl", {}))
    if companions:
        state["companions"] = {}
        for name, other in companions.items():
            where = os.path.join(load_dir, tag)
            if not os.path.isdir(os.path.join(where, name)):
                raise FileNotFoundError(f"checkpoint {where} holds no {name!r} engine (was it written by a run without "
                                        f"a {name}?); resume with the original algorithm or start a new output_dir")
            other_path, other_client = other.load_checkpoint(where, tag=name, **kwargs)
            if other_path is None:
                raise FileNotFoundError(f"DeepSpeed could not load the {name!r} engine of checkpoint {where}")
            state["companions"][name] = (other_client or {}).get("dsrl", {})
    rank_file = os.path.join(load_dir, tag, f"dsrl_rank{_rank()}.pt")
    rank_state = torch.load(rank_file, weights_only=False) if os.path.isfile(rank_file) else None
    return tag, state, rank_state
