"""``python -m dsrl.check`` / ``deepspeed --module dsrl.check --ds_config FILE``: the exactness self-check.

A thin entry kept at this path (architecture §5); the work is :mod:`dsrl.cli.check`'s.
"""

from dsrl.cli.check import main
from dsrl.runtime.process_exit import leave

if __name__ == "__main__":
    leave(main())  # no interpreter finalization beside gloo threads (dsrl/runtime/process_exit.py)
