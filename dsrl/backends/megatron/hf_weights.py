"""A megatron-core ``GPTModel`` from a Hugging Face decoder (Llama, Qwen2, Qwen3), and its weights both ways.

mbridge (the HF <-> megatron-core bridge verl and slime use) builds its models with Transformer Engine's layer spec,
which needs CUDA; on the CPU, and wherever Transformer Engine is absent, dsrl builds the ``GPTModel`` with
megatron-core's local layer spec and maps the weights itself, per architecture, here. Invariants (tested against
the HF forward, tests/distributed/test_megatron_hf.py):

- :func:`gpt_config` and :func:`build_gpt_model` give the HF model's function: RMSNorm with its epsilon, SwiGLU,
  rotary embeddings with its base (rotate-half, as HF), grouped-query attention, Qwen2's q/k/v biases, Qwen3's
  per-head q/k norms, tied or untied output head; no dropout;
- :func:`load_hf_weights` copies this tensor-parallel rank's shard of every HF weight into the model, name by name:
  q, k and v fused per query group as megatron-core's ``linear_qkv`` holds them, gate and up fused as ``linear_fc1``,
  each split over the tensor-parallel group as megatron-core splits it; every model weight is written once
  (anything left over or missing is an error naming it);
- :func:`gather_hf_weights` is its inverse over the tensor-parallel group: the full HF ``state_dict`` (HF names,
  HF layouts) from the shards, bit for bit what was loaded; :func:`hf_state_of_checkpoint` the same of the model's
  tensors in a dist-checkpoint (offline export).

Pipeline stages hold a contiguous range of layers (megatron-core's layer offset); the HF layer index is the global
one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from dsrl.config import ConfigError

#: the HF ``model_type`` values this map serves
SUPPORTED = ("llama", "qwen2", "qwen3")


def _check(hf_config: Any) -> None:
    kind = getattr(hf_config, "model_type", None)
    if kind not in SUPPORTED:
        raise ConfigError(f"dsrl.engine kind 'megatron': the model's config.json has model_type = {kind!r}; dsrl maps "
                          f"the weights of {', '.join(SUPPORTED)} to megatron-core. Fix: use one of those, or the "
                          "DeepSpeed engine.")
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        raise ConfigError(f"dsrl.engine kind 'megatron': hidden_act = {hf_config.hidden_act!r}; the map builds SwiGLU "
                          "(silu). Fix: use the DeepSpeed engine for this model.")


def head_dim(hf_config: Any) -> int:
    return int(getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads)


def gpt_config(hf_config: Any, **overrides: Any) -> Any:
    """The ``TransformerConfig`` of the HF model (module docstring); ``overrides`` add megatron-core's own settings
    (parallel sizes, ``calculate_per_token_loss``, ``use_cpu_initialization``, ...)."""
    import torch.nn.functional as F
    from megatron.core.transformer import TransformerConfig

    _check(hf_config)
    kind = hf_config.model_type
    settings: dict[str, Any] = dict(
        num_layers=hf_config.num_hidden_layers, hidden_size=hf_config.hidden_size,
        ffn_hidden_size=hf_config.intermediate_size, num_attention_heads=hf_config.num_attention_heads,
        num_query_groups=getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads,
        kv_channels=head_dim(hf_config), normalization="RMSNorm", layernorm_epsilon=hf_config.rms_norm_eps,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        add_qkv_bias=kind == "qwen2" or bool(getattr(hf_config, "attention_bias", False)),
        qk_layernorm=kind == "qwen3", hidden_dropout=0.0, attention_dropout=0.0,
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
    )
    settings.update(overrides)
    return TransformerConfig(**settings)


def layer_spec(config: Any) -> Any:
    """The local layer spec of the HF decoder's layers (RMSNorm, q/k norms when ``config.qk_layernorm``): its core
    attention dsrl's context-parallel one under context parallelism
    (:func:`dsrl.backends.megatron.context_parallel.context_parallel_spec`), its norms marked under sequence
    parallelism (:func:`dsrl.backends.megatron.sequence_parallel.sequence_parallel_spec`)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from dsrl.backends.megatron.context_parallel import context_parallel_spec
    from dsrl.backends.megatron.sequence_parallel import sequence_parallel_spec

    spec = get_gpt_layer_local_spec(qk_layernorm=config.qk_layernorm, normalization="RMSNorm")
    return sequence_parallel_spec(context_parallel_spec(spec, config), config)


