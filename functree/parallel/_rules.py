"""Sharding rules by key path: the ``PartitionSpec`` of every leaf of a model or state.

``rules`` is one of

* ``None``: every leaf replicated (``P()``);
* ``"fsdp"``: each floating leaf with at least :data:`FSDP_MIN_SIZE` elements is split
  over ``data_axis`` along its largest dimension divisible by the axis size (the first
  such on ties); smaller or indivisible leaves are replicated;
* ``{pattern: PartitionSpec or "fsdp"}``: glob patterns over the dotted names of
  ``ft.to_flat_dict`` (``"encoder.*.weight"``, ``"*.bias"``); the first matching pattern
  wins, unmatched leaves are replicated. A rule's value ``"fsdp"`` gives the leaves it
  matches the ``"fsdp"`` split above, so a last rule ``"*": "fsdp"`` reads "these rules,
  FSDP for everything else" (``sharding="fsdp"`` is ``{"*": "fsdp"}``)::

      {"*.query_projection.weight": P("data", "model"),   # tensor parallel (+ FSDP, written out)
       "*.output_projection.weight": P("model", "data"),
       "*": "fsdp"}                                        # every other leaf: FSDP

  A leaf a rule names keeps exactly its rule's spec: ``"*"`` never adds the data axis to
  it, so a tensor-parallel rule that also splits over ``data_axis`` (``P("data",
  "model")``) composes with the fallback without splitting one dimension twice. (Why a
  rule value rather than a wrapper such as ``fsdp(rules=...)``: the mapping stays one
  plain, printable value with one reading, first match wins, and "fsdp" can be given to
  any part of the model, not only to the rest.) The patterns are those of
  :mod:`functree._naming`, matched ``anywhere``:

A pattern matches a leaf when it matches its dotted name or any dotted suffix of it, so
the optimizer moments of a parameter (``1.mu.encoder.0.weight``) follow the parameter's
rule (``encoder.*.weight``). A leaf of an optimizer state matched through its
parameter's name (``*.weight`` or ``encoder.*.weight`` for ``1.v_row.encoder.0.weight``)
keeps the rule when the spec fits its shape and is replicated otherwise (factored
moments); a model's leaf, or a state's leaf the pattern names by its own path, must fit,
and no leaf takes a mesh axis the mesh lacks. Non-floating leaves (integers,
counts, PRNG keys) are always replicated: a rule that matches only such leaves is refused
(:data:`NON_FLOATING_RULE`), its fix the rules without it.

A leaf of an ``ft.nn.Stack`` (``blocks.layers.up.weight``, shape ``(n, ...)``) has a
leading layer axis per enclosing stack. ``"fsdp"`` splits one of its other dimensions,
never the layer axis. A rule's spec describes one member (``P(None, "model")`` for a
Dense weight of any stack depth: the layer axes are prepended unsplit), unless it has one
entry per dimension of the stacked leaf, layer axes included (``P("stage", None, None)``),
which is how a rule asks to split the layer axis.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, Mesh, PartitionSpec

from functree._naming import (
    check_patterns,
    kept_parts_fix,
    key_path_hint,
    leaf_infos,
    literal_pattern,
    match_kind,
    member_names,
    member_rule_names,
    right_name,
    suggestion,
)
from functree._stacked import stack_depths
from functree._tree import dotted_name, has_shape_and_dtype, written_dtype

__all__ = ["partition_specs", "FSDP_MIN_SIZE", "check_data_axis", "check_compute_dtype"]

FSDP = "fsdp"
"""The rule (and ``sharding=`` value) that splits leaves FSDP-style over the data axis."""

FSDP_MIN_SIZE = 1024
"""Leaves with fewer elements are replicated by ``"fsdp"`` (sharding them saves little
memory and costs one collective each).

Example:
  >>> import functree as ft
  >>> ft.parallel.FSDP_MIN_SIZE
  1024
