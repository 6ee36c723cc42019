"""A function of Modules compiled ahead of time for its arguments' shapes, kept as bytes: ``ft.export``.

``jax.export`` serializes a program together with its arguments' tree structure, and a
Module's structure (its class, its static configuration) is no JAX container:
``jax.export.export(jax.jit(f))(model, x).serialize()`` fails unless every class is
registered under a serialized name first, and a notebook that redefines a class collides
with its own earlier registration. ``ft.export`` exports the function of the arguments'
*arrays* (JAX sees a flat list) and describes their structure as a checkpoint does
(``functree/train/checkpoint/_treespec.py``: classes by name, static fields as data).
So:

* the bytes are data: a header of JSON and JAX's own serialized program, both checked by
  SHA-256 digests (the header's too: its key names place the arrays); reading them imports
  nothing and builds only registered classes (as ``ft.train.load`` does);
* a call checks the arguments against the description before the program runs: another
  class, another static field (an activation, ``training``) or another shape is an
  :class:`ExportError` naming the key path, the exported value and the given one, never
  a program that silently computes what the exported arguments' configuration computes;
* the results are rebuilt as the function returned them (a Module as that Module).

A batch dimension left open is JAX's symbolic shape:
``jax.ShapeDtypeStruct(jax.export.symbolic_shape("b, 3"), jnp.float32)`` as the example
argument. ``platforms=("cpu", "cuda", "tpu")`` compiles for several backends at once.
Serialization needs the ``flatbuffers`` package (``pip install flatbuffers``, or the ``export`` extra).

Example:
  >>> import functree as ft, jax, jax.numpy as jnp
  >>> model = ft.nn.Dense(3, 2, key=jax.random.key(0))
  >>> exported = ft.export(lambda model, x: model(x))(model, jnp.ones((4, 3)))
  >>> exported
  Exported(fn(model, x) -> 1 array, platforms ('cpu',))
  >>> bool(jnp.allclose(exported(model, jnp.ones((4, 3))), model(jnp.ones((4, 3)))))
  True
"""

from __future__ import annotations

import hashlib
import inspect
import json
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from functree._paths import KeyPath
from functree._tree import child_name
from functree.train.checkpoint._decode import decode_leaf, leaf_specs
from functree.train.checkpoint._errors import UnsavableKeyError, text_literal
from functree.train.checkpoint._treespec import (
    CheckpointError,
    SpecError,
    _named_children,
    decode,
    encode,
)

__all__ = ["export", "Exported", "ExportError"]

MAGIC = b"functree.Exported\n"
FORMAT = 1


class ExportError(ValueError):
    """Exported bytes that cannot be read, or a call whose arguments are not the exported ones.

    Example:
      >>> import functree as ft
      >>> issubclass(ft.ExportError, ValueError)
      True
    """

    __module__ = "functree"  # shown as ft.ExportError, where users read it


NOT_AN_ARRAY = """\
ft.export: the argument at {path} is a {type}: an exported program takes arrays (and Python \
numbers, traced as jax.jit traces them); other values belong in a Module's static fields or \
in the function itself:

    wrong:  ft.export(fn)(model, {{"mode": "train"}}, x)
    right:  ft.export(lambda model, x: fn(model, {{"mode": "train"}}, x))(model, x)"""

RESULT_NOT_AN_ARRAY = """\
ft.export({name}): the result at {path} is a {type}: an exported program returns arrays \
(in any tree of them: Modules, dicts, lists, optimizer states). Return the arrays alone:

    wrong:  return y, lambda v: v * 2
    right:  return y"""

DIFFERENT_TREE = """\
The exported {name} was traced for other arguments: at {path} it has {saved}, this call \
gives {given}. Its program computes what the exported arguments' classes and static fields \
compute, so it cannot run these. Call it with arguments built as the exported ones, or \
export {name} again with these as the example:

    wrong:  exported(*args)                      # {path}: {given}
    right:  exported = ft.export({name})(*args)   # traced for these; then exported(*args)"""

DIFFERENT_ARRAY = """\
The exported {name} takes {path} as {saved}; this call gives {given}. Pass an array of the \
exported shape and dtype{symbolic}, or export again with this one as the example:

    wrong:  exported(..., {given_short}, ...)
    right:  ft.export({name})(..., {given_short}, ...)"""

