"""Save and resume training engines in one atomic checkpoint: DeepSpeed's
:class:`dsrl.backends.deepspeed.engine.RLEngine` s, or the Megatron engine (:mod:`dsrl.checkpoint.megatron_files`).

The policy's engine is the checkpoint's root; each companion (the critic: its engine, LR schedule and
step counters) goes to ``<tag>/<name>/`` in the same commit (:mod:`dsrl.checkpoint.commit`), with a
manifest that records every file and each engine's layout, so a resume on another world size goes
through DeepSpeed's universal checkpoints (:mod:`dsrl.checkpoint.elastic`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dsrl.backends.deepspeed.engine import RLEngine
from dsrl.checkpoint import commit
from dsrl.checkpoint.elastic import engine_layout, load, saved_layout
from dsrl.core.engine import TrainEngine
from dsrl.core.errors import CheckpointError


@dataclass(frozen=True)
class Resumed:
    """What a resume restored besides the engines' own state."""

    tag: str | None  # None: nothing to resume from
    client_state: dict[str, Any]
    rank_state: dict[str, Any] | None
    notice: str | None = None  # set after an elastic resume (another world size): say so to the user

    def __iter__(self):  # (tag, client_state, rank_state), as the earlier RLEngine.load_checkpoint returned
        return iter((self.tag, self.client_state, self.rank_state))


def save_engines(rl: TrainEngine, save_dir: str, tag: str, client_state: dict[str, Any] | None = None,
                 rank_state: dict[str, Any] | None = None, keep_last: int | None = None, checksums: bool = True,
                 before_commit: Callable[[str], None] | None = None,
                 companions: dict[str, TrainEngine] | None = None, model: dict[str, Any] | None = None) -> str:
    """Atomic checkpoint of ``rl`` (engine + schedule + ``client_state`` + per-rank state) and its companions,
    with ``model`` (:func:`dsrl.checkpoint.adapters.record`) in its manifest; returns the committed checkpoint's
    directory. Collective: every rank calls it."""
    target: Any
    if isinstance(rl, RLEngine):
        target, layout = rl.engine, engine_layout(rl).to_dict()
        state = {"engine": rl.state_dict(), "client": client_state or {}}
        others = {name: (c.engine, {"engine": c.state_dict()}, engine_layout(c).to_dict())
                  for name, c in (companions or {}).items()}
    else:  # the Megatron engine, whose dist-checkpoint holds its step state (dsrl.checkpoint.megatron_files)
        from dsrl.backends.megatron.checkpoint import megatron_layout
        from dsrl.checkpoint.megatron_files import MegatronFiles

        target, layout, state = MegatronFiles(rl), megatron_layout(rl), {"client": client_state or {}}
        others = {name: (MegatronFiles(c), {}, megatron_layout(c)) for name, c in (companions or {}).items()}
    return commit.save(target, save_dir, tag, state, rank_state=rank_state, keep_last=keep_last, layout=layout,
                       checksums=checksums, before_commit=before_commit, companions=others, model=model)


def load_engines(rl: TrainEngine, load_dir: str, tag: str | None = None,
                 companions: dict[str, TrainEngine] | None = None) -> Resumed:
    """Resume ``rl`` from the newest complete checkpoint of ``load_dir`` (or ``tag``) and each companion from
    ``<tag>/<name>/``, on this or another number of data-parallel ranks. Collective: every rank calls it."""
    tag = tag or commit.latest_complete_tag(load_dir)
    if tag is None:
        return Resumed(None, {}, None)
    where = os.path.join(load_dir, tag)
    for name in companions or {}:
        if not os.path.isdir(os.path.join(where, name)):
            raise CheckpointError(f"checkpoint {where} holds no {name!r} engine (written by a run without a "
                                  f"{name}?). Fix: resume with the original algorithm, or start a new "
                                  "dsrl.run.output_dir.")
    if not isinstance(rl, RLEngine):  # the Megatron engine (dsrl.checkpoint.megatron_files)
        from dsrl.backends.megatron.checkpoint import check_layout
        from dsrl.checkpoint import manifest
        from dsrl.checkpoint.megatron_files import MegatronFiles

        notice = check_layout(manifest.engine_layout(where), rl, where)
        _, state, rank_state = commit.load(MegatronFiles(rl), load_dir, tag)  # the engine's step state included
        for name, c in (companions or {}).items():  # the critic's engine: <tag>/<name>/megatron/
            check_layout(manifest.engine_layout(where, name), c, os.path.join(where, name))
            MegatronFiles(c).load_checkpoint(where, name)
        return Resumed(tag, state.get("client", {}), rank_state, notice)
    state, rank_state, notice = load(rl, load_dir, tag, saved_layout(where))
    rl.load_state_dict(state["engine"])
    for name, c in (companions or {}).items():
        other, _, _ = load(c, load_dir, tag, saved_layout(os.path.join(where, name), root=where, subdir=name),
                           subdir=name)
        c.load_state_dict(other["engine"])
    return Resumed(tag, state.get("client", {}), rank_state, notice)
