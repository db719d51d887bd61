"""End-to-end GRPO, dsrl vs TRL's GRPOTrainer, side by side in one run: the same model, task, prompts,
group size, mini-batch, epochs per rollout, max new tokens and optimizer.

    python bench/e2e.py                                     # CPU: the "scaled" Qwen2 shape (26.5 M), hf
    python bench/e2e.py --device cuda --shape 0.5b --backends hf cb   # one GPU, Qwen2.5-0.5B shape, bf16

Each (backend, repetition) runs one fresh process per side (``--sides``: dsrl, ``trl`` = TRL's defaults,
``trl-ds`` = TRL through its own DeepSpeed integration with dsrl's precision recipe; order rotated every
repetition), on one device each (dsrl through DeepSpeed ZeRO-1 on a world of one), and each writes one record
per rollout. A *rollout* is the same unit on every side:
P prompts x G samples generated, scored, old log-probs computed once, then E x R/B optimizer steps
of B sequences in micro-batches of m. Per rollout (medians over the rollouts after the first, which
carries one-time warm-up costs) the table gives:

- seconds: generate (the generation call), log-probs (the no-grad forward for old log-probs),
  train (everything else: rewards, advantages, forward/backward, optimizer steps);
- generation tokens/s = completion tokens / generate seconds; training tokens/s = E x (prompt +
  completion tokens) / train seconds;
- peak memory: GPU: ``torch.cuda.max_memory_allocated`` over the rollout; CPU: the process's peak RSS;
- dsrl/TRL: TRL's rollout seconds over dsrl's (> 1 means dsrl is faster).

The model: a random-weight Qwen2 of the named shape whose head gives the eos token a constant
probability 1/``--mean_len`` per step (bench/_common.py ``long_tailed_model``), so completion
lengths are long-tailed the way RL completions are; both sides build it with the same seed
(identical weights). Prompts come from dsrl's built-in ``reverse`` task with its tiny tokenizer (the
model's other token ids decode to nothing, so rewards are mostly the task's length credit); both
sides score with the same reward function. Backends: ``hf`` = transformers ``generate`` on both
sides; ``cb`` = transformers continuous batching on both sides (dsrl ``rollout.backend = "cb"``,
TRL ``use_transformers_continuous_batching``); ``vllm`` = dsrl's vLLM backend (TRL's side not wired).
Precision: fp32 on the CPU; on a GPU, dsrl's default (DeepSpeed bf16: bf16 weights, fp32 master weights
and moments, fp32 gradient accumulation), TRL's default for a bf16 checkpoint (bf16 weights updated in
place, ``bf16=True``) and, for ``trl-ds``, dsrl's recipe given to TRL as its ``deepspeed`` config.
The optimizer on every side: torch AdamW, constant LR, grad clipping 1.0, no KL term. TRL is a
benchmark-only dependency (``pip install trl==1.16.0``), never a runtime one. Nothing asserts on time.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any

from _common import EOS, REPO, SHAPES, free_port, long_tailed_model, report, serve_biased_head
from _e2e_report import census_table, combine, results_table
from _profile import PHASES, PhaseProfiler, format_profile, memory_census

SIDES = ("dsrl", "trl", "trl-ds")
BACKENDS = ("hf", "cb", "vllm")


@dataclass
class Workload:
    """Everything both trainers are given; one JSON blob passed to each worker process."""

    shape: str = "scaled"
    mean_len: float = 12.0
    prompts_per_rollout: int = 8  # P
    samples_per_prompt: int = 4  # G
    mini_batch_size: int = 16  # B
    micro_batch_size: int = 4  # m (sequences per forward/backward)
    epochs_per_rollout: int = 1  # E
    max_new_tokens: int = 32
    rollouts: int = 4
    lr: float = 1e-5
    seed: int = 0
    device: str = "cpu"
    backend: str = "hf"
    profile_dir: str = ""  # set: one more rollout, profiled (bench/_profile.py), left out of the timings
    profile_skip: int = 8  # generate: decode forwards left untraced at the start of each call ...
    profile_window: int = 16  # ... and the forwards traced after them

    @property
    def rollout_size(self) -> int:
        return self.prompts_per_rollout * self.samples_per_prompt

    @property
    def steps_per_rollout(self) -> int:
        return self.epochs_per_rollout * self.rollout_size // self.mini_batch_size

    @property
    def total_rollouts(self) -> int:
        return self.rollouts + (1 if self.profile_dir else 0)


class PhaseClock:
    """Seconds and peak device memory of the generate and log-prob phases (everything else of a rollout is
    "train"), synchronised with the device; feeds an optional :class:`PhaseProfiler` the phase boundaries."""

    def __init__(self, device: str):
        self.cuda = device.startswith("cuda")
        self.t = {"generate_s": 0.0, "logprobs_s": 0.0}
        self.peak: dict[str, float] = {}
        self.completion_tokens = 0
        self.sequence_tokens = 0
        self.profiler: PhaseProfiler | None = None

    def sync(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize()

    def close(self, phase: str) -> None:
        """The peak since the last close belongs to ``phase``; start a new one."""
        if self.cuda:
            import torch

            self.peak[phase] = max(self.peak.get(phase, 0.0), torch.cuda.max_memory_allocated() / 2**20)
            torch.cuda.reset_peak_memory_stats()

    def begin(self) -> None:
        self.sync()
        self.peak = {}
        if self.cuda:
            import torch

            torch.cuda.reset_peak_memory_stats()

    def timed(self, key: str, fn: Any) -> Any:
        phase = key.removesuffix("_s")

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            self.sync()
            self.close("train")
            if self.profiler is not None:
                self.profiler.enter(phase)
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            self.sync()
            self.t[key] += time.perf_counter() - t0
            self.close(phase)
            if self.profiler is not None:
                self.profiler.enter("train")
            return out

        return wrapper

    def take(self) -> dict[str, Any]:
        self.sync()
        self.close("train")
        out = {**self.t, "completion_tokens": self.completion_tokens, "sequence_tokens": self.sequence_tokens,
               **{f"peak_{p}_mb": self.peak.get(p) for p in PHASES}}
        out["peak_mb"] = (max(self.peak.values()) if self.cuda and self.peak
                          else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
        self.t = dict.fromkeys(self.t, 0.0)
        self.completion_tokens = self.sequence_tokens = 0
        return out


class WorkerOutput:
    """What a worker reports, rewritten after every rollout so that a worker stopped at its time limit still
    leaves the rollouts it finished."""

    def __init__(self, path: str, side: str, w: Workload):
        self.path, self.w = path, w
        self.data: dict[str, Any] = {"side": side, "records": [], "census": None, "profile": None}
        self.write()

    def write(self) -> None:
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.data, f)
        os.replace(tmp, self.path)

    def rollout(self, index: int, record: dict[str, Any], profiler: PhaseProfiler | None) -> None:
        if profiler is not None:
            profiler.finish()
            self.data["profile"] = profiler.summary()
            with open(os.path.join(self.w.profile_dir, f"{self.data['side']}_{self.w.backend}.txt"), "w") as f:
                f.write(format_profile(self.data["side"], self.data["profile"]))
        else:
            self.data["records"].append(record)
        self.write()


def bench_model(w: Workload) -> Any:
    dtype = "float32" if w.device == "cpu" else "bfloat16"
    return long_tailed_model(w.shape, w.mean_len, "cpu", dtype)


def _profiler_for(w: Workload, index: int, model: Any, clock: PhaseClock) -> PhaseProfiler | None:
    if not w.profile_dir or index != w.rollouts:
        return None
    clock.profiler = PhaseProfiler(model, clock.cuda, skip=w.profile_skip, window=w.profile_window)
    clock.profiler.start()
    return clock.profiler


# -- the dsrl side ----------------------------------------------------------------------------------


def run_dsrl(w: Workload, out: WorkerOutput) -> None:
    """dsrl's Trainer on one device (ZeRO-1), its own loop body timed phase by phase."""
    import dsrl.rl.policy.model
    from dsrl.rl.trainer import Trainer

    # The benchmark's model instead of the built-in tiny one (same weights as the TRL side).
    model = bench_model(w)
    dsrl.rl.policy.model.build_model = lambda *a, **k: model
    if w.backend == "vllm":
        serve_biased_head(model)
    out_dir = tempfile.mkdtemp(prefix="e2e_dsrl_")
    run_file = {
        # ZeRO-1 on one device partitions nothing; unlike ZeRO-0 it accepts bf16 with fp32 gradient accumulation
        "zero_optimization": {"stage": 1},
        "optimizer": {"type": "AdamW", "params": {"lr": w.lr, "betas": [0.9, 0.999], "eps": 1e-8,
                                                  "weight_decay": 0.0, "torch_adam": True}},
        "gradient_clipping": 1.0,
        "steps_per_print": 1 << 30,
        "dsrl": {
            "batch": {"prompts_per_rollout": w.prompts_per_rollout, "samples_per_prompt": w.samples_per_prompt,
                      "mini_batch_size": w.mini_batch_size, "epochs_per_rollout": w.epochs_per_rollout,
                      "micro_batch_size_per_rank": w.micro_batch_size, "loss_agg": "seq-mean-token-mean"},
            "run": {"rollouts": w.total_rollouts, "output_dir": out_dir, "seed": w.seed, "save_final": False,
                    "progress_bar": False, "log_every": 1 << 30},
            "model": {"arch": "qwen2"},
            "data": {"task": "reverse", "size": 512, "max_prompt_tokens": 16},
            "rollout": {"backend": w.backend, "max_new_tokens": w.max_new_tokens, "temperature": 1.0,
                        "generation_batch_size": w.prompts_per_rollout,
                        "logprob_micro_batch_size": w.micro_batch_size},
            "algorithm": {"name": "grpo"},
        },
    }
    trainer = Trainer(run_file)
    clock = PhaseClock(w.device)
    generate = clock.timed("generate_s", trainer.backend.generate)

    def counted_generate(*args: Any, **kwargs: Any) -> Any:
        result = generate(*args, **kwargs)
        clock.completion_tokens += sum(len(c.completion_ids) for c in result)
        clock.sequence_tokens += sum(len(c.prompt_ids) + len(c.completion_ids) for c in result)
        return result

    trainer.backend.generate = counted_generate
    trainer.experience.score_logprobs = clock.timed("logprobs_s", trainer.experience.score_logprobs)
    for i in range(w.total_rollouts):
        profiler = _profiler_for(w, i, model, clock)
        clock.begin()
        t0 = time.perf_counter()
        local, _stats, _rounds = trainer.experience.make(trainer.rollout_index)
        trainer.train_rollout(local, lambda res, critic_res: None)
        clock.sync()
        trainer.rollout_index += 1
        record = {"rollout_s": time.perf_counter() - t0, **clock.take()}
        if i == 0:
            out.data["census"] = memory_census(model, trainer.rl.engine.optimizer, w.device)
        out.rollout(i, record, profiler)
    trainer.metrics.close()
    close = getattr(trainer.backend, "close", None)
    if close is not None:
        close()


