"""The RL loop: rollout -> rewards -> advantages -> mini-batches -> RLEngine (and the critic's RLEngine).

One rollout, on every rank:

1. :class:`dsrl.rl.experience.ExperienceMaker` draws P prompts (the same on every rank); each
   data-parallel replica generates all G completions of its P/D prompts, scores them, applies the
   algorithm's filters, computes old (and reference) log-probs once, then group advantages;
2. the lengths of all R samples are all-gathered (a few bytes each; tensor-parallel peers
   contribute nothing), and every rank computes the same E*R/B partitions: for each of E epochs the
   rollout is reshuffled into R/B mini-batches (the same permutation on every rank), each
   partitioned across replicas and into micro-batches (fixed size or token budget) by
   :mod:`dsrl.core.partition`. Then one all-to-all moves each sample, with its old/ref log-probs and
   advantage, from the replica that generated it to the ranks that train on it, once per rollout,
   so a rank receives about R/D samples, not R (:mod:`dsrl.rl.data.replica`: tensor peers get
   identical micro-batches); every mini-batch is one ``RLEngine.train_mini_batch`` call, i.e. one
   optimizer step;
3. with a critic (ppo, :mod:`dsrl.rl.critic`) the critic takes one exact step on the same micro-batches
   right after the policy's; in the first ``critic.warmup_rollouts`` rollouts only the critic steps.
   Both engines are saved in one checkpoint commit and resume together.

The progress bar's total is the plan's total optimizer steps and every loop bound comes from the
same plan, so the bar ends exactly at the last step. Progress messages go through ``logging``
(logger ``dsrl``, rank 0), redirected through tqdm while the bar is shown.
"""

from __future__ import annotations

import functools
import logging
import os
import random
import time
from typing import Any

import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator

from dsrl import algos
from dsrl.backends.deepspeed.engine import RLEngine, ensure_distributed, initialize, on_gpu, prepare
from dsrl.backends.deepspeed.frozen import FrozenModel, frozen_engine
from dsrl.checkpoint import adapters
from dsrl.checkpoint.commit import latest_complete_tag
from dsrl.checkpoint.engines import load_engines, save_engines
from dsrl.checkpoint.export import export_checkpoint, write_hf_meta
from dsrl.checkpoint.output_lock import release_all
from dsrl.checkpoint.run_dir import FINAL_MODEL, check_free_space, open_run_dir
from dsrl.config import Config, ConfigError, load_config
from dsrl.core import collectives, timeouts
from dsrl.core.errors import RunError
from dsrl.core.partition import mini_batches, partition_mini_batch
from dsrl.core.seeds import derived_seed
from dsrl.rl.critic import build_critic, prepare_critic
from dsrl.rl.data.batching import Sample
from dsrl.rl.data.replica import RolloutIndex, is_source, my_micro_batches
from dsrl.rl.disagg.remote import GenerationStopped
from dsrl.rl.disagg.roles import Role
from dsrl.rl.empty_rollouts import EmptyRollouts, RolloutOutcome
from dsrl.rl.experience import ExperienceMaker, ExperienceSettings, Rewards
from dsrl.rl.memory import StateOffload
from dsrl.rl.policy_loss import PolicyLoss
from dsrl.rl.rewards.contract import all_timed_out
from dsrl.rl.rewards.functions import load_accuracy_fn
from dsrl.rollout.base import RolloutBackend
from dsrl.runtime.console import log_through
from dsrl.runtime.metrics import MetricsWriter, rollout_record
from dsrl.runtime.peers import Peers
from dsrl.runtime.phases import PhaseClock, phase_record
from dsrl.runtime.stop import StopControl, StopRun
from dsrl.runtime.watchdog import Watch

CHECKPOINT_SUBDIR = "checkpoints"
log = logging.getLogger("dsrl.rl.trainer")
STEP_METRICS = ("loss", "grad_norm", "lr", "tokens", "sequences", "micro_batches", "step_applied",
                "clip_low_frac", "clip_high_frac", "kl", "entropy", "router_aux_loss", "step_s")


