"""dsrl.rl.policy.logprobs.forward_logprobs in one process: the output head fused into the forward.

- on tiny Hugging Face models (tied Qwen2, untied Llama, padded and packed rows, a temperature) the log-probs
  and entropy at the completion positions and the gradient of every parameter equal float64 autograd through
  the model's own full logits; positions outside the selection hold zeros; the compact order is the samples'
  completion order (what the old/ref passes cut per sample);
- LoRA: a ``modules_to_save`` head (adapters on and off) is fused; adapters on ``lm_head`` take the logits path
  (with a warning), exactly;
- a model that post-processes logits: with its config field (Gemma2 soft-capping) it takes the logits path and
  is exact; without one it is refused, as is a head called twice.
"""

from __future__ import annotations

import logging

import pytest
import torch

from dsrl.config import ModelConfig
from dsrl.core.logprobs import LOGPROB_MASK
from dsrl.rl.data.batching import Sample, collate, collate_packed, completion_positions
from dsrl.rl.policy import logprobs as P
from dsrl.rl.policy.model import build_model

PAD, BOS, EOS, VOCAB = 0, 1, 2, 64
TOL = 1e-6


def _samples() -> list[Sample]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i, (p, c) in enumerate([(3, 5), (6, 2), (2, 9), (4, 1)]):
        toks = torch.randint(4, VOCAB, (p + c,), generator=g).tolist()
        out.append(Sample(tokens=toks, prompt_len=p, group=i, reward=0.0))
    out[3].active = False  # masked samples still get their log-probs (one per completion token)
    return out


def _model(arch: str = "qwen2", tied: bool = True, **extra) -> torch.nn.Module:
    return build_model(ModelConfig(arch=arch, tiny={"tie_word_embeddings": tied}, **extra), VOCAB, PAD, BOS, EOS,
                       on_gpu=False)


def _reference(model, micro, temperature):
    """float64 (log-prob, entropy) [b, t] from the model's own logits."""
    ref = P.run_causal_lm(model, micro).logits.double() / temperature
    logp = torch.log_softmax(ref, -1)
    return logp.gather(-1, micro["targets"].unsqueeze(-1)).squeeze(-1), -(logp.exp() * logp).sum(-1)


def _weights(shape):
    g = torch.Generator().manual_seed(5)
    return torch.randn(shape, generator=g, dtype=torch.float64), torch.randn(shape, generator=g, dtype=torch.float64)


def _compare(model, micro, temperature=0.7):
    """max relative error of values and of every parameter's gradient, fused (float32) vs float64."""
    mask = micro[LOGPROB_MASK].to(torch.float64)
    w_lp, w_ent = _weights(mask.shape)
    model.zero_grad()
    tok = P.forward_logprobs(model, micro, temperature=temperature, entropy_grad=True)
    ((tok.logprobs * w_lp.float()).sum() + (tok.entropy * w_ent.float()).sum()).backward()
    got = {n: p.grad.double().clone() for n, p in model.named_parameters() if p.grad is not None}
    ref_model = _float64(model)
    ref_lp, ref_ent = _reference(ref_model, micro, temperature)
    (((ref_lp * w_lp) * mask).sum() + ((ref_ent * w_ent) * mask).sum()).backward()
    want = {n: p.grad for n, p in ref_model.named_parameters() if p.grad is not None}
    assert got.keys() == want.keys() and got
    errors = {n: float((got[n] - want[n]).norm() / want[n].norm().clamp(min=1e-30)) for n in want}
    errors["logprobs"] = float(((tok.logprobs.detach().double() - ref_lp.detach()) * mask).abs().max())
    errors["entropy"] = float(((tok.entropy.detach().double() - ref_ent.detach()) * mask).abs().max())
    assert not tok.logprobs[mask == 0].any() and not tok.entropy[mask == 0].any()  # zeros outside the selection
    return errors, tok


def _float64(model):
    import copy

    return copy.deepcopy(model).double()


@pytest.mark.parametrize("arch,tied", [("qwen2", True), ("llama", False)])
@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_fused_equals_float64_values_and_gradients(arch, tied, layout):
    torch.manual_seed(0)
    model = _model(arch, tied)
    assert isinstance(P.fused_head(model), tuple)  # the fused path, not the logits path
    samples = _samples()
    micro = collate(samples, PAD) if layout == "padded" else collate_packed(samples, PAD)
    assert micro[LOGPROB_MASK].device.type == "cpu" and int(micro[LOGPROB_MASK].sum()) == 5 + 2 + 9 + 1
    errors, tok = _compare(model, micro)
    assert max(errors.values()) <= TOL, errors
    # the compact values are the samples' completion tokens in order (the old/ref passes cut them per sample)
    if layout == "padded":
        want = torch.cat([row[sl] for row, sl in zip(tok.logprobs.detach(), completion_positions(samples))])
        assert torch.equal(tok.selected_logprobs.detach(), want)