INT_OUT_OF_RANGE = """\
The exported {name} takes {path} as {dtype}[]; the Python int {value} is outside {dtype}'s range \
[{low}, {high}] (JAX raises OverflowError for it; NumPy would wrap it around). Pass a value in \
range, or export again with a wider integer (under jax_enable_x64):

    wrong:  exported(..., {value}, ...)
    right:  ft.export({name})(..., jnp.asarray({value}, jnp.int64), ...)"""

BAD_CALL = """\
The exported {name} takes the arguments ({parameters}): {error}.

    wrong:  exported({wrong})
    right:  exported({call})"""

UNMATCHED = """\
ft.export: the arrays at {paths} are described by the arguments' key paths but are no leaves \
of their JAX tree (a pytree node that flattens other values than its fields hold): the \
program would hold them as constants. Pass them as arrays of their own:

    wrong:  ft.export(fn)(node_with_its_own_flatten, x)
    right:  ft.export(fn)(dict(node_with_its_own_flatten.__dict__), x)"""

RESULT_NOT_REBUILT = """\
ft.export({name}): its results could not be rebuilt from their description as another \
process rebuilds them ({why}). Register the class or function (ft.train.register), or \
return arrays:

    wrong:  return SomeUnregisteredState(w=w)
    right:  return {{"w": w}}        # or @ft.train.register on the class"""

RESULT_NOT_DESCRIBED = """\
ft.export({name}): its results cannot be described as data, as another process reads them: \
{why}; a dict's keys are kept as text (str, int and bool keys). Key the dict by text or \
integers, or return its values in a list:

    wrong:  return {{{key}: y}}
    right:  return {{{key_text}: y}}"""

RESULT_NOT_DATA = "ft.export({name}): its results cannot be described as data, as another process reads them: {why}."

RESULT_LAYER_STATE = """\
ft.export({name}): its results cannot be described as data, as another process reads them: \
{why}; a dict's keys are kept as text (str, int and bool keys). The layer state that \
ft.nn.collect_state returns is keyed by KeyPath: return it applied to its model, or keyed by text:

    wrong:  return ft.nn.collect_state(lambda m: m(x), model)
    right:  y, updates = ft.nn.collect_state(lambda m: m(x), model)
            return y, ft.nn.apply_state(model, updates)
       or:  return y, {{str(path): value for path, value in updates.items()}}"""

KEY_EXPECTED = """\
The exported {name} takes {path} as {saved}; this call gives {given}. Pass what the \
exported call passed there:

    wrong:  exported(..., {given_code}, ...)
    right:  exported(..., {saved_code}, ...)"""

NOT_EXPORTED = """\
These {size} bytes are not an exported functree program (they start with {start!r}, not \
{magic!r}): read the bytes that Exported.serialize() wrote:

    wrong:  ft.Exported.deserialize(open("model.safetensors", "rb").read())
    right:  ft.Exported.deserialize(open("model.exported", "rb").read())"""

DAMAGED = """\
The exported program's bytes are damaged ({why}): nothing was run. Write them again with \
Exported.serialize(), or read an intact copy."""

NEWER_FORMAT = """\
The exported program was written in format {format} (functree {version}); this functree \
reads format {mine}. Upgrade functree to read it:  pip install -U git+https://github.com/functree/functree"""

NO_FLATBUFFERS = """\
JAX serializes an exported program with the flatbuffers package, which is not installed:

    right:  pip install "functree[export]"      # or: pip install flatbuffers"""


