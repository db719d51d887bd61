"""The models of ``dsrl.check`` (:mod:`dsrl.cli.check`): built from a config and the current torch seed, never
downloaded. A tiny custom causal model whose right padding never changes earlier positions, tiny Hugging Face
Llama / Qwen2 / Qwen3 models (tied heads, GQA; ``llama_untied``: its own output head, vocabulary-parallel under
AutoTP; Qwen3's per-head q/k norms), and the MoE models of :mod:`dsrl.cli.check_moe`."""

from __future__ import annotations

import torch

from dsrl.cli.check_moe import MoESettings, moe_model
from dsrl.cli.check_objectives import DENSE_CONFIGS, HIDDEN, VOCAB, dense_config, value_model


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


def hf_model(arch: str, layers: int = 1) -> torch.nn.Module:
    """A tiny Hugging Face causal LM from a config (no download): Llama, Qwen2 or Qwen3 (tied embeddings, GQA), a Llama
    with its own output head (``llama_untied``: under AutoTP a vocabulary-parallel head), or a Mixtral /
    Qwen3-MoE (:func:`dsrl.cli.check_moe.moe_model`: 4 experts, top-2, eager expert loop). ``layers``: the dense
    models' depth (the Megatron engine's check splits two over its pipeline stages)."""
    from transformers import AutoModelForCausalLM

    if arch in DENSE_CONFIGS:
        config = dense_config(arch, layers, tie_word_embeddings=arch != "llama_untied")
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


class _Identity(torch.autograd.Function):
    """An autograd node that passes values and gradients through unchanged (as ZeRO-3's hook functions do)."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        return grad


def _through(value: object) -> object:
    if isinstance(value, torch.Tensor) and value.requires_grad:
        return _Identity.apply(value)
    if isinstance(value, tuple):
        return tuple(_through(v) for v in value)
    return value


def with_zero3_autograd_nodes(module: torch.nn.Module) -> torch.nn.Module:
    """``module`` with an identity autograd node on every submodule's positional tensor inputs and tensor outputs
    that require grad, where DeepSpeed ZeRO-3 inserts its backward-hook functions (``PostBackwardFunctionModule``,
    ``PreBackwardFunctionForModule``). Values and gradients are unchanged; what changes is the order in which autograd
    sums in float32 the gradients of a tensor read several times (e.g. the normed hidden states that the q, k and v
    projections read). On SmolLM2-135M that order alone moves the gradient by 1.0e-6 (relative, as one vector) on one
    micro-batch, bit for bit what a ZeRO-3 engine on one rank gives against the plain module, so a ZeRO-3 check's
    float32 reference is computed through the same nodes."""
    for sub in module.modules():
        sub.register_forward_pre_hook(lambda mod, args: tuple(_through(a) for a in args))
        sub.register_forward_hook(lambda mod, args, out: _through(out))
    return module