# -- the TRL side -----------------------------------------------------------------------------------


def trl_deepspeed_config(gpu: bool) -> dict[str, Any]:
    """dsrl's precision recipe for TRL, through transformers' own DeepSpeed integration: the ds_config dsrl
    resolves for this benchmark's run (bench/e2e.py run_dsrl; dsrl.backends.deepspeed.config), with the batch
    fields and hyper-parameters left to the Trainer ("auto"). On a GPU: DeepSpeed's bf16 mode (bf16 weights,
    fp32 master weights and Adam moments), fp32 gradient accumulation and communication."""
    ds: dict[str, Any] = {
        "zero_optimization": {"stage": 1},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                  "weight_decay": "auto", "torch_adam": True}},
        "gradient_clipping": "auto", "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto", "train_batch_size": "auto", "steps_per_print": 1 << 30,
    }
    if gpu:
        ds["bf16"] = {"enabled": True}
        ds["data_types"] = {"grad_accum_dtype": "fp32"}
        ds["communication_data_type"] = "fp32"
    return ds


def run_trl(w: Workload, out: WorkerOutput, deepspeed: bool) -> None:
    """TRL's GRPOTrainer on one device with the same model, prompts, batch hierarchy and optimizer; with
    ``deepspeed``, through DeepSpeed ZeRO-1 with dsrl's precision recipe (:func:`trl_deepspeed_config`)."""
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from dsrl.config import DataConfig, ModelConfig
    from dsrl.rl.data.prompts import load_prompts
    from dsrl.rl.policy.tokenizer import load_tokenizer
    from dsrl.tasks import get_task

    torch.manual_seed(w.seed)
    tok = load_tokenizer(ModelConfig())
    task = get_task("reverse")
    rows = load_prompts(DataConfig(task="reverse", size=512), seed=w.seed)
    dataset = Dataset.from_list([{"prompt": r["prompt"], "answer": r["answer"]} for r in rows])

    def reward(prompts: list[str], completions: list[str], answer: list[str], **_: Any) -> list[float]:
        return task.rewards(prompts, completions, answer)

    R, B, m = w.rollout_size, w.mini_batch_size, w.micro_batch_size
    gpu = w.device.startswith("cuda")
    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="e2e_trl_"), seed=w.seed, report_to=[], save_strategy="no",
        logging_steps=1 << 30, disable_tqdm=True, use_cpu=not gpu, bf16=gpu,
        per_device_train_batch_size=m, gradient_accumulation_steps=B // m,
        steps_per_generation=(R // B) * (B // m), num_generations=w.samples_per_prompt,
        num_iterations=w.epochs_per_rollout, max_steps=w.total_rollouts * w.steps_per_rollout,
        max_completion_length=w.max_new_tokens, temperature=1.0, top_p=1.0, top_k=0,
        learning_rate=w.lr, lr_scheduler_type="constant", warmup_steps=0, optim="adamw_torch",
        adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, weight_decay=0.0, max_grad_norm=1.0,
        beta=0.0, loss_type="grpo", scale_rewards="group", shuffle_dataset=True,
        use_transformers_continuous_batching=w.backend == "cb", dataloader_num_workers=0,
        deepspeed=trl_deepspeed_config(gpu) if deepspeed else None,
    )
    model = bench_model(w)
    model.generation_config.eos_token_id = EOS
    clock = PhaseClock(w.device)

    class RolloutClock(TrainerCallback):
        """Closes a rollout record every E x R/B optimizer steps."""

        def __init__(self) -> None:
            self.t0 = 0.0
            self.rollout = 0
            self.optimizer: Any = None
            self.profiler: PhaseProfiler | None = None

        def begin(self) -> None:
            self.profiler = _profiler_for(w, self.rollout, model, clock)
            clock.begin()
            self.t0 = time.perf_counter()

        def on_train_begin(self, *_: Any, optimizer: Any = None, **__: Any) -> None:
            self.optimizer = optimizer
            self.begin()

        def on_step_end(self, _args: Any, state: Any, *_: Any, optimizer: Any = None, **__: Any) -> None:
            if state.global_step % w.steps_per_rollout:
                return
            clock.sync()
            record = {"rollout_s": time.perf_counter() - self.t0, **clock.take()}
            if self.rollout == 0:
                out.data["census"] = memory_census(model, optimizer or self.optimizer, w.device)
            out.rollout(self.rollout, record, self.profiler)
            self.rollout += 1
            clock.profiler = None
            self.begin()

    trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=args, train_dataset=dataset,
                          processing_class=tok, callbacks=[RolloutClock()])
    generate = clock.timed("generate_s", trainer._generate_single_turn)

    def counted_generate(prompt_ids: Any, *a: Any, **k: Any) -> Any:
        completion_ids, logprobs = generate(prompt_ids, *a, **k)
        clock.completion_tokens += sum(len(c) for c in completion_ids)
        clock.sequence_tokens += sum(len(p) + len(c) for p, c in zip(prompt_ids, completion_ids))
        return completion_ids, logprobs

    trainer._generate_single_turn = counted_generate
    logps = trainer._get_per_token_logps_and_entropies
    timed_logps = clock.timed("logprobs_s", logps)
    trainer._get_per_token_logps_and_entropies = (
        lambda *a, **k: logps(*a, **k) if torch.is_grad_enabled() else timed_logps(*a, **k))
    trainer.train()


