"""A lambda's or a local function's identity in a checkpoint: its name and its code.

A static function (an activation, a ``Lambda``'s function) is stored by its qualified name,
which names a module-level ``def`` (as pickle names it: a definition edited under its name is
the same function). Every lambda of a module has one name (``__main__.<lambda>``) and every
function a factory returns one too (``make.<locals>.act``), so a template's ``lambda v: v * 5``
took the place of a saved ``lambda v: v * 2`` unnoticed: outputs 5.15 off, no message. Their
names carry digests of what they compute: ``__main__.<lambda>@py311:3f2a9c0b1d7e:9a8b7c6d5e4f``,
the Python version, the digest of the bytecode (constants, names, nested code) and the digest
of the source (its syntax tree: no comments, no layout), each with the defaults and the
captured values. Bytecode differs between Python versions, so a file written under 3.12 read
under 3.11 compared nothing and a template's other lambda loaded silently; the source digest
is the same under every version and is compared whenever both names have one. The bytecode
digests are compared within one version, as before. A function whose source cannot be read
(defined by ``exec`` of a string) has no source digest (``...@py311:3f2a9c0b1d7e``, as files
written before source digests): across versions, and for files written before digests at all,
the name alone decides.
"""

from __future__ import annotations
import __future__

import ast
import functools
import hashlib
import linecache
import sys
import types
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

_PYTHON = f"py{sys.version_info[0]}{sys.version_info[1]}"
# the ``from __future__`` flags a code object carries, given back to compile its source alike
_FUTURE = functools.reduce(lambda a, b: a | b, (getattr(__future__, f).compiler_flag
                                                 for f in __future__.all_feature_names))
# fields of a syntax tree that change nothing a function computes (its annotations, a string
# constant's ``u`` prefix; the bytecode digest leaves them out too)
_NOT_COMPUTED = frozenset({"returns", "annotation", "type_comment", "kind"})
_Definition = ast.Lambda | ast.FunctionDef | ast.AsyncFunctionDef


def with_code(fn: Any, name: str) -> str:
    """``name`` (``fn``'s ``module.qualname``), with ``@py3XY:digest`` where the name does
    not tell one function from another (a lambda, a function defined inside a function).

    Example:
      >>> double, triple = (lambda v: v * 2), (lambda v: v * 3)
      >>> with_code(double, "m.<lambda>") != with_code(triple, "m.<lambda>")
      True
      >>> with_code(double, "m.<lambda>") == with_code(lambda v: v * 2, "m.<lambda>")
      True
    """
    if "<lambda>" not in name and "<locals>" not in name:
        return name
    digest = code_digest(fn)
    if digest is None:
        return name
    source = source_digest(fn)
    return f"{name}@{_PYTHON}:{digest}" + (f":{source}" if source else "")


def code_digest(fn: Any, seen: frozenset[int] = frozenset()) -> str | None:
    """12 hex digits of sha256 over ``fn``'s code (bytecode, constants, names, nested code)
    and its defaults and captured values; None for a callable with no code (a builtin).
    ``seen``: the objects being described (a local function that calls itself captures
    itself: described once)."""
    code = getattr(fn, "__code__", None)
    if not isinstance(code, types.CodeType):
        return None
    return _digest(fn, lambda h: _feed_code(h, code), seen, code_digest)


def source_digest(fn: Any, seen: frozenset[int] = frozenset()) -> str | None:
    """12 hex digits of sha256 over ``fn``'s source as a syntax tree (which every Python
    version parses alike, where bytecode differs) and its defaults and captured values (a
    captured function by its source digest); None where the source cannot be read, or is not
    what ``fn`` runs (its file edited since)."""
    code = getattr(fn, "__code__", None)
    if not isinstance(code, types.CodeType):
        return None
    node = _definition(code, getattr(fn, "__globals__", None))
    if node is None:
        return None
    tree = _tree_text(node, _positional_names(node)).encode()
    return _digest(fn, lambda h: h.update(tree), seen, source_digest)


def _positional_names(node: _Definition) -> dict[str, str]:
    """The definition's positional parameters (and ``*args``) by their place: ``lambda v: v * 2``
    and ``lambda x: x * 2`` compute the same, and their bytecode is the same (a renamed
    parameter loaded from a checkpoint is the saved function). Keyword-only parameters keep
    their names: a caller passes them by name."""
    a = node.args
    names = [p.arg for p in (*a.posonlyargs, *a.args)] + ([a.vararg.arg] if a.vararg else [])
    return {name: f"<{i}>" for i, name in enumerate(names)}


