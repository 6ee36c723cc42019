"""``ft.losses.WeightedMean(total, count)``: a mean kept as its numerator and denominator,
so that means over microbatches (``accumulate=k``) are exact: ``Σ total_i / Σ count_i``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from functree._repr import shown_repr

__all__ = ["WeightedMean", "ratio", "loss_value", "loss_count", "WEIGHTED_MEAN_NOT_SCALAR", "BAD_TOTAL", "BAD_COUNT", "IMMUTABLE"]

WEIGHTED_MEAN_NOT_SCALAR = """\
{what} needs a scalar, but got a ft.losses.WeightedMean(total, count) (a loss returned with \
reduction="weighted"): its value is .value (total / count). The optimizer reads the record \
itself (accumulate=k weighs each microbatch by its count); anywhere else take its value:

    wrong:  ft.gradient(loss_fn, at=model)            # loss_fn returns reduction="weighted"
    right:  ft.gradient(lambda m, *b: loss_fn(m, *b).value, at=model)
       or:  loss = ft.losses.softmax_cross_entropy(logits, labels)   # the mean itself
"""

BAD_TOTAL = """\
WeightedMean: total must be a floating scalar (the kept positions' summed loss), got {given}.

    wrong:  ft.losses.WeightedMean(values, keep.sum())
    right:  ft.losses.WeightedMean(jnp.sum(values * keep), keep.sum())
"""

BAD_COUNT = """\
WeightedMean: count must be a scalar (the number of kept positions), got shape {given}.

    wrong:  ft.losses.WeightedMean(total, keep)
    right:  ft.losses.WeightedMean(total, keep.sum())
"""

IMMUTABLE = """\
WeightedMean is immutable (set {name!r}): build another.

    wrong:  w.total = w.total + penalty
    right:  w = ft.losses.WeightedMean(w.total + penalty * w.count, w.count)
"""


@jax.tree_util.register_pytree_node_class
class WeightedMean:
    """A mean as its two parts: ``value = total / count`` (0 when ``count`` is 0), the
    derivative flowing through ``total`` alone (``count``, the number of kept tokens or
    examples, holds none: ``jax.lax.stop_gradient``).

    What ``reduction="weighted"`` returns (``ft.losses.softmax_cross_entropy(logits,
    labels, reduction="weighted")``: the summed loss of the kept positions and their
    number). A loss function may return it where it returns a scalar loss (alone or as
    the first item of ``(loss, aux)``): :class:`ft.optim.Optimizer` differentiates its
    value, and with ``accumulate=k`` combines the microbatches as ``Σ_i ∇total_i / Σ_i
    count_i``, the whole minibatch's gradient, where the mean of the microbatches' means
    weighs a microbatch of 2 kept tokens as one of 200 (Hugging Face's
    ``num_items_in_batch``). The step's loss is the value ``Σ total_i / Σ count_i``.

    It is a pytree (two leaves: ``total``, ``count``), not an array: arithmetic, ``float``,
    ``jnp.asarray`` and the differential operators raise :data:`WEIGHTED_MEAN_NOT_SCALAR`
    (take ``.value``; add a penalty to ``total``, scaled by ``count``, to keep the parts).

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> logits = jnp.array([[2.0, 0.0], [0.0, 2.0], [1.0, 1.0]])
      >>> w = ft.losses.softmax_cross_entropy(logits, jnp.array([0, -100, 1]), reduction="weighted")
      >>> w.count, w.value
      (Array(2., dtype=float32), Array(0.41..., dtype=float32))
      >>> ft.losses.softmax_cross_entropy(logits, jnp.array([0, -100, 1]))
      Array(0.41..., dtype=float32)
    """

    __slots__ = ("count", "total")
    total: Any
    count: Any

    def __init__(self, total: Any, count: Any) -> None:
        total = jnp.asarray(total)
        if not jnp.issubdtype(total.dtype, jnp.inexact) or total.shape != ():
            raise TypeError(BAD_TOTAL.format(given=f"{total.dtype}{list(total.shape)}"))
        count = jnp.asarray(count)
        if count.shape != ():
            raise TypeError(BAD_COUNT.format(given=list(count.shape)))
        object.__setattr__(self, "total", total)
        object.__setattr__(self, "count", jax.lax.stop_gradient(count.astype(total.dtype)))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(IMMUTABLE.format(name=name))

    @property
    def value(self) -> jax.Array:
        """``total / count``, 0 where ``count`` is 0 (every label ignored), as the mean's."""
        return ratio(self.total, self.count)

    def tree_flatten(self) -> tuple[tuple[Any, Any], None]:
        return (self.total, self.count), None

    @classmethod
    def tree_unflatten(cls, aux: Any, children: Any) -> WeightedMean:
        out = object.__new__(cls)  # no checks: JAX rebuilds it from tracers, stacked leaves, placeholders
        object.__setattr__(out, "total", children[0])
        object.__setattr__(out, "count", children[1])
        return out

    def __repr__(self) -> str:  # (a donated record's arrays as <deleted f32[]>: shown_repr)
        return f"WeightedMean(total={shown_repr(self.total)}, count={shown_repr(self.count)})"

    def _refuse(self, *_: Any, **__: Any) -> Any:
        raise TypeError(WEIGHTED_MEAN_NOT_SCALAR.format(what="This operation"))

    __array__ = __jax_array__ = __float__ = __index__ = __bool__ = _refuse
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _refuse
    __truediv__ = __rtruediv__ = __pow__ = __neg__ = __lt__ = __gt__ = __le__ = __ge__ = _refuse


@jax.jit  # one program where it runs eagerly (WeightedMean.value in a notebook cell), not five
def ratio(numerator: Any, denominator: Any) -> jax.Array:
    """``numerator / denominator``, 0 where ``denominator`` is 0 (no label kept: the mean of
    nothing), with a finite gradient there (the division never sees the 0).

    Example:
      >>> import jax.numpy as jnp
      >>> from functree.losses._weighted import ratio
      >>> ratio(jnp.float32(3.0), jnp.float32(2.0)), ratio(jnp.float32(3.0), jnp.float32(0.0))
      (Array(1.5, dtype=float32), Array(0., dtype=float32))
    """
    some = denominator != 0
    safe = jnp.where(some, denominator, jnp.ones((), jnp.result_type(denominator)))
    return jnp.where(some, numerator / safe, jnp.zeros((), jnp.result_type(numerator)))


def loss_value(loss: Any) -> Any:
    """``loss.value`` for a :class:`WeightedMean`, ``loss`` itself otherwise (unchanged)."""
    return loss.value if isinstance(loss, WeightedMean) else loss


def loss_count(loss: Any) -> Any:
    """``loss.count`` for a :class:`WeightedMean`, None otherwise."""
    return loss.count if isinstance(loss, WeightedMean) else None