"""

MISSING_AXIS = """\
The mesh has no axis {axis!r}; its axes are {axes}.

    wrong:  {call}(..., mesh=jax.make_mesh((8,), ("batch",)), data_axis="data")
    right:  {call}(..., mesh=jax.make_mesh((8,), ("data",)), data_axis="data")
       or:  {call}(..., mesh=mesh, data_axis={first!r})"""

UNMATCHED_RULE = """\
The sharding rule {pattern!r} matches no parameter. Closest names: {close}.
Patterns are globs over the dotted names of ft.to_flat_dict(model):

    wrong:  sharding={{{pattern!r}: P(...)}}
    right:  sharding={{{suggestion!r}: P(...)}}"""

MEMBER_RULE = """\
The sharding rule {pattern!r} matches no parameter, only members of a stacked leaf \
({members}): a rule shards a whole leaf of an ft.nn.Stack (all its members alike), \
never one member. Give the rule to the stacked leaf:

    wrong:  sharding={{{pattern!r}: P(...)}}
    right:  sharding={{{stacked!r}: P(...)}}   # P describes one member; the layer axis is prepended"""

BAD_SPEC = """\
The sharding rule {pattern!r} gives {spec} to {path}, of shape {shape}, which it cannot \
split: {why}.
Each sharded dimension must be divisible by the size of its mesh axes ({sizes}):

    wrong:  sharding={{{pattern!r}: {written}}}
    right:  sharding={right}"""

STACKED_SPEC = "{spec} (the rule's {written}, the layer axes of the stack prepended)"
"""How :data:`BAD_SPEC` names the spec a stacked leaf got from a rule written for one member."""

DUPLICATE_AXIS = """\
The sharding rule {pattern!r} gives {spec} to {path}, which names the mesh axis {axis!r} \
for more than one dimension: a mesh axis splits at most one dimension of a leaf.

    wrong:  sharding={{{pattern!r}: {spec}}}
    right:  sharding={{{pattern!r}: {right}}}   # each mesh axis once"""

BAD_RULES = """\
sharding= takes None, "fsdp" or a mapping {{pattern: PartitionSpec or "fsdp"}}, got {given}.

    wrong:  sharding="zero3"
    right:  sharding="fsdp"
       or:  sharding={{"encoder.*.weight": P(None, "model"), "*.bias": P()}}
       or:  sharding={{"encoder.*.weight": P("data", "model"), "*": "fsdp"}}   # FSDP for the rest"""

BAD_RULE_VALUE = """\
The sharding rule {pattern!r} gives {given}; a rule gives a PartitionSpec (or a tuple of \
mesh axis names) or "fsdp".

    wrong:  sharding={{{pattern!r}: {given}}}
    right:  sharding={{{pattern!r}: "fsdp"}}            # FSDP over the data axis
       or:  sharding={{{pattern!r}: P(None, "model")}}  # a spec per dimension"""

NON_FLOATING_RULE = """\
The sharding rule {pattern!r} names no floating leaf, only {leaves}: integer, boolean and \
PRNG-key leaves (counts, indices, masks, keys) are always replicated, so the rule places \
nothing. Drop it:

    wrong:  sharding={rules}
    right:  sharding={right}"""

SHADOWED_RULE = """\
The sharding rule {pattern!r} is never used: {name!r}, which it matches, is taken by the \
earlier rule {earlier!r} (the first matching rule wins). Put the narrower rule first:

    wrong:  sharding={{{earlier!r}: ..., {pattern!r}: ...}}
    right:  sharding={{{pattern!r}: ..., {earlier!r}: ...}}"""

BAD_COMPUTE_DTYPE = """\
{what} must be a floating dtype ({why}), got {given}.

    wrong:  {call}{given}{end}
    right:  {call}jnp.bfloat16{end}"""


