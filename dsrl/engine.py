"""RLEngine: one exact optimizer step per mini-batch on top of a DeepSpeedEngine.

``train_mini_batch(micro_batches, loss_fn)`` keeps these invariants (architecture §2, §3, §7):

- the applied gradient is exactly the gradient of L_M = sum_t w_t l_t over the whole mini-batch,
  whatever its split into micro-batches and ranks: the global counts (N_M, S_M) come from one
  collective over the token-owning group *before* the first backward, each micro-batch backward
  is ``engine.backward(D * sum_{t in micro} w_t l_t, scale_wrt_gas=False)``, and D is the engine's
  real averaging factor (:func:`dsrl.parallel.deepspeed_view`);
- every rank of that group runs the same number of forwards and backwards (ranks with fewer
  micro-batches run zero-weight copies of one of theirs), so ZeRO-2/3 never hangs;
- ``engine.step()`` runs exactly once; the LR schedule advances only if the update was applied;
- a non-finite loss on any rank skips the update on every rank (never a NaN in the weights), and a
  mini-batch with zero valid tokens gives a zero loss and a zero gradient.
"""

from __future__ import annotations

import math
import os
import socket
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from dsrl import checkpoint as ckpt
from dsrl import cpu_shm
from dsrl.config import Config, ConfigError, load_config
from dsrl.ds_validation import validated_deepspeed_config
from dsrl.loss import (
    GlobalCounts,
    check_micro_batch,
    local_counts,
    masked_sum,
    token_weights,
    weighted_sum,
    zero_weight_micro_batch,
)
from dsrl.parallel import ParallelView, deepspeed_view
from dsrl.plan import BatchPlan
from dsrl.schedule import PlannedScheduler

MicroBatch = Mapping[str, Any]
LossFn = Callable[[Any, MicroBatch], "torch.Tensor | tuple[torch.Tensor, dict[str, torch.Tensor]]"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_distributed() -> None:
    """Initialise torch.distributed and DeepSpeed's communication backend; a plain ``python`` run
    becomes 1 rank.

    ``DSRL_INIT_TIMEOUT_S`` (seconds) bounds the wait for every rank to join the process group. On the
    CPU accelerator the shared-memory all-reduce segments DeepSpeed creates are checked for room
    before and unlinked after (:mod:`dsrl.cpu_shm`), so no job leaks ``/dev/shm``.
    """
    import deepspeed

    kwargs = {}
    if not dist.is_initialized():
        if "RANK" not in os.environ and "OMPI_COMM_WORLD_RANK" not in os.environ:
            os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_SIZE="1")
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(_free_port()))
        timeout_s = os.environ.get("DSRL_INIT_TIMEOUT_S")
        if timeout_s:
            from datetime import timedelta

            # Fail fast when a node never joins (DeepSpeed's default waits 10 minutes).
            kwargs["timeout"] = timedelta(seconds=float(timeout_s))
        if os.environ.get("WORLD_SIZE") == os.environ.get("LOCAL_SIZE"):
            cpu_shm.check_room(int(os.environ.get("LOCAL_SIZE", "1")))
    # Over a process group the caller started, this only builds DeepSpeed's backend (and its shm
    # segments), as deepspeed.initialize would later; either way they are released right here.
    deepspeed.init_distributed(verbose=False, **kwargs)
    cpu_shm.release_segments()


def on_gpu() -> bool:
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().device_name() != "cpu"


