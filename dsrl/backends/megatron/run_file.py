"""What a run file says of the Megatron engine: its layout (``dsrl.engine``) and its optimizer (the ds_config's).

A run file is written once for both engines (``dsrl.engine.kind`` chooses): the ds_config's ``"optimizer"`` and
``"gradient_clipping"`` configure megatron-core's optimizer as they configure DeepSpeed's, and its ``"scheduler"``
(or ``dsrl.scheduler``) is dsrl's own schedule on either engine (launch/train.py hands it to :func:`build_engine`),
so the learning rate of every optimizer step is the same. What megatron-core cannot take is a ConfigError naming
the field, before any work.
"""

from __future__ import annotations

from typing import Any

from dsrl.backends.megatron.engine import MegatronLayout, OptimizerSettings
from dsrl.config import ConfigError
from dsrl.config.engine import EngineConfig

# DeepSpeed's optimizer "type" (case-insensitive) -> megatron-core's OptimizerConfig.optimizer
_OPTIMIZERS = {"adam": "adam", "adamw": "adam", "sgd": "sgd"}
_KNOWN_PARAMS = {"adam": {"lr", "betas", "eps", "weight_decay", "adam_w_mode", "torch_adam", "fused"},
                 "sgd": {"lr", "momentum", "weight_decay"}}


def layout_of(engine: EngineConfig) -> MegatronLayout:
    """The :class:`MegatronLayout` of ``dsrl.engine`` (expert parallelism was refused when the run file was
    read)."""
    return MegatronLayout(tensor_model_parallel_size=engine.tensor_model_parallel_size,
                          pipeline_model_parallel_size=engine.pipeline_model_parallel_size,
                          context_parallel_size=engine.context_parallel_size,
                          sequence_parallel=engine.sequence_parallel)


def optimizer_settings(ds_config: dict[str, Any], bf16: bool = False) -> OptimizerSettings:
    """megatron-core's optimizer for the ds_config's ``"optimizer"`` (Adam, AdamW, SGD) and ``"gradient_clipping"``:
    AdamW with decoupled weight decay on every parameter (DeepSpeed's Adam is AdamW unless ``adam_w_mode`` is
    false), SGD with its momentum, and the clipping DeepSpeed would apply (its default when unset). Adam's
    weight decay must be given: DeepSpeed's default differs between its CPU and GPU classes. ``bf16``: the model's
    dtype (``dsrl.model.dtype``, resolved) is bfloat16, so megatron-core trains in mixed precision (bf16 weights and
    activations, fp32 main weights, gradients reduced in fp32); a ds_config ``bf16`` or ``fp16`` section must not
    say otherwise. Every problem at once, as one ConfigError."""
    problems: list[str] = []
    section = ds_config.get("optimizer")
    if not isinstance(section, dict) or "type" not in section:
        raise ConfigError('the ds_config has no "optimizer" section: the Megatron engine builds its optimizer from it. '
                          'Fix: add one, e.g. "optimizer": {"type": "AdamW", "params": {"lr": 1e-6}}.')
    kind = str(section["type"])
    name = _OPTIMIZERS.get(kind.lower())
    params = section.get("params") or {}
    if name is None:
        raise ConfigError(f"ds_config optimizer.type = {kind!r} with dsrl.engine.kind = 'megatron': megatron-core "
                          "offers Adam(W) and SGD. Fix: use \"AdamW\", \"Adam\" or \"SGD\".")
    unknown = sorted(set(params) - _KNOWN_PARAMS[name])
    if unknown:
        problems.append(f"ds_config optimizer.params {', '.join(unknown)} with dsrl.engine.kind = 'megatron': "
                        f"megatron-core's {name} takes {', '.join(sorted(_KNOWN_PARAMS[name]))}. Fix: remove them.")
    if name == "adam" and params.get("adam_w_mode") is False:
        problems.append("ds_config optimizer.params.adam_w_mode = false with dsrl.engine.kind = 'megatron': dsrl "
                        "builds megatron-core's Adam with decoupled weight decay (AdamW). Fix: remove adam_w_mode.")
    lr = params.get("lr")
    if not isinstance(lr, (int, float)) or isinstance(lr, bool) or lr <= 0:
        problems.append(f"ds_config optimizer.params.lr = {lr!r}: the Megatron engine needs a positive learning "
                        "rate. Fix: set it.")
        lr = 1.0
    if name == "adam" and "weight_decay" not in params:
        problems.append("ds_config optimizer.params.weight_decay is unset with dsrl.engine.kind = 'megatron': "
                        "DeepSpeed's default depends on the class it builds (torch's AdamW: 0.01 on the CPU; "
                        "FusedAdam: 0 on GPUs), so the two engines would differ. Fix: set it, e.g. 0.0.")
    from deepspeed.runtime.config import get_gradient_clipping

    clip = get_gradient_clipping(ds_config)  # DeepSpeed's own reading, with its default (1.0 in 0.19)
    if not isinstance(clip, (int, float)) or isinstance(clip, bool) or clip < 0:
        problems.append(f"ds_config gradient_clipping = {clip!r} must be a number >= 0 (0: no clipping).")
        clip = 0.0
    fp16, bf16_section = (ds_config.get(mode) for mode in ("fp16", "bf16"))
    if isinstance(fp16, dict) and fp16.get("enabled") is True:
        problems.append("ds_config fp16.enabled with dsrl.engine.kind = 'megatron': the Megatron engine's mixed "
                        "precision is bfloat16 (float16 needs a dynamic loss scale, not wired). Fix: remove the fp16 "
                        "section and set dsrl.model.dtype to 'bfloat16' (or 'auto' on a GPU).")
    if isinstance(bf16_section, dict) and bf16_section.get("enabled") is True and not bf16:
        problems.append("ds_config bf16.enabled with dsrl.engine.kind = 'megatron' while dsrl.model.dtype resolves to "
                        "float32: the Megatron engine's precision follows the model's dtype. Fix: set "
                        "dsrl.model.dtype to 'bfloat16', or bf16.enabled to false.")
    if isinstance(bf16_section, dict) and bf16_section.get("enabled") is False and bf16:
        problems.append("ds_config bf16.enabled = false with dsrl.model.dtype bfloat16 on dsrl.engine.kind = "
                        "'megatron': the engine trains a bfloat16 model in mixed precision (fp32 main weights). Fix: "
                        "set bf16.enabled to true or \"auto\", or dsrl.model.dtype to 'float32'.")
    if problems:
        from dsrl.config.errors import problems_error

        raise problems_error(problems)
    betas = tuple(params.get("betas", (0.9, 0.999)))
    return OptimizerSettings(
        lr=float(lr), betas=(float(betas[0]), float(betas[1])), eps=float(params.get("eps", 1e-8)),
        weight_decay=float(params.get("weight_decay", 0.0)), clip_grad=float(clip), optimizer=name,
        sgd_momentum=float(params.get("momentum", 0.0)), decay_every_parameter=True, bf16=bf16)