def build_gpt_model(hf_config: Any, config: Any, *, pre_process: bool = True, post_process: bool = True,
                    parallel_output: bool = True, value_head: bool = False) -> Any:
    """A ``GPTModel`` of ``config`` (:func:`gpt_config`) shaped like the HF model: local layer spec, rotary
    embeddings, the HF vocabulary and context length, the output head tied when the HF model ties it. With
    ``value_head`` it is the HF ``AutoModelForTokenClassification(num_labels=1)`` (a value model): the output layer is
    a :class:`ValueHead`, replicated over the tensor-parallel group, and nothing is tied."""
    from megatron.core.models.gpt import GPTModel

    spec = layer_spec(config)
    tied = _ties_head(hf_config, value_head)
    gpt = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=hf_config.vocab_size,
                   max_sequence_length=hf_config.max_position_embeddings, pre_process=pre_process,
                   post_process=post_process, parallel_output=parallel_output,
                   share_embeddings_and_output_weights=tied, position_embedding_type="rope",
                   rotary_base=rope_theta(hf_config))
    if value_head and post_process:
        gpt.output_layer = ValueHead(config.hidden_size, config.params_dtype, config.sequence_parallel)
    return gpt


def _ties_head(hf_config: Any, value: bool) -> bool:
    """Whether the model's output head is its embedding: the HF config ties them, and it is not a value model."""
    return bool(getattr(hf_config, "tie_word_embeddings", False)) and not value


class ValueHead(torch.nn.Module):
    """A value model's output layer in ``GPTModel``'s place for it: ``weight [1, H]`` and ``bias [1]`` (the HF
    ``score``, ``Linear(H, 1)``), replicated on every tensor-parallel rank (named ``output_layer.*`` as megatron-core's
    checkpointing expects of a post-process stage). Every rank of the group computes the same values from the same
    hidden states, so each computes the whole gradient of its copy and of the hidden states: no collective is needed
    (as for the final norm); the gradient norm counts the copy once (it is not marked tensor-parallel). Under
    sequence parallelism (``split_positions``) each rank sees a slice of the positions, so its gradient is a partial
    sum, marked ``sequence_parallel`` for ``finalize_model_grads`` to add up over the group, as the norms' are."""

    sequence_parallel = False  # the layer does not gather its input (the model's face gathers its output)

    def __init__(self, hidden_size: int, dtype: torch.dtype, split_positions: bool = False):
        super().__init__()
        score = torch.nn.Linear(hidden_size, 1, dtype=dtype)  # HF's initialisation (overwritten by the HF weights)
        self.weight, self.bias = score.weight, score.bias
        for param in (self.weight, self.bias):
            param.sequence_parallel = split_positions  # type: ignore[attr-defined]

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor | None = None,
                runtime_gather_output: bool | None = None) -> tuple[torch.Tensor, None]:
        return torch.nn.functional.linear(hidden, self.weight, self.bias), None


def rope_theta(hf_config: Any) -> int:
    """The rotary base of the HF model: ``rope_parameters["rope_theta"]`` (transformers 5), else the older top-level
    ``rope_theta``. Rotary scaling (``rope_type`` other than ``default``: llama3, yarn, ...) is refused: the local
    spec's rotary embedding has no such variant in this map."""
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ("default", None):
        raise ConfigError(f"dsrl.engine kind 'megatron': the model's config.json scales its rotary embedding "
                          f"(rope_type = {kind!r}); dsrl's map builds plain rotary embeddings. Fix: use the DeepSpeed "
                          "engine for this model.")
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", None))
    return int(theta if theta is not None else 10000)


# -- the map -------------------------------------------------------------------------------------------