def export(fn: Callable[..., Any], *, platforms: Sequence[str] | None = None) -> Callable[..., Exported]:
    """``ft.export(fn)(*example_args)``: ``fn`` compiled ahead of time for the example
    arguments' structure, shapes and dtypes, as an :class:`Exported` to call or serialize.

    ``fn(*args)`` may take and return Modules, optimizer states and any tree of arrays; the
    example arguments may be arrays or ``jax.ShapeDtypeStruct`` (with a symbolic dimension,
    ``jax.export.symbolic_shape("b")``, for a size left open). ``platforms`` names the
    backends to compile for (JAX's default: this process's). The arguments' static
    configuration is part of the program: a call checks it (:class:`Exported`).

    Example: a training step, exported, written and read back in another process:
      >>> import functree as ft, jax, jax.numpy as jnp
      >>> model = ft.nn.Dense(3, 1, key=jax.random.key(0))
      >>> optimizer = ft.optim.Optimizer(ft.optim.adam(1e-2))
      >>> def step(model, opt_state, x, y):
      ...     return optimizer.minimize(lambda m: jnp.mean((m(x) - y) ** 2), model, opt_state)
      >>> x, y = jnp.ones((4, 3)), jnp.zeros((4, 1))
      >>> data = ft.export(step)(model, optimizer.init(model), x, y).serialize()  # what a file holds
      >>> step = ft.Exported.deserialize(data)
      >>> model, opt_state, loss = step(model, optimizer.init(model), x, y)
      >>> type(model).__name__, type(opt_state).__name__
      ('Dense', 'OptimizerState')
    """
    platforms = None if platforms is None else tuple(platforms)

    def trace(*args: Any, **kwargs: Any) -> Exported:
        return _export(fn, platforms, args, kwargs)

    return trace


def _export(fn: Callable[..., Any], platforms: tuple[str, ...] | None, args: tuple, kwargs: dict) -> Exported:
    name = getattr(fn, "__name__", "")
    name = name if name.isidentifier() else "fn"  # (a lambda's "<lambda>": the error's code runs as fn)
    parameters = _parameters(fn)
    signature = _signature(parameters)
    named = _bind(signature, parameters, args, kwargs, name)
    leaves, treedef = jax.tree.flatten(named)
    arrays, spec = encode(named)
    keys = _keys_by_position(treedef, len(leaves), arrays)
    if sorted(keys.values()) != sorted(arrays):  # an array the program would hold as a constant: never silently
        missing = sorted(set(arrays) - set(keys.values()))
        raise ExportError(UNMATCHED.format(paths=", ".join(missing)))
    for key, x in arrays.items():
        if not isinstance(x, (jax.Array, np.ndarray, jax.ShapeDtypeStruct)):
            raise ExportError(NOT_AN_ARRAY.format(path=key, type=type(x).__name__))
    in_keys = list(arrays)
    tags = _leaf_tags(spec)
    positions = {key: i for i, key in keys.items()}
    out: dict[str, Any] = {}

    def flat(*xs: Any) -> list[Any]:
        full = list(leaves)
        for key, x in zip(in_keys, xs):
            prng = tags[key].get("prng")
            full[positions[key]] = x if prng is None else jax.random.wrap_key_data(x, impl=prng)
        bound = jax.tree.unflatten(treedef, full)
        call_args, call_kwargs = _call_arguments(signature, parameters, bound)
        result = fn(*call_args, **call_kwargs)
        try:
            out_arrays, out["spec"] = encode(result)
        except CheckpointError as e:  # its text is a checkpoint's ("Nothing was written"): said for results
            if not isinstance(e, UnsavableKeyError):
                raise ExportError(RESULT_NOT_DATA.format(name=name, why=str(e).split(":")[0])) from None
            if isinstance(e.key, KeyPath):  # collect_state's layer state
                raise ExportError(RESULT_LAYER_STATE.format(name=name, why=e.why)) from None
            raise ExportError(RESULT_NOT_DESCRIBED.format(name=name, why=e.why, key=e.shown,
                                                          key_text=text_literal(e.key_text))) from None
        out["keys"] = list(out_arrays)
        for key, x in out_arrays.items():
            if not isinstance(x, (jax.Array, np.ndarray)):
                raise ExportError(RESULT_NOT_AN_ARRAY.format(name=name, path=key or "the root", type=type(x).__name__))
        return [out_arrays[k] for k in out["keys"]]

    examples = [_example(arrays[k], tags[k]) for k in in_keys]
    exported = jax.export.export(jax.jit(flat), platforms=platforms)(*examples)
    result = Exported(exported, name, parameters, spec, in_keys, out["spec"], out["keys"])
    try:  # the results' structure, rebuilt as another process rebuilds it: refused here, not there
        result._results([np.zeros(tuple(d if isinstance(d, int) else 1 for d in a.shape), a.dtype)
                         for a in exported.out_avals])
    except CheckpointError as e:
        raise ExportError(RESULT_NOT_REBUILT.format(name=name, why=str(e).splitlines()[0])) from None
    return result


