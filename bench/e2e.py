"""End-to-end GRPO, dsrl vs TRL's GRPOTrainer, side by side in one run: the same model, task, prompts,
group size, mini-batch, epochs per rollout, max new tokens and optimizer.

    python bench/e2e.py                                     # CPU: the "scaled" Qwen2 shape (26.5 M), hf
    python bench/e2e.py --device cuda --shape 0.5b --backends hf cb   # one GPU, Qwen2.5-0.5B shape, bf16

Each (backend, repetition) runs two fresh processes, dsrl then TRL (order flipped every repetition),
on one device each (dsrl through DeepSpeed ZeRO-1 on a world of one, TRL through its own Trainer,
no DeepSpeed), and each writes one record per rollout. A *rollout* is the same unit on both sides:
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
TRL ``use_transformers_continuous_batching``). Precision: fp32 on the CPU; on a GPU, dsrl's default
(DeepSpeed bf16: bf16 weights, fp32 master copy) and TRL's default for a bf16 checkpoint (bf16
weights updated in place, ``bf16=True``). The optimizer on both sides: torch AdamW, constant LR, grad
clipping 1.0, no KL term. TRL is a benchmark-only dependency (``pip install trl``), never a runtime one.
Nothing asserts on time.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any

from _common import EOS, REPO, SHAPES, long_tailed_model, report, table


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
    profile_dir: str = ""

    @property
    def rollout_size(self) -> int:
        return self.prompts_per_rollout * self.samples_per_prompt

    @property
    def steps_per_rollout(self) -> int:
        return self.epochs_per_rollout * self.rollout_size // self.mini_batch_size


class PhaseClock:
    """Seconds spent in the generate and log-prob phases, synchronised with the device."""

    def __init__(self, device: str):
        self.cuda = device.startswith("cuda")
        self.t = {"generate_s": 0.0, "logprobs_s": 0.0}
        self.completion_tokens = 0
        self.sequence_tokens = 0

    def sync(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize()

    def timed(self, key: str, fn: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            self.sync()
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            self.sync()
            self.t[key] += time.perf_counter() - t0
            return out

        return wrapper

    def take(self) -> dict[str, float]:
        out = {**self.t, "completion_tokens": self.completion_tokens, "sequence_tokens": self.sequence_tokens}
        self.t = dict.fromkeys(self.t, 0.0)
        self.completion_tokens = self.sequence_tokens = 0
        return out


def peak_memory_mb(device: str) -> float:
    """Peak device memory since the last reset (GPU) or the process's peak RSS (CPU), in MiB."""
    if device.startswith("cuda"):
        import torch

        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def reset_peak(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.reset_peak_memory_stats()


class Profiled:
    """``torch.profiler`` over one rollout (``PROFILE_ROLLOUT``) when ``profile_dir`` is set: the top operators
    by self device time and by self CPU time go to ``<profile_dir>/<side>_<backend>.txt``. The profiled rollout
    is left out of the timings."""

    def __init__(self, w: Workload, side: str):
        self.path = os.path.join(w.profile_dir, f"{side}_{w.backend}.txt") if w.profile_dir else None
        self.prof: Any = None

    def start(self, rollout: int) -> bool:
        if self.path is None or rollout != PROFILE_ROLLOUT:
            return False
        import torch

        acts = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        self.prof = torch.profiler.profile(activities=acts)
        self.prof.__enter__()
        return True

    def stop(self) -> None:
        if self.prof is None:
            return
        self.prof.__exit__(None, None, None)
        avg = self.prof.key_averages()
        device_key = "self_device_time_total" if any(getattr(e, "self_device_time_total", 0) for e in avg) else None
        with open(self.path, "w") as f:
            if device_key:
                f.write(avg.table(sort_by=device_key, row_limit=30) + "\n\n")
            f.write(avg.table(sort_by="self_cpu_time_total", row_limit=30) + "\n")
        self.prof = None


PROFILE_ROLLOUT = 2


def bench_model(w: Workload) -> Any:
    dtype = "float32" if w.device == "cpu" else "bfloat16"
    return long_tailed_model(w.shape, w.mean_len, "cpu", dtype)


# -- the dsrl side ----------------------------------------------------------------------------------


def run_dsrl(w: Workload) -> list[dict[str, Any]]:
    """dsrl's Trainer on one device (ZeRO-1), its own loop body timed phase by phase."""
    import dsrl.rl.models
    from dsrl.rl.trainer import Trainer

    # The benchmark's model instead of the built-in tiny one (same weights as the TRL side).
    model = bench_model(w)
    dsrl.rl.models.build_model = lambda *a, **k: model
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
            "run": {"rollouts": w.rollouts, "output_dir": out_dir, "seed": w.seed, "save_final": False,
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
        out = generate(*args, **kwargs)
        clock.completion_tokens += sum(len(c.completion_ids) for c in out)
        clock.sequence_tokens += sum(len(c.prompt_ids) + len(c.completion_ids) for c in out)
        return out

    trainer.backend.generate = counted_generate
    trainer.experience.score_logprobs = clock.timed("logprobs_s", trainer.experience.score_logprobs)
    records = []
    profiler = Profiled(w, "dsrl")
    for i in range(w.rollouts):
        profiled = profiler.start(i)
        reset_peak(w.device)
        clock.sync()
        t0 = time.perf_counter()
        local, _stats, _rounds = trainer.experience.make(trainer.rollout_index)
        trainer.train_rollout(local, lambda res, critic_res: None)
        clock.sync()
        trainer.rollout_index += 1
        record = {"rollout_s": time.perf_counter() - t0, **clock.take(), "peak_mb": peak_memory_mb(w.device)}
        profiler.stop()
        if not profiled:
            records.append(record)
    trainer.metrics.close()
    return records


# -- the TRL side -----------------------------------------------------------------------------------


def run_trl(w: Workload) -> list[dict[str, Any]]:
    """TRL's GRPOTrainer on one device with the same model, prompts, batch hierarchy and optimizer."""
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from dsrl.config import DataConfig, ModelConfig
    from dsrl.rl.data import load_prompts
    from dsrl.rl.tokenizer import load_tokenizer
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
        num_iterations=w.epochs_per_rollout, max_steps=w.rollouts * w.steps_per_rollout,
        max_completion_length=w.max_new_tokens, temperature=1.0, top_p=1.0, top_k=0,
        learning_rate=w.lr, lr_scheduler_type="constant", warmup_steps=0, optim="adamw_torch",
        adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, weight_decay=0.0, max_grad_norm=1.0,
        beta=0.0, loss_type="grpo", scale_rewards="group", shuffle_dataset=True,
        use_transformers_continuous_batching=w.backend == "cb", dataloader_num_workers=0,
    )
    model = bench_model(w)
    model.generation_config.eos_token_id = EOS
    clock = PhaseClock(w.device)
    records: list[dict[str, Any]] = []

    profiler = Profiled(w, "trl")

    class RolloutClock(TrainerCallback):
        """Closes a rollout record every E x R/B optimizer steps."""

        def __init__(self) -> None:
            self.t0 = 0.0
            self.rollout = 0
            self.profiled = False

        def on_train_begin(self, *_: Any, **__: Any) -> None:
            self.profiled = profiler.start(self.rollout)
            reset_peak(w.device)
            clock.sync()
            self.t0 = time.perf_counter()

        def on_step_end(self, _args: Any, state: Any, *_: Any, **__: Any) -> None:
            if state.global_step % w.steps_per_rollout == 0:
                clock.sync()
                now = time.perf_counter()
                record = {"rollout_s": now - self.t0, **clock.take(), "peak_mb": peak_memory_mb(w.device)}
                profiler.stop()
                if not self.profiled:
                    records.append(record)
                self.rollout += 1
                self.profiled = profiler.start(self.rollout)
                reset_peak(w.device)
                self.t0 = time.perf_counter()

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
    return records


# -- the driver -------------------------------------------------------------------------------------


def run_worker(side: str, w: Workload, timeout: float | None = None) -> list[dict[str, Any]] | None:
    """One side in a fresh process (its own peak memory, no shared state); its per-rollout records, or
    None when it ran past ``timeout`` seconds."""
    with tempfile.NamedTemporaryFile("r", suffix=".json") as out:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "RANK": "0", "WORLD_SIZE": "1",
               "LOCAL_RANK": "0", "TOKENIZERS_PARALLELISM": "false"}
        if w.device == "cpu":  # the same intra-op threads on both sides (accelerate would pick its own)
            env.setdefault("OMP_NUM_THREADS", "1")
        cmd = [sys.executable, __file__, "--worker", side, "--workload", json.dumps(asdict(w)), "--out", out.name]
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return None
        if proc.returncode != 0:
            raise RuntimeError(f"{side} worker failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                               f"{proc.stderr[-5000:]}")
        return json.load(out)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def summarize(records: list[dict[str, Any]], w: Workload) -> dict[str, float]:
    """Medians over the rollouts after the first; peak memory is the maximum over all of them."""
    steady = records[1:] or records
    med = {k: statistics.median(r[k] for r in steady) for k in ("rollout_s", "generate_s", "logprobs_s")}
    train = [r["rollout_s"] - r["generate_s"] - r["logprobs_s"] for r in steady]
    med["train_s"] = statistics.median(train)
    med["gen_tok_s"] = statistics.median(r["completion_tokens"] / max(r["generate_s"], 1e-9) for r in steady)
    med["train_tok_s"] = statistics.median(w.epochs_per_rollout * r["sequence_tokens"] / max(t, 1e-9)
                                           for r, t in zip(steady, train))
    med["mean_len"] = statistics.mean(r["completion_tokens"] for r in steady) / w.rollout_size
    med["peak_mb"] = max(r["peak_mb"] for r in records)
    return med


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu", help="cpu | cuda")
    ap.add_argument("--shape", default=None, choices=list(SHAPES), help="default: scaled on CPU, 0.5b on GPU")
    ap.add_argument("--backends", nargs="+", default=["hf"], choices=["hf", "cb"])
    ap.add_argument("--repeats", type=int, default=2, help="process pairs per backend (order flipped each time)")
    for field, default in asdict(Workload()).items():
        if field not in ("shape", "device", "backend", "profile_dir"):
            ap.add_argument(f"--{field}", type=type(default), default=None)
    ap.add_argument("--profile_dir", default="", help=f"write a torch.profiler summary of rollout "
                    f"{PROFILE_ROLLOUT + 1} of each process here (that rollout is left out of the timings)")
    ap.add_argument("--worker_timeout", type=float, default=None, help="seconds per process; a slower one is "
                    "reported as a timeout")
    ap.add_argument("--no-record", dest="no_record", action="store_true")
    ap.add_argument("--worker", choices=["dsrl", "trl"], help=argparse.SUPPRESS)
    ap.add_argument("--workload", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        w = Workload(**json.loads(args.workload))
        if w.device == "cpu":
            os.environ["DS_ACCELERATOR"] = "cpu"
        records = (run_dsrl if args.worker == "dsrl" else run_trl)(w)
        with open(args.out, "w") as f:
            json.dump(records, f)
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
    rows = []
    for backend in args.backends:
        w = Workload(**{**base, "backend": backend})
        results: dict[str, list[dict[str, float]]] = {"dsrl": [], "trl": []}
        for rep in range(args.repeats):
            for side in (("dsrl", "trl") if rep % 2 == 0 else ("trl", "dsrl")):
                records = run_worker(side, w, args.worker_timeout)
                if records is not None:
                    results[side].append(summarize(records, w))
                print(f"{backend} rep {rep} {side}: {results[side][-1] if records else 'timed out'}", flush=True)
        ratios = [t["rollout_s"] / d["rollout_s"] for d, t in zip(results["dsrl"], results["trl"])] or [float("nan")]
        for side in ("dsrl", "trl"):
            if not results[side]:
                rows.append([backend, side, f"timed out (> {args.worker_timeout:g} s per process)"] + [""] * 8)
                continue
            s = {k: statistics.median(r[k] for r in results[side]) for k in results[side][0]}
            rows.append([backend, side, f"{s['rollout_s']:.2f}", f"{s['generate_s']:.2f}", f"{s['logprobs_s']:.2f}",
                         f"{s['train_s']:.2f}", f"{s['gen_tok_s']:,.0f}", f"{s['train_tok_s']:,.0f}",
                         f"{s['mean_len']:.1f}", f"{s['peak_mb']:,.0f}",
                         f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"
                         if side == "dsrl" else ""])
    w = Workload(**base)
    import torch
    import transformers
    import trl

    body = (f"Shape {w.shape} ({SHAPES[w.shape]['vocab']}-token vocabulary), {w.device}, "
            f"{'float32' if w.device == 'cpu' else 'bfloat16'}; P = {w.prompts_per_rollout} prompts x G = "
            f"{w.samples_per_prompt} = R = {w.rollout_size} sequences per rollout, B = {w.mini_batch_size}, m = "
            f"{w.micro_batch_size}, E = {w.epochs_per_rollout} ({w.steps_per_rollout} optimizer steps per rollout), "
            f"max_new_tokens = {w.max_new_tokens} (eos probability 1/{w.mean_len:g} per step), {w.rollouts} "
            f"rollouts per process, {args.repeats} process pair(s) per backend; torch {torch.__version__}, "
            f"transformers {transformers.__version__}, trl {trl.__version__}. Seconds per rollout are medians over "
            "rollouts 2..N of each process, then over processes; 'dsrl/TRL' = TRL's seconds per rollout over "
            "dsrl's (median, range over process pairs; > 1: dsrl faster). Peak memory: "
            f"{'GPU max allocated' if w.device != 'cpu' else 'process peak RSS'}.\n\n")
    body += table(["backend", "trainer", "s/rollout", "generate s", "log-probs s", "train s", "gen tok/s",
                   "train tok/s", "mean len", "peak MiB", "dsrl/TRL"], rows)
    report("End to end: dsrl vs TRL GRPOTrainer (bench/e2e.py)", body, args.no_record)


if __name__ == "__main__":
    main()
