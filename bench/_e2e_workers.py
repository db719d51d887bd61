"""bench/e2e.py's worker processes: the workload both trainers are given, dsrl's side (its own ``Trainer.run()``,
figures from its metrics rows) and TRL's (GRPOTrainer with callbacks that time its phases). One side per process;
heavy imports stay inside the functions."""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _common import EOS, long_tailed_model, rollout_rows, serve_biased_head
from _profile import PhaseProfiler, format_profile, memory_census

# dsrl's phases (dsrl/runtime/phases.py) as the profiler groups them; between phases counts as "train"
PROFILE_PHASE = {"generate": "generate", "old_logprobs": "logprobs", "ref_logprobs": "logprobs"}
STATUS = Path("/proc/self/status")


@dataclass
class Workload:
    """Everything the trainers are given; one JSON blob passed to each worker process."""

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
    gradient_checkpointing: bool = True  # on every side (TRL's default)
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


class WorkerOutput:
    """What a worker reports besides dsrl's metrics rows (TRL's records, the memory census, the profile),
    rewritten after every change so that a worker stopped at its time limit still leaves what it had."""

    def __init__(self, path: str, side: str, w: Workload):
        self.path, self.w = path, w
        self.data: dict[str, Any] = {"side": side, "records": [], "census": None, "profile": None}
        self.write()

    def write(self) -> None:
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.data, f)
        os.replace(tmp, self.path)

    def profile(self, profiler: PhaseProfiler) -> None:
        profiler.finish()
        self.data["profile"] = profiler.summary()
        with open(os.path.join(self.w.profile_dir, f"{self.data['side']}_{self.w.backend}.txt"), "w") as f:
            f.write(format_profile(self.data["side"], self.data["profile"]))
        self.write()


def bench_model(w: Workload, gradient_checkpointing: bool = False) -> Any:
    dtype = "float32" if w.device == "cpu" else "bfloat16"
    return long_tailed_model(w.shape, w.mean_len, "cpu", dtype, gradient_checkpointing=gradient_checkpointing)


def _profiled(w: Workload, rollout: int) -> bool:
    return bool(w.profile_dir) and rollout == w.rollouts


# -- the dsrl side ----------------------------------------------------------------------------------


DEFAULT_BACKEND = "default"  # dsrl's side with a run file that names no rollout.backend (what a user gets)


def dsrl_run_file(w: Workload, run_dir: str, offload: bool = False) -> dict[str, Any]:
    """The run file dsrl's side trains with (the ds_config TRL + DeepSpeed mirrors: :func:`trl_deepspeed_config`);
    with ``w.backend == "default"`` it names no ``rollout.backend``; ``offload``: with
    ``dsrl.memory.offload_states``, under ZeRO-2 (ZeRO-1 with bf16 and fp32 gradient accumulation runs DeepSpeed's
    BF16_Optimizer, which cannot offload: docs/memory.md)."""
    backend = {} if w.backend == DEFAULT_BACKEND else {"backend": w.backend}
    return {
        # ZeRO-1 on one device partitions nothing; unlike ZeRO-0 it accepts bf16 with fp32 gradient accumulation
        "zero_optimization": {"stage": 2 if offload else 1},
        "optimizer": {"type": "AdamW", "params": {"lr": w.lr, "betas": [0.9, 0.999], "eps": 1e-8,
                                                  "weight_decay": 0.0, "torch_adam": True}},
        "gradient_clipping": 1.0,
        "steps_per_print": 1 << 30,
        "dsrl": {
            "batch": {"prompts_per_rollout": w.prompts_per_rollout, "samples_per_prompt": w.samples_per_prompt,
                      "mini_batch_size": w.mini_batch_size, "epochs_per_rollout": w.epochs_per_rollout,
                      "micro_batch_size_per_rank": w.micro_batch_size, "loss_agg": "seq-mean-token-mean"},
            "run": {"rollouts": w.total_rollouts, "output_dir": run_dir, "seed": w.seed, "save_final": False,
                    "progress_bar": False, "log_every": 1},
            "model": {"arch": "qwen2", "gradient_checkpointing": w.gradient_checkpointing},
            "data": {"task": "reverse", "size": 512, "max_prompt_tokens": 16},
            "rollout": {**backend, "max_new_tokens": w.max_new_tokens, "temperature": 1.0,
                        "generation_batch_size": w.prompts_per_rollout,
                        "logprob_micro_batch_size": w.micro_batch_size},
            "algorithm": {"name": "grpo"},
            "memory": {"offload_states": offload},
        },
    }


