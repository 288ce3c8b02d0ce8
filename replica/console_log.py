"""kvroute's INFO lines on the process's stderr: a server's start-up lines (an engine's
KV cache size) where nothing else configures logging (``kvroute serve-replica``, a Ray
Serve replica, whose stderr Ray keeps in the replica's log and shows on the driver)."""

from __future__ import annotations

import logging
import sys


class _Stderr(logging.StreamHandler):
    """Writes to the ``sys.stderr`` of the moment (a test or Ray may have replaced it)."""

    stream = property(lambda self: sys.stderr, lambda self, value: None)


def log_info_to_stderr() -> None:
    """Show the ``kvroute`` loggers' INFO and above on stderr (once per process)."""
    logger = logging.getLogger("kvroute")
    if not any(isinstance(h, _Stderr) for h in logger.handlers):
        handler = _Stderr()
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)
    if logger.level == logging.NOTSET:  # (a level set on purpose stays)
        logger.setLevel(logging.INFO)
