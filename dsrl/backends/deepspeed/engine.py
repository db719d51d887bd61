"""RLEngine: one exact optimizer step per mini-batch on top of a DeepSpeedEngine.

``train_mini_batch(micro_batches, loss_fn)`` keeps the invariants of :mod:`dsrl.core.step` (global
counts in one collective before the first backward, zero-weight fillers so every rank runs the same
number of forwards and backwards, the exact weights, the all-rank non-finite skip, metric token
means, the step counters). What is DeepSpeed's (architecture §3, §7):

- each micro-batch backward is ``engine.backward(D * sum_{t in micro} w_t l_t, scale_wrt_gas=False)``
  with D the engine's real averaging factor (:func:`dsrl.backends.deepspeed.view.deepspeed_view`), so that its
  average over D ranks applies exactly the gradient of L_M;
- ``engine.step()`` runs exactly once; dsrl's LR schedule advances only if
  ``engine.was_step_applied()``;
- ZeRO-0 has no overflow check of its own: local gradients are checked too, and a non-finite step is
  dropped (``zero_grad``) on every rank; on ZeRO 1-3 the engine's own overflow check skips it (and
  dsrl raises if an update was applied anyway).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from dsrl.backends.deepspeed import cpu_shm, hooks
from dsrl.backends.deepspeed.apex import apex_adam_for
from dsrl.backends.deepspeed.autoep import ensure_transformers_compat, expert_parallel_enabled
from dsrl.backends.deepspeed.autotp import (
    check_model_for_tensor_parallel,
    declare_vocab_shard_of,
    tensor_parallel_size,
)
from dsrl.backends.deepspeed.config import data_parallel_size
from dsrl.backends.deepspeed.frozen import FrozenModel, frozen_engine
from dsrl.backends.deepspeed.offload import require_resident
from dsrl.backends.deepspeed.schedule import PlannedScheduler, ScheduleSpec
from dsrl.backends.deepspeed.validation import accelerator_is_gpu, validated_deepspeed_config
from dsrl.backends.deepspeed.view import deepspeed_view
from dsrl.config import Config, ConfigError, load_config
from dsrl.core import launchers, rendezvous, timeouts
from dsrl.core.engine import TokenLossFn, micro_batch_loss
from dsrl.core.errors import RunError
from dsrl.core.parallel import ParallelView
from dsrl.core.plan import BatchPlan
from dsrl.core.step import Log, MicroBatch, MiniBatchCounts, StepCore, StepInputs, StepResult, Update

LossFn = Callable[[Any, MicroBatch], "torch.Tensor | tuple[torch.Tensor, dict[str, torch.Tensor]]"]


def ensure_distributed(join_timeout_s: float | None = None, collective_timeout_s: float | None = None) -> None:
    """Initialise torch.distributed and DeepSpeed's communication backend; a plain ``python`` run
    becomes 1 rank.

    The launcher's variables are read first (:func:`dsrl.core.launchers.adopt`: DeepSpeed's launcher and pdsh,
    torchrun, Slurm's srun, OpenMPI's mpirun), then every rank checks in with rank 0 before any work
    (:func:`dsrl.core.rendezvous.check_in`), bounded by ``join_timeout_s`` (else ``$DSRL_INIT_TIMEOUT_S``, else
    :data:`dsrl.core.timeouts.DEFAULT_JOIN_TIMEOUT_S`, a minute): a host that never starts its ranks ends the whole
    job with one sentence naming the host, the launcher and the fix, instead of the launcher's 10-minute or
    DeepSpeed's 30-minute wait. DeepSpeed then builds the default group on that same store. Afterwards every
    collective of the default group is bounded by ``collective_timeout_s`` when given (:mod:`dsrl.core.timeouts`).
    On the CPU accelerator each rank uses its share of the host's cores as intra-op threads unless
    ``OMP_NUM_THREADS`` says otherwise (:func:`dsrl.core.launchers.cpu_threads_per_rank`), and the shared-memory
    all-reduce segments DeepSpeed creates are checked for room before and unlinked after
    (:mod:`dsrl.backends.deepspeed.cpu_shm`), with a watcher process that removes them even if the start-up is
    interrupted, so no job leaks ``/dev/shm``.
    """
    import deepspeed

    kwargs = {}
    cleaner = None
    starting = not dist.is_initialized()
    if starting:
        from datetime import timedelta

        launch = launchers.adopt()
        threads = launchers.cpu_threads_per_rank(launch.local_size) if not on_gpu() else None
        if threads is not None:  # the CPU accelerator, OMP_NUM_THREADS unset: the host's cores shared out
            torch.set_num_threads(threads)
        bound = timeouts.join_timeout_s(join_timeout_s)
        store = rendezvous.check_in(launch, bound)
        kwargs.update(timeout=timedelta(seconds=bound), init_method=rendezvous.init_method(store, launch))
        if launch.world_size == launch.local_size:
            cpu_shm.check_room(launch.local_size)
            cleaner = cpu_shm.arm_cleaner(launch.rank)
    try:
        # Over a process group the caller started, this only builds DeepSpeed's backend (and its shm
        # segments), as deepspeed.initialize would later; either way they are released right here.
        try:
            deepspeed.init_distributed(verbose=False, **kwargs)
        except RuntimeError as e:
            if "timeout" in kwargs and timeouts.looks_like_timeout(e):
                raise RunError(_join_failure(kwargs["timeout"].total_seconds(), e)) from e
            raise
        cpu_shm.release_segments()
    finally:
        if cleaner is not None:
            cleaner.disarm()
    if collective_timeout_s is not None or starting:
        timeouts.set_collective_timeout(collective_timeout_s or timeouts.DEFAULT_COLLECTIVE_TIMEOUT_S)


def _join_failure(seconds: float, exc: BaseException) -> str:
    world, rank = os.environ.get("WORLD_SIZE", "?"), os.environ.get("RANK", "?")
    where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
    first = str(exc).strip().splitlines()[0][:300]
    return (f"rank {rank}: every one of the {world} ranks checked in at {where}, but the process group was not built "
            f"within {seconds:g} s (dsrl.run.join_timeout_s, or ${timeouts.JOIN_TIMEOUT_ENV}); see the other ranks' "
            f"output for one that ended or stalled after checking in. ({first})")


class ReplicaGradNorm:
    """The gradient norm of a ZeRO-0 step, which DeepSpeed 0.19.8 computes but keeps nowhere for a plain optimizer
    (ZeRO 1-3 and its 16-bit optimizers report theirs). In dsrl's unmanaged accumulation ``engine.step()`` all-reduces
    the gradients, clips them with ``clip_fp32_gradients`` (DeepSpeed's ``clip_grad_norm_``, whose return value is
    the norm before clipping) and steps the optimizer: with clipping, the engine's clip call is DeepSpeed's own with
    its result kept; without, an optimizer pre-step hook measures the (averaged, unclipped) gradients. Every replica
    holds whole gradients, so the norm needs no collective. :meth:`take` returns the last step's (None if none)."""

    def __init__(self, engine: Any):
        self.engine, self.norm = engine, None
        if engine.gradient_clipping() > 0:
            engine.clip_fp32_gradients = self._clip
        elif isinstance(engine.optimizer, torch.optim.Optimizer):  # a 16-bit wrapper reports its own norm
            engine.optimizer.register_step_pre_hook(self._measure)

    def _clip(self) -> None:
        from deepspeed.runtime.utils import clip_grad_norm_

        e = self.engine
        self.norm = clip_grad_norm_(parameters=e.module.parameters(), max_norm=e.gradient_clipping(), mpu=e.mpu)

    def _measure(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        grads = [p.grad for p in self.engine.module.parameters() if p.grad is not None]
        self.norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads])) \
            if grads else None

    def take(self) -> Any:
        norm, self.norm = self.norm, None
        return norm


