"""dsrl.backends.megatron in one process: the CP cut matches megatron-core's get_batch_on_this_cp_rank, the
scheduler driver, and the ImportError message."""

from __future__ import annotations

import inspect
import sys

import pytest
import torch

pytest.importorskip("megatron.core")


@pytest.mark.parametrize("cp", [1, 2, 3])
def test_cp_cut_matches_megatron_and_keeps_whole_counts(monkeypatch, cp):
    from megatron.core import parallel_state as ps
    from megatron.core.utils import get_batch_on_this_cp_rank

    from dsrl.backends.megatron import shard_for_context_parallel, unshard_from_context_parallel
    from dsrl.core.weights import sequence_valid_tokens

    g = torch.Generator().manual_seed(cp)
    s = 12 * cp
    micro = {"tokens": torch.randint(0, 50, (2, s), generator=g), "loss_mask": (torch.rand(2, s, generator=g) > 0.4),
             "advantages": torch.randn(2, generator=g)}
    micro["loss_mask"][1] = False  # a fully masked sequence
    whole_n = sequence_valid_tokens(micro)
    shards = [shard_for_context_parallel(micro, cp, r) for r in range(cp)]
    # megatron-core >= 0.18 takes is_hybrid_cp and asks torch.distributed for the CP group's size and rank
    takes_hybrid = "is_hybrid_cp" in inspect.signature(get_batch_on_this_cp_rank).parameters
    hybrid = {"is_hybrid_cp": False} if takes_hybrid else {}
    for r, sh in enumerate(shards):
        monkeypatch.setattr(ps, "get_context_parallel_world_size", lambda cp=cp: cp)
        monkeypatch.setattr(ps, "get_context_parallel_rank", lambda r=r: r)
        monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None, cp=cp: cp)
        monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None, r=r: r)
        theirs = get_batch_on_this_cp_rank({"tokens": micro["tokens"].clone(), "loss_mask": micro["loss_mask"]},
                                           **hybrid)
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
    from dsrl.backends.megatron import SchedulerDriver, build_param_scheduler

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
    from dsrl.backends.megatron import require_megatron

    monkeypatch.setitem(sys.modules, "megatron", None)
    monkeypatch.setitem(sys.modules, "megatron.core", None)
    with pytest.raises(ImportError, match=r"pip install -e '.\[megatron\]'"):
        require_megatron()
