"""Commands: ``dsrl plan | export | plot`` (:mod:`.main`; the plan's memory per phase: :mod:`.memory`), the
exactness self-check's work
(:mod:`.check`, entered as ``python -m dsrl.check``), and the multi-node environment and preflight
(``python -m dsrl.cli.launch_env``).

May import: anything in dsrl (it sits on top).
"""

from dsrl.cli.main import main

__all__ = ["main"]
