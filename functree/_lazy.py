"""Names a package reads from another module on their first read (PEP 562).

``import functree`` runs the core alone; ``ft.nn``, ``ft.shard`` and ``ft.nn.from_hf`` are
imported when first read. A package declares its table (name -> the module it is read
from) and takes its module ``__getattr__`` and ``__dir__`` from :func:`lazy_names`; a name
whose module is ``<package>.<name>`` is that subpackage itself.

Example:
  >>> import functree
  >>> functree.nn.Dense.__module__   # functree.nn imported on this first read
  'functree.nn._linear'
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any

from functree._foreign_methods import missing_module_attribute

__all__ = ["lazy_names"]


def lazy_names(package: str, table: Mapping[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The module ``__getattr__`` and ``__dir__`` of ``package`` for the names of ``table``:
    each imported on its first read and then kept as a plain module attribute."""

    def __getattr__(name: str) -> Any:
        home = table.get(name)
        if home is None:  # another library's name (ft.filter_jit, ft.nn.Linear) names functree's
            raise missing_module_attribute(package, name)
        module = importlib.import_module(home)
        value = module if home == f"{package}.{name}" else getattr(module, name)
        vars(sys.modules[package])[name] = value  # found once: later reads are plain attributes
        return value

    def __dir__() -> list[str]:
        return sorted({*vars(sys.modules[package]), *table})

    return __getattr__, __dir__
