"""Recording and replaying the routes of a mixture-of-experts policy (R3) on the model itself.

Routes are the data format of :mod:`dsrl.core.routes` (``[positions, moe_layers, top_k]`` per sequence, FREE =
route freely).

**Replay invariant** (:meth:`MoERouting.force`). With routes forced, a forward computes the router's logits as
usual (so the router's gradient flows), sends every token that has a route to exactly the forced experts, and
weights each forced expert by the router's probability at it, normalised the way the architecture normalises its
own top-k: Mixtral always, Qwen2/Qwen3-MoE when ``norm_topk_prob``, DeepSpeed AutoEP's router by its
``route_norm`` and ``route_scale``. Tokens without a route (FREE) are routed exactly as without replay. Forcing
the routes a forward itself chose reproduces that forward bit for bit.

**Where.** Hooks on the routers of transformers' MoE blocks (``MixtralTopKRouter``, ``Qwen2MoeTopKRouter``,
``Qwen3MoeTopKRouter``, which return ``(logits, top-k weights, top-k experts)``) and, under DeepSpeed AutoEP
(which replaces each MoE block by an ``AutoEPMoELayer``), on the layer's ``TokenChoiceTopKRouter`` (returning
``(top-k weights, top-k experts, tokens per expert)``) and that router's ``gate`` (the logits). Forcing there
changes the experts the AutoEP layer dispatches to, so tokens travel to their forced experts by its all-to-all.
The hooks see the block's input flattened to ``[rows, hidden]`` in (batch, position) order, so forced routes are
given as ``[batch, positions, layers, top_k]`` (or already flat) for the micro-batch about to run.

The hooks are installed once per model (:meth:`MoERouting.of`) and do nothing unless routes are forced or a
recording / probability capture is open. Forcing is *sticky* (it stays until the next :meth:`MoERouting.force`),
so a gradient-checkpointed layer that re-runs its forward during the backward re-runs it with the same routes.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from dsrl.core.routes import AUTOEP_LAYER, FREE, HF_ROUTERS, ROUTE_DTYPE, MoELayout, RouteShapeError

_ROUTINGS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> its MoERouting


@dataclass
class _Site:
    """One MoE layer's router and how to read and force it."""

    layer: int
    router: torch.nn.Module
    kind: str  # "hf" (transformers' top-k router) or "autoep" (DeepSpeed's TokenChoiceTopKRouter)
    expert_parallel_size: int = 1  # autoep: ranks the layer's experts are split over (tokens travel by all-to-all)
    logits: torch.Tensor | None = None  # autoep: the gate's output of the running forward


def _hf_normalises(router: torch.nn.Module) -> bool:
    """Whether a transformers router renormalises its top-k probabilities (Mixtral always; Qwen: norm_topk_prob)."""
    if type(router).__name__ == "MixtralTopKRouter":
        return True
    return bool(router.norm_topk_prob)


def _hf_probs(router: torch.nn.Module, logits: torch.Tensor) -> torch.Tensor:
    """The router's softmax over experts, computed as the router computes it (float32)."""
    if type(router).__name__ == "MixtralTopKRouter":
        return torch.nn.functional.softmax(logits.float(), dim=-1)
    return torch.nn.functional.softmax(logits, dtype=torch.float, dim=-1)


def _autoep_probs(router: torch.nn.Module, logits: torch.Tensor) -> torch.Tensor:
    if router.score_func == "softmax":
        return torch.nn.functional.softmax(logits.to(torch.float32), dim=1)
    if router.score_func == "sigmoid":
        return torch.sigmoid(logits.to(torch.float32))
    raise NotImplementedError(f"AutoEP router score function {router.score_func!r}")


