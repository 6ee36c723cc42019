"""The dtype ``ft.nn``'s layers accumulate in: float32 for bfloat16/float16 values.

Sums over many elements (normalization statistics, pooling windows, a bias's gradient over
every row) lose their low bits in a 16-bit float; the layers sum in :func:`statistics_dtype`
and round only the result.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp

__all__ = ["statistics_dtype"]


def statistics_dtype(dtype: Any) -> Any:
    """float32 for narrower floating dtypes (bfloat16, float16), else ``dtype`` itself.

    Example:
      >>> import jax.numpy as jnp
      >>> statistics_dtype(jnp.bfloat16), statistics_dtype(jnp.float64)
      (dtype('float32'), dtype('float64'))
    """
    dtype = jnp.dtype(dtype)
    return jnp.dtype(jnp.float32) if jnp.finfo(dtype).bits < 32 else dtype
