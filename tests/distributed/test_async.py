"""Disaggregated generation (rollout.placement = "disaggregated", ARCHITECTURE §8) on 3 CPU ranks: 2 trainers and
1 generator under one ``deepspeed`` launch.

- k = 0 with TIS: the run is bitwise the colocated run on 2 ranks (every step's loss, gradient norm and LR, every
  rollout's behavior/trainer mismatch, and every weight), also when the generator is killed with SIGKILL mid-run
  and the job is resumed with ``--resume auto`` (the trainers commit a checkpoint of their side when the generator
  is gone, and name it); the same under ZeRO-3 (the publish gathers the partitioned weights once) and with LoRA
  (the generator carries the adapters; stopped and resumed);
- k = 1: samples are one version stale (staleness 1, behavior/trainer mismatch measured and corrected with
  TIS), and after a trainer is killed with SIGKILL (named by role, rank and host) and the job resumed, the prompt
  stream and the versions continue without gap or repeat (rollouts 1..R once each, the same prompt-epoch count as
  an uninterrupted run, staleness <= 1, the first resumed rollout generated from the checkpoint's weights);
- a generator killed while the trainers are busy (the launcher's SIGTERM reaches them first) is named;
- a generator that hangs (SIGSTOP) is named with its role, rank and host within the collective bound, the
  trainer side commits a checkpoint, and the job ends soon after, with dsrl's status 1;
- a configuration error of either side (the trainers' plan, vLLM missing on the generator) is printed once, by
  rank 0, with every other problem, before any work.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import torch
from conftest import EXTENDED, REPO, free_port, launch, node_launcher, write_json

BASE = json.loads((REPO / "configs" / "tiny_grpo_cpu.json").read_text())
ARGS = ["--dsrl.run.rollouts", "6", "--dsrl.sft.steps", "4", "--dsrl.run.save_every", "2",
        "--dsrl.run.keep_last", "4", "--dsrl.run.progress_bar", "false", "--dsrl.batch.prompts_per_rollout", "8",
        "--dsrl.batch.mini_batch_size", "32"]
TIMED = ("_s", "tokens_per_s", "generator_idle_frac", "trainer_wait", "publish", "generator_s", "_mib",
         "weight_sync_bytes", "weight_sync_buckets")  # a colocated hf run syncs nothing: the weights are shared
TIS = {"mode": "tis", "level": "token", "cap": 2.0}  # the shipped async config's correction: it uses mu in the loss


def _run_file(tmp: Path, disaggregated: bool, k: int = 0, base: dict | None = None, zero: int | None = None,
              **rollout_correction) -> Path:
    raw = json.loads(json.dumps(base or BASE))
    raw["scheduler"]["params"]["warmup_num_steps"] = 2
    if zero is not None:
        raw["zero_optimization"]["stage"] = zero
    if rollout_correction:
        raw["dsrl"]["algorithm"]["rollout_correction"] = rollout_correction
    if disaggregated:
        raw["dsrl"]["rollout"].update(placement="disaggregated", generator_ranks=1)
        raw["dsrl"]["algorithm"]["max_staleness"] = k
    return write_json(tmp / f"run_{int(disaggregated)}_{k}_{zero}.json", raw)


def _same_rows(colocated: Path, split: Path) -> None:
    """Every sft, step and rollout row equal bit for bit (timings aside), the measured mismatch included: the
    generator computes the behavior log-probs with the colocated replica's kernels."""
    for event in ("sft", "step", "rollout"):
        want, got = _rows(colocated, event), _rows(split, event)
        assert got == want, (event, [(a, b) for a, b in zip(want, got) if a != b][:1])


def _rows(out: Path, event: str) -> list[dict]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.endswith(TIMED)} for r in rows if r["event"] == event]


def _start(args: list[str], nprocs: int, env: dict | None = None) -> subprocess.Popen:
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p), **(env or {})}
    cmd = [*node_launcher(nprocs, free_port()), "launch/train.py", *args]
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _rank_process(job: subprocess.Popen, rank: int) -> psutil.Process:
    for p in psutil.Process(job.pid).children(recursive=True):
        if f"--local_rank={rank}" in " ".join(p.cmdline()):
            return p
    raise AssertionError(f"no rank {rank} process")


