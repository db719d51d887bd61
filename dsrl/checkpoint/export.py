"""A checkpoint as a Hugging Face model directory: ``dsrl export RUN_OR_CHECKPOINT_DIR --out DIR``.

Every checkpoint dsrl commits carries, beside DeepSpeed's files, an ``hf/`` directory with the model's
``config.json``, ``generation_config.json`` and the tokenizer (a few KB to a few MB, written by rank 0
before the commit and covered by the manifest), so one checkpoint directory is enough to export it.

Invariants of :func:`export_checkpoint`:
- the weights are the checkpoint's fp32 master weights, consolidated from any ZeRO stage (ZeRO-3
  shards included) by DeepSpeed's ``zero_to_fp32`` utilities in one process, whatever the number of
  ranks that wrote them (ZeRO-0 keeps whole weights in its model-states file; AutoTP shards are merged
  by DeepSpeed's universal-checkpoint conversion); a Megatron engine's checkpoint gives its model's tensors from its
  dist-checkpoint (any tensor and pipeline sizes), mapped to Hugging Face names
  (:func:`dsrl.backends.megatron.hf_weights.hf_state_of_checkpoint`);
- the checkpoint is verified against its manifest first (a damaged file is an error naming it);
- the output directory appears complete or not at all (written beside it, then renamed) and holds
  ``model.safetensors`` (or shards), ``config.json``, ``generation_config.json`` and the tokenizer,
  loadable with ``AutoModelForCausalLM.from_pretrained`` / ``AutoTokenizer.from_pretrained``;
- ``dtype="auto"`` writes the dtype the model was trained in (its config's), else float32/bfloat16/float16;
- a LoRA run (``dsrl.model.lora``; its ``hf/`` holds PEFT's ``adapter_config.json``) exports the merged model
  (each adapted weight ``W + (alpha/r) B A``, PEFT's ``merge_and_unload``), loadable like any other, or with
  ``adapter=True`` the adapter alone (``adapter_model.safetensors`` + ``adapter_config.json`` + the tokenizer),
  loadable with ``peft.PeftModel.from_pretrained(base_model, DIR)``.
"""

from __future__ import annotations

import contextlib
import glob
import io
import os
import shutil
from collections.abc import Callable
from typing import Any

import torch

from dsrl.checkpoint.adapters import ADAPTER_CONFIG, HF_META
from dsrl.checkpoint.megatron_files import ENGINE_DIR as MEGATRON_DIR
from dsrl.config import ConfigError

PEFT_HINT = "pip install -e '.[lora]' (in the dsrl checkout) (peft>=0.21,<0.22)"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def write_hf_meta(engine_dir: str, model: Any, tokenizer: Any) -> None:
    """Save the model's config and generation config and the tokenizer into ``engine_dir/hf`` (rank 0)."""
    folder = os.path.join(engine_dir, HF_META)
    os.makedirs(folder, exist_ok=True)
    model.config.save_pretrained(folder)
    generation = getattr(model, "generation_config", None)
    if generation is not None:
        generation.save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    adapters = getattr(model, "peft_config", None)  # a LoRA policy: what export needs to rebuild it
    if isinstance(adapters, dict) and "default" in adapters:
        adapters["default"].save_pretrained(folder)


def _is_zero_partitioned(engine_dir: str) -> bool:
    return bool(glob.glob(os.path.join(engine_dir, "*zero_pp_rank_*_optim_states.pt")))


def _param(saved: Any) -> torch.Tensor:
    """A universal checkpoint's fp32 entry: ``{"param": tensor, ...}``, or (ZeRO-3 + AutoEP, dense parameters) the
    bare flat tensor."""
    return saved["param"] if isinstance(saved, dict) else saved


def _is_expert_parallel(engine_dir: str) -> bool:
    """Whether DeepSpeed AutoEP wrote the checkpoint: per-expert files (ZeRO-0/1/2), or its layer list in the model
    states (ZeRO-3 keeps experts partitioned inside them)."""
    if glob.glob(os.path.join(engine_dir, "layer_*_expert_*_model_states.pt")):
        return True
    from deepspeed.checkpoint.constants import AUTOEP_LAYERS_KEY

    files = sorted(glob.glob(os.path.join(engine_dir, "*model_states.pt")))
    return bool(files) and AUTOEP_LAYERS_KEY in torch.load(files[0], map_location="cpu", weights_only=False, mmap=True)