def on_gpu() -> bool:
    """Whether DeepSpeed's accelerator is a GPU (not the CPU accelerator)."""
    return accelerator_is_gpu()


class RLEngine(StepCore):
    """A DeepSpeedEngine whose optimizer step, normalisation and LR schedule dsrl owns: the DeepSpeed
    :class:`dsrl.core.engine.TrainEngine`.

    The step itself is :class:`dsrl.core.step.StepCore`'s; this adapter says how DeepSpeed runs it:
    one ``engine.backward(D * S_w, scale_wrt_gas=False)`` per micro-batch, then one ``engine.step()``.
    """

    def __init__(
        self,
        engine: Any,
        plan: BatchPlan,
        scheduler: PlannedScheduler,
        view: ParallelView,
        config: Config | None = None,
    ):
        super().__init__(view, scheduler, loss_agg=plan.loss_agg, mini_batch_size=plan.mini_batch_size,
                         loss_agg_norm_length=plan.loss_agg_norm_length)
        self.engine = engine
        self.plan = plan
        self.scheduler = scheduler
        self.config = config
        # ZeRO-0 without tensor parallelism: DeepSpeed keeps no gradient norm for a plain optimizer; dsrl reads it
        # where DeepSpeed has the averaged gradients (ReplicaGradNorm)
        self._replica_norm = ReplicaGradNorm(engine) if (self.zero_stage == 0 and view.tensor_parallel_size == 1) \
            else None

    # -- conveniences ---------------------------------------------------------------------------
    @property
    def module(self) -> torch.nn.Module:
        return self.engine.module

    @property
    def device(self) -> torch.device:
        return self.engine.device

    collective_device = device  # counts and metrics are reduced on the engine's device

    @property
    def zero_stage(self) -> int:
        return self.engine.zero_optimization_stage()

    @property
    def monitor(self) -> Any:
        """DeepSpeed's monitor of the run (csv / TensorBoard / wandb / comet, as the ds_config enables them)."""
        return self.engine.monitor

    # -- forwards that are not training steps (dsrl.core.forwards.PolicyForwards) ---------------
    def generation_scope(self) -> contextlib.AbstractContextManager[None]:
        """The full parameters on this rank and none of the engine's hooks for the block (ZeRO-3: one gather on
        entry, collective): :func:`dsrl.backends.deepspeed.hooks.generation_scope`."""
        return hooks.generation_scope(self.engine)

    def no_grad_scope(self) -> contextlib.AbstractContextManager[None]:
        """Forwards without the engine's per-forward hooks for the block (ZeRO-3 still gathers per forward):
        :func:`dsrl.backends.deepspeed.hooks.no_grad_scope`."""
        return hooks.no_grad_scope(self.engine)

    # -- the step -------------------------------------------------------------------------------
    def train_mini_batch(self, micro_batches: Sequence[MicroBatch], loss_fn: LossFn,
                         token_loss_fn: TokenLossFn | None = None) -> StepResult:
        """One optimizer step over a mini-batch given as this rank's micro-batches.

        ``loss_fn(engine, micro)`` runs the forward through the engine and returns per-token losses
        ``[b, t]`` (or ``(losses, metrics)`` with per-token metric tensors ``[b, t]``, reported as
        global token means). dsrl applies the aggregation weights; user code never divides by a count.
        With ``token_loss_fn`` the loss comes in the seam's two parts (:mod:`dsrl.core.engine`): ``loss_fn`` is
        then the forward and ``token_loss_fn(output, micro)`` the per-token loss of its output.
        The result is a :class:`dsrl.core.step.StepResult`, usable as a dict (``res["loss"]``).
        """
        return self.run_step(micro_batches, loss_fn, token_loss_fn)

    def _forward_backward(self, inputs: StepInputs, forward_fn: LossFn,
                          token_loss_fn: TokenLossFn | None) -> tuple[list[Log], torch.Tensor | None]:
        require_resident(self.engine)  # dsrl.memory.offload_states: reloaded before every training phase
        self.engine.train()
        logs = []
        for item in inputs.items:
            s_w, log = self.micro_loss(micro_batch_loss(self.engine, item.micro, forward_fn, token_loss_fn), item)
            self.engine.backward(s_w * self.view.grad_scale, scale_wrt_gas=False)
            logs.append(log)
        # ZeRO-0 has no overflow check of its own: a non-finite local gradient must skip the step too.
        return logs, self._local_grads_nonfinite() if self.zero_stage == 0 else None

    def _update(self, skip: bool, counts: MiniBatchCounts) -> Update:
        lr = self.scheduler.current_lr()
        applied = False
        if skip and self.zero_stage == 0:
            self.engine.zero_grad()  # stage 0 has no overflow check: drop the step on every rank
        else:
            self.engine.step()
            applied = bool(self.engine.was_step_applied())
            if applied and skip:
                raise RuntimeError(
                    "a non-finite loss reached an optimizer update that DeepSpeed applied; the weights may "
                    "hold NaN. Resume from the last complete checkpoint and check rewards/advantages."
                )
        norm = None
        if applied:
            self.scheduler.step()
            norm = self.engine.get_global_grad_norm()
            if norm is None and self._replica_norm is not None:
                norm = self._replica_norm.take()
        return Update(applied, norm, lr)

    def _local_grads_nonfinite(self) -> torch.Tensor:
        grads = [p.grad for p in self.engine.module.parameters() if p.grad is not None]
        if not grads:
            return torch.zeros((), dtype=torch.float64, device=self.device)
        norms = torch._foreach_norm(grads)
        total = torch.stack([n.double() for n in norms]).sum()
        return (~torch.isfinite(total)).double()

    @torch.no_grad()
    def forward_no_grad(self, micro_batches: Sequence[MicroBatch], fn: Callable[[Any, MicroBatch], Any]) -> list[Any]:
        """Run ``fn(engine, micro)`` without gradients on each micro-batch, in eval mode, outside the engine's
        per-forward hooks (:meth:`no_grad_scope`: no timer, no device synchronization).

        Every rank of the token-owning group runs the same number of forwards (ZeRO-3 gathers
        parameters in each forward): ranks with fewer micro-batches run discarded filler forwards.
        """
        micros = list(micro_batches)
        n_max = self.max_micro_batches(len(micros))
        if micros and self._template is None and "loss_mask" in micros[0]:
            self.remember_template(micros[0])
        was_training = self.engine.training
        self.engine.eval()
        try:
            with self.no_grad_scope():
                outs = [fn(self.engine, mb) for mb in micros]
                for filler in self.fillers(micros, n_max):
                    fn(self.engine, filler)
        finally:
            self.engine.train(was_training)
        return outs

    def frozen(self, module: torch.nn.Module, offload: Callable[[Any], Any] | None = None) -> FrozenModel:
        """``module`` frozen and placed like this engine's model (:func:`dsrl.backends.deepspeed.frozen.frozen_engine`:
        under ZeRO-3 an optimizer-less engine sharded like the policy, else a plain module on the device), as a
        no-grad pass runs it. ``offload(placed)`` makes its weights' offload between passes
        (:meth:`dsrl.backends.deepspeed.offload.StateOffload.frozen`), None keeps them resident."""
        placed = frozen_engine(module, self, self.device)
        return FrozenModel(placed, self.device, offload(placed) if offload is not None else None)

    # -- checkpoints ----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "plan": self.plan.to_dict()}


