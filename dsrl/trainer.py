"""The RL loop: rollout -> rewards -> advantages -> mini-batches -> RLEngine.

One rollout, on every rank:

1. the prompt sampler (identical on all ranks) draws P prompts; rank r generates G completions for
   its P/D of them (whole groups stay on one rank, so group statistics need no communication);
2. rewards (plus DAPO overlong shaping) and filters (DAPO dynamic sampling refills zero-variance
   groups; overlong filtering masks truncated samples; a non-finite reward masks its sample);
3. old (and reference) log-probs, once per rollout, before any update, for the local samples (with
   ``kl_in = "reward"`` the KL penalty lands on the rewards here), then group advantages;
4. the samples of all ranks are all-gathered; for each of E epochs the rollout is reshuffled into
   R/B mini-batches (the same permutation on every rank), each partitioned across ranks and into
   micro-batches (fixed size or token budget) by :mod:`dsrl.partition`; every mini-batch is one
   ``RLEngine.train_mini_batch`` call, i.e. one optimizer step.

The progress bar's total is the plan's total optimizer steps and every loop bound comes from the
same plan, so the bar ends exactly at the last step.
"""

from __future__ import annotations

import logging
import math
import os
import random
import time
from typing import Any

import torch
import torch.distributed as dist

from dsrl import algos
from dsrl.batching import Sample, chunks, collate, collate_packed, completion_positions
from dsrl.config import Config, ConfigError, load_config
from dsrl.ds_config import sequence_parallel_size
from dsrl.ds_validation import validated_deepspeed_config
from dsrl.engine import RLEngine, ensure_distributed, initialize, on_gpu
from dsrl.loss import clipped_policy_loss, kl_estimate, token_entropy, token_logprobs
from dsrl.metrics import MetricsWriter
from dsrl.partition import mini_batches, partition_mini_batch
from dsrl.plan import BatchPlan

CHECKPOINT_SUBDIR = "checkpoints"
log = logging.getLogger("dsrl.trainer")


def derived_seed(*parts: int) -> int:
    """A 63-bit seed from integers (run seed, rollout, round, global rank...), stable across runs."""
    h = 0x9E3779B97F4A7C15
    for p in parts:
        h = (h ^ (int(p) + 0x9E3779B97F4A7C15 + (h << 6) + (h >> 2))) & 0x7FFFFFFFFFFFFFFF
    return h


def _all_reduce(values: list[float], op: Any = None, device: Any = "cpu") -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op or dist.ReduceOp.SUM)
    return t.tolist()