def _after_rollout(job: subprocess.Popen, out: Path, rollout: int, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        metrics = out / "metrics.jsonl"
        if metrics.exists() and any(json.loads(x).get("rollout") == rollout and json.loads(x)["event"] == "rollout"
                                    for x in metrics.read_text().splitlines() if x.strip()):
            return
        if job.poll() is not None:
            raise AssertionError(f"the job ended before rollout {rollout}:\n{job.stdout.read()[-3000:]}")
        time.sleep(0.2)
    raise AssertionError(f"no rollout {rollout} within {timeout} s")


def _committed(job: subprocess.Popen, out: Path, timeout: float = 300) -> None:
    """Wait until the run has a committed checkpoint (``checkpoints/latest``)."""
    deadline = time.monotonic() + timeout
    while not (out / "checkpoints" / "latest").exists():
        if job.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"no committed checkpoint:\n{job.stdout.read()[-3000:] if job.poll() else ''}")
        time.sleep(0.1)


def _finish(job: subprocess.Popen, timeout: float = 120) -> tuple[int, str]:
    try:
        out, _ = job.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)
        out, _ = job.communicate()
        raise AssertionError(f"the job did not end:\n{out[-3000:]}") from None
    return job.returncode, out


def _weights(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(out / "final_model" / "model.safetensors"))


@EXTENDED
def test_k0_is_bitwise_the_colocated_run_also_after_a_killed_generator(tmp_path):
    colocated, split = tmp_path / "colocated", tmp_path / "split"
    launch(["launch/train.py", "--ds_config", str(_run_file(tmp_path, False, **TIS)), *ARGS, "--dsrl.run.output_dir",
            str(colocated)], nprocs=2, timeout=600)
    # no periodic checkpoint: the one resumed from is the trainer side's commit when the generator was lost, taken
    # after the next rollout's prompts were drawn (it must hold the stream as it was before that draw)
    run = ["--ds_config", str(_run_file(tmp_path, True, k=0, **TIS)), *ARGS, "--dsrl.run.output_dir", str(split),
           "--dsrl.run.save_every", "1000"]
    job = _start(run, nprocs=3)
    _after_rollout(job, split, 2)  # a tiny rollout takes well under a second on a fast machine: kill early
    _rank_process(job, 2).kill()  # the generator, SIGKILL
    code, text = _finish(job)
    assert code != 0, text[-2000:]
    assert "generator 0 (rank 2 on host" in text, text[-3000:]  # named, whether the trainers waited or trained
    trained = max(r["rollout"] for r in _rows(split, "rollout"))
    assert 2 <= trained < 6, trained
    latest = (split / "checkpoints" / "latest").read_text().strip()
    assert latest == f"rollout{trained}", (latest, trained)  # the trainer side's state when it stopped
    launch(["launch/train.py", *run, "--resume", "auto"], nprocs=3, timeout=600)
    _same_rows(colocated, split)
    a, b = _weights(colocated), _weights(split)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


LORA = json.loads((REPO / "configs" / "tiny_grpo_lora_cpu.json").read_text())
SHORT = ["--dsrl.run.rollouts", "3", "--dsrl.sft.steps", "4", "--dsrl.run.progress_bar", "false",
         "--dsrl.batch.prompts_per_rollout", "8", "--dsrl.batch.mini_batch_size", "32"]


