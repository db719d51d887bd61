"""The phase fields of a rollout row over real ranks (2 processes, gloo): seconds and token counts are summed then
divided by the world size (the mean over ranks, as ``rollout_s``), peaks are the maximum over ranks, and a phase
whose peak only one rank knows keeps that rank's value. Per-rank values are planted so that sum, mean and max all
differ; the phase fields of real training jobs are checked in test_trainer.py and test_multiturn.py."""

from __future__ import annotations

import json
import os
import sys

import torch.multiprocessing as mp
from conftest import REPO, free_port


def _rank(rank: int, world: int, port: int, out: str) -> None:
    sys.path.insert(0, str(REPO))
    import torch.distributed as dist

    from dsrl.runtime.phases import PhaseTotals, phase_record

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    t = PhaseTotals()
    t.seconds.update(generate=1.0 + rank, train=10.0 * (rank + 1))
    t.runs.update(generate=1, train=1, reward=rank)  # reward ran on rank 1 only
    t.peak_mib.update(generate=100.0 * (rank + 1), train=500.0 - 100 * rank, reward=7.0 if rank else None)
    t.generated_tokens, t.trained_tokens = 30.0 * (rank + 1), 60.0
    row = phase_record(t.reduced("cpu"), world)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(row, f)
    dist.barrier()
    dist.destroy_process_group()


def test_phase_fields_are_means_and_maxima_over_ranks(tmp_path):
    mp.spawn(_rank, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    rows = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert rows[0] == rows[1]  # every rank computes the same row
    row = rows[0]
    assert row["phase_generate_s"] == 1.5 and row["phase_train_s"] == 15.0 and row["phase_reward_s"] == 0.0
    assert row["peak_generate_mib"] == 200.0 and row["peak_train_mib"] == 500.0 and row["peak_reward_mib"] == 7.0
    assert row["peak_mib"] == 500.0
    assert row["generate_tokens_per_s"] == 90.0 / 1.5 and row["train_sequence_tokens_per_s"] == 120.0 / 15.0
    assert "phase_ref_logprobs_s" not in row
