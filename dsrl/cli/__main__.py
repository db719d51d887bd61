"""``python -m dsrl.cli`` is the ``dsrl`` command."""

import sys

from dsrl.cli.main import main

sys.exit(main())
