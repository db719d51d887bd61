"""The run's parts, built by one function: :func:`build_run` -> :class:`RunParts`.

The order is the contract:

1. stop requests are handled from the start (:class:`dsrl.runtime.stop.StopControl`: during start-up a request
   aborts at once), then the process group is joined within ``run.join_timeout_s``;
2. every check that needs no collective work runs on every rank of the job (:func:`check_run`: the tokenizer, the
   prompts, the reward function and environment, the whole run file with its DeepSpeed half, the policy model,
   the rollout backend this rank builds, the MoE settings), and the ranks agree on the outcome (generator ranks
   included), so a configuration error is printed once, by rank 0, together with every other rank's, before
   anything is touched on disk or built collectively;
3. the output directory (lock, refusals, the verified checkpoint to continue from) and its free space;
4. the run's context (:class:`dsrl.runtime.context.RunContext`: rank, world, stop control, the watch of phase ends,
   the phase clock, the peers), which every long-lived part shares;
5. the components, each from its own sections and the plan, handed their collaborators through constructors:
   the policy actor (engine, KL reference, MoE routing, loss), the reward model, the critic (the training engines
   and frozen models registered with the memory offload, ``dsrl.memory``), the rollout backend
   (or the generators' remote one), the scorer, the multi-turn runner, the experience maker, the run state and
   its checkpointer; then the resume, the metrics writer positioned after it, and the evaluator (``dsrl.eval``,
   whose prompts were loaded and checked with the others in step 2).

Every rank builds the same parts from the same run file; weights are identical on every rank because the run seed
is set before any model is built.
"""

from __future__ import annotations

import logging
import os
import random
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from transformers import PreTrainedTokenizerBase

from dsrl import algos
from dsrl.backends.deepspeed.engine import EngineSpec, ensure_distributed, on_gpu
from dsrl.backends.deepspeed.offload import StateOffload
from dsrl.checkpoint.output_lock import release_all
from dsrl.checkpoint.run_dir import RunDir, check_free_space, open_run_dir
from dsrl.config import Config, ConfigError, load_config
from dsrl.core import collectives
from dsrl.core.errors import RunError
from dsrl.core.plan import BatchPlan
from dsrl.core.routes import MoELayout
from dsrl.core.seeds import derived_seed
from dsrl.rl.critic import Critic, NoCritic
from dsrl.rl.data.evalset import EvalPrompts, prompts_per_call
from dsrl.rl.data.prompts import PromptSource, describe_rendering
from dsrl.rl.disagg.roles import Role
from dsrl.rl.empty_rollouts import EmptyRollouts
from dsrl.rl.episodes.environment import EnvironmentCaller
from dsrl.rl.evaluation import EvalSettings, Evaluator
from dsrl.rl.experience import ExperienceMaker, ExperienceSettings
from dsrl.rl.policy.actor import ActorSettings, PolicyActor
from dsrl.rl.policy.rollout_side import RolloutSide, RolloutSideSettings
from dsrl.rl.rewards.contract import RewardCaller
from dsrl.rl.rewards.scoring import Scorer
from dsrl.rl.run.checkpointer import Checkpointer
from dsrl.rl.run.engines import (
    MegatronSpec,
    build_critic,
    engine_builder,
    final_model_writer,
    prepare_critic,
    prepare_engine,
    rollout_backend,
)
from dsrl.rl.run.state import RunState
from dsrl.rl.run.stopping import StopPolicy
from dsrl.rollout.base import RolloutBackend
from dsrl.runtime.context import RunContext
from dsrl.runtime.metrics import MetricsWriter
from dsrl.runtime.peers import Peers
from dsrl.runtime.phases import PhaseClock, resident_mib
from dsrl.runtime.stop import StopControl
from dsrl.runtime.watchdog import PhaseWatch, Watch

log = logging.getLogger("dsrl.rl.trainer")


