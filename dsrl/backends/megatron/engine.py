"""megatron-core as a :class:`dsrl.core.engine.TrainEngine`: :class:`MegatronEngine`, and :func:`build_engine`, which
makes one of a Hugging Face causal LM.

:class:`MegatronEngine` is :class:`dsrl.backends.megatron.step.MegatronRLStep` (the exact step, one
``forward_backward_func`` call per mini-batch) with the rest of the protocol:

- ``module`` is a :class:`dsrl.backends.megatron.causal_lm.GPTCausalLM`: the application's forwards (the fused
  log-probs of ``dsrl.rl.policy.logprobs``, the losses' ``forward``) run on it as on a Hugging Face model;
- ``train_mini_batch(micros, forward_fn, token_loss_fn)``: on the last pipeline stage ``forward_fn(module, micro)``
  then ``token_loss_fn(output, micro)`` inside Megatron's schedule; an earlier stage runs the module's trunk and
  sends its activations (the application's forward is a forward *through* the model, so it is the same model on
  every stage);
- ``forward_no_grad(micros, fn)``: ``fn(module, micro)`` without gradients; with pipeline parallelism through
  Megatron's forward-only schedule, ``fn`` running on the last stage and its results broadcast to every stage, so
  every rank returns the same list;
- ``frozen(module)``: a frozen model (KL reference, reward model) is a full replica on every rank (placing it in
  Megatron's layout is not built yet);
- generation does not run on the engine's model: a rollout model receives its weights, :meth:`MegatronEngine.
  hf_weights` (every weight under its Hugging Face name, full, on every rank, one at a time); ``generation_scope``
  says so.

Checkpoints go through megatron-core's dist-checkpointing (:meth:`MegatronEngine.save_checkpoint` /
``load_checkpoint``). ``launch/train.py`` builds this engine for ``dsrl.engine.kind = "megatron"``
(:mod:`dsrl.rl.run.engines`), with the ds_config's optimizer (:mod:`dsrl.backends.megatron.run_file`), dsrl's
schedule and, on the CPU, dsrl's gradient clipping (:func:`clip_grad_norm_on_host`). Not built yet (ARCHITECTURE §4
"(engine)"; issue 40): expert parallelism (refused by :class:`MegatronLayout`) and generator ranks fed from it.
Mixed precision is megatron-core's (``OptimizerSettings.bf16``: the model in bf16 under ``Float16Module``, fp32 main
weights in the optimizer, gradients accumulated and reduced in fp32). Sequence parallelism (megatron-core's, over the
tensor group) runs (:mod:`dsrl.backends.megatron.sequence_parallel`), and so does context parallelism, with dsrl's
all-gather attention in megatron-core's local spec (:mod:`dsrl.backends.megatron.context_parallel`).
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from dsrl.backends.megatron.causal_lm import GPTCausalLM, GPTValueModel
from dsrl.backends.megatron.deps import require_megatron
from dsrl.backends.megatron.schedule import OPTIMIZER_STEPS, build_param_scheduler
from dsrl.backends.megatron.step import PER_TOKEN, MegatronRLStep
from dsrl.core.engine import ForwardFn, TokenLossFn
from dsrl.core.plan import BatchPlan
from dsrl.core.step import MicroBatch, StepResult


@dataclass(frozen=True)
class MegatronLayout:
    """The parallel sizes of a Megatron engine (the run file's ``dsrl.engine`` section, issue 40)."""

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    context_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    sequence_parallel: bool = False

    def refusals(self) -> list[str]:
        """What this engine does not run yet, one sentence each (empty: it runs)."""
        out = []
        if self.expert_model_parallel_size != 1:
            out.append("expert_model_parallel_size > 1: the Hugging Face weight map serves dense Llama / Qwen2 / "
                       "Qwen3 models only. Fix: set expert_model_parallel_size to 1.")
        if self.sequence_parallel and self.tensor_model_parallel_size < 2:
            out.append("sequence_parallel = true with tensor_model_parallel_size = 1: megatron-core's sequence "
                       "parallelism splits the positions over the tensor group. Fix: set tensor_model_parallel_size "
                       ">= 2, or sequence_parallel to false.")
        return out


@dataclass(frozen=True)
class OptimizerSettings:
    """Megatron's optimizer (AdamW: decoupled weight decay) and the plan's LR schedule: ``warmup_steps`` and the
    decay over the plan's optimizer steps down to ``min_lr`` (``decay_style`` of ``OptimizerParamScheduler``)."""

    lr: float = 1e-5
    min_lr: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    clip_grad: float = 0.0
    warmup_steps: int = 0
    decay_style: str = "constant"
    optimizer: str = "adam"
    sgd_momentum: float = 0.9
    use_distributed_optimizer: bool = True  # on GPUs (megatron-core's takes CUDA tensors only)
    # True: weight decay on every parameter, as DeepSpeed's optimizers do (launch/train.py); False: megatron-core's
    # default, none on biases and one-dimensional weights (norms)
    decay_every_parameter: bool = False
    # mixed precision: bf16 weights and activations (megatron-core's Float16Module), fp32 main weights in the
    # optimizer, gradients accumulated and reduced in fp32
    bf16: bool = False


class ReplicatedFrozen:
    """A frozen model beside the Megatron engine: a full replica on this rank (eval mode, no gradients), as a no-grad
    pass runs it; nothing is sharded, so no rank runs filler forwards."""

    def __init__(self, model: torch.nn.Module, offload: Any = None):
        self.model, self.offload = model, offload
        self.filler_forwards = 0

    def forward_no_grad(self, micro_batches: Sequence[Any], fn: Callable[[Any, Any], Any],
                        filler: Any = None) -> list[Any]:
        with self.offload.for_pass() if self.offload is not None else contextlib.nullcontext(), torch.no_grad():
            return [fn(self.model, micro) for micro in micro_batches]


def _whole_loss(output: Any, micro: MicroBatch) -> Any:
    """The token loss when the forward already is the whole loss (``token_loss_fn=None``)."""
    return output


class MegatronEngine(MegatronRLStep):
    """The megatron-core :class:`dsrl.core.engine.TrainEngine` (module docstring). ``chunk``: the ``GPTModel`` wrapped
    in megatron-core's DDP (built with ``calculate_per_token_loss=True``); ``hf_config``: the HF config it was made
    from; ``plan``: the run's :class:`dsrl.core.plan.BatchPlan`; ``value_model``: the chunk is a value model's (the
    critic's, :class:`GPTValueModel`), not a causal LM's."""

    def __init__(self, chunk: Any, optimizer: Any, scheduler: Any, plan: BatchPlan, hf_config: Any, *,
                 schedule_unit: str = OPTIMIZER_STEPS, host_clip_grad: float = 0.0, value_model: bool = False):
        from megatron.core import parallel_state as ps

        super().__init__(chunk, optimizer, scheduler, loss_agg=plan.loss_agg, convention=PER_TOKEN,
                         schedule_unit=schedule_unit, mini_batch_size=plan.mini_batch_size,
                         loss_agg_norm_length=plan.loss_agg_norm_length,
                         context_parallel_in_model=ps.get_context_parallel_world_size() > 1)
        self.plan = plan
        self.hf_config = hf_config
        self.host_clip_grad = float(host_clip_grad)  # > 0: dsrl clips (megatron-core's clipping needs CUDA)
        self.monitor: Any = None  # the run's metrics monitor (DeepSpeed's MonitorMaster), set by the composition root
        self._module = (GPTValueModel if value_model else GPTCausalLM)(chunk, hf_config)

    def _optimizer_step(self) -> tuple[bool, Any]:
        """megatron-core's step, or on the CPU with clipping its three parts with dsrl's clipping between them
        (:func:`clip_grad_norm_on_host`); a non-finite gradient norm applies nothing."""
        if self.host_clip_grad <= 0:
            return super()._optimizer_step()
        if self.optimizer.prepare_grads():  # an overflow found by a loss scaler (fp16): megatron skips the step
            return False, None
        norm = clip_grad_norm_on_host(self.optimizer, self.host_clip_grad)
        if not math.isfinite(norm):
            return False, norm
        return bool(self.optimizer.step_with_ready_grads()), norm

    # -- what the application's forwards see (dsrl.core.forwards.PolicyForwards) -------------------
    @property
    def module(self) -> GPTCausalLM | GPTValueModel:
        return self._module

    @property
    def device(self) -> torch.device:
        return self.collective_device

    def generation_scope(self) -> contextlib.AbstractContextManager[None]:
        raise RuntimeError("the Megatron engine's model does not generate: its weights go to a rollout model "
                           "(MegatronEngine.hf_weights, by Hugging Face name), which does.")

    def no_grad_scope(self) -> contextlib.AbstractContextManager[None]:
        """Megatron's DDP keeps no per-forward hooks that a no-grad forward must avoid: nothing to scope."""
        return contextlib.nullcontext()

    # -- the step ---------------------------------------------------------------------------------
    def train_mini_batch(self, micro_batches: Sequence[MicroBatch], loss_fn: ForwardFn,
                         token_loss_fn: TokenLossFn | None = None) -> StepResult:
        """One exact optimizer step (:meth:`MegatronRLStep.train_step`): ``loss_fn(module, micro)`` is the forward
        on the last stage (the whole loss when ``token_loss_fn`` is None), earlier stages run the trunk."""
        return self.train_step(micro_batches, self._stage_forward(loss_fn), token_loss_fn or _whole_loss)

    def _stage_forward(self, fn: Callable[[Any, MicroBatch], Any]) -> Callable[[Any, MicroBatch], Any]:
        module = self._module
        if module.post_process:
            return lambda chunk, micro: fn(module, micro)
        return lambda chunk, micro: module(input_ids=micro["input_ids"], attention_mask=micro["attention_mask"],
                                           position_ids=micro.get("position_ids"))

    # -- no-grad passes (dsrl.core.forwards.NoGradPasses) -----------------------------------------
    def forward_no_grad(self, micro_batches: Sequence[MicroBatch], fn: Callable[[Any, MicroBatch], Any]) -> list[Any]:
        """``[fn(module, micro) for micro in micro_batches]`` without gradients, in eval mode, on every rank (module
        docstring). Pipeline stages of one replica must be given the same micro-batches."""
        micros = list(micro_batches)
        if micros and self._template is None and "loss_mask" in micros[0]:
            self.remember_template(micros[0])
        with _eval(self.model), torch.no_grad():
            if self.view.pipeline is None:
                return [fn(self._module, micro) for micro in micros]
            return self._pipelined_no_grad(micros, fn)

    def _pipelined_no_grad(self, micros: list[MicroBatch], fn: Callable[[Any, MicroBatch], Any]) -> list[Any]:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        pipeline = self.view.pipeline
        assert pipeline is not None
        outs: list[Any] = []
        if micros:
            forward = self._stage_forward(fn)

            def forward_step(data_iterator: Iterator[MicroBatch], chunk: Any) -> tuple[Any, None]:
                return forward(chunk, next(data_iterator)), None  # no loss function: the last stage keeps the output

            seq_length, mbs = self._shapes(micros)
            outs = list(get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=iter(micros), model=self.model[0],
                num_microbatches=len(micros), seq_length=seq_length, micro_batch_size=mbs, forward_only=True))
        box = [outs if pipeline.is_last_stage else None]
        dist.broadcast_object_list(box, src=pipeline.last_stage_global_rank, group=pipeline.group)
        return list(box[0])

    # -- checkpoints ----------------------------------------------------------------------------------
    def save_checkpoint(self, directory: str) -> None:
        """The model, the optimizer and dsrl's step state (the schedule, the counters) to ``directory`` through
        megatron-core's dist-checkpointing (each rank writes its shards; collective over every rank)."""
        from megatron.core import dist_checkpointing

        os.makedirs(directory, exist_ok=True)
        try:
            dist_checkpointing.save(self._sharded_state(loading=False) | {"dsrl": self.state_dict()}, directory)
        finally:
            _stop_checkpoint_writer_queue()

    def load_checkpoint(self, directory: str) -> None:
        """Restore what :meth:`save_checkpoint` wrote, exactly: the next step is the one the saving run would have
        made (collective over every rank)."""
        from megatron.core import dist_checkpointing

        sharded = self._sharded_state(loading=True)
        state = dist_checkpointing.load(sharded | {"dsrl": None}, directory)
        self.model[0].module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.load_state_dict(state["dsrl"])

    def _sharded_state(self, loading: bool) -> dict[str, Any]:
        model = self.model[0].module.sharded_state_dict()
        return {"model": model, "optimizer": self.optimizer.sharded_state_dict(model, is_loading=loading)}

    # -- weights for a rollout model ------------------------------------------------------------------
    def hf_weights(self, main: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """Every weight of the model as ``(Hugging Face name, full tensor)``, on every rank, one weight at a time
        (:func:`dsrl.backends.megatron.hf_weights.iter_hf_weights`: gathered over the tensor group when reached),
        the pipeline stages in order, each stage's weights broadcast to the others as they come: no rank holds more
        than one full weight beside its shards. Collective: every rank consumes the iterator to its end. A tensor
        may be a view of a parameter, valid until the next optimizer step (copy it to keep it). ``main``: under
        mixed precision the optimizer's fp32 main weights (what its steps update) instead of the bf16 model's."""
        from megatron.core import parallel_state as ps

        from dsrl.backends.megatron.hf_weights import iter_hf_weights

        tp_group = ps.get_tensor_model_parallel_group() if self.view.tensor_parallel_size > 1 else None
        tensor_of = None
        if main and hasattr(self.optimizer, "fp32_from_float16_groups"):  # megatron-core's mixed-precision optimizer
            copies = {id(p): m for group, mains in zip(self.optimizer.float16_groups,
                                                        self.optimizer.fp32_from_float16_groups, strict=True)
                      for p, m in zip(group, mains, strict=True)}
            tensor_of = lambda p: copies.get(id(p), p)  # noqa: E731
        stage_weights = iter_hf_weights(self.model[0], self.hf_config, tp_group, tensor_of)
        pipeline = self.view.pipeline
        if pipeline is None:
            yield from stage_weights
            return
        mine = ps.get_pipeline_model_parallel_rank()
        for stage in range(pipeline.size):
            src = dist.get_global_rank(pipeline.group, stage)
            while True:
                item = next(stage_weights, None) if stage == mine else None
                header = [None if item is None else (item[0], tuple(item[1].shape), item[1].dtype)]
                dist.broadcast_object_list(header, src=src, group=pipeline.group)
                if header[0] is None:
                    break
                name, shape, dtype = header[0]
                tensor = item[1].contiguous() if item is not None else torch.empty(shape, dtype=dtype,
                                                                                    device=self.device)
                dist.broadcast(tensor, src=src, group=pipeline.group)
                yield name, tensor

    def frozen(self, module: torch.nn.Module, offload: Callable[[Any], Any] | None = None) -> ReplicatedFrozen:
        """``module`` frozen and replicated on this rank's device (:class:`ReplicatedFrozen`)."""
        module.eval()
        module.requires_grad_(False)
        placed = module.to(self.device)
        return ReplicatedFrozen(placed, offload(placed) if offload is not None else None)


@torch.no_grad()
def clip_grad_norm_on_host(optimizer: Any, max_norm: float) -> float:
    """megatron-core's ``clip_grad_norm`` in plain torch, for the CPU (megatron-core 0.16.1's asserts CUDA tensors):
    the L2 norm of the main gradients, each counted once (``get_main_grads_for_grad_norm`` leaves out tensor-parallel
    duplicates and the second copy of a shared embedding), summed over ``get_grad_stats_parallel_group()``; every
    gradient scaled by ``max_norm / (norm + 1e-6)`` when that is below 1 (DeepSpeed's and megatron-core's formula).
    Returns the norm before clipping; a non-finite norm scales nothing."""
    squares = torch.zeros((), dtype=torch.float32)
    for grad in optimizer.get_main_grads_for_grad_norm():
        squares += grad.float().pow(2).sum()
    group = optimizer.get_grad_stats_parallel_group()
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(squares, group=group)
    norm = float(squares.sqrt())
    coefficient = max_norm / (norm + 1e-6)
    if math.isfinite(norm) and coefficient < 1.0:
        for param in optimizer.get_parameters():
            if param.grad is not None:
                param.grad.mul_(coefficient)
    return norm


def _stop_checkpoint_writer_queue() -> None:
    """Shut down the process megatron-core's checkpoint writer started for its results queue.

    ``FileSystemWriterAsync`` (megatron-core 0.16.1) keeps a queue of a ``multiprocessing`` Manager, a spawned process
    (~400 MB), in a module global for the life of the interpreter; only interpreter finalization would stop it, and a
    dsrl rank ends without it (:func:`dsrl.runtime.process_exit.leave`). Left running it outlives the rank and holds
    the launcher's output pipes open. Stopped after each save, the next save starts a new one."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    queue = filesystem_async._results_queue
    if queue is not None:
        filesystem_async._results_queue = None
        queue._manager.shutdown()


@contextlib.contextmanager
def _eval(chunks: Sequence[torch.nn.Module]) -> Iterator[None]:
    modes = [c.training for c in chunks]
    for c in chunks:
        c.eval()
    try:
        yield
    finally:
        for c, mode in zip(chunks, modes):
            c.train(mode)


def initialize_parallel(layout: MegatronLayout, seed: int) -> None:
    """megatron-core's parallel state for ``layout`` (torch.distributed initialised first) and its model-parallel
    random generators, seeded."""
    require_megatron()
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    refused = layout.refusals()
    if refused:
        from dsrl.config import ConfigError

        raise ConfigError("dsrl.engine (kind 'megatron'): " + " ".join(refused))
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=layout.tensor_model_parallel_size,
                                 pipeline_model_parallel_size=layout.pipeline_model_parallel_size,
                                 context_parallel_size=layout.context_parallel_size,
                                 expert_model_parallel_size=layout.expert_model_parallel_size)
    model_parallel_cuda_manual_seed(seed)


def build_engine(hf_config: Any, hf_state: Mapping[str, torch.Tensor], plan: BatchPlan, layout: MegatronLayout,
                 settings: OptimizerSettings, *, on_gpu: bool = False,
                 scheduler_of: Callable[[Any], Any] | None = None, value_model: bool = False) -> MegatronEngine:
    """A :class:`MegatronEngine` of the Hugging Face model ``hf_config`` / ``hf_state`` (its ``state_dict``, HF names;
    this rank loads its tensor shard and pipeline stage), after :func:`initialize_parallel` with ``layout``: the
    ``GPTModel`` of :mod:`dsrl.backends.megatron.hf_weights`, megatron-core's DDP and (distributed) optimizer, and the
    schedule over the plan's optimizer steps: ``scheduler_of(optimizer)`` (launch/train.py passes dsrl's schedule of
    the ds_config, the DeepSpeed engine's own), else megatron-core's ``OptimizerParamScheduler`` of ``settings``.
    Gradient clipping (``settings.clip_grad``) is megatron-core's on GPUs and :func:`clip_grad_norm_on_host` on
    the CPU. ``value_model``: the HF model is a value model (``AutoModelForTokenClassification`` with one label, the
    critic's), built with its :class:`dsrl.backends.megatron.hf_weights.ValueHead`."""
    require_megatron()
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    from dsrl.backends.megatron import hf_weights

    tp, pp = layout.tensor_model_parallel_size, layout.pipeline_model_parallel_size
    dtype = torch.bfloat16 if settings.bf16 else torch.float32
    if hf_config.vocab_size % tp:
        from dsrl.config import ConfigError

        raise ConfigError(f"dsrl.engine tensor_model_parallel_size = {tp} does not divide the model's vocabulary "
                          f"({hf_config.vocab_size} tokens). Fix: a tensor-parallel size that divides it.")
    config = hf_weights.gpt_config(
        hf_config, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        calculate_per_token_loss=True, use_cpu_initialization=not on_gpu, pipeline_dtype=dtype,
        bf16=settings.bf16, params_dtype=dtype,
        sequence_parallel=layout.sequence_parallel, context_parallel_size=layout.context_parallel_size,
        # pipeline stages exchange activations of each micro-batch's own shape (megatron-core refuses that with its
        # all-gather MoE dispatcher, even for a dense model)
        variable_seq_lengths=pp > 1, **({"moe_token_dispatcher_type": "alltoall"} if pp > 1 else {}))
    gpt = hf_weights.build_gpt_model(hf_config, config, pre_process=ps.is_pipeline_first_stage(),
                                     post_process=ps.is_pipeline_last_stage(), value_head=value_model)
    hf_weights.load_hf_weights(gpt, hf_config, hf_state, ps.get_tensor_model_parallel_rank(), tp)
    if on_gpu:
        gpt.cuda()
    chunk = Float16Module(config, gpt) if settings.bf16 else gpt  # bf16 in, fp32 out of the last stage
    # megatron-core 0.16.1's distributed optimizer and its gradient clipping take CUDA tensors only: on the CPU the
    # plain optimizer (every replica keeps the whole state) and no clipping
    distributed = settings.use_distributed_optimizer and on_gpu
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(
        use_distributed_optimizer=distributed, grad_reduce_in_fp32=settings.bf16), chunk)
    optimizer = get_megatron_optimizer(OptimizerConfig(
        bf16=settings.bf16, params_dtype=dtype,
        optimizer=settings.optimizer, lr=settings.lr, min_lr=settings.min_lr, weight_decay=settings.weight_decay,
        adam_beta1=settings.betas[0], adam_beta2=settings.betas[1], adam_eps=settings.eps,
        sgd_momentum=settings.sgd_momentum, clip_grad=settings.clip_grad if on_gpu else 0.0,
        use_distributed_optimizer=distributed), [ddp], config_overrides={} if settings.decay_every_parameter else None)
    if scheduler_of is not None:
        scheduler = scheduler_of(optimizer)
    else:
        scheduler = build_param_scheduler(optimizer, total_optimizer_steps=plan.total_optimizer_steps,
                                          max_lr=settings.lr, min_lr=settings.min_lr,
                                          warmup_steps=settings.warmup_steps, decay_style=settings.decay_style,
                                          init_lr=settings.min_lr)
    return MegatronEngine(ddp, optimizer, scheduler, plan, hf_config,
                          host_clip_grad=0.0 if on_gpu else settings.clip_grad, value_model=value_model)


__all__ = ["MegatronEngine", "MegatronLayout", "OptimizerSettings", "ReplicatedFrozen", "build_engine",
           "initialize_parallel"]
