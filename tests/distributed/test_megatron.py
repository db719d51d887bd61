"""dsrl inside megatron-core (0.16.1-0.19.x) on CPU (gloo, test-only CUDA shim).

Multi-process: the finalized gradient of dsrl's one-call Megatron step equals a single-process
float64 reference of L_M (relative error <= 1e-6 per parameter tensor) for DP=2 with 2 and 3
micro-batches on the two replicas, TP=2, PP=2 (1F1B), CP=2 (per-token model, hand- and
dsrl-sharded) and TP=2 x DP=2, all four loss_agg modes and both reduction conventions; at TP=2 (and
TP=2 x DP=2) also with log-probs and entropy from dsrl's fused vocabulary-parallel output layer, against a
plain float64 log-softmax of the full logits. The same
launches show the failure modes the guards exist for: TP double counting (gradient x 1/2), two
forward_backward_func calls in one per-token step, shard-local n_s under CP, and a fused head that takes its
vocabulary slice for the whole vocabulary.
In-process: the CP cut matches megatron-core's get_batch_on_this_cp_rank, the scheduler driver,
and the ImportError message.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys

import pytest
from conftest import EXTENDED, REPO, free_port

pytest.importorskip("megatron.core")

TOL = 1e-6
MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def torchrun(script: str, nprocs: int, args: list[str], timeout: float = 400) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nprocs),
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()), script, *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
        )
    return proc


def _run_suite(tmp_path, suite: str, nprocs: int) -> dict:
    out = tmp_path / f"{suite}.json"
    torchrun("tests/workers/megatron_worker.py", nprocs, ["--suite", suite, "--out", str(out)])
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

    # dsrl's fused output layer at TP=2 (log-probs and entropy from the vocabulary-parallel head without logits,
    # dsrl.backends.megatron.fused_output_layer): exact against a plain float64 log-softmax of the full logits;
    # the planted bug (each rank's vocabulary slice taken for the whole vocabulary: no all-reduce) is wrong.
    _check_exact(cases, "tp2/fused", 8)
    # ... and under megatron-core's sequence parallelism (the positions split over the tensor group: dsrl's
    # sequence_parallel_spec norms, the fused layer gathering its input along the sequence)
    _check_exact(cases, "tp2_sp/fused", 8)
    (unsharded,) = [c for c in cases if c["expect"] == "wrong:unsharded"]
    assert unsharded["error"] > 0.1, unsharded

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
    assert checks["err/torch_optimizer"].startswith("TypeError: MegatronRLStep needs megatron-core's optimizer, not "
                                                    "torch.optim.adam.Adam"), checks["err/torch_optimizer"]
    (warning,) = checks["warn/dropout"]  # only the step built with hidden_dropout = 0.1
    assert "hidden_dropout = 0.1, attention_dropout = 0.0: dropout makes every forward random" in warning

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
    fused = [c for c in res["cases"] if c["layout"] == "tp2dp2/fused"]  # the fused vocabulary-parallel head
    assert len(fused) == 4 and max(c["error"] for c in fused) <= TOL, fused


def _docs_python_block(doc: str, heading: str) -> str:
    return re.search(rf"### {heading}\n.*?```python\n(.*?)```", doc, re.S).group(1)


def test_the_documented_loop_runs_as_written(tmp_path):
    """docs/megatron.md's complete loop, copied as a user would: its CPU preamble at the top and the shim beside it,
    on 2 data-parallel gloo ranks. It runs the plan's 4 optimizer steps with finite losses, the first at the
    scheduler's init_lr. (The loop it replaces used `plan` and `clipped_policy_loss` without importing them.)"""
    doc = (REPO / "docs" / "megatron.md").read_text()
    script = tmp_path / "my_rl_loop.py"
    script.write_text(_docs_python_block(doc, "Running on CPU") + "\n" + _docs_python_block(doc, "A complete loop"))
    shutil.copy(REPO / "launch" / "megatron_cpu_shim.py", tmp_path)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), str(script)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": str(REPO)}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    steps = re.findall(r"^optimizer step (\d+): loss ([-+.\de]+) over (\d+) tokens, grad norm \S+, lr (\S+)$",
                       proc.stdout, re.M)
    assert [int(s[0]) for s in steps] == [1, 2, 3, 4], proc.stdout[-3000:]
    assert all(math.isfinite(float(s[1])) and int(s[2]) > 0 for s in steps) and steps[0][3] == "1.00e-05"
    assert "dropout" not in proc.stdout + proc.stderr  # dropout is off: no warning


@pytest.mark.parametrize("layout,args", [
    ("pp=2", ["--pp", "2", "--convention", "average", "--loss_agg", "seq-mean-token-mean"]),
    ("tp=2", ["--tp", "2"]),
])
def test_train_megatron_example(layout, args):
    proc = torchrun("launch/train_megatron.py", 2, args)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("[dsrl]")]
    assert layout in lines[0] and lines[-1].startswith("[dsrl] done: 4 optimizer steps, 0 skipped"), proc.stdout


# -- in-process --------------------------------------------------------------------------------


SHIMMED_FROM_PRETRAINED = r"""
import sys, torch
sys.path.insert(0, sys.argv[1])
import megatron_cpu_shim
if sys.argv[3] == "planted":  # the shim before the fix: torch's device context learns its factories after the wrappers
    import torch.utils._device as device_context
    device_context._device_constructors = lambda: set()
megatron_cpu_shim.install()
from transformers import AutoModelForCausalLM
inv = AutoModelForCausalLM.from_pretrained(sys.argv[2], dtype=torch.float32).model.rotary_emb.inv_freq
print("INV", inv[:3].tolist())
"""


@pytest.mark.parametrize("planted", [False, pytest.param(True, marks=EXTENDED)])
def test_the_cpu_shim_leaves_from_pretrained_intact(tmp_path, planted):
    """With the CPU shim installed before transformers is imported (as launch/train.py on the Megatron engine does),
    from_pretrained still builds a Llama's rotary frequencies: torch's device context knows its own factory functions,
    not the shim's wrappers (planted: a context that recognises none of them leaves inv_freq garbage)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=2, rope_parameters={"rope_type": "default", "rope_theta": 50000.0})
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "llama")
    want = (1.0 / 50000.0 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))[:3].tolist()
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, "-c", SHIMMED_FROM_PRETRAINED, str(REPO / "launch"), str(tmp_path / "llama"),
                           "planted" if planted else "fixed"], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(re.search(r"^INV (.*)$", proc.stdout, re.M).group(1))
    assert (max(abs(a - b) for a, b in zip(got, want)) < 1e-6) != planted, (got, want)