class Trainer:
    """Builds everything from one run file and runs the loop (see the module docstring)."""

    def __init__(self, config: str | dict | Config, overrides: dict[str, Any] | None = None,
                 resume: str | None = None, role: Role | None = None):
        """``role``: this rank's :class:`dsrl.rl.disagg.roles.Role` in a disaggregated job (made by
        :func:`dsrl.rl.disagg.roles.split_world`, which every rank calls first); None when colocated."""
        from dsrl.rl.data.prompts import PromptSampler, PromptSource
        from dsrl.rl.policy.model import frozen_copy

        self.cfg = load_config(config, overrides)
        d = self.cfg.dsrl
        self.d = d
        if resume is not None:
            d.run.resume = resume
        # Stop requests (signals, the launcher's death) are handled from here on (dsrl.runtime.stop).
        self.stop = StopControl(d.run.stop_grace_s, before_exit=release_all)
        self.stop.install()
        ensure_distributed(d.run.join_timeout_s, d.run.collective_timeout_s)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.on_gpu = on_gpu()
        self.role = role
        # Every rank's host and process, so that a rank that ended is named by role, rank and host whichever side
        # notices first (dsrl.runtime.peers): the job's store when disaggregated (generators included), else the
        # default group's.
        self.peers = role.peers if role is not None else Peers.of_default_group()
        self.stop.peers = self.peers
        torch.manual_seed(d.run.seed)  # identical initial weights on every rank
        random.seed(derived_seed(d.run.seed, self.rank))

        # Every check that needs no collective work runs first, on every rank of the job (generator ranks run
        # theirs), and the ranks agree on the outcome before anything is touched on disk or built collectively: a
        # configuration error is reported once, by rank 0, together with every other rank's, and every rank stops.
        problem: ConfigError | RunError | None = None
        try:
            spec, critic_spec, reward_fn, environment = self._check()
        except (ConfigError, RunError) as e:
            problem = e
        if role is not None:
            role.agree(problem)  # with the generator ranks (dsrl.rl.disagg.roles)
        else:
            collectives.agree(problem)
        tok, model = self.tokenizer, self.side.model
        # The output directory: lock, refusals, the verified checkpoint to continue from (dsrl.checkpoint.run_dir).
        self.run_dir = open_run_dir(d.run, checksums=d.run.checkpoint_checksums)
        self.run_dir.check_adapters(d.model.lora)  # the checkpoint's adapters are this run's (before the engine)
        check_free_space(self.run_dir, model, d.run)
        # The KL reference: a frozen copy, or for LoRA the policy itself with its adapters disabled (no copy).
        self.ref_model = frozen_copy(model) if d.algorithm.kl_coef > 0 and d.model.lora is None else None
        self.rl: RLEngine = initialize(model, spec)
        self.memory = StateOffload(d.memory, [self.rl])  # states off the device while generating (dsrl.rl.memory)
        self.plan = self.rl.plan
        self.device = self.rl.device
        ref_module = self.ref_model  # the frozen copy's module, whatever wraps it below (its routers: MoE replay)
        if self.ref_model is not None:
            frozen = frozen_engine(self.ref_model, self.rl, self.device)
            self.ref_model = FrozenModel(frozen, self.device, self.memory.frozen(frozen))
        elif d.algorithm.kl_coef > 0:
            from dsrl.rl.policy.lora import AdaptersDisabled

            self.ref_model = AdaptersDisabled(self.rl)
        self.moe = None  # the routing duties of an MoE policy's forwards (dsrl.rl.policy.moe)
        if self.moe_layout is not None:
            from dsrl.rl.policy.moe import PolicyRouting

            self.moe = PolicyRouting(d.model, self.rl.engine, ref_module)
        self.reward_model = None
        if d.data.reward_model:
            from dsrl.rl.rewards.model import RewardModel

            self.reward_model = RewardModel.load(d.data.reward_model, tok, self.rl, on_gpu=self.on_gpu,
                                                 micro_batch_size=d.rollout.logprob_micro_batch_size,
                                                 offload=self.memory.frozen)
        self.critic = build_critic(critic_spec, tok, seed=d.run.seed)  # the value model, or NO_CRITIC
        for critic_engine in self.critic.companions().values():
            self.memory.add_engine(critic_engine)
        self.sampler = PromptSampler(len(self.prompts), self.plan.prompts_per_rollout, seed=d.run.seed,
                                     last_rollout=d.run.last_rollout)
        self.prompt_source = PromptSource(self.prompts, self.sampler, tok, d.data)
        if role is not None:  # completions come from the generator ranks (dsrl.rl.disagg.remote)
            from dsrl.rl.disagg.remote import RemoteRolloutBackend

            self.backend: RolloutBackend = RemoteRolloutBackend(role, self.rl, d, self.plan, self.prompt_source,
                                                                self.stop)
        else:
            self.backend = self.side.backend(self.rl, self.plan.prompts_per_rank)
        self.pad_id = tok.pad_token_id
        self.algo = algos.resolve_algorithm(d.algorithm)
        self.policy_loss = PolicyLoss(d.algorithm, self.algo, d.rollout.temperature, self.ref_model is not None,
                                      self.moe)
        self.output_dir = d.run.output_dir
        self.ckpt_dir = os.path.join(self.output_dir, CHECKPOINT_SUBDIR)
        self.rollout_index = 0
        self.calls = 0  # mini-batches trained (applied or skipped)
        self.empty = EmptyRollouts(d.run.max_empty_rollouts)  # rollouts in a row that trained on nothing
        # phase ends bounded, missing ranks named, waits reported (runtime.watchdog)
        self.watch = Watch(d.run.collective_timeout_s, d.run.wait_report_s)
        self.watch.peers = self.peers
        # seconds, tokens and peak memory per phase of each rollout, in its metrics row (dsrl.runtime.phases)
        self.phases = PhaseClock(get_accelerator())
        self.experience = ExperienceMaker(
            ExperienceSettings.of(d), self.plan, self.rl, self.backend, tok, self.prompt_source,
            Rewards(reward_fn, load_accuracy_fn(d.data), self.reward_model, environment), self.algo,
            ref_model=self.ref_model, critic=self.critic, watch=self.watch, phases=self.phases, moe=self.moe)
        self.resume_notice: str | None = None  # set by an elastic resume (another world size)
        resumed = self._maybe_resume()
        self.metrics = MetricsWriter(self.output_dir, self.rank, getattr(self.rl.engine, "monitor", None),
                                     resume_at=(self.rollout_index, self.rl.optimizer_steps) if resumed else None)

    def _check(self) -> tuple[Any, Any, Any, Any]:
        """Everything that can refuse the run without collective work, in this order: the tokenizer, prompts,
        reward function and environment, the whole run file (the plan, the ds_config, the layout), the policy
        model (one build of the rollout side, :class:`dsrl.rl.policy.rollout_side.RolloutSide`) and, colocated,
        the rollout backend this rank will build. Returns (engine spec, critic spec or None, reward function,
        environment)."""
        from dsrl.rl.data.prompts import load_prompts
        from dsrl.rl.episodes.environment import load_environment
        from dsrl.rl.policy.model import resolve_dtype
        from dsrl.rl.policy.rollout_side import RolloutSide
        from dsrl.rl.rewards.functions import load_reward_fn

        d = self.d
        self.side = RolloutSide(self.cfg, self.on_gpu)
        self.tokenizer = self.side.tokenizer
        self.prompts = load_prompts(d.data, seed=d.run.seed)
        reward_fn = load_reward_fn(d.data) if d.data.has_rule_reward else None
        environment = load_environment(d.data)  # multi-turn rollouts (dsrl.rl.episodes.driver), or None
        _match_deepspeed_precision(self.cfg.ds_config, resolve_dtype(d.model.dtype, self.on_gpu))
        # The whole run file, DeepSpeed half included, is checked once, before the model is built: the plan, the
        # ds_config and the schedule made here are the ones the engine is built from.
        spec = prepare(self.cfg, dataset_size=len(self.prompts), on_gpu=self.on_gpu)
        critic_spec = prepare_critic(self.cfg, self.world, len(self.prompts), self.on_gpu)  # None: no critic
        self.side.build_model()
        if self.role is None:  # a generator rank checks the backend it builds itself
            self.side.check()
        self.moe_layout = self.side.check_moe()  # mixture-of-experts settings (dsrl.rl.policy.moe), every rank
        return spec, critic_spec, reward_fn, environment

    # -- resume ---------------------------------------------------------------------------------
    def _maybe_resume(self) -> bool:
        point = self.run_dir.resume  # chosen and verified by checkpoint.run_dir; any world size (checkpoint.elastic)
        if point is None:
            return False
        load_dir = point.ckpt_dir
        resumed = load_engines(self.rl, load_dir, point.tag, companions=self._companions())
        tag, client, rank_state = resumed
        self.resume_notice = resumed.notice
        if resumed.notice and self.rank == 0:
            log.warning(resumed.notice)
        if self.moe is not None:
            self.moe.check_resumed(client.get("moe"), os.path.join(load_dir, tag))
        self.rollout_index = int(client["rollout"])
        self.calls = int(client["calls"])
        self.empty.load_state_dict(client.get("empty_rollouts"))
        self.sampler.load_state_dict(client["sampler"])
        if rank_state is not None:
            torch.set_rng_state(rank_state["torch_rng"])
            random.setstate(rank_state["python_rng"])
        if self.rank == 0:
            log.info("resumed from %s at rollout %d, optimizer step %d", os.path.join(load_dir, tag),
                     self.rollout_index, self.rl.optimizer_steps)
        return True

    def _stream_state(self) -> dict[str, Any]:
        """What continues the run exactly besides the engines: the prompt stream, the call counter, the RNGs."""
        return {"calls": self.calls, "sampler": self.sampler.state_dict(), "torch_rng": torch.get_rng_state(),
                "python_rng": random.getstate(), "empty_rollouts": self.empty.state_dict()}

    def save(self, stream: dict[str, Any] | None = None) -> None:
        """Commit checkpoint ``rollout{rollout_index}``; ``stream`` (from :meth:`_stream_state`) is the state at the
        boundary after that rollout when the live state has moved past it (prompts drawn for the next rollout)."""
        stream = stream or self._stream_state()
        self.memory.reload()  # the engines are saved with their states on the device
        tag = f"rollout{self.rollout_index}"
        client = {"rollout": self.rollout_index, "calls": stream["calls"], "sampler": stream["sampler"],
                  "empty_rollouts": stream["empty_rollouts"],
                  "version": self.rollout_index}  # the policy version the saved weights are (weight syncs so far)
        if self.moe is not None:  # the routing layout, checked when the run resumes
            client["moe"] = self.moe.checkpoint_state()
        rank_state = {"torch_rng": stream["torch_rng"], "python_rng": stream["python_rng"]}
        t0 = time.perf_counter()
        with self.watch.phase("save"):
            save_engines(self.rl, self.ckpt_dir, tag, client_state=client, rank_state=rank_state,
                                    keep_last=self.d.run.keep_last, checksums=self.d.run.checkpoint_checksums,
                                    before_commit=lambda path: write_hf_meta(path, self.rl.module, self.tokenizer),
                                    companions=self._companions(), model=adapters.record(self.d.model.lora))
        self.stop.save_s = time.perf_counter() - t0

    def _companions(self) -> dict[str, RLEngine]:
        """Engines saved and resumed in the policy's checkpoint commit (the critic's)."""
        return self.critic.companions()

    # -- training -------------------------------------------------------------------------------
    def train_rollout(self, local: list[Sample], on_step) -> list[dict[str, Any]]:
        """E reshuffled passes over the rollout; one optimizer step per mini-batch (of the policy, unless
        in the critic's warm-up, and of the critic). Returns the policy's step results; the critic's are
        in ``self.critic.results``.

        Every rank learns all R lengths, partitions all E*R/B mini-batches, then receives only the
        samples its replica trains on (:mod:`dsrl.rl.data.replica`, rules 3-5)."""
        view = self.rl.view
        index = RolloutIndex.gather(view, local)
        seed = derived_seed(self.d.run.seed, self.rollout_index, 0xB47C4)
        steps = [partition_mini_batch(mb, index.lengths, self.plan)
                 for mb in mini_batches(index.size, self.plan.mini_batch_size, self.plan.epochs_per_rollout,
                                        seed=seed, shuffle=self.d.batch.shuffle)]
        samples = index.exchange(steps, self.device)
        del index
        results = []
        self.critic.begin_rollout()
        policy_steps = self.rollout_index >= self.plan.critic_warmup_rollouts
        for per_rank in steps:
            micros = my_micro_batches(samples, per_rank, view, self.pad_id, self.device, self.plan.packing)
            res = None
            if policy_steps:
                t0 = time.perf_counter()
                res = self._policy_step(micros)
                res["step_s"] = time.perf_counter() - t0
                res["padded_tokens"] = sum(int(m["input_ids"].numel()) for m in micros)
                results.append(res)
            critic_res = self.critic.train_mini_batch(micros)  # None without a critic
            self.calls += 1
            on_step(res, critic_res)
        return results

    def _policy_step(self, micros: list[dict[str, Any]]) -> Any:
        """One policy optimizer step; an MoE policy's load f (one all-reduce) first, its forced routes released
        after the step's backwards."""
        moe = self.moe
        if moe is None:
            return self.rl.train_mini_batch(micros, self.policy_loss)
        load = None
        if moe.aux_coef > 0:
            from dsrl.algos.router_balance import mini_batch_load

            lay = moe.layout
            load = mini_batch_load(micros, lay.layers, lay.experts, lay.top_k, self.rl.sum_over_count_group)
        try:
            return self.rl.train_mini_batch(micros, functools.partial(self.policy_loss, load=load))
        finally:
            moe.release()

    # -- the loop -------------------------------------------------------------------------------
    def _on_step(self, res: dict[str, Any] | None, critic_res: dict[str, Any] | None, bar: Any) -> None:
        if bar is not None and res is not None and res["step_applied"]:
            bar.update(1)
        rec = {"rollout": self.rollout_index + 1, "call": self.calls, "optimizer_step": self.rl.optimizer_steps,
               **{k: res[k] for k in STEP_METRICS if res is not None and k in res}}
        rec.update(self.critic.step_metrics(critic_res))
        self.metrics.write("step", rec, self.rl.optimizer_steps)
        # A mini-batch boundary: every rank takes the same stop decision here (dsrl.runtime.stop).
        self.stop.note_step(sum(r.get("step_s", 0.0) for r in (res, critic_res) if r is not None))
        if self.stop.decide(self.plan.optimizer_steps_per_rollout - (self.calls - self._rollout_calls)) == "stop":
            raise StopRun

    def _ends_run(self, start: int) -> bool:
        """Whether the rollout just finished is the last of this invocation by the plan or run.stop_after_rollouts
        (a stop request aside)."""
        r = self.d.run
        return self.rollout_index == self.plan.rollouts or (
            r.stop_after_rollouts is not None and self.rollout_index - start >= r.stop_after_rollouts)

    def _should_save(self, start: int) -> tuple[bool, bool]:
        """(save now, stop this invocation) after the rollout just finished."""
        r = self.d.run
        last = self.rollout_index == self.plan.rollouts
        stop = r.stop_after_rollouts is not None and self.rollout_index - start >= r.stop_after_rollouts
        periodic = bool(r.save_every) and self.rollout_index % r.save_every == 0
        asked = self.stop.decide(0) is not None  # a stop request (collective): checkpoint this rollout and stop
        return periodic or (last and r.save_final) or stop or asked, (stop or asked) and not last

    def run(self) -> dict[str, Any]:
        """Train to the plan's last rollout (or ``run.stop_after_rollouts``); returns the last rollout's record."""
        plan = self.plan
        bar = None
        if self.rank == 0 and self.d.run.progress_bar:
            from tqdm.auto import tqdm

            bar = tqdm(total=plan.total_optimizer_steps, initial=self.rl.optimizer_steps, unit="step",
                       desc="dsrl", dynamic_ncols=True)
        self.stop.training = True
        try:
            with log_through(bar):
                summary = self._loop(bar)
                if self._finished_here and self.d.run.export_final and self.d.run.save_final:
                    self._export_final()
        finally:
            self.stop.ending = True
            if bar is not None:
                bar.close()
            self.metrics.close()
            self.backend.close()
            self.stop.uninstall()
            self.run_dir.release()
        return summary

    def _export_final(self) -> None:
        """The final checkpoint as a Hugging Face model directory, <output_dir>/final_model (rank 0 writes)."""
        tag_dir = os.path.join(self.ckpt_dir, f"rollout{self.rollout_index}")
        out = os.path.join(self.output_dir, FINAL_MODEL)
        try:
            with self.watch.phase("export"), timeouts.patience(4 * 3600.0):
                collectives.on_rank0(lambda: export_checkpoint(tag_dir, out, overwrite=True, checksums=False))
        except (ConfigError, RunError) as e:  # the run itself succeeded: say so, do not fail it
            if self.rank == 0:
                log.warning("run.export_final: could not export %s: %s", tag_dir, e)
            return
        if self.rank == 0:
            log.info("exported the final model to %s (AutoModelForCausalLM.from_pretrained)", out)

    def _loop(self, bar: Any) -> dict[str, Any]:
        plan = self.plan
        if self.rank == 0:
            log.info("%d rollouts x %d optimizer steps = %d steps on %d rank(s); output %s", plan.rollouts,
                     plan.optimizer_steps_per_rollout, plan.total_optimizer_steps, self.world, self.output_dir)
        summary: dict[str, Any] = {}
        start = self.rollout_index
        t_loop = time.perf_counter()
        self._finished_here = False
        if start == 0 and self.d.sft.steps and self.rl.optimizer_steps == 0:
            self._supervised_warmup(bar)
        if start >= plan.rollouts and self.rank == 0:
            log.info("%s already holds the finished run (%d rollouts); nothing to do. Use a new "
                     "--dsrl.run.output_dir, or --overwrite to start over.", self.output_dir, plan.rollouts)
        self.backend.begin(self.rollout_index)  # where this invocation starts (a remote backend tells its generators)
        while self.rollout_index < plan.rollouts:
            self._rollout_calls = self.calls
            self.stop.new_rollout()
            boundary = self._stream_state()  # make() draws the next prompts: a stop inside it commits this state
            self.phases.start_rollout(self.rollout_index)
            self.memory.release()
            try:
                local, stats, rounds = self.experience.make(self.rollout_index)
            except GenerationStopped as e:
                self._stop_without_generation(e, boundary)
                self._log_stop(mid_rollout=False)
                return summary
            log.debug("rank %d rollout %d: %d local samples (%d masked), %d sampling rounds, %.2fs", self.rank,
                      self.rollout_index + 1, len(local), sum(not s.active for s in local), rounds, stats.rollout_s)
            self._count_phase_tokens(local)
            t0 = time.perf_counter()
            self.memory.reload()
            try:
                with self.watch.phase("step"), self.phases.phase("train"):
                    results = self.train_rollout(local, lambda res, critic_res: self._on_step(res, critic_res, bar))
            except StopRun:
                self._log_stop(mid_rollout=True)
                return summary
            stats.train_s = time.perf_counter() - t0
            self.rollout_index += 1
            totals = stats.summed(self.device)
            summary = rollout_record(totals, results, world=self.world,
                                     rollout=self.rollout_index, optimizer_step=self.rl.optimizer_steps,
                                     rollout_size=plan.rollout_size,
                                     prompt_epochs=self.prompt_source.drawn / len(self.prompts), sampling_rounds=rounds,
                                     local_train_s=stats.train_s, elapsed_s=time.perf_counter() - t_loop)
            summary.update(self.critic.rollout_metrics())
            summary.update(phase_record(self.phases.take().reduced(self.device), self.world))
            summary.update(self.memory.record(self.device, self.world))
            self.metrics.write("rollout", summary, self.rl.optimizer_steps)
            if problem := all_timed_out(summary["reward_timeouts"], plan.rollout_size):
                raise RunError(problem, agreed=True)
            if problem := all_timed_out(summary.get("environment_timeouts") or 0, plan.rollout_size, "environment"):
                raise RunError(problem, agreed=True)
            if self.rank == 0 and (self.rollout_index % self.d.run.log_every == 0
                                   or self.rollout_index == plan.rollouts):
                log.info(self.metrics.rollout_line(summary, plan.rollouts))
            # A rollout that trained on nothing is warned about; too many in a row, or a whole run of them, end the
            # run here, before its checkpoint (dsrl.rl.empty_rollouts). Global counts: every rank decides alike.
            self.empty.observe(self.rollout_index, RolloutOutcome.of(totals, [*results, *self.critic.results]),
                               last=self._ends_run(start), rank=self.rank)
            save, stop = self._should_save(start)
            if save:
                self.save()
            if stop:
                if self.stop.decision is not None:
                    self._log_stop(mid_rollout=False)
                elif self.rank == 0:
                    log.info("stopping after %d rollouts of this invocation (run.stop_after_rollouts); resume with "
                             "--resume auto", self.d.run.stop_after_rollouts)
                break
        self._finished_here = self.rollout_index == plan.rollouts and self.rollout_index > start
        return summary

    def _count_phase_tokens(self, local: list[Sample]) -> None:
        """The rollout's generated tokens and the tokens its E epochs train on, for the phase rates (each replica's
        samples counted once)."""
        if is_source(self.rl.view):
            self.phases.count_tokens(sum(s.model_tokens for s in local),
                                     self.plan.epochs_per_rollout * sum(len(s.tokens) for s in local))

    def _stop_without_generation(self, e: GenerationStopped, boundary: dict[str, Any]) -> None:
        """The generator ranks are gone (or a stop came while waiting for them): commit the trainer side's state
        (every rollout trained so far, and the prompt stream and RNGs as they were before the unfinished rollout
        drew from them) unless the newest checkpoint already holds it, then end the run. A generator that hangs is
        ended once the trainers have exited, by the lowest trainer of its host (dsrl.runtime.peers), so the
        launcher does not wait for it."""
        self.stop.ending = not e.requested  # every trainer ends on this agreed error: none of them has died
        if latest_complete_tag(self.ckpt_dir) != f"rollout{self.rollout_index}":
            self.save(boundary)
        checkpoint = os.path.join(self.ckpt_dir, f"rollout{self.rollout_index}")
        if e.requested:
            if self.rank == 0:
                log.warning("%s; checkpoint %s", e, checkpoint)
            return
        hosts = self.peers.hosts
        self.peers.end_after_exit([g for g in e.hung  # by the lowest trainer of the generator's host, if any
                                   if [r for r in range(self.world) if hosts[r] == hosts[g]][:1] == [self.rank]])
        ended = "; it is ended (SIGKILL) once the trainers have exited" if e.hung else ""
        raise GenerationStopped(f"{e}; checkpoint {checkpoint}{ended}", requested=False, hung=e.hung)

    def _log_stop(self, mid_rollout: bool) -> None:
        """Say where a stop left the run. A stop because a rank of the job had ended (the launcher's SIGTERM after a
        rank died, dsrl.runtime.stop) is a run error naming that rank, raised on every rank."""
        latest = latest_complete_tag(self.ckpt_dir)
        where = (f"at optimizer step {self.rl.optimizer_steps}, a mini-batch boundary inside rollout "
                 f"{self.rollout_index + 1} (the rest of it and a checkpoint did not fit in run.stop_grace_s)"
                 if mid_rollout else f"after rollout {self.rollout_index} with a committed checkpoint")
        last = os.path.join(self.ckpt_dir, latest) if latest else "none"
        if self.stop.peer_ended:
            who = (self.stop.ended or self.peers.obituary()
                   or "a rank of another host has ended (named in the messages of that host's ranks)")
            raise RunError(f"{who}; the launcher stopped the job ({self.stop.reason}) and the run stopped {where}; the "
                           f"last committed checkpoint is {last}; resume with --resume auto once every rank is healthy",
                           agreed=True)
        if self.rank != 0:
            return
        log.warning("stopped on request (%s) %s; the last committed checkpoint is %s; continue with --resume auto",
                    self.stop.reason, where, last)

    def _supervised_warmup(self, bar: Any) -> None:
        """The optional dsrl.sft phase (dsrl/rl/sft.py): policy steps on reference answers before rollout 1."""
        from dsrl.rl.sft import SupervisedWarmup

        t0, first = time.perf_counter(), []

        def on_step(step: int, res: Any) -> None:
            if bar is not None and res["step_applied"]:
                bar.update(1)
            first.append(res["loss"])
            rec = {"sft_step": step, "call": step, "optimizer_step": res["optimizer_step"],
                   **{k: res[k] for k in ("loss", "grad_norm", "lr", "tokens", "token_accuracy", "step_s") if k in res}}
            self.metrics.write("sft", rec, res["optimizer_step"])

        d = self.d
        SupervisedWarmup(d.sft, self.plan, self.rl, self.tokenizer, self.prompt_source, data=d.data, rollout=d.rollout,
                         seed=d.run.seed).run(on_step)
        if self.rank == 0:
            log.info("supervised warm-up: %d steps, loss %.3f -> %.3f, %.1fs", self.d.sft.steps, first[0], first[-1],
                     time.perf_counter() - t0)


def _match_deepspeed_precision(ds_config: dict[str, Any], dtype: torch.dtype) -> None:
    """A bf16 model trains with DeepSpeed's bf16 mode (fp32 master weights), unless the user said otherwise."""
    if dtype == torch.bfloat16:
        bf16 = ds_config.setdefault("bf16", {})
        if isinstance(bf16, dict) and bf16.get("enabled", "auto") == "auto":
            bf16["enabled"] = True
