"""Worker of tests/distributed/test_megatron_hf.py: a megatron-core GPTModel built from a Hugging Face config, with
the HF weights loaded through dsrl's map, computes the HF model's logits, and gathers back to the HF weights bit for
bit, under tensor and pipeline parallelism (CPU, gloo, the test-only CUDA shim).

    python -m torch.distributed.run --nproc_per_node 2 tests/workers/megatron_hf_worker.py --out r.json

For each architecture (Llama untied with grouped-query attention, Qwen2 with q/k/v biases and a tied head, Qwen3
with per-head q/k norms) and each layout (TP = 1 on every rank, TP = 2, PP = 2): the same random HF model on every
rank (seeded), its weights loaded into this rank's shard, the GPTModel's logits (gathered over the vocabulary;
with PP the last stage's, activations passed stage to stage by hand) against the HF forward in float32, and the
gathered HF state dict against the original (with ``--export``, also the HF state dict that ``dsrl export`` reads from
the model's dist-checkpoint). Rank 0 writes one JSON row per case. ``--plant`` plants a bug in the
map (k and v swapped in the fused qkv) so the test can show its check failing.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "launch"))
import megatron_cpu_shim  # noqa: E402

megatron_cpu_shim.install()

from dsrl.backends.megatron import hf_weights  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from megatron_common import hf_causal_lm, write_rows  # noqa: E402

SHAPE = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6,
             rope_theta=50000.0)  # not the default base: the map must read it


def hf_model(kind: str, value: bool = False) -> torch.nn.Module:
    return hf_causal_lm(kind, 7, value=value, **SHAPE)


def run_case(kind: str, tp: int, pp: int, plant: bool, checkpoints: str, value: bool = False) -> dict:
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    model_parallel_cuda_manual_seed(0)
    hf = hf_model(kind, value)
    cfg = hf_weights.gpt_config(hf.config, use_cpu_initialization=True, tensor_model_parallel_size=tp,
                                pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32)
    first, last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
    gpt = hf_weights.build_gpt_model(hf.config, cfg, pre_process=first, post_process=last, parallel_output=False,
                                     value_head=value)
    state = {k: v.clone() for k, v in hf.state_dict().items()}
    if hf.config.tie_word_embeddings and not value:
        del state["lm_head.weight"]  # as a tied model's safetensors hold it: the embedding only
    if plant and value:  # the value head's weight and bias taken from another model
        state["score.bias"] = state["score.bias"] + 1.0
    elif plant:
        for i in range(hf.config.num_hidden_layers):
            k, v = f"model.layers.{i}.self_attn.k_proj.weight", f"model.layers.{i}.self_attn.v_proj.weight"
            state[k], state[v] = state[v], state[k]
    hf_weights.load_hf_weights(gpt, hf.config, state, ps.get_tensor_model_parallel_rank(), tp)
    gpt.eval()
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, SHAPE["vocab_size"], (2, 24), generator=gen)
    positions = torch.arange(24).expand(2, 24)
    with torch.no_grad():
        want = hf(input_ids=tokens, use_cache=False).logits
        got = _pipelined_forward(gpt, tokens, positions, first, last, pp)
    error = float((got - want).abs().max()) if got is not None else None
    gathered = hf_weights.gather_hf_weights(gpt, hf.config, ps.get_tensor_model_parallel_group() if tp > 1 else None)
    original = hf.state_dict()
    mismatched = sorted(n for n, t in gathered.items() if not torch.equal(t, original[n]))
    stage_names = sorted(gathered)
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, {"error": error, "mismatched": mismatched, "names": stage_names})
    names = sorted({n for e in everyone for n in e["names"]})
    exported = {}
    if checkpoints:  # --export
        exported = _exported(gpt, hf.config, os.path.join(checkpoints, f"{kind}{'-value' if value else ''}-{tp}-{pp}"))
    export_mismatched = sorted(n for n in original if n in exported and not torch.equal(exported[n], original[n]))
    expected = sorted(n for n in original if not (n == "lm_head.weight" and hf.config.tie_word_embeddings))
    return {"arch": kind + ("-value" if value else ""), "tp": tp, "pp": pp, "plant": plant,
            "logit_error": max(e["error"] for e in everyone if e["error"] is not None),
            "mismatched": sorted({m for e in everyone for m in e["mismatched"]}),
            "export_mismatched": export_mismatched, "export_names": sorted(exported) == expected,
            "missing_names": sorted(set(expected) - set(names)), "extra_names": sorted(set(names) - set(expected))}


def _exported(gpt, hf_config, directory: str) -> dict:
    """The HF state dict ``dsrl export`` reads from the model's dist-checkpoint (saved here by every rank)."""
    from megatron.core import dist_checkpointing

    from dsrl.backends.megatron.checkpoint import model_tensors
    from dsrl.backends.megatron.engine import _stop_checkpoint_writer_queue

    os.makedirs(directory, exist_ok=True)
    dist_checkpointing.save(gpt.sharded_state_dict(), directory)
    _stop_checkpoint_writer_queue()
    return hf_weights.hf_state_of_checkpoint(model_tensors(directory), hf_config)


def _pipelined_forward(gpt, tokens, positions, first: bool, last: bool, pp: int):
    """The full logits on the last stage (None elsewhere): each stage's output hidden states sent to the next."""
    from megatron.core import parallel_state as ps

    if pp == 1:
        return gpt(input_ids=tokens, position_ids=positions, attention_mask=None)
    shape = (tokens.shape[1], tokens.shape[0], gpt.config.hidden_size)  # [s, b, h]
    if not first:
        hidden = torch.empty(shape)
        dist.recv(hidden, src=ps.get_pipeline_model_parallel_prev_rank())
        gpt.set_input_tensor(hidden)
    out = gpt(input_ids=tokens, position_ids=positions, attention_mask=None)
    if not last:
        dist.send(out.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
        return None
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--plant", action="store_true")
    ap.add_argument("--value", action="store_true", help="value models only (the critic's)")
    ap.add_argument("--export", action="store_true", help="also save each model's dist-checkpoint and read it back "
                    "as dsrl export does")
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rows = []
    checkpoints = os.path.join(os.path.dirname(os.path.abspath(args.out)), "checkpoints") if args.export else ""
    layouts = [(2, 1)] if args.plant else [(2, 1), (1, 2)] if args.export else [(1, 1), (2, 1), (1, 2)]
    if args.value:
        kinds = ("qwen2",) if args.plant else ("qwen2", "llama")
        rows = [run_case(kind, tp, pp, args.plant, checkpoints, value=True) for kind in kinds for tp, pp in layouts]
    for kind in () if args.value else ("llama",) if args.plant else ("llama", "qwen2", "qwen3"):
        for tp, pp in layouts:
            rows.append(run_case(kind, tp, pp, args.plant, checkpoints))
    write_rows(rows, args.out)


if __name__ == "__main__":
    from dsrl.runtime.process_exit import leave

    main()
    leave(0)  # no interpreter finalization beside gloo threads (dsrl/runtime/process_exit.py)