# -- the driver -------------------------------------------------------------------------------------


def side_skip_reason(side: str, backend: str) -> str | None:
    """Why ``side`` cannot run ``backend`` here (None: it can)."""
    if side != "dsrl" and importlib.util.find_spec("trl") is None:
        return "trl is not importable (benchmark-only: pip install trl==1.16.0)"
    if side == "trl-ds" and importlib.util.find_spec("deepspeed") is None:
        return "deepspeed is not importable"
    if backend == "vllm":
        if importlib.util.find_spec("vllm") is None:
            return "vllm is not importable"
        if side != "dsrl":
            return ("not wired: TRL's vLLM modes load the model from a checkpoint and sync every weight, and this "
                    "benchmark's model carries an output-head bias that vLLM's Qwen2 lacks (dsrl's side sends it "
                    "as a logit bias)")
    return None


def run_worker(side: str, w: Workload, timeout: float | None = None) -> dict[str, Any]:
    """One side in a fresh process (its own peak memory, no shared state). Returns the worker's output with
    ``status``: ``ok``, ``timeout`` (ran past ``timeout`` seconds; the rollouts it finished are kept) or
    ``failed`` (``error`` holds the end of its output)."""
    with tempfile.TemporaryDirectory(prefix="e2e_worker_") as tmp:
        path = os.path.join(tmp, "out.json")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0", "WORLD_SIZE": "1",
               "LOCAL_RANK": "0", "TOKENIZERS_PARALLELISM": "false"}
        if w.device == "cpu":  # the same intra-op threads on both sides (accelerate would pick its own)
            env.setdefault("OMP_NUM_THREADS", "1")
        cmd = [sys.executable, __file__, "--worker", side, "--workload", json.dumps(asdict(w)), "--out", path]
        t0 = time.perf_counter()
        status, error = "ok", ""
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
            if proc.returncode != 0:
                status, error = "failed", (proc.stdout[-1500:] + "\n" + proc.stderr[-3000:]).strip()
        except subprocess.TimeoutExpired:
            status = "timeout"
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, json.JSONDecodeError):
            data = {"side": side, "records": [], "census": None, "profile": None}
        data.update(status=status, error=error, seconds=time.perf_counter() - t0)
        return data




