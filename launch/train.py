"""Train with dsrl: ``deepspeed [--num_gpus N] launch/train.py --ds_config configs/<name>.json [--dsrl.a.b V ...]``.

Also runs as ``python launch/train.py ...`` (one rank). ``--resume auto|never|DIR`` overrides
``dsrl.run.resume`` (DIR: a run's output directory, its checkpoints/ directory or one checkpoint);
``--overwrite`` is ``--dsrl.run.overwrite true``. Any key of the ``"dsrl"`` section can be overridden
with a dotted flag, e.g. ``--dsrl.batch.samples_per_prompt 8 --dsrl.run.output_dir runs/try2``.

Exit status of each rank: 0 done (or stopped by run.stop_after_rollouts), 2 configuration error (every rank's
problems agreed before any work, printed once by rank 0), 1 run error (a sentence naming what failed; a rank
whose process ended is named by role, rank and host), 128 + signal number when stopped on request. The
``deepspeed`` launcher exits with the first nonzero status it sees among its ranks: dsrl's own when dsrl ended the
run, 256 - N when a rank was killed by signal N (247 for SIGKILL) (docs/reliability.md, "Exit status").
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
from dsrl.core.launchers import adopt as adopt_launch
from dsrl.core.rendezvous import PRINT_GRACE_S, PreflightError
from dsrl.core.timeouts import looks_like_timeout
from dsrl.runtime.peers import current as current_peers
from dsrl.runtime.process_exit import leave
from dsrl.runtime.stop import InterruptedStartup


def _megatron_on_this_host() -> None:
    """Without CUDA, megatron-core runs on the CPU with gloo through the shim beside this script
    (launch/megatron_cpu_shim.py), installed before megatron-core builds anything; with CUDA, nothing."""
    import torch

    if torch.cuda.is_available():
        return
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import megatron_cpu_shim

    megatron_cpu_shim.install()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ds_config", required=True, help="the run file: a ds_config with a \"dsrl\" section")
    parser.add_argument("--resume", default=None,
                        help="auto | never | a run's output directory, its checkpoints/ directory or one checkpoint")
    parser.add_argument("--overwrite", action="store_true",
                        help="start over in an output directory that holds a run (same as --dsrl.run.overwrite true)")
    parser.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # set by the launcher
    args, rest = parser.parse_known_args(argv)
    # Slurm's srun and OpenMPI's mpirun start this script without RANK & co.: derive them from their variables first
    # (dsrl.core.launchers), so that the log prefix, who prints and everything below see this rank's place.
    launch_problem = None
    try:
        adopt_launch()
    except RunError as e:
        launch_problem = e
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
        if launch_problem is not None:
            raise launch_problem
        # the command line and the run file alone (no process group yet): each node's first rank prints their errors
        overrides = parse_override_args(rest)
        if args.overwrite:
            overrides["dsrl.run.overwrite"] = True
        from dsrl.config import load_config

        cfg = load_config(args.ds_config, overrides)
        if cfg.dsrl.engine.kind == "megatron":
            _megatron_on_this_host()
        from dsrl.rl.disagg.roles import GENERATOR, split_world
        from dsrl.rl.trainer import Trainer

        role = split_world(cfg.dsrl)  # disaggregated: the job's last rollout.generator_ranks ranks generate
        if role is not None and role.kind == GENERATOR:
            from dsrl.rl.run.engines import start_generator

            _leave(start_generator(cfg, role).run())
        trainer = Trainer.from_config(cfg, resume=args.resume, role=role)
        trainer.parts.stop.restore_to({signal.SIGTERM: _ending})
        trainer.run()
    except ConfigError as e:
        printer = _prints_config_error(e, quiet, role)
        if printer:
            print(f"dsrl: configuration error: {e}", file=sys.stderr)
        if role is not None:  # trainer 0 before the start: the generators end with this status, silently
            role.abandon(2)
        if not printer:
            _wait_for_the_printer()
        return 2
    except RunError as e:
        printer = not (quiet and e.agreed)
        if printer:
            print(f"dsrl: error: {e}", file=sys.stderr)
        if role is not None:
            role.abandon(1)
        if isinstance(e, CollectiveTimeout) or role is not None:
            # A peer is stuck or gone (a generator, a trainer): tearing the groups down would wait for it. Leave now.
            _leave(1)
        if not printer:
            _wait_for_the_printer(PRINT_GRACE_S if isinstance(e, PreflightError) else 30.0)
        return 1
    except RuntimeError as e:
        if not looks_like_timeout(e):
            raise
        # A collective outside any watched phase lost a peer: name the ranks of this host that ended, if any.
        peers = current_peers()
        found = peers.obituary() if peers is not None else None
        print(f"dsrl: error: {found + '; ' if found else ''}a collective lost a peer or waited past "
              f"dsrl.run.collective_timeout_s ({str(e).splitlines()[0][:200]}); the last committed checkpoint is "
              "intact (resume with --resume auto once every rank is healthy)", file=sys.stderr)
        _leave(1)
    except (InterruptedStartup, KeyboardInterrupt) as e:
        print(f"dsrl: interrupted ({e or 'SIGINT'})", file=sys.stderr)
        return 130 if isinstance(e, KeyboardInterrupt) else 143
    if role is not None:  # a disaggregated job: receives still posted to gone peers must not block the exit
        _leave(trainer.parts.stop.exit_code)
    return trainer.parts.stop.exit_code


def _prints_config_error(e: ConfigError, quiet: bool, role: object) -> bool:
    """Whether this rank prints the configuration error ``e``, so that one rank does: rank 0 when every rank raised
    it (``e.agreed``); before any process group exists (the run file and its overrides, read alike by the ranks of
    a node), the first rank of each node; otherwise the rank that raised it."""
    if e.agreed:
        return not quiet
    if role is None and not torch.distributed.is_initialized():
        return os.environ.get("LOCAL_RANK", "0") == "0"
    return True


def _ending(signum: int, frame: object) -> None:
    """SIGTERM once the run is over (its own handlers are gone, dsrl.runtime.stop): this rank is on its way out, its
    last word (an error naming a lost rank) not yet printed; the launcher's SIGTERM, sent because another rank exited
    first, must not end it silently. It ends on its own within moments (the launcher's SIGKILL follows after 30 s)."""


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