Parameters = list[tuple[str, int, bool]]  # (name, kind, has a default): the function's signature, as data


def _parameters(fn: Callable[..., Any]) -> Parameters:
    """``fn``'s parameters as ``(name, kind, has a default)``: the arguments' names in key
    paths (``model.layers[0].weight``) and the signature a call is bound to."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: the arguments as given
        return [("args", int(inspect.Parameter.VAR_POSITIONAL), False),
                ("kwargs", int(inspect.Parameter.VAR_KEYWORD), False)]
    return [(p.name, int(p.kind), p.default is not p.empty) for p in signature.parameters.values()]


def _signature(parameters: Parameters) -> inspect.Signature:
    return inspect.Signature([inspect.Parameter(n, inspect._ParameterKind(k), default=None if d else inspect.Parameter.empty)
                              for n, k, d in parameters])


def _shown_parameters(parameters: Parameters) -> str:
    """The parameters as a signature shows them: ``*`` before the keyword-only ones (without
    it ``(model, x, scale)`` read as three positional arguments, and a call so written failed)."""
    shown, starred = [], False
    for n, k, _ in parameters:
        if k == inspect.Parameter.KEYWORD_ONLY and not starred:
            shown.append("*")
        starred = starred or k in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.KEYWORD_ONLY)
        shown.append(_STARS.get(k, "") + n)
    return ", ".join(shown)


_STARS: dict[Any, str] = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}


def _call_code(parameters: Parameters) -> str:
    """A call of the function's parameters by name: the keyword-only ones as ``name=name``."""
    return ", ".join(f"{n}={n}" if k == inspect.Parameter.KEYWORD_ONLY else _STARS.get(k, "") + n
                     for n, k, _ in parameters)


def _bind(signature: inspect.Signature, parameters: Parameters, args: tuple, kwargs: dict,
          name: str) -> dict[str, Any]:
    """The arguments by parameter name (a ``*args`` parameter a list, ``**kwargs`` a dict)."""
    try:
        arguments = signature.bind(*args, **kwargs).arguments
    except TypeError as e:
        positional = [n for n, k, _ in parameters if k in (0, 1)]
        given = [positional[i] if i < len(positional) else "..." for i in range(len(args))]
        wrong = ", ".join([*given, *(f"{k}=..." for k in kwargs)])
        raise ExportError(BAD_CALL.format(name=name, parameters=_shown_parameters(parameters), error=e,
                                          wrong=wrong, call=_call_code(parameters))) from None
    named = dict(arguments)  # the arguments given (a parameter left to its default is absent)
    for n, k, _ in parameters:
        if k == inspect.Parameter.VAR_POSITIONAL and n in named:
            named[n] = list(named[n])
    return named


