"""A mixture-of-experts policy in the trainer: its routing layout, the run's MoE settings checked before any work,
and what the trainer's forwards do with routes (routing replay, R3; the router's load-balancing term).

Invariants:
- :func:`check_moe_run` refuses, before any work and with one sentence naming the setting and the fix, what needs
  the model or the machine to be known: routing replay or a load-balancing loss on a dense model or on an MoE
  architecture dsrl cannot route, and replay with a rollout backend that cannot return routes here. The refusals
  a run file alone decides (AutoEP with ``cb``, ``vllm`` or disaggregated placement; replay or the load-balancing
  term under Ulysses or AutoTP) are rules of :mod:`dsrl.config.support`, checked with every run file;
- :class:`PolicyRouting` forces, under ``routing_replay = "rollout"``, each micro-batch's ``routes`` in the
  old-log-prob, reference and training forwards (:meth:`dsrl.rollout.routes.MoERouting.force`; sticky until
  :meth:`PolicyRouting.release`, so a backward that re-runs forwards sees them too), and always measures the
  rollout-vs-trainer mismatch: the trainer's own routes are recorded in the natural (unforced) old-log-prob
  forward, and when the samples carry rollout routes the recompute runs both ways (own routes, replayed routes),
  whichever the setting uses;
- the samples keep their routes for the training forwards only when they are replayed or counted for the
  load-balancing term (:mod:`dsrl.algos.router_balance`, computed by the trainer), whose load f comes from the
  routes the samples carry: the rollout's, or without those the trainer's own from its proximal forward.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from dsrl.config import ConfigError, ModelConfig, RolloutConfig
from dsrl.config.names import AUTO_BACKEND, CB_BACKEND, HF_BACKEND, REPLAY_ROLLOUT
from dsrl.core.routes import MoELayout, config_layout, differing_pairs, sequence_routes
from dsrl.rollout.routes import MoERouting

ROUTABLE_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe")  # dsrl.rollout.routes hooks their routers
# Rollout backends whose completions carry routes (rollout.backend -> why not, None = they do)
def routes_unsupported(backend: str, on_gpu: bool) -> str | None:
    """Why ``rollout.backend`` cannot give a mixture-of-experts policy's completions their routes here (None: it
    can): hf records them from the routers, cb too except on a GPU (CUDA graphs; so auto there), vLLM where its build
    can (:func:`dsrl.rollout.vllm.routes_unsupported`)."""
    if backend in (CB_BACKEND, AUTO_BACKEND) and on_gpu:
        return ("continuous batching on a GPU replays CUDA graphs, which run no Python forward and so none of the "
                "hooks that record routes" + (" (auto may pick it)" if backend == AUTO_BACKEND else ""))
    if backend in (HF_BACKEND, CB_BACKEND, AUTO_BACKEND):
        return None
    from dsrl.rollout.vllm import routes_unsupported as vllm_routes_unsupported

    try:
        return vllm_routes_unsupported(on_cpu=not on_gpu)
    except ImportError as e:
        return str(e)


def model_config(model_cfg: ModelConfig) -> Any:
    """The policy's transformers config: ``model.path``'s config.json (nothing downloaded), or the tiny model's."""
    if model_cfg.path:
        from transformers import AutoConfig

        if not os.path.isdir(model_cfg.path):
            return None  # reported where the model is built
        return AutoConfig.from_pretrained(model_cfg.path, local_files_only=True)
    from dsrl.rl.policy.model import tiny_config

    return tiny_config(model_cfg.arch, 2, None, None, None, model_cfg.tiny)


def policy_layout(model_cfg: ModelConfig) -> MoELayout | None:
    """The policy's :class:`MoELayout` from its config (None for a dense model)."""
    config = model_config(model_cfg)
    return config_layout(config) if config is not None else None


def check_moe_run(m: ModelConfig, rollout: RolloutConfig, on_gpu: bool | None = None) -> MoELayout | None:
    """The MoE refusals of the module docstring for a run file's ``model`` and ``rollout`` sections on this machine's
    accelerator (or ``on_gpu``); returns the policy's layout (None when dense)."""
    config = model_config(m)
    layout = config_layout(config) if config is not None else None
    replay = m.routing_replay == REPLAY_ROLLOUT
    what = f"model.path {m.path!r}" if m.path else f"model.arch {m.arch!r}"
    asked = [s for s, on in ((f"dsrl.model.routing_replay = {m.routing_replay!r}", replay),
                             (f"dsrl.model.router_aux_loss_coef = {m.router_aux_loss_coef}",
                              m.router_aux_loss_coef > 0)) if on]
    off = "set dsrl.model.routing_replay = 'off' and router_aux_loss_coef = 0"
    if not asked:
        return layout
    if layout is None:
        raise ConfigError(f"{asked[0]} with a dense model ({what} has no mixture-of-experts layers): there are no "
                          f"routes to replay or balance. Fix: {off}, or use an MoE model "
                          "(model.arch 'qwen3_moe', or a Mixtral / Qwen-MoE checkpoint).")
    model_type = getattr(config, "model_type", "")
    if model_type not in ROUTABLE_MODEL_TYPES:
        raise ConfigError(f"{asked[0]} with {what}, a {model_type!r} mixture of experts: dsrl records and replays "
                          f"the routers of {', '.join(ROUTABLE_MODEL_TYPES)} only. Fix: {off}, or use one of "
                          "those architectures.")
    if on_gpu is None:
        on_gpu = torch.cuda.is_available()
    if replay and (why := routes_unsupported(rollout.backend, on_gpu)) is not None:
        raise ConfigError(f"dsrl.model.routing_replay = 'rollout' with rollout.backend = {rollout.backend!r}: "
                          f"{why}, so there would be no routes to replay. Fix: use rollout.backend = 'hf' or 'cb', "
                          "or set routing_replay = 'off'.")
    return layout


