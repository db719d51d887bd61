"""Atomic checkpoints around DeepSpeed's ``save_checkpoint`` / ``load_checkpoint``.

DeepSpeed writes ``latest`` from rank 0 before the other ranks have finished their shards, with a
plain ``open('w')``. dsrl instead commits a checkpoint in this order (:func:`save` composes the
three steps; a trainer with several engines calls :func:`write_engine` once per engine, each into
its own sub-directory, between :func:`begin` and :func:`commit`):

1. :func:`begin`: rank 0 removes an earlier directory of the same tag (its ``COMPLETE`` marker
   first, so it can never be taken for a complete checkpoint while it is replaced);
2. :func:`write_engine`: every rank ``engine.save_checkpoint(dir, tag, client_state={"dsrl": ...},
   save_latest=False)``; :func:`write_rank_state`: every rank its own ``dsrl_rank{r}.pt`` (RNG
   streams, data cursors) via temp file + ``os.replace``, fsynced;
3. :func:`commit`: the ranks record every file's size and CRC-32 in ``MANIFEST.json``
   (:mod:`dsrl.checkpoint.manifest`), then rank 0 writes the ``COMPLETE`` marker, then ``latest`` via temp file +
   ``os.replace``, fsyncing each and the directory.

So ``latest`` only ever names a tag whose every shard, manifest and marker exist: a crash (even kill
-9) at any point leaves the previous complete checkpoint as the one a resume finds. A write that fails
on any rank (a full disk, a read-only directory) is agreed on by every rank at the end of its step,
the partial tag is removed, and :class:`dsrl.core.errors.CheckpointError` names the path, the cause and
the checkpoint that stays ``latest``.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import shutil
import signal
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from dsrl.checkpoint import manifest
from dsrl.checkpoint.atomic_io import atomic_torch_save, atomic_write_bytes, fsync_path
from dsrl.core import collectives
from dsrl.core.errors import CheckpointError

COMPLETE = "COMPLETE"
# Fault injection (tests): rank 0 kills itself with SIGKILL mid-save of the tag named by this variable.
FAULT_KILL_ENV = "DSRL_FAULT_KILL_DURING_SAVE"
LATEST = "latest"
_SAFE_TAG = re.compile(r"^[A-Za-z0-9._-]{1,200}$")
log = logging.getLogger("dsrl.checkpoint.commit")


def _rank() -> int:
    return collectives.rank()


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


def read_latest(save_dir: str) -> tuple[str | None, str | None]:
    """``(tag, problem)``: the complete tag that ``save_dir/latest`` names, or a sentence saying why it
    names none (garbage, a missing or incomplete tag). ``(None, None)`` when there is no ``latest``."""
    path = os.path.join(save_dir, LATEST)
    if not os.path.isfile(path):
        return None, None
    with open(path, "rb") as f:
        raw = f.read(512)
    text = raw.decode("utf-8", errors="replace").strip()
    shown = text[:40] + ("..." if len(text) > 40 else "")
    if not _SAFE_TAG.match(text) or text in (".", ".."):
        return None, f"{path} holds {shown!r}, which is not a checkpoint tag"
    if not os.path.isdir(os.path.join(save_dir, text)):
        return None, f"{path} names {text!r}, but {os.path.join(save_dir, text)} does not exist"
    if not is_complete(save_dir, text):
        return None, f"{path} names {text!r}, which has no {COMPLETE} marker (an interrupted save)"
    return text, None


def candidate_tags(save_dir: str) -> tuple[list[str], str | None]:
    """Complete tags newest first (the one ``latest`` names first), and the problem with ``latest`` if any."""
    tag, problem = read_latest(save_dir)
    tags = list(reversed(complete_tags(save_dir)))
    if tag is not None:
        tags = [tag] + [t for t in tags if t != tag]
    return tags, problem


def latest_complete_tag(save_dir: str) -> str | None:
    """The tag ``latest`` names if that checkpoint is complete, else the newest complete tag (a
    ``latest`` that names none is reported once in the log)."""
    tags, problem = candidate_tags(save_dir)
    if problem and _rank() == 0:
        log.warning("%s; using the newest complete checkpoint, %s", problem, tags[0] if tags else "none")
    return tags[0] if tags else None


# --------------------------------------------------------------------------------------------
# Saving


def _disk_full(folder: str) -> bool:
    """Whether ``folder``'s file system refuses a 1 MiB write with ENOSPC (a direct test: torch's writer
    reports a short write as "unexpected pos", without the errno)."""
    probe = os.path.join(folder, f".dsrl-space-probe.{os.getpid()}")
    try:
        with open(probe, "wb") as f:
            f.write(b"\0" * (1 << 20))
            f.flush()
            os.fsync(f.fileno())
        return False
    except OSError as e:
        return e.errno in (errno.ENOSPC, errno.EDQUOT)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(probe)


def _describe_failure(exc: BaseException, path: str) -> str:
    """Why a write under ``path`` failed, in words (a full disk is told apart from other errors)."""
    chain, e = [], exc
    while e is not None and len(chain) < 8:
        chain.append(e)
        e = e.__cause__ or e.__context__
    codes = {getattr(x, "errno", None) for x in chain}
    folder = path if os.path.isdir(path) else os.path.dirname(path)
    try:
        usage = shutil.disk_usage(folder)
        free = f"{usage.free / 2**20:.1f} MiB free of {usage.total / 2**20:.1f} MiB"
    except OSError:
        free = "free space unknown"
    if codes & {errno.ENOSPC, errno.EDQUOT} or _disk_full(folder):
        return f"no space left on the device ({free})"
    if codes & {errno.EACCES, errno.EPERM, errno.EROFS}:
        return f"the directory is not writable ({type(exc).__name__}: {exc})"
    return f"{type(exc).__name__}: {str(exc)[:300]}"


def _agree(error: str | None, save_dir: str, tag: str, previous: str | None) -> None:
    """Every rank learns whether any rank failed its part of the save; if one did, rank 0 removes the
    partial tag and every rank raises the same CheckpointError."""
    if not collectives.any_rank(error is not None):
        return
    errors = collectives.all_gather(error)
    first = next((r, e) for r, e in enumerate(errors) if e)
    path = os.path.join(save_dir, tag)
    if _rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
    kept = f"the previous checkpoint {os.path.join(save_dir, previous)} stays latest" if previous else \
        "no earlier checkpoint exists"
    if first[1].startswith("no space"):
        fix = "free space on that file system (or point dsrl.run.output_dir at a larger disk)"
    elif first[1].startswith("the directory is not writable"):
        fix = f"make {save_dir} writable (or point dsrl.run.output_dir elsewhere)"
    else:
        fix = "see the cause above"
    raise CheckpointError(
        f"saving checkpoint {tag} to {path} failed on rank {first[0]}: {first[1]}. Nothing was committed: {kept} "
        f"(the partial {tag} was removed). Fix: {fix}, then continue with --resume auto.", agreed=True)


def begin(save_dir: str, tag: str) -> str | None:
    """Step 1 (collective): make room for ``tag``; returns the tag that is ``latest`` now."""
    error, previous = None, None
    if _rank() == 0:
        try:
            previous = read_latest(save_dir)[0]
            os.makedirs(save_dir, exist_ok=True)
            path = os.path.join(save_dir, tag)
            if os.path.isdir(path):
                marker = os.path.join(path, COMPLETE)
                if os.path.exists(marker):
                    os.unlink(marker)  # never complete while it is being replaced
                    fsync_path(path)
                shutil.rmtree(path)
        except OSError as e:
            error = _describe_failure(e, save_dir)
    previous = collectives.broadcast(previous)
    _agree(error, save_dir, tag, previous)
    return previous


def write_engine(engine: Any, save_dir: str, tag: str, dsrl_state: dict[str, Any], previous: str | None,
                 subdir: str | None = None) -> str:
    """Step 2 (collective): the engine's DeepSpeed checkpoint in ``save_dir/tag`` (or in
    ``save_dir/tag/subdir`` for a second engine), with ``dsrl_state`` as its client state."""
    base, name = (save_dir, tag) if subdir is None else (os.path.join(save_dir, tag), subdir)
    error = None
    try:
        engine.save_checkpoint(base, tag=name, client_state={"dsrl": dsrl_state}, save_latest=False)
    except Exception as e:  # a failed torch.save (RuntimeError) or an OSError
        error = _describe_failure(e, os.path.join(base, name))
        if collectives.initialized():
            dist.barrier()  # stands in for the closing barrier of save_checkpoint that this rank skipped
    _agree(error, save_dir, tag, previous)
    return os.path.join(base, name)


def write_rank_state(save_dir: str, tag: str, rank_state: dict[str, Any] | None, previous: str | None) -> None:
    """Step 2b (collective): this rank's own state file, then fsync of every file of the tag."""
    path = os.path.join(save_dir, tag)
    error = None
    try:
        if rank_state is not None:
            atomic_torch_save(rank_state, os.path.join(path, f"dsrl_rank{_rank()}.pt"))
        for folder, _, files in os.walk(path):
            for name in files:
                fsync_path(os.path.join(folder, name))
    except Exception as e:
        error = _describe_failure(e, path)
    if _rank() == 0 and os.environ.get(FAULT_KILL_ENV) == tag:
        os.kill(os.getpid(), signal.SIGKILL)  # fault injection for tests: die with shards written, uncommitted
    _agree(error, save_dir, tag, previous)


