"""Shared pieces of the Megatron multi-process tests: a tiny GPTModel, RL-shaped data, the
per-token PPO loss, gathering TP/PP-sharded weights and gradients into one unsharded state, and the
single-process float64 reference gradient of L_M = sum_t w_t l_t."""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.distributed as dist

from dsrl.algos.losses import clipped_policy_loss
from dsrl.cli.check_measures import relative_error as relative_error
from dsrl.cli.reference import reference_gradient
from dsrl.core.weights import GlobalCounts, local_counts

VOCAB, HIDDEN, HEADS, LAYERS, SEQ, MAX_POS = 64, 32, 4, 2, 16, 32
CLIP_LOW, CLIP_HIGH = 0.2, 0.28
TEMPERATURE, ENTROPY_COEF = 0.8, 0.05  # the fused output layer's cases (gpt_fused_forward, fused_ppo_loss)
NORM_LENGTH = 12


def transformer_config(per_token: bool, pp: int = 1, **extra: Any) -> Any:
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, use_cpu_initialization=True,
        calculate_per_token_loss=per_token, pipeline_dtype=torch.float32, hidden_dropout=0.0,
        attention_dropout=0.0, pipeline_model_parallel_size=pp, **extra,
    )


def gpt_model(config: Any, pre_process: bool = True, post_process: bool = True) -> Any:
    """The local spec; with ``config.sequence_parallel`` its norms made to take it (dsrl's sequence_parallel_spec)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from dsrl.backends.megatron import sequence_parallel_spec

    spec = sequence_parallel_spec(get_gpt_layer_local_spec(), config)
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB,
                    max_sequence_length=MAX_POS, pre_process=pre_process, post_process=post_process)


def build_parallel(per_token: bool, seed: int = 0, ddp_kwargs: dict | None = None,
                   flip_flag_after_ddp: bool | None = None, sequence_parallel: bool = False) -> tuple[Any, Any, Any]:
    """(DDP model, megatron optimizer, scheduler) for the current parallel state."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from dsrl.backends.megatron import build_param_scheduler

    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    split = {"tensor_model_parallel_size": ps.get_tensor_model_parallel_world_size(),
             "sequence_parallel": True} if sequence_parallel else {}
    cfg = transformer_config(per_token, ps.get_pipeline_model_parallel_world_size(), **split)
    model = gpt_model(cfg, ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage())
    ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(**(ddp_kwargs or {})), model)
    if flip_flag_after_ddp is not None:
        cfg.calculate_per_token_loss = flip_flag_after_ddp
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-4, min_lr=0.0, clip_grad=0.0), [ddp])
    sched = build_param_scheduler(opt, total_optimizer_steps=20, max_lr=1e-4, warmup_steps=2)
    return ddp, opt, sched


def make_micro(gen: torch.Generator, b: int = 2, s: int = SEQ, vocab: int = VOCAB, empty_row: bool = False) -> dict:
    tokens = torch.randint(1, vocab, (b, s), generator=gen)
    labels = torch.randint(1, vocab, (b, s), generator=gen)
    mask = torch.zeros(b, s)
    for i in range(b):
        p = int(torch.randint(2, 6, (1,), generator=gen))
        c = 0 if (empty_row and i == 0) else int(torch.randint(1, s - p + 1, (1,), generator=gen))
        mask[i, p:p + c] = 1
    return {
        "tokens": tokens, "labels": labels, "loss_mask": mask,
        "position_ids": torch.arange(s).unsqueeze(0).expand(b, s).contiguous(),
        "old_logprobs": -4.2 + 0.3 * torch.randn(b, s, generator=gen),
        "advantages": torch.randn(b, generator=gen),
    }


def make_replicas(seed: int, counts: list[int]) -> list[list[dict]]:
    """Micro-batches of every data-parallel replica (identical on every rank)."""
    gen = torch.Generator().manual_seed(seed)
    return [[make_micro(gen, empty_row=(r == 0 and i == 0)) for i in range(m)] for r, m in enumerate(counts)]


def gpt_forward(model: Any, mb: dict) -> torch.Tensor:
    return model(input_ids=mb["tokens"], position_ids=mb["position_ids"], attention_mask=None, labels=mb["labels"])


def gpt_fused_forward(model: Any, mb: dict, vocab_parallel: bool = True) -> torch.Tensor:
    """[b, s, STATS] (log pi, entropy, gap) from the vocabulary-parallel output layer fused into dsrl's tiled
    log-softmax (dsrl.backends.megatron.fused_output_layer): no logits."""
    from dsrl.backends.megatron import fused_output_layer

    with fused_output_layer(model, mb["labels"], temperature=TEMPERATURE, entropy_grad=True,
                            vocab_parallel=vocab_parallel):
        return model(input_ids=mb["tokens"], position_ids=mb["position_ids"], attention_mask=None)


def gpt_reference_stats(model: Any, mb: dict) -> torch.Tensor:
    """[b, s, 2] (log pi, entropy) from the model's full logits and a plain float64 log-softmax (the reference)."""
    logits = model(input_ids=mb["tokens"], position_ids=mb["position_ids"], attention_mask=None)
    logp = torch.log_softmax(logits.double() / TEMPERATURE, dim=-1)
    return torch.stack([logp.gather(-1, mb["labels"].unsqueeze(-1)).squeeze(-1), -(logp.exp() * logp).sum(-1)], -1)


