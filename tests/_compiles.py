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
def compiled(*, clear: bool = True) -> Iterator[list[str]]:
    """The names of the programs compiled inside the block, every cache cleared first (so
    an eager operation another test ran compiles again here).

    ``clear=False`` keeps JAX's caches, for a block that runs a warm-up first and then
    asserts what the next call compiles (``names.clear()`` after the warm-up): that claim is
    the same with warm caches, and a clear costs the worker more than the block (up to 2 s in
    a worker that ran many tests, and every later test there traces and lowers its eager
    operations again)."""
    if clear:
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