def _digest(fn: Any, feed: Callable[[Any], None], seen: frozenset[int], of_function: Callable[..., Any]) -> str:
    """``feed``'s text (the code) then ``fn``'s defaults and captured values, a captured
    function by ``of_function`` (its digest of the same kind)."""
    seen = seen | {id(fn)}
    h = hashlib.sha256()
    feed(h)
    h.update(_value_text(getattr(fn, "__defaults__", None), seen, of_function).encode())
    h.update(_value_text(getattr(fn, "__kwdefaults__", None), seen, of_function).encode())
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            h.update(_value_text(cell.cell_contents, seen, of_function).encode())
        except ValueError:  # an empty cell (a name bound later)
            h.update(b"<empty>")
    return h.hexdigest()[:12]


def _definition(code: types.CodeType, module_globals: Any) -> _Definition | None:
    """The lambda or ``def`` in ``code``'s file (or notebook cell: IPython keeps cells in
    ``linecache``) that ``code`` was compiled from, or None (no source, or a file edited
    since: its text compiles to other code there)."""
    lines = linecache.getlines(code.co_filename, module_globals if isinstance(module_globals, dict) else None)
    text = "".join(lines)
    tree = _parsed(text) if lines else None
    if tree is None or not _compiled_there(text, code):
        return None
    if code.co_name == "<lambda>":
        return _lambda_node(tree, code)
    return next((n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                 and n.name == code.co_name
                 and (n.decorator_list[0] if n.decorator_list else n).lineno == code.co_firstlineno), None)


@functools.lru_cache(maxsize=8)
def _parsed(text: str) -> ast.Module | None:
    try:
        return ast.parse(text)
    except (SyntaxError, ValueError):  # (a file edited since: no source)
        return None


@functools.lru_cache(maxsize=8)
def _compiled(text: str, filename: str, flags: int) -> frozenset[bytes]:
    """:func:`_code_hash` of every function ``text`` compiles to, compiled whole (a
    function's bytecode depends on its module: ``jnp.tanh(v)`` where ``jnp`` is imported)."""
    def functions(c: types.CodeType) -> Any:
        yield c
        for const in c.co_consts:
            if isinstance(const, types.CodeType):
                yield from functions(const)
    try:
        module = compile(text, filename, "exec", flags=flags, dont_inherit=True)
    except (SyntaxError, ValueError):
        return frozenset()
    return frozenset(_code_hash(c) for c in functions(module))


def _compiled_there(text: str, code: types.CodeType) -> bool:
    """Whether ``text`` compiles to ``code`` at ``code``'s place (not edited since)."""
    return _code_hash(code) in _compiled(text, code.co_filename, code.co_flags & _FUTURE)


def _lambda_node(tree: ast.Module, code: types.CodeType) -> ast.Lambda | None:
    """The innermost lambda starting on ``code``'s first line whose body holds every
    instruction's position (several lambdas on one line, a lambda in a lambda)."""
    spans = [(p[0], p[2], p[1], p[3]) for p in code.co_positions() if None not in p and p[:3:2] != p[1::2]]
    if not spans:
        return None
    first, last = min(s[:2] for s in spans), max(s[2:] for s in spans)
    holding = [n for n in ast.walk(tree) if isinstance(n, ast.Lambda) and n.lineno == code.co_firstlineno
               and (n.body.lineno, n.body.col_offset) <= first
               and last <= (n.body.end_lineno or 0, n.body.end_col_offset or 0)]
    return max(holding, key=lambda n: (n.body.lineno, n.body.col_offset), default=None)  # (bodies nest)


def _code_hash(code: types.CodeType) -> bytes:
    """``code``'s bytecode digest with its place (first line, name, positions)."""
    h = hashlib.sha256()
    _feed_code(h, code)
    h.update(repr((code.co_firstlineno, code.co_name, list(code.co_positions()))).encode())
    return h.digest()


