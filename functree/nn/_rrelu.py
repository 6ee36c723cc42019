"""RReLU: the randomized leaky rectifier (Xu et al. 2015), torch's ``nn.RReLU``."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from functree._module import field
from functree._random import TRAINER_KEY, flat_key
from functree.nn._check import check_input
from functree.nn._mode import Layer

__all__ = ["RReLU"]

BAD_BOUNDS = """\
RReLU needs 0 <= lower <= upper (the range its negative slopes are drawn from), got \
lower={lower}, upper={upper}.

    wrong:  ft.nn.RReLU(lower={lower}, upper={upper})
    right:  ft.nn.RReLU(lower=1 / 8, upper=1 / 3)     # torch's defaults
"""

NO_KEY = """\
RReLU (lower={lower}, upper={upper}) is in training mode and needs a PRNG key to draw its slopes.

    wrong:  model(x)
    right:  model(x, key=jax.random.key(step))       # a fresh key every step
""" + TRAINER_KEY + """\
       or:  ft.nn.inferring(model, x)                 # the fixed slope (lower + upper) / 2
"""


class RReLU(Layer):
    """``y = x`` for ``x > 0``, ``y = a x`` otherwise: torch's ``nn.RReLU(lower, upper)``.

    In training each element draws its own slope ``a ~ U[lower, upper]`` (from ``key=``, as
    ``Dropout``); in inference (the default; see ``ft.nn.training``) ``a = (lower + upper) / 2``
    for every element, torch's ``leaky_relu`` with that slope. The gradient with respect to
    ``x`` is 1 where ``x > 0`` and the element's slope elsewhere (at 0 too, as torch's).
    ``lower``, ``upper`` and ``training`` are static; the layer has no parameters.

    Example:
      >>> import functree as ft, jax, jax.numpy as jnp
      >>> act = ft.nn.RReLU(0.1, 0.3)
      >>> act(jnp.array([-2.0, 3.0]))           # inference: slope 0.2
      Array([-0.4,  3. ], dtype=float32)
      >>> y = ft.nn.training(act)(-jnp.ones(1000), key=jax.random.key(0))
      >>> bool(((-y >= 0.1) & (-y <= 0.3)).all())
      True
    """

    lower: float = field(static=True, default=1.0 / 8.0)
    upper: float = field(static=True, default=1.0 / 3.0)
    training: bool = field(static=True, default=False)

    def __init__(self, lower: float = 1.0 / 8.0, upper: float = 1.0 / 3.0, *, training: bool = False):
        # 0 <= lower: a negative slope flips the sign of a negative input (torch accepts it; the
        # paper's range and torch's docs are in [0, 1)); `not (...)` also refuses NaN
        if not (0.0 <= float(lower) <= float(upper)):
            raise ValueError(BAD_BOUNDS.format(lower=lower, upper=upper))
        self.lower = float(lower)
        self.upper = float(upper)
        self.training = training

    def __call__(self, x: jax.Array, *, key: jax.Array | None = None) -> jax.Array:
        check_input(self, x, ())
        dtype = jnp.result_type(x)
        if not self.training or self.lower == self.upper:
            # the mean in Python's float64, then cast: torch's leaky_relu(x, (lower + upper) / 2)
            slope = jnp.asarray((self.lower + self.upper) / 2.0, dtype)
        else:
            if key is None:
                raise ValueError(NO_KEY.format(lower=self.lower, upper=self.upper))
            slope = jax.random.uniform(flat_key(key), jnp.shape(x), dtype, self.lower, self.upper)
        return jnp.where(x > 0, x, slope * x)  # torch's: at 0 the gradient is the slope