def check_data_axis(mesh: Mesh | AbstractMesh, data_axis: str, call: str = "ft.shard") -> None:
    """Raise a clear error when ``mesh`` has no axis named ``data_axis``."""
    if data_axis not in mesh.axis_names:
        raise ValueError(MISSING_AXIS.format(axis=data_axis, axes=tuple(mesh.axis_names), call=call,
                                             first=mesh.axis_names[0]))


def check_compute_dtype(dtype: Any, call: str = "compute_dtype=") -> Any:
    """``dtype`` as a NumPy dtype, or a clear error (showing ``call``: ``compute_dtype=``,
    or ``ft.cast(model, `` ending ``)``) when it is not floating."""
    try:
        dt = np.dtype(dtype)
    except TypeError:
        dt = None
    if dt is None or not jnp.issubdtype(dt, jnp.floating):
        what, why, end = (("compute_dtype", "the parameters and floating inputs are cast to it for the loss", "")
                          if call == "compute_dtype=" else ("ft.cast's dtype", "the parameters are cast to it", ")"))
        raise TypeError(BAD_COMPUTE_DTYPE.format(what=what, why=why, given=written_dtype(dtype), call=call, end=end))
    return dt


def _is_floating(x: Any) -> bool:
    # jnp's lattice, not NumPy's: bfloat16 and the float8 types (ml_dtypes) are no
    # np.floating, and a bfloat16 model would be replicated silently.
    dtype = getattr(x, "dtype", None)
    return dtype is not None and bool(jnp.issubdtype(dtype, jnp.floating))


def _axis_size(mesh: Mesh | AbstractMesh, entry: Any) -> int:
    names = entry if isinstance(entry, tuple) else (entry,)
    return math.prod(mesh.shape[n] for n in names)


def _misfit(spec: PartitionSpec, shape: tuple[int, ...], mesh: Mesh | AbstractMesh) -> str | None:
    """Why ``spec`` cannot split ``shape`` on ``mesh`` (None when it can)."""
    unknown = _unknown_axis(spec, mesh)
    if unknown is not None:
        return unknown
    if len(spec) > len(shape):
        return f"the spec has {len(spec)} entries and the leaf {len(shape)} dimensions"
    for dim, entry in enumerate(spec):
        if entry is None:
            continue
        size = _axis_size(mesh, entry)
        if shape[dim] % size:
            return f"dimension {dim} has size {shape[dim]}, not divisible by mesh axis {entry!r} of size {size}"
    return None


def _unknown_axis(spec: PartitionSpec, mesh: Mesh | AbstractMesh) -> str | None:
    """Why ``spec`` fits no leaf on ``mesh``: a name that is no axis of it (None when none)."""
    for entry in spec:
        for name in entry if isinstance(entry, tuple) else (entry,):
            if name is not None and name not in mesh.axis_names:
                return f"the mesh has no axis {name!r} (its axes: {tuple(mesh.axis_names)})"
    return None


def _once(spec: PartitionSpec) -> PartitionSpec:
    """``spec`` with every mesh axis kept at its first dimension only."""
    seen: set[str] = set()
    entries = []
    for entry in spec:
        names = [n for n in (entry if isinstance(entry, tuple) else (entry,)) if n is not None and n not in seen]
        seen.update(names)
        entries.append(None if not names else names[0] if len(names) == 1 else tuple(names))
    return PartitionSpec(*entries)


def _check_axes_once(spec: PartitionSpec, pattern: str, name: str) -> None:
    """Refuse a spec naming one mesh axis twice (``P("model", "model")``) here, naming the
    rule and the leaf, rather than in JAX's ``DuplicateSpecError``, which names neither."""
    axes = [n for entry in spec for n in (entry if isinstance(entry, tuple) else (entry,)) if isinstance(n, str)]
    again = next((n for i, n in enumerate(axes) if n in axes[:i]), None)
    if again is not None:
        raise ValueError(DUPLICATE_AXIS.format(pattern=pattern, spec=spec, path=name, axis=again, right=_once(spec)))


