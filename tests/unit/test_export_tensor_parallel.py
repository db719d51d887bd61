"""Exporting a ZeRO-0 AutoTP checkpoint: DeepSpeed's universal conversion needs ZeRO's optimizer-state files, which
ZeRO-0 does not write, so dsrl merges the tensor ranks' model-states files with the affine map DeepSpeed stores in
them (``universal_checkpoint_info.affine_map``: per parameter, its full shape and where each rank's shard lies in
it). The files here are written in that format, as DeepSpeed 0.19.8 wrote them for the tiny Qwen2 at
``autotp_size`` 2 (column-parallel q_proj: rows split; row-parallel o_proj: columns split; the norm replicated)."""

from __future__ import annotations

import torch

from dsrl.checkpoint.export import consolidated_state_dict


def _pieces(full: torch.Tensor, dim: int, tp: int) -> tuple[list[torch.Tensor], dict]:
    shards = list(full.chunk(tp, dim))
    ranks = {}
    for r, shard in enumerate(shards):
        offset = r * shard.shape[dim] * full.stride(dim)
        ranks[r] = {"shard_shape": list(shard.shape), "pieces": [
            {"shape": list(shard.shape), "source": [offset, list(full.stride())],
             "dest": [0, list(shard.contiguous().stride())], "locations": [r]}]}
    return [s.contiguous() for s in shards], {"logical_shape": list(full.shape), "ranks": ranks}


def _write(tmp_path, full: dict[str, torch.Tensor], dims: dict[str, int], tp: int = 2) -> None:
    modules = [{} for _ in range(tp)]
    affine = {}
    for name, tensor in full.items():
        if name in dims:
            shards, entry = _pieces(tensor, dims[name], tp)
            affine["^" + name.replace(".", "\\.") + "$"] = entry
        else:
            shards = [tensor.clone() for _ in range(tp)]
        for r in range(tp):
            modules[r][name] = shards[r]
    info = {"affine_map": {"version": 1, "params": affine}}
    for r in range(tp):
        path = tmp_path / f"mp_rank_{r:02d}_model_states.pt"
        torch.save({"module": modules[r], "universal_checkpoint_info": info}, path)  # shards saved as views: offsets


def test_zero0_tensor_parallel_shards_merge_into_the_full_weights(tmp_path):
    torch.manual_seed(0)
    full = {"q.weight": torch.randn(8, 6), "q.bias": torch.randn(8), "o.weight": torch.randn(6, 8),
            "norm.weight": torch.randn(6)}
    _write(tmp_path, full, {"q.weight": 0, "q.bias": 0, "o.weight": 1})
    merged = consolidated_state_dict(str(tmp_path))
    assert merged.keys() == full.keys() and all(torch.equal(merged[k], full[k]) for k in full)


def test_planted_wrong_split_dimension_is_visible(tmp_path):
    """The guard: a row-parallel weight recorded as split along rows merges into another tensor."""
    torch.manual_seed(0)
    full = {"o.weight": torch.randn(6, 8)}
    _write(tmp_path, full, {"o.weight": 1})
    shards = [torch.load(tmp_path / f"mp_rank_{r:02d}_model_states.pt", weights_only=False) for r in range(2)]
    _, wrong = _pieces(full["o.weight"], 0, 2)
    for r, state in enumerate(shards):
        state["universal_checkpoint_info"]["affine_map"]["params"]["^o\\.weight$"] = wrong
        state["module"]["o.weight"] = full["o.weight"].chunk(2, 1)[r].contiguous()
        torch.save(state, tmp_path / f"mp_rank_{r:02d}_model_states.pt")
    assert not torch.equal(consolidated_state_dict(str(tmp_path))["o.weight"], full["o.weight"])
