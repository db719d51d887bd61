"""``dsrl eval --ds_config FILE --model DIR [--out DIR] [--json] [--dsrl.x.y V ...]``: the run file's ``eval`` section
on a model, with the metrics an evaluation during training writes (:mod:`dsrl.rl.evaluation`).

``--model`` is a Hugging Face model directory (a run's ``final_model``, or ``dsrl export``'s output) or a dsrl
checkpoint (a run's output directory, its ``checkpoints/`` directory or one checkpoint), which rank 0 first exports
to a temporary model directory (LoRA adapters merged; the ranks must share its file system: one node).

On one rank (``dsrl eval ...``) or N (``deepspeed --num_gpus N --module dsrl.cli eval ...``): the prompts are split
over the ranks and each is evaluated once; every rank holds the whole model on its device in the run's dtype (no
DeepSpeed engine: evaluation needs no optimizer state) and generates with the run's ``rollout.backend`` under the
evaluation's sampling. ``eval.every`` plays no part: the command evaluates once. The row is the training one (its
``rollout`` is the checkpoint's, null for a model directory) plus ``model``: one console line; with ``--json`` the
row as JSON on stdout; with ``--out DIR`` appended to ``DIR/metrics.jsonl`` (and with ``dsrl.eval.log_samples`` the
completions to ``DIR/eval_samples.jsonl``). Exit status: 0, 2 (configuration
error), 1 (run error).
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import logging
import os
import re
import shutil
import sys
import tempfile
from typing import Any

from dsrl.config import ConfigError, DsrlConfig, load_config, parse_override_args
from dsrl.core import collectives
from dsrl.core.errors import RunError

log = logging.getLogger("dsrl.cli.evaluate")
WEIGHT_FILES = ("*.safetensors", "*.bin", "*.safetensors.index.json")


def is_model_dir(path: str) -> bool:
    """A Hugging Face model directory: a config.json beside weight files (a dsrl checkpoint holds its config in hf/,
    its weights in DeepSpeed's files)."""
    return os.path.isfile(os.path.join(path, "config.json")) and any(
        glob.glob(os.path.join(path, pattern)) for pattern in WEIGHT_FILES)


def resolve_model(path: str, scratch: str) -> tuple[str, int | None]:
    """``(model directory, the checkpoint's rollout or None)`` for ``--model`` (module docstring); a checkpoint is
    exported under ``scratch``. Run on rank 0."""
    if not os.path.exists(path):
        raise ConfigError(f"--model {path!r}: no such directory. Fix: give a model directory (a run's final_model) or "
                          "a run's output directory or checkpoint.")
    if is_model_dir(path):
        return path, None
    from dsrl.checkpoint.export import export_checkpoint, resolve

    try:
        _, tag = resolve(path)
    except ConfigError as e:
        raise ConfigError(f"--model {path!r} is neither a model directory (config.json and weights) nor a dsrl "
                          f"checkpoint: {e}") from None
    out = export_checkpoint(path, os.path.join(scratch, "model"), overwrite=True)
    found = re.fullmatch(r"rollout(\d+)", tag)
    return out, int(found.group(1)) if found else None


def evaluate(cfg_dsrl: DsrlConfig, model_dir: str, rollout: int | None,
             samples_path: str | None = None) -> dict[str, Any] | None:
    """One evaluation of the model in ``model_dir`` on every rank (collective) with ``cfg_dsrl``'s eval, data, rollout
    and model sections (its model section's path replaced by ``model_dir``, without adapters); the row on rank 0,
    else None."""
    from dsrl.backends.deepspeed.engine import on_gpu
    from dsrl.core.parallel import ParallelView
    from dsrl.rl.data.evalset import load_eval_prompts
    from dsrl.rl.episodes.environment import load_environment
    from dsrl.rl.evaluation import EvalSettings, Evaluator
    from dsrl.rl.policy.rollout_side import RolloutSide, RolloutSideSettings
    from dsrl.rl.rewards.functions import load_accuracy_fn, load_reward_fn
    from dsrl.rl.rewards.scoring import Scorer
    from dsrl.runtime.context import RunContext

    d = cfg_dsrl.model_copy(update={"model": cfg_dsrl.model.model_copy(update={"path": model_dir, "lora": None})})
    rank, world, gpu = collectives.rank(), collectives.world(), on_gpu()
    problem: BaseException | None = None
    try:
        if d.data.reward_model is not None:
            raise ConfigError("dsrl.data.reward_model is set, but dsrl eval scores without the training engine the "
                              "reward model is placed with. Fix: pass --dsrl.data.reward_model null (accuracy and the "
                              "rule reward are evaluated), or evaluate during training (dsrl.eval.every).")
        side = RolloutSide(RolloutSideSettings.of(d), gpu)
        prompts = load_eval_prompts(d.eval, d.data, d.run.seed, side.tokenizer, asked_by="dsrl eval")
        reward_fn = load_reward_fn(d.data) if d.data.has_rule_reward else None
        scorer = Scorer(d.data, side.tokenizer, reward_fn, load_accuracy_fn(d.data))
        environment = load_environment(d.data)
        side.build_model()
        side.check()
    except (ConfigError, RunError) as e:
        problem = e
    collectives.agree(problem)
    model = side.on_generator_device()
    device = next(model.parameters()).device
    per_call = d.rollout.generation_batch_size
    backend = side.backend(model, per_call)
    view = ParallelView(None, 1.0, world, rank)
    episodes = None
    if environment is not None:
        from dsrl.rl.episodes.driver import EpisodeRunner
        from dsrl.rl.episodes.environment import ObservationEncoder

        tok = side.tokenizer
        episodes = EpisodeRunner(backend, tok, environment, ObservationEncoder(tok, d.data.chat_template),
                                 d.rollout.max_turns, d.rollout.max_trajectory_tokens, view, device)
    evaluator = Evaluator(EvalSettings.of(d, rollouts=0), prompts, backend, scorer, side.tokenizer, view, device,
                          per_call, context=RunContext(rank, world), episodes=episodes, samples_path=samples_path)
    try:
        record = evaluator.run(rollout)
    finally:
        backend.close()
    assert record is not None  # no stop control here: an evaluation always completes
    return record if rank == 0 else None


def _evaluate_on_every_rank(d: DsrlConfig, model: str, samples_path: str | None = None) -> dict[str, Any] | None:
    """Join the job's ranks, resolve ``--model`` (rank 0), evaluate (every rank); the row on rank 0."""
    from dsrl.backends.deepspeed.engine import ensure_distributed

    ensure_distributed(d.run.join_timeout_s, d.run.collective_timeout_s)
    scratch = tempfile.mkdtemp(prefix="dsrl-eval-") if collectives.rank() == 0 else ""
    try:
        model_dir, rollout = collectives.on_rank0(lambda: resolve_model(model, scratch))
        return evaluate(d, model_dir, rollout, samples_path)
    finally:
        collectives.barrier()
        if scratch:
            shutil.rmtree(scratch, ignore_errors=True)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="dsrl eval", description="Evaluate a model on a run file's eval section.")
    parser.add_argument("--ds_config", required=True, help="the run file (its eval, data, rollout and model sections)")
    parser.add_argument("--model", required=True, help="a model directory, or a run's output directory / checkpoint")
    parser.add_argument("--out", default=None, help="append the row to OUT/metrics.jsonl (and with "
                                                    "dsrl.eval.log_samples the completions to OUT/eval_samples.jsonl)")
    parser.add_argument("--json", action="store_true", help="print the row as one JSON object")
    parser.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # set by the launcher
    args, rest = parser.parse_known_args(argv)
    cfg = load_config(args.ds_config, parse_override_args(rest))
    try:
        with contextlib.redirect_stdout(sys.stderr):  # the libraries' notices: stdout holds the result alone
            samples = os.path.join(args.out, "eval_samples.jsonl") if args.out else None
            record = _evaluate_on_every_rank(cfg.dsrl, args.model, samples)
    except (ConfigError, RunError) as e:
        if getattr(e, "agreed", False) and collectives.rank() != 0:
            return 2 if isinstance(e, ConfigError) else 1  # every rank has it: rank 0 prints it
        raise
    if record is None:
        return 0
    record["model"] = args.model
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "metrics.jsonl"), "a", encoding="utf-8") as f:
            f.write(json.dumps({"event": "eval", **record}) + "\n")
    if args.json:
        print(json.dumps({"event": "eval", **record}, indent=1))
    else:
        from dsrl.rl.evaluation import eval_line

        print(eval_line(record), file=sys.stdout)
    return 0
