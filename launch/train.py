"""Train with dsrl: ``deepspeed [--num_gpus N] launch/train.py --ds_config configs/<name>.json [--dsrl.a.b V ...]``.

Also runs as ``python launch/train.py ...`` (one rank). ``--resume auto|never|DIR`` overrides
``dsrl.run.resume``. Any key of the ``"dsrl"`` section can be overridden with a dotted flag, e.g.
``--dsrl.batch.samples_per_prompt 8 --dsrl.run.output_dir runs/try2``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from dsrl.config import ConfigError, parse_override_args


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ds_config", required=True, help="the run file: a ds_config with a \"dsrl\" section")
    parser.add_argument("--resume", default=None, help="auto | never | a checkpoint directory")
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
    try:
        overrides = parse_override_args(rest)
        from dsrl.trainer import Trainer

        trainer = Trainer(args.ds_config, overrides, resume=args.resume)
    except ConfigError as e:
        print(f"dsrl: configuration error: {e}", file=sys.stderr)
        return 2
    trainer.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