def _layer_names(i: int) -> dict[str, list[str]]:
    """megatron-core name (within layer ``decoder.layers.{local}``) -> the HF names it is made of (global layer i)."""
    p = f"model.layers.{i}."
    return {
        "input_layernorm.weight": [p + "input_layernorm.weight"],
        "self_attention.linear_qkv.weight": [p + "self_attn.q_proj.weight", p + "self_attn.k_proj.weight",
                                             p + "self_attn.v_proj.weight"],
        "self_attention.linear_qkv.bias": [p + "self_attn.q_proj.bias", p + "self_attn.k_proj.bias",
                                           p + "self_attn.v_proj.bias"],
        "self_attention.q_layernorm.weight": [p + "self_attn.q_norm.weight"],
        "self_attention.k_layernorm.weight": [p + "self_attn.k_norm.weight"],
        "self_attention.linear_proj.weight": [p + "self_attn.o_proj.weight"],
        "pre_mlp_layernorm.weight": [p + "post_attention_layernorm.weight"],
        "mlp.linear_fc1.weight": [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"],
        "mlp.linear_fc2.weight": [p + "mlp.down_proj.weight"],
    }


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int) -> torch.Tensor:
    """megatron-core's ``linear_qkv`` rows: for each query group, its query heads, then its key, then its value."""
    per = q.shape[0] // groups
    qg, kg, vg = q.reshape(groups, per, *q.shape[1:]), k.reshape(groups, -1, *k.shape[1:]), \
        v.reshape(groups, -1, *v.shape[1:])
    return torch.cat([qg, kg, vg], dim=1).reshape(-1, *q.shape[1:])


def _split_qkv(fused: torch.Tensor, groups: int, q_rows: int, kv_rows: int) -> tuple[torch.Tensor, ...]:
    """The inverse of :func:`_fuse_qkv`: (q, k, v) of ``groups`` query groups."""
    g = fused.reshape(groups, (q_rows + 2 * kv_rows) // groups, *fused.shape[1:])
    qn, kn = q_rows // groups, kv_rows // groups
    parts = g[:, :qn], g[:, qn:qn + kn], g[:, qn + kn:]
    return tuple(t.reshape(-1, *fused.shape[1:]) for t in parts)


def _stage(model: Any) -> tuple[dict[str, torch.nn.Parameter], int, bool]:
    """The model's weights by name (bare: no DDP ``module.`` prefix), its first layer's global index (a pipeline
    stage holds layers ``offset ...``) and whether its output layer is a value model's :class:`ValueHead`."""
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    while hasattr(model, "module") and not hasattr(model, "decoder") and not hasattr(model, "embedding"):
        model = model.module
    value = isinstance(getattr(model, "output_layer", None), ValueHead)
    return dict(model.named_parameters()), int(get_transformer_layer_offset(model.config)), value


class _Layout:
    """How one tensor-parallel rank holds the model (sizes of the HF model, this rank's share)."""

    def __init__(self, hf_config: Any, tp_rank: int, tp_size: int, value: bool = False):
        self.value = value  # a value model: its output layer is replicated
        self.groups = int(getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads)
        self.q_rows = hf_config.num_attention_heads * head_dim(hf_config)
        self.kv_rows = self.groups * head_dim(hf_config)
        self.rank, self.size = tp_rank, tp_size
        if self.groups % tp_size:
            raise ConfigError(f"tensor_model_parallel_size = {tp_size} does not divide the model's "
                              f"{self.groups} key/value heads; choose a divisor of it")

    def kind(self, mcore: str) -> str | None:
        """How megatron-core splits a weight over the tensor-parallel group: ``rows`` (column-parallel and
        vocabulary-parallel: output rows), ``fc1`` (gate and up split each), ``cols`` (row-parallel: input columns)
        or None (replicated: the norms, a value model's head)."""
        if self.value and mcore.startswith("output_layer."):
            return None
        if mcore.endswith(("linear_qkv.weight", "linear_qkv.bias", "word_embeddings.weight", "output_layer.weight")):
            return "rows"
        if mcore.endswith("linear_fc1.weight"):
            return "fc1"
        if mcore.endswith(("linear_proj.weight", "linear_fc2.weight")):
            return "cols"
        return None

    def shard(self, mcore: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of a full megatron-core tensor (already fused)."""
        kind = self.kind(mcore)
        if self.size == 1 or kind is None:
            return full
        if kind == "rows":
            return full.chunk(self.size, dim=0)[self.rank]
        if kind == "fc1":  # gate and up each split, then this rank's halves fused again
            gate, up = full.chunk(2, dim=0)
            return torch.cat([gate.chunk(self.size, 0)[self.rank], up.chunk(self.size, 0)[self.rank]])
        return full.chunk(self.size, dim=1)[self.rank]

    def unshard(self, mcore: str, parts: list[torch.Tensor]) -> torch.Tensor:
        """The full megatron-core tensor from every rank's part (in rank order)."""
        kind = self.kind(mcore)
        if len(parts) == 1 or kind is None:
            return parts[0]
        if kind == "rows":
            return torch.cat(parts, dim=0)
        if kind == "fc1":
            halves = [p.chunk(2, dim=0) for p in parts]
            return torch.cat([torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])])
        return torch.cat(parts, dim=1)