@dataclass
class RunParts:
    """Everything a training run is made of, built by :func:`build_run` (module docstring)."""

    cfg: Config
    role: Role | None  # this rank's role in a disaggregated job (None: colocated)
    context: RunContext  # rank, world, stop control, watch, phase clock and peers, shared by the parts
    run_dir: RunDir
    plan: BatchPlan
    tokenizer: PreTrainedTokenizerBase
    prompts: PromptSource
    actor: PolicyActor
    critic: Critic | NoCritic
    backend: RolloutBackend
    experience: ExperienceMaker
    memory: StateOffload
    state: RunState
    checkpointer: Checkpointer
    stop_policy: StopPolicy
    metrics: MetricsWriter
    resumed: bool
    evaluator: Evaluator

    @property
    def rank(self) -> int:
        return self.context.rank

    @property
    def world(self) -> int:
        return self.context.world

    @property
    def stop(self) -> StopControl:
        return self.context.required_stop()

    @property
    def peers(self) -> Peers:
        return self.context.required_peers()

    @property
    def watch(self) -> PhaseWatch:
        return self.context.watch

    @property
    def phases(self) -> PhaseClock:
        return self.context.phases

    def close(self) -> None:
        """Releases what the run holds, in this order: its metrics files, the rollout backend, the signal handlers
        and the run directory's lock. Called once, when the run ends (normally or not)."""
        self.metrics.close()
        self.backend.close()
        self.stop.uninstall()
        self.run_dir.release()


@dataclass
class CheckedRun:
    """What :func:`check_run` found and built without collective work."""

    side: RolloutSide
    prompts: PromptSource
    reward_fn: RewardCaller | None
    environment: EnvironmentCaller | None
    spec: EngineSpec | MegatronSpec
    critic_spec: EngineSpec | MegatronSpec | None
    moe_layout: MoELayout | None
    eval_prompts: EvalPrompts | None  # None: no evaluation during training (eval.every = 0)
    baseline_mib: float | None = None  # the process's resident memory before the model was built


def check_run(cfg: Config, world: int, gpu: bool, role: Role | None) -> CheckedRun:
    """Everything that can refuse the run without collective work, in this order: the tokenizer, prompts, reward
    function and environment, the whole run file (the plan, the ds_config, the layout: checked once, before the
    model is built, and the plan, ds_config and schedule made here are the ones the engine is built from), the
    policy model (one build of the rollout side) and, colocated, the rollout backend this rank will build (a
    generator rank checks the one it builds itself); the MoE settings on every rank; the evaluation prompts
    (``eval.every`` > 0)."""
    from dsrl.rl.episodes.environment import load_environment
    from dsrl.rl.policy.model import resolve_dtype
    from dsrl.rl.rewards.functions import load_reward_fn

    d = cfg.dsrl
    side = RolloutSide(RolloutSideSettings.of(d), gpu)
    prompts = PromptSource.load(d.data, d.batch.prompts_per_rollout, d.run.seed, d.run.last_rollout, side.tokenizer)
    reward_fn = load_reward_fn(d.data) if d.data.has_rule_reward else None
    environment = load_environment(d.data)  # multi-turn rollouts (dsrl.rl.episodes.driver), or None
    match_deepspeed_precision(cfg.ds_config, resolve_dtype(d.model.dtype, gpu))
    spec = prepare_engine(cfg, world, len(prompts), gpu)  # dsrl.engine.kind chooses (dsrl.rl.run.engines)
    critic_spec = prepare_critic(cfg, world, len(prompts), gpu)  # None: no critic
    side.check_context_length()  # from the model's config, before its weights are read
    baseline = resident_mib()  # the CPU's measure of what the run allocates is relative to this
    side.build_model()
    if role is None:
        side.check()
    moe = side.check_moe()
    eval_prompts = None
    if d.eval.every:
        from dsrl.rl.data.evalset import load_eval_prompts

        eval_prompts = load_eval_prompts(d.eval, d.data, d.run.seed, side.tokenizer, train_records=prompts.records,
                                         asked_by=f"dsrl.eval.every = {d.eval.every}")
    return CheckedRun(side, prompts, reward_fn, environment, spec, critic_spec, moe, eval_prompts, baseline)


