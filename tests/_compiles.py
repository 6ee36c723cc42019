"""The programs XLA compiles while a block runs, by name (``jit(flat)``, ``jit(stage)``)."""

from __future__ import annotations

import contextlib
import itertools
import logging
import re
from collections.abc import Iterator

import jax

# A value of this context is part of every key of JAX's tracing, lowering and compilation
# caches (jax.make_user_context), so a block run under a value of its own finds none of the
# programs compiled before it and compiles each as a fresh process would, while those
# programs stay cached for the code after the block. (`jax.clear_caches()` did the same by
# dropping every cached program: seconds in a worker that had run a hundred files, and each
# eager operation of the tests after it traced and lowered again.)
_FRESH = jax.make_user_context(0)
_BLOCKS = itertools.count(1)


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
    """The names of the programs compiled inside the block, as if none had been compiled
    before it (so an eager operation another test ran compiles again here)."""
    handler, logger = _Names(), logging.getLogger("jax")
    level, propagate = logger.level, logger.propagate
    logger.addHandler(handler)
    logger.setLevel(logging.WARNING)
    logger.propagate = False  # (JAX logs each compile at WARNING under log_compiles)
    try:
        with _FRESH(next(_BLOCKS)), jax.log_compiles(True):
            yield handler.names
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.propagate = propagate
