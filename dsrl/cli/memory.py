"""``dsrl plan``'s memory per phase (:mod:`dsrl.core.memory`) from a run file, without the model's weights.

- the policy's shape comes from its ``config.json`` (``model.path``, or ``--model_config`` where that directory
  is not on the planning machine) or from the built-in tiny model's config; parameters are counted exactly on a
  model built on PyTorch's ``meta`` device (no memory, no weights), LoRA's adapters by applying them there;
- the reward model's shape from ``data.reward_model``'s ``config.json``; the critic's from the policy's config
  with a one-label token-classification head (as :func:`dsrl.rl.critic.build_value_model` builds it);
- the device's memory: ``--device_memory_gib``, else the local GPU's; on the CPU accelerator the "device" is the
  host's memory, shared by the ranks of one machine: its total divided by the ranks planned (``--world_size``).
"""

from __future__ import annotations

import json
import os
import warnings
from typing import Any

from dsrl.config import Config, ConfigError
from dsrl.core.memory import GIB, MIB, PHASES, Fit, MemorySetup, ModelShape, PhaseMemory, estimate, fit


def _meta_model(config: Any, kind: str = "causal") -> Any:
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoModelForTokenClassification

    cls = {"causal": AutoModelForCausalLM, "sequence": AutoModelForSequenceClassification,
           "token": AutoModelForTokenClassification}[kind]
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cls.from_config(config)


def shape_of(model: Any, config: Any) -> ModelShape:
    """The :class:`ModelShape` of a (meta) model and its transformers config."""
    params = {id(p): p for p in model.parameters()}
    total = sum(p.numel() for p in params.values())
    trainable = sum(p.numel() for p in params.values() if p.requires_grad)
    largest = 0
    for module in model.modules():  # the largest block ZeRO-3 gathers at once: a decoder layer, the embedding
        children = list(module.children())
        if module is model or (children and any(isinstance(c, type(module)) for c in children)):
            continue
        if type(module).__name__.endswith(("DecoderLayer", "Embedding")) or module is getattr(model, "lm_head", None):
            largest = max(largest, sum(p.numel() for p in module.parameters()))
    text = getattr(config, "text_config", None) or config
    heads = int(text.num_attention_heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
    experts = getattr(text, "num_experts_per_tok", None) or 0
    moe_width = getattr(text, "moe_intermediate_size", None)
    mlp = int(moe_width * experts) if experts and moe_width else int(text.intermediate_size)
    layers = int(text.num_hidden_layers)
    return ModelShape(params=total, trainable=trainable, largest_layer=largest or total // max(layers, 1),
                      layers=layers, hidden=int(text.hidden_size), mlp_width=mlp, heads=heads,
                      kv_heads=int(getattr(text, "num_key_value_heads", None) or heads), head_dim=head_dim,
                      vocab=int(text.vocab_size))


def policy_config(cfg: Config, model_config: str | None = None) -> Any:
    """The policy's transformers config: ``model_config`` (a config.json or its directory), ``model.path``'s, or
    the tiny model's. A ``model.path`` missing here without ``model_config`` is a ConfigError naming the flag."""
    from transformers import AutoConfig

    d = cfg.dsrl
    where = model_config or d.model.path
    if where:
        path = where if os.path.isdir(where) else os.path.dirname(where) or "."
        name = os.path.join(path, "config.json") if os.path.isdir(where) else where
        if not os.path.isfile(name):
            source = "--model_config" if model_config else "dsrl.model.path"
            raise ConfigError(f"dsrl plan: no config.json at {where!r} ({source}) to size the memory from. Fix: pass "
                              "--model_config PATH/config.json (only the config is read, never the weights).")
        with open(name, encoding="utf-8") as f:
            raw = json.load(f)
        model_type = raw.pop("model_type", None)
        if model_type is None:
            raise ConfigError(f"dsrl plan: {name} has no model_type. Fix: point --model_config at a transformers "
                              "config.json.")
        return AutoConfig.for_model(model_type, **raw)
    from dsrl.rl.policy.model import tiny_config
    from dsrl.rl.policy.tokenizer import load_tokenizer

    tok = load_tokenizer(d.model)
    return tiny_config(d.model.arch, len(tok), tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, d.model.tiny)


def policy_shape(cfg: Config, config: Any) -> ModelShape:
    model = _meta_model(config)
    if cfg.dsrl.model.lora is not None:
        from dsrl.rl.policy.lora import apply_lora

        model = apply_lora(model, cfg.dsrl.model.lora)
    return shape_of(model, config)


def _reward_shape(cfg: Config) -> ModelShape | None:
    path = cfg.dsrl.data.reward_model
    if not path or not os.path.isfile(os.path.join(path, "config.json")):
        return None
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path, local_files_only=True)
    return shape_of(_meta_model(config, "sequence"), config)


def _critic_shape(cfg: Config, policy: Any) -> ModelShape | None:
    if not cfg.dsrl.has_critic:
        return None
    import copy

    config = copy.deepcopy(policy)
    config.num_labels = 1
    return shape_of(_meta_model(config, "token"), config)


def default_device_bytes(on_gpu: bool, world_size: int) -> tuple[int, str]:
    """(bytes, where they come from): the local GPU's memory, or the host's total shared by ``world_size`` ranks."""
    if on_gpu:
        import torch

        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            return int(props.total_memory), f"the local GPU ({props.name})"
    import psutil

    total = psutil.virtual_memory().total
    return total // max(world_size, 1), (f"the CPU accelerator: this host's {total / GIB:.1f} GiB shared by "
                                          f"{world_size} rank(s)")


def memory_report(cfg: Config, plan: Any, *, on_gpu: bool, world_size: int, device_memory_gib: float | None = None,
                  model_config: str | None = None, config: Any = None) -> tuple[dict[str, PhaseMemory], Fit, dict]:
    """The phases, their fit against the device, and what the JSON reports beside the phases (the device's memory
    and where it comes from). ``config``: the policy's transformers config when the caller has it."""
    config = config if config is not None else policy_config(cfg, model_config)
    shape = policy_shape(cfg, config)
    setup = MemorySetup.of(cfg, plan, shape, on_gpu=on_gpu, reward_model=_reward_shape(cfg),
                           critic=_critic_shape(cfg, config))
    if device_memory_gib is not None:
        device, source = int(device_memory_gib * GIB), "--device_memory_gib"
    else:
        device, source = default_device_bytes(on_gpu, world_size)
    phases = estimate(setup, device)
    verdict = fit(phases, device, setup)
    extra = {"memory_device_mib": round(device / MIB, 1), "memory_device_source": source,
             "memory_params": shape.params, "memory_trainable_params": shape.trainable,
             "memory_warnings": verdict.warnings, "memory_refusals": verdict.refusals}
    return phases, verdict, extra


def memory_rows(phases: dict[str, PhaseMemory], extra: dict[str, Any]) -> list[tuple[str, str]]:
    """The human-readable rows of ``dsrl plan``."""
    rows = [("device memory per rank", f"{extra['memory_device_mib']:,.0f} MiB ({extra['memory_device_source']})"),
            ("model parameters", f"{extra['memory_params']:,} ({extra['memory_trainable_params']:,} trained)")]
    for name in PHASES:
        phase = phases[name]
        parts = ", ".join(f"{k} {v / MIB:,.1f}" for k, v in sorted(phase.parts.items(), key=lambda kv: -kv[1]) if v)
        where = "" if phase.where == "every rank" else f" on {phase.where}"
        rows.append((f"memory: {name}{where}", f"{phase.total / MIB:,.1f} MiB ({parts})"))
    return rows
