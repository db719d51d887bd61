"""The per-token losses ``dsrl.check --objective`` checks, each with its float64 reference from the definition.

- ``policy``: ``-A_seq * log pi(next token)`` (a policy-gradient-shaped loss on a tiny causal model);
- ``gspo``: the sequence-level clipped ratio, :func:`dsrl.algos.losses.sequence_clipped_policy_loss` (clip
  ``RATIO_CLIP`` both ways; the check's old log-probs put sequence ratios on both sides of it);
- ``value``: the critic's clipped value loss, :func:`dsrl.algos.losses.clipped_value_loss` (``VALUE_CLIP``), on
  the critic's architecture, a tiny ``AutoModelForTokenClassification`` with one label;
- ``tis_token``, ``tis_sequence``, ``mis_token``, ``mis_sequence``: the ``policy`` loss under the off-policy
  correction (:mod:`dsrl.algos.correction`, cap ``CORRECTION_CAP``), from behavior log-probs on both sides of
  the cap: dsrl's correction runs on each sequence before the step (as the experience maker runs it), the
  reference applies the definition in float64 (weights w~ = min(w, C), or masks [1/C, C], per token or per
  sequence).

The dsrl side computes log-probs as the trainer does (the output head fused into a tiled log-softmax,
:mod:`dsrl.rl.policy.logprobs`) and calls dsrl.algos.losses; the reference side (:func:`reference_per_token_loss`)
is written independently, in float64, from the model's full logits and a plain log-softmax.
"""

from __future__ import annotations

from typing import Any

import torch

VOCAB, HIDDEN, MAX_LEN = 32, 16, 12  # the check's tiny models (dsrl.check)
CORRECTIONS = {"tis_token": ("tis", "token"), "tis_sequence": ("tis", "sequence"), "mis_token": ("mis", "token"),
               "mis_sequence": ("mis", "sequence")}  # objective -> (rollout_correction.mode, level)
OBJECTIVES = ("policy", "gspo", "value", *CORRECTIONS)
CORRECTION_CAP = 2.0
RATIO_CLIP = 0.1  # gspo objective: clip_low = clip_high (the data's ratios fall on both sides of it)
VALUE_CLIP = 0.2  # value objective: |V - V_old| <= VALUE_CLIP


#: the tiny dense Hugging Face architectures of dsrl.check (``--model``) -> their transformers config class
DENSE_CONFIGS = {"llama": "LlamaConfig", "llama_untied": "LlamaConfig", "qwen2": "Qwen2Config",
                 "qwen3": "Qwen3Config"}


def dense_config(arch: str, layers: int = 1, **extra: Any) -> Any:
    """The tiny config of a dense architecture of :data:`DENSE_CONFIGS`: 4 query heads of 4 dimensions over 2 KV
    heads, ``layers`` decoder layers, pad id 0, ``extra`` added."""
    import transformers

    cls = getattr(transformers, DENSE_CONFIGS[arch])
    return cls(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=layers, num_attention_heads=4,
               num_key_value_heads=2, head_dim=HIDDEN // 4, max_position_embeddings=4 * MAX_LEN, pad_token_id=0,
               intermediate_size=2 * HIDDEN, **extra)


def value_model(arch: str, layers: int = 1) -> torch.nn.Module:
    """The critic's architecture (dsrl.critic): a tiny ``AutoModelForTokenClassification`` with one label and no
    head dropout, of ``arch`` (:data:`DENSE_CONFIGS`; Qwen2 for ``tiny``/``auto``), of ``layers`` decoder layers."""
    from transformers import AutoModelForTokenClassification

    config = dense_config(arch if arch in DENSE_CONFIGS else "qwen2", layers, num_labels=1, classifier_dropout=0.0)
    return AutoModelForTokenClassification.from_config(config, dtype=torch.float32)


def _run(model: Any, micro: dict[str, torch.Tensor]) -> Any:
    if "attention_mask" in micro:  # the Megatron engine's model takes its rows' mask and positions
        return model(input_ids=micro["input_ids"], attention_mask=micro["attention_mask"],
                     position_ids=micro["position_ids"])
    return model(micro["input_ids"])


def _logprobs(model: Any, micro: dict[str, torch.Tensor]) -> torch.Tensor:
    """log pi(target) ``[b, t]`` as the trainer computes it: the model's output head fused into a tiled
    log-softmax at the micro-batch's selected positions (:func:`dsrl.rl.policy.logprobs.forward_logprobs`)."""
    from dsrl.rl.policy.logprobs import forward_logprobs

    return forward_logprobs(model, micro, run=_run).logprobs


def per_token_loss(model: Any, micro: dict[str, torch.Tensor]) -> torch.Tensor:
    """A policy-gradient-shaped loss: -A_seq * log pi(next token), ``[b, t]``."""
    logp = _logprobs(model, micro)
    return -micro["advantages"].unsqueeze(-1).to(logp.dtype) * logp


def gspo_loss(model: Any, micro: dict[str, torch.Tensor]) -> torch.Tensor:
    """dsrl's GSPO per-token loss (:func:`dsrl.algos.losses.sequence_clipped_policy_loss`), ``[b, t]``."""
    from dsrl.algos.losses import sequence_clipped_policy_loss

    logp = _logprobs(model, micro)
    return sequence_clipped_policy_loss(logp, micro["old_logprobs"].to(logp.dtype), micro["advantages"].to(logp.dtype),
                                        micro["loss_mask"], RATIO_CLIP, RATIO_CLIP)[0]