class RLEngine:
    """A DeepSpeedEngine whose optimizer step, normalisation and LR schedule dsrl owns."""

    def __init__(
        self,
        engine: Any,
        plan: BatchPlan,
        scheduler: PlannedScheduler,
        view: ParallelView,
        config: Config | None = None,
    ):
        self.engine = engine
        self.plan = plan
        self.scheduler = scheduler
        self.view = view
        self.config = config
        self.loss_agg = plan.loss_agg
        self.optimizer_steps = 0  # applied updates
        self.skipped_steps = 0
        self._template: MicroBatch | None = None

    # -- conveniences ---------------------------------------------------------------------------
    @property
    def module(self) -> torch.nn.Module:
        return self.engine.module

    @property
    def device(self) -> torch.device:
        return self.engine.device

    @property
    def zero_stage(self) -> int:
        return self.engine.zero_optimization_stage()

    def _gather_stats(self, values: list[float]) -> torch.Tensor:
        """All-gather a small float64 vector over the token-owning group -> [group_size, len]."""
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        if self.view.count_group_size == 1:
            return t.unsqueeze(0)
        out = [torch.empty_like(t) for _ in range(self.view.count_group_size)]
        dist.all_gather(out, t, group=self.view.count_group)
        return torch.stack(out)

    def _all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.view.count_group_size > 1:
            dist.all_reduce(t, group=self.view.count_group)
        return t

    def _fillers(self, micros: list[MicroBatch], n_max: int) -> list[MicroBatch]:
        if len(micros) == n_max:
            return []
        template = micros[0] if micros else self._template
        if template is None:
            raise ValueError(
                "this rank got no micro-batch while others did, and no earlier micro-batch can serve as a "
                "zero-weight filler; give every rank at least one micro-batch (dsrl.partition does)"
            )
        filler = zero_weight_micro_batch(template, one_row=True)
        return [filler] * (n_max - len(micros))

    def global_counts(self, micro_batches: Sequence[MicroBatch]) -> tuple[GlobalCounts, int]:
        """(N_M, S_M) of the whole mini-batch and the largest per-rank micro-batch count (1 collective)."""
        tok = seq = 0
        for i, mb in enumerate(micro_batches):
            check_micro_batch(mb, i)
            t, s = local_counts(mb, self.view.owns_sequences)
            tok, seq = tok + t, seq + s
        stats = self._gather_stats([tok, seq, len(micro_batches)])
        counts = GlobalCounts(tokens=int(stats[:, 0].sum().item()), sequences=int(stats[:, 1].sum().item()))
        return counts, int(stats[:, 2].max().item())

    # -- the step -------------------------------------------------------------------------------
    def train_mini_batch(self, micro_batches: Sequence[MicroBatch], loss_fn: LossFn) -> dict[str, Any]:
        """One optimizer step over a mini-batch given as this rank's micro-batches.

        ``loss_fn(engine, micro)`` runs the forward through the engine and returns per-token losses
        ``[b, t]`` (or ``(losses, metrics)`` with per-token metric tensors ``[b, t]``, reported as
        global token means). dsrl applies the aggregation weights; user code never divides by a count.
        """
        micros = list(micro_batches)
        counts, n_max = self.global_counts(micros)
        if micros:
            self._template = micros[0]
        fillers = self._fillers(micros, n_max)
        scale = self.view.grad_scale
        self.engine.train()

        loss_local = torch.zeros((), dtype=torch.float64, device=self.device)
        metric_sums: dict[str, torch.Tensor] = {}
        for mb in micros + fillers:
            out = loss_fn(self.engine, mb)
            per_token, metrics = out if isinstance(out, tuple) else (out, {})
            mask = mb["loss_mask"].to(per_token.device)
            if per_token.shape != mask.shape:
                raise ValueError(
                    f"loss_fn returned per-token losses of shape {tuple(per_token.shape)} for a micro-batch whose "
                    f"loss_mask is {tuple(mask.shape)}; they must match"
                )
            weights = token_weights(
                self.loss_agg,
                mb,
                counts,
                mini_batch_size=self.plan.mini_batch_size,
                norm_length=self.plan.loss_norm_length,
            ).to(per_token.device)
            contrib = weighted_sum(per_token, weights, mask)
            self.engine.backward(contrib * scale, scale_wrt_gas=False)
            loss_local += contrib.detach().double()
            for name, value in metrics.items():
                s = masked_sum(value.detach().double(), mask)
                metric_sums[name] = metric_sums.get(name, 0.0) + s

        names = sorted(metric_sums)
        nonfinite = (~torch.isfinite(loss_local)).double()
        if self.zero_stage == 0:
            nonfinite = nonfinite + self._local_grads_nonfinite()
        vec = torch.stack([loss_local, nonfinite] + [torch.as_tensor(metric_sums[n], dtype=torch.float64,
                                                                      device=self.device) for n in names])
        vec = self._all_reduce_sum(vec.clone())
        skipped_nonfinite = bool(vec[1].item() > 0) or not math.isfinite(vec[0].item())

        lr = self.scheduler.current_lr()
        applied = False
        if skipped_nonfinite and self.zero_stage == 0:
            self.engine.zero_grad()  # stage 0 has no overflow check: drop the step on every rank
        else:
            self.engine.step()
            applied = bool(self.engine.was_step_applied())
            if applied and skipped_nonfinite:
                raise RuntimeError(
                    "a non-finite loss reached an optimizer update that DeepSpeed applied; the weights may "
                    "hold NaN. Resume from the last complete checkpoint and check rewards/advantages."
                )
        if applied:
            self.scheduler.step()
            self.optimizer_steps += 1
        else:
            self.skipped_steps += 1

        grad_norm = self.engine.get_global_grad_norm() if applied else None
        if torch.is_tensor(grad_norm):
            grad_norm = grad_norm.item()
        N = counts.tokens
        result: dict[str, Any] = {
            "loss": vec[0].item(),
            "tokens": N,
            "sequences": counts.sequences,
            "micro_batches": n_max,
            "filler_micro_batches": len(fillers),
            "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
            "lr": lr,
            "step_applied": applied,
            "skipped_nonfinite": skipped_nonfinite,
            "optimizer_step": self.optimizer_steps,
        }
        for i, name in enumerate(names):
            result[name] = vec[2 + i].item() / N if N else 0.0
        return result

    def _local_grads_nonfinite(self) -> torch.Tensor:
        grads = [p.grad for p in self.engine.module.parameters() if p.grad is not None]
        if not grads:
            return torch.zeros((), dtype=torch.float64, device=self.device)
        norms = torch._foreach_norm(grads)
        total = torch.stack([n.double() for n in norms]).sum()
        return (~torch.isfinite(total)).double()

    @torch.no_grad()
    def forward_no_grad(self, micro_batches: Sequence[MicroBatch], fn: Callable[[Any, MicroBatch], Any]) -> list[Any]:
        """Run ``fn(engine, micro)`` without gradients on each micro-batch, in eval mode.

        Every rank of the token-owning group runs the same number of forwards (ZeRO-3 gathers
        parameters in each forward): ranks with fewer micro-batches run discarded filler forwards.
        """
        micros = list(micro_batches)
        n_max = int(self._gather_stats([len(micros)])[:, 0].max().item())
        if micros and self._template is None and "loss_mask" in micros[0]:
            self._template = micros[0]
        was_training = self.engine.training
        self.engine.eval()
        try:
            outs = [fn(self.engine, mb) for mb in micros]
            if len(micros) < n_max:
                template = micros[0] if micros else self._template
                if template is None:
                    raise ValueError("this rank has no micro-batch to run filler forwards with")
                for _ in range(n_max - len(micros)):
                    fn(self.engine, template)
        finally:
            self.engine.train(was_training)
        return outs

    # -- checkpoints ----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "scheduler": self.scheduler.state_dict(),
            "optimizer_steps": self.optimizer_steps,
            "skipped_steps": self.skipped_steps,
            "plan": self.plan.to_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state["scheduler"])
        self.optimizer_steps = int(state["optimizer_steps"])
        self.skipped_steps = int(state.get("skipped_steps", 0))

    def save_checkpoint(
        self,
        save_dir: str,
        tag: str,
        client_state: dict[str, Any] | None = None,
        rank_state: dict[str, Any] | None = None,
        keep_last: int | None = None,
    ) -> str:
        """Atomic checkpoint (see dsrl.checkpoint): engine + schedule + ``client_state`` + per-rank state."""
        state = {"engine": self.state_dict(), "client": client_state or {}}
        return ckpt.save(self.engine, save_dir, tag, state, rank_state=rank_state, keep_last=keep_last)

    def load_checkpoint(self, load_dir: str, tag: str | None = None) -> tuple[str | None, dict, dict | None]:
        """Resume from the newest complete checkpoint; returns (tag, client_state, rank_state)."""
        tag, state, rank_state = ckpt.load(self.engine, load_dir, tag)
        if tag is None:
            return None, {}, None
        self.load_state_dict(state["engine"])
        return tag, state.get("client", {}), rank_state


