"""Resuming a checkpoint on a different number of data-parallel ranks (elastic resume).

DeepSpeed refuses to load ZeRO-1/2/3 optimizer partitions written by another data-parallel size.
Its universal checkpoint format is partition-free: ``deepspeed.checkpoint.ds_to_universal`` turns a
checkpoint into one file per parameter (fp32 weights and optimizer moments), and an engine built
with ``"checkpoint": {"load_universal": true}`` re-partitions it for its own ranks.

Choice (measured in docs/reliability.md): convert **on the fly**, at the first resume on a different
size, not at every save. A conversion reads and rewrites the whole checkpoint once (it costs about as
much as a save, on rank 0 only), while most resumes use the same size; converting at save would put that
cost and a second copy of every checkpoint on every save. The conversion goes to ``<engine dir>/universal``
(atomically: a temporary directory renamed when complete) and is reused by later resumes of the same
checkpoint; it is deleted with its checkpoint.

Invariants of :func:`load`: the engine's parameters, optimizer moments and step counters are those
of the checkpoint (bit-identical; DeepSpeed re-partitions them); dsrl's client state (LR schedule,
step counters, prompt cursor) is restored as on any resume; a ZeRO-0 checkpoint, which is not
partitioned, loads directly. Per-rank files (RNG streams) belong to the old ranks and are not used.
Every change of size is announced in one log line. Changes DeepSpeed cannot convert (tensor or
sequence parallel size, the ZeRO stage) are refused with a sentence before anything is loaded.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass
from typing import Any

from dsrl.checkpoint import commit as ckpt
from dsrl.checkpoint import manifest
from dsrl.config import ConfigError
from dsrl.core import collectives, timeouts
from dsrl.core.errors import CheckpointError

log = logging.getLogger("dsrl.checkpoint.elastic")
UNIVERSAL = manifest.UNIVERSAL_DIR
_OPTIM_FILE = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")


@dataclass(frozen=True)
class Layout:
    """How an engine's state is split: what a checkpoint records and what a resume must match."""

    zero_stage: int  # -1: unknown (a checkpoint from before manifests)
    zero_partitions: int  # DeepSpeed's (sequence-)data-parallel size: ZeRO shards the state over it
    data_parallel_size: int  # D of the plan
    tensor_parallel_size: int = 1  # 0: unknown
    sequence_parallel_size: int = 1  # 0: unknown
    world_size: int = 1

    def to_dict(self) -> dict[str, int]:
        return dict(self.__dict__)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Layout:
        return cls(**{k: int(d[k]) for k in cls.__dataclass_fields__ if k in d})


def engine_layout(rl: Any) -> Layout:
    """The layout of a running :class:`dsrl.backends.deepspeed.engine.RLEngine`."""
    engine, view = rl.engine, rl.view
    return Layout(zero_stage=int(engine.zero_optimization_stage()),
                  zero_partitions=int(getattr(engine, "seq_dp_world_size", view.data_parallel_size)),
                  data_parallel_size=view.data_parallel_size, tensor_parallel_size=view.tensor_parallel_size,
                  sequence_parallel_size=view.sequence_parallel_size, world_size=collectives.world())


def saved_layout(engine_dir: str, root: str | None = None, subdir: str = ".") -> Layout | None:
    """The layout a checkpoint was written with: from its manifest, else (older checkpoints) the partition
    count from the names of its ZeRO optimizer files, the rest unknown; None when neither tells."""
    rec = manifest.engine_layout(root or engine_dir, subdir) if os.path.isdir(root or engine_dir) else None
    if rec:
        return Layout.from_dict(rec)
    ranks = {int(m.group(1)) for f in os.listdir(engine_dir) if (m := _OPTIM_FILE.match(f))}
    if not ranks:
        return None
    return Layout(zero_stage=-1, zero_partitions=len(ranks), data_parallel_size=len(ranks), tensor_parallel_size=0,
                  sequence_parallel_size=0)


def check_compatible(saved: Layout, now: Layout, where: str) -> None:
    """Raise ConfigError for a change no resume path can carry (module doc)."""
    for name, what in (("tensor_parallel_size", "ds_config tensor_parallel.autotp_size"),
                       ("sequence_parallel_size", "ds_config sequence_parallel_size")):
        if getattr(saved, name) and getattr(saved, name) != getattr(now, name):
            raise ConfigError(
                f"resume: {where} was written with {name} = {getattr(saved, name)}, this run has "
                f"{getattr(now, name)}. Fix: resume with the same {what} (only the data-parallel size may change).")
    if saved.zero_stage >= 0 and saved.zero_stage != now.zero_stage:
        raise ConfigError(
            f"resume: {where} was written with ZeRO stage {saved.zero_stage}, this run uses stage {now.zero_stage}. "
            f"Fix: resume with zero_optimization.stage = {saved.zero_stage}.")


def needs_universal(saved: Layout, now: Layout) -> bool:
    """Whether the optimizer partitions must be rebuilt (ZeRO 1-3 on another partition count)."""
    return now.zero_stage > 0 and saved.zero_partitions != now.zero_partitions


def convert_to_universal(engine_dir: str, out: str | None = None) -> tuple[str, float]:
    """``out`` (default ``engine_dir/universal``) from the DeepSpeed checkpoint in ``engine_dir``, made once
    and atomically; returns its path and the seconds spent (0 when it existed). Runs in this process only."""
    out = out or os.path.join(engine_dir, UNIVERSAL)
    if os.path.isdir(out):
        return out, 0.0
    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    tmp = f"{out}.tmp.{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    with _engine_files_only(engine_dir) as source:
        return _convert(ds_to_universal, engine_dir, source, tmp, out)


