"""Ulysses sequence parallelism: exact updates on ZeRO-2 and ZeRO-3 (with and without reduce_scatter).

ZeRO-3 with reduce_scatter averages over the whole sequence-data-parallel group (an extra 1/sp
compared with the other stages, architecture §7); dsrl reads that from the engine and scales by
D = |seq_dp|. Without the correction the ZeRO-3 update would be half the reference (error 0.5)."""

from __future__ import annotations

import json

from conftest import launch


def test_ulysses_sp2_exact_on_zero2_and_zero3(tmp_path):
    out = tmp_path / "sp.json"
    launch(["tests/workers/sp_worker.py", "--out", str(out)], nprocs=2, timeout=600)
    results = json.loads(out.read_text())
    assert len(results) == 6
    for r in results:
        assert r["D"] == 1 and r["error"] <= 1e-6, r
        expected_scale = 2.0 if (r["stage"] == 3 and r["reduce_scatter"]) else 1.0
        assert r["grad_scale"] == expected_scale, r
