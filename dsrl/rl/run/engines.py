"""The one place of :mod:`dsrl.rl` that chooses the training engine (ARCHITECTURE §4, "(engine)").

Every other room and module of the application works on the :class:`dsrl.core.engine.TrainEngine` protocol: the
policy actor receives a function that makes its engine of the model, the critic receives its engine, the reward
model and the KL reference are placed by the policy's engine (:meth:`TrainEngine.frozen`), and a generator rank
receives what it needs to know of the trainers' engine (the data-parallel replicas its calls serve, whether the
accelerator is a GPU). Today the engine is DeepSpeed's (:mod:`dsrl.backends.deepspeed`); a second engine is chosen
here and nowhere else. tests/unit/test_layout.py holds every other module of ``dsrl.rl`` to that.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from dsrl.backends.deepspeed.config import data_parallel_size
from dsrl.backends.deepspeed.engine import EngineSpec, initialize, on_gpu, prepare
from dsrl.config import Config, ConfigError
from dsrl.rl.critic import NO_CRITIC, Critic, NoCritic, build_value_model, critic_config
from dsrl.runtime.phases import PhaseClock

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch
    from transformers import PreTrainedTokenizerBase

    from dsrl.core.engine import TrainEngine
    from dsrl.rl.disagg.generator import GeneratorWorker
    from dsrl.rl.disagg.roles import Role


def engine_builder(spec: EngineSpec) -> Callable[[torch.nn.Module], TrainEngine]:
    """``build(model)``: the policy's training engine of ``model``, from the run's checked :class:`EngineSpec`."""
    return functools.partial(initialize, config=spec)


def prepare_critic(cfg: Config, world_size: int, dataset_size: int | None, on_gpu: bool) -> EngineSpec | None:
    """The critic's :class:`EngineSpec`: its half of the run file (:func:`dsrl.rl.critic.critic_config`) validated as
    the policy's is (DeepSpeed's own classes, the schedule with the critic's horizon), once, before any model is
    built; None when the algorithm trains no value model (the one place that decides)."""
    if not cfg.dsrl.has_critic:
        return None
    ccfg = critic_config(cfg)  # AutoTP and Ulysses are refused with the run file (dsrl.config.support)
    try:
        return prepare(ccfg, world_size=world_size, dataset_size=dataset_size, on_gpu=on_gpu)
    except ConfigError as e:
        raise ConfigError(f"the critic's run file (the policy's with dsrl.critic swapped in): {e}") from None


def build_critic(spec: EngineSpec | None, tokenizer: PreTrainedTokenizerBase, seed: int,
                 phases: PhaseClock | None = None) -> Critic | NoCritic:
    """The run's critic from :func:`prepare_critic`'s spec (its engine over the value model, seeded like the policy),
    or :data:`dsrl.rl.critic.NO_CRITIC` when it gave none."""
    if spec is None:
        return NO_CRITIC
    model = build_value_model(spec.config, tokenizer, spec.on_gpu, seed=seed)
    return Critic(initialize(model, spec), spec.config.dsrl.critic.value_clip, phases)


def start_generator(cfg: Config, role: Role) -> GeneratorWorker:
    """A generator rank's worker (:meth:`dsrl.rl.disagg.generator.GeneratorWorker.start`), told the trainers'
    data-parallel replicas (read after the ranks agreed on the run file: it may refuse it) and the accelerator."""
    from dsrl.rl.disagg.generator import GeneratorWorker

    def replicas() -> int:
        return data_parallel_size(cfg.ds_config, role.trainers)

    return GeneratorWorker.start(cfg, role, on_gpu=on_gpu(), trainer_replicas=replicas)
