"""The mixture-of-experts side of ``dsrl.check``: forced routes (routing replay, R3) and the router's
load-balancing loss, each against a float64 reference written from the definition.

With ``routing_replay = "rollout"`` (the run file's ``dsrl.model.routing_replay`` or ``--routing_replay``) every
sequence carries random routes ``[positions, moe_layers, top_k]`` (distinct experts per token, drawn from the seed,
mostly *not* the experts the router would choose): dsrl's side forces them through
:class:`dsrl.rollout.routes.MoERouting` (hooks on transformers' routers, or on DeepSpeed AutoEP's router, whose
all-to-all then carries every token to its forced experts); the reference replaces each MoE block of a float64
copy by :func:`reference_block`, the block computed from its definition with the same routes:

    y(x) = sum_k w_k(x) * W_down[e_k] (silu(W_gate[e_k] x) * W_up[e_k] x),   w_k = p_{e_k}(x) / sum_j p_{e_j}(x)

(p = softmax of the router's logits; Qwen-MoE without ``norm_topk_prob``: w_k = p_{e_k}). With
``router_aux_loss_coef`` c > 0 each token's loss gains ``c * a_t`` (:mod:`dsrl.algos.router_balance`); the
reference computes f from all sequences' counted tokens and a_t from its own probabilities.

Planted bugs (``--method``), expected to fail: ``replay_off`` (dsrl's side claims replay but lets the routers
choose) and ``routes_shifted`` (every sequence's routes moved one token later).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from dsrl.cli.check_objectives import HIDDEN, MAX_LEN, VOCAB

MOE_ARCHS = ("mixtral", "qwen3_moe")
PLANTED = ("replay_off", "routes_shifted")


@dataclass(frozen=True)
class MoESettings:
    """What the MoE case of the check runs with."""

    replay: bool
    aux_coef: float

    @property
    def active(self) -> bool:
        return self.replay or self.aux_coef > 0


def settings_from(raw: dict, replay: str | None, aux_coef: float | None) -> MoESettings:
    """The run file's ``dsrl.model`` MoE settings, overridden by the command line."""
    model = (raw.get("dsrl") or {}).get("model") or {}
    mode = replay if replay is not None else model.get("routing_replay", "off")
    coef = aux_coef if aux_coef is not None else float(model.get("router_aux_loss_coef", 0.0))
    return MoESettings(replay=(mode == "rollout"), aux_coef=coef)


def moe_model(arch: str, layers: int = 1) -> torch.nn.Module:
    """A tiny Hugging Face MoE causal LM from a config (no download), eager expert loop, 4 experts, top-2: a Mixtral
    (1 layer; 2 with ``layers=2``, the routing-replay model: a route's layer index then matters) or a Qwen3-MoE (2
    layers, ``norm_topk_prob``; its per-head q/k RMSNorm weights get gradients whose float32 rounding reaches
    ~2e-6 relative on their own, so the check's 1e-6 runs on Mixtral)."""
    from transformers import AutoModelForCausalLM, MixtralConfig, Qwen3MoeConfig

    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=4 * MAX_LEN, pad_token_id=0, tie_word_embeddings=False,
                  output_router_logits=False, num_experts_per_tok=2)
    if arch == "mixtral":
        config = MixtralConfig(intermediate_size=HIDDEN, num_local_experts=4, num_hidden_layers=layers, **common)
    elif arch == "qwen3_moe":
        config = Qwen3MoeConfig(intermediate_size=2 * HIDDEN, moe_intermediate_size=HIDDEN, num_experts=4,
                                norm_topk_prob=True, num_hidden_layers=2, **common)
    else:
        raise ValueError(f"not an MoE architecture of the check: {arch!r} (one of {', '.join(MOE_ARCHS)})")
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32, experts_implementation="eager")


def moe_layout(model: torch.nn.Module) -> tuple[int, int, int]:
    """(MoE layers, experts, top_k) of a check model."""
    from dsrl.core.routes import config_layout

    lay = config_layout(model.config)
    assert lay is not None
    return lay.layers, lay.experts, lay.top_k


def attach_routes(seqs: list[dict[str, torch.Tensor]], layout: tuple[int, int, int], seed: int) -> None:
    """Give every sequence random routes ``[positions, layers, top_k]``: distinct experts per token and layer."""
    layers, experts, top_k = layout
    g = torch.Generator().manual_seed(seed + 15485863)
    for s in seqs:
        n = s["input_ids"].shape[0]
        keys = torch.rand(n, layers, experts, generator=g)
        s["routes"] = keys.argsort(-1)[..., :top_k].to(torch.int16)


def collate_routes(seqs: list[dict[str, torch.Tensor]], width: int) -> torch.Tensor:
    """``[b, width, layers, top_k]`` routes, FREE (-1) at padding."""
    from dsrl.core.routes import FREE

    first = seqs[0]["routes"]
    out = torch.full((len(seqs), width, *first.shape[1:]), FREE, dtype=first.dtype)
    for i, s in enumerate(seqs):
        out[i, : s["routes"].shape[0]] = s["routes"]
    return out


