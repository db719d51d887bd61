"""bench/gpu/measure.py's memory tables (bench/gpu/memory_tables.py), rendered from results of the shape
bench/e2e.py's dsrl workers report on a GPU: dsrl plan against the measured peaks (within 15 % or not), the
training memory left as generation starts against the bf16 weights, offload and weight-sync seconds, the training
phase's MFU. The GPU round runs them for real; here each verdict is shown both ways."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench" / "gpu"))

from memory_tables import memory_section, peak_flops  # noqa: E402


def _side(peak_train: float, start: float, offload_s: float) -> dict:
    plan = {"generation": {"total_mib": 2000.0}, "logprobs": {"total_mib": 1500.0}, "training": {"total_mib": 12000.0}}
    summary = {"peak_generate_mb": 2100.0, "peak_logprobs_mb": 1400.0, "peak_train_mb": peak_train,
               "offload_s": offload_s, "reload_s": offload_s / 2, "weight_sync_s": 0.0, "train_phase_tok_s": 40000.0,
               "rollout_s": 10.0}
    return {"summary": summary, "plan_memory": plan, "params": 494_032_768, "weights_mib": 942.0,
            "device_name": "NVIDIA H200", "generation_start_mib": [13000.0, start, start],
            "weight_sync_probe": {"seconds": 0.004, "bytes": 988e6, "buckets": 2.0}}


def test_memory_tables_say_met_and_missed():
    results = {"auto": {"dsrl": _side(16000.0, 12500.0, 0.0), "dsrl-offload": _side(12500.0, 1000.0, 0.8)},
               "hf": {"dsrl": {"skipped": "dsrl runs auto in this part"}, "trl": {"summary": {"rollout_s": 9.0}}}}
    text = memory_section(results, gpu=True)
    lines = text.splitlines()
    row = next(x for x in lines if "| dsrl, offload_states" in x and "| training" in x)
    assert "12,000" in row and "12,500" in row and "1.04 (met)" in row  # within 15 %
    row = next(x for x in lines if x.startswith("| auto") and "| dsrl " in x and "| training" in x)
    assert "1.33 (missed)" in row
    left = [x for x in lines if "| 942 " in x]
    assert any("1.06 (<= 1.1: met)" in x for x in left) and any("13.27 (<= 1.1: missed)" in x for x in left)
    assert any("0.004 (942 MiB, 2 bucket(s); < 0.3 s: met)" in x for x in lines)
    mfu = 6 * 494_032_768 * 40000.0 / 989.4e12
    assert any(f"{mfu:.1%}" in x for x in lines), mfu
    assert any("| 0.800 " in x and "| 0.400 " in x for x in lines)


def test_without_a_gpu_or_a_dsrl_side_nothing_is_claimed():
    assert memory_section({"hf": {"trl": {"summary": {}}}}, gpu=True) == ""
    cpu = memory_section({"auto": {"dsrl": _side(16000.0, 12500.0, 0.0)}}, gpu=False)
    row = next(x for x in cpu.splitlines() if "| training" in x)
    assert [c.strip() for c in row.split("|")][4:7] == ["12,000", "-", "-"]  # CPU: the resident set is not comparable
    assert peak_flops("NVIDIA H100 PCIe") == 756.5e12 and peak_flops("NVIDIA H100 80GB HBM3") == 989.4e12
    assert peak_flops("cpu") is None