class Trainer:
    """Builds everything from one run file and runs the loop (see the module docstring)."""

    def __init__(self, config: str | dict | Config, overrides: dict[str, Any] | None = None,
                 resume: str | None = None):
        from dsrl.data import PromptSampler, encode_prompts, load_prompts, load_reward_fn
        from dsrl.models import build_model, frozen_copy, resolve_dtype
        from dsrl.rollout import make_backend
        from dsrl.tokenizer import load_tokenizer

        self.cfg = load_config(config, overrides)
        d = self.cfg.dsrl
        self.d = d
        if resume is not None:
            d.run.resume = resume
        ensure_distributed()
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.on_gpu = on_gpu()
        torch.manual_seed(d.run.seed)  # identical initial weights on every rank
        random.seed(derived_seed(d.run.seed, self.rank))

        self.tokenizer = load_tokenizer(d.model)
        self.prompts = load_prompts(d.data, seed=d.run.seed)
        self.reward_fn = load_reward_fn(d.data)
        self.accuracy_fn = _accuracy_fn(d.data)
        self._encode = encode_prompts
        tok = self.tokenizer
        _match_deepspeed_precision(self.cfg.ds_config, resolve_dtype(d.model.dtype, self.on_gpu))
        # The whole run file, DeepSpeed half included, is checked before the model is built (initialize
        # checks it again, cheaply, for callers that use it directly).
        plan = BatchPlan.from_config(self.cfg, self.world // sequence_parallel_size(self.cfg.ds_config),
                                     len(self.prompts))
        validated_deepspeed_config(self.cfg, plan, on_gpu=self.on_gpu)
        model = build_model(d.model, vocab_size=len(tok), pad_token_id=tok.pad_token_id,
                            bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, on_gpu=self.on_gpu,
                            seed=d.run.seed)
        self.ref_model = frozen_copy(model) if d.algorithm.kl_coef > 0 else None
        self.rl: RLEngine = initialize(model, self.cfg, dataset_size=len(self.prompts))
        self.plan = self.rl.plan
        self.device = self.rl.device
        if self.ref_model is not None:
            self.ref_model = _reference_engine(self.ref_model, self.rl, self.device)
        self.backend = make_backend(d.rollout, self.rl.engine, tok)
        self.sampler = PromptSampler(len(self.prompts), self.plan.prompts_per_rollout, seed=d.run.seed,
                                     last_rollout=d.run.last_rollout)
        self.pad_id = tok.pad_token_id
        self.algo = algos.resolve_algorithm(d.algorithm)
        self.clip_high = self.algo.clip_high
        self.dynamic_sampling = self.algo.dynamic_sampling
        self.output_dir = d.run.output_dir
        self.ckpt_dir = os.path.join(self.output_dir, CHECKPOINT_SUBDIR)
        self.rollout_index = 0
        self.calls = 0  # mini-batches trained (applied or skipped)
        self.prompts_drawn = 0
        resumed = self._maybe_resume()
        self.metrics = MetricsWriter(self.output_dir, self.rank, getattr(self.rl.engine, "monitor", None),
                                     resume_at=(self.rollout_index, self.rl.optimizer_steps) if resumed else None)

    # -- resume ---------------------------------------------------------------------------------
    def _maybe_resume(self) -> bool:
        mode = self.d.run.resume
        if mode == "never":
            return False
        load_dir = self.ckpt_dir if mode == "auto" else mode
        if not os.path.isdir(load_dir):
            if mode != "auto":
                raise ConfigError(f"dsrl.run.resume = {mode!r}: no such checkpoint directory. Fix: point it at "
                                  f"a run's checkpoints/ directory, or use 'auto' or 'never'.")
            return False
        tag, client, rank_state = self.rl.load_checkpoint(load_dir)
        if tag is None:
            return False
        self.rollout_index = int(client["rollout"])
        self.calls = int(client["calls"])
        self.prompts_drawn = int(client.get("prompts_drawn", 0))
        self.sampler.load_state_dict(client["sampler"])
        if rank_state is not None:
            torch.set_rng_state(rank_state["torch_rng"])
            random.setstate(rank_state["python_rng"])
        if self.rank == 0:
            print(f"dsrl: resumed from {os.path.join(load_dir, tag)} at rollout {self.rollout_index}, "
                  f"optimizer step {self.rl.optimizer_steps}", flush=True)
        return True

    def save(self) -> None:
        tag = f"rollout{self.rollout_index}"
        client = {"rollout": self.rollout_index, "calls": self.calls, "sampler": self.sampler.state_dict(),
                  "prompts_drawn": self.prompts_drawn}
        rank_state = {"torch_rng": torch.get_rng_state(), "python_rng": random.getstate()}
        self.rl.save_checkpoint(self.ckpt_dir, tag, client_state=client, rank_state=rank_state,
                                keep_last=self.d.run.keep_last)

    # -- rollout --------------------------------------------------------------------------------
    def _draw(self) -> tuple[list[int], int]:
        """The next P prompt indices (same on every rank) and this rank's slice start."""
        idx = self.sampler.next_indices()
        self.prompts_drawn += len(idx)
        per = self.plan.prompts_per_rank
        return idx[self.rank * per:(self.rank + 1) * per], per

    def _generate_groups(self, indices: list[int], seed: int) -> list[list[Sample]]:
        d = self.d
        G = self.plan.samples_per_prompt
        records = [self.prompts[i] for i in indices]
        prompt_ids = self._encode(self.tokenizer, [r["prompt"] for r in records], d.data.max_prompt_tokens,
                                  d.data.chat_template) if records else []
        # Called even with no prompts: under ZeRO-3 every rank must enter generate's parameter gather.
        completions = self.backend.generate(prompt_ids, G, seed=seed)
        if not completions:
            return []
        texts = self.tokenizer.batch_decode([c.completion_ids for c in completions], skip_special_tokens=True)
        prompts_rep = [records[c.prompt_index]["prompt"] for c in completions]
        answers_rep = [records[c.prompt_index].get("answer") for c in completions]
        rewards = [float(r) for r in self.reward_fn(prompts_rep, texts, answers_rep)]
        accs = self.accuracy_fn(prompts_rep, texts, answers_rep) if self.accuracy_fn else [None] * len(texts)
        groups: list[list[Sample]] = [[] for _ in indices]
        for c, r, acc in zip(completions, rewards, accs):
            groups[c.prompt_index].append(Sample(
                tokens=list(c.prompt_ids) + list(c.completion_ids), prompt_len=len(c.prompt_ids),
                group=indices[c.prompt_index], reward=r, finished=bool(c.finished), accuracy=acc))
        return groups

    def _shape_rewards(self, samples: list[Sample]) -> None:
        """DAPO overlong shaping and filtering; non-finite rewards mask their sample."""
        a = self.d.algorithm
        if a.overlong_buffer > 0:
            lengths = torch.tensor([s.completion_len for s in samples], dtype=torch.float64)
            pen = algos.overlong_shaping(lengths, self.d.rollout.max_new_tokens, a.overlong_buffer,
                                         a.overlong_penalty)
            for s, p in zip(samples, pen.tolist()):
                s.reward += p
        for s in samples:
            if a.overlong_filter and not s.finished:
                s.active = False
            if not math.isfinite(s.reward):
                s.active = False

    def collect(self) -> tuple[list[Sample], dict[str, float]]:
        """This rank's P/D prompt groups of G samples with shaped rewards (dynamic sampling included);
        advantages come later, after a KL-in-reward penalty (see :meth:`run`)."""
        mine, per = self._draw()
        rounds, kept, spare = 0, [], []
        stats = {"groups_generated": 0.0, "groups_zero_variance": 0.0}
        take = mine
        while True:
            seed = derived_seed(self.d.run.seed, self.rollout_index, rounds, self.rank)
            groups = self._generate_groups(take, seed)
            rounds += 1
            for g in groups:
                self._shape_rewards(g)
                stats["groups_generated"] += 1
                flat = bool(algos.zero_variance_groups(self._masked_rewards(g), len(g))[0])
                stats["groups_zero_variance"] += float(flat)
                (spare if (self.dynamic_sampling and flat) else kept).append(g)
            if not self.dynamic_sampling:
                break
            need = per - len(kept)
            global_need = _all_reduce([max(need, 0)], dist.ReduceOp.MAX, self.device)[0]
            if global_need <= 0 or rounds >= self.d.algorithm.max_sampling_rounds:
                break
            more, _ = self._draw()
            take = more[:max(need, 0)]
        kept = (kept + spare)[:per]  # after the last round, zero-variance groups fill any gap
        stats["sampling_rounds"] = float(rounds)
        return [s for g in kept for s in g], stats

    @staticmethod
    def _masked_rewards(samples: list[Sample]) -> torch.Tensor:
        """Rewards with masked samples as NaN: dsrl.algos leaves them out of every group statistic."""
        return torch.tensor([s.reward if s.active else float("nan") for s in samples], dtype=torch.float64)

    def _advantages(self, samples: list[Sample]) -> None:
        a, G = self.d.algorithm, self.plan.samples_per_prompt
        adv = algos.compute_advantages(a.name, self._masked_rewards(samples), G, normalize_std=self.algo.normalize_std)
        for s, v in zip(samples, adv.tolist()):
            s.advantage = v if (s.active and math.isfinite(v)) else 0.0

    # -- log-probs ------------------------------------------------------------------------------
    def _logprob_fn(self, module_call):
        temp = self.d.rollout.temperature

        def fn(model, micro):
            logits = module_call(model, micro)
            return token_logprobs(logits, micro["targets"], temp).float().cpu()

        return fn

    @staticmethod
    def _forward(model, micro):
        # Packed rows have no attention_mask: transformers derives the block-diagonal mask from position_ids.
        out = model(input_ids=micro["input_ids"], attention_mask=micro.get("attention_mask"),
                    position_ids=micro["position_ids"], use_cache=False)
        return out.logits

    def compute_old_logprobs(self, samples: list[Sample]) -> None:
        """Old (and reference) log-probs of every local sample, once per rollout, before any update;
        with ``kl_in = "reward"`` the reward is penalised by the summed k1 KL here."""
        groups = chunks(samples, self.d.rollout.logprob_micro_batch_size)
        micros = [collate(g, self.pad_id, self.device, with_logprobs=False) for g in groups]
        fn = self._logprob_fn(self._forward)
        outs = self.rl.forward_no_grad(micros, fn)
        for g, lp in zip(groups, outs):
            for s, row, sl in zip(g, lp, completion_positions(g)):
                s.old_logprobs = row[sl].tolist()
        if self.ref_model is not None:
            with torch.no_grad():
                for g, micro in zip(groups, micros):
                    lp = fn(self.ref_model, micro)
                    for s, row, sl in zip(g, lp, completion_positions(g)):
                        s.ref_logprobs = row[sl].tolist()
            if self.d.algorithm.kl_in == "reward":
                coef = self.d.algorithm.kl_coef
                for s in samples:
                    kl = kl_estimate(torch.tensor(s.old_logprobs), torch.tensor(s.ref_logprobs), "k1").sum().item()
                    s.reward -= coef * kl

    # -- training -------------------------------------------------------------------------------
    def loss_fn(self, engine, micro):
        """Per-token loss: clipped surrogate (+ KL in loss) (- entropy bonus), and per-token metrics."""
        a = self.d.algorithm
        logits = self._forward(engine, micro)
        logp = token_logprobs(logits, micro["targets"], self.d.rollout.temperature)
        loss, m = clipped_policy_loss(logp, micro["old_logprobs"], micro["advantages"], a.clip_low, self.clip_high)
        metrics = {"clip_low_frac": m["clip_low_frac"], "clip_high_frac": m["clip_high_frac"]}
        if self.ref_model is not None:
            kl = kl_estimate(logp, micro["ref_logprobs"], a.kl_estimator)
            metrics["kl"] = kl.detach()
            if a.kl_in == "loss":
                loss = loss + a.kl_coef * kl
        if a.entropy_coef > 0:
            ent = token_entropy(logits, self.d.rollout.temperature)
            loss = loss - a.entropy_coef * ent
            metrics["entropy"] = ent.detach()
        else:
            with torch.no_grad():
                metrics["entropy"] = token_entropy(logits.detach(), self.d.rollout.temperature)
        return loss, metrics

    def train_rollout(self, local: list[Sample], on_step) -> list[dict[str, Any]]:
        """E reshuffled passes over the all-gathered rollout; one optimizer step per mini-batch."""
        gathered: list[list[Sample]] = [None] * self.world  # type: ignore[list-item]
        dist.all_gather_object(gathered, local)
        rollout = [s for part in gathered for s in part]
        lengths = [s.length for s in rollout]
        results = []
        seed = derived_seed(self.d.run.seed, self.rollout_index, 0xB47C4)
        for mb in mini_batches(len(rollout), self.plan.mini_batch_size, self.plan.epochs_per_rollout, seed=seed,
                               shuffle=self.d.batch.shuffle):
            packed = self.d.model.packing
            per_rank = partition_mini_batch(mb, lengths, self.plan.data_parallel_size, self.d.batch, packed=packed)
            mine = per_rank[self.rank]
            make = collate_packed if packed else collate
            micros = [make([rollout[i] for i in ids], self.pad_id, self.device) for ids in mine if ids]
            t0 = time.perf_counter()
            res = self.rl.train_mini_batch(micros, self.loss_fn)
            res["step_s"] = time.perf_counter() - t0
            res["padded_tokens"] = sum(int(m["input_ids"].numel()) for m in micros)
            self.calls += 1
            results.append(res)
            on_step(res)
        return results

    # -- the loop -------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        plan = self.plan
        bar = None
        if self.rank == 0 and self.d.run.progress_bar:
            from tqdm.auto import tqdm

            bar = tqdm(total=plan.total_optimizer_steps, initial=self.rl.optimizer_steps, unit="step",
                       desc="dsrl", dynamic_ncols=True)
        if self.rank == 0:
            print(f"dsrl: {plan.rollouts} rollouts x {plan.optimizer_steps_per_rollout} optimizer steps = "
                  f"{plan.total_optimizer_steps} steps on {self.world} rank(s); output {self.output_dir}",
                  flush=True)

        def on_step(res: dict[str, Any]) -> None:
            if bar is not None and res["step_applied"]:
                bar.update(1)
            keys = ("loss", "grad_norm", "lr", "tokens", "sequences", "micro_batches", "step_applied",
                    "clip_low_frac", "clip_high_frac", "kl", "entropy", "step_s")
            rec = {"rollout": self.rollout_index + 1, "call": self.calls, "optimizer_step": res["optimizer_step"],
                   **{k: res[k] for k in keys if k in res}}
            self.metrics.write("step", rec, res["optimizer_step"])

        summary: dict[str, Any] = {}
        start = self.rollout_index
        if start >= plan.rollouts and self.rank == 0:
            print(f"dsrl: {self.output_dir} already holds the finished run ({plan.rollouts} rollouts); nothing to "
                  "do. Use a new --dsrl.run.output_dir or --resume never to start over.", flush=True)
        while self.rollout_index < plan.rollouts:
            t0 = time.perf_counter()
            self.backend.sync_weights()  # no-op for hf; vLLM reloads the policy (every rank calls it)
            local, stats = self.collect()
            self.compute_old_logprobs(local)
            self._advantages(local)
            t1 = time.perf_counter()
            log.debug("rank %d rollout %d: %d local samples (%d masked), %.0f sampling rounds, %.2fs",
                      self.rank, self.rollout_index + 1, len(local), sum(not s.active for s in local),
                      stats["sampling_rounds"], t1 - t0)
            results = self.train_rollout(local, on_step)
            t2 = time.perf_counter()
            self.rollout_index += 1
            summary = self._rollout_record(local, stats, results, t1 - t0, t2 - t1)
            self.metrics.write("rollout", summary, self.rl.optimizer_steps)
            if self.rank == 0 and (self.rollout_index % self.d.run.log_every == 0
                                   or self.rollout_index == plan.rollouts):
                line = self.metrics.rollout_line(summary, plan.rollouts)
                (bar.write(line) if bar is not None else print(line, flush=True))
            last = self.rollout_index == plan.rollouts
            every = self.d.run.save_every
            stop = self.d.run.stop_after_rollouts is not None and self.rollout_index - start >= \
                self.d.run.stop_after_rollouts
            if (every and self.rollout_index % every == 0) or (last and self.d.run.save_final) or stop:
                self.save()
            if stop and not last:
                if self.rank == 0:
                    print(f"dsrl: stopping after {self.d.run.stop_after_rollouts} rollouts of this invocation "
                          f"(run.stop_after_rollouts); resume with --resume auto", flush=True)
                break
        if bar is not None:
            bar.close()
        self.metrics.close()
        return summary

    def _rollout_record(self, local: list[Sample], stats: dict[str, float], results: list[dict[str, Any]],
                        rollout_s: float, train_s: float) -> dict[str, Any]:
        active = [s for s in local if s.active]
        finite = [s.reward for s in local if math.isfinite(s.reward)]
        accs = [s.accuracy for s in local if s.accuracy is not None]
        vec = [len(finite), sum(finite), sum(r * r for r in finite), len(accs), sum(accs),
               len(local), sum(s.completion_len for s in local), len(local) - len(active),
               sum(1 for s in local if not s.finished), stats["groups_generated"], stats["groups_zero_variance"],
               rollout_s, train_s]
        tot = _all_reduce(vec, device=self.device)
        n, s1, s2 = tot[0], tot[1], tot[2]
        mean = s1 / n if n else float("nan")
        std = math.sqrt(max(s2 / n - mean * mean, 0.0)) if n else float("nan")
        tokens = sum(r["tokens"] for r in results)
        applied = [r for r in results if r["step_applied"]]

        def tok_mean(key: str) -> float:
            vals = [(r[key], r["tokens"]) for r in results if key in r]
            w = sum(t for _, t in vals)
            return sum(v * t for v, t in vals) / w if w else float("nan")

        rec = {
            "rollout": self.rollout_index,
            "optimizer_step": self.rl.optimizer_steps,
            "episodes": self.rollout_index * self.plan.rollout_size,
            "prompt_epochs": self.prompts_drawn / len(self.prompts),
            "reward_mean": mean,
            "reward_std": std,
            "accuracy": tot[4] / tot[3] if tot[3] else None,
            "response_len": tot[6] / tot[5] if tot[5] else 0.0,
            "masked_samples": tot[7],
            "truncated_frac": tot[8] / tot[5] if tot[5] else 0.0,
            "zero_variance_groups": tot[10] / tot[9] if tot[9] else 0.0,
            "sampling_rounds": stats["sampling_rounds"],
            "loss": sum(r["loss"] for r in results) / len(results) if results else float("nan"),
            "kl": tok_mean("kl"),
            "entropy": tok_mean("entropy"),
            "clip_low_frac": tok_mean("clip_low_frac"),
            "clip_high_frac": tok_mean("clip_high_frac"),
            "clip_frac": tok_mean("clip_low_frac") + tok_mean("clip_high_frac"),
            "grad_norm": sum(r["grad_norm"] for r in applied) / len(applied) if applied else float("nan"),
            "lr": results[-1]["lr"] if results else float("nan"),
            "skipped_steps": len(results) - len(applied),
            "train_tokens": tokens,
            "tokens_per_s": tokens / train_s if train_s > 0 else 0.0,
            "rollout_s": tot[11] / self.world,
            "train_s": tot[12] / self.world,
        }
        return rec


