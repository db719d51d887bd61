"""bench/real_trl.py's parts that run in their own processes: the settings both trainers are given (one dsrl run file,
read through dsrl's own config, from which TRL's GRPOConfig is derived), TRL's side (GRPOTrainer on the real model,
timed by bench/_e2e_workers.py's clock) and the benchmark's own greedy evaluation of a saved model directory.
Heavy imports stay inside the functions."""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from _common import REPO

# dsrl's loss aggregation -> TRL's loss_type computing the same per-mini-batch objective (docs/concepts.md; TRL 1.16's
# GRPOTrainer._compute_loss): grpo = each sequence's token mean, averaged over the mini-batch's sequences; dapo = the
# token mean over the whole mini-batch (TRL normalises by the generation batch's tokens per accumulation window);
# dr_grpo = token sum over (B x max_completion_length).
TRL_LOSS_TYPE = {"seq-mean-token-mean": "grpo", "token-mean": "dapo", "seq-mean-token-sum-norm": "dr_grpo"}
SCHEDULE = "cosine_warmup_with_min_lr"  # transformers' schedule that has both a warmup start and a cosine floor


@dataclass
class Spec:
    """What both trainers are given; one JSON blob passed to each worker. ``None``: the run file's value."""

    model: str
    data: str
    run_file: str = "configs/smollm2_135m_chain_sum_cpu.json"
    rollouts: int = 12
    save_every: int = 2
    seed: int = 0
    prompts_per_rollout: int | None = None
    samples_per_prompt: int | None = None
    mini_batch_size: int | None = None
    max_new_tokens: int | None = None
    trl_micro_batch: int | None = None  # None: the mini-batch (one micro-batch per optimizer step)
    run_file_schedule: bool = False  # dsrl keeps the run file's WarmupCosineLR (else both: transformers' SCHEDULE)

    def to_json(self) -> str:
        return json.dumps(asdict(self))


def raw_run_file(spec: Spec) -> dict[str, Any]:
    return json.loads(Path(spec.run_file if os.path.isabs(spec.run_file) else REPO / spec.run_file).read_text())


def _warmup_cosine(raw: dict[str, Any], total_steps: int) -> dict[str, Any]:
    """The run file's WarmupCosineLR as transformers' SCHEDULE's arguments; a warmup as long as the whole run (a
    smoke run's few steps) is cut to ``total_steps - 1``, which dsrl requires, on both sides alike."""
    sched = raw.get("scheduler") or {}
    if sched.get("type") != "WarmupCosineLR":
        raise ValueError(f"the run file's scheduler is {sched.get('type')!r}; this benchmark maps WarmupCosineLR only")
    p = sched.get("params", {})
    return {"warmup_steps": min(int(p.get("warmup_num_steps", 1000)), max(total_steps - 1, 0)),
            "warmup_lr_rate": float(p.get("warmup_min_ratio", 0)), "min_lr_rate": float(p.get("cos_min_ratio", 1e-4))}


