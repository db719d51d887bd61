"""``python -m dsrl.check`` / ``deepspeed --module dsrl.check --ds_config FILE``: the exactness self-check.

A thin entry kept at this path (architecture §5); the work is :mod:`dsrl.cli.check`'s.
"""

import sys

from dsrl.cli.check import main

if __name__ == "__main__":
    sys.exit(main())