def build_run(config: str | dict[str, Any] | Config, overrides: dict[str, Any] | None = None,
              resume: str | None = None, role: Role | None = None) -> RunParts:
    """Every part of a training run on this rank (module docstring). ``resume`` overrides ``run.resume``;
    ``role``: this rank's :class:`dsrl.rl.disagg.roles.Role` in a disaggregated job (made by
    :func:`dsrl.rl.disagg.roles.split_world`, which every rank calls first), None when colocated."""
    cfg = load_config(config, overrides)
    d = cfg.dsrl
    if resume is not None:
        d.run.resume = resume
    stop = StopControl(d.run.stop_grace_s, before_exit=release_all)  # signals and the launcher's death, from here on
    stop.install()
    ensure_distributed(d.run.join_timeout_s, d.run.collective_timeout_s)
    rank, world, gpu = dist.get_rank(), dist.get_world_size(), on_gpu()
    # Every rank's host and process, so that a rank that ended is named by role, rank and host whichever side
    # notices first (dsrl.runtime.peers): the job's store when disaggregated (generators included), else the
    # default group's.
    peers = role.peers if role is not None else Peers.of_default_group()
    assert peers is not None  # split_world publishes a disaggregated job's
    torch.manual_seed(d.run.seed)  # identical initial weights on every rank
    random.seed(derived_seed(d.run.seed, rank))

    problem: ConfigError | RunError | None = None
    checked: CheckedRun | None = None
    try:
        checked = check_run(cfg, world, gpu, role)
    except (ConfigError, RunError) as e:
        problem = e
    if role is not None:
        role.agree(problem)  # with the generator ranks (dsrl.rl.disagg.roles)
    else:
        collectives.agree(problem)
    assert checked is not None  # agree() raised every rank's problem
    side, tok, prompts = checked.side, checked.side.tokenizer, checked.prompts

    run_dir = open_run_dir(d.run, checksums=d.run.checkpoint_checksums)
    run_dir.check_adapters(d.model.lora)  # the checkpoint's adapters are this run's (before the engine)
    check_free_space(run_dir, side.model, d.run)

    # seconds, tokens and peak memory per phase (dsrl.runtime.phases); phase ends bounded, missing ranks named, waits
    # reported (dsrl.runtime.watchdog): with the rank, the stop control and the peers, the context every part shares
    phases = PhaseClock(get_accelerator(), checked.baseline_mib)
    watch = Watch(d.run.collective_timeout_s, d.run.wait_report_s, peers=peers)
    context = RunContext(rank, world, stop, watch, phases, peers)
    memory = StateOffload(d.memory)  # training state and frozen models off the device between their phases
    algo = algos.resolve_algorithm(d.algorithm)
    actor = PolicyActor.build(side.model, engine_builder(checked.spec), d.model, ActorSettings.of(d), algo,
                              moe=checked.moe_layout is not None, phases=phases, frozen_offload=memory.frozen)
    memory.add_engine(actor.engine)  # the policy's training state first (the critic's after the frozen models)
    plan = actor.engine.plan
    reward_model = None
    if d.data.reward_model:
        from dsrl.rl.rewards.model import RewardModel

        reward_model = RewardModel.load(d.data.reward_model, tok, actor.engine, on_gpu=gpu,
                                        micro_batch_size=d.rollout.logprob_micro_batch_size, offload=memory.frozen)
    critic = build_critic(checked.critic_spec, tok, seed=d.run.seed, phases=phases)  # the value model, or NO_CRITIC
    for critic_engine in critic.companions().values():
        memory.add_engine(critic_engine)
    backend: RolloutBackend
    if role is not None:  # completions come from the generator ranks (dsrl.rl.disagg.remote)
        from dsrl.rl.disagg.remote import RemoteRolloutBackend

        backend = RemoteRolloutBackend(role, actor.engine, d.rollout, d.run, d.memory, plan, prompts, stop)
    else:
        backend = rollout_backend(checked.spec, side, actor.engine, plan.prompts_per_rank)
    episodes = None
    if checked.environment is not None:  # multi-turn rollouts (dsrl.rl.episodes.driver)
        from dsrl.rl.episodes.driver import EpisodeRunner
        from dsrl.rl.episodes.environment import ObservationEncoder

        episodes = EpisodeRunner(backend, tok, checked.environment, ObservationEncoder(tok, d.data.chat_template),
                                 d.rollout.max_turns, d.rollout.max_trajectory_tokens, actor.view, actor.device,
                                 context)
    from dsrl.rl.rewards.functions import load_accuracy_fn

    scorer = Scorer(d.data, tok, checked.reward_fn, load_accuracy_fn(d.data), reward_model)
    experience = ExperienceMaker(ExperienceSettings.of(d), plan, actor, backend, prompts, scorer, algo,
                                 tok.pad_token_id, critic=critic, episodes=episodes, context=context)
    state = RunState(prompts.sampler, EmptyRollouts(d.run.max_empty_rollouts))
    checkpointer = Checkpointer(actor, critic, state, run_dir, d.run, d.model, tok, context=context, memory=memory,
                                live_export=final_model_writer(checked.spec, side, actor.engine, tok))
    resumed = checkpointer.resume()
    metrics = MetricsWriter(d.run.output_dir, rank, actor.engine.monitor,
                            resume_at=(state.rollout, actor.engine.optimizer_steps) if resumed else None)
    # Held-out evaluation: the run's backend under the evaluation's sampling, each call as many sequences as a
    # training call (continuous batching's bounds), its progress in the run's state (dsrl.rl.evaluation).
    per_call = prompts_per_call(plan.prompts_per_rank, plan.samples_per_prompt, d.eval.samples_per_prompt)
    evaluator = Evaluator(EvalSettings.of(d, plan.rollouts), checked.eval_prompts, backend, scorer, tok, actor.view,
                          actor.device, per_call, context=context, episodes=episodes, metrics=metrics,
                          progress=state.evaluation, samples_path=os.path.join(d.run.output_dir, "eval_samples.jsonl"))
    if rank == 0 and len(prompts):  # what the model sees (the chat template's own system prompt), what ends a turn
        from dsrl.rollout.base import stop_token_ids

        stops = stop_token_ids(tok, side.weights(), d.rollout)
        log.info("%s; a completion ends at %s", describe_rendering(tok, prompts.records[0]["prompt"], d.data),
                 " or ".join(f"{tok.convert_ids_to_tokens(i)!r} (id {i})" for i in stops))
    if rank == 0 and checked.eval_prompts is not None:
        log.info("evaluation every %d rollouts on %s", d.eval.every, evaluator.describe())
        if checked.eval_prompts.overlap:
            log.warning("dsrl.eval: the evaluation prompts are not held out: %s; they are the task's whole prompt "
                        "space (set dsrl.data.size lower to hold some out, or dsrl.eval.path to prompts of your own)",
                        checked.eval_prompts.overlap)
    return RunParts(cfg, role, context, run_dir, plan, tok, prompts, actor, critic, backend, experience, memory,
                    state, checkpointer, StopPolicy.of(d.run, plan.rollouts), metrics, resumed, evaluator)


def match_deepspeed_precision(ds_config: dict[str, Any], dtype: torch.dtype) -> None:
    """A bf16 model trains with DeepSpeed's bf16 mode (fp32 master weights), unless the user said otherwise."""
    if dtype == torch.bfloat16:
        bf16 = ds_config.setdefault("bf16", {})
        if isinstance(bf16, dict) and bf16.get("enabled", "auto") == "auto":
            bf16["enabled"] = True