def _fsdp_spec(shape: tuple[int, ...], axis: str, size: int, layers: int = 0) -> PartitionSpec:
    """Split the largest divisible dimension after the first ``layers`` (a stack's layer axes)."""
    if math.prod(shape) < FSDP_MIN_SIZE or size == 1:
        return PartitionSpec()
    dims = [d for d in range(layers, len(shape)) if shape[d] % size == 0]
    if not dims:
        return PartitionSpec()
    best = max(dims, key=lambda d: (shape[d], -d))
    return PartitionSpec(*([None] * best), axis)


def _member_spec(spec: PartitionSpec, ndim: int, layers: int) -> PartitionSpec:
    """A rule's spec for a leaf under ``layers`` stacks: one member's, with the layer axes
    prepended unsplit, unless it names every dimension of the stacked leaf."""
    if not layers or len(spec) == ndim:
        return spec
    return PartitionSpec(*([None] * layers), *spec)


def _hits(name: str, pattern: str) -> tuple[bool, bool]:
    """Whether ``pattern`` matches ``name`` itself, and whether it matches ``name`` or one of
    its dotted suffixes (an optimizer moment's name ends with its parameter's)."""
    kind = match_kind(name, pattern, anywhere=True)  # the naming layer's one glob semantics
    return kind == "direct", kind is not None


def _through_parameter(name: str, pattern: str) -> bool:
    """Whether ``pattern`` matches a dotted suffix of ``name`` shorter than it: for a leaf of
    an optimizer state, the name of the parameter it follows. ``*.weight`` matches
    ``inner.0.v_row.layers.0.weight`` itself too, but names it through ``layers.0.weight``;
    ``inner.0.v_row.*`` names the state's own leaf."""
    rest = name.partition(".")[2]
    return bool(rest) and match_kind(rest, pattern, anywhere=True) is not None


def _rule_spec(name: str, leaf: Any, rules: Mapping[str, Any], mesh: Mesh | AbstractMesh, taken: dict[str, str],
               layers: int = 0, data_axis: str = "data", moment: bool = True, names: Sequence[str] = ()) -> PartitionSpec:
    for pattern, spec in rules.items():
        if not _hits(name, pattern)[1]:
            continue
        taken[name] = pattern
        if isinstance(spec, str):  # "fsdp" (checked by check_rules)
            return _fsdp_spec(tuple(leaf.shape), data_axis, mesh.shape[data_axis], layers)
        spec = spec if isinstance(spec, PartitionSpec) else PartitionSpec(*spec)
        _check_axes_once(spec, pattern, name)  # a moment's too: no shape can take it
        spec = _member_spec(spec, len(leaf.shape), layers)
        why = _misfit(spec, tuple(leaf.shape), mesh)
        if why is None:
            return spec
        # A moment may be of another shape than its parameter (factored: Adafactor's v_row),
        # and is replicated then; no leaf's shape takes a mesh axis the mesh lacks.
        if not moment or _unknown_axis(spec, mesh) or not _through_parameter(name, pattern):
            _refuse_misfit(name, tuple(leaf.shape), pattern, rules, mesh, layers, why, names)
        return PartitionSpec()  # a moment of another shape (factored): replicated
    return PartitionSpec()


def _written(spec: Any) -> PartitionSpec:
    return spec if isinstance(spec, PartitionSpec) else PartitionSpec(*spec)


def _refuse_misfit(name: str, shape: tuple[int, ...], pattern: str, rules: Mapping[str, Any],
                   mesh: Mesh | AbstractMesh, layers: int, why: str, names: Sequence[str]) -> None:
    """:data:`BAD_SPEC` for a rule whose spec cannot split the leaf ``name``, showing the
    spec as the user wrote it and a fix that places it (:func:`_misfit_fix`)."""
    written = _written(rules[pattern])
    spec = _member_spec(written, len(shape), layers)
    shown = STACKED_SPEC.format(spec=spec, written=written) if spec != written else str(spec)
    sizes = ", ".join(f"{a}={n}" for a, n in mesh.shape.items())
    raise ValueError(BAD_SPEC.format(pattern=pattern, spec=shown, path=name, shape=shape, why=why, sizes=sizes,
                                     written=written, right=_misfit_fix(name, shape, pattern, rules, mesh, layers,
                                                                        names)))