def _pairs(names: list[str], offset: int, tied: bool, value: bool = False) -> Iterator[tuple[str, list[str]]]:
    """(megatron-core name, the HF names it is made of) for every weight of a model (stage). A tied model's output
    layer (its own copy on the last pipeline stage) is the HF embedding; a value model's is the HF ``score``."""
    for name in names:
        if name == "embedding.word_embeddings.weight":
            yield name, ["model.embed_tokens.weight"]
        elif name == "decoder.final_layernorm.weight":
            yield name, ["model.norm.weight"]
        elif value and name in ("output_layer.weight", "output_layer.bias"):  # a value model's ValueHead
            yield name, ["score." + name.rsplit(".", 1)[1]]
        elif name == "output_layer.weight":
            yield name, ["model.embed_tokens.weight" if tied else "lm_head.weight"]
        elif name.startswith("decoder.layers."):
            local, rest = name[len("decoder.layers."):].split(".", 1)
            table = _layer_names(offset + int(local))
            if rest not in table:
                raise ValueError(f"megatron-core weight {name} has no Hugging Face counterpart in dsrl's map")
            yield name, table[rest]
        else:
            raise ValueError(f"megatron-core weight {name} has no Hugging Face counterpart in dsrl's map")


def load_hf_weights(model: Any, hf_config: Any, state: Mapping[str, torch.Tensor], tp_rank: int = 0,
                    tp_size: int = 1) -> None:
    """Copy this tensor-parallel rank's shard of the HF ``state`` into ``model`` (module docstring). A tied model's
    output layer (the last pipeline stage's copy) takes the embedding, and its ``lm_head.weight`` may be absent from
    ``state``; any other missing HF weight, or an HF weight no model weight takes (on a model holding every layer),
    is an error naming it."""
    params, offset, value = _stage(model)
    lay = _Layout(hf_config, tp_rank, tp_size, value)
    names = list(params)
    used: set[str] = set()
    tied = _ties_head(hf_config, value)
    for mcore, hf_names in _pairs(names, offset, tied, value):
        missing = [n for n in hf_names if n not in state]
        if missing:
            raise ValueError(f"the Hugging Face weights lack {', '.join(missing)} (for megatron-core {mcore})")
        parts = [state[n] for n in hf_names]
        if mcore.endswith(("linear_qkv.weight", "linear_qkv.bias")):
            full = _fuse_qkv(*parts, groups=lay.groups)
        elif mcore.endswith("linear_fc1.weight"):
            full = torch.cat(parts, dim=0)
        else:
            full = parts[0]
        shard = lay.shard(mcore, full)
        target = params[mcore]
        if shard.shape != target.shape:
            raise ValueError(f"{' + '.join(hf_names)} give megatron-core {mcore} the shape {tuple(shard.shape)} on "
                             f"tensor-parallel rank {tp_rank}, but the model holds {tuple(target.shape)}")
        with torch.no_grad():
            target.copy_(shard)
        used.update(hf_names)
    holds_all = len({n.split(".")[2] for n in names if n.startswith("decoder.layers.")}) == hf_config.num_hidden_layers
    left = sorted(n for n in state if n not in used and not (tied and n == "lm_head.weight"))
    if holds_all and left:
        raise ValueError(f"Hugging Face weights that no megatron-core weight takes: {', '.join(left[:5])}")