class MoERouting:
    """The routers of one model, hooked once: record routes, force routes, capture router probabilities.

    Build it with :meth:`of` *after* ``deepspeed.initialize`` (AutoEP replaces the MoE blocks there)."""

    def __init__(self, sites: list[_Site], layout: MoELayout):
        self.sites, self.layout = sites, layout
        self._forced: torch.Tensor | None = None  # [rows, layers, top_k] long
        self._records: list[list[torch.Tensor]] | None = None
        self._probs: list[torch.Tensor | None] | None = None
        self._handles: list[Any] = []
        for site in sites:
            if site.kind == "autoep":
                self._handles.append(site.router.gate.register_forward_hook(self._gate_hook(site)))
            self._handles.append(site.router.register_forward_hook(self._router_hook(site)))

    # -- finding the routers ---------------------------------------------------------------------
    @classmethod
    def of(cls, model: Any) -> MoERouting | None:
        """The routing of ``model`` (a module, a DeepSpeed engine or a PEFT model), None when it has no MoE
        router; one per model (the same object for every caller while the model's routers stay the same).
        Raises when it has routers of more than one kind or of inconsistent shapes."""
        module = getattr(model, "module", model)
        sites = cls._find(module)
        known = _ROUTINGS.get(module)
        if known is not None and [s.router for s in known.sites] == [s.router for s in sites]:
            return known
        if known is not None:  # the routers were replaced (AutoEP builds its layers in deepspeed.initialize)
            known.close()
        routing = cls._build(sites)
        if routing is not None:
            _ROUTINGS[module] = routing
        return routing

    @classmethod
    def _find(cls, module: torch.nn.Module) -> list[_Site]:
        sites: list[_Site] = []
        for _, sub in module.named_modules():
            name = type(sub).__name__
            if name in HF_ROUTERS:
                sites.append(_Site(len(sites), sub, "hf"))
            elif name == AUTOEP_LAYER:
                sites.append(_Site(len(sites), sub.router, "autoep", int(sub.ep_size)))
        return sites

    @classmethod
    def _build(cls, sites: list[_Site]) -> MoERouting | None:
        if not sites:
            return None
        shapes = {(int(s.router.num_experts), int(s.router.top_k)) for s in sites}
        kinds = {s.kind for s in sites}
        if len(shapes) != 1 or len(kinds) != 1:
            raise RuntimeError(f"the model's MoE routers differ in kind or shape ({sorted(kinds)}, "
                               f"(experts, top_k) = {sorted(shapes)}); dsrl routes one kind of uniform router")
        experts, top_k = shapes.pop()
        return cls(sites, MoELayout(layers=len(sites), experts=experts, top_k=top_k))

    @property
    def expert_parallel_size(self) -> int:
        """The largest AutoEP expert-parallel size of the layers (1 without AutoEP): above 1 every forward is a
        collective of the expert-parallel group, so its ranks must run the same number of forwards."""
        return max(s.expert_parallel_size for s in self.sites)

    def close(self) -> None:
        """Remove the hooks."""
        for h in self._handles:
            h.remove()
        self._handles = []

    # -- forcing ---------------------------------------------------------------------------------
    def force(self, routes: torch.Tensor | None) -> None:
        """Force ``routes`` (``[batch, positions, layers, top_k]`` or ``[rows, layers, top_k]``, :data:`FREE` =
        route freely) in every following forward until the next call; None routes freely again."""
        if routes is None:
            self._forced = None
            return
        if routes.dim() == 4:
            routes = routes.reshape(-1, *routes.shape[2:])
        self.check_routes(routes, "forced routes", values=False)  # values: where routes enter (no device sync here)
        self._forced = routes.to(torch.long)

    @contextlib.contextmanager
    def forcing(self, routes: torch.Tensor | None) -> Iterator[None]:
        """:meth:`force` for the block only (not for a backward that re-runs forwards after it)."""
        self.force(routes)
        try:
            yield
        finally:
            self._forced = None

    def check_routes(self, routes: torch.Tensor, what: str, values: bool = True) -> None:
        """``routes[..., layers, top_k]`` must match this model's layout and (``values``) hold expert ids or FREE."""
        lay = self.layout
        if routes.dim() < 2 or tuple(routes.shape[-2:]) != (lay.layers, lay.top_k):
            raise RouteShapeError(f"{what} have shape {tuple(routes.shape)}, but the model routes every token through "
                                  f"{lay.layers} MoE layers to {lay.top_k} experts ([..., {lay.layers}, {lay.top_k}] "
                                  "expected): they were recorded on another model")
        if values and routes.numel() and (int(routes.max()) >= lay.experts or int(routes.min()) < FREE):
            raise RouteShapeError(f"{what} name experts outside 0..{lay.experts - 1} (the model has {lay.experts} "
                                  "experts per layer): they were recorded on another model")

    def _forced_for(self, site: _Site, rows: int) -> torch.Tensor | None:
        forced = self._forced
        if forced is None:
            return None
        if forced.shape[0] != rows:
            raise RouteShapeError(f"forced routes cover {forced.shape[0]} token rows but MoE layer {site.layer}'s "
                                  f"router sees {rows}: routes must be given for exactly the micro-batch that runs "
                                  "([batch, positions, layers, top_k] of its input_ids)")
        return forced[:, site.layer]

    # -- recording and capture -------------------------------------------------------------------
    @contextlib.contextmanager
    def recording(self) -> Iterator[RouteLog]:
        """Record the experts of every forward run in the block (after any forcing)."""
        log = RouteLog(self.layout)
        self._records = log.per_layer
        try:
            yield log
        finally:
            self._records = None

    @contextlib.contextmanager
    def router_probs(self) -> Iterator[list[torch.Tensor | None]]:
        """Capture each MoE layer's router probabilities ``[rows, experts]`` (float32, in the autograd graph) of
        the forward run in the block; the yielded list holds one entry per layer."""
        probs: list[torch.Tensor | None] = [None] * self.layout.layers
        self._probs = probs
        try:
            yield probs
        finally:
            self._probs = None

    # -- the hooks -------------------------------------------------------------------------------
    def _gate_hook(self, site: _Site) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: Any, output: torch.Tensor) -> None:
            site.logits = output

        return hook

    def _router_hook(self, site: _Site) -> Callable[..., Any]:
        def hook(module: torch.nn.Module, args: Any, output: Any) -> Any:
            if self._forced is None and self._records is None and self._probs is None:
                site.logits = None
                return None
            if site.kind == "hf":
                out, experts, probs = self._hf_output(site, output)
            else:
                out, experts, probs = self._autoep_output(site, output)
                site.logits = None
            if self._records is not None:
                self._records[site.layer].append(experts.detach().to(ROUTE_DTYPE))
            if self._probs is not None:
                self._probs[site.layer] = probs
            return out

        return hook

    def _hf_output(self, site: _Site, output: Any) -> tuple[Any, torch.Tensor, torch.Tensor]:
        logits, scores, experts = output
        probs = _hf_probs(site.router, logits)
        forced = self._forced_for(site, experts.shape[0])
        if forced is None:
            return output, experts, probs
        forced = forced.to(experts.device)
        experts = torch.where((forced < 0).any(-1, keepdim=True), experts, forced.to(experts.dtype))
        top = probs.gather(-1, experts)
        if _hf_normalises(site.router):
            top = top / top.sum(dim=-1, keepdim=True)
        return (logits, top.to(scores.dtype), experts), experts, probs

    def _autoep_output(self, site: _Site, output: Any) -> tuple[Any, torch.Tensor, torch.Tensor]:
        top_scores, experts, counts = output
        router = site.router
        if site.logits is None:
            raise RuntimeError("AutoEP router ran without its gate: DeepSpeed's TokenChoiceTopKRouter changed")
        probs = _autoep_probs(router, site.logits)
        forced = self._forced_for(site, experts.shape[0])
        if forced is None:
            return output, experts, probs
        from deepspeed.moe.ep_count import count_tokens_per_expert

        forced = forced.to(experts.device)
        experts = torch.where((forced < 0).any(-1, keepdim=True), experts, forced.to(experts.dtype))
        top = probs.gather(dim=1, index=experts)
        if router.route_norm:
            top = top / (top.sum(dim=-1, keepdim=True) + 1e-20)
        top = top * router.route_scale
        return (top, experts, count_tokens_per_expert(experts, router.num_experts)), experts, probs