def _misfit_fix(name: str, shape: tuple[int, ...], pattern: str, rules: Mapping[str, Any],
                mesh: Mesh | AbstractMesh, layers: int, names: Sequence[str]) -> str:
    """The ``right:`` of :data:`BAD_SPEC`: the spec with a misspelt mesh axis replaced (the
    closest, or the one left), or its surplus trailing ``None`` entries dropped, where that
    fits; else the leaf replicated. A glob that also names other leaves (``names``: the
    model's, not its moments) keeps its spec for them, the leaf getting a rule of its own
    first: ``{"*.weight": P()}`` replicated every weight (a model too large for one device,
    on every device)."""
    written = _written(rules[pattern])
    respelt = _respelt(written, mesh)
    trimmed = PartitionSpec(*_trimmed(list(written)))
    for spec, note in [(respelt, f"the mesh's axes are {tuple(mesh.axis_names)}"),
                       (trimmed, "no entry for a dimension the leaf lacks")]:
        if spec != written and spec is not None and _misfit(_member_spec(spec, len(shape), layers), shape, mesh) is None:
            return f"{{{pattern!r}: {spec}}}   # {note}"
    kept = written if respelt == written else respelt  # (None: an axis no spec can name)
    earlier = list(rules)[:list(rules).index(pattern)]
    others = [n for n in names if n != name and _hits(n, pattern)[1] and not any(_hits(n, p)[1] for p in earlier)]
    if kept is None:
        return f"{{{pattern!r}: P()}}   # replicated, or name the mesh's axes: {tuple(mesh.axis_names)}"
    if not others:
        return f"{{{pattern!r}: P()}}   # replicated" + (f", or a spec that divides {shape}" if shape else "")
    own = literal_pattern(name)
    return f"{{{own!r}: P(), {pattern!r}: {kept}}}   # {name} replicated, first; the rule for the others"


def _trimmed(entries: list[Any]) -> list[Any]:
    while entries and entries[-1] is None:
        entries = entries[:-1]
    return entries


def _respelt(spec: PartitionSpec, mesh: Mesh | AbstractMesh) -> PartitionSpec | None:
    """``spec`` with each name the mesh lacks replaced by the mesh axis most like it (or the
    only one ``spec`` leaves free); ``spec`` itself when it names none, None when a name has
    no such axis."""
    used = [n for entry in spec for n in (entry if isinstance(entry, tuple) else (entry,)) if n is not None]
    free = [a for a in mesh.axis_names if a not in used]
    close: dict[Any, str] = {}
    for n in used:
        if n in mesh.axis_names:
            continue
        near = difflib.get_close_matches(str(n), free, n=1, cutoff=0.6) or (free if len(free) == 1 else [])
        if not near:
            return None
        close[n] = near[0]
        free.remove(near[0])
    return PartitionSpec(*[tuple(close.get(n, n) for n in e) if isinstance(e, tuple) else close.get(e, e) for e in spec])


def _is_state(node: Any) -> bool:
    """An optimizer state: functree's, or one of optax's (a NamedTuple)."""
    from functree.optim._state import OptimizerState  # functree.optim is above this layer

    return isinstance(node, OptimizerState) or (isinstance(node, tuple) and hasattr(node, "_fields"))