def consolidated_state_dict(engine_dir: str, scratch: str | None = None) -> dict[str, torch.Tensor]:
    """The full fp32 weights of the DeepSpeed checkpoint in ``engine_dir``, in one process.

    ZeRO-1/2/3: DeepSpeed's ``zero_to_fp32``; tensor-parallel (AutoTP) shards: DeepSpeed's universal
    conversion (into ``scratch``, removed after), whose per-parameter files hold the merged weights;
    ZeRO-0: the model-states file (with AutoTP: one per tensor rank, merged by :func:`_merged_tensor_parallel_shards`;
    DeepSpeed's universal conversion needs ZeRO's optimizer-state files, which ZeRO-0 does not write). DeepSpeed
    AutoEP (per-expert ``layer_*_expert_*`` files, or its layer list in ZeRO-3's model states): the universal
    conversion, which reassembles every layer's experts, under the Hugging Face names
    (:func:`dsrl.backends.deepspeed.autoep.hf_state_dict`).
    """
    if glob.glob(os.path.join(engine_dir, "*mp_rank_01_*.pt")) and not _is_zero_partitioned(engine_dir):
        return _merged_tensor_parallel_shards(engine_dir)
    expert_parallel = _is_expert_parallel(engine_dir)
    if expert_parallel or glob.glob(os.path.join(engine_dir, "*mp_rank_01_*.pt")):
        from dsrl.checkpoint.elastic import convert_to_universal

        scratch = scratch or f"{engine_dir.rstrip(os.sep)}.export-universal.tmp"
        try:
            universal, _ = convert_to_universal(engine_dir, out=scratch)
            zero = os.path.join(universal, "zero")
            state = {name: _param(torch.load(os.path.join(zero, name, "fp32.pt"), weights_only=False)).float()
                     for name in sorted(os.listdir(zero)) if os.path.isfile(os.path.join(zero, name, "fp32.pt"))}
            if expert_parallel:
                from dsrl.backends.deepspeed.autoep import hf_state_dict

                state = hf_state_dict(state)
            return state
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    if _is_zero_partitioned(engine_dir):
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        parent, tag = os.path.split(os.path.abspath(engine_dir))
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            state = get_fp32_state_dict_from_zero_checkpoint(parent, tag=tag)
        state = {k: v.float() for k, v in state.items()}
        # Frozen parameters (LoRA's base) are recorded for the consolidation from ZeRO-2 on only; under ZeRO-1 the
        # model-states file holds them whole (ZeRO-1/2 never partition the parameters; ZeRO-3's are empty there).
        for f in glob.glob(os.path.join(engine_dir, "mp_rank_*_model_states.pt"))[:1]:
            module = torch.load(f, map_location="cpu", weights_only=False)["module"]
            state.update({k: v.float() for k, v in module.items() if k not in state and v.numel() > 0})
        return state
    files = sorted(glob.glob(os.path.join(engine_dir, "mp_rank_*_model_states.pt")))
    if len(files) != 1:
        raise ConfigError(f"{engine_dir}: expected one mp_rank_*_model_states.pt (ZeRO-0), found {len(files)}.")
    module = torch.load(files[0], map_location="cpu", weights_only=False)["module"]
    return {k: v.float() for k, v in module.items()}


def _merged_tensor_parallel_shards(engine_dir: str) -> dict[str, torch.Tensor]:
    """The full weights of a ZeRO-0 AutoTP checkpoint: each tensor rank's model-states file holds its shards, and
    the affine map DeepSpeed writes with them (``universal_checkpoint_info.affine_map``: per parameter pattern, its
    full shape and, per tensor rank, where each piece of the shard lies in the full tensor, as offset and strides)
    places every piece. A parameter outside the map is replicated: tensor rank 0's copy."""
    import re

    files = sorted(glob.glob(os.path.join(engine_dir, "mp_rank_*_model_states.pt")))
    states = [torch.load(f, map_location="cpu", weights_only=False) for f in files]
    modules = [s["module"] for s in states]
    affine = (states[0].get("universal_checkpoint_info") or {}).get("affine_map", {}).get("params", {})
    out = {}
    for name, tensor in modules[0].items():
        entry = next((v for pattern, v in affine.items() if re.fullmatch(pattern, name)), None)
        if entry is None:
            out[name] = tensor.float()
            continue
        full = torch.empty(entry["logical_shape"], dtype=torch.float32)
        for rank, shard_info in entry["ranks"].items():
            shard = modules[int(rank)][name].float().contiguous()
            for piece in shard_info["pieces"]:
                (src_offset, src_strides), (dst_offset, dst_strides) = piece["source"], piece["dest"]
                # as_strided's offset counts from the storage's start: a loaded shard may be a view into a larger one
                torch.as_strided(full, piece["shape"], src_strides, src_offset).copy_(
                    torch.as_strided(shard, piece["shape"], dst_strides, shard.storage_offset() + dst_offset))
        out[name] = full
    return out


def fit_shapes(state: dict[str, torch.Tensor], shapes: dict[str, torch.Size]) -> dict[str, torch.Tensor]:
    """``state`` with every flat tensor reshaped to its parameter's shape: DeepSpeed's universal conversion of an
    AutoEP checkpoint leaves the dense parameters flat (their numel must match)."""
    out = dict(state)
    for name, t in state.items():
        want = shapes.get(name)
        if want is not None and t.dim() == 1 and len(want) > 1 and t.numel() == want.numel():
            out[name] = t.reshape(want)
    return out


