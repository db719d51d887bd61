"""Prompt-shared micro-batches (dsrl.model.share_prompts; dsrl.rl.data.prefix, dsrl.core.prompt_partition):

- the shared rows give every selected position the log-prob, entropy and gradient its padded row gives (float32
  rounding), for Llama- and Qwen2-shaped models, prompts of several lengths, empty completions and samples in any
  order; a layout that shifts one completion's positions is caught;
- the partition keeps every invariant of dsrl.core.partition (each sample once, equal micro-batch counts, every
  rank holding a sample, the budget) with whole prompts; the grouped mini-batches hold whole prompts;
- the combinations it cannot serve are refused with the field and the fix.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from dsrl.config import ConfigError, ModelConfig
from dsrl.core.prompt_partition import grouped_mini_batches, prompt_micro_batches
from dsrl.rl.data import prefix
from dsrl.rl.data.batching import Sample, collate
from dsrl.rl.data.prefix import PREFIX_INPUT_IDS, prefix_inputs, row_length
from dsrl.rl.policy.logprobs import forward_logprobs

VOCAB = 61


def _model(arch: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    cls = LlamaConfig if arch == "llama" else Qwen2Config
    config = cls(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=arch == "llama")
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")


def _samples(seed: int) -> list[Sample]:
    rng = random.Random(seed)
    out = []
    for g in range(4):
        prompt = [rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 9))]
        for _ in range(rng.randint(1, 4)):
            completion = [rng.randrange(1, VOCAB) for _ in range(rng.randint(0, 6))]
            out.append(Sample(tokens=prompt + completion, prompt_len=len(prompt), group=g, reward=0.0,
                              advantage=rng.uniform(-1, 1)))
    rng.shuffle(out)
    return out


def _pass(model: torch.nn.Module, micro: dict) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    tok = forward_logprobs(model, micro, entropy=True)
    (tok.logprobs * micro["loss_mask"] * micro["advantages"][:, None]).sum().backward()
    return tok.logprobs.detach(), tok.entropy.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("seed", [0, 1])
def test_shared_rows_give_the_padded_rows_values_and_gradients(arch, seed):
    model, samples = _model(arch), _samples(seed)
    padded, shared = collate(samples, 0), collate(samples, 0, shared=True)
    assert shared[PREFIX_INPUT_IDS].numel() < padded["input_ids"].numel()  # fewer positions run
    lp, ent, grad = _pass(model, padded)
    lp2, ent2, grad2 = _pass(model, shared)
    assert torch.allclose(lp, lp2, atol=2e-6, rtol=0) and torch.allclose(ent, ent2, atol=2e-6, rtol=0)
    for name, g in grad.items():
        scale = float(g.abs().max()) or 1.0
        assert float((g - grad2[name]).abs().max()) / scale < 1e-5, name


def test_a_layout_whose_completions_see_each_other_is_caught(monkeypatch):
    model, samples = _model("llama"), _samples(2)
    lp, _, _ = _pass(model, collate(samples, 0))

    def causal(tokens, prompt_lens, pad_id):  # planted bug: a plain causal mask, completions see each other
        out = prefix_inputs(tokens, prompt_lens, pad_id)
        mask = out[prefix.PREFIX_ATTENTION_MASK]
        out[prefix.PREFIX_ATTENTION_MASK] = torch.ones_like(mask).tril_()
        return out

    monkeypatch.setattr("dsrl.rl.data.batching.prefix_inputs", causal)
    lp2, _, _ = _pass(model, collate(samples, 0, shared=True))
    assert float((lp - lp2).abs().max()) > 1e-3


def test_each_prompt_is_one_row_and_padding_attends_to_itself():
    tokens = [[5, 6, 7, 1, 2], [5, 6, 7, 3], [9, 4]]
    out = prefix_inputs(tokens, [3, 3, 1], pad_id=0)
    ids, pos, mask = out[PREFIX_INPUT_IDS], out[prefix.PREFIX_POSITION_IDS], out[prefix.PREFIX_ATTENTION_MASK]
    assert ids.tolist() == [[5, 6, 7, 1], [9, 0, 0, 0]]  # [prompt | 1] (2 and 3 are targets only); [prompt]
    assert pos[0].tolist() == [0, 1, 2, 3]
    assert mask[1, 0].diagonal().all()  # no row without a key (NaN under sdpa)
    assert out[prefix.PREFIX_INDEX].tolist() == [2, 3, 2, 4]  # sample 0: p-1, its token; 1: p-1; 2: p-1 of row 1
    assert row_length(3, [4, 3]) == 4


def test_partition_keeps_prompts_together_within_the_budget():
    rng = random.Random(0)
    for trial in range(200):
        prompts, per = rng.randint(1, 6), rng.randint(1, 8)
        groups = [i // per for i in range(prompts * per)]
        plen = {g: rng.randint(2, 40) for g in range(prompts)}
        prompt_lens = [plen[g] for g in groups]
        lengths = [p + rng.randint(0, 30) for p in prompt_lens]
        size = len(groups)
        batch = rng.choice([b for b in range(1, size + 1) if size % b == 0])
        dp, budget = rng.randint(1, 4), rng.randint(max(lengths), 300)
        for mb in grouped_mini_batches(groups, batch, 2, seed=trial):
            part = prompt_micro_batches(mb, lengths, groups, prompt_lens, dp, budget)
            assert sorted(i for r in part for m in r for i in m) == sorted(mb)
            assert len({len(r) for r in part}) == 1
            if len(mb) >= dp:
                assert all(any(r) for r in part)
            for m in (m for r in part for m in r if m):
                rows: dict[int, list[int]] = {}
                for i in m:
                    rows.setdefault(groups[i], []).append(i)
                longest = max(row_length(prompt_lens[v[0]], [lengths[i] for i in v]) for v in rows.values())
                assert len(rows) * longest <= budget


def test_grouped_mini_batches_hold_whole_prompts():
    groups = np.repeat(np.arange(6), 4).tolist()
    for mb in grouped_mini_batches(groups, 8, 3, seed=7):
        assert len({groups[i] for i in mb}) == 2
    assert grouped_mini_batches(groups, 8, 1, seed=7) == grouped_mini_batches(groups, 8, 1, seed=7)
    assert sorted(sum(grouped_mini_batches(groups, 8, 1, seed=3), [])) == list(range(24))


@pytest.mark.parametrize("fields, words", [
    ({"packing": True}, ["share_prompts", "packing", "Fix"]),
    ({"attn_implementation": "flash_attention_2"}, ["share_prompts", "attn_implementation", "sdpa"]),
    ({"routing_replay": "rollout"}, ["share_prompts", "routing_replay", "Fix"]),
])
def test_combinations_it_cannot_serve_are_refused(fields, words):
    with pytest.raises(ConfigError) as e:
        ModelConfig(share_prompts=True, **fields)
    assert all(w in str(e.value) for w in words)