@EXTENDED
@pytest.mark.parametrize("cell", ["zero3", "lora"])
def test_k0_is_bitwise_the_colocated_run_under_zero3_and_with_lora(tmp_path, cell):
    """ZeRO-3 trainers publish weights gathered once (their module holds empty shards); a LoRA generator holds the
    adapters and receives them with the base weights, also on resume (the lora run stops after 2 rollouts). The
    weights travel in buckets of 10 KiB (dsrl.memory.weight_sync_bucket_mib; the tiny policy is ~0.5 MiB: dozens of
    buckets, tensors split across them) and land bit for bit: the runs are the colocated one."""
    base, zero = (LORA, 2) if cell == "lora" else (BASE, 3)
    colocated, split = tmp_path / "colocated", tmp_path / "split"
    launch(["launch/train.py", "--ds_config", str(_run_file(tmp_path, False, base=base, zero=zero, **TIS)), *SHORT,
            "--dsrl.run.output_dir", str(colocated)], nprocs=2, timeout=600)
    run = ["--ds_config", str(_run_file(tmp_path, True, k=0, base=base, zero=zero, **TIS)), *SHORT,
           "--dsrl.run.output_dir", str(split), "--dsrl.memory.weight_sync_bucket_mib", "0.01"]
    if cell == "lora":
        launch(["launch/train.py", *run, "--dsrl.run.stop_after_rollouts", "2"], nprocs=3, timeout=600)
        run += ["--resume", "auto"]
    launch(["launch/train.py", *run], nprocs=3, timeout=600)
    _same_rows(colocated, split)
    rows = _rows_all(split, "rollout")
    assert [r["rollout"] for r in rows] == [1, 2, 3]
    assert all(r["weight_sync_buckets"] > 10 and r["weight_sync_bytes"] > r["weight_sync_buckets"] * 5000
               for r in rows), rows  # many buckets, each close to the 10 KiB bound
    assert all(r["weight_sync_buckets"] == 0 for r in _rows_all(colocated, "rollout"))


def _rows_all(out: Path, event: str) -> list[dict]:
    return [r for r in (json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()) if r["event"] == event]


@EXTENDED
def test_k1_runs_stale_and_resumes_after_a_killed_trainer_without_gap_or_repeat(tmp_path):
    cut = tmp_path / "killed"
    run_file = _run_file(tmp_path, True, k=1, mode="tis", level="token", cap=2.0)
    job = _start(["--ds_config", str(run_file), *ARGS, "--dsrl.run.output_dir", str(cut)], nprocs=3)
    _after_rollout(job, cut, 2)  # a tiny rollout takes well under a second on a fast machine: kill early
    _committed(job, cut)  # (rollout 2's periodic checkpoint: a kill during its save leaves none to resume from)
    before = _rows(cut, "rollout")
    assert [r["staleness_max"] for r in before[:2]] == [0, 1]  # rollout r is generated from version r - 1
    assert before[1]["rollout_logprob_abs_diff"] > 1e-4  # stale weights: a measured mismatch
    _rank_process(job, 1).kill()  # a trainer, SIGKILL
    code, text = _finish(job)
    assert code != 0
    assert "trainer 1 (rank 1 on host" in text and "has ended" in text, text[-3000:]
    resumed_from = (cut / "checkpoints" / "latest").read_text().strip()
    launch(["launch/train.py", "--ds_config", str(run_file), *ARGS, "--dsrl.run.output_dir", str(cut), "--resume",
            "auto"], nprocs=3, timeout=600)
    got = _rows(cut, "rollout")
    assert [r["rollout"] for r in got] == [1, 2, 3, 4, 5, 6]  # each once: no gap, no repeat
    dataset = BASE["dsrl"]["data"]["size"]
    assert [r["prompt_epochs"] for r in got] == [8 * (i + 1) / dataset for i in range(6)]  # the stream continues
    first = int(resumed_from.removeprefix("rollout"))  # the first resumed rollout is generated from the checkpoint
    assert 2 <= first < 6, first
    assert [r["staleness_max"] for r in got] == [0, 1, 1, 1, 1, 1][:first] + [0] + [1] * (5 - first), (first, got)
    assert all(r["rollout_logprob_abs_diff"] > 1e-4 for r in got if r["staleness_max"])  # stale: measured mismatch