def shifted(routes: torch.Tensor) -> torch.Tensor:
    """The planted bug: each row's routes one position later (the first position keeps its own)."""
    out = routes.clone()
    out[:, 1:] = routes[:, :-1]
    return out


# -- dsrl's side ------------------------------------------------------------------------------------
def mini_batch_load(engine: Any, routing: Any, micros: list[dict]) -> torch.Tensor:
    """f of the whole mini-batch (:func:`dsrl.algos.router_balance.mini_batch_load` over the engine's count group)."""
    from dsrl.algos.router_balance import mini_batch_load as load

    lay = routing.layout
    return load(micros, lay.layers, lay.experts, lay.top_k, engine.sum_over_count_group)


def routed_loss(base: Callable[[Any, dict], torch.Tensor], routing: Any, settings: MoESettings,
                load: torch.Tensor | None, method: str) -> Callable[[Any, dict], torch.Tensor]:
    """dsrl's side: ``base``'s per-token loss with the micro-batch's routes forced (sticky, so the backward's
    re-forwards see them too) and ``aux_coef * a_t`` added."""
    from dsrl.algos.router_balance import balance_per_token

    def loss(engine: Any, micro: dict) -> torch.Tensor:
        routes = micro.get("routes") if settings.replay and method != "replay_off" else None
        if routes is not None and method == "routes_shifted":
            routes = shifted(routes)
        routing.force(routes)
        with routing.router_probs() as probs:
            lt = base(engine, micro)
        if settings.aux_coef > 0:
            lt = lt + settings.aux_coef * balance_per_token(probs, load, lt.shape).to(lt.dtype)
        return lt

    return loss


# -- the reference ----------------------------------------------------------------------------------
def reference_block(block: torch.nn.Module, layer: int, routes: torch.Tensor, probs: list) -> Callable:
    """The forward of one MoE block from its definition (module docstring), with ``routes`` ``[rows, top_k]``
    forced (FREE rows: the float64 top-k), storing the layer's probabilities ``[rows, experts]`` in ``probs``."""
    top_k = int(block.gate.top_k)
    normalise = type(block.gate).__name__ == "MixtralTopKRouter" or bool(getattr(block.gate, "norm_topk_prob", True))

    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        b, t, h = hidden_states.shape
        x = hidden_states.reshape(-1, h)
        p = torch.softmax(x @ block.gate.weight.T, dim=-1)
        probs[layer] = p
        r = routes.to(torch.long)
        free = (r < 0).any(-1, keepdim=True)
        r = torch.where(free, p.topk(top_k, dim=-1).indices, r)
        w = p.gather(1, r)
        if normalise:
            w = w / w.sum(-1, keepdim=True)
        gate_up, down = block.experts.gate_up_proj, block.experts.down_proj
        out = torch.zeros_like(x)
        for k in range(top_k):
            e = r[:, k]
            g, u = torch.einsum("nih,nh->ni", gate_up[e], x).chunk(2, dim=-1)
            out = out + w[:, k:k + 1] * torch.einsum("nhi,ni->nh", down[e], torch.nn.functional.silu(g) * u)
        return out.reshape(b, t, h)

    return forward


@contextlib.contextmanager
def reference_routing(ref: torch.nn.Module, batch: dict[str, torch.Tensor], forced: bool) -> Iterator[list]:
    """Every MoE block of the float64 ``ref`` computed by :func:`reference_block`, with the batch's routes when
    ``forced`` (else FREE everywhere: the float64 top-k); yields the per-layer probabilities of the forward run in
    the block."""
    blocks = [m for m in ref.modules() if hasattr(m, "gate") and hasattr(m, "experts")]
    b, t = batch["input_ids"].shape
    routes = batch.get("routes") if forced else None
    top_k = int(blocks[0].gate.top_k)
    if routes is None:
        routes = torch.full((b, t, len(blocks), top_k), -1, dtype=torch.long)
    flat = routes.reshape(b * t, len(blocks), top_k)
    probs: list = [None] * len(blocks)
    for layer, block in enumerate(blocks):
        block.forward = reference_block(block, layer, flat[:, layer], probs)
    try:
        yield probs
    finally:
        for block in blocks:
            del block.forward


def reference_aux(probs: list, batch: dict[str, torch.Tensor], mask: torch.Tensor, experts: int,
                  top_k: int) -> torch.Tensor:
    """a_t ``[b, t]`` in float64 from the definition: f counted from the routes at the counted tokens of the whole
    mini-batch, a_t = (E / L) sum_l sum_e f_le p_tle."""
    b, t = mask.shape
    counted = mask.reshape(-1) > 0
    routes = batch["routes"].reshape(b * t, len(probs), top_k).to(torch.long)[counted]
    n = int(counted.sum())
    total = torch.zeros(b * t, dtype=torch.float64)
    for layer, p in enumerate(probs):
        f = torch.zeros(experts, dtype=torch.float64)
        for e in range(experts):
            f[e] = (routes[:, layer] == e).sum() / (top_k * n) if n else 0.0
        total = total + (p * f).sum(-1)
    return (total * experts / len(probs)).reshape(b, t)