def value_loss(model: Any, micro: dict[str, torch.Tensor]) -> torch.Tensor:
    """dsrl's critic loss (:func:`dsrl.algos.losses.clipped_value_loss`) on the value model's output, ``[b, t]``."""
    from dsrl.algos.losses import clipped_value_loss
    from dsrl.rl.critic import forward_values

    rows = {k: micro[k] for k in ("attention_mask",) if k in micro}  # the Megatron engine's model takes its mask
    values = forward_values(model, {"input_ids": micro["input_ids"], "position_ids": micro.get("position_ids"), **rows})
    return clipped_value_loss(values, micro["old_values"].to(values.dtype), micro["returns"].to(values.dtype),
                              VALUE_CLIP)[0]


def corrected_loss(model: Any, micro: dict[str, torch.Tensor]) -> torch.Tensor:
    """The policy loss times the correction's weights (``is_weights``; mis changed only ``loss_mask``)."""
    loss = per_token_loss(model, micro)
    return loss * micro["is_weights"].to(loss.dtype) if "is_weights" in micro else loss


def apply_correction(seqs: list[dict[str, torch.Tensor]], objective: str) -> list[dict[str, torch.Tensor]]:
    """dsrl's side of a correction objective: :func:`dsrl.algos.correction.correct` on every sequence's counted
    tokens, giving ``is_weights`` (tis, float32 as the trainer collates them) or a narrower ``loss_mask`` (mis)."""
    from dsrl.algos.correction import correct

    if objective not in CORRECTIONS:
        return seqs
    mode, level = CORRECTIONS[objective]
    out = []
    for s in seqs:
        counted = (s["loss_mask"] > 0).tolist()
        fix = correct(s["old_logprobs"].tolist(), s["behavior_logprobs"].tolist(), counted, mode, level,
                      CORRECTION_CAP)
        s = dict(s)
        if mode == "tis":  # as the trainer collates them: 1 where a sample (or token) carries no weight
            s["is_weights"] = torch.tensor(fix.weights or [1.0] * len(counted), dtype=torch.float32)
        if fix.keep is not None:
            s["loss_mask"] = s["loss_mask"] * torch.tensor(fix.keep, dtype=torch.long)
        out.append(s)
    return out


def reference_correction(batch: dict[str, torch.Tensor], objective: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, loss mask) of a correction objective in float64, from the definition (ARCHITECTURE §8): log w =
    log pi_old - log mu on the counted tokens; tis: min(w, C) per token or min(exp(sum log w), C) per sequence;
    mis: tokens (or whole sequences) with w outside [1/C, C] leave the mask. Other objectives: (1, the mask)."""
    mask = batch["loss_mask"].double()
    if objective not in CORRECTIONS:
        return torch.ones_like(mask), mask
    mode, level = CORRECTIONS[objective]
    log_w = (batch["old_logprobs"].double() - batch["behavior_logprobs"].double()) * mask
    if level == "sequence":
        log_w = log_w.sum(-1, keepdim=True).expand_as(mask)
    cap = torch.tensor(CORRECTION_CAP, dtype=torch.float64)
    if mode == "tis":
        return torch.minimum(torch.exp(log_w), cap), mask
    inside = (log_w >= -torch.log(cap)) & (log_w <= torch.log(cap))
    return torch.ones_like(mask), mask * inside.double()


LOSSES = {"policy": per_token_loss, "gspo": gspo_loss, "value": value_loss,
          **dict.fromkeys(CORRECTIONS, corrected_loss)}


def reference_per_token_loss(model: Any, batch: dict[str, torch.Tensor], objective: str) -> torch.Tensor:
    """The objective's per-token loss in float64, written from its definition (masked positions arbitrary)."""
    mask = batch["loss_mask"].double()
    if objective == "value":
        out = model(batch["input_ids"])
        v = out.logits[..., 0]
        r, v_old = batch["returns"].double(), batch["old_values"].double()
        v_clipped = torch.minimum(torch.maximum(v, v_old - VALUE_CLIP), v_old + VALUE_CLIP)
        return 0.5 * torch.maximum((v - r) ** 2, (v_clipped - r) ** 2)
    logits = model(batch["input_ids"])
    logits = getattr(logits, "logits", logits)
    logp = torch.log_softmax(logits, dim=-1).gather(-1, batch["targets"].unsqueeze(-1)).squeeze(-1)
    adv = batch["advantages"].double()
    if objective == "policy":
        return -adv.unsqueeze(-1) * logp
    if objective in CORRECTIONS:
        weights, _ = reference_correction(batch, objective)
        return weights * (-adv.unsqueeze(-1) * logp)
    # gspo: one ratio per sequence, s_i = exp(mean over its valid tokens of log pi - log pi_old)
    diff = torch.where(mask > 0, logp - batch["old_logprobs"].double(), torch.zeros_like(logp))
    s = torch.exp(diff.sum(-1) / mask.sum(-1).clamp(min=1))
    per_seq = -torch.minimum(s * adv, s.clamp(1 - RATIO_CLIP, 1 + RATIO_CLIP) * adv)
    return per_seq.unsqueeze(-1).expand_as(logp)