class RouteLog:
    """What :meth:`MoERouting.recording` saw: per layer, the experts of each forward's rows."""

    def __init__(self, layout: MoELayout):
        self.layout = layout
        self.per_layer: list[list[torch.Tensor]] = [[] for _ in range(layout.layers)]

    @property
    def forwards(self) -> int:
        return len(self.per_layer[0]) if self.per_layer else 0

    def call(self, i: int) -> torch.Tensor:
        """Forward ``i``'s routes, ``[rows, layers, top_k]`` (ROUTE_DTYPE, on the CPU)."""
        return torch.stack([layer[i] for layer in self.per_layer], dim=1).cpu()

    def calls(self) -> list[torch.Tensor]:
        return [self.call(i) for i in range(self.forwards)]


def generation_routes(log: RouteLog, rows: int, width: int, generated: int) -> torch.Tensor:
    """``[rows, width + generated - 1, layers, top_k]`` routes of a KV-cached generation of ``generated`` new tokens
    on ``rows`` prompts padded to ``width``: the prefill forward's, then one position per decode forward (a
    generation's last token is never fed back; decode forwards beyond ``generated - 1``, which synchronised
    generation runs while other ranks finish, are not part of any sequence)."""
    if log.forwards == 0:
        raise RuntimeError("no forward was recorded during generation")
    first = log.call(0)
    parts = [first.reshape(rows, width, *first.shape[1:])]
    for i in range(1, min(generated, log.forwards)):
        parts.append(log.call(i).reshape(rows, -1, *parts[0].shape[2:]))
    return torch.cat(parts, dim=1)
