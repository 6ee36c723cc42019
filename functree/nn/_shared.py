"""``ft.nn.Shared``: weight tying that survives gradients, optimizers and checkpoints.

A tie stores the value once. ``Shared(model, {target: source})`` keeps ``model`` with the
target removed (``None``) and puts the source's value there whenever the model is used:

    resolve(shared) = model with model[target] = transform(model[source])

so the pytree has one leaf for the tied value. Its gradient is then the sum over both
uses (the chain rule through the copy), ``∂L/∂w = ∂L/∂w_source + transformᵀ(∂L/∂w_target)``,
and the optimizer's moments and a checkpoint hold it once.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from functree._key_path_names import key_path
from functree._leaf_checks import leaf_spec, quoted
from functree._module import Module, field
from functree._naming import untransform
from functree._paths import KeyPath
from functree._tree import dotted_name
from functree.nn._sequential import member_cache

__all__ = ["Shared"]

BAD_TIE = """\
ft.nn.Shared ties {{target: source}} or {{target: (source, transform)}} with key paths \
into the model, got {given!r}.

    right:  ft.nn.Shared(model, {{"head.weight": ("embed.embeddings", jnp.transpose)}})
       or:  ft.nn.Shared(model, {{"decoder": "encoder"}})   # one layer at two places"""

SOURCE_UNDER_TARGET = """\
ft.nn.Shared: the source {source!r} lies inside the tied target {target!r}, which is \
removed from the stored model. Tie each place to the one value that stays:

    wrong:  {{"b": "a", "c": "b"}}
    right:  {{"b": "a", "c": "a"}}"""

BAD_TARGET = """\
ft.nn.Shared can tie a field of a Module, an item of a list, tuple or dict; the target \
{path} lies in a {type}. Tie the enclosing value instead."""

PART_OF_TRANSFORMED = """\
ft.set({path}): {target} is tied to a transform of {source}; set the whole target or the \
source, not part of it.
    right:  ft.set(model, "{source}", value)"""

TIE_SHAPE = """\
ft.nn.Shared: the tie {{{target}: {spec}}} puts {given} at {at}, which holds \
{expected}. A tied value takes the place of the target's: it must have its shape and dtype.{hint}
    wrong:  ft.nn.Shared(model, {{{target}: {spec}}})
    right:  ft.nn.Shared(model, {{{target}: {right}}}){note}"""

TIE_TRANSPOSED = """
A matrix of the reversed shape is used transposed (an embedding matrix (vocab, width) as the \
output projection (width, vocab)): tie it through jnp.transpose, not a reshape, which would \
scramble it."""

NOTHING_TIED = """\
ft.nn.Shared needs at least one tie {target: source}.

    right:  ft.nn.Shared(model, {"decoder": "encoder"})"""


def _removed(tree: Any, path: KeyPath) -> Any:
    """``tree`` with ``None`` at ``path`` (``ft.set`` would refuse: None has no shape)."""
    parent_path, last = KeyPath(path[:-1]), path[-1]
    parent = parent_path.get(tree)
    if isinstance(parent, Module) or hasattr(parent, "_replace"):
        new = parent.replace(**{last.key: None}) if isinstance(parent, Module) else parent._replace(**{last.key: None})
    elif isinstance(parent, (list, tuple)):
        new = type(parent)(None if i == last.key % len(parent) else v for i, v in enumerate(parent))
    elif isinstance(parent, Mapping):
        new = {**parent, last.key: None}
    else:
        raise ValueError(BAD_TARGET.format(path=path, type=type(parent).__name__))
    return parent_path.set(tree, new) if parent_path else new


