"""The run's checkpoints: save, resume, the mid-rollout boundary and the final export (:class:`Checkpointer`).

One checkpoint ``rollout{N}`` (N rollouts trained) holds, in one atomic commit (:mod:`dsrl.checkpoint.engines`):
the policy's engine, its companions (the critic's), the run's state (:class:`dsrl.rl.run.state.RunState`) and
what the actor records beside its engine (an MoE policy's routing layout) as client state, and each rank's random
streams. Invariants:

- a resume restores all of it, on this or another world size (DeepSpeed's universal checkpoints), and the run
  continues bitwise as if uninterrupted;
- a stop that comes after the next rollout began drawing prompts commits the state of the rollout boundary
  (:meth:`dsrl.rl.run.state.RunState.snapshot`), so the interrupted rollout is drawn again on resume;
- when the generator ranks are gone (disaggregated), the trainer side commits its state unless the newest
  checkpoint already holds it, then ends the run naming them;
- every checkpoint carries the model's Hugging Face metadata (config, tokenizer), so the final one exports to a
  model directory (``run.export_final``).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

from transformers import PreTrainedTokenizerBase

from dsrl.backends.deepspeed.offload import StateOffload
from dsrl.checkpoint import adapters
from dsrl.checkpoint.commit import latest_complete_tag
from dsrl.checkpoint.engines import load_engines, save_engines
from dsrl.checkpoint.export import export_checkpoint, write_hf_meta
from dsrl.checkpoint.run_dir import FINAL_MODEL, RunDir
from dsrl.config import ConfigError, ModelConfig, RunConfig
from dsrl.core import collectives, timeouts
from dsrl.core.errors import RunError
from dsrl.rl.critic import Critic, NoCritic
from dsrl.rl.disagg.remote import GenerationStopped
from dsrl.rl.policy.actor import PolicyActor
from dsrl.rl.run.state import RunState, Snapshot
from dsrl.runtime.context import RunContext

CHECKPOINT_SUBDIR = "checkpoints"
log = logging.getLogger("dsrl.rl.trainer")


class Checkpointer:
    """Saves and resumes the run's checkpoints under ``run.output_dir``/checkpoints (module docstring)."""

    def __init__(self, actor: PolicyActor, critic: Critic | NoCritic, state: RunState, run_dir: RunDir,
                 run: RunConfig, model: ModelConfig, tokenizer: PreTrainedTokenizerBase, *, context: RunContext,
                 memory: StateOffload, live_export: Callable[[str], None] | None = None):
        """``context``: the run's (its stop control, watch and peers required: a checkpoint is bounded, a stop
        commits one, and gone generator ranks are named). ``live_export(out)``: how the final model is written when
        no offline export of its checkpoint exists (the Megatron engine: its live weights through the rollout model,
        :func:`dsrl.rl.run.engines.final_model_writer`); collective. None:
        :func:`dsrl.checkpoint.export.export_checkpoint` on rank 0."""
        self.actor, self.critic, self.state, self.run_dir, self.memory = actor, critic, state, run_dir, memory
        self.live_export = live_export
        self.run, self.model, self.tokenizer = run, model, tokenizer
        self.watch, self.rank, self.world = context.watch, context.rank, context.world
        self.stop, self.peers = context.required_stop(), context.required_peers()
        self.ckpt_dir = os.path.join(run.output_dir, CHECKPOINT_SUBDIR)
        self.notice: str | None = None  # set by an elastic resume (another world size)

    def tag_dir(self, rollout: int) -> str:
        return os.path.join(self.ckpt_dir, f"rollout{rollout}")

    def save(self, at: Snapshot | None = None) -> None:
        """Commit checkpoint ``rollout{N}`` of the live state, or of ``at`` (the boundary a stop inside the next
        rollout's drawing commits). Collective: every rank calls it."""
        at = at or self.state.snapshot()
        self.memory.reload()  # the engines are saved with their states on the device
        client = dict(at.state)
        routing = self.actor.checkpoint_state()
        if routing is not None:  # the routing layout, checked when the run resumes
            client["moe"] = routing
        engine = self.actor.engine
        t0 = time.perf_counter()
        with self.watch.phase("save"):
            save_engines(engine, self.ckpt_dir, f"rollout{client['rollout']}", client_state=client, rank_state=at.rng,
                         keep_last=self.run.keep_last, checksums=self.run.checkpoint_checksums,
                         before_commit=lambda path: write_hf_meta(path, engine.module, self.tokenizer),
                         companions=self.critic.companions(), model=adapters.record(self.model.lora))
        self.stop.note_save(time.perf_counter() - t0)

    def resume(self) -> bool:
        """Continue from the checkpoint the run directory chose and verified (any world size); False when the run
        starts fresh. Collective."""
        point = self.run_dir.resume
        if point is None:
            return False
        resumed = load_engines(self.actor.engine, point.ckpt_dir, point.tag, companions=self.critic.companions())
        tag, client, rank_state = resumed
        self.notice = resumed.notice
        if resumed.notice and self.rank == 0:
            log.warning(resumed.notice)
        self.actor.check_resumed(client.get("moe"), os.path.join(point.ckpt_dir, tag))
        self.state.load_state_dict(client)
        if rank_state is not None:
            RunState.load_rng_state(rank_state)
        if self.rank == 0:
            log.info("resumed from %s at rollout %d, optimizer step %d", os.path.join(point.ckpt_dir, tag),
                     self.state.rollout, self.actor.engine.optimizer_steps)
        return True

    def export_final(self) -> None:
        """The final checkpoint as a Hugging Face model directory, <output_dir>/final_model (rank 0 writes); a
        failure is a warning: the run itself succeeded."""
        tag_dir = self.tag_dir(self.state.rollout)
        out = os.path.join(self.run.output_dir, FINAL_MODEL)
        try:
            with self.watch.phase("export"), timeouts.patience(4 * 3600.0):
                if self.live_export is not None:
                    self.live_export(out)
                else:
                    collectives.on_rank0(lambda: export_checkpoint(tag_dir, out, overwrite=True, checksums=False))
        except (ConfigError, RunError) as e:
            if self.rank == 0:
                log.warning("run.export_final: could not export %s: %s", tag_dir, e)
            return
        if self.rank == 0:
            log.info("exported the final model to %s (AutoModelForCausalLM.from_pretrained)", out)

    def stop_without_generation(self, e: GenerationStopped, boundary: Snapshot) -> None:
        """The generator ranks are gone (or a stop came while waiting for them): commit the trainer side's state at
        ``boundary`` (every rollout trained so far, the prompt stream and RNGs as they were before the unfinished
        rollout drew from them) unless the newest checkpoint already holds it, then end the run. A generator that
        hangs is ended once the trainers have exited, by the lowest trainer of its host
        (:meth:`dsrl.runtime.peers.Peers.end_after_exit`), so the launcher does not wait for it."""
        if not e.requested:
            self.stop.end_run()  # every trainer ends on this agreed error: none of them has died
        rollout = self.state.rollout
        if latest_complete_tag(self.ckpt_dir) != f"rollout{rollout}":
            self.save(boundary)
        checkpoint = self.tag_dir(rollout)
        if e.requested:
            if self.rank == 0:
                log.warning("%s; checkpoint %s", e, checkpoint)
            return
        hosts = self.peers.hosts
        self.peers.end_after_exit([g for g in e.hung  # by the lowest trainer of the generator's host, if any
                                   if [r for r in range(self.world) if hosts[r] == hosts[g]][:1] == [self.rank]])
        ended = "; it is ended (SIGKILL) once the trainers have exited" if e.hung else ""
        raise GenerationStopped(f"{e}; checkpoint {checkpoint}{ended}", requested=False, hung=e.hung)