def test_no_grad_equals_grad_bitwise_and_without_a_mask_every_position():
    model = _model()
    micro = collate(_samples(), PAD)
    with_grad = P.forward_logprobs(model, micro, entropy=True).stats
    with torch.no_grad():
        plain = P.forward_logprobs(model, micro, entropy=True).stats
    assert with_grad.requires_grad and torch.equal(plain, with_grad.detach())
    everything = {k: v for k, v in micro.items() if k != LOGPROB_MASK}
    with torch.no_grad():
        full = P.forward_logprobs(model, everything)
        lp, _ = _reference(model, everything, 1.0)
    assert full.index is None and full.stats.shape[0] == micro["targets"].numel()
    assert float((full.logprobs.double() - lp).abs().max()) <= TOL


def test_target_is_top_is_the_argmax():
    model = _model()
    micro = collate(_samples(), PAD)
    with torch.no_grad():
        tok = P.forward_logprobs(model, micro)
        logits = P.run_causal_lm(model, micro).logits
        micro = dict(micro, targets=logits.argmax(-1))  # every target is the greedy token
        top = P.forward_logprobs(model, micro).target_is_top
    mask = micro[LOGPROB_MASK]
    assert top[mask].all() and not top[~mask].any()
    assert tok.target_is_top[mask].float().mean() < 1.0


def _lora(lora: dict, tied: bool = False) -> torch.nn.Module:
    pytest.importorskip("peft")
    from dsrl.config import LoraConfig

    model = _model("qwen2", tied, lora=LoraConfig(**lora))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name or ".modules_to_save." in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.03)
    return model


def test_lora_modules_to_save_head_is_fused_with_adapters_on_and_off():
    model = _lora({"r": 4, "modules_to_save": ["lm_head"]})
    linears, shard = P.fused_head(model)
    assert len(linears) == 2 and shard is None  # the original head and the adapter's trained copy
    micro = collate(_samples(), PAD)
    errors, _ = _compare(model, micro)
    assert max(errors.values()) <= TOL, errors
    with torch.no_grad():
        on = P.forward_logprobs(model, micro).logprobs
        with model.disable_adapter():
            off = P.forward_logprobs(model, micro).logprobs
            ref, _ = _reference(model, micro, 1.0)
    assert float(((off.double() - ref) * micro[LOGPROB_MASK]).abs().max()) <= TOL and not torch.equal(on, off)


def test_lora_adapters_on_the_head_take_the_logits_path(caplog):
    model = _lora({"r": 4, "target_modules": ["q_proj", "lm_head"]})
    reason = P.fused_head(model)
    assert isinstance(reason, str) and "not a plain linear layer" in reason
    with caplog.at_level(logging.WARNING, logger="dsrl.rl.policy.logprobs"):
        errors, _ = _compare(model, collate(_samples(), PAD))
    assert max(errors.values()) <= TOL, errors
    assert "logits path" in caplog.text


def test_soft_capping_model_takes_the_logits_path_exactly():
    from transformers import AutoModelForCausalLM, Gemma2Config

    torch.manual_seed(0)
    config = Gemma2Config(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=8, pad_token_id=PAD,
                          final_logit_softcapping=3.0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    assert "final_logit_softcapping" in P.fused_head(model)
    errors, _ = _compare(model, collate(_samples(), PAD))
    assert max(errors.values()) <= TOL, errors


class _Scaled(torch.nn.Module):
    """A model that scales its head's output without saying so in a config."""

    def __init__(self, calls: int = 1):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 8)
        self.head = torch.nn.Linear(8, VOCAB)
        self.calls = calls

    def get_output_embeddings(self):
        return self.head

    def forward(self, input_ids):
        h = self.embed(input_ids)
        out = self.head(h)
        for _ in range(self.calls - 1):
            out = self.head(h)
        return out * 2 if self.calls == 1 else out


def test_unannounced_post_processing_and_a_second_head_call_are_refused():
    micro = collate(_samples(), PAD)
    run = lambda m, mb: m(mb["input_ids"])  # noqa: E731
    with pytest.raises(RuntimeError, match="changes its output head's result"):
        P.forward_logprobs(_Scaled(), micro, run=run)
    with pytest.raises(RuntimeError, match="ran 2 times"):
        P.forward_logprobs(_Scaled(calls=2), micro, run=run)
    head = _Scaled().head
    assert "forward" not in head.__dict__  # the head's own forward is back after a call, even a failed one