def in_optimizer_states(tree: Any) -> list[bool]:
    """For each leaf of ``tree`` (in flattening order), whether it lies in an optimizer state:
    a moment, whose name ends with its parameter's, and not a parameter of a model held
    beside the state (``(model, state)``: ``0.layers.1.weight``)."""
    flags: list[bool] = []
    for node in jax.tree.leaves(tree, is_leaf=_is_state):
        flags += [True] * len(jax.tree.leaves(node)) if _is_state(node) else [False]
    return flags


def check_rules(rules: Any) -> None:
    """Refuse sharding rules that are neither None, ``"fsdp"`` nor a mapping of glob to spec,
    and patterns that every key-path pattern refuses (:func:`functree._naming.check_patterns`:
    a regex's ``[^0]``, which a glob reads as "^ or 0", a printed key path, a reversed range):
    such a rule matches other leaves than meant, or none, and a leaf left unsplit is only
    seen as memory."""
    if rules is None or (isinstance(rules, str) and rules == FSDP):
        return
    if not isinstance(rules, Mapping):
        raise TypeError(BAD_RULES.format(given=repr(rules)[:80]))
    check_patterns([k for k in rules if isinstance(k, str) or key_path_hint(k)])  # a KeyPath: its dotted name
    if not all(isinstance(k, str) for k in rules):
        raise TypeError(BAD_RULES.format(given=repr(rules)[:80]))
    for pattern, spec in rules.items():
        if not (isinstance(spec, (PartitionSpec, tuple, list)) or (isinstance(spec, str) and spec == FSDP)):
            raise TypeError(BAD_RULE_VALUE.format(pattern=pattern, given=repr(spec)[:60]))


def partition_specs(tree: Any, rules: Any = None, *, mesh: Mesh | AbstractMesh, data_axis: str = "data",
                    strict: bool = True) -> Any:
    """The tree of ``PartitionSpec``s that ``rules`` give the array leaves of ``tree``.

    ``tree`` is a model, a parameter view, an optimizer state or any pytree of arrays (or
    of ``jax.ShapeDtypeStruct``); ``rules`` is ``None``, ``"fsdp"`` or
    ``{pattern: PartitionSpec or "fsdp"}`` (see the module docstring; ``"*": "fsdp"`` last
    for FSDP on every leaf no other rule names). Non-array leaves stay as they are; every
    array leaf gets a spec.

    Raises ``ValueError`` for a ``data_axis`` the mesh lacks, a pattern that matches no
    floating leaf (naming the closest names) or only leaves an earlier pattern took (not
    with ``strict=False``, for a tree that holds only part of the model), a spec that
    cannot split the leaf it names and a spec naming one mesh axis twice, and for a pattern
    every key-path pattern refuses (:func:`functree._naming.check_patterns`: ``[^0]``, a
    printed key path); ``TypeError`` for a rule value other than a ``PartitionSpec`` or
    ``"fsdp"``.

    Example:
      >>> import functree as ft, jax, jax.numpy as jnp
      >>> from jax.sharding import PartitionSpec as P
      >>> mesh = jax.make_mesh((1,), ("data",))
      >>> params = {"dense": {"weight": jnp.ones((64, 32)), "bias": jnp.ones(32)}}
      >>> ft.partition_specs(params, "fsdp", mesh=mesh)["dense"]
      {'bias': P(), 'weight': P()}
      >>> ft.partition_specs(params, {"*.weight": P(None, "data")}, mesh=mesh)["dense"]
      {'bias': P(), 'weight': P(None, 'data')}
      >>> mesh2 = jax.sharding.AbstractMesh((2, 2), ("data", "model"))
      >>> ft.partition_specs(params, {"*.bias": P("model"), "*": "fsdp"}, mesh=mesh2)["dense"]
      {'bias': P('model',), 'weight': P('data',)}
    """
    check_data_axis(mesh, data_axis, "ft.partition_specs")
    check_rules(rules)
    path_leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    names = [dotted_name(p) for p, _ in path_leaves]
    depths = stack_depths(tree)  # leading layer axes of each leaf (ft.nn.Stack)
    taken: dict[str, str] = {}  # leaf name -> the rule that gave its spec
    specs = []
    moments = in_optimizer_states(tree)
    parameters = [n for n, (_, leaf), moment in zip(names, path_leaves, moments, strict=True)
                  if not moment and _is_floating(leaf)]  # what a misfit's fix keeps the rule for
    for name, (_, leaf), layers, moment in zip(names, path_leaves, depths, moments, strict=True):
        if not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
            specs.append(leaf)
        elif not _is_floating(leaf) or rules is None:
            specs.append(PartitionSpec())
        elif isinstance(rules, str):  # "fsdp"
            specs.append(_fsdp_spec(tuple(leaf.shape), data_axis, mesh.shape[data_axis], layers))
        else:
            specs.append(_rule_spec(name, leaf, rules, mesh, taken, layers, data_axis, moment, parameters))
    if strict and isinstance(rules, Mapping):
        arrays = [(n, leaf) for n, (_, leaf) in zip(names, path_leaves) if has_shape_and_dtype(leaf)]
        floating = [n for n, leaf in arrays if _is_floating(leaf)]
        if any(len(leaf.shape) for n, leaf in arrays if n in floating):  # not only scalars (an SGD state)
            fixed = [(n, leaf) for n, leaf in arrays if not _is_floating(leaf)]
            _check_all_used(rules, taken, floating, tree, fixed)
    return jax.tree.unflatten(treedef, specs)


