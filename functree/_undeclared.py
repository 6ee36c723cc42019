"""The error for a Module's ``__init__`` assigning an attribute its class body does not declare.

A torch user writes ``self.conv1 = ft.nn.Conv2D(...)`` in ``__init__`` with no field
declared; a functree model is a frozen dataclass whose fields JAX flattens and rebuilds,
so an undeclared attribute would be lost at the first ``jit``. The error names the
declaration for the value assigned (a layer's class, ``jax.Array``, configuration) and,
read from the ``__init__``'s source where Python has it, every other ``self.<name> = ...``
the class does not declare: one error for the whole ``__init__``, not one per run.
Nothing here runs unless the assignment was refused.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from typing import Any

import jax
import numpy as np

from functree._foreign_arguments import public_name

__all__ = ["NOT_A_FIELD", "ALSO_UNDECLARED", "not_a_field"]

NOT_A_FIELD = """\
{cls}.__init__ assigns self.{name}, which is not a declared field: it would be lost the \
first time JAX rebuilds the module (jit, grad, tree_map). Declare it in the class body:

{lines}{also}"""

ALSO_UNDECLARED = """

{cls}.__init__ also assigns these, undeclared: {names}. Declare each the same way:

{lines}"""

_WIDTH = 44  # the declarations' comments line up


def not_a_field(module: Any, name: str, value: Any, base: type) -> AttributeError:
    """The error for ``module.__init__`` assigning ``value`` to the undeclared ``name``
    (``base``: the Module class, whose subclasses are layers).

    Example:
      >>> import functree as ft, jax
      >>> class Net(ft.Module):
      ...     def __init__(self, key):
      ...         self.fc = ft.nn.Dense(2, 1, key=key)
      >>> try:
      ...     Net(jax.random.key(0))
      ... except AttributeError as e:
      ...     print(str(e).splitlines()[2].strip())
      fc: ft.nn.Dense                            # a layer: its parameters train
    """
    cls = type(module)
    if isinstance(value, (jax.Array, np.ndarray)):
        lines = [_line(f"{name}: jax.Array", "a parameter"),
                 _line(f"{name}: jax.Array = ft.field(no_derivative=True)", "carried state")]
    elif isinstance(value, base):
        lines = [_line(f"{name}: {public_name(type(value))}", "a layer: its parameters train")]
    else:
        lines = [_line(f"{name}: {_static_type(value)} = ft.field(static=True)", "configuration")]
    others = {n: v for n, v in _assigned_in_init(cls, base).items() if n != name and n not in cls.__ft_field_set__}
    also = ""
    if others:
        also = ALSO_UNDECLARED.format(cls=cls.__name__, names=", ".join(others),
                                      lines="\n".join(_line(f"{n}: {v}", "a layer" if v != "..." else "")
                                                       for n, v in others.items()))
    return AttributeError(NOT_A_FIELD.format(cls=cls.__name__, name=name, lines="\n".join(lines), also=also))


def _static_type(value: Any) -> str:
    if callable(value) and not isinstance(value, type):
        return "Callable"
    return type(value).__name__


def _line(code: str, comment: str = "") -> str:
    return f"    {code:<{_WIDTH}} # {comment}" if comment else f"    {code}"


def _assigned_in_init(cls: type, base: type) -> dict[str, str]:
    """The names ``cls.__init__`` assigns as ``self.<name> = ...`` (in order, once each) and
    their declaration's type where the value is a call of a Module class (``ft.nn.Dense(...)``:
    ``ft.nn.Dense``; else ``...``), read from its source; none where Python has no source
    (a ``python -c`` class). The called name is looked up, never called."""
    init = getattr(cls.__init__, "__wrapped__", cls.__init__)
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(init)))
    except (OSError, TypeError, SyntaxError, IndentationError):
        return {}
    fn = tree.body[0] if tree.body and isinstance(tree.body[0], (ast.FunctionDef, ast.AsyncFunctionDef)) else None
    if fn is None or not fn.args.args:
        return {}
    me, scope = fn.args.args[0].arg, getattr(init, "__globals__", {})
    found = []
    for node in ast.walk(fn):
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            targets, value = [node.target], node.value
        else:
            continue
        for target, given in _pairs(targets, value):
            found += [(sub.lineno, sub.col_offset, sub.attr, _declared_type(given, scope, base)) for sub in ast.walk(target)
                      if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id == me]
    out: dict[str, str] = {}
    for _, _, name, kind in sorted(found):
        out.setdefault(name, kind)
    return out


def _pairs(targets: list[Any], value: Any) -> list[tuple[Any, Any]]:
    """Each assignment target with its value: ``self.a, self.b = A(), B()`` pairs them."""
    out = []
    for t in targets:
        if (isinstance(t, ast.Tuple) and isinstance(value, ast.Tuple) and len(t.elts) == len(value.elts)
                and not any(isinstance(e, ast.Starred) for e in t.elts)):
            out += list(zip(t.elts, value.elts))
        else:
            out.append((t, value))
    return out


def _declared_type(value: Any, scope: dict[str, Any], base: type) -> str:
    """``ft.nn.Dense`` for a value ``ft.nn.Dense(...)`` (or ``Dense(...)`` imported), else ``...``."""
    if not isinstance(value, ast.Call):
        return "..."
    parts, func = [], value.func
    while isinstance(func, ast.Attribute):
        parts.insert(0, func.attr)
        func = func.value
    if not isinstance(func, ast.Name) or func.id not in scope:
        return "..."
    found = scope[func.id]
    for part in parts:
        found = getattr(found, part, None)
    return public_name(found) if isinstance(found, type) and issubclass(found, base) else "..."