@dataclass
class RouteMismatch:
    """This rank's sums of the rollout-vs-trainer comparison (sources only)."""

    pairs: int = 0  # (position, layer) pairs with a route on both sides
    differing: int = 0  # of those, the ones whose set of experts differs
    tokens: int = 0  # counted completion tokens compared below
    own_abs_diff: float = 0.0  # sum |log pi (trainer's own routes) - log mu|
    replayed_abs_diff: float = 0.0  # sum |log pi (rollout's routes replayed) - log mu|
    replayed_tokens: int = 0


class PolicyRouting:
    """The MoE duties of the trainer's forwards (module docstring) for the policy engine and its KL reference."""

    def __init__(self, model_cfg: ModelConfig, policy: Any, reference: torch.nn.Module | None = None):
        """``policy``: the policy's module or DeepSpeed engine; ``reference``: the KL reference's own module (a
        frozen copy), None when the reference is the policy itself (LoRA with its adapters disabled) or absent."""
        routing = MoERouting.of(policy)
        if routing is None:
            raise ValueError("PolicyRouting needs a mixture-of-experts policy")
        self.routing = routing
        self.ref_routing = MoERouting.of(reference) if reference is not None else routing
        if self.ref_routing is None:
            raise ValueError("the KL reference of a mixture-of-experts policy has no MoE router")
        self.replay = model_cfg.routing_replay == REPLAY_ROLLOUT
        self.aux_coef = float(model_cfg.router_aux_loss_coef)
        self.layout = routing.layout

    @property
    def keep_routes(self) -> bool:
        """Whether samples carry their routes to the training forwards (replayed, or counted for the load f)."""
        return self.replay or self.aux_coef > 0

    def release(self) -> None:
        """No routes forced any more (after a mini-batch's backwards, or a pass of forwards)."""
        self.routing.force(None)
        self.ref_routing.force(None)

    def forcing(self, fn: Callable[[Any, dict], Any], routing: MoERouting | None = None) -> Callable[[Any, dict], Any]:
        """``fn`` with each micro-batch's ``routes`` forced first (FREE everywhere when it has none)."""
        routing = routing or self.routing

        def run(model: Any, micro: dict) -> Any:
            routing.force(micro.get("routes"))
            return fn(model, micro)

        return run

    def recorded(self, forward: Callable[[], list[Any]]) -> tuple[list[Any], list[torch.Tensor]]:
        """``forward()``'s outputs and the routes of its forwards (``[rows, layers, top_k]`` each, in order),
        routed by the trainer's own routers."""
        self.routing.force(None)
        with self.routing.recording() as log:
            outs = forward()
        return outs, log.calls()

    def check_sample_routes(self, routes: torch.Tensor, positions: int, where: str) -> None:
        """A sample's routes must fit the policy (``[positions, layers, top_k]``, experts in range), before any
        forward uses them; the error names the setting and the fix."""
        from dsrl.core.routes import RouteShapeError

        fix = (" Fix: generate with the same dsrl.model settings as the trainer (generator ranks included), or set "
               "dsrl.model.routing_replay = 'off'.")
        try:
            self.routing.check_routes(routes, f"the routes of {where}")
        except RouteShapeError as e:
            raise RouteShapeError(f"{e}.{fix}") from None
        if routes.shape[0] != positions:
            raise RouteShapeError(f"the routes of {where} cover {routes.shape[0]} positions, but the sample has "
                                  f"{positions} input positions (tokens - 1): the rollout backend broke its contract "
                                  f"(dsrl.rollout.base).{fix}")

    def checkpoint_state(self) -> dict[str, Any]:
        """What a checkpoint records of the MoE setup (compared on resume by :meth:`check_resumed`)."""
        lay = self.layout
        return {"layers": lay.layers, "experts": lay.experts, "top_k": lay.top_k,
                "routing_replay": "rollout" if self.replay else "off"}

    def check_resumed(self, saved: dict[str, Any] | None, where: str) -> None:
        """A checkpoint written with another routing layout cannot be resumed with this policy's routes."""
        if not saved:
            return
        now = self.checkpoint_state()
        if any(saved.get(k) != now[k] for k in ("layers", "experts", "top_k")):
            raise ConfigError(f"{where} was written by a mixture-of-experts policy routing {saved.get('layers')} "
                              f"layers x {saved.get('experts')} experts, top-{saved.get('top_k')}, but this run's "
                              f"model routes {now['layers']} x {now['experts']}, top-{now['top_k']}: its routes "
                              "would not fit. Fix: resume with the dsrl.model settings the checkpoint was trained "
                              "with, or start a new run (--dsrl.run.output_dir).")

    def compare(self, rollout: torch.Tensor | None, own: torch.Tensor, mismatch: RouteMismatch) -> None:
        """Add one sample's (rollout routes, trainer's own routes) comparison to ``mismatch``."""
        if rollout is None:
            return
        own = sequence_routes(own, rollout.shape[0])
        diff, pairs = differing_pairs(rollout.to(torch.long), own.to(torch.long))
        mismatch.differing += diff
        mismatch.pairs += pairs
