"""An MoE policy under DeepSpeed AutoEP (``deepspeed --num_gpus 2``, autoep_size 2), per ZeRO stage in one launch:

- generation with the hf backend while the ranks hold different numbers of prompts (rank 0 three, rank 1 one, one
  prompt per generate call): every forward is an all-to-all of the expert-parallel group, so the ranks must run
  as many calls and decode steps as each other; the report holds each completion's length, its routes' shape, and
  how many (position, layer) routes differ from those an unsharded float32 copy's routers choose on the same
  sequence;
- one AdamW step (DeepSpeed's universal conversion reads Adam's moments), a DeepSpeed checkpoint, and the
  checkpoint consolidated for export (:func:`dsrl.checkpoint.export.consolidated_state_dict`: DeepSpeed's
  universal conversion, experts reassembled, Hugging Face names) compared with the live engine's parameters
  gathered the way dsrl.check gathers them.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import types

import torch
import torch.distributed as dist

VOCAB, PAD, BOS, EOS = 16, 0, 1, 2
PROMPTS = {0: [[BOS, 5, 6, 7], [BOS, 4], [BOS, 3, 5, 3, 6]], 1: [[BOS, 7, 7]]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--stages", default="2,3")
    parser.add_argument("--local_rank", type=int, default=0)
    args = parser.parse_args()

    import dsrl
    from dsrl.backends.deepspeed.autoep import full_parameters, moe_optimizer
    from dsrl.checkpoint.export import consolidated_state_dict, fit_shapes
    from dsrl.config import ModelConfig, RolloutConfig
    from dsrl.core.routes import differing_pairs
    from dsrl.rl.policy.model import build_model
    from dsrl.rollout.hf import HFRolloutBackend
    from dsrl.rollout.routes import MoERouting

    report: dict = {}
    for stage in [int(s) for s in args.stages.split(",")]:
        model = build_model(ModelConfig(arch="qwen3_moe"), VOCAB, PAD, BOS, EOS, on_gpu=False, seed=0)
        plain = copy.deepcopy(model).eval()
        cfg = {"zero_optimization": {"stage": stage}, "expert_parallel": {"enabled": True, "autoep_size": 2},
               "zero_allow_untested_optimizer": True, "gradient_clipping": 0.0,
               "dsrl": {"batch": {"prompts_per_rollout": 2, "samples_per_prompt": 2, "mini_batch_size": 4,
                                  "micro_batch_size_per_rank": 2}, "run": {"rollouts": 1}}}
        engine = dsrl.initialize(model, cfg, optimizer=moe_optimizer(lambda g: torch.optim.AdamW(g, lr=1e-2)))
        rank = dist.get_rank()
        tok = types.SimpleNamespace(eos_token_id=EOS, pad_token_id=PAD)
        backend = HFRolloutBackend(engine, tok, RolloutConfig(max_new_tokens=6, generation_batch_size=1))
        completions = backend.generate(PROMPTS[rank], 2, seed=rank)
        plain_routing = MoERouting.of(plain)
        rows = []
        for c in completions:
            toks = torch.tensor(c.prompt_ids + c.completion_ids)
            with torch.no_grad(), plain_routing.recording() as log:
                plain(toks[:-1].unsqueeze(0))
            diff, pairs = differing_pairs(c.routes.long(), log.call(0).long())
            rows.append({"length": len(c.completion_ids), "routes": list(c.routes.shape), "differing": diff,
                         "pairs": pairs})
        # one AdamW step on a tiny batch, then a checkpoint and its consolidation
        ids = torch.tensor([[BOS, 5, 6, 7, 3], [BOS, 4, 4, 2, 0]])
        micro = {"input_ids": ids, "loss_mask": torch.ones_like(ids), "targets": torch.roll(ids, -1, 1)}

        def loss_fn(eng, mb):
            logits = eng(input_ids=mb["input_ids"]).logits
            return -torch.log_softmax(logits.float(), -1).gather(-1, mb["targets"].unsqueeze(-1)).squeeze(-1)

        engine.train_mini_batch([micro], loss_fn)
        live = full_parameters(engine.engine)
        tag = f"stage{stage}"
        engine.engine.save_checkpoint(args.ckpt, tag=tag)
        dist.barrier()
        worst, names, shapes = None, None, None
        if rank == 0:
            saved = fit_shapes(consolidated_state_dict(os.path.join(args.ckpt, tag)),
                               {n: t.shape for n, t in live.items()})
            names = sorted(set(saved) ^ set(live))  # a tied output head may come as a second name
            worst = max(float((saved[n].double() - live[n]).abs().max()) for n in live if n in saved)
            shapes = all(saved[n].shape == live[n].shape for n in live if n in saved)
        report[str(stage)] = {"completions": rows, "export_names_differing": names, "export_max_abs_diff": worst,
                              "export_shapes_match": shapes,
                              "layers": backend.routing.layout.layers, "synced": backend.synced}
        dist.barrier()
    with open(f"{args.out}.{dist.get_rank()}", "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    from dsrl.runtime.process_exit import leave

    main()
    leave(0)
