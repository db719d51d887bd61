"""Multi-process worker for tests/distributed/test_rollout_zero3.py (run with ``deepspeed --num_gpus N``).

Builds the tiny model on every rank, keeps a plain copy, wraps the original in a ZeRO-``--stage``
RLEngine and has the ranks generate with the ``--backend`` rollout backend (hf or cb) *different*
amounts (rank r: 3 - 2r prompts, max_new_tokens 12 - 7r, then a round where the last rank has no
prompt at all), then the same prompts with the same seed on every rank. Rank 0 writes a JSON report
with, per rank: whether each engine generation equals the plain module's with the same seed, the
number of collectives issued inside each generate call, the completions of the identical round (they
must not depend on the rank), whether the parameters were re-partitioned, and whether a training
step after generation still works. ``--hooks_probe`` also counts the collectives
of one generate call with the ZeRO-3 hooks left active inside ``GatheredParameters`` (same work on
every rank, so it cannot hang), to show why the backend suspends them; ``--keep_zero3_hooks`` runs
the uneven rounds with the hooks active (expected to fail: gloo error here, a hang on NCCL).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import types
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

VOCAB, PAD, BOS, EOS = 32, 0, 1, 2


class CollectiveCounter:
    """Counts calls into DeepSpeed's communication backend (every ZeRO collective goes through it)."""

    NAMES = ("all_gather_into_tensor", "all_gather", "all_gather_coalesced", "all_reduce", "all_reduce_coalesced",
             "broadcast", "reduce_scatter_tensor", "reduce_scatter", "reduce", "barrier", "all_to_all_single")

    def __init__(self) -> None:
        self.calls = 0
        self.names: list[str] = []

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        from deepspeed.comm import comm as ds_comm

        cdb = ds_comm.cdb
        originals = {n: getattr(cdb, n) for n in self.NAMES if hasattr(cdb, n)}

        def wrap(name: str, fn: Any) -> Any:
            def counted(*args: Any, **kwargs: Any) -> Any:
                self.calls += 1
                self.names.append(name)
                return fn(*args, **kwargs)

            return counted

        for name, fn in originals.items():
            setattr(cdb, name, wrap(name, fn))
        try:
            yield
        finally:
            for name in originals:
                delattr(cdb, name)  # back to the class attribute (bound method)


def as_lists(completions: list[Any]) -> list[tuple[int, list[int], bool]]:
    return [(c.prompt_index, c.completion_ids, c.finished) for c in completions]