def _data_parallel_size(cfg: Config, mpu: Any, world_size: int) -> int:
    if mpu is not None and tensor_parallel_size(cfg.ds_config) > 1:
        raise ConfigError(
            f"ds_config tensor_parallel.autotp_size = {tensor_parallel_size(cfg.ds_config)} with an mpu passed to "
            "dsrl.initialize: DeepSpeed's AutoTP replaces the engine's mpu with its own (data x tensor) groups. "
            "Fix: pass no mpu with AutoTP, or set autotp_size to 1 and keep your mpu.")
    if mpu is not None and hasattr(mpu, "get_sequence_parallel_world_size"):
        # Ulysses mpu (deepspeed.runtime.sequence_parallel.parallel_state_sp): replicas = |seq_dp| / sp
        return int(mpu.get_sequence_data_parallel_world_size()) // int(mpu.get_sequence_parallel_world_size())
    if mpu is not None:
        return int(mpu.get_data_parallel_world_size())
    return data_parallel_size(cfg.ds_config, world_size)


@dataclass(frozen=True)
class EngineSpec:
    """Everything an :class:`RLEngine` is built from besides the model, derived and checked once per run
    (:func:`prepare`): the run file, its :class:`BatchPlan`, the ds_config DeepSpeed will see and the LR
    schedule dsrl steps, both validated by DeepSpeed's own classes. ``initialize`` takes it as it is, so
    nothing downstream rebuilds the plan or re-validates the ds_config."""

    config: Config
    plan: BatchPlan
    ds_config: dict[str, Any]
    schedule: ScheduleSpec
    on_gpu: bool