@EXTENDED
def test_a_generator_killed_while_the_trainers_are_busy_is_named(tmp_path):
    """The trainers score with a reward function that takes 3 s per call: the launcher's SIGTERM (sent as soon as
    the generator died) reaches them while they work, before they wait for the generator's next samples."""
    out, mark = tmp_path / "out", tmp_path / "reward_calls"
    job = _start(["--ds_config", str(_run_file(tmp_path, True, k=1, **TIS)), *ARGS, "--dsrl.run.output_dir", str(out),
                  "--dsrl.data.reward_fn", "tests/data/reward_fixture.py:slow_exact_batched", "--dsrl.run.rollouts",
                  "40"], nprocs=3, env={"DSRL_TEST_REWARD_MARK": str(mark)})
    _after_rollout(job, out, 2)
    deadline = time.monotonic() + 300  # a trainer has started scoring rollout 3 (2 trainers x 2 rollouts before)
    while not (mark.exists() and len(mark.read_text().splitlines()) > 4) and time.monotonic() < deadline:
        time.sleep(0.02)
    _rank_process(job, 2).kill()  # the generator waits for version 3 (k = 1): it is killed while nobody talks to it
    code, text = _finish(job)
    assert code != 0, text[-3000:]
    assert "dsrl: error: generator 0 (rank 2 on host" in text and "has ended (its process is gone)" in text, \
        text[-3000:]
    latest = (out / "checkpoints" / "latest").read_text().strip()
    assert latest == f"rollout{max(r['rollout'] for r in _rows(out, 'rollout'))}"


@EXTENDED
@pytest.mark.parametrize("bound", [20])
def test_a_hung_generator_is_named_and_the_job_ends_within_its_bound(tmp_path, bound):
    out = tmp_path / "out"
    job = _start(["--ds_config", str(_run_file(tmp_path, True, k=0)), *ARGS, "--dsrl.run.output_dir", str(out),
                  "--dsrl.run.collective_timeout_s", str(bound), "--dsrl.data.reward_timeout_s", "10",
                  "--dsrl.run.rollouts", "40"], nprocs=3)  # cannot finish before the SIGSTOP lands
    _after_rollout(job, out, 2)
    generator = _rank_process(job, 2)
    generator.suspend()  # SIGSTOP: alive, silent; nobody here ends it
    t0 = time.monotonic()
    try:
        # named at 0.9 x bound, then a checkpoint; the trainers end the frozen generator after they exit, so the
        # launcher (whose SIGTERM a stopped process cannot act on) does not wait 30 s for it
        code, text = _finish(job, timeout=bound * 6)
        wall = time.monotonic() - t0
    finally:
        with contextlib.suppress(psutil.NoSuchProcess):
            generator.kill()
    assert code == 1, (code, text[-3000:])  # dsrl's status, not the killed generator's
    assert wall < bound * 2.5, (wall, text[-3000:])  # 0.9 x bound + a checkpoint, not + 30 s + 30 s
    last = max(r["rollout"] for r in _rows(out, "rollout"))
    assert ("generator 0 (rank 2 on host" in text and f"sent no samples for rollout {last + 1} within" in text
            and "it is frozen (its process is stopped)" in text), text[-3000:]  # counted as the console counts
    assert (out / "checkpoints" / "latest").read_text().strip() == f"rollout{last}"


def test_configuration_errors_of_both_sides_are_printed_once_before_any_work(tmp_path):
    """The trainers' plan error (a warmup no shorter than the run) and the generator's (rollout.backend vllm without
    vLLM) in one sentence list, once; the generator adds nothing, and no output directory is created."""
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here: the generator's refusal needs it missing")
    out = tmp_path / "out"
    raw = json.loads(json.dumps(BASE))
    raw["dsrl"]["rollout"].update(placement="disaggregated", generator_ranks=1, backend="vllm")
    proc = launch(["launch/train.py", "--ds_config", str(write_json(tmp_path / "run.json", raw)), *SHORT,
                   "--dsrl.sft.steps", "0", "--dsrl.run.output_dir", str(out)], nprocs=3, timeout=300, check=False)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 2, text[-3000:]
    assert text.count("dsrl: configuration error:") == 1, text[-3000:]
    assert "2 problems:" in text and "warmup_num_steps = 10 is not shorter" in text, text[-3000:]
    assert "rollout.backend = 'vllm' needs vLLM, which is not installed. Fix: in the dsrl checkout, pip install -e " \
           "'.[vllm]'" in text
    assert "Traceback" not in text and "ended before the run started" not in text, text[-3000:]
    assert not out.exists()
