"""Convolutions laid out so that XLA's compiler does not abort on them.

XLA's convolution operand swap (``ConvOperandSwapper``, run inside the algebraic simplifier
on the CPU: jaxlib 0.9.2 to 0.12.0.1 at least) may swap the input and the filter of a
convolution whose filter is larger than its input on some axis. It keeps unchanged an axis
it takes for a grouped one: a window of 2, an input dilated by 2 (``lhs_dilation``), stride
1, no padding. The swapped convolution's window no longer fits, XLA's own check fails, and
the **process aborts** (``Check failed: ... Window dimensions do not match RHS shape``): a
notebook's kernel dies. Raw JAX hits it too: ``jax.grad`` of a ``conv_general_dilated``
with a ``(3, 2)`` kernel, strides 2 and padding 1 on a 4 x 4 image.

Such a convolution is what JAX builds for the input gradient of a strided convolution with a
filter of 2, strides 2 and padding 1 before (``pad_before = d (k - 1) - lo = 0``), what
``Fold`` computes (the transpose of ``Unfold``), and a transposed convolution's own forward
with that filter and strides and torch's ``padding=1``. The layers here avoid the axis:

* a convolution (and ``Unfold``) at risk pads its input itself (``jnp.pad``) and convolves
  with ``"VALID"``: the gradient's window is then padded by 1 and the pad's transpose is a
  slice (the same values, :func:`pads_at_risk`);
* a transposed convolution at risk pads each such axis by one more on both sides and crops
  the extra outputs (:func:`dilated_axes_at_risk`).

Both change the program's layout only where the risk is; every other convolution is lowered
as before.

Example:
  >>> pads_at_risk((3, 2), (2, 2), (1, 1), ((1, 1), (1, 1)))
  True
  >>> pads_at_risk((3, 3), (2, 2), (1, 1), ((1, 1), (1, 1)))
  False
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["pads_at_risk", "dilated_axes_at_risk"]


def _unsafe_axis(k: int, d: int, dilated_by: int) -> bool:
    """The axis XLA's swap takes for a grouped one: a window of 2 (undilated) over an input
    dilated by 2 (the stride-1, unpadded part is the caller's)."""
    return k == 2 and d == 1 and dilated_by == 2


def pads_at_risk(kernel: Sequence[int], strides: Sequence[int], dilation: Sequence[int],
                 pads: Sequence[tuple[int, int]]) -> bool:
    """Whether the input gradient of a convolution with these settings (``pads``: ``(low,
    high)`` per axis) has an axis XLA's swap mishandles: a filter of 2 with strides 2 and
    low padding 1 (the gradient's padding before is then ``d (k - 1) - lo = 0``)."""
    return any(_unsafe_axis(k, d, s) and lo == 1 for k, s, d, (lo, _) in zip(kernel, strides, dilation, pads))


def dilated_axes_at_risk(kernel: Sequence[int], strides: Sequence[int], dilation: Sequence[int],
                         pads: Sequence[tuple[int, int]]) -> tuple[int, ...]:
    """The axes of a transposed convolution (its input dilated by ``strides``, padded by
    ``pads``) that XLA's swap mishandles: a filter of 2, strides 2, no padding."""
    return tuple(i for i, (k, s, d, pad) in enumerate(zip(kernel, strides, dilation, pads))
                 if _unsafe_axis(k, d, s) and tuple(pad) == (0, 0))
