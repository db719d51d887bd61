"""The console while a run shows its progress bar: dsrl's log records go through tqdm, so lines never break the bar."""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def log_through(bar: Any) -> Iterator[None]:
    """Route dsrl's log records through tqdm while ``bar`` is shown (so lines do not break the bar);
    give the ``dsrl`` logger a stdout handler when nothing configured logging."""
    logger = logging.getLogger("dsrl")
    if not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("dsrl: %(message)s"))
        logger.addHandler(handler)
        if logger.level == logging.NOTSET:
            logger.setLevel(logging.INFO)
    if bar is None:
        yield
        return
    from tqdm.contrib.logging import logging_redirect_tqdm

    with logging_redirect_tqdm(loggers=[logger]):
        yield