def fused_ppo_loss(output: torch.Tensor, mb: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """output = [b, s, >= 2] (log pi, entropy) -> PPO clipped loss minus an entropy bonus, per token."""
    logp, entropy = output[..., 0], output[..., 1]
    loss, info = clipped_policy_loss(logp, mb["old_logprobs"].to(logp.dtype), mb["advantages"].to(logp.dtype),
                                     CLIP_LOW, CLIP_HIGH)
    return loss - ENTROPY_COEF * entropy, {"ratio": info["ratio"]}


def ppo_loss(output: torch.Tensor, mb: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """output = per-token cross entropy [b, t] (GPTModel with labels) -> PPO clipped loss per token."""
    logp = -output
    loss, info = clipped_policy_loss(logp, mb["old_logprobs"].to(logp.dtype), mb["advantages"].to(logp.dtype),
                                     CLIP_LOW, CLIP_HIGH)
    return loss, {"ratio": info["ratio"]}


def global_counts_of(all_micros: list[dict]) -> GlobalCounts:
    """The tokens and sequences of every micro-batch of every replica, counted in one process (what the all-reduce
    of each replica's local counts must give)."""
    tok = seq = 0
    for mb in all_micros:
        t, s = local_counts(mb)
        tok, seq = tok + t, seq + s
    return GlobalCounts(tokens=tok, sequences=seq)


def reference_grads(model: torch.nn.Module, all_micros: list[dict], mode: str, forward: Any, loss: Any,
                    mini_batch_size: int) -> dict[str, torch.Tensor]:
    """grad of the mini-batch loss over every micro-batch of every replica, one process, float64, from its definition
    (:func:`dsrl.cli.reference.reference_gradient`)."""
    def per_token(m: torch.nn.Module, mb: dict) -> torch.Tensor:
        out = loss(forward(m, mb), mb)
        return out[0] if isinstance(out, tuple) else out

    return reference_gradient(model, all_micros, per_token, mode, mini_batch_size=mini_batch_size,
                              norm_length=NORM_LENGTH)


def ratio_to_reference(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    """<g, g_ref> / <g_ref, g_ref>: the factor by which g is a multiple of g_ref."""
    num = sum(float((got[n].double() * r).sum()) for n, r in ref.items())
    den = sum(float((r * r).sum()) for r in ref.values())
    return num / den


def gather_full(ddp: Any, what: str) -> dict[str, torch.Tensor]:
    """Unsharded parameters (``what="param"``) or finalized gradients (``"grad"``, the DDP main_grad),
    keyed by their TP=1/PP=1 names; complete on rank 0, empty elsewhere."""
    from megatron.core import parallel_state as ps

    tp_group = ps.get_tensor_model_parallel_group()
    tp = ps.get_tensor_model_parallel_world_size()
    offset = ps.get_pipeline_model_parallel_rank() * (LAYERS // ps.get_pipeline_model_parallel_world_size())
    mine: dict[str, torch.Tensor] = {}
    for name, p in ddp.module.named_parameters():
        t = (p.main_grad if what == "grad" else p).detach().float().clone()
        if tp > 1 and getattr(p, "tensor_model_parallel", False):
            parts = [torch.empty_like(t) for _ in range(tp)]
            dist.all_gather(parts, t, group=tp_group)
            t = torch.cat(parts, dim=p.partition_dim)
        name = re.sub(r"decoder\.layers\.(\d+)\.", lambda m: f"decoder.layers.{int(m.group(1)) + offset}.", name)
        mine[name] = t
    keep = ps.get_data_parallel_rank(with_context_parallel=True) == 0 and ps.get_tensor_model_parallel_rank() == 0
    everything: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everything, mine if keep else {})
    merged: dict[str, torch.Tensor] = {}
    for part in everything:
        merged.update(part)
    return merged if dist.get_rank() == 0 else {}


def reference_gpt(params: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A TP=1/PP=1 GPTModel in float64 holding ``params`` (call with TP=PP=1 parallel state)."""
    model = gpt_model(transformer_config(per_token=False))
    own = dict(model.named_parameters())
    if set(own) != set(params):
        raise AssertionError(f"reference parameter names differ: {sorted(set(own) ^ set(params))[:6]}")
    with torch.no_grad():
        for name, p in own.items():
            p.copy_(params[name])
    return model.double()


def hf_causal_lm(kind: str, seed: int, value: bool = False, **shape: Any) -> torch.nn.Module:
    """A random Hugging Face ``kind`` model (``llama``: untied head; ``qwen2``: tied head, q/k/v biases; ``qwen3``:
    per-head q/k norms, head_dim 16) of ``shape`` (config fields), float32, eval mode, seeded; its norms moved off 1
    and its biases off 0, so that a mapping error shows. ``value``: the value model of that config (the critic's,
    ``<Arch>ForTokenClassification`` with one label)."""
    import transformers

    cls_cfg, cls_model = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
                          "qwen3": ("Qwen3Config", "Qwen3ForCausalLM")}[kind]
    if value:
        cls_model = cls_model.replace("CausalLM", "TokenClassification")
    extra: dict[str, Any] = {"tie_word_embeddings": kind == "qwen2"}
    if kind == "qwen3":
        extra["head_dim"] = 16
    if value:
        extra.update(num_labels=1, classifier_dropout=0.0)
    cfg = getattr(transformers, cls_cfg)(**shape, **extra)
    torch.manual_seed(seed)
    model = getattr(transformers, cls_model)(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model


def write_rows(rows: Any, out: str) -> None:
    """Rank 0 writes the worker's result rows to ``out`` as JSON; every rank waits for it."""
    import json

    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(rows, f, indent=1)
    dist.barrier()