def prepare(config: str | dict | Config, *, world_size: int | None = None, mpu: Any = None,
            dataset_size: int | None = None, client_optimizer: Any = None, on_gpu: bool | None = None,
            overrides: dict[str, Any] | None = None) -> EngineSpec:
    """The :class:`EngineSpec` of a run file on ``world_size`` ranks (default: the running process group's),
    before any model exists: every configuration error is raised here, naming its field."""
    cfg = load_config(config, overrides)
    world = world_size if world_size is not None else dist.get_world_size()
    if world <= 0:
        raise ConfigError(f"world size {world} must be a positive number of ranks")
    gpu = accelerator_is_gpu() if on_gpu is None else on_gpu
    plan = BatchPlan.from_config(cfg, _data_parallel_size(cfg, mpu, world), dataset_size)
    ds_config, schedule = validated_deepspeed_config(cfg, plan, on_gpu=gpu, mpu=mpu, client_optimizer=client_optimizer)
    return EngineSpec(cfg, plan, ds_config, schedule, gpu)


def initialize(
    model: torch.nn.Module,
    config: str | dict | Config | EngineSpec,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    model_parameters: Any = None,
    dataset_size: int | None = None,
    mpu: Any = None,
    overrides: dict[str, Any] | None = None,
) -> RLEngine:
    """Like ``deepspeed.initialize``, plus the plan: returns an :class:`RLEngine`.

    ``config`` is a run file (path, dict or :class:`dsrl.config.Config`), or the :class:`EngineSpec` that
    :func:`prepare` made of one (then ``dataset_size`` and ``overrides`` are already in it). All
    configuration errors are raised before DeepSpeed builds anything.
    """
    import deepspeed

    if isinstance(config, EngineSpec):
        spec = config
        ensure_distributed(spec.config.dsrl.run.join_timeout_s, spec.config.dsrl.run.collective_timeout_s)
    else:
        cfg = load_config(config, overrides)
        ensure_distributed(cfg.dsrl.run.join_timeout_s, cfg.dsrl.run.collective_timeout_s)
        spec = prepare(cfg, mpu=mpu, dataset_size=dataset_size, client_optimizer=optimizer)
    cfg, plan, ds_config = spec.config, spec.plan, spec.ds_config
    check_model_for_tensor_parallel(model, tensor_parallel_size(ds_config))
    if expert_parallel_enabled(ds_config):
        ensure_transformers_compat()  # DeepSpeed 0.19.8 AutoEP presets vs transformers 5 (autoep.py)
    if model_parameters is None:
        model_parameters = [p for p in model.parameters() if p.requires_grad]
    # apex's prebuilt FusedAdam instead of compiling DeepSpeed's, where apex is present (apex.py).
    apex_optimizer, ds_config = apex_adam_for(ds_config, model_parameters, cfg.dsrl.model.apex, spec.on_gpu, optimizer)
    optimizer = apex_optimizer or optimizer
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model_parameters, optimizer=optimizer, config=ds_config, mpu=mpu
    )
    declare_vocab_shard_of(engine.module)  # an untied head AutoTP made column-parallel (the fused log-probs)
    view = deepspeed_view(engine)
    if view.data_parallel_size != plan.data_parallel_size:
        raise ConfigError(
            f"the engine averages over {view.data_parallel_size} data-parallel replicas but the plan was built "
            f"for D = {plan.data_parallel_size}; check sequence_parallel_size / tensor_parallel.autotp_size / mpu"
        )
    torch_optimizer = engine.basic_optimizer if engine.basic_optimizer is not None else engine.optimizer
    scheduler = PlannedScheduler(spec.schedule, torch_optimizer)
    return RLEngine(engine, plan, scheduler, view, cfg)
