"""dsrl's exactness self-check for a run file of either engine: ``deepspeed [--num_gpus N] launch/check.py --ds_config
FILE [dsrl.check's flags]``.

``dsrl.check`` itself (``deepspeed --module dsrl.check``) checks DeepSpeed run files anywhere and Megatron run files
(``dsrl.engine.kind = "megatron"``) on CUDA; this entry also runs the latter without CUDA, through the CPU shim
beside it (launch/megatron_cpu_shim.py, installed before megatron-core is imported, as launch/train.py does).
"""

from __future__ import annotations

import os
import sys

import torch


def _megatron_without_cuda(argv: list[str]) -> bool:
    import argparse

    from dsrl.config import load_config

    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--ds_config")
    known, _ = parser.parse_known_args(argv)
    return (known.ds_config is not None and not torch.cuda.is_available()
            and load_config(known.ds_config).dsrl.engine.kind == "megatron")


if __name__ == "__main__":
    from dsrl.runtime.process_exit import leave

    if _megatron_without_cuda(sys.argv[1:]):
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import megatron_cpu_shim

        megatron_cpu_shim.install()
    from dsrl.cli.check import main

    leave(main())  # no interpreter finalization beside gloo threads (dsrl/runtime/process_exit.py)
