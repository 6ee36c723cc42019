"""``ft.cast``: a model with its floating parameters in another dtype (mixed precision)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from functree._parameters import floats_as_arrays, parameters, with_parameters
from functree.nn._state import follow
from functree.parallel._rules import check_compute_dtype

__all__ = ["cast", "cast_floating"]


def cast(tree: Any, dtype: Any) -> Any:
    """``tree`` with every floating *parameter* leaf cast to ``dtype``.

    Parameters are the leaves of ``ft.parameters(tree)``: integer and boolean leaves,
    ``no_derivative`` fields (BatchNorm statistics) and static fields are left as they are,
    and so are complex parameters (no complex bfloat16: a cast would drop the imaginary part).
    Differentiating through ``cast`` gives gradients in the original dtype, which is how a
    float32 master copy trains in bfloat16: ``loss_fn(ft.cast(model, jnp.bfloat16), x)``.
    Inside ``ft.nn.collect_state`` the cast layers record their state (BatchNorm's
    statistics, computed in float32) at the key paths of the model's own layers.

    Example:
      >>> import functree as ft, jax, jax.numpy as jnp
      >>> bn = ft.nn.BatchNorm(3)
      >>> half = ft.cast(bn, jnp.bfloat16)
      >>> half.scale.dtype, half.running_mean.dtype
      (dtype(bfloat16), dtype('float32'))
    """
    dtype = check_compute_dtype(dtype, "ft.cast(model, ")
    view = parameters(tree)
    # Real parameters only: a complex one has no bfloat16 form (astype drops its imaginary part).
    # (a Python float field, ``bias: float = 0.0``, is a trained parameter: an array here, cast)
    out = with_parameters(tree, jax.tree.map(
        lambda p: p.astype(dtype) if jnp.issubdtype(p.dtype, jnp.floating) else p, floats_as_arrays(view)))
    follow(tree, out)  # under ft.nn.collect_state: the cast layers record at the model's key paths
    return out


def cast_floating(tree: Any, dtype: Any) -> Any:
    """Every floating array leaf of ``tree`` (inputs of a batch) cast to ``dtype``."""

    def one(x: Any) -> Any:
        if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != dtype:
            return jnp.asarray(x).astype(dtype)
        return x

    return jax.tree.map(one, tree)
