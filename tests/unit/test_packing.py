"""Padding-free packing: a packed micro-batch gives the same per-token losses, counts, weights and
gradient as the right-padded layout (transformers' block-diagonal mask from position_ids)."""

from __future__ import annotations

import pytest
import torch

from dsrl.config import ModelConfig
from dsrl.core.logprobs import token_logprobs
from dsrl.core.weights import GlobalCounts, local_counts, token_weights, weighted_sum
from dsrl.rl.data.batching import Sample, collate, collate_packed
from dsrl.rl.policy.model import build_model


def _samples() -> list[Sample]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i, (p, c) in enumerate([(3, 5), (6, 2), (2, 9), (4, 1)]):
        toks = torch.randint(4, 60, (p + c,), generator=g).tolist()
        out.append(Sample(tokens=toks, prompt_len=p, group=i, reward=0.0, advantage=float(i) - 1.5))
    out[3].active = False  # a fully masked sample: no token, no sequence count
    return out


def _loss(model, micro, mode, counts):
    logits = model(input_ids=micro["input_ids"], attention_mask=micro.get("attention_mask"),
                   position_ids=micro["position_ids"], use_cache=False).logits
    logp = token_logprobs(logits, micro["targets"])
    adv = micro["advantages"]
    per_token = -(adv.unsqueeze(-1) if adv.dim() == 1 else adv) * logp
    return weighted_sum(per_token, token_weights(mode, micro, counts), micro["loss_mask"]), per_token


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_packed_equals_padded(mode):
    model = build_model(ModelConfig(arch="qwen2", attn_implementation="sdpa"), vocab_size=64, pad_token_id=0,
                        bos_token_id=1, eos_token_id=2, on_gpu=False)
    samples = _samples()
    padded, packed = collate(samples, 0), collate_packed(samples, 0)
    assert packed["input_ids"].shape == (1, sum(s.length for s in samples))
    # completions 5 + 2 + 9 tokens; the masked sample counts nothing
    assert local_counts(padded) == local_counts(packed) == (16, 3)
    counts = GlobalCounts(*local_counts(padded))
    grads = []
    for micro in (padded, packed):
        model.zero_grad()
        loss, _ = _loss(model, micro, mode, counts)
        loss.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    # Without the position_ids restart (one long sequence), tokens attend across samples: different.
    broken = dict(packed, position_ids=torch.arange(packed["input_ids"].shape[1]).unsqueeze(0))
    model.zero_grad()
    _loss(model, broken, mode, counts)[0].backward()
    assert any(not torch.allclose(p.grad, g, rtol=1e-3) for p, g in zip(model.parameters(), grads[0]))
