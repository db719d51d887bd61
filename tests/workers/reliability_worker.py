"""Worker for tests/distributed/test_elastic_export.py: ``launch/train.py`` plus two probes.

``--dump_resumed FILE``: after the Trainer resumed (before any new step), rank 0 writes the engine's
full parameters (gathered under ZeRO-3), its optimizer step and the LR it will use next.
``--dump_logits FILE``: after the run, the engine's logits on a fixed input (every rank runs the
forward: ZeRO-3 gathers parameters in it), written by rank 0 with that input.
Every other argument is launch/train.py's.
"""

from __future__ import annotations

import argparse
import logging
import sys

import torch


def _full_parameters(rl) -> dict[str, torch.Tensor]:
    import deepspeed

    params = dict(rl.engine.module.named_parameters())
    if rl.zero_stage == 3:
        with deepspeed.zero.GatheredParameters(list(params.values())):
            return {k: v.detach().clone().float() for k, v in params.items()}
    return {k: v.detach().clone().float() for k, v in params.items()}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--ds_config", required=True)
    p.add_argument("--resume", default=None)
    p.add_argument("--dump_resumed", default=None)
    p.add_argument("--dump_logits", default=None)
    p.add_argument("--local_rank", type=int, default=None)
    args, rest = p.parse_known_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(asctime)s %(name)s %(message)s")
    from dsrl.config import parse_override_args
    from dsrl.rl.trainer import Trainer

    trainer = Trainer.from_config(args.ds_config, parse_override_args(rest), resume=args.resume)
    parts = trainer.parts
    rl = parts.actor.engine
    if args.dump_resumed:
        params = _full_parameters(rl)
        if parts.rank == 0:
            torch.save({"params": params, "optimizer_steps": rl.optimizer_steps,
                        "next_lr": rl.scheduler.current_lr(), "notice": parts.checkpointer.notice}, args.dump_resumed)
    trainer.run()
    if args.dump_logits:
        ids = (torch.arange(24).view(2, 12) * 7 + 3) % len(parts.tokenizer)
        rl.engine.eval()
        with torch.no_grad():
            logits = rl.engine(input_ids=ids.to(rl.device), use_cache=False).logits.float().cpu()
        if parts.rank == 0:
            torch.save({"input_ids": ids, "logits": logits}, args.dump_logits)
    return parts.stop.exit_code


if __name__ == "__main__":
    from dsrl.runtime.process_exit import leave

    leave(main())  # no interpreter finalization beside gloo threads (dsrl/runtime/process_exit.py)
