"""``ft.nn.initializers``: weight initializers (``init(key, shape, dtype) -> array``)."""

from functree.nn._initializers import *  # noqa: F403
from functree.nn._initializers import __all__  # noqa: F401
