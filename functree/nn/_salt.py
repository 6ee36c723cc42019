"""Keys a layer draws from its stored key (HF ports' ``dropout_key``, LoRA's dropout), salted
per microbatch and per device: ``salted_keys`` opens a context, ``salted`` folds its salts in."""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any

import jax


class _Salts(threading.local):
    """The open contexts' salts, outermost first: each thread its own (set up on first use)."""

    def __init__(self) -> None:
        self.stack: list[Any] = []


_SALTS = _Salts()


@contextlib.contextmanager
def salted_keys(salt: Any) -> Iterator[None]:
    """While open, every key a layer draws from its stored key (:func:`salted`: HF ports'
    ``dropout_key``, LoRA's) has ``salt`` folded in, after the salts of the contexts around it.

    The accumulation loop opens one per microbatch (its index) and a data-parallel step one
    per device (its index on the data axis): each then draws masks of its own, as torch
    does, where the stored key alone would repeat them. The key a layer records as its next
    ``dropout_key`` is not salted, so a job's keys do not depend on the number of
    microbatches or devices; with no context open, nothing changes.

    Example:
      >>> import jax
      >>> from functree.nn._salt import salted, salted_keys
      >>> key = jax.random.key(0)
      >>> with salted_keys(1):
      ...     inside = salted(key)
      >>> bool((jax.random.key_data(inside) == jax.random.key_data(jax.random.fold_in(key, 1))).all())
      True
      >>> salted(key) is key
      True
    """
    salts = _SALTS.stack
    salts.append(salt)
    try:
        yield
    finally:
        salts.pop()


def salted_call(fn: Callable[..., Any], salt: Any) -> Callable[..., Any]:
    """``fn`` run inside :func:`salted_keys` ``(salt)``: the accumulation loop's loss of
    microbatch ``i``, its own dropout masks, as ``fold_in(key, i)`` gives a ``key=`` loss its own."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        with salted_keys(salt):
            return fn(*args, **kwargs)

    return run


def salted(key: jax.Array) -> jax.Array:
    """``key`` with the open :func:`salted_keys` contexts' salts folded in, outermost first:
    ``fold_in(fold_in(key, s_1), s_2)``; ``key`` itself when none is open. Called on a key
    drawn from a layer's stored key, never on a key the caller passed (already folded)."""
    for salt in _SALTS.stack:
        key = jax.random.fold_in(key, salt)
    return key