def gather_hf_weights(model: Any, hf_config: Any, tp_group: Any = None) -> dict[str, torch.Tensor]:
    """This pipeline stage's weights as HF names and layouts, full (gathered over the tensor-parallel group
    ``tp_group``; None: one rank holds everything). Collective over ``tp_group``. A replicated weight is the
    parameter itself (no copy)."""
    return dict(iter_hf_weights(model, hf_config, tp_group))


def iter_hf_weights(model: Any, hf_config: Any, tp_group: Any = None,
                    tensor_of: Callable[[torch.Tensor], torch.Tensor] | None = None,
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """:func:`gather_hf_weights` one megatron-core weight at a time: ``(HF name, full tensor)``, each gathered over
    the tensor-parallel group when it is reached (every rank of ``tp_group`` must consume the iterator to its end, in
    step), so that at most one full weight is held beside the shards. ``tensor_of(parameter)``: the tensor to give
    for a parameter (default: the parameter; the optimizer's fp32 main copy under mixed precision)."""
    import torch.distributed as dist

    size = dist.get_world_size(tp_group) if tp_group is not None else 1
    rank = dist.get_rank(tp_group) if tp_group is not None else 0
    params, offset, value = _stage(model)
    lay = _Layout(hf_config, rank, size, value)
    tied = _ties_head(hf_config, value)
    for mcore, hf_names in _pairs(list(params), offset, tied, value):
        if tied and mcore == "output_layer.weight":
            continue  # the last stage's copy of the embedding: the HF model has it once
        local = (tensor_of(params[mcore]) if tensor_of is not None else params[mcore]).detach()
        parts = [local]
        if size > 1 and lay.kind(mcore) is not None:  # replicated tensors need no gather
            parts = [torch.empty_like(local) for _ in range(size)]
            dist.all_gather(parts, local.contiguous(), group=tp_group)
        yield from _unfused(mcore, hf_names, lay.unshard(mcore, parts), lay)


def _unfused(mcore: str, hf_names: list[str], full: torch.Tensor, lay: _Layout) -> Iterator[tuple[str, torch.Tensor]]:
    """The HF tensors a full megatron-core tensor is made of (q/k/v and gate/up split apart)."""
    if mcore.endswith(("linear_qkv.weight", "linear_qkv.bias")):
        yield from zip(hf_names, _split_qkv(full, lay.groups, lay.q_rows, lay.kv_rows))
    elif mcore.endswith("linear_fc1.weight"):
        yield from zip(hf_names, full.chunk(2, dim=0))
    else:
        yield hf_names[0], full


#: checkpoint key (within a layer) -> parameter name, where megatron-core's local layers save under Transformer
#: Engine's names (the norms fused into the next linear there)
_CHECKPOINT_KEYS = {"self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
                    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight"}


def hf_state_of_checkpoint(tensors: Mapping[str, torch.Tensor], hf_config: Any) -> dict[str, torch.Tensor]:
    """The HF ``state_dict`` of a model's tensors as megatron-core's dist-checkpointing saved them, read whole (any
    tensor and pipeline sizes: the layers stacked along a first axis of ``num_hidden_layers``, the norms under their
    checkpoint keys). A value model (its ``output_layer.bias``) gives its ``score``; a tied model's head is the
    embedding (no ``lm_head.weight``). Anything the map does not know is an error naming it."""
    params: dict[str, torch.Tensor] = {}
    for key, tensor in tensors.items():
        if key.startswith("decoder.layers."):
            rest = key[len("decoder.layers."):]
            rest = _CHECKPOINT_KEYS.get(rest, rest)
            if tensor.shape[0] != hf_config.num_hidden_layers:
                raise ValueError(f"checkpoint tensor {key} stacks {tensor.shape[0]} layers; the model's config.json "
                                 f"has {hf_config.num_hidden_layers}")
            params.update({f"decoder.layers.{i}.{rest}": tensor[i] for i in range(tensor.shape[0])})
        else:
            params[key] = tensor
    value = "output_layer.bias" in params
    tied = _ties_head(hf_config, value)
    lay = _Layout(hf_config, 0, 1, value)
    out: dict[str, torch.Tensor] = {}
    for mcore, hf_names in _pairs(list(params), 0, tied, value):
        out.update(_unfused(mcore, hf_names, params[mcore], lay))
    return out
