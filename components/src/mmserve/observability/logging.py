"""One log format for every component: one line per event, request ids in the message."""

from __future__ import annotations

import logging
import os

FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"


def configure_logging() -> None:
    """Info level unless `MMSERVE_LOG_LEVEL` says otherwise."""
    level = os.environ.get("MMSERVE_LOG_LEVEL", "INFO").upper()
    logging.basicConfig(level=level, format=FORMAT)
