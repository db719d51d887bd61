"""The run's output directory: what a run continues from, who owns the directory, whether it can hold
the run. Everything here happens before any rollout (docs/reliability.md).

Invariants kept by :func:`open_run_dir` (collective; every rank gets the same outcome or the same error):

- ``--resume`` (``run.resume``) accepts ``auto``, ``never``, a run's output directory, its
  ``checkpoints/`` directory or one checkpoint (tag) directory;
- nothing a run wrote is truncated, replaced or moved back unless the user said so: a fresh start in an
  output directory that holds a run's checkpoints or metrics, a resume from another run into it, or a
  resume from an older checkpoint of it than its newest, are refused (exit status 2) with a message
  naming ``--resume auto``, a new ``--dsrl.run.output_dir`` and ``--overwrite`` (``run.overwrite``);
  ``--overwrite`` with ``--resume auto`` (the default) starts over, never continues;
- a checkpoint is used only after its manifest checks out: ``auto`` falls back from a damaged newest
  checkpoint to the previous complete one, saying which file is damaged (the damaged one is renamed
  ``<tag>.damaged`` and kept); an explicitly named checkpoint that is damaged is an error naming the file;
- the directory is locked by rank 0 of the job that runs in it (:class:`OutputLock`);
- the output and checkpoint directories exist, are directories and are writable, before any work.
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass, field
from typing import Any

from dsrl.checkpoint import adapters, manifest
from dsrl.checkpoint import commit as ckpt
from dsrl.checkpoint.output_lock import OutputLock
from dsrl.config import ConfigError
from dsrl.core import collectives

CHECKPOINTS = "checkpoints"
METRICS = "metrics.jsonl"
FINAL_MODEL = "final_model"
DAMAGED_SUFFIX = ".damaged"
log = logging.getLogger("dsrl.checkpoint.run_dir")
_WAYS_FORWARD = ("Fix: continue it with --resume auto, start elsewhere with a new --dsrl.run.output_dir, or "
                 "discard it with --overwrite (--dsrl.run.overwrite true).")


@dataclass
class ResumePoint:
    """The checkpoint a run continues from (``ckpt_dir/tag``), chosen and verified on every rank."""

    ckpt_dir: str
    tag: str
    explicit: bool
    layout: dict[str, Any] | None = None
    lora: dict[str, Any] | str | None = adapters.NOT_KNOWN  # the adapters it was trained with (checkpoint.adapters)

    @property
    def path(self) -> str:
        return os.path.join(self.ckpt_dir, self.tag)


@dataclass
class RunDir:
    output_dir: str
    ckpt_dir: str
    resume: ResumePoint | None
    lock: OutputLock | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def metrics_path(self) -> str:
        return os.path.join(self.output_dir, METRICS)

    def check_adapters(self, lora: Any) -> None:
        """Refuse to continue a checkpoint trained with other LoRA adapters than this run's ``dsrl.model.lora``
        (:mod:`dsrl.checkpoint.adapters`); every rank raises the same ConfigError (the record was broadcast)."""
        if self.resume is None:
            return
        try:
            adapters.check_resume(self.resume.path, self.resume.lora, lora)
        except ConfigError as e:
            e.agreed = True
            raise

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None


# --------------------------------------------------------------------------------------------
# rank 0: kinds, writability, lock


def _probe_writable(folder: str, field_name: str) -> None:
    probe = os.path.join(folder, f".dsrl-write-test.{os.getpid()}")
    try:
        with open(probe, "wb") as f:
            f.write(b"x")
        os.unlink(probe)
    except OSError as e:
        raise ConfigError(f"{field_name}: {folder} is not writable ({e.strerror}); checkpoints and metrics could not "
                          "be saved. Fix: make it writable or point dsrl.run.output_dir at a writable directory."
                          ) from None


def _make_writable_dir(folder: str, field_name: str) -> None:
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"{field_name}: cannot create {folder} ({e.strerror}). Fix: choose a path you can "
                          "write.") from None
    _probe_writable(folder, field_name)


def prepare_directories(output_dir: str) -> None:
    """Create the output and checkpoint directories; refuse files in their place and unwritable ones."""
    field_name = f"dsrl.run.output_dir = {output_dir!r}"
    if os.path.exists(output_dir) and not os.path.isdir(output_dir):
        raise ConfigError(f"{field_name} is an existing file, not a directory. Fix: choose a directory path "
                          "(it is created if missing).")
    _make_writable_dir(output_dir, field_name)
    ckpt_dir = os.path.join(output_dir, CHECKPOINTS)
    if os.path.exists(ckpt_dir) and not os.path.isdir(ckpt_dir):
        raise ConfigError(f"{field_name}: {ckpt_dir} is a file, but checkpoints go into a directory of that name. "
                          "Fix: move the file away or choose another output_dir.")
    metrics = os.path.join(output_dir, METRICS)
    if os.path.isdir(metrics):
        raise ConfigError(f"{field_name}: {metrics} is a directory, but the metrics go into a file of that name. "
                          "Fix: move it away or choose another output_dir.")
    _make_writable_dir(ckpt_dir, f"{field_name} (its checkpoints/ directory)")


# --------------------------------------------------------------------------------------------
# resume sources


def _looks_like_tag(path: str) -> bool:
    if os.path.isfile(os.path.join(path, ckpt.COMPLETE)) or os.path.isfile(os.path.join(path, manifest.MANIFEST)):
        return True
    return any(n.endswith("model_states.pt") for n in os.listdir(path))


def classify(resume: str, own_ckpt_dir: str, what: str = "dsrl.run.resume") -> tuple[str, list[str], bool, str | None]:
    """``(ckpt_dir, candidate tags newest first, explicit, note about latest)`` for ``run.resume`` (errors
    name ``what``: the field, or the command that asked)."""
    if resume == "never":
        return own_ckpt_dir, [], False, None
    if resume == "auto":
        tags, problem = ckpt.candidate_tags(own_ckpt_dir)
        return own_ckpt_dir, tags, False, problem
    field_name = f"{what} = {resume!r}" if what.startswith("dsrl.") else f"{what} {resume}"
    if not os.path.isdir(resume):
        modes = ", or use 'auto' or 'never'" if what == "dsrl.run.resume" else ""
        raise ConfigError(f"{field_name}: no such directory. Fix: give a run's output directory, its checkpoints/ "
                          f"directory or one checkpoint directory{modes}.")
    path = os.path.abspath(resume)
    if _looks_like_tag(path):
        parent, tag = os.path.split(path.rstrip(os.sep))
        if not ckpt.is_complete(parent, tag):
            raise ConfigError(f"{field_name}: {path} has no {ckpt.COMPLETE} marker, so its save never finished "
                              f"(a crash or a full disk). Fix: resume from an earlier checkpoint: "
                              f"{_previous_hint(parent, tag)}")
        return parent, [tag], True, None
    folder = path if os.path.isfile(os.path.join(path, ckpt.LATEST)) or ckpt.complete_tags(path) else \
        os.path.join(path, CHECKPOINTS)
    tags, problem = ckpt.candidate_tags(folder)
    if not tags:
        raise ConfigError(f"{field_name}: {path} holds no complete checkpoint (looked in {folder}). Fix: give a run's "
                          "output directory, its checkpoints/ directory or one checkpoint directory.")
    return folder, tags, True, problem


def _previous_hint(ckpt_dir: str, tag: str) -> str:
    older = [t for t in reversed(ckpt.complete_tags(ckpt_dir)) if ckpt._tag_order(t) < ckpt._tag_order(tag)]
    return f"--resume {os.path.join(ckpt_dir, older[0])}" if older else "there is none; start over with --overwrite"


def choose(ckpt_dir: str, tags: list[str], explicit: bool, checksums: bool,
           what: str = "dsrl.run.resume") -> tuple[ResumePoint | None, list[str]]:
    """The first candidate whose files match its manifest (collective), and the notes on damaged ones.

    An explicit source is used as named or not at all (ConfigError naming the damaged file).
    """
    notes: list[str] = []
    for i, tag in enumerate(tags):
        root = os.path.join(ckpt_dir, tag)
        bad = manifest.problems(root, checksums)
        if not bad:
            layout, lora = collectives.broadcast((manifest.engine_layout(root), adapters.saved_lora(root))
                                                 if collectives.rank() == 0 else None)
            return ResumePoint(ckpt_dir, tag, explicit, layout, lora), notes
        more = f" (and {len(bad) - 1} more problem(s))" if len(bad) > 1 else ""
        if explicit:
            raise ConfigError(f"{what}: checkpoint {root} is damaged: {bad[0]}{more}. Fix: use an earlier "
                              f"checkpoint: {_previous_hint(ckpt_dir, tag)} (--resume auto picks the newest intact "
                              "one of this run).")
        nxt = tags[i + 1] if i + 1 < len(tags) else None
        notes.append(f"checkpoint {root} is damaged: {bad[0]}{more}; "
                     + (f"falling back to the previous complete checkpoint {nxt}" if nxt else "no earlier one is left"))
    return None, notes


# --------------------------------------------------------------------------------------------
# rank 0: what the output directory already holds


def holds_run(output_dir: str) -> list[str]:
    """What in ``output_dir`` belongs to an earlier run (empty when it holds none)."""
    found = []
    tags = ckpt.complete_tags(os.path.join(output_dir, CHECKPOINTS))
    if tags:
        found.append(f"{len(tags)} checkpoint(s) ({', '.join(tags[-3:])})")
    metrics = os.path.join(output_dir, METRICS)
    if os.path.isfile(metrics) and os.path.getsize(metrics) > 0:
        found.append(f"{METRICS} ({os.path.getsize(metrics)} bytes)")
    return found


def _discard(output_dir: str, tags: list[str] | None = None) -> None:
    """Delete what an earlier run wrote (``tags`` only, when given): the explicit --overwrite."""
    ckpt_dir = os.path.join(output_dir, CHECKPOINTS)
    if tags is not None:
        for tag in tags:
            shutil.rmtree(os.path.join(ckpt_dir, tag), ignore_errors=True)
        return
    shutil.rmtree(ckpt_dir, ignore_errors=True)
    os.makedirs(ckpt_dir, exist_ok=True)
    for name in (METRICS, "metrics.dropped.jsonl"):
        if os.path.isfile(os.path.join(output_dir, name)):
            os.unlink(os.path.join(output_dir, name))
    shutil.rmtree(os.path.join(output_dir, FINAL_MODEL), ignore_errors=True)


def settle(output_dir: str, point: ResumePoint | None, damaged: list[str], overwrite: bool) -> list[str]:
    """Refuse or carry out what the start would do to ``output_dir`` (rank 0); returns notes for the log."""
    own_ckpt = os.path.realpath(os.path.join(output_dir, CHECKPOINTS))
    notes = []
    for tag in damaged:  # auto fell back past them: keep them for inspection, never resume from them again
        src = os.path.join(own_ckpt, tag)
        os.unlink(os.path.join(src, ckpt.COMPLETE))
        os.replace(src, src + DAMAGED_SUFFIX)
        notes.append(f"moved the damaged checkpoint to {src + DAMAGED_SUFFIX}")
    found = holds_run(output_dir)
    own = point is not None and os.path.realpath(point.ckpt_dir) == own_ckpt
    if point is None or not own:
        if found and not overwrite:
            what = "a fresh start" if point is None else f"resuming from {point.path}"
            raise ConfigError(f"dsrl.run.output_dir = {output_dir!r} already holds a run ({'; '.join(found)}); "
                              f"{what} there would overwrite it. {_WAYS_FORWARD}")
        if found:
            _discard(output_dir)
            notes.append(f"--overwrite: discarded the earlier run in {output_dir} ({'; '.join(found)})")
        return notes
    newer = [t for t in ckpt.complete_tags(own_ckpt) if ckpt._tag_order(t) > ckpt._tag_order(point.tag)]
    if newer and not overwrite:
        raise ConfigError(f"dsrl.run.resume: {point.path} is older than this run's newest checkpoint(s) "
                          f"{', '.join(newer)}; continuing from it would replace them and drop their metrics rows. "
                          "Fix: --resume auto continues from the newest; add --overwrite to go back to "
                          f"{point.tag} anyway, or resume into a new --dsrl.run.output_dir.")
    if newer:
        _discard(output_dir, newer)
        notes.append(f"--overwrite: discarded the newer checkpoints {', '.join(newer)}")
    return notes


def _note(run: RunDir, text: str) -> None:
    run.notes.append(text)
    if collectives.rank() == 0:
        log.warning(text)


def open_run_dir(run_cfg: Any, checksums: bool = True) -> RunDir:
    """Prepare ``run_cfg.output_dir`` and decide what the run continues from (collective; module doc)."""
    output_dir = os.path.abspath(run_cfg.output_dir)
    ckpt_dir = os.path.join(output_dir, CHECKPOINTS)

    held: dict[str, OutputLock] = {}

    def first() -> str | None:
        prepare_directories(output_dir)
        held["lock"] = OutputLock.acquire(output_dir)
        return held["lock"].taken_over

    taken_over = collectives.on_rank0(first)
    run = RunDir(output_dir, ckpt_dir, None, held.get("lock"))
    if taken_over:
        _note(run, taken_over)
    try:
        # --overwrite means start over: with the default --resume auto it must not pick the old run's newest
        # checkpoint (only an explicitly named checkpoint is gone back to, dropping the newer ones).
        resume = "never" if run_cfg.overwrite and run_cfg.resume == "auto" else run_cfg.resume
        folder, tags, explicit, latest_note = collectives.on_rank0(lambda: classify(resume, ckpt_dir))
        if latest_note:
            _note(run, f"{latest_note}; using the newest complete checkpoint instead")
        point, damaged_notes = choose(folder, tags, explicit, checksums)
        for text in damaged_notes:
            _note(run, text)
        damaged = tags[:tags.index(point.tag)] if point is not None else list(tags)
        if os.path.realpath(folder) != os.path.realpath(ckpt_dir):
            damaged = []  # another run's checkpoints are never renamed
        for text in collectives.on_rank0(lambda: settle(output_dir, point, damaged, run_cfg.overwrite)):
            _note(run, text)
        run.resume = point
    except BaseException:
        run.release()
        raise
    return run


# --------------------------------------------------------------------------------------------
# free space


def estimate_checkpoint_bytes(model: Any, with_export: bool = False) -> int:
    """An upper estimate of one checkpoint of ``model`` (bytes): the weights in their dtype plus an fp32
    master copy and two Adam moments (12 bytes) per trainable parameter, frozen weights (LoRA's base) a second
    time (ZeRO 2-3 record them again for the consolidation), plus the exported copy when asked."""
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    trainable = sum(p.numel() for p in params if p.requires_grad)
    width = params[0].element_size() if params else 4
    return n * width + trainable * 12 + (n - trainable) * width + (n * width if with_export else 0)


def check_free_space(run: RunDir, model: Any, run_cfg: Any) -> None:
    """Compare the free space of the checkpoint directory with one checkpoint's estimated size
    (collective): below it a warning, below half of it an error, both naming the sizes and the path."""
    if not (run_cfg.save_final or run_cfg.save_every or run_cfg.stop_after_rollouts):
        return
    need = estimate_checkpoint_bytes(model, with_export=run_cfg.export_final)

    def check() -> None:
        free = shutil.disk_usage(run.ckpt_dir).free
        words = (f"{run.ckpt_dir} has {free / 2**20:.1f} MiB free; one checkpoint of this model needs about "
                 f"{need / 2**20:.1f} MiB")
        if free < need / 2:
            raise ConfigError(f"dsrl.run.output_dir: {words}, so no checkpoint could be saved. Fix: free space or "
                              "point dsrl.run.output_dir at a larger disk.")
        if free < need:
            log.warning("%s: a checkpoint save will probably fail (it would end the run, keeping the previous "
                        "checkpoint). Free space or point dsrl.run.output_dir at a larger disk.", words)

    collectives.on_rank0(check)