def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu", help="cpu | cuda")
    ap.add_argument("--shape", default=None, choices=list(SHAPES), help="default: scaled on CPU, 0.5b on GPU")
    ap.add_argument("--backends", nargs="+", default=["hf"], choices=list(BACKENDS))
    ap.add_argument("--sides", nargs="+", default=["dsrl", "trl"], choices=list(SIDES),
                    help="trl = TRL's defaults; trl-ds = TRL through DeepSpeed with dsrl's precision recipe")
    ap.add_argument("--repeats", type=int, default=2, help="process rounds per backend (order rotated each time)")
    for field, default in asdict(Workload()).items():
        if field not in ("shape", "device", "backend", "profile_dir"):
            ap.add_argument(f"--{field}", type=type(default), default=None)
    ap.add_argument("--profile_dir", default="", help="profile one more rollout per process (left out of the "
                    "timings; bench/_profile.py) and write a summary per side here")
    ap.add_argument("--worker_timeout", type=float, default=None, help="seconds per process; a slower one is "
                    "stopped and reported with the rollouts it finished")
    ap.add_argument("--json", default=None, help="also write the results here (rewritten after every process)")
    ap.add_argument("--no-record", dest="no_record", action="store_true")
    ap.add_argument("--worker", choices=list(SIDES), help=argparse.SUPPRESS)
    ap.add_argument("--workload", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        w = Workload(**json.loads(args.workload))
        if w.device == "cpu":
            os.environ["DS_ACCELERATOR"] = "cpu"
        out = WorkerOutput(args.out, args.worker, w)
        if args.worker == "dsrl":
            run_dsrl(w, out)
        else:
            run_trl(w, out, deepspeed=args.worker == "trl-ds")
        return
    gpu_defaults = dict(shape="0.5b", prompts_per_rollout=16, samples_per_prompt=8, mini_batch_size=64,
                        micro_batch_size=8, max_new_tokens=256, mean_len=64.0, rollouts=4)
    base = asdict(Workload())
    if args.device != "cpu":
        base.update(gpu_defaults)
    base.update({k: v for k, v in vars(args).items() if k in base and v is not None})
    if base["profile_dir"]:
        os.makedirs(base["profile_dir"], exist_ok=True)
        base["profile_dir"] = os.path.abspath(base["profile_dir"])
    base["device"] = args.device
    gpu = args.device != "cpu"
    results: dict[str, dict[str, Any]] = {}
    for backend in args.backends:
        w = Workload(**{**base, "backend": backend})
        runs: dict[str, list[dict[str, Any]]] = {}
        results[backend] = {}
        sides = list(args.sides)
        for side in sides:
            reason = side_skip_reason(side, backend)
            if reason:
                results[backend][side] = {"skipped": reason}
                print(f"{backend} {side}: skipped ({reason})", flush=True)
        runnable = [s for s in sides if s not in results[backend]]
        for rep in range(args.repeats):
            order = runnable[rep % len(runnable):] + runnable[:rep % len(runnable)] if runnable else []
            for side in order:
                res = run_worker(side, w, args.worker_timeout)
                runs.setdefault(side, []).append(res)
                results[backend][side] = combine(runs[side], w)
                summary = results[backend][side].get("summary")
                print(f"{backend} rep {rep} {side}: {res['status']} in {res['seconds']:.0f} s, "
                      f"{len(res['records'])} rollouts; {summary}", flush=True)
                if res["status"] == "failed":
                    print(res["error"][-2000:], flush=True)
                if args.json:
                    _dump(args.json, base, args, results)
        results[backend] = {s: results[backend][s] for s in sides}
    if args.json:
        _dump(args.json, base, args, results)
    w = Workload(**base)
    body = describe(w, args.repeats, gpu) + "\n\n" + results_table(results, gpu)
    census = census_table(results)
    if census:
        body += ("\n\nResident memory after the first rollout, by role (MiB; bench/_profile.py memory_census: "
                 "'other' = what the allocator holds beyond the weights, gradients, master weights and "
                 "optimizer state: activations' caches, DeepSpeed's buffers, fragmentation):\n\n" + census)
    report("End to end: dsrl vs TRL GRPOTrainer (bench/e2e.py)", body, args.no_record)


def describe(w: Workload, repeats: int, gpu: bool) -> str:
    """The workload paragraph of the recorded section."""
    import torch
    import transformers

    trl_version = "not installed"
    if importlib.util.find_spec("trl") is not None:
        import trl

        trl_version = trl.__version__
    return (f"Shape {w.shape} ({SHAPES[w.shape]['vocab']}-token vocabulary), {w.device}, "
            f"{'float32' if not gpu else 'bfloat16'}; P = {w.prompts_per_rollout} prompts x G = "
            f"{w.samples_per_prompt} = R = {w.rollout_size} sequences per rollout, B = {w.mini_batch_size}, m = "
            f"{w.micro_batch_size}, E = {w.epochs_per_rollout} ({w.steps_per_rollout} optimizer steps per rollout), "
            f"max_new_tokens = {w.max_new_tokens} (eos probability 1/{w.mean_len:g} per step), {w.rollouts} "
            f"rollouts per process, {repeats} process round(s) per backend; torch {torch.__version__}, "
            f"transformers {transformers.__version__}, trl {trl_version}. Seconds per rollout are medians over "
            "rollouts 2..N of each process, then over processes. "
            + ("TRL default = bf16 weights updated in place (bf16=True); TRL + DeepSpeed = ZeRO-1 with dsrl's "
               "recipe (bf16 weights, fp32 master weights and moments, fp32 gradient accumulation and "
               "communication); dsrl = DeepSpeed ZeRO-1 with that recipe. " if gpu else
               "float32 everywhere; TRL + DeepSpeed = TRL through DeepSpeed ZeRO-1 as dsrl runs. ")
            +
            "Last column: TRL's seconds per rollout over dsrl's (> 1: dsrl faster) / dsrl's peak memory over "
            "TRL's (< 1: dsrl lighter). Peak memory: "
            + ("GPU max allocated, overall and per phase." if gpu else "process peak RSS."))


def _dump(path: str, base: dict[str, Any], args: Any, results: dict[str, Any]) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump({"workload": base, "repeats": args.repeats, "results": results}, f, indent=1)
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    main()
