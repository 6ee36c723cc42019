"""A Module class's pytree functions (``flatten``, ``flatten_with_keys``, ``unflatten``),
generated once per class from its field names as straight-line code, as dataclasses
generates ``__init__``. :class:`functree.Module` registers them with JAX when a subclass is
defined; JAX's unflatten (every jit output, ``tree_map``, gradient) then never calls
``__init__``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

__all__ = ["pytree_functions"]

def _tuple_source(items: list[str]) -> str:
    """Python source of a tuple display: ``()``, ``(a,)``, ``(a, b)``."""
    if len(items) == 1:
        return f"({items[0]},)"
    return "(" + ", ".join(items) + ")"


def pytree_functions(cls: type) -> tuple[Callable, Callable, Callable]:
    """``flatten``, ``flatten_with_keys`` and ``unflatten`` for ``cls``, generated once
    from its field names (identifiers) as straight-line code, as dataclasses does.
    For ``weight``, ``bias`` and a static ``activation``::

        def flatten(self):
            d = self.__dict__
            return (d['weight'], d['bias']), (d['activation'],)
        def unflatten(aux, children):
            obj = _new(_cls)
            d = obj.__dict__
            d['weight'], d['bias'] = children
            d['activation'], = aux
            return obj

    Children are the data fields (parameters and no_derivative) in declaration order,
    keyed by ``GetAttrKey(name)``; the auxiliary data is the tuple of static values
    (hashed and compared by jit). ``unflatten`` fills a bare instance's dict: no
    ``__init__``, no checks.
    """
    static = cls.__ft_static__  # type: ignore[attr-defined]
    data = [n for n in cls.__ft_fields__ if n not in static]  # type: ignore[attr-defined]
    namespace: dict[str, Any] = {"_new": object.__new__, "_cls": cls}
    for i, name in enumerate(data):
        namespace[f"_k{i}"] = jax.tree_util.GetAttrKey(name)
    aux = _tuple_source([f"d[{n!r}]" for n in static])
    children = _tuple_source([f"d[{n!r}]" for n in data])
    keyed = _tuple_source([f"(_k{i}, d[{n!r}])" for i, n in enumerate(data)])
    fill = [f"    {targets}= {source}" for targets, source in (
        ("".join(f"d[{n!r}], " for n in data), "children"),
        ("".join(f"d[{n!r}], " for n in static), "aux"),
    ) if targets]
    body = "\n".join(fill)
    source = f"""\
def flatten(self):
    d = self.__dict__
    return {children}, {aux}
def flatten_with_keys(self):
    d = self.__dict__
    return {keyed}, {aux}
def unflatten(aux, children):
    obj = _new(_cls)
    d = obj.__dict__
{body}
    return obj
"""
    exec(source, namespace)  # field names only appear as string literals
    functions = namespace["flatten"], namespace["flatten_with_keys"], namespace["unflatten"]
    for fn in functions:
        fn.__qualname__ = f"{cls.__qualname__}.<{fn.__name__}>"
        fn.__module__ = cls.__module__
    return functions