def commit(save_dir: str, tag: str, previous: str | None, engines: dict[str, dict[str, Any]],
           checksums: bool = True, keep_last: int | None = None,
           before_commit: Callable[[str], None] | None = None, model: dict[str, Any] | None = None) -> str:
    """Step 3 (collective): ``before_commit(tag_dir)`` on rank 0 (small extra files), the manifest of
    every file (with ``model``, what the model was), then the ``COMPLETE`` marker and ``latest``; prune to
    ``keep_last``."""
    path = os.path.join(save_dir, tag)
    error = None
    if _rank() == 0 and before_commit is not None:
        try:
            before_commit(path)
        except Exception as e:
            error = _describe_failure(e, path)
    _agree(error, save_dir, tag, previous)
    try:
        files, error = manifest.collect(path, checksums), None
    except OSError as e:
        files, error = {}, _describe_failure(e, path)
    _agree(error, save_dir, tag, previous)
    if _rank() == 0:
        try:
            manifest.write(path, files, engines, tag, model=model)
            atomic_write_bytes(os.path.join(path, COMPLETE), tag.encode())
            atomic_write_bytes(os.path.join(save_dir, LATEST), tag.encode())
        except Exception as e:
            error = _describe_failure(e, path)
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(path, COMPLETE))
            if previous and read_latest(save_dir)[0] != previous:
                with contextlib.suppress(OSError):
                    atomic_write_bytes(os.path.join(save_dir, LATEST), previous.encode())
        if error is None and keep_last:
            prune(save_dir, keep_last)
    _agree(error, save_dir, tag, previous)
    return path


