"""The policy's per-token loss of one training micro-batch (:class:`PolicyLoss`), as the trainer's engine calls it.

``PolicyLoss(...)(engine, micro)`` returns ``(loss[b, t], metrics)``: per token, never reduced here. It is the
engine seam's two parts (:mod:`dsrl.core.engine`) composed: :meth:`PolicyLoss.forward` (the forward through the
engine) then :meth:`PolicyLoss.token_loss` (the per-token loss of its output), which the actor hands to the
engine separately. The engine (:meth:`dsrl.core.engine.TrainEngine.train_mini_batch`) weights and sums it with
the mini-batch's global counts (ARCHITECTURE §2), so every term added here -- the clipped surrogate, the KL
penalty, the entropy bonus, the router's load-balancing term -- is aggregated exactly like the surrogate.

The log-probs and the entropy come from one forward through the fused output head
(:func:`dsrl.rl.policy.logprobs.forward_logprobs`); under routing replay the micro-batch's recorded routes are
forced before it and stay forced for its backward (the actor releases them after the step, :mod:`dsrl.rl.policy.actor`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from dsrl.algos import ResolvedAlgorithm
from dsrl.algos.losses import clipped_policy_loss, kl_estimate, sequence_clipped_policy_loss, sequence_index
from dsrl.config import AlgorithmConfig
from dsrl.rl.policy.logprobs import forward_logprobs

if TYPE_CHECKING:
    from dsrl.rl.policy.moe import PolicyRouting


@dataclass(frozen=True)
class PolicyOutput:
    """What a training micro-batch's forward gives its loss: log pi(target) and the entropy ``[b, t]`` at the
    completion positions, and an MoE policy's recorded router probabilities (None unless the load-balancing term
    is on)."""

    logprobs: torch.Tensor
    entropy: torch.Tensor
    router_probs: Any = None


@dataclass(frozen=True)
class PolicyLoss:
    """Clipped surrogate (token or sequence ratio), times the off-policy correction's weight when the micro-batch
    carries one, (+ KL in the loss) (- entropy bonus) (+ the router's load-balancing term, given the mini-batch's
    expert ``load``), and per-token metrics.

    ``algorithm`` is the run file's section, ``algo`` its resolved algorithm (clip range, ratio level);
    ``with_reference``: the micro-batches carry ``ref_logprobs`` (a KL penalty is measured); ``moe``: an MoE
    policy's routing duties (:class:`dsrl.rl.policy.moe.PolicyRouting`), None for a dense one."""

    algorithm: AlgorithmConfig
    algo: ResolvedAlgorithm
    temperature: float
    with_reference: bool
    moe: PolicyRouting | None = None

    def __call__(self, engine: torch.nn.Module, micro: dict[str, Any],
                 load: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The whole loss of one micro-batch: :meth:`token_loss` of :meth:`forward`."""
        return self.token_loss(self.forward(engine, micro, load), micro, load)

    def forward(self, engine: torch.nn.Module, micro: dict[str, Any],
                load: torch.Tensor | None = None) -> PolicyOutput:
        """The micro-batch's forward through ``engine``: log-probs and entropy at its completion positions (under
        routing replay with its routes forced first; with an expert ``load``, the router's probabilities kept)."""
        a, moe = self.algorithm, self.moe
        if moe is not None and moe.replay:
            if "routes" not in micro:
                raise RuntimeError("a training micro-batch arrived without routes under dsrl.model.routing_replay = "
                                   "'rollout'; the data path dropped them")
            moe.routing.force(micro["routes"])
        # log-probs and entropy from the same tiles of the fused output head; the entropy carries a gradient only
        # when it is in the loss
        with moe.routing.router_probs() if load is not None else contextlib.nullcontext() as probs:
            tok = forward_logprobs(engine, micro, temperature=self.temperature, entropy=True,
                                   entropy_grad=a.entropy_coef > 0)
        return PolicyOutput(tok.logprobs, tok.entropy, probs)

    def token_loss(self, out: PolicyOutput, micro: dict[str, Any],
                   load: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The per-token loss ``[b, t]`` of :meth:`forward`'s output and its per-token metrics (class docstring)."""
        a, algo, moe = self.algorithm, self.algo, self.moe
        logp = out.logprobs
        if algo.ratio_level == "sequence":
            index = sequence_index(micro["loss_mask"], micro["position_ids"])
            loss, m = sequence_clipped_policy_loss(logp, micro["old_logprobs"], micro["advantages"], micro["loss_mask"],
                                                   algo.clip_low, algo.clip_high, index)
        else:
            loss, m = clipped_policy_loss(logp, micro["old_logprobs"], micro["advantages"], algo.clip_low,
                                          algo.clip_high)
        if "is_weights" in micro:  # the off-policy correction's truncated weight (dsrl.algos.correction)
            loss = loss * micro["is_weights"]
        metrics = {"clip_low_frac": m["clip_low_frac"], "clip_high_frac": m["clip_high_frac"]}
        if self.with_reference:
            kl = kl_estimate(logp, micro["ref_logprobs"], a.kl_estimator)
            metrics["kl"] = kl.detach()
            if a.kl_in == "loss":
                loss = loss + a.kl_coef * kl
        ent = out.entropy
        if a.entropy_coef > 0:
            loss = loss - a.entropy_coef * ent
        metrics["entropy"] = ent.detach()
        if load is not None:  # a_t of dsrl.algos.router_balance, aggregated like every per-token term
            from dsrl.algos.router_balance import balance_per_token

            assert moe is not None and out.router_probs is not None
            aux = balance_per_token(out.router_probs, load, loss.shape).to(loss.dtype)
            loss = loss + moe.aux_coef * aux
            metrics["router_aux_loss"] = aux.detach()
        return loss, metrics
