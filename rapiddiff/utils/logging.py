"""One logger namespace, ``rapiddiff.*``; the CLI decides the level and the handler."""

from __future__ import annotations

import logging


def get_logger(name: str) -> logging.Logger:
    """``get_logger(__name__)`` in every module; messages go to stderr via :func:`setup_logging`."""
    return logging.getLogger(name if name.startswith("rapiddiff") else f"rapiddiff.{name}")


def setup_logging(verbose: int = 0) -> None:
    level = logging.WARNING if verbose < 0 else logging.INFO if verbose == 0 else logging.DEBUG
    root = logging.getLogger("rapiddiff")
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        root.addHandler(handler)
        # Our handler prints rapiddiff's messages; a library that configures the root logger
        # (pykeen's evaluation does) must not print them a second time.
        root.propagate = False
    root.setLevel(level)
