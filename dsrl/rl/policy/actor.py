"""The policy actor: the policy's engine, its KL reference, its mixture-of-experts routing duties and its loss behind
two verbs -- the twin of :class:`dsrl.rl.critic.Critic`.

- :meth:`PolicyActor.add_logprobs` gives a rollout's samples their old log-probs (pi_old: the trainer's own
  recompute with the weights it holds, once per rollout, before any update), their reference log-probs (with a
  KL reference: a frozen copy, or for a LoRA policy the policy itself with its adapters disabled, no second copy)
  and, for a mixture-of-experts policy, the comparison of the rollout's routes with the trainer's own; with
  ``algorithm.kl_in = "reward"`` and no critic (a critic takes the KL per token in GAE instead) the summed k1 KL over
  the model's tokens is subtracted from each sample's reward here;
- :meth:`PolicyActor.train_mini_batch` takes one exact optimizer step of the policy over this rank's micro-batches
  of a mini-batch (ARCHITECTURE §2): an MoE policy's expert load first (one all-reduce), its forced routes released
  after the step's backwards.

Invariants: every pass runs the same number of forwards on every rank (the engine's and the reference's
``forward_no_grad``, :class:`dsrl.core.forwards.NoGradPasses`), and each pass's results leave the device in one copy
at its end (:meth:`dsrl.rl.data.batching.PassBatches.per_sample`). An MoE policy's old log-probs come from a forward
with the trainer's own routes (recorded) and, when the backend returned routes, one with the rollout's routes
replayed (:mod:`dsrl.rl.policy.moe`); the setting picks which the samples keep; the reference replays the rollout's
routes through its own routers under routing replay.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from dsrl.algos import ResolvedAlgorithm
from dsrl.algos.losses import kl_estimate
from dsrl.config import AlgorithmConfig, DsrlConfig, ModelConfig
from dsrl.core.engine import TrainEngine
from dsrl.core.errors import RunError
from dsrl.core.forwards import NoGradPasses
from dsrl.core.parallel import ParallelView
from dsrl.rl.data.batching import PassBatches, Sample, completion_positions
from dsrl.rl.data.prefix import PREFIX_INPUT_IDS
from dsrl.rl.data.replica import is_source
from dsrl.rl.policy.logprobs import forward_logprobs
from dsrl.rl.policy.loss import PolicyLoss
from dsrl.runtime.phases import PhaseClock

if TYPE_CHECKING:
    from dsrl.rl.policy.moe import PolicyRouting, RouteMismatch


@dataclass(frozen=True)
class ActorSettings:
    """What of the run file the actor reads: its ``algorithm`` section (KL coefficient and placement), the rollout's
    sampling ``temperature`` (the log-probs are those of the tempered distribution), the micro-batch size of the
    no-grad passes (``rollout.logprob_micro_batch_size``) and whether they share prompts (``model.share_prompts``)."""

    algorithm: AlgorithmConfig
    temperature: float
    logprob_micro_batch_size: int
    share_prompts: bool = False  # model.share_prompts: the no-grad passes run each prompt once per micro-batch

    @classmethod
    def of(cls, d: DsrlConfig) -> ActorSettings:
        return cls(d.algorithm, d.rollout.temperature, d.rollout.logprob_micro_batch_size, d.model.share_prompts)


class PolicyActor:
    """The policy's training-side duties (module docstring). Build it with :meth:`build`."""

    def __init__(self, engine: TrainEngine, loss: PolicyLoss, settings: ActorSettings, *,
                 reference: NoGradPasses | None = None, routing: PolicyRouting | None = None,
                 phases: PhaseClock | None = None):
        self.engine, self.loss, self.settings = engine, loss, settings
        self.reference, self.routing = reference, routing
        self.phases = phases or PhaseClock()

    @classmethod
    def build(cls, model: torch.nn.Module, build_engine: Callable[[torch.nn.Module], TrainEngine],
              model_cfg: ModelConfig, settings: ActorSettings, algo: ResolvedAlgorithm, *, moe: bool,
              phases: PhaseClock, frozen_offload: Callable[[Any], Any] | None = None) -> PolicyActor:
        """The policy's engine, made of ``model`` by ``build_engine`` (the composition root chose the engine,
        :mod:`dsrl.rl.run.engines`), its KL reference when ``algorithm.kl_coef > 0`` (a frozen copy taken before the
        engine wraps the model and placed by the engine like the policy, :meth:`TrainEngine.frozen`, or the LoRA
        policy with its adapters disabled), an MoE policy's routing duties (``moe``) and the loss.
        ``frozen_offload`` makes the frozen copy's weights' offload between its passes (``dsrl.memory``)."""
        want_reference = settings.algorithm.kl_coef > 0
        copy = None
        if want_reference and model_cfg.lora is None:
            from dsrl.rl.policy.model import frozen_copy

            copy = frozen_copy(model)  # before the engine: it may shard the model it wraps
        engine = build_engine(model)
        reference: NoGradPasses | None = None
        if copy is not None:
            reference = engine.frozen(copy, frozen_offload)
        elif want_reference:
            from dsrl.rl.policy.lora import AdaptersDisabled

            reference = AdaptersDisabled(engine)
        routing = None
        if moe:
            from dsrl.rl.policy.moe import PolicyRouting

            routing = PolicyRouting(model_cfg, engine.module, copy)  # the copy's own routers replay the reference's
        loss = PolicyLoss(settings.algorithm, algo, settings.temperature, reference is not None, routing)
        return cls(engine, loss, settings, reference=reference, routing=routing, phases=phases)

    @property
    def view(self) -> ParallelView:
        return self.engine.view

    @property
    def device(self) -> torch.device:
        return self.engine.device

    @property
    def has_reference(self) -> bool:
        """Whether the samples get reference log-probs (a KL penalty is measured)."""
        return self.reference is not None

    # -- verb 1: log-probs of a rollout -----------------------------------------------------------
    def pass_batches(self, samples: list[Sample], pad_id: int) -> PassBatches:
        """The rollout's samples as the micro-batches of its no-grad passes (collated once, shared with the
        critic's values pass)."""
        return PassBatches.of(samples, self.settings.logprob_micro_batch_size, pad_id, self.device,
                              shared=self.settings.share_prompts)

    def add_logprobs(self, batches: PassBatches, *, with_routes: bool = False,
                     kl_in_reward: bool = True) -> RouteMismatch | None:
        """Old (and reference) log-probs of every sample of ``batches``, before any update; with ``algorithm.kl_in
        = "reward"`` and ``kl_in_reward`` (False with a critic) the reward is penalised by the summed k1 KL here.
        ``with_routes``: the rollout backend returned routes (the same on every rank: the MoE passes are
        collective). Returns an MoE policy's route comparison (None for a dense one)."""
        samples = [s for g in batches.groups for s in g]
        fn = self._logprob_fn()
        mismatch = None
        with self.phases.phase("old_logprobs"):
            if self.routing is None:
                outs = self.engine.forward_no_grad(batches.micros, fn)
            else:
                outs, mismatch = self._moe_logprobs(batches, fn, with_routes)
            for s, values in zip(samples, batches.per_sample(outs)):
                s.old_logprobs = values
        if self.reference is None:
            return mismatch
        with torch.no_grad(), self.phases.phase("ref_logprobs"):
            routing = self.routing
            if routing is not None and routing.replay:  # the rollout's routes in the reference's forwards too
                fn = routing.forcing(fn, routing.ref_routing)
            try:
                refs = self.reference.forward_no_grad(batches.micros, fn)
            finally:
                if routing is not None:
                    routing.release()
            for s, values in zip(samples, batches.per_sample(refs)):
                s.ref_logprobs = values
        a = self.settings.algorithm
        if a.kl_in == "reward" and kl_in_reward:
            for s in samples:  # over the model's tokens only (a trajectory's observations are not the policy's)
                kl = kl_estimate(torch.tensor(s.old_logprobs), torch.tensor(s.ref_logprobs), "k1")
                s.reward -= a.kl_coef * float((kl * torch.tensor(s.model_mask, dtype=kl.dtype)).sum())
        return mismatch

    def _logprob_fn(self) -> Callable[[Any, dict[str, torch.Tensor]], torch.Tensor]:
        """``fn(model, micro)``: log pi(target) ``[b, t]`` on the device at the micro-batch's completion positions
        (zeros elsewhere), through the fused output head (:func:`dsrl.rl.policy.logprobs.forward_logprobs`)."""
        temp = self.settings.temperature

        def fn(model: Any, micro: dict[str, torch.Tensor]) -> torch.Tensor:
            return forward_logprobs(model, micro, temperature=temp).logprobs

        return fn

    def _moe_logprobs(self, batches: PassBatches, fn: Callable[[Any, dict[str, torch.Tensor]], torch.Tensor],
                      with_routes: bool) -> tuple[list[torch.Tensor], RouteMismatch]:
        """An MoE policy's old log-probs (module docstring) and the rollout-vs-trainer comparison. Samples keep
        routes only where training needs them (replayed, or counted for the load-balancing term)."""
        from dsrl.core.routes import ROUTE_DTYPE
        from dsrl.rl.policy.moe import RouteMismatch

        moe = self.routing
        assert moe is not None
        lay = moe.layout
        for g in batches.groups:
            for s in g:
                self._check_routes(moe, s, with_routes)
        own, calls = moe.recorded(lambda: self.engine.forward_no_grad(batches.micros, fn))
        replayed = None
        if with_routes:
            try:
                replayed = self.engine.forward_no_grad(batches.micros, moe.forcing(fn))
            finally:
                moe.release()
        own_cpu, replayed_cpu = _on_host(own), _on_host(replayed) if replayed is not None else None
        mm = RouteMismatch()
        counted_here = is_source(self.view)
        for i, (g, mb) in enumerate(zip(batches.groups, batches.micros)):
            b, t = mb["input_ids"].shape
            per_row = calls[i].reshape(b, t, lay.layers, lay.top_k)
            for row, (s, sl) in enumerate(zip(g, completion_positions(g))):
                n = len(s.tokens) - 1
                if counted_here:
                    moe.compare(s.routes, per_row[row, :n], mm)
                    _add_abs_diff(mm, s, own_cpu[i][row, sl], replayed_cpu[i][row, sl] if replayed_cpu else None)
                if not moe.keep_routes:
                    s.routes = None
                elif s.routes is None:  # the load f counts the trainer's own routes
                    s.routes = per_row[row, :n].to(ROUTE_DTYPE).clone()
        return (replayed if (moe.replay and replayed is not None) else own), mm

    @staticmethod
    def _check_routes(moe: PolicyRouting, s: Sample, with_routes: bool) -> None:
        """A sample's rollout routes fit the policy; under replay every sample has them."""
        if s.routes is not None:
            moe.check_sample_routes(s.routes, len(s.tokens) - 1, f"a sample of prompt {s.group}")
        elif with_routes and moe.replay:
            raise RunError(f"a sample of prompt {s.group} reached the trainer without routes while "
                           "dsrl.model.routing_replay = 'rollout' (its generator recorded none: a generator started "
                           "with other settings, or samples from before a resume). Fix: restart the generators "
                           "with this run file, or set routing_replay = 'off'.")

    # -- verb 2: one optimizer step -------------------------------------------------------------------
    def train_mini_batch(self, micro_batches: list[dict[str, Any]]) -> dict[str, Any]:
        """One exact optimizer step of the policy over this rank's micro-batches of a mini-batch; the step's results
        with its time (``step_s``) and the padded tokens it ran (``padded_tokens``)."""
        t0 = time.perf_counter()
        res = self._step(micro_batches)
        res["step_s"] = time.perf_counter() - t0
        res["padded_tokens"] = sum(int(m.get(PREFIX_INPUT_IDS, m["input_ids"]).numel()) for m in micro_batches)
        return res

    def _step(self, micro_batches: list[dict[str, Any]]) -> dict[str, Any]:
        moe = self.routing
        if moe is None:
            return self.engine.train_mini_batch(micro_batches, self.loss.forward, self.loss.token_loss)
        load = None
        if moe.aux_coef > 0:
            from dsrl.algos.router_balance import mini_batch_load

            lay = moe.layout
            load = mini_batch_load(micro_batches, lay.layers, lay.experts, lay.top_k, self.engine.sum_over_count_group)
        try:
            return self.engine.train_mini_batch(micro_batches, functools.partial(self.loss.forward, load=load),
                                                functools.partial(self.loss.token_loss, load=load))
        finally:
            moe.release()

    # -- checkpoints --------------------------------------------------------------------------------
    def checkpoint_state(self) -> dict[str, Any] | None:
        """What a checkpoint records of the policy beside its engine: an MoE policy's routing layout (None when
        dense)."""
        return self.routing.checkpoint_state() if self.routing is not None else None

    def check_resumed(self, saved: dict[str, Any] | None, where: str) -> None:
        """Refuse a checkpoint written with another routing layout (an MoE policy; nothing to check when dense)."""
        if self.routing is not None:
            self.routing.check_resumed(saved, where)


def _on_host(outs: list[torch.Tensor]) -> list[torch.Tensor]:
    """A pass's outputs on the host with one device-to-host copy (ARCHITECTURE §4)."""
    if not outs:
        return []
    flat = torch.cat([o.reshape(-1) for o in outs]).cpu()
    return [part.view(o.shape) for part, o in zip(flat.split([o.numel() for o in outs]), outs)]


def _add_abs_diff(mm: RouteMismatch, s: Sample, own: torch.Tensor, replayed: torch.Tensor | None) -> None:
    """|log pi - log mu| over a sample's counted model tokens, recomputed with the trainer's own routes and (when
    present) with the rollout's replayed."""
    if s.behavior_logprobs is None or not s.active:
        return
    mu = torch.tensor(s.behavior_logprobs, dtype=torch.float64)
    keep = torch.tensor(s.model_mask, dtype=torch.bool)[: mu.shape[0]]
    mm.tokens += int(keep.sum())
    mm.own_abs_diff += float((own.double()[: mu.shape[0]] - mu).abs()[keep].sum())
    if replayed is not None:
        mm.replayed_tokens += int(keep.sum())
        mm.replayed_abs_diff += float((replayed.double()[: mu.shape[0]] - mu).abs()[keep].sum())
