"""dsrl inside megatron-core 0.16.1 on CPU (gloo, test-only CUDA shim).

Multi-process: the finalized gradient of dsrl's one-call Megatron step equals a single-process
float64 reference of L_M (relative error <= 1e-6 per parameter tensor) for DP=2 with 2 and 3
micro-batches on the two replicas, TP=2, PP=2 (1F1B), CP=2 (per-token model, hand- and
dsrl-sharded) and TP=2 x DP=2, all four loss_agg modes and both reduction conventions. The same
launches show the failure modes the guards exist for: TP double counting (gradient x 1/2), two
forward_backward_func calls in one per-token step, and shard-local n_s under CP.
In-process: the CP cut matches megatron-core's get_batch_on_this_cp_rank, the scheduler driver,
and the ImportError message.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import REPO, free_port

pytest.importorskip("megatron.core")

TOL = 1e-6
MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def torchrun(script: str, nprocs: int, args: list[str], timeout: float = 400) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nprocs),
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()), script, *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
        )
    return proc


def _run_suite(tmp_path, suite: str, nprocs: int) -> dict:
    out = tmp_path / f"{suite}.json"
    torchrun("tests/megatron_worker.py", nprocs, ["--suite", suite, "--out", str(out)])
    return json.loads(out.read_text())


def _check_exact(cases: list[dict], layout: str, n: int) -> None:
    exact = [c for c in cases if c["layout"] == layout and c["expect"] == "exact"]
    assert len(exact) == n, [c["layout"] for c in cases]
    assert {(c["convention"], c["mode"]) for c in exact} >= {(v, m) for v in ("per_token", "average") for m in MODES}
    worst = max(exact, key=lambda c: c["error"])
    assert worst["error"] <= TOL, worst


def test_megatron_dp_tp_pp_cp_exact_and_guards(tmp_path):
    res = _run_suite(tmp_path, "main", 2)
    cases, checks = res["cases"], res["checks"]
    for layout in ("dp2", "tp2", "pp2", "cp2/dsrl_shard", "cp2/hand_shard"):
        _check_exact(cases, layout, 8)
    # DP=2 ran 2 and 3 micro-batches on the two replicas: the filler made both run 3.
    dp = [c for c in cases if c["layout"] == "dp2" and c["expect"] == "exact"]
    assert all(c["result"]["micro_batches"] == 3 for c in dp)
    assert {c["result"]["filler_micro_batches"] for c in dp} <= {0, 1}

    # TP double count: counting over the whole world (TP peers included) halves the gradient.
    (tp_wrong,) = [c for c in cases if c["expect"] == "ratio:0.5"]
    assert abs(tp_wrong["ratio"] - 0.5) < 1e-6, tp_wrong
    assert "tensor-parallel peers" in checks["err/tp_world_count_group"]

    # Two forward_backward_func calls per step: refused by dsrl's guard; without it, wrong.
    assert checks["err/two_calls_guarded"].startswith("RuntimeError: finalize_model_grads ran twice")
    (two,) = [c for c in cases if c["expect"] == "wrong:two_calls"]
    assert two["error"] > 0.1, two

    # CP: counts over DP x CP equal the whole-sequence counts; shard-local n_s is wrong.
    assert checks["cp2/per_token/counts"][:2] == checks["cp2/whole_counts"]
    for c in cases:
        if c["expect"] == "wrong:shard_local_n_s":
            assert c["error"] > 0.1, c

    # Construction checks name the problem.
    assert "DDP was built while calculate_per_token_loss was still False" in checks["err/flag_set_after_ddp"]
    assert "average_in_collective=True" in checks["err/average_in_collective"]
    assert checks["err/average_with_flag"].startswith("ValueError: convention='average' needs")
    assert checks["err/not_ddp"].startswith("TypeError")
    assert "never advanced per micro-batch" in checks["err/bad_unit"]

    # Scheduler: once per optimizer step whatever the micro-batch count; exact resume; samples unit.
    assert checks["sched/steps_positions"] == [1, 2, 3]
    assert checks["sched/resumed_position"] == 3 and checks["sched/resumed_lr_matches"]
    assert checks["sched/samples_position"] == sum(checks["sched/samples_seen"]) == 10 + 6
    for layout in ("dp2", "tp2", "pp2"):
        for conv in ("per_token", "average"):
            assert checks[f"{layout}/{conv}/scheduler_position"] == checks[f"{layout}/{conv}/optimizer_steps"] == 4


def test_megatron_tp2_dp2_exact(tmp_path):
    res = _run_suite(tmp_path, "tp2dp2", 4)
    _check_exact(res["cases"], "tp2dp2", 8)


@pytest.mark.parametrize("layout,args", [
    ("pp=2", ["--pp", "2", "--convention", "average", "--loss_agg", "seq-mean-token-mean"]),
    ("tp=2", ["--tp", "2"]),
])
def test_train_megatron_example(layout, args):
    proc = torchrun("launch/train_megatron.py", 2, args)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("[dsrl]")]
    assert layout in lines[0] and lines[-1].startswith("[dsrl] done: 4 optimizer steps, 0 skipped"), proc.stdout


# -- in-process --------------------------------------------------------------------------------


@pytest.mark.parametrize("cp", [1, 2, 3])
def test_cp_cut_matches_megatron_and_keeps_whole_counts(monkeypatch, cp):
    from megatron.core import parallel_state as ps
    from megatron.core.utils import get_batch_on_this_cp_rank

    from dsrl.loss import sequence_valid_tokens
    from dsrl.megatron import shard_for_context_parallel, unshard_from_context_parallel

    g = torch.Generator().manual_seed(cp)
    s = 12 * cp
    micro = {"tokens": torch.randint(0, 50, (2, s), generator=g), "loss_mask": (torch.rand(2, s, generator=g) > 0.4),
             "advantages": torch.randn(2, generator=g)}
    micro["loss_mask"][1] = False  # a fully masked sequence
    whole_n = sequence_valid_tokens(micro)
    shards = [shard_for_context_parallel(micro, cp, r) for r in range(cp)]
    for r, sh in enumerate(shards):
        monkeypatch.setattr(ps, "get_context_parallel_world_size", lambda cp=cp: cp)
        monkeypatch.setattr(ps, "get_context_parallel_rank", lambda r=r: r)
        theirs = get_batch_on_this_cp_rank({"tokens": micro["tokens"].clone(), "loss_mask": micro["loss_mask"]})
        assert torch.equal(sh["tokens"], theirs["tokens"]) and torch.equal(sh["loss_mask"], theirs["loss_mask"])
        assert torch.equal(sh["seq_valid_tokens"].double(), whole_n)
        assert torch.equal(sh["advantages"], micro["advantages"])
    assert torch.equal(unshard_from_context_parallel([sh["tokens"] for sh in shards]), micro["tokens"])
    assert sum(int(sh["loss_mask"].sum()) for sh in shards) == int(micro["loss_mask"].sum())
    if cp > 1:
        with pytest.raises(ValueError, match="multiple of"):
            shard_for_context_parallel({"loss_mask": torch.ones(1, 2 * cp + 1)}, cp, 0)
        padded = shard_for_context_parallel({"loss_mask": torch.ones(1, 2 * cp + 1)}, cp, 0, pad=True)
        assert padded["loss_mask"].shape[1] == 4 and int(padded["seq_valid_tokens"]) == 2 * cp + 1


def test_scheduler_driver_unit_success_and_resume():
    from dsrl.megatron import SchedulerDriver, build_param_scheduler

    def fresh(unit: str = "optimizer_steps"):
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
        return opt, build_param_scheduler(opt, total_optimizer_steps=10, max_lr=1.0, min_lr=0.1, warmup_steps=2,
                                          unit=unit, samples_per_step=8)

    opt, sched = fresh()
    drv = SchedulerDriver(sched)
    assert drv.after_optimizer_step(False, 8) == 0 and drv.position == 0  # skipped update: no advance
    for _ in range(3):
        drv.after_optimizer_step(True, 8)
    assert drv.position == 3
    state = drv.state_dict()
    opt2, sched2 = fresh()
    sched2.step(increment=4)
    drv2 = SchedulerDriver(sched2)
    drv2.load_state_dict(state)
    drv2.load_state_dict(state)
    assert drv2.position == 3 and opt2.param_groups[0]["lr"] == pytest.approx(opt.param_groups[0]["lr"])
    _, ssched = fresh("samples")
    sdrv = SchedulerDriver(ssched, "samples")
    assert ssched.lr_decay_steps == 80 and ssched.lr_warmup_steps == 16
    sdrv.after_optimizer_step(True, 7)
    assert sdrv.position == 7
    with pytest.raises(ValueError, match="counts 'optimizer_steps'"):
        sdrv.load_state_dict(state)


def test_missing_megatron_names_the_extra(monkeypatch):
    from dsrl.megatron import require_megatron

    monkeypatch.setitem(sys.modules, "megatron", None)
    monkeypatch.setitem(sys.modules, "megatron.core", None)
    with pytest.raises(ImportError, match=r"pip install 'dsrl\[megatron\]'"):
        require_megatron()
