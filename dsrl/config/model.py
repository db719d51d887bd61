"""``dsrl.model``: the policy (and reference) model."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import field_validator, model_validator

from dsrl.config.errors import ConfigError
from dsrl.config.names import RoutingReplay, TinyArch
from dsrl.config.section import Section, setting


class LoraConfig(Section):
    """LoRA adapters (Hugging Face PEFT, `pip install -e '.[lora]'`): the adapters (and `modules_to_save`) are
    the only trainable parameters; the KL reference is the same model with its adapters disabled (docs/lora.md)."""

    PATH: ClassVar[str] = "dsrl.model.lora"

    r: int = setting(8, "rank of each adapter (A: r x in, B: out x r)", gt=0)
    alpha: float = setting(16.0, "scaling numerator: the adapted weight is W + (alpha / r) B A", gt=0)
    dropout: float = setting(0.0, "dropout on the adapter's input while training (log-prob forwards run in eval "
                                  "mode, without it)", ge=0, lt=1)
    target_modules: list[str] | Literal["all-linear"] = setting(
        "all-linear", "the modules that get adapters: PEFT's module names or name suffixes (e.g. [\"q_proj\", "
                      "\"v_proj\"]), or all-linear (every linear layer except the output head)")
    modules_to_save: list[str] | None = setting(
        None, "modules trained in full beside the adapters (PEFT's modules_to_save, e.g. [\"score\"]); not the "
              "embedding or output head of a model with tied word embeddings")

    @field_validator("target_modules", "modules_to_save")
    @classmethod
    def _names_given(cls, value: Any, info: Any) -> Any:
        """`target_modules` (a list) and `modules_to_save` name at least one module, each a non-empty string."""
        if isinstance(value, list) and (not value or not all(isinstance(v, str) and v.strip() for v in value)):
            raise ConfigError(f"dsrl.model.lora.{info.field_name} = {value!r} must name at least one module, each a "
                              "non-empty string. Fix: list module names such as [\"q_proj\", \"v_proj\"]"
                              + (", or use \"all-linear\"." if info.field_name == "target_modules" else
                                 ", or remove the key."))
        return value


class ModelConfig(Section):
    """The policy (and reference) model."""

    PATH: ClassVar[str] = "dsrl.model"

    path: str | None = setting(None, "local directory of a HF causal LM; unset = the built-in tiny model")
    tokenizer: str | None = setting(None, "tokenizer directory; unset = model.path, or the shipped tiny tokenizer")
    arch: TinyArch = setting("qwen2", "architecture of the tiny model")
    tiny: dict[str, Any] = setting(dict, "overrides of the tiny model's transformers config")
    dtype: Literal["auto", "float32", "bfloat16"] = setting(
        "auto", "load dtype; auto = bfloat16 on GPU, float32 on CPU")
    attn_implementation: str | None = setting(
        None, "transformers attn_implementation (sdpa, flash_attention_2, eager)")
    gradient_checkpointing: bool = setting(False, "activation checkpointing")
    apex: Literal["auto", "off"] = setting(
        "auto", "NVIDIA apex where it imports: on GPU its prebuilt FusedAdam replaces the FusedAdam DeepSpeed would "
                "compile for a ds_config Adam/AdamW (same update rule; docs/benchmarks.md); 'off' = never")
    packing: bool = setting(
        False, "padding-free micro-batches: sequences packed into one row, position_ids restarting per sequence "
               "and no attention mask (transformers builds the block-diagonal mask on sdpa/eager, varlen kernels "
               "on flash attention); the token budget then counts real tokens only")
    share_prompts: bool = setting(
        False, "prompt-shared forwards in the training and log-prob passes: each distinct prompt of a micro-batch "
               "runs once, followed by the completions of its samples (a 4-D attention mask keeps each completion "
               "to its prompt and itself), and mini-batches and micro-batches keep a prompt's samples together; the "
               "same function as padded rows up to float rounding, fewer positions when G samples share prompts "
               "longer than their completions (docs/rollout.md); sdpa or eager attention")
    lora: LoraConfig | None = setting(
        None, "LoRA adapters as the only trainable parameters; unset = full fine-tuning")
    routing_replay: RoutingReplay = setting(
        "off", "mixture-of-experts policies: 'rollout' forces, in the trainer's old-log-prob, reference and training "
               "forwards, the experts the rollout backend chose for every token (R3; the router's gradient still "
               "flows); 'off' lets the trainer's routers choose (docs/moe.md)")
    router_aux_loss_coef: float = setting(
        0.0, "mixture-of-experts policies: coefficient of the router's load-balancing loss in the objective, a "
             "per-token term aggregated like the policy loss (docs/moe.md); 0 = not part of the objective", ge=0)

    @model_validator(mode="after")
    def _shared_prompts_alone(self) -> ModelConfig:
        """`share_prompts` lays rows out itself: not with `packing` (another layout), flash attention (which takes
        no 4-D mask) or a mixture-of-experts policy's replayed or counted routes (laid out per padded row)."""
        if not self.share_prompts:
            return self
        p = f"{self.PATH}.share_prompts"
        if self.packing:
            raise ConfigError(f"{p} and {self.PATH}.packing are both set; they lay micro-batches out in two different "
                              "ways. Fix: keep one (share_prompts when samples share long prompts, packing otherwise).")
        if self.attn_implementation and self.attn_implementation.startswith("flash"):
            raise ConfigError(f"{p} with {self.PATH}.attn_implementation = {self.attn_implementation!r}: the shared "
                              "rows need a 4-D attention mask, which flash attention does not take. Fix: use 'sdpa' "
                              "(or 'eager'), or set share_prompts to false.")
        if self.routing_replay != "off" or self.router_aux_loss_coef > 0:
            raise ConfigError(f"{p} with a mixture-of-experts policy's routes ({self.PATH}.routing_replay = "
                              f"{self.routing_replay!r}, router_aux_loss_coef = {self.router_aux_loss_coef:g}): routes "
                              "are laid out per padded row. Fix: set share_prompts to false, or routing_replay to "
                              "'off' and router_aux_loss_coef to 0.")
        return self
