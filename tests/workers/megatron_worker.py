"""Multi-process worker for the Megatron tests (CPU, gloo, with the test-only CUDA shim).

    python -m torch.distributed.run --nproc_per_node 2 tests/workers/megatron_worker.py --suite main --out r.json
    python -m torch.distributed.run --nproc_per_node 4 tests/workers/megatron_worker.py --suite tp2dp2 --out r.json

Every case runs dsrl's real Megatron step (one forward_backward_func call, DDP, finalize, optimizer,
scheduler), gathers the finalized gradient into one unsharded state on rank 0, and compares it with
a single-process float64 reference of L_M. Rank 0 writes one JSON with per-case errors.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "launch"))
import megatron_cpu_shim  # noqa: E402

megatron_cpu_shim.install()

import megatron_common as mc  # noqa: E402
from megatron_cp import run_cp_suite  # noqa: E402

from dsrl.backends.megatron import MegatronRLStep  # noqa: E402
from dsrl.config.names import LOSS_AGG_MODES  # noqa: E402

CONVENTIONS = ("per_token", "average")


class Recorder:
    """Collects (params, grads, data, expectation) per case on rank 0; references come later."""

    def __init__(self) -> None:
        self.cases: list[dict[str, Any]] = []
        self.checks: dict[str, Any] = {}

    def add(self, layout: str, convention: str, mode: str, params: dict, grads: dict, micros: list[dict],
            expect: str = "exact", result: dict | None = None, fused: bool = False) -> None:
        if dist.get_rank() == 0:
            self.cases.append({"layout": layout, "convention": convention, "mode": mode, "params": params,
                               "grads": grads, "micros": micros, "expect": expect, "fused": fused,
                               "result": {k: v for k, v in (result or {}).items() if isinstance(v, (int, float))}})


def _init_layout(tp: int = 1, pp: int = 1, cp: int = 1) -> None:
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 context_parallel_size=cp)


def _expect_error(fn: Any) -> str:
    try:
        fn()
    except (ValueError, TypeError, RuntimeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "NO ERROR"


def run_equivalence(rec: Recorder, layout: str, counts: list[int], seed: int) -> None:
    """Both conventions x all four modes; counts[r] micro-batches on data-parallel replica r; the scheduler's
    position and the optimizer steps of each convention's step recorded."""
    steps = _train_every_mode(rec, layout, counts, seed, mc.gpt_forward, mc.ppo_loss, CONVENTIONS, LOSS_AGG_MODES)
    for conv, step in steps.items():
        rec.checks[f"{layout}/{conv}/scheduler_position"] = step.driver.position
        rec.checks[f"{layout}/{conv}/optimizer_steps"] = step.optimizer_steps


def run_fused(rec: Recorder, layout: str, counts: list[int], seed: int, *, vocab_parallel: bool = True,
              conventions: tuple[str, ...] = CONVENTIONS, modes: tuple[str, ...] = LOSS_AGG_MODES,
              expect: str = "exact", sequence_parallel: bool = False) -> None:
    """The PPO loss with an entropy bonus on log-probs from the vocabulary-parallel output layer fused into dsrl's
    tiled log-softmax (mc.gpt_fused_forward); the reference: the model's full logits, a plain float64 log-softmax.
    ``vocab_parallel=False`` is the planted bug (each rank's slice taken for the whole vocabulary)."""
    import functools

    forward = functools.partial(mc.gpt_fused_forward, vocab_parallel=vocab_parallel)
    _train_every_mode(rec, layout, counts, seed, forward, mc.fused_ppo_loss, conventions, modes,
                      sequence_parallel=sequence_parallel, expect=expect, fused=True)


def _train_every_mode(rec: Recorder, layout: str, counts: list[int], seed: int, forward, loss,
                      conventions: tuple[str, ...], modes: tuple[str, ...], sequence_parallel: bool = False,
                      **add_options) -> dict[str, Any]:
    """For each convention a fresh model and MegatronRLStep, one step per loss mode on this replica's
    micro-batches (counts[r] on replica r), each recorded against the whole mini-batch; returns each convention's
    step."""
    from megatron.core import parallel_state as ps

    replicas = mc.make_replicas(seed, counts)
    all_micros = [mb for rep in replicas for mb in rep]
    mine = replicas[ps.get_data_parallel_rank()]
    bsz = sum(mb["loss_mask"].shape[0] for mb in all_micros)
    steps = {}
    for conv in conventions:
        ddp, opt, sched = mc.build_parallel(conv == "per_token", sequence_parallel=sequence_parallel)
        step = MegatronRLStep(ddp, opt, sched, convention=conv, mini_batch_size=bsz,
                              loss_agg_norm_length=mc.NORM_LENGTH)
        for mode in modes:
            step.loss_agg = mode
            params = mc.gather_full(ddp, "param")
            res = step.train_step(mine, forward, loss)
            rec.add(layout, conv, mode, params, mc.gather_full(ddp, "grad"), all_micros, result=res, **add_options)
        steps[conv] = step
    return steps