def _reference_engine(ref: torch.nn.Module, rl: RLEngine, device: Any) -> Any:
    """The frozen KL reference: partitioned like the policy under ZeRO-3, else a plain module copy.

    Under ZeRO-3 a full copy on every rank would defeat the point of ZeRO-3, so the reference is
    wrapped in an optimizer-less DeepSpeed engine (parameters sharded, gathered per forward). Every
    rank then runs the same number of reference forwards, which holds because every rank scores the
    same number of log-prob micro-batches per rollout.
    """
    if rl.zero_stage != 3:
        return ref.to(device)
    import deepspeed

    ds = rl.engine.config if isinstance(getattr(rl.engine, "config", None), dict) else {}
    cfg: dict[str, Any] = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
                           "steps_per_print": 1 << 30}
    for key in ("bf16", "fp16"):
        if isinstance(ds.get(key), dict):
            cfg[key] = {"enabled": bool(ds[key].get("enabled", False))}
    engine, *_ = deepspeed.initialize(model=ref, config=cfg)
    engine.eval()
    return engine


def _match_deepspeed_precision(ds_config: dict[str, Any], dtype: torch.dtype) -> None:
    """A bf16 model trains with DeepSpeed's bf16 mode (fp32 master weights), unless the user said otherwise."""
    if dtype == torch.bfloat16:
        bf16 = ds_config.setdefault("bf16", {})
        if isinstance(bf16, dict) and bf16.get("enabled", "auto") == "auto":
            bf16["enabled"] = True


def _accuracy_fn(data_cfg):
    try:
        from dsrl.data import load_accuracy_fn
    except ImportError:
        return None
    return load_accuracy_fn(data_cfg)
