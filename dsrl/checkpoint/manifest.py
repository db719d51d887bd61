"""MANIFEST.json: what a committed checkpoint holds (every file, its size, optionally its CRC-32), and
the layout each engine was saved with (data-parallel size, ZeRO stage), written at commit.

Invariants:
- the manifest is written (atomically) before the ``COMPLETE`` marker, so every complete checkpoint
  written by this version has one; besides the files and layouts it records what the model was
  (``"model"``: its LoRA adapters, :mod:`dsrl.checkpoint.adapters`); it lists every file of the tag
  directory, sub-directories included
  (a second engine saved under ``<tag>/<name>/`` is covered without change), except the commit files
  themselves and the ``universal/`` conversion caches that a resume may add later;
- :func:`problems` names each file that is missing, has another size or another checksum; an empty
  list means the files are as committed;
- both :func:`collect` and :func:`problems` share the reading among the ranks (file ``i`` is read by
  rank ``i mod world``) and return the same result on every rank.
"""

from __future__ import annotations

import json
import os
import zlib
from typing import Any

from dsrl.checkpoint.atomic_io import atomic_write_bytes
from dsrl.core import collectives

MANIFEST = "MANIFEST.json"
FORMAT = 1
UNIVERSAL_DIR = "universal"  # DeepSpeed universal-checkpoint conversions live here (dsrl.checkpoint.elastic)
_SKIP = {MANIFEST, "COMPLETE"}
_CHUNK = 8 << 20


def crc32(path: str) -> str:
    """The file's CRC-32 as 8 hex digits (zlib's, ~1.8 GB/s on one core)."""
    value = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            value = zlib.crc32(chunk, value)
    return f"{value:08x}"


def list_files(root: str) -> list[str]:
    """Relative paths of the checkpoint's files under ``root``, sorted (commit files, conversion caches
    and temp files left out)."""
    out = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d != UNIVERSAL_DIR and ".tmp." not in d)
        rel = os.path.relpath(folder, root)
        for name in files:
            if ".tmp." in name or (rel == "." and name in _SKIP):
                continue
            out.append(name if rel == "." else os.path.join(rel, name))
    return sorted(out)


def _describe(root: str, names: list[str], checksums: bool) -> dict[str, dict[str, Any]]:
    out = {}
    for name in names:
        path = os.path.join(root, name)
        entry: dict[str, Any] = {"size": os.path.getsize(path)}
        if checksums:
            entry["crc32"] = crc32(path)
        out[name] = entry
    return out


def _my_share(names: list[str]) -> list[str]:
    r, w = collectives.rank(), collectives.world()
    return [n for i, n in enumerate(names) if i % w == r]


def collect(root: str, checksums: bool) -> dict[str, dict[str, Any]]:
    """``{relative path: {"size": n, "crc32": hex}}`` of every file under ``root`` (collective)."""
    names = collectives.broadcast(list_files(root) if collectives.rank() == 0 else None)
    error = None
    try:
        mine = _describe(root, _my_share(names), checksums)
    except OSError as e:
        mine, error = {}, f"{e.filename}: {e.strerror}"
    parts = collectives.all_gather((mine, error))
    errors = [err for _, err in parts if err]
    if errors:
        raise OSError(f"cannot read back the checkpoint files to record them: {errors[0]}")
    return {k: v for part, _ in parts for k, v in part.items()}


def write(root: str, files: dict[str, dict[str, Any]], engines: dict[str, dict[str, Any]], tag: str,
          model: dict[str, Any] | None = None) -> None:
    """Write ``root/MANIFEST.json`` atomically (rank 0); ``model`` is what the run's model was (its LoRA adapters,
    :mod:`dsrl.checkpoint.adapters`), when given."""
    doc = {"format": FORMAT, "tag": tag, "engines": engines, "files": files}
    if model is not None:
        doc["model"] = model
    atomic_write_bytes(os.path.join(root, MANIFEST), json.dumps(doc, indent=1, sort_keys=True).encode())


def read(root: str) -> dict[str, Any] | None:
    """The manifest of checkpoint ``root``; None when it has none (written before manifests existed).

    Raises ValueError naming the file when it exists but is not a manifest.
    """
    path = os.path.join(root, MANIFEST)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, "rb") as f:
            doc = json.loads(f.read().decode("utf-8"))
        if not isinstance(doc, dict) or not isinstance(doc.get("files"), dict):
            raise ValueError("no 'files' table")
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is damaged ({e})") from None
    return doc


def _check(root: str, names: list[str], files: dict[str, dict[str, Any]], checksums: bool) -> list[str]:
    out = []
    for name in names:
        want = files[name]
        path = os.path.join(root, name)
        if not os.path.isfile(path):
            out.append(f"{path} is missing")
            continue
        size = os.path.getsize(path)
        if size != want.get("size"):
            out.append(f"{path} has {size} bytes where {want.get('size')} were written")
        elif checksums and "crc32" in want and crc32(path) != want["crc32"]:
            out.append(f"{path} does not match its recorded CRC-32 (its content changed after the commit)")
    return out


def problems(root: str, checksums: bool = True) -> list[str]:
    """What is wrong with checkpoint ``root`` against its manifest: one sentence per damaged file
    (collective; the same list on every rank). A checkpoint without a manifest has none to check."""
    try:
        doc = read(root) if collectives.rank() == 0 else None
        err = None
    except ValueError as e:
        doc, err = None, str(e)
    doc, err = collectives.broadcast((doc, err))
    if err:
        return [err]
    if doc is None:
        return []
    names = sorted(doc["files"])
    mine = _check(root, _my_share(names), doc["files"], checksums)
    return sorted(p for part in collectives.all_gather(mine) for p in part)


def engine_layout(root: str, engine_dir: str = ".") -> dict[str, Any] | None:
    """The layout the engine in ``root/engine_dir`` was saved with (``data_parallel_size``,
    ``zero_stage``, ``world_size``, ...), or None without a manifest."""
    doc = read(root)
    if doc is None:
        return None
    return (doc.get("engines") or {}).get(engine_dir)