def _stacked_name(member: str, tree: Any) -> str:
    """The stacked name of the leaf a member name belongs to."""
    for info in leaf_infos(tree):
        if member in member_names(info):
            return info.name
    return member


def _check_all_used(rules: Mapping[str, Any], taken: dict[str, str], names: list[str], tree: Any,
                    fixed: list[tuple[str, Any]]) -> None:
    """Refuse a rule that gave no floating leaf its spec (``fixed``: the other array leaves,
    always replicated, named when the rule matches only those)."""
    used = set(taken.values())
    for pattern in rules:
        if pattern in used:
            continue
        members = member_rule_names(pattern, leaf_infos(tree))
        if members:
            raise ValueError(MEMBER_RULE.format(pattern=pattern, members=", ".join(map(repr, members[:3])),
                                                stacked=_stacked_name(members[0], tree)))
        shadowed = next((n for n in names if _hits(n, pattern)[1] and n in taken), None)
        if shadowed is not None:
            raise ValueError(SHADOWED_RULE.format(pattern=pattern, name=shadowed, earlier=taken[shadowed]))
        _refuse_non_floating(pattern, rules, fixed)
        close = difflib.get_close_matches(pattern, names, n=3, cutoff=0.0)
        better = (suggestion(pattern, leaf_infos(tree)) or kept_parts_fix(pattern, close)
                  or right_name(pattern, close, "*.weight"))  # a glob stays one
        raise ValueError(UNMATCHED_RULE.format(pattern=pattern, close=", ".join(map(repr, close)), suggestion=better))


def _refuse_non_floating(pattern: str, rules: Mapping[str, Any], fixed: list[tuple[str, Any]]) -> None:
    """:data:`NON_FLOATING_RULE` for a rule matching only integer, boolean or key leaves: its
    fix is the rules without it, as no pattern places such a leaf (the unmatched rule's fix,
    a closest floating name or the pattern's own ``*.`` form, gave another leaf the spec or
    the same error again)."""
    hit = [f"{n} ({leaf.dtype}, shape {tuple(leaf.shape)})" for n, leaf in fixed if _hits(n, pattern)[1]]
    if hit:
        rest = {k: v for k, v in rules.items() if k != pattern}
        leaves = ", ".join(hit[:3]) + (f" and {len(hit) - 3} more" if len(hit) > 3 else "")
        raise ValueError(NON_FLOATING_RULE.format(pattern=pattern, leaves=leaves, rules=dict(rules),
                                                  right=rest or None))