class DsrlWatcher:
    """A listener on dsrl's phase clock (dsrl.runtime.phases.PhaseListener): the memory census after the first
    rollout's training and, with a profile directory, the profiler through the last (extra) rollout. It runs
    outside the phases' timing."""

    def __init__(self, w: Workload, model: Any, trainer: Any, out: WorkerOutput):
        self.w, self.model, self.trainer, self.out = w, model, trainer, out
        self.profiler: PhaseProfiler | None = None
        out.data["generation_start_mib"] = []

    def phase_started(self, name: str, rollout: int) -> None:
        if name == "generate" and self.w.device.startswith("cuda") and rollout < self.w.rollouts:
            import torch  # what the device holds as generation starts: weights + what training left there

            self.out.data["generation_start_mib"].append(torch.cuda.memory_allocated() / 2**20)
        if _profiled(self.w, rollout) and self.profiler is None:
            self.profiler = PhaseProfiler(self.model, self.w.device.startswith("cuda"), skip=self.w.profile_skip,
                                          window=self.w.profile_window)
            self.profiler.start()
        if self.profiler is not None:
            self.profiler.enter(PROFILE_PHASE.get(name, "train"))

    def phase_ended(self, name: str, rollout: int) -> None:
        if self.profiler is not None:
            if name == "train":
                self.out.profile(self.profiler)
                self.profiler = None
            else:
                self.profiler.enter("train")
        if name == "train" and rollout == 0:
            optimizer = self.trainer.parts.actor.engine.engine.optimizer
            self.out.data["census"] = memory_census(self.model, optimizer, self.w.device)
            self.out.write()


def run_dsrl(w: Workload, out: WorkerOutput, run_dir: str, offload: bool = False) -> None:
    """dsrl's Trainer on one device (ZeRO-1), run as launch/train.py runs it; its rows land in
    ``run_dir/metrics.jsonl`` (read by the driver: :func:`dsrl_records`). Beside them: ``dsrl plan``'s memory
    prediction for this run file and model (:func:`plan_memory`), the device's allocated memory as each
    generation starts, the weights' size and parameter count, and after the timed rollouts a bucketed weight copy
    (:func:`weight_sync_probe`)."""
    import dsrl.rl.policy.model
    from dsrl.rl.trainer import Trainer
    from dsrl.rollout.auto import AutoRolloutBackend

    # The benchmark's model (the TRL sides' weights, with a biased head dsrl's model builder cannot express) in
    # place of the built-in tiny one: the one thing replaced; the trainer, its loop and its metrics are dsrl's.
    model = bench_model(w, gradient_checkpointing=w.gradient_checkpointing)
    dsrl.rl.policy.model.build_model = lambda *a, **k: model
    if w.backend == "vllm":
        serve_biased_head(model)
    run_file = dsrl_run_file(w, run_dir, offload)
    out.data.update(plan_memory=plan_memory(run_file, model, w), params=sum(p.numel() for p in model.parameters()),
                    weights_mib=sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20,
                    device_name=_device_name(w))
    out.write()
    trainer = Trainer.from_config(run_file)
    backend = trainer.parts.backend
    if isinstance(backend, AutoRolloutBackend):  # what "auto" runs on this workload (one call per rollout)
        out.data["auto_picks"] = backend.decision(trainer.parts.plan.prompts_per_rank, w.samples_per_prompt).backend
        out.write()
    trainer.parts.phases.add_listener(DsrlWatcher(w, model, trainer, out))
    trainer.run()
    out.data["weight_sync_probe"] = weight_sync_probe(model)
    out.write()


def _device_name(w: Workload) -> str:
    if w.device.startswith("cuda"):
        import torch

        return torch.cuda.get_device_name(0)
    return "cpu"


def plan_memory(run_file: dict[str, Any], model: Any, w: Workload) -> dict[str, Any]:
    """``dsrl plan``'s memory per phase (dsrl/cli/memory.py) for this run file and this model's config, against the
    local device: {phase: {"parts": MiB, "total_mib": MiB}} (phases: generation, logprobs, training)."""
    from dsrl.cli.memory import memory_report
    from dsrl.config import load_config
    from dsrl.core.plan import BatchPlan

    cfg = load_config(run_file)
    plan = BatchPlan.from_config(cfg, 1, 512)
    phases, _, _ = memory_report(cfg, plan, on_gpu=w.device.startswith("cuda"), world_size=1, config=model.config)
    return {name: phase.to_json() for name, phase in phases.items()}


def weight_sync_probe(model: Any, bucket_mib: float = 512.0, repeats: int = 3) -> dict[str, float]:
    """The policy's generation weights copied in buckets of ``bucket_mib`` into a second copy on the same device
    (what a colocated engine's load does at the least; vLLM's loader adds its own work): the fastest of
    ``repeats`` syncs, its bytes and buckets. Runs after the timed rollouts (the second copy is the probe's)."""
    import torch

    from dsrl.core.buckets import bucket_bytes, whole_buckets
    from dsrl.rollout.policy import iter_generation_weights

    with torch.no_grad():
        named = list(iter_generation_weights(model))
        target = [torch.empty_like(t) for _, t in named]
        buckets = whole_buckets([t.numel() * t.element_size() for _, t in named], bucket_bytes(bucket_mib))
        cuda = next(model.parameters()).is_cuda
        best = float("inf")
        for _ in range(repeats):
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            for bucket in buckets:
                torch._foreach_copy_([target[i] for i in bucket], [named[i][1] for i in bucket])
            if cuda:
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
    return {"seconds": best, "bytes": float(sum(t.numel() * t.element_size() for _, t in named)),
            "buckets": float(len(buckets))}