def _tree_text(node: Any, renamed: dict[str, str]) -> str:
    """A syntax tree as its node types and field values, the same under Python 3.11 to 3.13
    (``ast.dump``'s text changed in 3.13; empty fields, which one version has and another
    lacks, such as 3.12's ``type_params``, are left out); the ``renamed`` parameters (and every
    use of their names) by their place."""
    if isinstance(node, ast.AST):
        fields = (f"{k}={_field_text(node, k, v, renamed)}" for k, v in ast.iter_fields(node)
                  if k not in _NOT_COMPUTED and v is not None and v != [])
        return f"{type(node).__name__}({','.join(fields)})"
    if isinstance(node, list):
        return "[" + ",".join(_tree_text(v, renamed) for v in node) + "]"
    return repr(node)


def _field_text(node: ast.AST, key: str, value: Any, renamed: dict[str, str]) -> str:
    if (isinstance(node, ast.Name) and key == "id") or (isinstance(node, ast.arg) and key == "arg"):
        value = renamed.get(value, value)
    return _tree_text(value, renamed)


def _feed_code(h: Any, code: types.CodeType) -> None:
    # (no file name, no line numbers: the same lambda moved in its file is the same function)
    h.update(code.co_code)
    h.update(repr(code.co_names).encode())
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            _feed_code(h, const)
        else:
            h.update(repr(const).encode())


def _value_text(value: Any, seen: frozenset[int], of_function: Callable[..., Any]) -> str:
    """A captured value as text that differs where the value does: plain data by ``repr``,
    functions by their name and ``of_function`` (their digest), arrays by dtype, shape and
    bytes; other objects by type (what their state is cannot be read safely); an object met
    again, by its place."""
    if value is None or isinstance(value, (bool, int, float, complex, str, bytes)):
        return repr(value)
    if id(value) in seen:
        return "<itself>"
    inner = seen | {id(value)}
    if isinstance(value, (tuple, list)):
        return type(value).__name__ + "(" + ",".join(_value_text(v, inner, of_function) for v in value) + ")"
    if isinstance(value, dict):
        items = (_value_text(k, inner, of_function) + ":" + _value_text(v, inner, of_function)
                 for k, v in value.items())
        return "{" + ",".join(items) + "}"
    if isinstance(value, types.FunctionType):
        return f"{value.__module__}.{value.__qualname__}:{of_function(value, inner)}"
    if isinstance(value, jax.Array) and jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):
        # a typed key has no NumPy form (np.asarray raised inside JAX): its bits, under its impl
        return f"{value.dtype}:" + _value_text(jax.random.key_data(value), inner, of_function)
    if isinstance(value, np.generic) or (hasattr(value, "__array__") and hasattr(value, "dtype")):
        array = np.asarray(value)
        return f"array({array.dtype},{array.shape},{hashlib.sha256(array.tobytes()).hexdigest()[:16]})"
    return f"<{type(value).__module__}.{type(value).__qualname__}>"


def same_function(saved: Any, mine: Any) -> bool:
    """Whether two stored function names are one function: equal names whose source
    digests, where both have one, are equal, and whose bytecode digests, where both are of
    one Python version, are equal (a name without digests, from a file written before
    them, is compared by name)."""
    if saved == mine:
        return True
    if not (isinstance(saved, str) and isinstance(mine, str)):
        return False
    (a, _, code_a), (b, _, code_b) = saved.partition("@"), mine.partition("@")
    if a != b:
        return False
    if not code_a or not code_b:
        return True
    (python_a, bytecode_a, source_a), (python_b, bytecode_b, source_b) = _digests(code_a), _digests(code_b)
    if source_a and source_b and source_a != source_b:
        return False
    return python_a != python_b or bytecode_a == bytecode_b


def _digests(code: str) -> tuple[str, str, str]:
    """``py311:3f2a9c0b1d7e:9a8b7c6d5e4f`` as its Python version, bytecode digest and source
    digest (``""`` where the name has none)."""
    python, _, rest = code.partition(":")
    bytecode, _, source = rest.partition(":")
    return python, bytecode, source


def shown(name: str) -> str:
    """A stored function name as a message shows it: ``__main__.<lambda> (code 3f2a9c0b1d7e,
    source 9a8b7c6d5e4f)``."""
    base, _, code = name.partition("@")
    if not code:
        return base
    _, bytecode, source = _digests(code)
    return f"{base} (code {bytecode}" + (f", source {source})" if source else ")")
