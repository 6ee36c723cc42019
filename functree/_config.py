"""Global switches: ``ft.config``.

``ft.config.diagnostics`` turns the differentiation diagnostics on (the default) or off.
The environment variable ``FUNCTREE_DIAGNOSTICS=0`` turns them off at import.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

__all__ = ["Config", "config"]

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")

BAD_ENVIRONMENT = """\
{name}={value!r} is not a switch. Use one of {true} (on) or {false} (off):

    export {name}=0    # diagnostics off
"""

BAD_OPTION = """\
ft.config.{name} takes True or False; got {value!r}.

    wrong:  ft.config.{name} = {value!r}
    right:  ft.config.{name} = False
"""

UNKNOWN_OPTION = "ft.config has no option {name!r}; its options are {options}."


def _environment_flag(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    if value is None or value.strip() == "":
        return default
    if value.strip().lower() in _TRUE:
        return True
    if value.strip().lower() in _FALSE:
        return False
    raise ValueError(BAD_ENVIRONMENT.format(name=name, value=value, true=_TRUE, false=_FALSE))


class Config:
    """functree's global options.

    Attributes:
      diagnostics: run the differentiation diagnostics (activity analysis on the jaxpr of
        every differentiated function, once per traced signature). Default ``True``;
        ``FUNCTREE_DIAGNOSTICS=0`` in the environment turns it off.

    Example:
      >>> import functree as ft
      >>> ft.config.diagnostics
      True
      >>> with ft.config.override(diagnostics=False):
      ...     ft.config.diagnostics
      False
    """

    __slots__ = ("_diagnostics",)
    _OPTIONS = ("diagnostics",)

    def __init__(self) -> None:
        self._diagnostics = _environment_flag("FUNCTREE_DIAGNOSTICS", True)

    @property
    def diagnostics(self) -> bool:
        return self._diagnostics

    @diagnostics.setter
    def diagnostics(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise TypeError(BAD_OPTION.format(name="diagnostics", value=value))
        self._diagnostics = value

    @contextlib.contextmanager
    def override(self, **options: Any) -> Iterator[Config]:
        """Set options inside a ``with`` block; restore them after."""
        for name in options:
            if name not in self._OPTIONS:
                raise AttributeError(UNKNOWN_OPTION.format(name=name, options=list(self._OPTIONS)))
        saved = {name: getattr(self, name) for name in options}
        try:
            for name, value in options.items():
                setattr(self, name, value)
            yield self
        finally:
            for name, value in saved.items():
                setattr(self, name, value)

    def __repr__(self) -> str:
        items = ", ".join(f"{n}={getattr(self, n)!r}" for n in self._OPTIONS)
        return f"ft.config({items})"


config = Config()
"""functree's global switches (one :class:`Config`): set an option, or change it for a
``with`` block. ``diagnostics`` (on by default; ``FUNCTREE_DIAGNOSTICS=0`` turns it off at
import) runs the differentiation diagnostics.

Example:
  >>> import functree as ft
  >>> ft.config.diagnostics
  True
  >>> with ft.config.override(diagnostics=False):
  ...     ft.config.diagnostics
  False
  >>> ft.config.diagnostics
  True
"""