def run_dp_extras(rec: Recorder) -> None:
    """DP=2: construction errors, finalize-twice refusal, the naive two-call result, scheduler resume."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.utils import get_model_config

    from dsrl.backends.megatron import build_param_scheduler

    c = rec.checks
    ddp, opt, sched = mc.build_parallel(per_token=False, flip_flag_after_ddp=True)
    c["err/flag_set_after_ddp"] = _expect_error(lambda: MegatronRLStep(ddp, opt, sched, convention="per_token"))
    ddp, opt, sched = mc.build_parallel(per_token=False, ddp_kwargs={"average_in_collective": True},
                                        flip_flag_after_ddp=True)
    c["err/average_in_collective"] = _expect_error(lambda: MegatronRLStep(ddp, opt, sched, convention="per_token"))
    ddp, opt, sched = mc.build_parallel(per_token=True)
    c["err/average_with_flag"] = _expect_error(lambda: MegatronRLStep(ddp, opt, sched, convention="average"))
    c["err/not_ddp"] = _expect_error(lambda: MegatronRLStep(ddp.module, opt, sched, convention="per_token"))
    c["err/bad_unit"] = _expect_error(lambda: MegatronRLStep(ddp, opt, sched, schedule_unit="micro_batches"))
    # megatron-core's example loop keeps a torch Adam: refused at construction, before any forward (it used to fail
    # after the forward/backward, unpacking the None that torch's step returns).
    torch_adam = torch.optim.Adam(ddp.parameters(), lr=1e-4)
    c["err/torch_optimizer"] = _expect_error(lambda: MegatronRLStep(
        ddp, torch_adam, build_param_scheduler(torch_adam, total_optimizer_steps=4, max_lr=1e-4, min_lr=0.0),
        convention="per_token"))
    # Dropout left at Megatron's default: a warning at construction (exactness needs a deterministic forward).
    warned: list[str] = []
    catch = logging.Handler()
    catch.emit = lambda record: warned.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("dsrl.backends.megatron").addHandler(catch)
    ddp_d, opt_d, sched_d = mc.build_parallel(per_token=True)
    MegatronRLStep(ddp_d, opt_d, sched_d, convention="per_token")
    get_model_config(ddp_d).hidden_dropout = 0.1
    MegatronRLStep(ddp_d, opt_d, sched_d, convention="per_token")
    logging.getLogger("dsrl.backends.megatron").removeHandler(catch)
    c["warn/dropout"] = warned

    # Two forward_backward_func calls in one step, per-token mode.
    replicas = mc.make_replicas(7, [2, 3])
    all_micros = [mb for rep in replicas for mb in rep]
    mine = replicas[ps.get_data_parallel_rank()]
    step = MegatronRLStep(ddp, opt, sched, convention="per_token")
    step.train_step(mine, mc.gpt_forward, mc.ppo_loss)
    cfg = step.config

    def native_step(it: Any, model: Any) -> Any:
        mb = next(it)
        out = mc.gpt_forward(model, mb)

        def loss_func(o: torch.Tensor) -> Any:
            per_token, _ = mc.ppo_loss(o, mb)
            m = mb["loss_mask"]
            return (per_token * m).sum(), m.sum().to(torch.int), {}

        return out, loss_func

    def two_calls() -> None:
        for chunk in (mine[:1], mine[1:]):
            get_forward_backward_func()(forward_step_func=native_step, data_iterator=iter(chunk), model=ddp,
                                        num_microbatches=len(chunk), seq_length=mc.SEQ, micro_batch_size=2)

    ddp.zero_grad_buffer()
    c["err/two_calls_guarded"] = _expect_error(two_calls)
    guard = cfg.finalize_model_grads_func
    cfg.finalize_model_grads_func = finalize_model_grads  # what happens without dsrl's guard
    params = mc.gather_full(ddp, "param")
    ddp.zero_grad_buffer()
    two_calls()
    rec.add("dp2", "per_token", "token-mean", params, mc.gather_full(ddp, "grad"), all_micros, expect="wrong:two_calls")
    cfg.finalize_model_grads_func = guard

    # Scheduler: optimizer steps (never per micro-batch) and samples; exact resume.
    ddp, opt, sched = mc.build_parallel(per_token=True)
    step = MegatronRLStep(ddp, opt, sched, convention="per_token")
    lrs, positions = [], []
    for m in ([2, 3], [1, 1], [3, 2]):
        reps = mc.make_replicas(11 + m[0], m)
        res = step.train_step(reps[ps.get_data_parallel_rank()], mc.gpt_forward, mc.ppo_loss)
        lrs.append(res["lr"])
        positions.append(res["scheduler_position"])
    c["sched/steps_positions"] = positions
    c["sched/steps_lrs"] = lrs
    state = step.state_dict()
    fresh = build_param_scheduler(opt, total_optimizer_steps=20, max_lr=1e-4, warmup_steps=2)
    fresh.step(increment=5)  # a loop that already advanced it must not add on top
    step2 = MegatronRLStep(ddp, opt, fresh, convention="per_token")
    step2.load_state_dict(state)
    step2.load_state_dict(state)
    c["sched/resumed_position"] = step2.driver.position
    c["sched/resumed_lr_matches"] = abs(fresh.get_lr(opt.param_groups[0]) - sched.get_lr(opt.param_groups[0])) < 1e-15
    ssched = build_param_scheduler(opt, total_optimizer_steps=20, max_lr=1e-4, warmup_steps=2, unit="samples",
                                   samples_per_step=10)
    step3 = MegatronRLStep(ddp, opt, ssched, convention="per_token", schedule_unit="samples")
    samples = []
    for m in ([2, 3], [1, 2]):
        reps = mc.make_replicas(21 + m[0], m)
        samples.append(step3.train_step(reps[ps.get_data_parallel_rank()], mc.gpt_forward, mc.ppo_loss)["samples"])
    c["sched/samples_seen"] = samples
    c["sched/samples_position"] = step3.driver.position


def run_tp_double_count(rec: Recorder) -> None:
    """TP=2: counting over the whole world counts every token twice -> gradient x 1/2 (average)."""
    replicas = mc.make_replicas(5, [3])
    ddp, opt, sched = mc.build_parallel(per_token=False)
    world = dist.group.WORLD
    rec.checks["err/tp_world_count_group"] = _expect_error(
        lambda: MegatronRLStep(ddp, opt, sched, convention="average", count_group=world))
    step = MegatronRLStep(ddp, opt, sched, convention="average", count_group=world, check_count_group=False)
    params = mc.gather_full(ddp, "param")
    step.train_step(replicas[0], mc.gpt_forward, mc.ppo_loss)
    rec.add("tp2", "average", "token-mean", params, mc.gather_full(ddp, "grad"), replicas[0], expect="ratio:0.5")


def references(rec: Recorder) -> list[dict[str, Any]]:
    """Rank 0: float64 single-process reference for every recorded case (TP=PP=1 parallel state)."""
    out = []
    for case in rec.cases:
        model = mc.reference_gpt(case["params"])
        bsz = sum(mb["loss_mask"].shape[0] for mb in case["micros"])
        forward, loss = (mc.gpt_reference_stats, mc.fused_ppo_loss) if case["fused"] else (mc.gpt_forward, mc.ppo_loss)
        ref = mc.reference_grads(model, case["micros"], case["mode"], forward, loss, bsz)
        out.append({"layout": case["layout"], "convention": case["convention"], "mode": case["mode"],
                    "expect": case["expect"], "error": mc.relative_error(case["grads"], ref),
                    "ratio": mc.ratio_to_reference(case["grads"], ref), "result": case["result"]})
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--suite", choices=("main", "tp2dp2"), default="main")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    t0 = time.time()
    rec = Recorder()
    timings: dict[str, float] = {}
    if args.suite == "main":
        assert dist.get_world_size() == 2
        _init_layout()
        run_equivalence(rec, "dp2", [2, 3], seed=1)
        run_dp_extras(rec)
        timings["dp2"] = time.time() - t0
        _init_layout(tp=2)
        run_equivalence(rec, "tp2", [3], seed=2)
        run_tp_double_count(rec)
        run_fused(rec, "tp2/fused", [3], seed=6)
        run_fused(rec, "tp2/fused", [3], seed=6, vocab_parallel=False, conventions=("per_token",),
                  modes=("token-mean",), expect="wrong:unsharded")
        # megatron-core's sequence parallelism (dsrl's norms of the local spec, the fused layer gathering its input)
        run_fused(rec, "tp2_sp/fused", [3], seed=7, sequence_parallel=True)
        timings["tp2"] = time.time() - t0
        _init_layout(pp=2)
        run_equivalence(rec, "pp2", [3], seed=3)
        timings["pp2"] = time.time() - t0
        _init_layout(cp=2)
        cp_cases = run_cp_suite(rec.checks)
        timings["cp2"] = time.time() - t0
    else:
        assert dist.get_world_size() == 4
        _init_layout(tp=2)
        run_equivalence(rec, "tp2dp2", [2, 3], seed=4)
        run_fused(rec, "tp2dp2/fused", [2, 3], seed=8, conventions=("per_token",))
        cp_cases = []
        timings["tp2dp2"] = time.time() - t0
    _init_layout()
    if dist.get_rank() == 0:
        cases = references(rec) + cp_cases
        timings["references"] = time.time() - t0
        with open(args.out, "w") as f:
            json.dump({"cases": cases, "checks": rec.checks, "timings": timings}, f, indent=1)
    dist.barrier()
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    from dsrl.runtime.process_exit import leave

    main()
    leave(0)  # no interpreter finalization beside gloo threads (dsrl/runtime/process_exit.py)
