"""The programs XLA compiles while a block runs, by name (``jit(flat)``, ``jit(stage)``)."""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Iterator

import jax


class _Names(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.names: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        found = re.match(r"Compiling (\S+)", record.getMessage())
        if found:
            self.names.append(found.group(1))


@contextlib.contextmanager
def compiled() -> Iterator[list[str]]:
    """The names of the programs compiled inside the block, every cache cleared first (so
    an eager operation another test ran compiles again here)."""
    jax.clear_caches()
    handler, logger = _Names(), logging.getLogger("jax")
    level, propagate = logger.level, logger.propagate
    logger.addHandler(handler)
    logger.setLevel(logging.WARNING)
    logger.propagate = False  # (JAX logs each compile at WARNING under log_compiles)
    try:
        with jax.log_compiles(True):
            yield handler.names
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.propagate = propagate