def all_partitioned(module: torch.nn.Module) -> bool:
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    return all(p.ds_status == ZeroParamStatus.NOT_AVAILABLE or getattr(p, "ds_persist", False)
               for p in module.parameters())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--stage", type=int, default=3)
    parser.add_argument("--arch", default="qwen2")
    parser.add_argument("--backend", default="hf", choices=["hf", "cb"])
    parser.add_argument("--cb_attention", default="auto", choices=["auto", "model", "varlen"])
    parser.add_argument("--hooks_probe", action="store_true")
    parser.add_argument("--keep_zero3_hooks", action="store_true")
    parser.add_argument("--local_rank", type=int, default=0)
    args = parser.parse_args()

    import dsrl
    from dsrl.backends.deepspeed.engine import ensure_distributed
    from dsrl.config import ModelConfig, RolloutConfig
    from dsrl.rl.policy.model import build_model, frozen_copy
    from dsrl.rollout.cb import ContinuousBatchingBackend
    from dsrl.rollout.hf import HFRolloutBackend

    if args.keep_zero3_hooks:
        import dsrl.backends.deepspeed.hooks as hf_mod

        hf_mod.suspended_zero3_hooks = lambda engine: contextlib.nullcontext()
    ensure_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model(ModelConfig(arch=args.arch), VOCAB, PAD, BOS, EOS, on_gpu=False, seed=3)
    plain = frozen_copy(model)
    cfg = {
        # persistence threshold 0: no parameter stays resident, so ZeRO-3 really partitions all of them
        "zero_optimization": {"stage": args.stage, "stage3_param_persistence_threshold": 0},
        "zero_allow_untested_optimizer": True,
        "dsrl": {"batch": {"prompts_per_rollout": world, "samples_per_prompt": 2, "mini_batch_size": 2 * world,
                           "micro_batch_size_per_rank": 1}, "run": {"rollouts": 1}},
    }
    engine = dsrl.initialize(model, cfg, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    tok = types.SimpleNamespace(eos_token_id=EOS, pad_token_id=PAD)

    n_prompts = max(0, 3 - 2 * rank)
    rollout = RolloutConfig(max_new_tokens=max(2, 12 - 7 * rank), generation_batch_size=2,
                            cb_attention=args.cb_attention)
    prompts = [[BOS] + [3 + (5 * rank + 3 * i + j) % (VOCAB - 3) for j in range(1 + 2 * i)] for i in range(n_prompts)]
    rounds = [(prompts, 3, 11 + rank), (prompts[:1] if rank < world - 1 else [], 2, 5)]

    counter = CollectiveCounter()
    backend_cls = {"hf": HFRolloutBackend, "cb": ContinuousBatchingBackend}[args.backend]
    z3 = backend_cls(engine, tok, rollout)
    ref = backend_cls(plain, tok, rollout)
    report: dict[str, Any] = {"rank": rank, "rounds": []}
    if args.hooks_probe and args.stage == 3:
        # Before any training step (the first rollout of a run), identical work on every rank (same prompt,
        # seed, weights and length limit), so leaving the hooks on cannot hang here: it shows how many
        # collectives they add.
        import dsrl.backends.deepspeed.hooks as hf_mod

        probe = {}
        same = HFRolloutBackend(engine, tok, RolloutConfig(max_new_tokens=12))
        for label, keep in (("suspended", False), ("hooks_on", True)):
            saved = hf_mod.suspended_zero3_hooks
            if keep:
                hf_mod.suspended_zero3_hooks = lambda engine: contextlib.nullcontext()
            try:
                before = counter.calls
                with counter.counting():
                    got = same.generate([[BOS, 4, 5]], 2, seed=0)
                probe[label] = {"collectives": counter.calls - before, "kinds": sorted(set(counter.names[before:])),
                                "tokens": sum(len(c.completion_ids) for c in got)}
            finally:
                hf_mod.suspended_zero3_hooks = saved
        report["hooks_probe"] = probe

    for ps, g, seed in rounds:
        before = counter.calls
        with counter.counting():
            got = z3.generate(ps, g, seed)
        expect = ref.generate(ps, g, seed)
        report["rounds"].append({
            "prompts": len(ps), "completions": len(got), "equal": as_lists(got) == as_lists(expect),
            "tokens": sum(len(c.completion_ids) for c in got), "collectives": counter.calls - before,
            "training_mode_restored": engine.module.training,
        })
    # identical work (prompts, settings, seed) on every rank
    same = backend_cls(engine, tok, RolloutConfig(max_new_tokens=8)).generate([[BOS, 4, 5], [BOS, 6]], 3, seed=9)
    report["same_work"] = as_lists(same)
    report["partitioned_after"] = all_partitioned(engine.module) if args.stage == 3 else None
    report["persistent_params"] = sum(bool(getattr(p, "ds_persist", False)) for p in engine.module.parameters())

    # The engine still trains after generation (hooks back in place): one step with a real loss.
    ids = torch.tensor([[BOS, 5, 6, 7, 8]])
    micro = {"input_ids": ids, "loss_mask": torch.ones_like(ids)}

    def loss_fn(eng: Any, mb: dict[str, torch.Tensor]) -> torch.Tensor:
        logits = eng(input_ids=mb["input_ids"]).logits.float()
        return -torch.log_softmax(logits, -1).gather(-1, mb["input_ids"].unsqueeze(-1)).squeeze(-1)

    metrics = engine.train_mini_batch([micro], loss_fn)
    report["train_step_applied"] = bool(metrics["step_applied"])
    report["train_loss_finite"] = bool(torch.isfinite(torch.tensor(metrics["loss"])))

    reports: list[Any] = [None] * world
    dist.all_gather_object(reports, report)
    if rank == 0:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(reports, f, indent=1)
    dist.barrier()


if __name__ == "__main__":
    from dsrl.runtime.process_exit import leave

    main()
    leave(0)  # no interpreter finalization beside gloo threads (dsrl/runtime/process_exit.py)