def total_steps(spec: Spec, batch: dict[str, Any]) -> int:
    """The run's optimizer steps: rollouts x E x P x G / B (the run file's batch section, with ``spec``'s values)."""
    b = {**batch, **{k: v for k, v in (("prompts_per_rollout", spec.prompts_per_rollout), ("samples_per_prompt",
         spec.samples_per_prompt), ("mini_batch_size", spec.mini_batch_size)) if v is not None}}
    return (spec.rollouts * b.get("epochs_per_rollout", 1) * b.get("prompts_per_rollout", 8)
            * b.get("samples_per_prompt", 4) // b["mini_batch_size"])


def dsrl_run_file(spec: Spec, output_dir: str) -> dict[str, Any]:
    """The run file dsrl's sides train with: ``spec.run_file`` with the model, data, batch, seed and length of the
    benchmark; a checkpoint every ``save_every`` rollouts, all kept, the final one exported (``final_model``); dsrl's
    own evaluation off (the benchmark evaluates); activation checkpointing off (faster on the CPU for this size,
    and TRL's side is set alike); the LR schedule as transformers' :data:`SCHEDULE` with the run file's WarmupCosineLR
    warmup start, warmup length and floor (``dsrl.scheduler``, the schedule TRL builds), unless
    ``spec.run_file_schedule``."""
    raw = raw_run_file(spec)
    d = raw["dsrl"]
    if not spec.run_file_schedule:
        s = _warmup_cosine(raw, total_steps(spec, d.get("batch", {})))
        raw.pop("scheduler")
        d["scheduler"] = {"name": SCHEDULE, "warmup_steps": s["warmup_steps"],
                          "kwargs": {"warmup_lr_rate": s["warmup_lr_rate"], "min_lr_rate": s["min_lr_rate"]}}
    d.setdefault("model", {}).update(path=spec.model, gradient_checkpointing=False)
    d.setdefault("data", {})["path"] = spec.data
    batch = {"prompts_per_rollout": spec.prompts_per_rollout, "samples_per_prompt": spec.samples_per_prompt,
             "mini_batch_size": spec.mini_batch_size}
    d.setdefault("batch", {}).update({k: v for k, v in batch.items() if v is not None})
    if spec.max_new_tokens is not None:
        d.setdefault("rollout", {})["max_new_tokens"] = spec.max_new_tokens
    d["run"] = {**d.get("run", {}), "rollouts": spec.rollouts, "output_dir": output_dir, "seed": spec.seed,
                "save_every": spec.save_every, "keep_last": spec.rollouts // max(spec.save_every, 1) + 1,
                "save_final": True, "export_final": True, "progress_bar": False, "overwrite": True}
    d["eval"] = {"every": 0}
    return raw


def settings(spec: Spec) -> dict[str, Any]:
    """The hyper-parameters both sides train with, read from dsrl's resolved config of :func:`dsrl_run_file`
    (TRL's GRPOConfig is built from these)."""
    from dsrl.algos.defaults import resolve_algorithm
    from dsrl.config import load_config

    raw = dsrl_run_file(spec, "unused")
    cfg = load_config(raw)
    d, opt = cfg.dsrl, cfg.ds_config["optimizer"]
    if str(opt.get("type", "")).lower() != "adamw":
        raise ValueError(f"the run file's optimizer is {opt.get('type')!r}; this benchmark maps AdamW only")
    algo = resolve_algorithm(d.algorithm)
    if d.loss_agg not in TRL_LOSS_TYPE:
        raise ValueError(f"dsrl's loss_agg {d.loss_agg!r} has no TRL loss_type computing the same objective")
    if algo.kl_coef and (algo.kl_in != "loss" or algo.kl_estimator != "k3"):
        raise ValueError("TRL's KL term is k3 in the loss; set dsrl.algorithm.kl_in = loss, kl_estimator = k3")
    b, params = d.batch, opt["params"]
    base = raw_run_file(spec)
    schedule = _warmup_cosine(base, total_steps(spec, base["dsrl"].get("batch", {})))
    return {
        "P": b.prompts_per_rollout, "G": b.samples_per_prompt, "B": b.mini_batch_size, "E": b.epochs_per_rollout,
        "steps_per_rollout": b.epochs_per_rollout * b.prompts_per_rollout * b.samples_per_prompt // b.mini_batch_size,
        "lr": float(params["lr"]), "betas": list(params.get("betas", (0.9, 0.999))),
        "eps": float(params.get("eps", 1e-8)), "weight_decay": float(params.get("weight_decay", 0.0)),
        "grad_clip": float(cfg.ds_config.get("gradient_clipping", 0.0)), "schedule": schedule,
        "clip_low": algo.clip_low, "clip_high": algo.clip_high, "kl_coef": algo.kl_coef,
        "normalize_std": algo.normalize_std, "loss_agg": d.loss_agg, "trl_loss_type": TRL_LOSS_TYPE[d.loss_agg],
        "temperature": d.rollout.temperature, "top_p": d.rollout.top_p, "top_k": d.rollout.top_k,
        "max_new_tokens": d.rollout.max_new_tokens, "backend": d.rollout.backend,
        "share_prompts": d.model.share_prompts, "gradient_checkpointing": d.model.gradient_checkpointing,
        "max_prompt_tokens": d.data.max_prompt_tokens,
        "micro_batch_tokens": b.max_tokens_per_micro_batch,
    }


def prompt_stream(spec: Spec) -> tuple[Any, list[dict[str, Any]], list[dict[str, Any]]]:
    """(dsrl's data config, the prompt records in file order, and in the order dsrl's sampler draws them, ``rollouts
    x P`` of them): TRL's dataset in that order, unshuffled, gives TRL's rollout k the prompts of dsrl's rollout k."""
    from dsrl.config import load_config
    from dsrl.rl.data.prompts import PromptSampler, load_prompts

    d = load_config(dsrl_run_file(spec, "unused")).dsrl
    records = load_prompts(d.data, seed=d.run.seed)
    sampler = PromptSampler(len(records), d.batch.prompts_per_rollout, seed=d.run.seed)
    return d.data, records, [records[i] for _ in range(spec.rollouts) for i in sampler.next_indices()]


# -- TRL's side ----------------------------------------------------------------------------------------------------


def run_trl(spec: Spec, out_path: str, output_dir: str) -> None:
    """TRL's GRPOTrainer on the model directory with :func:`settings`, dsrl's prompt stream and dsrl's reward
    function; per-rollout records (bench/_e2e_workers.py ``TrlClock``: generation, no-grad log-probs, the rest,
    peak resident set), the LR of every optimizer step and the checkpoint of every ``save_every`` rollouts (model
    only), written to ``out_path`` as they come. Before training, TRL's own rendering of the first prompt must be
    dsrl's token ids, and so must the first prompt TRL generates from."""
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    from _e2e_workers import TrlClock, WorkerOutput, time_trl_phases
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from dsrl.rl.data.prompts import encode
    from dsrl.tasks.procedural import gym_reward

    h = settings(spec)
    data_cfg, records, rows = prompt_stream(spec)
    system = [{"role": "system", "content": data_cfg.system_prompt}] if data_cfg.system_prompt else []

    def conversation(text: str) -> list[dict[str, str]]:  # dsrl's data.chat_template: a user message
        return [*system, {"role": "user", "content": text}]

    dataset = Dataset.from_list([{"prompt": conversation(r["prompt"]), "question": r["prompt"], "answer": r["answer"],
                                  "task": r["columns"]["task"], "metadata": r["columns"]["metadata"]} for r in rows])

    def reward(completions: list[Any], question: list[str], answer: list[str], task: list[str],
               metadata: list[str], **_: Any) -> list[float]:
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return gym_reward(question, texts, answer, task, metadata)

    spr, m = h["steps_per_rollout"], spec.trl_micro_batch or h["B"]
    if h["B"] % m:
        raise ValueError(f"--trl_micro_batch {m} must divide the mini-batch B = {h['B']}")
    s = h["schedule"]
    args = GRPOConfig(
        output_dir=output_dir, seed=spec.seed, report_to=[], logging_steps=1 << 30, disable_tqdm=True,
        use_cpu=True, bf16=False, fp16=False, dataloader_num_workers=0, shuffle_dataset=False,
        per_device_train_batch_size=m, gradient_accumulation_steps=h["B"] // m,
        steps_per_generation=h["P"] * h["G"] // m, num_generations=h["G"], num_iterations=h["E"],
        max_steps=spec.rollouts * spr, max_completion_length=h["max_new_tokens"],
        temperature=h["temperature"], top_p=h["top_p"], top_k=h["top_k"], repetition_penalty=1.0,
        learning_rate=h["lr"], optim="adamw_torch", adam_beta1=h["betas"][0], adam_beta2=h["betas"][1],
        adam_epsilon=h["eps"], weight_decay=h["weight_decay"], max_grad_norm=h["grad_clip"],
        lr_scheduler_type=SCHEDULE, warmup_steps=s["warmup_steps"],
        lr_scheduler_kwargs={"warmup_lr_rate": s["warmup_lr_rate"], "min_lr_rate": s["min_lr_rate"]},
        beta=h["kl_coef"], loss_type=h["trl_loss_type"], epsilon=h["clip_low"], epsilon_high=h["clip_high"],
        scale_rewards="group" if h["normalize_std"] else "none", mask_truncated_completions=False,
        gradient_checkpointing=h["gradient_checkpointing"],
        save_strategy="steps", save_steps=spec.save_every * spr, save_only_model=True,
    )
    tok = AutoTokenizer.from_pretrained(spec.model)
    model = AutoModelForCausalLM.from_pretrained(spec.model, dtype=torch.float32)
    clock = TrlClock("cpu")
    out = WorkerOutput(out_path, "trl", None)
    out.data.update(lrs=[], checkpoints={}, settings=h)

    class RolloutClock(TrainerCallback):
        """Closes a rollout record every E x R/B optimizer steps; a checkpoint's save is no rollout's time."""

        def begin(self) -> None:
            clock.begin()
            self.t0 = time.perf_counter()

        def on_train_begin(self, *_: Any, **__: Any) -> None:
            self.begin()

        def on_optimizer_step(self, *_: Any, optimizer: Any = None, **__: Any) -> None:
            out.data["lrs"].append(optimizer.param_groups[0]["lr"])  # before the scheduler advances

        def on_step_end(self, _args: Any, state: Any, *_: Any, **__: Any) -> None:
            if state.global_step % spr == 0:
                out.data["records"].append({"rollout_s": time.perf_counter() - self.t0, **clock.take()})
                out.write()
                self.begin()

        def on_save(self, a: Any, state: Any, *_: Any, **__: Any) -> None:
            path = os.path.join(a.output_dir, f"checkpoint-{state.global_step}")
            out.data["checkpoints"][str(state.global_step // spr)] = path
            out.write()
            self.begin()

    trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=args, train_dataset=dataset,
                          processing_class=tok, callbacks=[RolloutClock()])

    rendered = [int(t) for t in trainer._tokenize_prompts([dataset[0]["prompt"]])[0][0]]
    expected = encode(tok, [rows[0]["prompt"]], data_cfg.max_prompt_tokens, data_cfg.chat_template,
                      data_cfg.system_prompt).ids[0]
    row0 = trainer._tokenize_prompts([conversation(records[0]["prompt"])])[0][0]
    out.data["first_prompt"] = {"question": rows[0]["prompt"], "trl_ids": rendered, "dsrl_ids": expected,
                                "text": tok.decode(rendered), "file_row0": {"tokens": len(row0),
                                                                            "text": tok.decode(row0)}}
    out.write()
    assert rendered == expected, f"TRL renders the first prompt as {rendered}, dsrl as {expected}"
    time_trl_phases(trainer, clock)
    generate = trainer._generate_single_turn

    def checked(prompt_ids: Any, *a: Any, **k: Any) -> Any:
        if "first_generated_ids" not in out.data:
            out.data["first_generated_ids"] = [int(t) for t in prompt_ids[0]]
            assert out.data["first_generated_ids"] == expected, "TRL's first generation starts from other ids"
        return generate(prompt_ids, *a, **k)

    trainer._generate_single_turn = checked
    trainer.train()
    if str(spec.rollouts) not in out.data["checkpoints"]:
        path = os.path.join(output_dir, f"checkpoint-{spec.rollouts * spr}")
        trainer.save_model(path)
        out.data["checkpoints"][str(spec.rollouts)] = path
    out.data["done"] = True
    out.write()


# -- the benchmark's own evaluation ----------------------------------------------------------------------------------


def test_rows(data: str, split: str = "test", limit: int | None = None) -> list[dict[str, str]]:
    """The held-out rows (``question``, ``answer``, ``task``, ``metadata``) of a ``dsrl prepare-data`` directory."""
    import pandas as pd

    frame = pd.read_parquet(Path(data) / f"{split}.parquet")
    rows = frame.to_dict("records")
    return rows[:limit] if limit else rows


def greedy_accuracy(model_dir: str, tokenizer_dir: str, rows: list[dict[str, str]], max_new_tokens: int = 16,
                    batch_size: int = 50) -> dict[str, Any]:
    """Accuracy of a saved Hugging Face model directory, neither trainer's own evaluation: transformers loads it in
    float32; each question goes through the tokenizer's chat template (a user message, the generation prompt);
    ``generate`` decodes greedily (at most ``max_new_tokens``), ``batch_size`` prompts at a time, left-padded with
    pad = eos; dsrl.tasks.procedural.gym_accuracy scores the completions (special tokens dropped)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from dsrl.tasks.procedural import gym_accuracy

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.padding_side = "left"
    tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    gen = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=tok.eos_token_id,
                           pad_token_id=tok.eos_token_id)
    texts = [tok.apply_chat_template([{"role": "user", "content": r["question"]}], tokenize=False,
                                     add_generation_prompt=True) for r in rows]
    completions: list[str] = []
    t0 = time.perf_counter()
    with torch.no_grad():
        for i in range(0, len(texts), batch_size):
            enc = tok(texts[i:i + batch_size], return_tensors="pt", padding=True, add_special_tokens=False)
            ids = model.generate(**enc, generation_config=gen)
            completions += tok.batch_decode(ids[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    acc = gym_accuracy([r["question"] for r in rows], completions, [r["answer"] for r in rows],
                       [r["task"] for r in rows], [r["metadata"] for r in rows])
    return {"accuracy": sum(acc) / len(acc), "prompts": len(acc), "seconds": time.perf_counter() - t0,
            "first_completions": completions[:3]}


def evaluate_main(models: list[str], tokenizer_dir: str, data: str, limit: int | None, max_new_tokens: int,
                  batch_size: int, out: str) -> None:
    """Evaluate several model directories in this process; write {dir: result} to ``out``."""
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    rows = test_rows(data, limit=limit)
    results = {m: greedy_accuracy(m, tokenizer_dir, rows, max_new_tokens, batch_size) for m in models}
    Path(out).write_text(json.dumps(results, indent=1))
