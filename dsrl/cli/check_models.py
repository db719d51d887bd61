"""The models of ``dsrl.check`` (:mod:`dsrl.cli.check`): built from a config and the current torch seed, never
downloaded. A tiny custom causal model whose right padding never changes earlier positions, tiny Hugging Face
Llama / Qwen2 models (tied heads, GQA; ``llama_untied``: its own output head, vocabulary-parallel under AutoTP),
and the MoE models of :mod:`dsrl.cli.check_moe`."""

from __future__ import annotations

import torch

from dsrl.cli.check_moe import MoESettings, moe_model
from dsrl.cli.check_objectives import HIDDEN, MAX_LEN, VOCAB, value_model


class TinyCausalModel(torch.nn.Module):
    """Embedding -> causal prefix-mean mixing -> tanh MLP -> logits. Right padding never changes
    the outputs at earlier positions, so any split into padded micro-batches is exact."""

    def __init__(self, vocab: int = VOCAB, hidden: int = HIDDEN):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.mix = torch.nn.Linear(hidden, hidden)
        self.out = torch.nn.Linear(hidden, vocab)

    def get_output_embeddings(self) -> torch.nn.Linear:
        """The output head (transformers' name): dsrl's log-probs fuse it into a tiled log-softmax."""
        return self.out

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        steps = torch.arange(1, h.shape[1] + 1, device=h.device, dtype=h.dtype).view(1, -1, 1)
        prefix_mean = h.cumsum(1) / steps
        return self.out(torch.tanh(self.mix(h + prefix_mean)))


def hf_model(arch: str) -> torch.nn.Module:
    """A tiny Hugging Face causal LM from a config (no download): Llama or Qwen2 (tied embeddings, GQA), a Llama
    with its own output head (``llama_untied``: under AutoTP a vocabulary-parallel head), or a Mixtral /
    Qwen3-MoE (:func:`dsrl.cli.check_moe.moe_model`: 4 experts, top-2, eager expert loop)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=4 * MAX_LEN, pad_token_id=0)
    if arch in ("qwen2", "llama", "llama_untied"):
        cls = Qwen2Config if arch == "qwen2" else LlamaConfig
        config = cls(intermediate_size=2 * HIDDEN, tie_word_embeddings=arch != "llama_untied", **common)
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return moe_model(arch)


def is_model_dir(arch: str) -> bool:
    """Whether ``--model`` names a Hugging Face model directory (a real pretrained model) rather than a built-in."""
    import os

    return os.path.isfile(os.path.join(arch, "config.json"))


def build_model(arch: str, objective: str = "policy", moe: MoESettings | None = None) -> torch.nn.Module:
    """The check's model, initialised from the current torch seed (an MoE case: Mixtral with 2 layers), or a real
    pretrained causal LM loaded in float32 from the directory ``arch`` (its weights, not the seed's)."""
    if is_model_dir(arch):
        from transformers import AutoModelForCausalLM

        if objective == "value":
            raise ValueError("dsrl.check --objective value checks a tiny value model; --model DIR is a causal LM. "
                             "Fix: check the value objective without --model DIR.")
        return AutoModelForCausalLM.from_pretrained(arch, dtype=torch.float32)
    if objective == "value":
        return value_model(arch)
    if moe is not None and arch == "mixtral":
        return moe_model(arch, layers=2)
    return TinyCausalModel() if arch == "tiny" else hf_model(arch)


def model_for(ds_config: dict, requested: str, moe: MoESettings | None = None) -> str:
    """``--model auto``: the tiny custom model, unless the ds_config shards the model by name (AutoTP ->
    llama, AutoEP -> mixtral) or routes are replayed / balanced (``moe`` active: mixtral)."""
    from dsrl.backends.deepspeed.autoep import expert_parallel_enabled
    from dsrl.backends.deepspeed.autotp import tensor_parallel_size

    if requested != "auto":
        return requested  # a built-in's name, or a model directory
    if (moe is not None and moe.active) or expert_parallel_enabled(ds_config):
        return "mixtral"
    return "llama" if tensor_parallel_size(ds_config) > 1 else "tiny"


def logprob_head(module: torch.nn.Module) -> str:
    """How the check's log-probs were computed: ``fused`` (the output head fused into the tiled log-softmax),
    ``fused vocab-parallel`` (a vocabulary-parallel head, e.g. an untied head under AutoTP) or ``logits: <why>``."""
    from dsrl.rl.policy.logprobs import fused_head

    how = fused_head(module)
    if isinstance(how, str):
        return f"logits: {how}"
    return "fused" if how[1] is None else "fused vocab-parallel"
