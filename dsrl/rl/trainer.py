"""The RL loop, top to bottom, one call per stage; its parts are built by :func:`dsrl.rl.run.parts.build_run`.

One rollout, on every rank:

1. **experience** (:class:`dsrl.rl.experience.ExperienceMaker`): P prompts drawn (the same on every rank), each
   data-parallel replica generating all G completions of its P/D prompts, scored by the one reward formula,
   filtered, then old (and reference) log-probs from the policy actor and values from the critic, once, and
   advantages;
2. **update**: for each of E epochs the rollout is reshuffled into R/B mini-batches, each partitioned across
   replicas and into micro-batches, and one all-to-all moves each sample to the ranks that train on it
   (:func:`dsrl.rl.data.replica.rollout_micro_batches`); per mini-batch the actor takes one exact optimizer step
   (unless in the critic's warm-up, ``critic.warmup_rollouts``) and then the critic;
3. **record**: the rollout's statistics summed over the ranks, with each phase's seconds, tokens and peak memory,
   to metrics.jsonl, DeepSpeed's monitor and the console;
4. **evaluate**: when due (``dsrl.eval``: before the first rollout, every ``eval.every`` rollouts and after the last),
   the held-out evaluation of the weights (:class:`dsrl.rl.evaluation.Evaluator`), before the rollout's checkpoint;
   a due one that a stop skipped runs when the run resumes, before its first rollout;
5. **decide**: the stop policy (:class:`dsrl.rl.run.stopping.StopPolicy`) says whether to checkpoint and whether to
   end; a rollout that trained on nothing is warned about, and too many in a row end the run
   (:class:`dsrl.rl.empty_rollouts.EmptyRollouts`).

An optional supervised warm-up (``dsrl.sft``) runs before rollout 1. The progress bar's total is the plan's total
optimizer steps and every loop bound comes from the same plan, so the bar ends exactly at the last step. A stop
request is decided at each mini-batch boundary by every rank alike (:mod:`dsrl.runtime.stop`). Progress messages
go through ``logging`` (logger ``dsrl``, rank 0), redirected through tqdm while the bar is shown.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from dsrl.core.errors import RunError
from dsrl.core.seeds import derived_seed
from dsrl.rl.data.batching import Sample
from dsrl.rl.data.replica import is_source, rollout_micro_batches
from dsrl.rl.disagg.remote import GenerationStopped
from dsrl.rl.empty_rollouts import RolloutOutcome
from dsrl.rl.rewards.contract import all_timed_out
from dsrl.rl.rollout_stats import RolloutStats
from dsrl.rl.run.parts import RunParts, build_run
from dsrl.rl.run.stopping import report_stop
from dsrl.runtime.console import log_through
from dsrl.runtime.metrics import rollout_record
from dsrl.runtime.phases import phase_record
from dsrl.runtime.stop import StopRun

if TYPE_CHECKING:
    from dsrl.config import Config
    from dsrl.rl.disagg.roles import Role

log = logging.getLogger("dsrl.rl.trainer")
STEP_METRICS = ("loss", "grad_norm", "lr", "tokens", "sequences", "micro_batches", "step_applied",
                "clip_low_frac", "clip_high_frac", "kl", "entropy", "router_aux_loss", "step_s")
StepResult = dict[str, Any]


class Trainer:
    """Runs the loop (module docstring) on the parts of one run."""

    def __init__(self, parts: RunParts):
        self.parts = parts
        self.bar: Any = None  # the progress bar (rank 0, run.progress_bar)

    @classmethod
    def from_config(cls, config: str | dict[str, Any] | Config, overrides: dict[str, Any] | None = None,
                    resume: str | None = None, role: Role | None = None) -> Trainer:
        """The trainer of a run file (a path, a dict or a :class:`dsrl.config.Config`): :func:`build_run`."""
        return cls(build_run(config, overrides, resume, role))

    def run(self) -> dict[str, Any]:
        """Train to the plan's last rollout (or ``run.stop_after_rollouts``); returns the last rollout's record."""
        p = self.parts
        run = p.cfg.dsrl.run
        if p.rank == 0 and run.progress_bar:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=p.plan.total_optimizer_steps, initial=p.actor.engine.optimizer_steps, unit="step",
                            desc="dsrl", dynamic_ncols=True)
        p.stop.begin_training()
        try:
            with log_through(self.bar):
                start = p.state.rollout
                summary = self._loop()
                if p.state.rollout == p.plan.rollouts > start and run.export_final and run.save_final:
                    p.checkpointer.export_final()
        finally:
            p.stop.end_run()
            if self.bar is not None:
                self.bar.close()
            p.close()
        return summary

    def _loop(self) -> dict[str, Any]:
        p, plan, state = self.parts, self.parts.plan, self.parts.state
        if p.rank == 0:
            log.info("%d rollouts x %d optimizer steps = %d steps on %d rank(s); output %s", plan.rollouts,
                     plan.optimizer_steps_per_rollout, plan.total_optimizer_steps, p.world, p.cfg.dsrl.run.output_dir)
        summary: dict[str, Any] = {}
        start, t_loop = state.rollout, time.perf_counter()
        if start == 0 and p.cfg.dsrl.sft.steps and p.actor.engine.optimizer_steps == 0:
            self._supervised_warmup()
        if start >= plan.rollouts and p.rank == 0:
            log.info("%s already holds the finished run (%d rollouts); nothing to do. Use a new "
                     "--dsrl.run.output_dir, or --overwrite to start over.", p.cfg.dsrl.run.output_dir, plan.rollouts)
        p.backend.begin(state.rollout)  # where this invocation starts (a remote backend tells its generators)
        self._evaluate()  # before rollout 1, or the one a stop skipped
        if p.stop.decision is not None:  # a stop during that evaluation: nothing was trained since the checkpoint
            self._report_stop(mid_rollout=False)
            return summary
        while state.rollout < plan.rollouts:
            boundary = state.snapshot()  # make() draws the next prompts: a stop inside it commits this state
            p.stop.new_rollout()
            p.phases.start_rollout(state.rollout)
            p.memory.release()  # training state off the device while generating (dsrl.memory)
            try:
                local, stats, rounds = p.experience.make(state.rollout)
            except GenerationStopped as e:
                p.checkpointer.stop_without_generation(e, boundary)
                self._report_stop(mid_rollout=False)
                return summary
            self._count_phase_tokens(local)
            t0 = time.perf_counter()
            p.memory.reload()
            try:
                with p.watch.phase("step"), p.phases.phase("train"):
                    results = self.train_rollout(local)
            except StopRun:
                self._report_stop(mid_rollout=True)
                return summary
            stats.train_s = time.perf_counter() - t0
            state.rollout += 1
            summary, totals = self._record(stats, results, rounds, elapsed_s=time.perf_counter() - t_loop)
            self._evaluate()  # when due, before the rollout's checkpoint
            decision = p.stop_policy.after_rollout(state.rollout, start, requested=p.stop.decide(0) is not None)
            # A rollout that trained on nothing is warned about; too many in a row, or a whole run of them, end the
            # run here, before its checkpoint (dsrl.rl.empty_rollouts). Global counts: every rank decides alike.
            state.empty.observe(state.rollout, RolloutOutcome.of(totals, [*results, *p.critic.results]),
                                last=decision.final, rank=p.rank)
            if decision.save:
                p.checkpointer.save()
            if decision.early:
                if p.stop.decision is not None:
                    self._report_stop(mid_rollout=False)
                elif p.rank == 0:
                    log.info("stopping after %d rollouts of this invocation (run.stop_after_rollouts); resume with "
                             "--resume auto", p.cfg.dsrl.run.stop_after_rollouts)
            if decision.end:
                break
        return summary

    def _evaluate(self) -> None:
        """The held-out evaluation of the weights after ``state.rollout`` rollouts, when due; generator ranks that are
        gone meanwhile (disaggregated) end the run after a checkpoint of what was trained."""
        p = self.parts
        if not p.evaluator.due(p.state.rollout):
            return
        p.memory.release()  # generation needs the device, not the training state (dsrl.memory)
        try:
            p.evaluator.evaluate_if_due(p.state.rollout, p.actor.engine.optimizer_steps)
        except GenerationStopped as e:  # (a stop request ends the evaluation inside it)
            p.checkpointer.stop_without_generation(e, p.state.snapshot())  # commits what was trained, then raises

    def train_rollout(self, local: list[Sample]) -> list[StepResult]:
        """E reshuffled passes over the rollout, one optimizer step per mini-batch: the actor's (unless in the
        critic's warm-up), then the critic's. Returns the actor's step results (the critic keeps its own)."""
        p, state = self.parts, self.parts.state
        seed = derived_seed(p.cfg.dsrl.run.seed, state.rollout, 0xB47C4)
        policy_steps = state.rollout >= p.plan.critic_warmup_rollouts
        p.critic.begin_rollout()
        results: list[StepResult] = []
        first_call = state.calls
        for micros in rollout_micro_batches(local, p.actor.view, p.plan, seed, p.cfg.dsrl.batch.shuffle,
                                            p.tokenizer.pad_token_id, p.actor.device):
            res = p.actor.train_mini_batch(micros) if policy_steps else None
            if res is not None:
                results.append(res)
            critic_res = p.critic.train_mini_batch(micros)  # None without a critic
            state.calls += 1
            self._on_step(res, critic_res, steps_left=p.plan.optimizer_steps_per_rollout - (state.calls - first_call))
        return results

    def _on_step(self, res: StepResult | None, critic_res: StepResult | None, steps_left: int) -> None:
        p = self.parts
        steps = p.actor.engine.optimizer_steps
        if self.bar is not None and res is not None and res["step_applied"]:
            self.bar.update(1)
        rec = {"rollout": p.state.rollout + 1, "call": p.state.calls, "optimizer_step": steps,
               **{k: res[k] for k in STEP_METRICS if res is not None and k in res}}
        rec.update(p.critic.step_metrics(critic_res))
        p.metrics.write("step", rec, steps)
        # A mini-batch boundary: every rank takes the same stop decision here (dsrl.runtime.stop).
        p.stop.note_step(sum(r.get("step_s", 0.0) for r in (res, critic_res) if r is not None))
        if p.stop.decide(steps_left) == "stop":
            raise StopRun

    def _record(self, stats: RolloutStats, results: list[StepResult], rounds: int,
                elapsed_s: float) -> tuple[dict[str, Any], RolloutStats]:
        """The rollout's row of metrics.jsonl (statistics summed over the ranks, phases reduced), written and, every
        ``run.log_every`` rollouts, logged, with the summed statistics; a rollout whose every reward (or
        environment) call ran out of time ends the run."""
        p, plan = self.parts, self.parts.plan
        rollout, steps = p.state.rollout, p.actor.engine.optimizer_steps
        totals = stats.summed(p.actor.device)
        summary = rollout_record(totals, results, world=p.world, rollout=rollout, optimizer_step=steps,
                                 rollout_size=plan.rollout_size, prompt_epochs=p.prompts.drawn / len(p.prompts),
                                 sampling_rounds=rounds, local_train_s=stats.train_s, elapsed_s=elapsed_s)
        summary.update(p.critic.rollout_metrics())
        summary.update(phase_record(p.phases.take().reduced(p.actor.device), p.world))
        summary.update(p.memory.record(p.actor.device, p.world))
        p.metrics.write("rollout", summary, steps)
        if problem := all_timed_out(summary["reward_timeouts"], plan.rollout_size):
            raise RunError(problem, agreed=True)
        if problem := all_timed_out(summary.get("environment_timeouts") or 0, plan.rollout_size, "environment"):
            raise RunError(problem, agreed=True)
        if p.rank == 0 and (rollout % p.cfg.dsrl.run.log_every == 0 or rollout == plan.rollouts):
            log.info(p.metrics.rollout_line(summary, plan.rollouts))
        return summary, totals

    def _count_phase_tokens(self, local: list[Sample]) -> None:
        """The rollout's generated tokens and the tokens its E epochs train on, for the phase rates (each replica's
        samples counted once)."""
        p = self.parts
        if is_source(p.actor.view):
            p.phases.count_tokens(sum(s.model_tokens for s in local),
                                  p.plan.epochs_per_rollout * sum(len(s.tokens) for s in local))

    def _report_stop(self, mid_rollout: bool) -> None:
        p = self.parts
        report_stop(p.stop, p.peers, p.checkpointer.ckpt_dir, rank=p.rank,
                    optimizer_steps=p.actor.engine.optimizer_steps, rollout=p.state.rollout, mid_rollout=mid_rollout)

    def _supervised_warmup(self) -> None:
        """The optional dsrl.sft phase (dsrl/rl/sft.py): policy steps on reference answers before rollout 1."""
        from dsrl.rl.sft import SupervisedWarmup

        p, d = self.parts, self.parts.cfg.dsrl
        t0, first = time.perf_counter(), []

        def on_step(step: int, res: StepResult) -> None:
            if self.bar is not None and res["step_applied"]:
                self.bar.update(1)
            first.append(res["loss"])
            rec = {"sft_step": step, "call": step, "optimizer_step": res["optimizer_step"],
                   **{k: res[k] for k in ("loss", "grad_norm", "lr", "tokens", "token_accuracy", "step_s") if k in res}}
            p.metrics.write("sft", rec, res["optimizer_step"])

        SupervisedWarmup(d.sft, p.plan, p.actor.engine, p.tokenizer, p.prompts, data=d.data, rollout=d.rollout,
                         seed=d.run.seed).run(on_step)
        if p.rank == 0:
            log.info("supervised warm-up: %d steps, loss %.3f -> %.3f, %.1fs", d.sft.steps, first[0], first[-1],
                     time.perf_counter() - t0)