def resolve(source: str, checksums: bool = True) -> tuple[str, str]:
    """``(checkpoints dir, tag)`` for a run directory, its checkpoints/ directory or one checkpoint;
    the newest complete checkpoint, verified (ConfigError naming a damaged file)."""
    from dsrl.checkpoint.run_dir import choose, classify

    folder, tags, _, _ = classify(source, source, what="dsrl export")
    point, _ = choose(folder, tags, explicit=True, checksums=checksums, what="dsrl export")
    assert point is not None  # choose raises for an explicit source it cannot use
    return point.ckpt_dir, point.tag


def _with_adapters(model: Any, meta: str) -> Any:
    """``model`` (on the meta device) wrapped by PEFT as the checkpoint's LoRA run wrapped it."""
    try:
        import peft
    except ImportError:
        raise ConfigError(f"{meta} holds a LoRA adapter config (the run used dsrl.model.lora): exporting it needs "
                          f"Hugging Face PEFT. Fix: {PEFT_HINT}.") from None
    import warnings

    config = peft.PeftConfig.from_pretrained(meta)
    config.inference_mode = False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return peft.get_peft_model(model, config)


def export_checkpoint(source: str, out: str, dtype: str = "auto", overwrite: bool = False,
                      engine: str | None = None, checksums: bool = True, adapter: bool = False) -> str:
    """Write the newest checkpoint of ``source`` (or ``source`` itself, a checkpoint) to ``out`` as a
    Hugging Face model directory (module doc); ``engine`` names a second engine's sub-directory. A LoRA
    checkpoint is written merged, or with ``adapter`` as its adapter alone (a PEFT adapter directory)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    if dtype != "auto" and dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype!r}: use auto, {', '.join(DTYPES)}")
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)) and not overwrite:
        raise ConfigError(f"--out {out}: exists and is not empty. Fix: choose a new directory or pass --overwrite.")
    ckpt_dir, tag = resolve(source, checksums)
    engine_dir = os.path.join(ckpt_dir, tag) if engine is None else os.path.join(ckpt_dir, tag, engine)
    meta = os.path.join(engine_dir, HF_META)
    if not os.path.isfile(os.path.join(meta, "config.json")):
        raise ConfigError(f"{engine_dir} has no {HF_META}/config.json (written by dsrl with every checkpoint since "
                          "export existed). Fix: export a newer checkpoint, or copy the model's config.json and "
                          f"tokenizer files into {meta}.")
    lora = os.path.isfile(os.path.join(meta, ADAPTER_CONFIG))
    if adapter and not lora:
        raise ConfigError(f"--adapter: {engine_dir} was not trained with dsrl.model.lora (its {HF_META}/ holds no "
                          f"{ADAPTER_CONFIG}), so it has no adapter. Fix: export without --adapter.")
    config = AutoConfig.from_pretrained(meta, local_files_only=True)
    out = os.path.abspath(out)
    megatron = os.path.join(engine_dir, MEGATRON_DIR)
    if os.path.isdir(megatron):  # the Megatron engine's dist-checkpoint, any tensor and pipeline sizes
        from dsrl.backends.megatron.checkpoint import model_tensors
        from dsrl.backends.megatron.hf_weights import hf_state_of_checkpoint

        state = hf_state_of_checkpoint(model_tensors(megatron), config)
    else:
        state = consolidated_state_dict(engine_dir, scratch=f"{out}.universal.tmp.{os.getpid()}")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        if lora:
            model = _with_adapters(model, meta)
    state = fit_shapes(state, {n: p.shape for n, p in model.named_parameters()})
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    still_meta = [n for n, p in model.named_parameters() if p.is_meta]
    if still_meta or unexpected:
        raise ConfigError(f"{engine_dir}: the checkpoint does not match {meta}/config.json (missing "
                          f"{still_meta[:5]}, unexpected {list(unexpected)[:5]}).")
    del missing
    if lora and not adapter:
        model = model.merge_and_unload()  # W + (alpha/r) B A in every adapted layer; a plain transformers model
    target = DTYPES.get(dtype) or getattr(config, "dtype", None) or torch.float32
    target = DTYPES.get(target, target) if isinstance(target, str) else target
    model = model.to(target)
    if os.path.isfile(os.path.join(meta, "generation_config.json")) and not adapter:
        model.generation_config = GenerationConfig.from_pretrained(meta, local_files_only=True)
    def tokenizer(folder: str) -> None:
        with contextlib.suppress(OSError, ValueError):
            AutoTokenizer.from_pretrained(meta, local_files_only=True).save_pretrained(folder)

    return write_model_dir(model, out, tokenizer)  # a PEFT model (adapter=True) writes the adapter only


def write_model_dir(model: Any, out: str, extra: Callable[[str], None] | None = None) -> str:
    """``model.save_pretrained`` (safetensors) and ``extra(folder)`` (the tokenizer) into ``out``, written beside it
    and renamed into place, replacing what was there: a reader finds the old directory or the whole new one."""
    tmp = f"{out}.tmp.{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    if extra is not None:
        extra(tmp)
    if os.path.exists(out):
        shutil.rmtree(out)
    os.rename(tmp, out)
    return out