def _call_arguments(signature: inspect.Signature, parameters: Parameters,
                    named: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    """``(args, kwargs)`` that call the function as the exported call did: a parameter after
    one left to its default goes by keyword (``f(x, c=y)`` of ``f(a, b=1, c=2)``)."""
    arguments = {n: tuple(named[n]) if k == inspect.Parameter.VAR_POSITIONAL else named[n]
                 for n, k, _ in parameters if n in named}
    bound = inspect.BoundArguments(signature, arguments)  # type: ignore[arg-type]
    return bound.args, bound.kwargs


class _Position:
    """A leaf's place in JAX's flattening order, put where the leaf was (so the
    description's names of the leaves are matched to JAX's order)."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


def _keys_by_position(treedef: Any, count: int, arrays: dict[str, Any]) -> dict[int, str]:
    """``{position in jax.tree.flatten's order: the description's name}`` of the array leaves."""
    marked, _ = encode(jax.tree.unflatten(treedef, [_Position(i) for i in range(count)]))
    return {m.index: k for k, m in marked.items() if isinstance(m, _Position) and k in arrays}


def _example(x: Any, tag: dict[str, Any]) -> Any:
    """The abstract value the program is traced for: a Python number weakly typed, as jit
    traces it; a PRNG key as its key data (the program wraps it)."""
    if isinstance(x, jax.ShapeDtypeStruct):
        return x
    weak = "python" in tag or tag.get("weak") is True
    dtype = jax.dtypes.canonicalize_dtype(x.dtype)
    return jax.ShapeDtypeStruct(np.shape(x), dtype, weak_type=weak)


_KEY = "key"  # an argument leaf taken as its key data


def _taken(leaves: list[Any], seen: tuple[Any, list[int], list[str | None], list[tuple[int, Any]]],
           keys: list[str], name: str) -> list[Any]:
    """The exported arrays among the arguments' leaves: a PRNG key as its key data, a Python
    or NumPy number as an array (:data:`KEY_EXPECTED` where a key and an array trade places)."""
    _, positions, kinds, _ = seen
    out = []
    for key, i, kind in zip(keys, positions, kinds):
        x = leaves[i]
        is_key = isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
        if is_key != (kind == _KEY):
            saved, given = ("a PRNG key", "an array") if kind == _KEY else ("an array", "a PRNG key")
            codes = {"a PRNG key": "jax.random.key(0)", "an array": "jnp.zeros(...)"}
            raise ExportError(KEY_EXPECTED.format(name=name, path=key, saved=saved, given=given,
                                                  saved_code=codes[saved], given_code=codes[given]))
        out.append(jax.random.key_data(x) if is_key else np.asarray(x) if isinstance(x, np.generic) else x)
    return out


# A Python number is weakly typed in JAX (jit traced at float32 takes 3 as 3.0): the exported
# dtypes it may take, by its type (bool before int, its subclass); a NumPy number has its own
# dtype, compared as an array's.
_WEAK_KINDS = ((bool, (np.bool_,)), (int, (np.integer, np.inexact)), (float, (np.inexact,)),
               (complex, (np.complexfloating,)))


def _weak(x: Any, dtype: Any, key: str, name: str) -> Any:
    """A Python number as an array of the exported ``dtype`` where JAX's weak typing would take
    it so (an ``int`` for a float, never a ``float`` for an int), else as its own array (refused
    as another dtype by the caller); an int outside an integer dtype's range is
    :data:`INT_OUT_OF_RANGE` (JAX's ``OverflowError``, where NumPy would wrap it around)."""
    kinds = next(kinds for cls, kinds in _WEAK_KINDS if isinstance(x, cls))
    if not any(jnp.issubdtype(dtype, k) for k in kinds):
        return np.asarray(x)
    if isinstance(x, int) and not isinstance(x, bool) and jnp.issubdtype(dtype, np.integer):
        info = jnp.iinfo(dtype)
        if not info.min <= x <= info.max:
            raise ExportError(INT_OUT_OF_RANGE.format(name=name, path=key, dtype=np.dtype(dtype).name, value=x,
                                                      low=info.min, high=info.max))
    return np.asarray(x, dtype)


def _leaf_tags(spec: Any) -> dict[str, dict[str, Any]]:
    """``{stored name: leaf node}`` of a description's array leaves (with their tags:
    ``python``, ``prng``, ``weak``)."""
    return {node["key"]: node for _, node in leaf_specs(spec) if node.get("kind") == "leaf"}


def _untagged(spec: Any, *, keys: bool = True) -> Any:
    """The description with its leaves' tags left out, and their stored names unless
    ``keys``: what a call may change (a Python float given where a weakly typed array was
    exported) is no difference; with the names, the results' arrays are put by name."""
    if isinstance(spec, dict):
        if spec.get("kind") == "leaf":
            return {"kind": "leaf", "key": spec["key"]} if keys else {"kind": "leaf"}
        return {k: _untagged(v, keys=keys) for k, v in spec.items()}
    if isinstance(spec, list):
        return [_untagged(v, keys=keys) for v in spec]
    return spec


def _difference(saved: Any, given: Any, path: str) -> tuple[str, str, str] | None:
    """The first place two descriptions differ: ``(key path, saved, given)``, or None."""
    if saved == given:
        return None
    where = path or "the arguments"
    if not (isinstance(saved, dict) and isinstance(given, dict) and saved.get("kind") == given.get("kind")):
        return where, _kind(saved), _kind(given)
    if saved.get("keys") != given.get("keys") and isinstance(saved.get("keys"), list) \
            and isinstance(given.get("keys"), list):
        mine, theirs = [k[1] for k in saved["keys"]], [k[1] for k in given["keys"]]
        for k in mine:
            if k not in theirs:
                return child_name(path, k), "a value", "nothing"
        for k in theirs:
            if k not in mine:
                return child_name(path, k), "nothing", "a value"
    for part in ("class", "names", "keys"):
        if saved.get(part) != given.get(part):
            return where, f"{part} {_shown(saved.get(part))}", f"{part} {_shown(given.get(part))}"
    statics = given.get("static", {})
    for name, value in saved.get("static", {}).items():
        if value != statics.get(name):
            return child_name(path, name), f"the static value {_shown(value)}", _shown(statics.get(name))
    theirs = dict(_named_children(given, path))
    for name, child in _named_children(saved, path):
        found = _difference(child, theirs.get(name), child_name(path, name))
        if found:
            return found
    return where, _kind(saved), _kind(given)


def _kind(spec: Any) -> str:
    if not isinstance(spec, dict):
        return "nothing"
    if "class" in spec:
        return f"a {str(spec['class']).rsplit('.', 1)[-1]}"
    kind = str(spec.get("kind"))
    return {"leaf": "an array", "none": "None"}.get(kind, f"a {kind}")


def _shown(code: Any) -> str:
    return json.dumps(code)[:120]


def _array_text(dtype: Any, shape: Sequence[Any]) -> str:
    return f"{np.dtype(dtype).name}[{', '.join(map(str, shape))}]"


class Exported:
    """A function compiled ahead of time (:func:`export`): call it as the function, or
    keep it as bytes (:meth:`serialize`, :meth:`deserialize`).

    A call checks its arguments against the exported ones first: the classes and static
    fields, then each array's shape and dtype (a symbolic dimension takes any size), each
    error naming the key path (``model.layers[0].weight``). Its results are rebuilt as the
    function returned them; a Module by its class's registered name, as a checkpoint is.
    """

    __slots__ = ("_checked", "_exported", "_in_keys", "_in_spec", "_out_keys", "_out_spec", "_parameters", "_run",
                 "_seen", "_signature", "_template", "name")

    def __init__(self, exported: Any, name: str, parameters: Parameters, in_spec: Any,
                 in_keys: list[str], out_spec: Any, out_keys: list[str]) -> None:
        self._exported = exported
        self.name = name
        self._parameters = parameters
        self._in_spec, self._in_keys = in_spec, in_keys
        self._out_spec, self._out_keys = out_spec, out_keys
        self._checked = _untagged(in_spec, keys=False)
        self._signature = _signature(parameters)  # (bound at every call: built once)
        self._seen: tuple[Any, list[int], list[str | None], list[tuple[int, Any]]] | None = None  # the last arguments' structure, checked
        self._template: tuple[Any, list[Any], list[dict[str, Any]]] | None = None  # the results' structure
        self._run = jax.jit(exported.call)  # (Exported.call alone traces again at every call: 10x the time)

    @property
    def platforms(self) -> tuple[str, ...]:
        return tuple(self._exported.platforms)

    @property
    def inputs(self) -> dict[str, jax.ShapeDtypeStruct]:
        """``{key path: shape and dtype}`` of the arrays the program takes."""
        return {k: jax.ShapeDtypeStruct(a.shape, a.dtype) for k, a in zip(self._in_keys, self._exported.in_avals)}

    def __repr__(self) -> str:
        shown = _shown_parameters(self._parameters)
        count = len(self._out_keys)
        return f"Exported({self.name}({shown}) -> {count} array{'s' if count != 1 else ''}, platforms {self.platforms})"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        named = _bind(self._signature, self._parameters, args, kwargs, self.name)
        leaves, treedef = jax.tree.flatten(named)
        seen = self._seen
        if seen is None or seen[0] != treedef or any(leaves[i] is not v for i, v in seen[3]):
            seen = self._seen = self._checked_structure(named, leaves, treedef)  # described and compared once
        xs = _taken(leaves, seen, self._in_keys, self.name)
        xs = [self._argument(k, x, aval) for k, x, aval in zip(self._in_keys, xs, self._exported.in_avals)]
        return self._results(self._run(*xs))

    def _checked_structure(self, named: dict[str, Any], leaves: list[Any], treedef: Any
                           ) -> tuple[Any, list[int], list[str | None], list[tuple[int, Any]]]:
        """The arguments' description compared with the exported one (:data:`DIFFERENT_TREE`
        names the first difference); then ``(treedef, the jax leaf position of each
        exported array, its kind, the other leaves by position)``: the next call with this
        structure and the same functions at leaves takes its arrays without describing the
        arguments again."""
        arrays, spec = encode(named)
        found = _difference(self._checked, _untagged(spec, keys=False), "")
        if found is not None:
            path, saved, given = found
            raise ExportError(DIFFERENT_TREE.format(name=self.name, path=path, saved=saved, given=given))
        tags = _leaf_tags(spec)
        positions = {k: i for i, k in _keys_by_position(treedef, treedef.num_leaves, arrays).items()}
        taken = [positions[k] for k in self._in_keys]
        kinds: list[str | None] = [_KEY if "prng" in tags[k] else None for k in self._in_keys]
        others = [(i, x) for i, x in enumerate(leaves) if i not in set(taken)]  # functions at leaves
        return treedef, taken, kinds, others

    def _results(self, outs: Sequence[Any]) -> Any:
        """The function's results rebuilt from the program's arrays: their structure decoded
        once (classes looked up by name, as a checkpoint's), each call's arrays put in it."""
        if self._template is None:
            stripped = _untagged(self._out_spec)
            template = decode(stripped, {k: _Position(i) for i, k in enumerate(self._out_keys)})
            leaves, treedef = jax.tree.flatten(template)
            tags = _leaf_tags(self._out_spec)
            self._template = treedef, leaves, [tags[k] for k in self._out_keys]
        treedef, leaves, tags = self._template
        values = [decode_leaf(tag, {tag["key"]: x}) for tag, x in zip(tags, outs)]
        return treedef.unflatten([values[x.index] if isinstance(x, _Position) else x for x in leaves])

    def _argument(self, key: str, x: Any, aval: Any) -> Any:
        """``x`` if it has the exported array's shape (a symbolic dimension: any size) and
        dtype (a Python number: one JAX's weak typing gives that dtype), else
        :data:`DIFFERENT_ARRAY` naming its key path."""
        given_short = None
        if isinstance(x, (bool, int, float, complex)):  # a Python number: its code in a message is itself
            given_short, x = repr(x), _weak(x, aval.dtype, key, self.name)
        if not isinstance(x, (jax.Array, np.ndarray)):
            raise ExportError(NOT_AN_ARRAY.format(path=key, type=type(x).__name__))
        shape = np.shape(x)
        dtype = jax.dtypes.canonicalize_dtype(x.dtype)
        fits = len(shape) == len(aval.shape) and all(
            not isinstance(d, int) or d == s for d, s in zip(aval.shape, shape))
        if not fits or dtype != aval.dtype:
            symbolic = any(not isinstance(d, int) for d in aval.shape)
            raise ExportError(DIFFERENT_ARRAY.format(
                name=self.name, path=key, saved=_array_text(aval.dtype, aval.shape),
                given=_array_text(dtype, shape),
                given_short=given_short or f"jnp.zeros({tuple(shape)}, jnp.{dtype.name})",
                symbolic=" (a symbolic dimension takes any size)" if symbolic else ""))
        return x

    def serialize(self) -> bytes:
        """The program as bytes: a JSON header (the arguments' and results' descriptions,
        their names, SHA-256 digests of the program and of the header with it) and JAX's
        serialized program."""
        try:
            program = bytes(self._exported.serialize())
        except ImportError as e:
            raise ImportError(NO_FLATBUFFERS) from e
        from functree import __version__

        fields = {
            "format": FORMAT, "functree": __version__, "jax": jax.__version__, "name": self.name,
            "parameters": self._parameters, "in": self._in_spec, "in_keys": self._in_keys,
            "out": self._out_spec, "out_keys": self._out_keys,
            "sha256": hashlib.sha256(program).hexdigest(),
        }
        header = json.dumps({**fields, "digest": _digest(fields, program)}).encode()
        return MAGIC + len(header).to_bytes(8, "little") + header + program

    @classmethod
    def deserialize(cls, data: bytes) -> Exported:
        """The :class:`Exported` that :meth:`serialize` wrote, checked before use: its
        magic bytes, format, digest and descriptions (:class:`ExportError` names the
        damage). Nothing is imported or constructed because the bytes name it."""
        data = bytes(data)
        if not data.startswith(MAGIC):
            raise ExportError(NOT_EXPORTED.format(size=len(data), start=data[:len(MAGIC)], magic=MAGIC))
        start = len(MAGIC) + 8
        size = int.from_bytes(data[len(MAGIC):start], "little")
        if len(data) < start + size:
            raise ExportError(DAMAGED.format(why=f"{len(data)} bytes, the header alone needs {start + size}"))
        header = _header(data[start:start + size])
        program = data[start + size:]
        if hashlib.sha256(program).hexdigest() != header["sha256"]:
            raise ExportError(DAMAGED.format(why="the program's SHA-256 digest differs from the header's"))
        if "digest" in header and _digest(header, program) != header["digest"]:  # (files written before: none)
            raise ExportError(DAMAGED.format(why="the header's SHA-256 digest differs from the one it holds"))
        try:
            exported = jax.export.deserialize(bytearray(program))
        except ImportError as e:
            raise ImportError(NO_FLATBUFFERS) from e
        if len(exported.in_avals) != len(header["in_keys"]) or len(exported.out_avals) != len(header["out_keys"]):
            raise ExportError(DAMAGED.format(why="the header names other arrays than the program takes"))
        parameters = [(str(n), int(k), bool(d)) for n, k, d in header["parameters"]]
        return cls(exported, header["name"], parameters, header["in"], header["in_keys"], header["out"],
                   header["out_keys"])


# The header's checked entries and their types; with the versions and the header's digest, the
# entries there are: another is damage (a renamed "digest" would skip the header's check).
_TYPES = {"format": int, "name": str, "parameters": list, "in": dict, "in_keys": list, "out": dict,
          "out_keys": list, "sha256": str}
_ENTRIES = frozenset(_TYPES) | {"functree", "jax", "digest"}


def _digest(header: dict[str, Any], program: bytes) -> str:
    """The SHA-256 digest of ``header`` (but its ``digest``) and ``program``: the program's
    own digest leaves the header unchecked, whose key names place the arrays (two names
    swapped swapped two results, or two inputs of one shape, silently) and whose results'
    static fields are rebuilt as written. The JSON is written again sorted, as read."""
    fields = json.loads(json.dumps({k: v for k, v in header.items() if k != "digest"}))
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode() + program).hexdigest()


def _header(raw: bytes) -> dict[str, Any]:
    """The header's JSON, each entry checked (type, format, descriptions naming the keys)."""
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ExportError(DAMAGED.format(why=f"its header is no JSON: {e}")) from None
    if not isinstance(header, dict):
        raise ExportError(DAMAGED.format(why="its header is no JSON object"))
    if isinstance(header.get("format"), int) and header["format"] > FORMAT:
        raise ExportError(NEWER_FORMAT.format(format=header["format"], version=header.get("functree"), mine=FORMAT))
    unknown = sorted(set(header) - _ENTRIES)
    if unknown:
        raise ExportError(DAMAGED.format(why=f"its header holds entries no functree writes: {unknown}"))
    for entry, kind in _TYPES.items():
        if not isinstance(header.get(entry), kind):
            raise ExportError(DAMAGED.format(why=f"its header's {entry!r} is no {kind.__name__}"))
    for entry in header["parameters"]:
        if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], str) and entry[1] in range(5)
                and isinstance(entry[2], bool)):
            raise ExportError(DAMAGED.format(why=f"its header's parameter {entry!r} is no [name, kind, default]"))
    for spec, keys in ((header["in"], header["in_keys"]), (header["out"], header["out_keys"])):
        try:
            named = list(_leaf_tags(spec))
        except SpecError as e:
            raise ExportError(DAMAGED.format(why=str(e).splitlines()[0])) from None
        if sorted(map(str, named)) != sorted(map(str, keys)):
            raise ExportError(DAMAGED.format(why="its header's arrays and their descriptions differ"))
    return header