def _data_parallel_size(cfg: Config, mpu: Any) -> int:
    if mpu is not None and hasattr(mpu, "get_sequence_parallel_world_size"):
        # Ulysses mpu (deepspeed.runtime.sequence_parallel.parallel_state_sp): replicas = |seq_dp| / sp
        return int(mpu.get_sequence_data_parallel_world_size()) // int(mpu.get_sequence_parallel_world_size())
    if mpu is not None:
        return int(mpu.get_data_parallel_world_size())
    sp = int(cfg.ds_config.get("sequence_parallel_size", 1) or 1)
    return dist.get_world_size() // sp


def initialize(
    model: torch.nn.Module,
    config: str | dict | Config,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    model_parameters: Any = None,
    dataset_size: int | None = None,
    mpu: Any = None,
    overrides: dict[str, Any] | None = None,
) -> RLEngine:
    """Like ``deepspeed.initialize``, plus the plan: returns an :class:`RLEngine`.

    All configuration errors are raised before DeepSpeed builds anything.
    """
    import deepspeed

    cfg = load_config(config, overrides)
    ensure_distributed()
    dp = _data_parallel_size(cfg, mpu)
    plan = BatchPlan.from_config(cfg, dp, dataset_size)
    # The ds_config DeepSpeed will see and the LR schedule, checked by DeepSpeed's own classes first.
    ds_config, spec = validated_deepspeed_config(cfg, plan, on_gpu=on_gpu(), mpu=mpu, client_optimizer=optimizer)
    if model_parameters is None:
        model_parameters = [p for p in model.parameters() if p.requires_grad]
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model_parameters, optimizer=optimizer, config=ds_config, mpu=mpu
    )
    view = deepspeed_view(engine)
    if view.data_parallel_size != plan.data_parallel_size:
        raise ConfigError(
            f"the engine averages over {view.data_parallel_size} data-parallel replicas but the plan was built "
            f"for D = {plan.data_parallel_size}; check sequence_parallel_size / mpu"
        )
    torch_optimizer = engine.basic_optimizer if engine.basic_optimizer is not None else engine.optimizer
    scheduler = PlannedScheduler(spec, torch_optimizer)
    return RLEngine(engine, plan, scheduler, view, cfg)