def _check_tie(old: Any, new: Any, transform: Any, target: Any, source: Any) -> None:
    """Raise TIE_SHAPE where the tied value ``new`` has another shape or dtype than the
    target's ``old`` value (a leaf, or a layer of the same structure: leaf by leaf)."""
    pairs = [("", old, new)]
    old_leaves, old_def = jax.tree_util.tree_flatten_with_path(old)
    new_leaves, new_def = jax.tree_util.tree_flatten_with_path(new)
    if leaf_spec(old) is None and old_def == new_def:
        pairs = [(dotted_name(p), a, b) for (p, a), (_, b) in zip(old_leaves, new_leaves)]
    for where, a, b in pairs:
        expected, got = leaf_spec(a), leaf_spec(b)
        if expected is None or got is None or expected == got:
            continue
        right, note = _right_spec(quoted(source), transform, where, got, expected)
        raise ValueError(TIE_SHAPE.format(
            target=quoted(target), spec=_spec_text(source, transform), at=".".join(filter(None, (str(target), where))),
            given=_shape_text(got), expected=_shape_text(expected),
            hint=TIE_TRANSPOSED if _transposed(where, transform, got, expected) else "", right=right, note=note))


def _transposed(where: str, transform: Any, got: Any, expected: Any) -> bool:
    """Whether a plain array tie would fit through a transpose (a matrix of the reversed shape)."""
    return not where and transform is None and len(got[0]) == 2 and got[0] == expected[0][::-1]


def _right_spec(source: str, transform: Any, where: str, got: Any, expected: Any) -> tuple[str, str]:
    """``(the tie's value, a comment)`` in the fix: the source through the transform that
    fits (a transpose, a cast), else what the transform or the source must give."""
    cast = "" if got[1] == expected[1] else f".astype(jnp.{expected[1]})"
    if _transposed(where, transform, got, expected):
        return (f"({source}, jnp.transpose)" if not cast else f"({source}, lambda w: w.T{cast})"), ""
    if got[0] == expected[0] and not where:
        return f"({source}, lambda w: {_call(transform)}{cast})", ""
    if where:
        return "source", f"   # a source whose {where} has {_shape_text(expected)}"
    return f"({source}, transform)", f"   # transform(value): {_shape_text(expected)}"


def _call(transform: Any) -> str:
    return "w" if transform is None else f"{_function_name(transform)}(w)"


def _function_name(transform: Any) -> str:
    """How the user's code names ``transform``: ``jnp.transpose``, a def's name, else ``transform``."""
    name = getattr(transform, "__name__", "")
    if getattr(jnp, name, None) is transform:
        return f"jnp.{name}"
    return name if name.isidentifier() else "transform"


def _spec_text(source: Any, transform: Any) -> str:
    return quoted(source) if transform is None else f"({quoted(source)}, {_function_name(transform)})"


def _shape_text(spec: Any) -> str:
    return f"shape {spec[0]} and dtype {spec[1]}"


def _rank(value: Any) -> int | None:
    """An array's number of axes; None for another value (a layer tied whole)."""
    shape = getattr(value, "shape", None)
    return None if shape is None else len(shape)


def _inside(path: KeyPath, prefix: KeyPath) -> bool:
    return len(path) >= len(prefix) and tuple(path[: len(prefix)]) == tuple(prefix)


def _transformed(transform: Callable[[Any], Any], value: Any) -> Any:
    """``transform(value)``; a host (NumPy) source of a half-precision float keeps its width.

    NumPy computes a host value's transform, and its promotion is the one to keep for
    float64 and float32 (a float64 ``w`` gives float64 ``0.1 * w.T``, exactly as the float64
    source is exported; JAX without x64 would give float32, 7e-9 off). A narrower source's
    result takes the dtype ``jax.eval_shape`` gives the transform (bfloat16 for ``0.1 * w.T``
    of a bfloat16 ``w``, as torch's), so an exported target keeps the source's dtype; where
    that is the source's dtype, the transform runs on float32 and is rounded once, as torch
    computes ``0.1 * w``, whatever NumPy's promotion of the version installed. A transform JAX
    cannot trace (NumPy-only code such as ``np.ascontiguousarray``) keeps NumPy's result. JAX
    arrays and tracers (a jitted call) are left as the transform gives them."""
    out = transform(value)
    if not (isinstance(out, np.ndarray) and isinstance(value, np.ndarray) and _half_float(value.dtype)):
        return out
    try:
        wanted = jax.eval_shape(transform, value).dtype
    except Exception:  # the call above ran; only tracing failed: NumPy's dtype stands
        return out
    if wanted == value.dtype:
        # Computed on float32 (which holds every half-precision value exactly) and rounded
        # once, as torch computes 0.1 * w: not left to NumPy's promotion, which changed under
        # us (ml_dtypes 0.7 keeps 0.1 * bfloat16 in bfloat16, rounding 0.1 to bfloat16 first:
        # one bfloat16 step off torch's product; ml_dtypes 0.6 widened it to float32).
        wide = transform(value.astype(np.float32))
        if isinstance(wide, np.ndarray) and wide.shape == out.shape:
            return wide.astype(wanted)
    return out.astype(wanted, copy=False)


