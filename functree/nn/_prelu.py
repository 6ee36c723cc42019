"""PReLU: a rectifier whose negative slope is learned (He et al. 2015)."""

from __future__ import annotations

import operator
from typing import Any

import jax
import jax.numpy as jnp

from functree._module import field
from functree._repr import short_array
from functree.nn._check import LayerInputError, check_input, check_unbatched
from functree.nn._mode import Layer
from functree.nn._window import is_int

__all__ = ["PReLU"]

BAD_CHANNELS = ("Pass inputs whose channel axis ({axis}) has num_parameters = {n} entries, or build the layer "
                "for the channels you have (torch's channel axis is 1: channel_axis=1 for a channels-first input).")

BAD_NUM_PARAMETERS = """\
ft.nn.PReLU: num_parameters={given!r}; it is an int >= 1, the number of slopes: 1 (one for every \
element) or the number of channels (one each), as torch's nn.PReLU's.

    wrong:  ft.nn.PReLU({given!r})
    right:  ft.nn.PReLU(1)      # one slope
       or:  ft.nn.PReLU(64)     # one slope per channel of a [..., 64] input"""


class PReLU(Layer):
    """``y = max(0, x) + slope * min(0, x)``: torch's ``nn.PReLU``, the slope learned.

    ``num_parameters`` is 1 (one slope for every element) or the number of channels (one
    slope each), starting at ``init`` (0.25). Channels are the last axis
    (``channel_axis=-1``: functree's layers are channels-last); torch's are axis 1, which is
    the last of a ``[N, C]`` input only: ``channel_axis=1`` reads a channels-first
    ``[N, C, ...]`` input as torch does. ``slope`` is torch's ``weight`` (the state-dict
    port converts the name); it takes no weight decay (torch's docs advise none).

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> act = ft.nn.PReLU(2, init=0.1)
      >>> act(jnp.array([[-1.0, -2.0], [3.0, 4.0]]))
      Array([[-0.1, -0.2],
             [ 3. ,  4. ]], dtype=float32)
    """

    slope: jax.Array = field(decay=False)
    channel_axis: int = field(static=True, default=-1)

    def __init__(self, num_parameters: int = 1, init: float = 0.25, *, channel_axis: int = -1,
                 dtype: Any = jnp.float32):
        if not is_int(num_parameters) or num_parameters < 1:  # 0 and -1 failed inside jnp (full, reshape)
            raise ValueError(BAD_NUM_PARAMETERS.format(given=num_parameters))
        self.slope = jnp.full((int(num_parameters),), init, dtype)
        self.channel_axis = operator.index(channel_axis)

    def __call__(self, x: jax.Array) -> jax.Array:
        check_unbatched(self, slope=1)  # an ensemble's: [models, 1] read as one slope per channel
        check_input(self, x, ())
        slope = self.slope.astype(jnp.result_type(x))
        n = slope.shape[0]
        if n > 1:
            axis = self.channel_axis
            if jnp.ndim(x) == 0 or not -x.ndim <= axis < x.ndim or x.shape[axis] != n:
                raise LayerInputError(self, f"[..., {n}] on axis {axis} (float)", short_array(x),
                                      BAD_CHANNELS.format(axis=axis, n=n))
            slope = jax.lax.broadcast_to_rank(slope.reshape((n,) + (1,) * (x.ndim - axis % x.ndim - 1)), x.ndim)
        else:  # one slope: a scalar, so a scalar input stays a scalar (a [1] slope made it [1])
            slope = slope.reshape(())
        return jnp.where(x > 0, x, slope * x)  # torch's: at 0 the gradient is the slope