def save(
    engine: Any,
    save_dir: str,
    tag: str,
    dsrl_state: dict[str, Any],
    rank_state: dict[str, Any] | None = None,
    keep_last: int | None = None,
    *,
    layout: dict[str, Any] | None = None,
    checksums: bool = True,
    before_commit: Callable[[str], None] | None = None,
    companions: dict[str, tuple[Any, dict[str, Any], dict[str, Any]]] | None = None,
    model: dict[str, Any] | None = None,
) -> str:
    """Save a DeepSpeed engine checkpoint plus dsrl's state, committed atomically (module doc).

    ``dsrl_state`` (rank 0's copy is kept under ZeRO-0/1/2) goes into DeepSpeed's client state
    under the single key ``"dsrl"``; ``rank_state`` is written per rank to ``dsrl_rank{r}.pt``;
    ``layout`` (the engine's data-parallel size, ZeRO stage, ...) is recorded in the manifest;
    ``companions`` maps a name to ``(engine, its dsrl state, its layout)`` for a second engine (the
    critic beside the policy), written to ``tag/<name>/`` in the same commit; ``model`` (what the model was: its
    LoRA adapters) is recorded in the manifest.
    Returns the checkpoint directory. Must be called on every rank.
    """
    previous = begin(save_dir, tag)
    write_engine(engine, save_dir, tag, dsrl_state, previous)
    layouts = {".": layout or {}}
    for name, (other, other_state, other_layout) in (companions or {}).items():
        write_engine(other, save_dir, tag, other_state, previous, subdir=name)
        layouts[name] = other_layout
    write_rank_state(save_dir, tag, rank_state, previous)
    return commit(save_dir, tag, previous, layouts, checksums=checksums, keep_last=keep_last,
                  before_commit=before_commit, model=model)


def prune(save_dir: str, keep_last: int) -> None:
    """Delete all but the newest ``keep_last`` complete checkpoints (rank 0 only)."""
    current = read_latest(save_dir)[0]
    tags = complete_tags(save_dir)
    for tag in tags[:-keep_last]:
        if tag != current:
            shutil.rmtree(os.path.join(save_dir, tag), ignore_errors=True)


# --------------------------------------------------------------------------------------------
# Loading


def load(engine: Any, load_dir: str, tag: str | None = None, rank_state: bool = True,
         **kwargs: Any) -> tuple[str | None, dict, dict | None]:
    """Load the newest complete checkpoint (or ``tag``) into ``engine``.

    Returns ``(tag, dsrl_state, rank_state)``; ``(None, {}, None)`` when there is none. ``kwargs`` go to
    ``engine.load_checkpoint``; with ``rank_state=False`` the per-rank file is not read.
    """
    tag = tag or latest_complete_tag(load_dir)
    if tag is None:
        return None, {}, None
    if not is_complete(load_dir, tag):
        raise CheckpointError(f"checkpoint {os.path.join(load_dir, tag)} is incomplete (no {COMPLETE} marker): an "
                              "interrupted save. Fix: resume from an earlier checkpoint (--resume auto finds it).")
    path, client_state = engine.load_checkpoint(load_dir, tag=tag, **kwargs)
    if path is None:
        raise CheckpointError(f"DeepSpeed could not load checkpoint {os.path.join(load_dir, tag)}")
    rank_file = os.path.join(load_dir, tag, f"dsrl_rank{_rank()}.pt")
    state = torch.load(rank_file, weights_only=False) if rank_state and os.path.isfile(rank_file) else None
    return tag, (client_state or {}).get("dsrl", {}), state