def _half_float(dtype: np.dtype) -> bool:
    """A floating dtype narrower than float32 (bfloat16, float16, the float8s), whose NumPy
    arithmetic widens to float32 where JAX's keeps the narrow dtype."""
    return bool(jnp.issubdtype(dtype, jnp.floating)) and dtype.itemsize < 4


class Shared(Module):
    """A model in which some places hold the same value, stored once (weight tying).

    ``Shared(model, {target: source})`` ties the value at key path ``target`` to the one
    at ``source`` (any value: an array, a layer); ``{target: (source, transform)}`` puts
    ``transform(source value)`` there, e.g. an embedding matrix used transposed as the
    output projection. The stored ``model`` holds ``None`` at each target, so gradients,
    optimizer state and checkpoints have one leaf per tied value and the tie holds after
    any number of steps. :meth:`resolve` gives the complete model; calling a ``Shared``
    calls it.

    Args:
      model: the model, with any value at the targets (one layer object at two fields,
        PyTorch-style, works; its shape is checked against the source's).
      ties: ``{target: source}`` or ``{target: (source, transform)}``; key paths as in
        :func:`ft.get` (``"head.weight"``, ``".layers[1]"``).

    Example:
      >>> import functree as ft, jax, jax.numpy as jnp
      >>> class LM(ft.Module):
      ...     embed: ft.nn.Embedding
      ...     head: ft.nn.Dense
      ...     def __call__(self, tokens):
      ...         return self.head(self.embed(tokens))
      >>> k1, k2 = jax.random.split(jax.random.key(0))
      >>> lm = ft.nn.Shared(LM(ft.nn.Embedding(10, 4, key=k1), ft.nn.Dense(4, 10, key=k2)),
      ...                   {"head.weight": ("embed.embeddings", jnp.transpose)})
      >>> lm(jnp.array([1, 2])).shape
      (2, 10)
      >>> sorted(ft.to_flat_dict(lm))  # the tied matrix is stored once
      ['model.embed.embeddings', 'model.head.bias']
      >>> bool((lm.resolve().head.weight == lm.model.embed.embeddings.T).all())
      True

    Names: the stored tree names the tied matrix once, ``model.embed.embeddings`` (the
    names of ``ft.to_flat_dict`` and checkpoints); it answers also to the resolved
    model's names, ``embed.embeddings`` and ``head.weight`` (torch's names), in
    ``ft.get``/``ft.set``, ``ft.select`` and ``ft.from_flat_dict``:

      >>> bool((ft.get(lm, "head.weight") == lm.model.embed.embeddings.T).all())
      True
      >>> ft.select(lm, "head.weight").model.embed.embeddings
      True

    An ensemble of tied models built with ``jax.vmap`` (leaves with a leading model axis)
    resolves model by model: :attr:`ranks` records each transformed source's rank, and a
    transform is mapped over the axes in front (``ft.get(ensemble, "head.weight")`` is
    each model's transpose).
    """

    model: Any
    ties: tuple[tuple[KeyPath, KeyPath, Callable[[Any], Any] | None], ...] = field(static=True)
    # Per tie, the rank of a transformed source array (else None): a source of more axes is a
    # batch of models (a jax.vmap-ed ensemble), which a transform such as jnp.transpose would mix.
    ranks: tuple[int | None, ...] | None = field(static=True, default=None)
    __ft_tied__: ClassVar[bool] = True
    __ft_template_static__: ClassVar[tuple[str, ...]] = ("ranks",)  # derived: a restore's template decides them
    __ft_added_static__: ClassVar[tuple[str, ...]] = ("ranks",)  # files written before it read as None
    __ft_repr_hidden__: ClassVar[tuple[str, ...]] = ("ranks",)  # derived bookkeeping: not shown in repr

    def __ft_derive_added__(self, names: frozenset[str]) -> dict[str, Any]:
        """``ranks`` for a Shared read from a file written before it, as built now."""
        if "ranks" not in names:
            return {}
        return {"ranks": tuple(None if t is None else _rank(source.get(self.model)) for _, source, t in self.ties)}

    def __init__(self, model: Any, ties: Mapping[str | KeyPath, Any]):
        if not isinstance(ties, Mapping) or not ties:
            raise ValueError(NOTHING_TIED if isinstance(ties, Mapping) else BAD_TIE.format(given=ties))
        parsed, given = [], []
        for target, spec in ties.items():
            source, transform = spec if isinstance(spec, tuple) and len(spec) == 2 else (spec, None)
            if not isinstance(source, (str, KeyPath)) or not (transform is None or callable(transform)):
                raise ValueError(BAD_TIE.format(given={target: spec}))
            parsed.append((key_path(model, target), key_path(model, source), transform))
            given.append((target, source))
        for target, _, _ in parsed:
            for _, source, _ in parsed:
                if _inside(source, target):
                    raise ValueError(SOURCE_UNDER_TARGET.format(source=source, target=target))
        stored = model
        for (target, source, transform), names in zip(parsed, given):
            value = source.get(model)
            value = value if transform is None else _transformed(transform, value)  # as resolve() gives it
            _check_tie(target.get(model), value, transform, *names)
            target.set(model, value)  # a leaf's own checks (a Python number's kind)
            stored = _removed(stored, target)
        self.model = stored
        self.ties = tuple(parsed)
        self.ranks = tuple(None if t is None else _rank(source.get(model)) for _, source, t in parsed)

    def _transforms(self) -> list[Callable[[Any], Any] | None]:
        """Each tie's transform, mapped (``jax.vmap``) over the leading axes its source has
        beyond the rank recorded at construction: a batch of models (a jax.vmap-ed
        ensemble) resolves model by model, ``jnp.transpose`` transposing each model's matrix."""
        out = []
        for (_, source, transform), rank in zip(self.ties, self.ranks or (None,) * len(self.ties)):
            shape = getattr(source.get(self.model), "shape", None)
            if transform is not None and rank is not None and shape is not None:
                for _ in range(len(shape) - rank):
                    transform = jax.vmap(transform)
            out.append(transform)
        return out

    def resolve(self) -> Any:
        """The complete model: each target holds its source's (transformed) value."""
        model = self.model
        for (target, source, _), transform in zip(self.ties, self._transforms()):
            value = source.get(model)
            model = target.set(model, value if transform is None else _transformed(transform, value))
        return model

    def set_resolved(self, path: KeyPath, value: Any) -> Shared:
        """A copy with ``value`` at ``path`` of the resolved model (``ft.set(lm, "head.weight", w)``):
        a tie target's value is written to its source (through the inverse of its transform)."""
        for (target, source, _), transform in zip(self.ties, self._transforms()):
            if not _inside(path, target):
                continue
            rest = KeyPath(path[len(target):])
            if transform is None:
                return self.replace(model=(source + rest).set(self.model, value))
            if rest:
                raise ValueError(PART_OF_TRANSFORMED.format(path=path, target=target.name, source=source.name))
            return self.replace(model=source.set(self.model, untransform(transform, source.get(self.model),
                                                                          value, target.name, source.name)))
        return self.replace(model=path.set(self.model, value))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.resolve()(*args, **kwargs)

    def init_cache(self, batch_size: int, max_length: int, dtype: Any = None) -> Any:
        """The tied model's ``init_cache`` (the cache protocol of ``ft.nn.generate``)."""
        return member_cache(self.resolve(), "the tied model", "ft.nn.Shared", batch_size, max_length, dtype)