def dsrl_records(run_dir: str, w: Workload, loop_time: bool = False) -> list[dict[str, Any]]:
    """The timed rollouts' records from dsrl's ``rollout`` rows (the profiled extra rollout left out). A rollout's
    seconds: the difference of consecutive rows' ``elapsed_s``; with ``loop_time``, the row's ``rollout_s +
    train_s`` instead (making the experience, then training on it: what the rollout costs without the evaluation
    or checkpoint that the run may add between rollouts, which ``elapsed_s`` counts)."""
    rows = [r for r in rollout_rows(run_dir) if r["rollout"] <= w.rollouts]
    out, before = [], 0.0
    for r in rows:

        def peak(*phases: str, r: dict = r) -> float | None:
            known = [r[f"peak_{p}_mib"] for p in phases if r.get(f"peak_{p}_mib") is not None]
            return max(known) if known else None

        out.append({
            "rollout_s": r["rollout_s"] + r["train_s"] if loop_time else r["elapsed_s"] - before,
            "generate_s": r["phase_generate_s"],
            "logprobs_s": r["phase_old_logprobs_s"] + r.get("phase_ref_logprobs_s", 0.0),
            "reward_s": r["phase_reward_s"], "train_phase_s": r["phase_train_s"],
            "completion_tokens": r["response_len"] * w.rollout_size,
            "sequence_tokens": (r["train_sequence_tokens_per_s"] or 0.0) * r["phase_train_s"] / w.epochs_per_rollout,
            "peak_mb": r["peak_mib"], "peak_generate_mb": peak("generate"),
            "peak_logprobs_mb": peak("old_logprobs", "ref_logprobs"), "peak_train_mb": peak("reward", "train"),
            "offload_s": r.get("offload_s", 0.0), "reload_s": r.get("reload_s", 0.0),
            "offload_bytes": r.get("offload_bytes", 0.0), "weight_sync_s": r.get("weight_sync_s", 0.0),
        })
        before = r["elapsed_s"]
    return out


# -- the TRL side -----------------------------------------------------------------------------------


def _vmhwm_mib() -> float | None:
    try:
        for line in STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def _reset_vmhwm() -> None:
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


class TrlClock:
    """Seconds and peak memory of TRL's generate and log-prob phases (everything else of a rollout is "train"),
    synchronised with the device; feeds an optional :class:`PhaseProfiler` the phase boundaries. Peak memory:
    CUDA max allocated per phase; CPU the rollout's peak resident set (VmHWM, reset at the rollout's start)."""

    PHASES = ("generate", "logprobs", "train")

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
        else:
            _reset_vmhwm()

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
               **{f"peak_{p}_mb": self.peak.get(p) for p in self.PHASES}}
        out["peak_mb"] = max(self.peak.values()) if self.cuda and self.peak else _vmhwm_mib()
        self.t = dict.fromkeys(self.t, 0.0)
        self.completion_tokens = self.sequence_tokens = 0
        return out


def trl_deepspeed_config(gpu: bool) -> dict[str, Any]:
    """dsrl's precision recipe for TRL, through transformers' own DeepSpeed integration: the ds_config dsrl
    resolves for this benchmark's run (:func:`dsrl_run_file`; dsrl.backends.deepspeed.config), with the batch
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
    """TRL's GRPOTrainer on one device with the same model, prompts, batch hierarchy, optimizer and gradient
    checkpointing; with ``deepspeed``, through DeepSpeed ZeRO-1 with dsrl's precision recipe
    (:func:`trl_deepspeed_config`)."""
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
        gradient_checkpointing=w.gradient_checkpointing,
        deepspeed=trl_deepspeed_config(gpu) if deepspeed else None,
    )
    model = bench_model(w)  # TRL turns gradient checkpointing on itself (args.gradient_checkpointing)
    model.generation_config.eos_token_id = EOS
    clock = TrlClock(w.device)

    class RolloutClock(TrainerCallback):
        """Closes a rollout record every E x R/B optimizer steps."""

        def __init__(self) -> None:
            self.t0 = 0.0
            self.rollout = 0
            self.optimizer: Any = None

        def begin(self) -> None:
            if _profiled(w, self.rollout):
                clock.profiler = PhaseProfiler(model, clock.cuda, skip=w.profile_skip, window=w.profile_window)
                clock.profiler.start()
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
            if clock.profiler is not None:
                out.profile(clock.profiler)
                clock.profiler = None
            else:
                out.data["records"].append(record)
                out.write()
            self.rollout += 1
            self.begin()

    trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=args, train_dataset=dataset,
                          processing_class=tok, callbacks=[RolloutClock()])
    time_trl_phases(trainer, clock)
    trainer.train()


def time_trl_phases(trainer: Any, clock: TrlClock) -> None:
    """Wrap a GRPOTrainer's generation call (counting its completion and sequence tokens) and its no-grad log-prob
    calls (old and reference log-probs; the training forward runs with grad and is left alone) in ``clock``."""
    import torch

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
