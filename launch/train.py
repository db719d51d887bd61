"""Train with dsrl: ``deepspeed [--num_gpus N] launch/train.py --ds_config configs/<name>.json [--dsrl.a.b V ...]``.

Also runs as ``python launch/train.py ...`` (one rank). ``--resume auto|never|DIR`` overrides
``dsrl.run.resume`` (DIR: a run's output directory, its checkpoints/ directory or one checkpoint);
``--overwrite`` is ``--dsrl.run.overwrite true``. Any key of the ``"dsrl"`` section can be overridden
with a dotted flag, e.g. ``--dsrl.batch.samples_per_prompt 8 --dsrl.run.output_dir runs/try2``.

Exit status: 0 done (or stopped by run.stop_after_rollouts), 2 configuration error, 1 run error (a
sentence naming what failed), 128 + signal number when stopped on request (docs/reliability.md).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time

import torch.distributed

from dsrl.checkpoint.output_lock import release_all
from dsrl.config import ConfigError, parse_override_args
from dsrl.core.errors import CollectiveTimeout, RunError
from dsrl.runtime.process_exit import leave
from dsrl.runtime.stop import InterruptedStartup


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ds_config", required=True, help="the run file: a ds_config with a \"dsrl\" section")
    parser.add_argument("--resume", default=None,
                        help="auto | never | a run's output directory, its checkpoints/ directory or one checkpoint")
    parser.add_argument("--overwrite", action="store_true",
                        help="start over in an output directory that holds a run (same as --dsrl.run.overwrite true)")
    parser.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # set by the launcher
    args, rest = parser.parse_known_args(argv)
    # dsrl logs to stdout; DSRL_LOG_LEVEL (forwarded to every node through .deepspeed_env) sets its level.
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(asctime)s dsrl rank" + os.environ.get("RANK", "0")
                                           + " %(levelname)s %(message)s"))
    logger = logging.getLogger("dsrl")
    logger.addHandler(handler)
    logger.propagate = False
    logger.setLevel(os.environ.get("DSRL_LOG_LEVEL", "INFO").upper())
    quiet = os.environ.get("RANK", "0") != "0"  # an error every rank agreed on is printed by rank 0 only
    role = None
    try:
        overrides = parse_override_args(rest)
        if args.overwrite:
            overrides["dsrl.run.overwrite"] = True
        from dsrl.config import load_config
        from dsrl.rl.disagg.roles import GENERATOR, split_world
        from dsrl.rl.trainer import Trainer

        cfg = load_config(args.ds_config, overrides)
        role = split_world(cfg.dsrl)  # disaggregated: the job's last rollout.generator_ranks ranks generate
        if role is not None and role.kind == GENERATOR:
            from dsrl.rl.disagg.generator import GeneratorWorker

            _leave(GeneratorWorker(cfg, role).run())
        trainer = Trainer(cfg, resume=args.resume, role=role)
        trainer.run()
    except ConfigError as e:
        if not _prints_config_error(e, quiet, role):
            _wait_for_the_printer()
            if e.agreed:
                return 2
        print(f"dsrl: configuration error: {e}", file=sys.stderr)
        return 2
    except RunError as e:
        if isinstance(e, CollectiveTimeout) or role is not None:
            if not (quiet and e.agreed):
                print(f"dsrl: error: {e}", file=sys.stderr)
            # A peer is stuck or gone (a generator, a trainer): tearing the groups down would wait for it. Leave now.
            _leave(1)
        if quiet and e.agreed:
            _wait_for_the_printer()
            return 1
        print(f"dsrl: error: {e}", file=sys.stderr)
        return 1
    except (InterruptedStartup, KeyboardInterrupt) as e:
        print(f"dsrl: interrupted ({e or 'SIGINT'})", file=sys.stderr)
        return 130 if isinstance(e, KeyboardInterrupt) else 143
    if role is not None:  # a disaggregated job: receives still posted to gone peers must not block the exit
        _leave(trainer.stop.exit_code)
    return trainer.stop.exit_code


def _prints_config_error(e: ConfigError, quiet: bool, role: object) -> bool:
    """Whether this rank prints the configuration error ``e``, so that one rank does: rank 0 when every rank raised
    it (``e.agreed``); before any process group exists (the run file and its overrides, read alike by the ranks of
    a node), the first rank of each node; otherwise the rank that raised it."""
    if e.agreed:
        return not quiet
    if role is None and not torch.distributed.is_initialized():
        return os.environ.get("LOCAL_RANK", "0") == "0"
    return True


def _wait_for_the_printer(bound_s: float = 30.0) -> None:
    """A rank that leaves an error to the rank printing it waits for that rank to end the job: the launcher
    (deepspeed's, torchrun) ends every rank once one exits with an error, and would otherwise kill the printing
    rank if this one exited first. SIGTERM/SIGINT end the wait silently; past ``bound_s`` this rank goes on to exit
    (printing an error that was not agreed itself: the printing rank may not have met it)."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    time.sleep(bound_s)


def _leave(code: int) -> None:
    """End now, without interpreter finalization (:mod:`dsrl.runtime.process_exit`); the output lock is released."""
    leave(code, [release_all])


if __name__ == "__main__":
    _leave(main())
