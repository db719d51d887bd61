"""The one place of :mod:`dsrl.rl` that chooses the training engine (ARCHITECTURE §4, "(engine)").

Every other room and module of the application works on the :class:`dsrl.core.engine.TrainEngine` protocol: the
policy actor receives a function that makes its engine of the model, the critic receives its engine, the reward
model and the KL reference are placed by the policy's engine (:meth:`TrainEngine.frozen`), and a generator rank
receives what it needs to know of the trainers' engine (the data-parallel replicas its calls serve, whether the
accelerator is a GPU). ``dsrl.engine.kind`` chooses, here and nowhere else:

- ``"deepspeed"``: :func:`dsrl.backends.deepspeed.engine.prepare` / ``initialize`` (an :class:`EngineSpec`);
- ``"megatron"``: a :class:`MegatronSpec` (the plan over ``world / (TP x PP)`` replicas, megatron-core's optimizer of
  the ds_config's, dsrl's schedule of the run file: the same learning rate at every step as on DeepSpeed), and
  :func:`dsrl.backends.megatron.engine.build_engine` of the policy's HF model, which stays on every rank as the
  rollout model's replica (:func:`rollout_backend`).

tests/unit/test_layout.py holds every other module of ``dsrl.rl`` to that.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dsrl.backends.deepspeed.config import data_parallel_size
from dsrl.backends.deepspeed.engine import EngineSpec, initialize, on_gpu, prepare
from dsrl.backends.deepspeed.schedule import PlannedScheduler, ScheduleSpec
from dsrl.config import Config, ConfigError
from dsrl.config.engine import MEGATRON_ENGINE
from dsrl.rl.critic import NO_CRITIC, Critic, NoCritic, build_value_model, critic_config
from dsrl.runtime.phases import PhaseClock

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch
    from transformers import PreTrainedTokenizerBase

    from dsrl.core.engine import TrainEngine
    from dsrl.core.plan import BatchPlan
    from dsrl.rl.disagg.generator import GeneratorWorker
    from dsrl.rl.disagg.roles import Role
    from dsrl.rl.policy.rollout_side import RolloutSide
    from dsrl.rollout.base import RolloutBackend


@dataclass(frozen=True)
class MegatronSpec:
    """Everything the Megatron engine is built from besides the model, derived and checked once per run
    (:func:`prepare_engine`): the plan over the data-parallel replicas, the resolved ds_config (its monitors), dsrl's
    schedule, megatron-core's layout and optimizer settings."""

    config: Config
    plan: BatchPlan
    ds_config: dict[str, Any]
    schedule: ScheduleSpec
    layout: Any  # dsrl.backends.megatron.engine.MegatronLayout
    settings: Any  # dsrl.backends.megatron.engine.OptimizerSettings
    on_gpu: bool