@contextlib.contextmanager
def _engine_files_only(engine_dir: str):
    """``engine_dir`` itself, or, when it holds sub-directories (a companion engine such as the critic,
    ``hf/``), a temporary directory of links to its own files only: DeepSpeed's converter collects
    model-state files recursively and would count the companion's as another model-parallel rank."""
    if not any(os.path.isdir(os.path.join(engine_dir, n)) for n in os.listdir(engine_dir)):
        yield engine_dir
        return
    stage = tempfile.mkdtemp(prefix="dsrl-engine-files-")
    try:
        for name in os.listdir(engine_dir):
            path = os.path.abspath(os.path.join(engine_dir, name))
            if os.path.isfile(path):
                os.symlink(path, os.path.join(stage, name))
        yield stage
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def _convert(ds_to_universal: Any, engine_dir: str, source: str, tmp: str, out: str) -> tuple[str, float]:
    args = argparse.Namespace(input_folder=source, output_folder=tmp, num_extract_workers=1,
                              num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=True)
    chatter = io.StringIO()
    t0 = time.perf_counter()
    try:
        with contextlib.redirect_stdout(chatter), contextlib.redirect_stderr(chatter):
            ds_to_universal(args)
    except Exception as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(
            f"converting {engine_dir} to DeepSpeed's universal format for an elastic resume failed: "
            f"{type(e).__name__}: {e}. Output: {chatter.getvalue()[-800:]}") from e
    finally:
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(os.path.dirname(tmp), "latest_universal"))  # ds_to_universal writes it beside
    os.rename(tmp, out)
    return out, time.perf_counter() - t0


@contextlib.contextmanager
def _universal_loading(engine: Any):
    cfg = engine._config
    before = cfg.load_universal_checkpoint
    cfg.load_universal_checkpoint = True
    try:
        yield
    finally:
        cfg.load_universal_checkpoint = before


@contextlib.contextmanager
def _as_sentence(what: str):
    """DeepSpeed's load failures (a file it cannot parse, a missing one) as one sentence naming ``what``."""
    try:
        yield
    except (CheckpointError, ConfigError):
        raise
    except Exception as e:
        raise CheckpointError(f"could not load checkpoint {what}: {type(e).__name__}: {str(e)[:300]}. Fix: resume from "
                              "an earlier checkpoint (--resume <its directory>).") from e


def _deepspeed_load(engine: Any, load_dir: str, tag: str) -> dict:
    with _as_sentence(os.path.join(load_dir, tag)):
        path, client = engine.load_checkpoint(load_dir, tag=tag)
    if path is None:
        raise CheckpointError(f"DeepSpeed found no checkpoint to load in {os.path.join(load_dir, tag)}")
    return client or {}


def load(rl: Any, ckpt_dir: str, tag: str, saved: Layout | None, convert_timeout_s: float = 4 * 3600.0,
         subdir: str | None = None) -> tuple[dict, dict | None, str | None]:
    """Load checkpoint ``ckpt_dir/tag`` (its engine in ``subdir``, if given) into ``rl``, converting
    through the universal format when the partition count changed (collective).

    Returns ``(dsrl_state, rank_state, notice)``: the notice is the one-line announcement of a changed
    layout (None when it is unchanged), and ``rank_state`` is None after a change.
    """
    now = engine_layout(rl)
    where = os.path.join(ckpt_dir, tag)
    engine_dir = where if subdir is None else os.path.join(where, subdir)
    parent, name = os.path.split(engine_dir)
    if saved is not None:
        check_compatible(saved, now, where)
    if saved is None or (saved.zero_partitions, saved.data_parallel_size) == (now.zero_partitions,
                                                                              now.data_parallel_size):
        if subdir is None:
            with _as_sentence(where):
                _, state, rank_state = ckpt.load(rl.engine, ckpt_dir, tag)
            return state, rank_state, None
        return _deepspeed_load(rl.engine, parent, name).get("dsrl", {}), None, None
    if needs_universal(saved, now):
        with timeouts.patience(convert_timeout_s):
            universal, seconds = collectives.on_rank0(lambda: convert_to_universal(engine_dir))
        with _universal_loading(rl.engine):
            client = _deepspeed_load(rl.engine, engine_dir, UNIVERSAL)
        how = f"re-partitioned through DeepSpeed's universal checkpoint ({universal}, converted in {seconds:.1f} s)"
    else:
        client = _deepspeed_load(rl.engine, parent, name)
        how = "loaded directly (ZeRO-0 keeps whole optimizer states)"
    D, B = now.data_parallel_size, rl.plan.mini_batch_size
    stage = saved.zero_stage if saved.zero_stage >= 0 else now.zero_stage
    notice = (f"elastic resume: {where} was written on {saved.data_parallel_size} data-parallel rank(s) "
              f"(ZeRO-{stage}), this run has {D}; {how}. The plan is rebuilt for D = {D} ({B} sequences per "
              f"optimizer step, {B // max(D, 1)} per rank); the prompt cursor, optimizer step and LR schedule "
              "continue; per-rank RNG streams restart from the run seed.")
    return client.get("dsrl", {}), None, notice
