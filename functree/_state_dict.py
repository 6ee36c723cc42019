"""Flat state dicts: ``{"layers.0.weight": array, ...}`` and back, checked by key path."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from functree import _stacked
from functree._functions import builtin_name
from functree._naming import is_tied, resolve_alias, tie_targets, untransform
from functree._naming import names as leaf_names
from functree._paths import ensure_acyclic
from functree._tree import bounded_put, cached, is_none

__all__ = ["to_flat_dict", "from_flat_dict", "FlatDictReport"]

DUPLICATE_NAME = """\
ft.{fn}: two leaves share the dotted name {name!r} ({first} and {second}); a dict key \
containing "." collides with a nested path (or an int key with a str key of the same digits). \
Rename the key, e.g. {fixed!r}."""

TIES_DISAGREE = """\
ft.from_flat_dict: {first!r} and {second!r} name one tied parameter ({stored!r}, stored \
once by ft.nn.Shared) but hold different values. A tie holds one value: give equal values \
or only one of the names:
    right:  flat.pop({second!r})"""

FLAT_DICT_MISMATCH = """\
ft.from_flat_dict: the flat dict does not fit the template.
{report}
Pass strict=False to fill what matches and get this report back instead."""

TORCH_HINT = """\
torch tensors ({names}): pass cast=True (it converts them through .detach().cpu().numpy() to \
the template's floating dtypes), or convert the state dict first: \
{{k: v.detach().cpu().numpy() for k, v in state_dict.items()}}"""

FLOAT_DIFFER = "floating dtypes differ ({names}): "
"""The start of :data:`FLOAT_HINT`: a loader that takes no ``cast=`` (the checkpoints')
gives its own rest (:meth:`FlatDictReport.with_hint`)."""

FLOAT_HINT = FLOAT_DIFFER + """\
pass cast=True to convert floating values to the template's dtypes: \
ft.from_flat_dict(template, flat, cast=True)"""

INT_DIFFER = "integer dtypes differ ({names}): "
"""The start of :data:`INT_HINT`, as :data:`FLOAT_DIFFER` is :data:`FLOAT_HINT`'s."""

INT_HINT = INT_DIFFER + """\
pass cast=True to convert integers to the template's integer dtypes (it converts only values \
the dtype holds, as these are; none is wrapped): ft.from_flat_dict(template, flat, cast=True)"""

CAST_HINT = """\
cast=True converts floating values of the same shape, and integers to an integer dtype that \
holds them; convert these yourself: {names}"""

KIND_HINT = """\
{names}: values of another kind than the template's leaves ({kinds}). cast=True never changes \
a value's kind (it converts floating dtypes, and integers to an integer dtype that holds them): \
an integer past 2**24 is no exact float32, a float's fraction is lost in an int. Convert them \
yourself where that is meant:
    right:  ft.from_flat_dict(model, {{**flat, {entries}}}{options})"""

TORCH_CAST_HINT = """\
loading converts floating tensors to the model's floating dtypes and integer tensors to its \
integer dtypes where they hold the values; these are of another kind (an integer tensor for a \
floating leaf, or the reverse) or out of range: convert them before loading: {names}"""

_BEYOND_RANGE = """\
{names}: values beyond the largest finite value of the leaf's floating dtype ({limits}), \
which the cast would turn into inf (NaN in a float8 without inf): a silently different model, \
so they were not loaded. Load into a wider dtype and cast what fits after, or clip them \
yourself where that is meant:
"""
"""The start of the range hints, formatted by :func:`range_hint`: ``{limits}`` names each
leaf dtype's largest value, and the fix's ``{dtype}``, ``{largest}`` and ``{wider}`` are
the first's (a float8 leaf's 448, not float16's 65504: clipped there, still NaN)."""

FLOAT_RANGE_HINT = _BEYOND_RANGE + """
    wrong:  ft.from_flat_dict({dtype}_model, flat, cast=True)   # values beyond {largest}
    right:  ft.from_flat_dict({wider}_model, flat, cast=True)
       or:  {{k: np.clip(v, -{largest}, {largest}) for k, v in flat.items()}}   # clipped on purpose"""
"""from_flat_dict's own (a checkpoint read as saved and cast into a float16 template goes
through it): torch's ``.clamp`` is no method of the NumPy arrays it is given."""

TORCH_FLOAT_RANGE_HINT = _BEYOND_RANGE + """
    wrong:  ft.nn.load_torch_state_dict({dtype}_model, state_dict)   # values beyond {largest}
    right:  ft.nn.load_torch_state_dict({wider}_model, state_dict)
       or:  {{k: v.clamp(-{largest}, {largest}) for k, v in state_dict.items()}}   # clipped on purpose"""

_BEYOND_INT_RANGE = """\
{names}: integers beyond the leaf's {dtype} range ({low} to {high}), which the cast would wrap \
around (a silently different value), so they were not loaded. Give the model's {leaf} the \
dtype {wider} to hold them (64-bit integers need jax_enable_x64), or clip them yourself where \
that is meant:
"""
"""The start of the integer range hints, formatted by :func:`int_range_hint` (a narrower
integer leaf given integers it cannot hold: torch's int64 count past int32's largest)."""

INT_RANGE_HINT = _BEYOND_INT_RANGE + """
    wrong:  ft.from_flat_dict(model, flat, cast=True)   # {name} beyond {high}
    right:  ft.from_flat_dict(model, {{**flat, {name!r}: np.clip(flat[{name!r}], {low}, {high})}}, cast=True)"""

TORCH_INT_RANGE_HINT = _BEYOND_INT_RANGE + """
    wrong:  ft.nn.load_torch_state_dict(model, state_dict)   # {name} beyond {high}
    right:  ft.nn.load_torch_state_dict(model, {{**state_dict, {name!r}: state_dict[{name!r}].clamp({low}, {high})}})"""

META_TENSORS = """\
{caller}: {names} are torch tensors on the "meta" device: shapes without values (a module \
built under torch.device("meta"), or by init_empty_weights), nothing to load{strict}. Give \
real values:

    wrong:  {caller}({target}, meta_module.state_dict(){options})
    right:  module.to_empty(device="cpu"); module.load_state_dict(torch.load(path))
            {caller}({target}, module.state_dict(){options})"""


LAZY_TENSORS = """\
{caller}: {names} are torch's uninitialized parameters (a LazyLinear / LazyConv*d's before \
its first forward): no shape and no values, nothing to load{strict}. Run the torch module \
once, which gives them their shapes, then save or load its state dict:

    wrong:  {caller}({target}, lazy_module.state_dict(){options})
    right:  lazy_module(example_input)    # materializes the lazy parameters
            {caller}({target}, lazy_module.state_dict(){options})"""


_HINTS = {"torch": TORCH_HINT, "float": FLOAT_HINT, "int": INT_HINT, "cast": CAST_HINT}  # "range": range_hint, "wraps": int_range_hint, "kind": _kind_hint


def _spec(x: Any) -> tuple[tuple[int, ...], str]:
    if isinstance(x, (float, int, complex)) and not hasattr(x, "dtype"):
        return (), type(x).__name__
    return tuple(np.shape(x)), str(getattr(x, "dtype", type(x).__name__))


_NAMES: dict[Any, tuple[str, ...]] = {}  # tree definition -> its leaves' dotted names


def _named_leaves(tree: Any, fn: str) -> tuple[list[Any], Any, tuple[str, ...]]:
    """``(leaves, treedef, names)``: the dotted names are cached per tree definition.

    Only for trees whose dict keys are all ``str``: ``{1: x}``, ``{1.0: x}`` and
    ``{True: x}`` have equal tree definitions but different names.
    """
    ensure_acyclic(tree)
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    key, names = cached(_NAMES, treedef)
    if names is None:
        present = jax.tree.leaves(tree, is_leaf=is_none)
        names = tuple(n for n, x in zip(leaf_names(tree), present) if x is not None)  # the naming layer's
        path_leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
        if len(frozenset(names)) != len(names):
            _raise_duplicate(path_leaves, names, fn)
        if key is not None and _str_keys_only(path_leaves):
            bounded_put(_NAMES, key, names)
    return leaves, treedef, names


def _str_keys_only(path_leaves: list[tuple[Any, Any]]) -> bool:
    return all(
        type(k.key) is str for path, _ in path_leaves for k in path if isinstance(k, jax.tree_util.DictKey)
    )


def to_flat_dict(tree: Any, *, unstack: bool = False) -> dict[str, Any]:
    """A flat dict from dotted key-path names to leaves (``None`` leaves skipped).

    The names are computed once per tree definition; a later call costs a JAX flatten.
    An ``ft.nn.Stack`` gives one stacked leaf per field (``blocks.layers.up.weight``, shape
    ``(n, ...)``); with ``unstack=True``, one leaf per member (``blocks.3.up.weight``).

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> ft.to_flat_dict({"layers": [{"w": jnp.ones(2)}], "b": 0.5})
      {'b': 0.5, 'layers.0.w': Array([1., 1.], dtype=float32)}
    """
    if unstack:
        tree = _stacked.expand(tree)
    leaves, _, names = _named_leaves(tree, "to_flat_dict")
    return dict(zip(names, leaves))


def _raise_duplicate(path_leaves: list[tuple[Any, Any]], names: Sequence[str], fn: str) -> None:
    """Raise :data:`DUPLICATE_NAME` for the first two leaves of one name (the naming
    layer's, the flat dict's keys), by their key paths."""
    seen: dict[str, Any] = {}
    for (path, _), name in zip(path_leaves, names, strict=True):
        if name in seen:
            raise ValueError(
                DUPLICATE_NAME.format(
                    fn=fn,
                    name=name,
                    first=jax.tree_util.keystr(seen[name]),
                    second=jax.tree_util.keystr(path),
                    fixed=name.replace(".", "_") if "." in name else f"k{name}",
                )
            )
        seen[name] = path


@dataclasses.dataclass(frozen=True)
class FlatDictReport:
    """What did not fit in :func:`from_flat_dict`: names missing, unexpected and mismatched.

    ``hints`` say how to fix mismatches (a torch tensor, a float64 array: ``cast=True``).

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> template = {"w": jnp.zeros(2), "b": jnp.zeros(1)}
      >>> tree, report = ft.from_flat_dict(template, {"w": jnp.ones(3), "x": jnp.ones(1)}, strict=False)
      >>> report.ok, report.missing, report.unexpected
      (False, ('b',), ('x',))
      >>> report.mismatched
      (('w', 'shape (2,) dtype float32', 'shape (3,) dtype float32'),)
    """

    missing: tuple[str, ...] = ()
    unexpected: tuple[str, ...] = ()
    mismatched: tuple[tuple[str, str, str], ...] = ()  # (name, expected, given)
    hints: tuple[str, ...] = ()
    # The (kind, names) behind each hint ("torch", "float", "int", "cast": :data:`_HINTS`; "range", "wraps", "kind").
    hinted: tuple[tuple[str, tuple[str, ...]], ...] = dataclasses.field(default=(), repr=False)

    @property
    def ok(self) -> bool:
        return not (self.missing or self.unexpected or self.mismatched)

    def with_hint(self, kind: str, text: str) -> FlatDictReport:
        """This report with the hint for mismatches of ``kind`` written as ``text`` (its
        ``{names}``: theirs): a caller whose fix differs from :func:`from_flat_dict`'s (a
        loader that takes no ``cast=``).

        Example:
          >>> import functree as ft, jax.numpy as jnp, numpy as np
          >>> _, report = ft.from_flat_dict({"w": jnp.zeros(2)}, {"w": np.ones(2)}, strict=False)
          >>> report.with_hint("float", "{names}: cast them yourself").hints
          ('w: cast them yourself',)
        """
        hints = tuple(text.format(names=_listed(list(names))) if k == kind else h
                      for h, (k, names) in zip(self.hints, self.hinted))
        return dataclasses.replace(self, hints=hints) if self.hinted else self

    def __str__(self) -> str:
        lines = []
        if self.missing:
            lines.append(f"  missing keys:    {list(self.missing)}")
        if self.unexpected:
            lines.append(f"  unexpected keys: {list(self.unexpected)}")
        for name, expected, given in self.mismatched:
            lines.append(f"  {name}: expected {expected}, given {given}")
        lines.extend(f"  hint: {hint}" for hint in self.hints)
        return "\n".join(lines) or "  everything matched"


def _names_members(template: Any, flat: Mapping[str, Any], names: Sequence[str]) -> bool:
    """Whether a name of ``flat`` that is no stacked leaf's is a member's (``blocks.3.up.weight``):
    a stacked leaf the template lacks (``blocks.layers.member_scale``) is reported as
    unexpected against the stacked names, not as every leaf missing under member names."""
    known = frozenset(names)
    members = frozenset(_named_leaves(_stacked.expand(template), "from_flat_dict")[2])
    return any(k in members or resolve_alias(template, k) in members for k in flat if k not in known)


def from_flat_dict(template: Any, flat: Mapping[str, Any], *, strict: bool = True, cast: bool = False) -> Any:
    """Rebuild a tree shaped like ``template`` from a flat dict made by :func:`to_flat_dict`.

    Every leaf's shape and dtype is checked against the template. With ``strict=True`` any
    mismatch raises one error listing missing keys, unexpected keys and shape/dtype
    mismatches by name; with ``strict=False`` the template's leaf is kept wherever the
    flat dict does not fit, and ``(tree, report)`` is returned.

    ``cast=True`` converts what is only a floating dtype away: a float64 NumPy array, a
    torch tensor (through ``.detach().cpu().numpy()``; torch is never imported) or a
    Python float becomes the template leaf's floating dtype when its shape is the
    template's; an integer value becomes the leaf's integer dtype when it holds every value
    (torch's int64 step counts into int32 leaves; 2**40 is refused, never wrapped). Shapes
    are never changed, and no value changes kind (integer, floating, bool).

    A tied parameter of ``template`` (``ft.nn.Shared``) takes any of its names
    (``model.embed.embeddings``, ``embed.embeddings``, ``head.weight``; a transformed
    tie's value goes back through the transform's inverse): given under two names, the
    values must be equal.

    The stacks of ``template`` (``ft.nn.Stack``) take either form of
    :func:`to_flat_dict`: stacked leaves (``blocks.layers.up.weight``) or, when ``flat``
    holds a name that is no stacked leaf's, one entry per member (``blocks.3.up.weight``,
    a torch state dict's ``h.0.mlp.c_fc.weight``).

    Example:
      >>> import functree as ft, jax.numpy as jnp, numpy as np
      >>> template = {"w": jnp.zeros(2)}
      >>> ft.from_flat_dict(template, {"w": jnp.ones(2)})["w"]
      Array([1., 1.], dtype=float32)
      >>> ft.from_flat_dict(template, {"w": np.ones(2)}, cast=True)["w"]   # float64 -> float32
      Array([1., 1.], dtype=float32)
    """
    olds, treedef, names = _named_leaves(template, "from_flat_dict")
    check_no_meta(flat, "ft.from_flat_dict", "template", ", cast=True")
    flat = _through_ties(template, flat, frozenset(names))
    if _stacked.wants_members(template, flat, frozenset(names)) and _names_members(template, flat, names):
        out = from_flat_dict(_stacked.expand(template), flat, strict=strict, cast=cast)
        tree, report = (out, None) if strict else out
        tree = _stacked.restack(template, tree)
        return tree if strict else (tree, report)
    missing, mismatched, leaves = [], [], []
    hinted: dict[str, list[str]] = {}
    for name, old in zip(names, olds):
        if name not in flat:
            missing.append(name)
            leaves.append(old)
            continue
        new = _cast(old, flat[name]) if cast else flat[name]
        if _fits(old, new):
            leaves.append(new)
            continue
        mismatched.append((name, _described(old), _described(new)))
        kind = _hint_kind(old, new, cast)
        if kind is not None:
            hinted.setdefault(kind, []).append(name)
        leaves.append(old)
    known = frozenset(names)
    unexpected = tuple(k for k in flat if k not in known)
    dtypes = dict(zip(names, map(_template_dtype, olds)))
    hints = tuple(range_hint(FLOAT_RANGE_HINT, {n: dtypes[n] for n in names}) if kind == "range"
                  else int_range_hint(INT_RANGE_HINT, {n: dtypes[n] for n in names}) if kind == "wraps"
                  else _kind_hint(names, dtypes, flat, cast) if kind == "kind"
                  else _HINTS[kind].format(names=_listed(names)) for kind, names in hinted.items())
    report = FlatDictReport(tuple(missing), unexpected, tuple(mismatched), hints,
                            tuple((kind, tuple(names)) for kind, names in hinted.items()))
    if strict and not report.ok:
        raise ValueError(FLAT_DICT_MISMATCH.format(report=report))
    tree = jax.tree.unflatten(treedef, leaves)
    return tree if strict else (tree, report)


def _through_ties(template: Any, flat: Mapping[str, Any], known: frozenset[str]) -> Mapping[str, Any]:
    """``flat`` with the other names of tied parameters (an ``ft.nn.Shared``'s resolved
    names: ``head.weight``, ``embed.embeddings``) turned into their stored names
    (``model.embed.embeddings``); a value given under two names must be the same."""
    unknown = [k for k in flat if k not in known]
    if not unknown or (not any(is_tied(x) for x in jax.tree.leaves(template, is_leaf=is_tied)) and not is_tied(template)):
        return flat
    ties = tie_targets(template)
    out: dict[str, Any] = {}
    given: dict[str, str] = {}
    for k, v in flat.items():
        stored = k if k in known else resolve_alias(template, k)
        if stored is None or stored not in known:  # a member's: the members' pass, with the member's tie
            out[k] = v
            continue
        if k in ties and ties[k][1] is not None:  # a transformed tie: its source's value
            source_name, transform, source = ties[k]
            v = untransform(transform, source, np.asarray(to_numpy(v)), k, source_name)
        if stored in out and not _same(out[stored], v):
            raise ValueError(TIES_DISAGREE.format(first=given[stored], second=k, stored=stored))
        out.setdefault(stored, v)
        given.setdefault(stored, k)
    return out


def _same(a: Any, b: Any) -> bool:
    x, y = to_numpy(a), to_numpy(b)
    return x is not None and y is not None and x.shape == y.shape and bool(np.array_equal(x, y.astype(x.dtype)))


def _fits(old: Any, new: Any) -> bool:
    return _spec(old) == _spec(new) or _python_scalar_fits(old, new)


def _python_scalar_fits(old: Any, new: Any) -> bool:
    """A Python scalar leaf (Swift's ``bias: Float``) accepts a scalar array of its kind.

    Checkpoints store Python floats, ints and bools as 0-d arrays (float32, int32, bool).
    """
    if not isinstance(old, (bool, int, float)) or np.shape(new) != ():
        return False
    try:
        kind = np.dtype(getattr(new, "dtype", type(new))).kind
    except TypeError:  # a dtype NumPy does not know (torch.float32)
        return False
    if isinstance(old, bool):
        return kind == "b"
    return kind in ("i", "u") if isinstance(old, int) else kind == "f"


def check_no_meta(flat: Mapping[str, Any], caller: str, target: str, options: str = "", strict: str = "") -> None:
    """:data:`META_TENSORS` naming ``flat``'s torch tensors on the "meta" device (no values),
    :data:`LAZY_TENSORS` its uninitialized lazy parameters (no shape): torch's own error, from
    the conversion, names no key."""
    lazy = [repr(k) for k, v in flat.items() if type(v).__name__ in ("UninitializedParameter", "UninitializedBuffer")]
    if lazy:  # torch's own error (its shape read) names no key either
        raise ValueError(LAZY_TENSORS.format(caller=caller, names=_listed(lazy), strict=strict,
                                             target=target, options=options))
    names = [repr(k) for k, v in flat.items() if getattr(v, "is_meta", False) is True]
    if names:
        raise ValueError(META_TENSORS.format(caller=caller, names=_listed(names), strict=strict,
                                             target=target, options=options))


def _is_torch_like(x: Any) -> bool:
    """A tensor with ``.detach()``, ``.cpu()`` and ``.numpy()`` (torch's), without importing torch."""
    return all(callable(getattr(x, method, None)) for method in ("detach", "cpu", "numpy"))


def tensor_to_numpy(x: Any) -> np.ndarray:
    """A torch tensor as NumPy, without importing torch: bfloat16, which torch hands NumPy
    no dtype for, as its bits in ml_dtypes' bfloat16 (exact); complex32 widened to
    complex64 (``.float()`` would drop the imaginary parts); other dtypes NumPy lacks
    (float8) widened to float32. A lazy conjugate or negation (``c.conj()``, ``c.conj().imag``:
    a bit on the tensor, which ``.numpy()`` refuses) is applied first."""
    tensor = x.detach().cpu()
    if hasattr(tensor, "resolve_conj"):  # torch >= 1.10
        tensor = tensor.resolve_conj().resolve_neg()
    try:
        return np.asarray(tensor.numpy())
    except TypeError:
        torch = sys.modules[type(tensor).__module__.split(".")[0]]  # the tensor's own torch
        if str(tensor.dtype) == "torch.bfloat16":
            return tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        if tensor.is_complex():
            return np.asarray(tensor.to(torch.complex64).numpy())
        return np.asarray(tensor.float().numpy())


def to_numpy(x: Any) -> np.ndarray | None:
    """``x`` as a NumPy array (a torch-like tensor through ``.detach().cpu().numpy()``), else None."""
    if _is_torch_like(x):
        return tensor_to_numpy(x)
    if isinstance(x, (np.ndarray, np.generic, jax.Array, float, int)) or hasattr(x, "__array__"):
        return np.asarray(x)
    if isinstance(x, (list, tuple)):  # nested lists of numbers: an array, as np.asarray reads them
        try:
            value = np.asarray(x)
        except ValueError:  # ragged
            return None
        return value if value.dtype.kind in "biuf" else None
    return None


def _template_dtype(old: Any) -> np.dtype | None:
    if isinstance(old, float):
        return np.dtype(np.float64)  # a Python float leaf: any floating value, kept a float
    dtype = getattr(old, "dtype", None)
    try:
        return None if dtype is None else np.dtype(dtype)
    except TypeError:  # an extended dtype (a PRNG key's, key<fry>): no NumPy dtype, no cast
        return None


def _cast(old: Any, new: Any) -> Any:
    """``new`` converted to the template leaf's floating dtype when only the dtype differs."""
    if _fits(old, new):
        return new
    value = to_numpy(new)
    if value is None:
        return new
    if _fits(old, value):
        return _like(old, value)
    dtype = _template_dtype(old)
    if dtype is None or value.shape != np.shape(old) or not castable(dtype, value):
        return new
    return _like(old, value.astype(dtype))


def castable(dtype: np.dtype, value: np.ndarray) -> bool:
    """Whether ``value`` converts to ``dtype`` without changing kind or wrapping: the same
    dtype, both floating (bfloat16 too) with every finite value finite after the cast
    (float32's 7e4 into float16 is refused, never made inf), or both integers with every
    value held (torch's int64 step count of 3 into an int32 leaf; 2**40 is refused, never
    wrapped)."""
    given = np.dtype(value.dtype)
    if given == dtype:
        return True
    if _both_floating(given, dtype):
        return not overflows(dtype, value)
    if given.kind not in "iu" or dtype.kind not in "iu":
        return False
    info = np.iinfo(dtype)
    return value.size == 0 or bool(value.min() >= info.min and value.max() <= info.max)


def overflows(dtype: Any, value: np.ndarray) -> bool:
    """Whether casting the floating ``value`` to the floating ``dtype`` turns a finite entry
    into inf or NaN (a float32 running variance of 7e4 into float16: inf). Read only for a
    narrower range than the value's: its least and greatest entries, cast (rounding is
    monotone), or, where those are not finite, each finite entry."""
    given = np.dtype(value.dtype)
    if value.size == 0 or float(jnp.finfo(dtype).max) >= float(jnp.finfo(given).max):
        return False
    ends = np.array([value.min(), value.max()], given)
    with np.errstate(over="ignore", invalid="ignore"):  # the overflow is the answer, not a warning
        if np.isfinite(ends).all():
            return not bool(np.isfinite(ends.astype(dtype)).all())
        finite = value[np.isfinite(value)]
        return not bool(np.isfinite(finite.astype(dtype)).all())


def _like(old: Any, value: np.ndarray) -> Any:
    """A converted value in the template leaf's container: a JAX array, a Python scalar, NumPy."""
    if isinstance(old, (bool, int, float)) and not isinstance(old, np.generic):
        return type(old)(value)
    return jnp.asarray(value) if isinstance(old, jax.Array) else value


def _both_floating(a: Any, b: Any) -> bool:
    return bool(jnp.issubdtype(a, jnp.floating) and jnp.issubdtype(b, jnp.floating))


def _hint_kind(old: Any, new: Any, cast: bool) -> str | None:
    """Which hint fixes one mismatched leaf: "torch", "float", "kind" (an integer for a floating
    leaf, ...), "cast", "range" (floats past the leaf's), "wraps" (integers past it) or None
    (shapes say it all)."""
    shape = np.shape(old)
    if cast:
        value, dtype = to_numpy(new), _template_dtype(old)
        fits = value is not None and dtype is not None and value.shape == shape
        if fits and value is not None and _wraps(np.dtype(dtype), value):
            return "wraps"
        if fits and value is not None and _other_kind(dtype, value.dtype):
            return "kind"
        if value is None or not (fits and _both_floating(value.dtype, dtype)):
            return None if value is None else "cast"
        return "range" if overflows(dtype, value) else None
    if _is_torch_like(new):
        return "torch"
    given, dtype = _given_dtype(new), _template_dtype(old)
    if given is None or dtype is None or np.shape(new) != shape:
        return None
    try:
        if _both_floating(given, dtype):
            return "float"
        if _other_kind(dtype, given):
            return "kind"
        if _real_kind(given) != "integer" or _real_kind(dtype) != "integer":
            return None
        value = np.asarray(new)  # an int64 step count for an int32 leaf: cast=True's if it holds them
        return "wraps" if _wraps(np.dtype(dtype), value) else "int" if castable(np.dtype(dtype), value) else None
    except TypeError:  # a dtype NumPy does not know
        return None


def _given_dtype(new: Any) -> Any:
    """A given value's dtype: its own, or a Python number's or list's as NumPy reads it (3: int64)."""
    if hasattr(new, "dtype"):
        return new.dtype
    value = to_numpy(new) if isinstance(new, (int, float, list, tuple)) else None
    return None if value is None else value.dtype


def _real_kind(dtype: Any) -> str | None:
    """"bool", "integer" or "floating" (None for others: complex, a PRNG key's)."""
    return next((k for k, base in (("bool", jnp.bool_), ("integer", jnp.integer), ("floating", jnp.floating))
                 if jnp.issubdtype(dtype, base)), None)


def _other_kind(dtype: Any, given: Any) -> bool:
    """Whether ``given`` is a real dtype of another kind than the leaf's real ``dtype`` (int32
    for float32): a conversion the user may mean, never made by ``cast=True``."""
    leaf, value = _real_kind(dtype), _real_kind(given)
    return leaf is not None and value is not None and leaf != value


def _kind_hint(names: Sequence[str], dtypes: Mapping[str, Any], flat: Mapping[str, Any], cast: bool) -> str:
    """:data:`KIND_HINT` for the leaves ``names`` given values of another kind: each one's
    dtype and the given one's, the conversion to the leaf's dtype written for (up to three of)
    them."""
    def given(n: str) -> str:
        return str(getattr(flat[n], "dtype", type(flat[n]).__name__))

    kinds = ", ".join(f"{given(n)} for {np.dtype(dtypes[n]).name} at {n}" for n in names[:3])
    entries = ", ".join(f"{n!r}: np.asarray(flat[{n!r}], jnp.{np.dtype(dtypes[n]).name})" for n in names[:3])
    more = f" and {len(names) - 3} more" if len(names) > 3 else ""
    return KIND_HINT.format(names=_listed(list(names)), kinds=kinds + more, entries=entries + (", ..." if more else ""),
                            options=", cast=True" if cast else "")


def _largest(dtype: Any) -> str:
    """A floating dtype's largest finite value as code: ``65504``, ``448``, ``3.4028234663852886e+38``."""
    largest = float(jnp.finfo(dtype).max)
    return str(int(largest)) if largest < 2**53 else repr(largest)


def range_hint(text: str, dtypes: Mapping[str, Any]) -> str:
    """``text`` (:data:`FLOAT_RANGE_HINT`, :data:`TORCH_FLOAT_RANGE_HINT`) for the leaves
    ``{name: dtype}`` whose values are beyond their dtype's range: each dtype's largest value
    named, the fix written for the first (the bound to clip at is the leaf's, not float16's)."""
    kinds = list(dict.fromkeys(np.dtype(d) for d in dtypes.values()))
    first = kinds[0]
    limits = ", ".join(f"{d.name}'s is {_largest(d)}" for d in kinds)
    wider = "float32" if jnp.finfo(first).bits < 32 else "float64"
    return text.format(names=_listed(list(dtypes)), limits=limits, dtype=first.name, largest=_largest(first),
                       wider=wider)


def _wraps(dtype: np.dtype, value: np.ndarray) -> bool:
    """Whether ``value``'s integers do not fit the integer ``dtype``, narrower than 64 bits
    (one twice as wide holds them: :func:`int_range_hint`'s fix)."""
    return dtype.kind in "iu" and np.dtype(value.dtype).kind in "iu" and dtype.itemsize < 8 and not castable(dtype, value)


def int_range_hint(text: str, dtypes: Mapping[str, Any], leaf: str | None = None) -> str:
    """``text`` (:data:`INT_RANGE_HINT`, :data:`TORCH_INT_RANGE_HINT`) for the integer leaves
    ``{name: dtype}`` given integers beyond their range (:func:`_wraps`): the first's range
    named, the fix written for it (a leaf twice as wide, or its values clipped to the range);
    ``leaf``: its key path where ``name`` is another (a torch name), else ``name``."""
    name, first = next(iter(dtypes.items()))
    first = np.dtype(first)
    info = np.iinfo(first)
    wider = np.dtype(f"{first.kind}{2 * first.itemsize}").name
    return text.format(names=_listed(list(dtypes)), dtype=first.name, low=info.min, high=info.max, wider=wider,
                       name=name, leaf=leaf or name)


def _listed(names: list[str], most: int = 5) -> str:
    shown = ", ".join(names[:most])
    return shown if len(names) <= most else f"{shown} and {len(names) - most} more"


def _fmt(spec: tuple[tuple[int, ...], str]) -> str:
    return f"shape {spec[0]} dtype {spec[1]}"


def _described(x: Any) -> str:
    """A leaf as a mismatch shows it: a function by its name (``function jax.nn.relu``),
    anything else by shape and dtype."""
    if callable(x) and not hasattr(x, "dtype"):
        name = builtin_name(x) or getattr(x, "__qualname__", None) or type(x).__name__
        return f"function {name}"
    return _fmt(_spec(x))
