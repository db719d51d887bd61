"""Writes that readers see whole or not at all: temp file, fsync, ``os.replace``, fsync of the directory.

Shared by the checkpoint commit (:mod:`dsrl.checkpoint.commit`) and its manifest (:mod:`dsrl.checkpoint.manifest`).
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch


def fsync_path(path: str) -> None:
    """fsync ``path`` (a file or a directory) where the platform allows; errors are ignored."""
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
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_path(os.path.dirname(os.path.abspath(path)))


def atomic_torch_save(obj: Any, path: str) -> None:
    """``torch.save`` to ``path`` so that readers see the old file or the whole new one."""
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        torch.save(obj, tmp)
        fsync_path(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
