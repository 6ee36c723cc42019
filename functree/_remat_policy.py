"""Rematerialisation policies: the one check of ``remat=`` / ``policy=`` values, shared by
``ft.with_recomputation_in_pullbacks`` and ``ft.nn.Remat`` / ``ft.nn.Stack(remat=)``.

A value is ``None``/``False`` (off), ``True`` (save nothing but the inputs), the name of a
policy in ``jax.checkpoint_policies`` that is itself a policy (``f(prim, ...)``), or a
policy function. A name of a policy *factory* (``save_only_these_names``, which takes the
names) is refused with the call to write instead.

Example:
  >>> from functree._remat_policy import remat_policy
  >>> remat_policy("dots_saveable")
  'dots_saveable'
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import jax

__all__ = ["remat_policy", "policy_names", "checkpointed", "jax_policy"]

BAD_POLICY = """\
{arg}={given!r} is not a rematerialisation policy. Pass True (save nothing, recompute the \
whole block), the name of a policy in jax.checkpoint_policies, or a policy function:

    wrong:  {wrong}
    right:  {right}
Policy names: {names}."""

FACTORY_POLICY = """\
{arg}={given!r} names a policy factory that takes arguments; call it and pass the policy:

    wrong:  {arg}={given!r}
    right:  {arg}=jax.checkpoint_policies.{given}("name", ...)"""

_REMAT_USAGE = ("ft.nn.Remat(layer, policy={given!r})",
                'ft.nn.Remat(layer, policy="dots_with_no_batch_dims_saveable")\n'
                "       or:  ft.nn.Stack(make, 12, key=k, remat=True)")


@functools.cache
def policy_names() -> list[str]:
    """Names of the policies in ``jax.checkpoint_policies`` usable as is: ``f(prim, ...)``
    or ``f(*_, ...)``; the others (``save_only_these_names(*names)``) are factories."""
    names = []
    for name in dir(jax.checkpoint_policies):
        fn = getattr(jax.checkpoint_policies, name)
        if name.startswith("_") or not callable(fn):
            continue
        try:
            params = list(inspect.signature(fn).parameters)
        except (TypeError, ValueError):
            continue
        if params[:1] in (["prim"], ["_"]):
            names.append(name)
    return names


def remat_policy(remat: Any, *, arg: str = "remat", usage: tuple[str, str] = _REMAT_USAGE) -> Any:
    """Check ``remat`` (None/False: off; True; a ``jax.checkpoint_policies`` name; a policy).

    ``arg`` and ``usage`` (the wrong and right lines, ``{given!r}`` filled in) name the
    caller's argument in the error.
    """
    if remat is None or isinstance(remat, bool):
        return remat
    if isinstance(remat, str):
        if remat in policy_names():
            return remat
        if callable(getattr(jax.checkpoint_policies, remat, None)):
            raise ValueError(FACTORY_POLICY.format(arg=arg, given=remat))
    elif callable(remat):
        return remat
    wrong, right = usage
    raise ValueError(BAD_POLICY.format(arg=arg, given=remat, wrong=wrong.format(given=remat), right=right,
                                       names=", ".join(policy_names())))


def jax_policy(remat: Any) -> Any:
    """The ``policy=`` of ``jax.checkpoint`` for a checked value that is on (True: None)."""
    if isinstance(remat, str):
        return getattr(jax.checkpoint_policies, remat)
    return remat if callable(remat) else None


def checkpointed(fn: Callable[..., Any], remat: Any, *, scan_body: bool = False) -> Callable[..., Any]:
    """``fn`` under ``jax.checkpoint`` with ``remat``'s policy; ``fn`` itself when off.

    Outside a scan, XLA's common-subexpression elimination would merge the backward pass's
    recomputation with the forward pass's values (saving them after all: a tanh chain under
    ``jax.jit(jax.grad)`` keeps 8 tanh, as without remat, where recomputing gives 15), so
    ``prevent_cse=True`` there, JAX's default. A ``lax.scan`` body (``scan_body=True``: a
    Stack's) cannot be merged across iterations; preventing CSE there only costs speed.
    """
    if remat is None or remat is False:
        return fn
    return jax.checkpoint(fn, policy=jax_policy(remat), prevent_cse=not scan_body)