def prepare_engine(cfg: Config, world: int, dataset_size: int | None, gpu: bool) -> EngineSpec | MegatronSpec:
    """The policy engine's spec of the run file on ``world`` ranks, before any model exists: every configuration
    error of its engine is raised here, naming its field."""
    if cfg.dsrl.engine.kind != MEGATRON_ENGINE:
        return prepare(cfg, world_size=world, dataset_size=dataset_size, on_gpu=gpu)
    from dsrl.backends.megatron.deps import require_megatron
    from dsrl.backends.megatron.run_file import layout_of, optimizer_settings

    require_megatron()
    engine = cfg.dsrl.engine
    replica = engine.model_parallel_size
    if world % replica:
        raise ConfigError(f"dsrl.engine: tensor_model_parallel_size x pipeline_model_parallel_size x "
                          f"context_parallel_size = {replica} ranks "
                          f"per model replica does not divide the job's {world} ranks. Fix: launch a multiple of "
                          f"{replica} ranks, or change the sizes.")
    import torch

    from dsrl.rl.policy.model import resolve_dtype

    settings = optimizer_settings(cfg.ds_config, bf16=resolve_dtype(cfg.dsrl.model.dtype, gpu) == torch.bfloat16)
    # The run file as the DeepSpeed engine reads it (the plan, the ds_config checked by DeepSpeed's own classes, the
    # schedule), over the Megatron engine's data-parallel replicas: DeepSpeed's mpu interface says how many.
    # megatron-core owns the precision (settings.bf16): DeepSpeed only plans, schedules and reads the monitors here
    planned = Config(ds_config={k: v for k, v in cfg.ds_config.items() if k not in ("bf16", "fp16")},
                     dsrl=cfg.dsrl.model_copy(update={"model": cfg.dsrl.model.model_copy(update={"dtype": "float32"})}),
                     source=cfg.source)
    shared = prepare(planned, world_size=world, mpu=_DataParallelReplicas(world // replica), dataset_size=dataset_size,
                     on_gpu=gpu)
    return MegatronSpec(cfg, shared.plan, shared.ds_config, shared.schedule, layout_of(engine), settings, gpu)


class _DataParallelReplicas:
    """What DeepSpeed's config reads of an mpu: the number of data-parallel replicas."""

    def __init__(self, replicas: int):
        self.replicas = replicas

    def get_data_parallel_world_size(self) -> int:
        return self.replicas


class PlannedParamScheduler:
    """dsrl's schedule (:class:`PlannedScheduler`: the ds_config's ``"scheduler"`` or ``dsrl.scheduler`` over the
    plan's horizon) in the shape megatron's step drives (:class:`dsrl.backends.megatron.schedule.SchedulerDriver`:
    ``step(increment)``, ``num_steps``, ``state_dict``), so optimizer step k has the LR it has on DeepSpeed."""

    def __init__(self, planned: PlannedScheduler):
        self.planned = planned

    @property
    def num_steps(self) -> int:
        return self.planned.steps

    @num_steps.setter
    def num_steps(self, value: int) -> None:  # the driver resets the position before a load
        self.planned.steps = int(value)

    def step(self, increment: int = 1) -> None:
        for _ in range(int(increment)):
            self.planned.step()

    def state_dict(self) -> dict[str, Any]:
        return self.planned.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.planned.load_state_dict(state)


def _torch_optimizer(optimizer: Any) -> Any:
    """The torch optimizer under megatron-core's wrapper (its param groups carry the LR the step uses)."""
    import torch

    inner = getattr(optimizer, "optimizer", None)
    if not isinstance(inner, torch.optim.Optimizer):
        raise RuntimeError(f"megatron-core built a {type(optimizer).__name__} with no single torch optimizer under it "
                           "(several parameter groups of different kinds?); dsrl's schedule drives one")
    return inner


def _build_megatron(model: torch.nn.Module, spec: MegatronSpec) -> TrainEngine:
    """The policy's Megatron engine: megatron-core's parallel state of the layout first (the critic's engine, built
    after it, shares it)."""
    from deepspeed.monitor.config import get_monitor_config
    from deepspeed.monitor.monitor import MonitorMaster

    from dsrl.backends.megatron.engine import initialize_parallel

    initialize_parallel(spec.layout, seed=spec.config.dsrl.run.seed)
    engine = _megatron_engine(model, spec, value_model=False)
    engine.monitor = MonitorMaster(get_monitor_config(spec.ds_config))
    return engine


def _megatron_engine(model: torch.nn.Module, spec: MegatronSpec, value_model: bool) -> Any:
    from dsrl.backends.megatron.engine import build_engine

    return build_engine(model.config, model.state_dict(), spec.plan, spec.layout, spec.settings, on_gpu=spec.on_gpu,
                        scheduler_of=lambda opt: PlannedParamScheduler(PlannedScheduler(spec.schedule,
                                                                                        _torch_optimizer(opt))),
                        value_model=value_model)


def engine_builder(spec: EngineSpec | MegatronSpec) -> Callable[[torch.nn.Module], TrainEngine]:
    """``build(model)``: the policy's training engine of ``model``, from the run's checked spec. The Megatron engine
    copies the model's weights into its shards and leaves ``model`` itself as the rollout model."""
    if isinstance(spec, MegatronSpec):
        return functools.partial(_build_megatron, spec=spec)
    return functools.partial(initialize, config=spec)


def rollout_backend(spec: EngineSpec | MegatronSpec, side: RolloutSide, engine: TrainEngine,
                    prompts_per_call: int) -> RolloutBackend:
    """The colocated run's rollout backend: on DeepSpeed it generates with the engine (its own module); on Megatron
    with the rollout side's HF model, a full replica on every rank whose ``sync_weights`` copies
    :meth:`MegatronEngine.hf_weights` into it whenever the engine has stepped (:class:`dsrl.rollout.replica.
    ReplicaSync`)."""
    if not isinstance(spec, MegatronSpec):
        return side.backend(engine, prompts_per_call)
    from dsrl.rollout.replica import ReplicaSync

    hf_weights = engine.hf_weights  # type: ignore[attr-defined]  # MegatronEngine's
    replica = side.on_generator_device() if spec.on_gpu else side.model  # not run on a GPU yet
    return ReplicaSync(side.backend(replica, prompts_per_call), replica, hf_weights, lambda: engine.optimizer_steps)


def prepare_critic(cfg: Config, world_size: int, dataset_size: int | None,
                   on_gpu: bool) -> EngineSpec | MegatronSpec | None:
    """The critic's engine spec: its half of the run file (:func:`dsrl.rl.critic.critic_config`) validated as the
    policy's is (DeepSpeed's own classes, the schedule with the critic's horizon; on the engine of
    ``dsrl.engine.kind``, the policy's), once, before any model is built; None when the algorithm trains no value
    model (the one place that decides)."""
    if not cfg.dsrl.has_critic:
        return None
    ccfg = critic_config(cfg)  # AutoTP and Ulysses are refused with the run file (dsrl.config.support)
    try:
        return prepare_engine(ccfg, world_size, dataset_size, on_gpu)
    except ConfigError as e:
        raise ConfigError(f"the critic's run file (the policy's with dsrl.critic swapped in): {e}") from None


def build_critic(spec: EngineSpec | MegatronSpec | None, tokenizer: PreTrainedTokenizerBase, seed: int,
                 phases: PhaseClock | None = None) -> Critic | NoCritic:
    """The run's critic from :func:`prepare_critic`'s spec (its engine over the value model, seeded like the policy),
    or :data:`dsrl.rl.critic.NO_CRITIC` when it gave none. On Megatron the critic's engine is built after the
    policy's, in the parallel state the policy's set up (the same layout: the critic's run file keeps
    ``dsrl.engine``)."""
    if spec is None:
        return NO_CRITIC
    model = build_value_model(spec.config, tokenizer, spec.on_gpu, seed=seed)
    if isinstance(spec, MegatronSpec):
        engine = _megatron_engine(model, spec, value_model=True)
        del model  # the engine holds its shards; the HF value model is not used again
    else:
        engine = initialize(model, spec)
    return Critic(engine, spec.config.dsrl.critic.value_clip, phases)


def start_generator(cfg: Config, role: Role) -> GeneratorWorker:
    """A generator rank's worker (:meth:`dsrl.rl.disagg.generator.GeneratorWorker.start`), told the trainers'
    data-parallel replicas (read after the ranks agreed on the run file: it may refuse it) and the accelerator."""
    from dsrl.rl.disagg.generator import GeneratorWorker

    def replicas() -> int:
        return data_parallel_size(cfg.ds_config, role.trainers)

    return GeneratorWorker.start(cfg, role, on_gpu=on_gpu(), trainer_replicas=replicas)


def final_model_writer(spec: EngineSpec | MegatronSpec, side: RolloutSide, engine: TrainEngine,
                       tokenizer: PreTrainedTokenizerBase) -> Callable[[str], None] | None:
    """How ``run.export_final`` writes the Megatron engine's final model (None on DeepSpeed, whose checkpoints export
    offline): every rank copies the engine's weights into the rollout side's HF model (a collective stream), and rank
    0 saves that model and the tokenizer to ``out`` (:func:`dsrl.checkpoint.export.write_model_dir`); a failure
    there (a full disk) reaches every rank as a RunError (:func:`dsrl.core.collectives.on_rank0`)."""
    if not isinstance(spec, MegatronSpec):
        return None

    def write(out: str) -> None:
        from dsrl.checkpoint.export import write_model_dir
        from dsrl.core import collectives
        from dsrl.rollout.replica import copy_weights

        copy_weights(side.model, engine.hf_weights())  # type: ignore[attr-defined]  # MegatronEngine's
        collectives.on_rank0(lambda: write_model_dir(side.model, out, tokenizer.save_pretrained))

    return write
