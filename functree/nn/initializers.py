"""``ft.nn.initializers``: weight initializers (``init(key, shape, dtype) -> array``)."""

from functree.nn._initializers import *  # noqa: F403
from functree.nn._initializers import __all__

TORCH_IN_PLACE = """\
module 'functree.nn.initializers' has no attribute {name!r}: torch's nn.init.{name}(tensor) fills a \
tensor in place; here {stem}(...) is a function the layer draws its weight with:

    wrong:  ft.nn.initializers.{name}(layer.weight)
    right:  ft.nn.Dense(n_in, n_out, key=k, weight_initializer=ft.nn.initializers.{stem}())
       or:  layer = layer.replace(weight=ft.nn.initializers.{stem}()(k, layer.weight.shape, layer.weight.dtype))"""


TORCH_UNIFORM = """\
module 'functree.nn.initializers' has no attribute 'uniform_': torch's nn.init.uniform_(tensor, a, b) \
fills a tensor in place from U(a, b); JAX's uniform(scale) here draws U[0, scale), another \
distribution. A layer draws its weight with a function of (key, shape, dtype):

    wrong:  ft.nn.initializers.uniform_(layer.weight, -0.1, 0.1)
    right:  ft.nn.Dense(n_in, n_out, key=k, weight_initializer=lambda k, s, d: jax.random.uniform(k, s, d, -0.1, 0.1))"""


def __getattr__(name: str):
    """torch's in-place ``nn.init.kaiming_normal_`` names this module's function."""
    if name == "uniform_":
        raise AttributeError(TORCH_UNIFORM)
    stem = name[:-1]
    if name.endswith("_") and stem in __all__:
        raise AttributeError(TORCH_IN_PLACE.format(name=name, stem=stem))
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
