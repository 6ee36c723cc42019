"""Stack: ``n`` blocks of one structure, parameters stacked, applied with ``jax.lax.scan``.

``stack(x) = f_{n-1}(... f_1(f_0(x)))`` where member ``i`` is the block whose every leaf
is ``leaf[i]`` of the stacked block. One block is traced and compiled whatever ``n`` is
(``lax.scan``), so compile time and the step's jaxpr do not grow with depth, and the
parameters are initialised by one ``jax.vmap`` over ``n`` keys.

Key paths address members too: ``ft.get(model, "blocks.3.up.weight")`` is member 3's
array (see :mod:`functree._stacked`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from functree._leaf_checks import quoted
from functree._module import Module, field, from_fields
from functree._naming import refuse_batched_members
from functree._paths import KeyPath, children, walk
from functree._random import one_key
from functree._repr import short_array
from functree._source import call_refusal
from functree._traces import staged
from functree._tree import dotted_name, is_array_value, join_names
from functree.nn._check import FIX_BATCHED, BatchedLayerError, LayerInputError
from functree.nn._eager_keys import eager_program, static_key
from functree.nn._mode import Layer
from functree.nn._remat import call_collecting, checkpointed, collecting, record_under, remat_policy
from functree.nn._sequential import Sequential, cache_pair, member_cache, takes_key
from functree.nn._window import is_int

__all__ = ["Stack"]

BAD_N = """\
ft.nn.Stack needs n >= 1 members (an int), got n={n!r}.

    wrong:  ft.nn.Stack(make, {n!r}, key=k)
    right:  ft.nn.Stack(make, 12, key=k)"""

NOT_A_MODULE = """\
ft.nn.Stack: make(key) must return an ft.Module (one block), got {type}.

    wrong:  ft.nn.Stack(lambda k: jax.random.normal(k, (4, 4)), 12, key=k)
    right:  ft.nn.Stack(lambda k: Block(64, key=k), 12, key=k)"""

MAKE_TAKES_KEY = """\
ft.nn.Stack calls make(key) once per member, under jax.vmap over n split keys, so each \
member gets its own initialization; {name}{signature} cannot be called with one key \
(Python's "{problem}"). Take the key and give it to the block:

    wrong:  ft.nn.Stack({name}, n, key=k)   # {name}{signature}
    right:  ft.nn.Stack(lambda k: Block(..., key=k), n, key=k)   # the block's other arguments given here"""

EMPTY_LAYERS = """\
ft.nn.Stack.from_layers needs at least one module, got {given!r}.

    right:  ft.nn.Stack.from_layers([block0, block1, block2])"""

DIFFERENT_STRUCTURE = """\
ft.nn.Stack: member {index} differs from member 0 at {path}: {first} in member 0, {given} \
in member {index}. Stacked members must have identical structure (types, static fields, leaf \
shapes and dtypes).
    right:  ft.nn.Stack.from_layers([Block(64, key=k) for k in jax.random.split(key, n)])"""

CHANGES_SHAPE = """\
ft.nn.Stack: each member maps x to the same shape and dtype (it is applied with \
jax.lax.scan), but a {block} maps {given} to {returned}.
    wrong:  ft.nn.Stack(lambda k: ft.nn.Dense(64, 128, key=k), n, key=k)
    right:  ft.nn.Stack(lambda k: ft.nn.Dense(64, 64, key=k), n, key=k)   # or put the \
change of shape before or after the Stack"""

CHANGES_DTYPE = """\
ft.nn.Stack: each member maps x to the same shape and dtype (it is applied with \
jax.lax.scan), but a {block} maps {given} to {returned}: its parameters are {params}, so x is \
promoted. Give the members x's dtype, or x theirs:
    wrong:  stack(x)                                   # x {given_dtype}, the members' weights {params}
    right:  ft.cast(stack, jnp.{given_dtype_name})(x)              # the members in x's dtype
       or:  stack(x.astype(jnp.{returned_dtype_name}))"""

OUT_OF_RANGE = """\
stack[{index}]: the Stack holds {n} members (0 to {last}, or -{n} to -1 from the end).
    wrong:  stack[{index}]
    right:  stack[{last}]   # or stack[-1], the last member"""

BAD_CACHES = """\
ft.nn.Stack of {n} members: cache= holds one cache per member stacked on axis 0 (every leaf \
[{n}, ...]), got {given}.

    right:  caches = stack.init_cache(batch_size, max_length); x, caches = stack(x, cache=caches, ...)"""

BAD_MEMBER = """\
ft.set({path}): a member of this Stack is a {expected}; given {given} (at {where}: {first} in \
the Stack, {other} given). Stacked members share one structure: the same types, static \
fields, leaf shapes and dtypes.
    right:  ft.set(model, {name}, block)   # a block of the same structure and shapes"""

ABSTRACT_MEMBER = """\
ft.set: {name} is in member {index} of a Stack whose leaf {stacked} is abstract ({leaf}, from \
jax.eval_shape): it holds no values to write one member's into. Set the member on the built model, or the whole \
stacked leaf on the template:
    wrong:  ft.set(template, {name}, value)
    right:  model = ft.set(jax.jit(build)(key), {name}, value)
       or:  template = ft.set(template, {stacked}, jnp.stack(values))   # one value per member"""


def _describe(tree: Any) -> str:
    leaves = jax.tree.leaves(tree)
    if len(leaves) == 1 and hasattr(leaves[0], "shape"):
        return short_array(leaves[0])
    return f"{type(tree).__name__} {jax.tree.map(lambda a: (tuple(a.shape), str(a.dtype)), tree)}"


def _spec(x: Any) -> tuple[tuple[int, ...], str]:
    return tuple(jnp.shape(x)), str(jnp.result_type(x))


def _show(x: Any) -> str:
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return short_array(x)
    if isinstance(x, (Module, list, tuple, dict)):
        return f"a {type(x).__name__}"
    return getattr(x, "__name__", None) or repr(x)[:60]


def _differ(x: Any, y: Any) -> bool:
    if is_array_value(x) and is_array_value(y):
        # arrays by shape and dtype, whatever their types: a NumPy array, a jax.Array, a
        # tracer (a member read under jax.vmap / jax.grad, a constant set there) all stack
        return _spec(x) != _spec(y)
    if type(x) is not type(y):
        return True
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return _spec(x) != _spec(y)
    if children(x) or isinstance(x, Module):
        return False  # compared through its children (static fields included)
    try:
        return bool(x != y)
    except Exception:  # a value that does not compare to a bool
        return x is not y


def _first_difference(first: Any, other: Any) -> tuple[str, str, str] | None:
    """``(key path, first's value, other's value)`` where ``other`` differs from ``first``
    (type, static value, leaf shape or dtype, set of children), or None."""
    if _differ(first, other):
        return "<root>", _show(first), _show(other)
    a, b = list(walk(first)), list(walk(other))
    for (pa, x), (pb, y) in zip(a, b):
        if pa != pb:
            return str(pa), f"{pa} = {_show(x)}", f"{pb} = {_show(y)}"
        if _differ(x, y):
            return str(pa), _show(x), _show(y)
    if len(a) != len(b):
        return "<root>", f"{len(a)} values", f"{len(b)} values"
    return None


def _check_n(n: Any) -> int:
    if not is_int(n) or n < 1:  # a NumPy int is a count
        raise ValueError(BAD_N.format(n=n))
    return int(n)


def _check_make(make: Any) -> None:
    """Refuse a ``make`` that cannot take one key (:data:`MAKE_TAKES_KEY`): ``lambda:
    Block(...)`` or a block class needing other arguments failed inside ``jax.vmap`` with
    Python's "takes 0 positional arguments but 1 was given", naming neither the Stack nor
    the fix. A callable without a readable signature is left to its call."""
    refused = call_refusal(make, None)
    if refused is not None:
        name, signature, problem = refused
        raise TypeError(MAKE_TAKES_KEY.format(name=name, signature=signature, problem=problem))


class Stack(Layer):
    """``n`` blocks of one structure applied in order, with parameters stacked (``lax.scan``).

    ``make(key)`` builds one block; it runs once, under ``jax.vmap`` over ``n`` split
    keys, so every leaf of :attr:`layers` has a leading axis of size ``n`` and init costs
    the same for any ``n``. ``stack(x, *args, key=None, **kwargs)`` computes
    ``x_{i+1} = member_i(x_i, *args, **kwargs)`` for ``i = 0..n-1`` with ``jax.lax.scan``:
    each member maps ``x`` to the same shape and dtype; ``key=`` is split into one key per
    member for blocks that take one (Dropout); layer state (BatchNorm) is collected per
    member, and recorded intermediates (``ft.nn.record_intermediate``) are stacked: ``[n, ...]``. ``remat=True`` (or a ``jax.checkpoint_policies`` name, or a policy) recomputes
    each block in the backward pass instead of storing its activations. Called eagerly
    (outside ``jax.jit``), the scan compiles once per structure and signature of its
    inputs and per value of what the blocks' Python reads, not at every call: each eager
    call re-reads, for every block class of the user's and the class of every user callable
    object held as a static value (an activation object), its ``__call__`` (patched or not),
    the methods and class attributes it names on ``self``, and the globals their code names
    (a notebook's ``GAIN = 0.0`` is seen, as by a Python loop over the members); a block
    reading what cannot be keyed cheaply (a large NumPy array), or holding a plain mutable
    object as a static value (keyed by identity, it could be edited in place), is traced at
    every call. The blocks' static values are keyed by exact type and value (``-0.0`` is not
    ``0.0``, ``np.float32(2.0)`` is not ``2.0``), not by ``==``.
    Inside ``jax.jit`` it is the jaxpr's own ``scan`` and jit's rule applies: what was read
    while tracing stays until the function is traced again.

    With ``cache=`` (one cache per member stacked on axis 0, from :meth:`init_cache`: the
    key-value caches of decoding) each member is called ``x, c = member(x, cache=c, *args,
    **kwargs)`` inside the scan and ``stack(x, cache=caches, ...)`` returns ``(x, caches)``.

    ``len(stack) == n``; ``stack[i]`` is member ``i`` (the block's own type);
    ``stack.unstack()`` is an ``ft.nn.Sequential`` of the members;
    :meth:`from_layers` stacks existing blocks. Key paths reach members:
    ``ft.get(model, "blocks.3.up.weight")``, ``ft.to_flat_dict(model, unstack=True)``.

    An ensemble of models built with ``jax.vmap(lambda k: Model(..., key=k))(keys)`` has
    leaves ``[E, n, ...]``: :attr:`ranks` (each member leaf's own rank, recorded at
    construction) tells its leading axes from the member axis, and member key paths and
    patterns (``"blocks.1.*"``) on the whole ensemble raise, naming the fix: use them
    inside ``jax.vmap`` over the ensemble, one model at a time. Whole-leaf patterns
    (``"blocks.*"``, ``"*.bias"``) work on the ensemble.

    Example:
      >>> import functree as ft, jax, jax.numpy as jnp
      >>> stack = ft.nn.Stack(lambda k: ft.nn.Dense(4, 4, jax.nn.tanh, key=k), 3, key=jax.random.key(0))
      >>> len(stack), stack.layers.weight.shape, stack[1].weight.shape
      (3, (3, 4, 4), (4, 4))
      >>> x = jnp.ones((2, 4))
      >>> bool(jnp.allclose(stack(x), stack.unstack()(x), atol=1e-6))
      True
      >>> ft.get({"blocks": stack}, "blocks.2.bias").shape
      (4,)
    """

    layers: Any
    n: int = field(static=True)
    remat: Any = field(static=True, default=None)
    # ``((name in a member, rank), ...)``: each member leaf's own rank, so that a leaf with more
    # leading axes than ``[n, *member]`` (a jax.vmap-ed ensemble of models) is recognised.
    ranks: tuple[tuple[str, int], ...] | None = field(static=True, default=None)
    __ft_stacked__: ClassVar[bool] = True
    __ft_stacked_block__: ClassVar[str] = "layers"  # the field of the stacked block (its members' static fields)
    __ft_template_static__: ClassVar[tuple[str, ...]] = ("remat", "ranks")  # a restore's template decides them (how it spends memory; ranks are derived)
    __ft_added_static__: ClassVar[tuple[str, ...]] = ("ranks",)  # files written before it read as None
    __ft_repr_hidden__: ClassVar[tuple[str, ...]] = ("ranks",)  # derived bookkeeping: not shown in repr

    def __ft_derive_added__(self, names: frozenset[str]) -> dict[str, Any]:
        """``ranks`` for a Stack read from a file written before it (``functree._module.derive_added``):
        from the leaves, where every one has the ``n`` members on axis 0 (a single model's
        Stack, as built now); otherwise None (the axis-0 check still refuses an ensemble of
        another size)."""
        leaves = jax.tree.leaves(self.layers)
        if "ranks" not in names or not all(np.ndim(a) >= 1 and np.shape(a)[0] == self.n for a in leaves):
            return {}
        return {"ranks": member_ranks(self.layers)}

    def __init__(self, make: Callable[[jax.Array], Any], n: int, *, key: jax.Array, remat: Any = None):
        n = _check_n(n)
        self.remat = remat_policy(remat)
        _check_make(make)
        layers = jax.vmap(make)(jax.random.split(one_key(key), n))
        if not isinstance(layers, Module):
            raise TypeError(NOT_A_MODULE.format(type=type(layers).__name__))
        self.layers = layers
        self.n = n
        self.ranks = member_ranks(layers)

    @classmethod
    def from_layers(cls, layers: Sequence[Any], *, remat: Any = None) -> Stack:
        """A stack of existing blocks (identical structure, shapes and dtypes).

        Example:
          >>> import functree as ft, jax
          >>> blocks = [ft.nn.Dense(2, 2, key=k) for k in jax.random.split(jax.random.key(0), 4)]
          >>> ft.nn.Stack.from_layers(blocks).layers.weight.shape
          (4, 2, 2)
        """
        layers = list(layers)
        if not layers:
            raise ValueError(EMPTY_LAYERS.format(given=layers))
        for i, layer in enumerate(layers):
            if not isinstance(layer, Module):
                raise TypeError(NOT_A_MODULE.format(type=type(layer).__name__))
            diff = _first_difference(layers[0], layer)
            if diff is not None:
                raise ValueError(DIFFERENT_STRUCTURE.format(index=i, path=diff[0], first=diff[1], given=diff[2]))
        stacked = jax.tree.map(lambda *xs: jnp.stack([jnp.asarray(x) for x in xs]), *layers)
        return from_fields(cls, {"layers": stacked, "n": len(layers), "remat": remat_policy(remat),
                                 "ranks": member_ranks(stacked)})

    def __call__(self, x: Any, *args: Any, key: jax.Array | None = None, cache: Any = None,
                 **kwargs: Any) -> Any:
        self._check_called_unbatched()
        keys = jax.random.split(one_key(key), self.n) if key is not None and takes_key(self.layers) else None
        if cache is not None:
            self._check_caches(cache)
        state = collecting()
        eager = _eager_scan(self, x, keys, cache, args, kwargs, state)
        if eager is not None:  # compiled once per signature, not at every call
            x, values, cache, paths = eager()
        else:
            paths: list[KeyPath] = []
            x, values, cache = self._scan(x, keys, cache, args, kwargs, paths if state else None)
        record_under(self, "layers", paths, values)
        return x if cache is None else (x, cache)

    def _scan(self, x: Any, keys: Any, cache: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
              paths: list[KeyPath] | None) -> tuple[Any, Any, Any]:
        """``(x, state values, caches)`` of the members applied in order by ``jax.lax.scan``;
        with ``paths``, each member's layer state is collected (its key paths stored into
        ``paths`` while tracing) and stacked by the scan."""

        def body(carry: Any, xs: tuple[Any, Any, Any]) -> tuple[Any, Any]:
            member, k, c = xs
            kw = kwargs if k is None else {**kwargs, "key": k}
            if c is not None:
                kw = {**kw, "cache": c}
            try:
                if paths is not None:
                    out, values = call_collecting(lambda m: m(carry, *args, **kw), member, paths)
                else:
                    out, values = member(carry, *args, **kw), ()
            except LayerInputError as e:
                raise e.within(member, KeyPath.parse(".layers")) from None
            y, c = (out, None) if c is None else cache_pair(out, member, "each member", "ft.nn.Stack")
            _check_carry(member, carry, y)
            return y, (values, c)

        x, (values, cache) = jax.lax.scan(
            checkpointed(body, self.remat, scan_body=True), x, (self.layers, keys, cache), length=self.n
        )
        return x, values, cache

    def init_cache(self, batch_size: int, max_length: int, dtype: Any = None) -> Any:
        """Every member's ``init_cache(batch_size, max_length, dtype)``, stacked on axis 0.

        Example:
          >>> import functree as ft, jax
          >>> stack = ft.nn.Stack(lambda k: ft.nn.MultiheadAttention(8, 2, key=k), 3, key=jax.random.key(0))
          >>> stack.init_cache(2, 16).keys.shape          # 3 members, batch 2, 16 slots
          (3, 2, 16, 2, 4)
        """
        member = self._member(0)
        member_cache(member, "each member", "ft.nn.Stack", batch_size, max_length, dtype)  # checks
        return jax.vmap(lambda m: m.init_cache(batch_size, max_length, dtype))(self.layers)

    def _check_caches(self, cache: Any) -> None:
        leaves = jax.tree.leaves(cache)
        bad = next((a for a in leaves if not hasattr(a, "shape") or not a.shape or a.shape[0] != self.n), None)
        if not leaves or bad is not None:
            given = "no arrays" if not leaves else (short_array(bad) if hasattr(bad, "dtype") else repr(bad)[:40])
            raise ValueError(BAD_CACHES.format(n=self.n, given=f"a {type(cache).__name__} with {given}"))

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int | slice) -> Any:
        """Member ``index`` (the block's type), or a Stack of a slice of the members."""
        if isinstance(index, slice):
            self._check_unbatched(f"[{index.start}:{index.stop}:{index.step}]")
            members = range(self.n)[index]
            if not members:
                raise IndexError(f"stack[{index.start}:{index.stop}:{index.step}] selects no member of {self.n}.")
            picked = jnp.asarray(list(members), jnp.int32)
            return self._with_layers(jax.tree.map(lambda a: _take(a, picked), self.layers))
        if not isinstance(index, int) or isinstance(index, bool) or not -self.n <= index < self.n:
            raise IndexError(OUT_OF_RANGE.format(index=index, n=self.n, last=self.n - 1))
        return self._member(index)

    def __iter__(self) -> Iterator[Any]:
        return (self._member(i) for i in range(self.n))

    def unstack(self) -> Sequential:
        """An ``ft.nn.Sequential`` of the members (the same function, unrolled).

        It takes the Stack's arguments: ``stack.unstack()(x, mask=m)`` equals ``stack(x,
        mask=m)``; with ``cache=`` it takes a tuple of one cache per member
        (``unstacked.init_cache``) where the Stack takes them stacked.

        Example:
          >>> import functree as ft, jax
          >>> stack = ft.nn.Stack(lambda k: ft.nn.Dense(2, 2, key=k), 3, key=jax.random.key(0))
          >>> len(stack.unstack().layers)
          3
        """
        return Sequential(*self)

    # The stacked-node protocol of functree._stacked (per-member key paths).
    def _member(self, i: int) -> Any:
        # A tree shaped like the model (a mask's bools, labels) holds one value for all members.
        self._check_unbatched(f"[{i}]")
        return jax.tree.map(lambda a: _item(a, i), self.layers)

    def _batched_leaf(self) -> tuple[str, tuple[int, ...], int | None] | None:
        """``(name, shape, member rank)`` of the first leaf with leading axes before the
        member axis (a jax.vmap-ed ensemble of models), or None.

        A leaf's own rank is the one :attr:`ranks` recorded at construction; a leaf it does
        not name (a file written before it, a layer replaced since: rank None) must at least
        have ``n`` on axis 0. A leaf without axes (a mask's bool) is every member's."""
        known = dict(self.ranks or ())
        pairs, _ = jax.tree_util.tree_flatten_with_path(self.layers)
        for path, a in pairs:
            shape, rank = tuple(getattr(a, "shape", ())), known.get(dotted_name(path))
            if shape and (len(shape) > rank + 1 if rank is not None else shape[0] != self.n):
                return dotted_name(path), shape, rank
        return None

    def _batch_shape(self) -> tuple[int, ...]:
        """The leading axes of the leaves before the member axis (``()``; ``(E,)`` for a
        jax.vmap-ed ensemble of E models), where :attr:`ranks` tells them apart."""
        _, shape, rank = self._batched_leaf() or ("", (), None)
        return () if rank is None else shape[: len(shape) - 1 - rank]

    def _check_called_unbatched(self) -> None:
        """:class:`BatchedLayerError` for a batch of stacks (an ensemble) called outside
        ``jax.vmap``: the scan's own error named only a length and axis sizes."""
        bad = self._batched_leaf()
        if bad is not None:
            name, shape, rank = bad
            expected = f"one Stack's leaves are [{self.n}, ...]" + ("" if rank is None else f" (layers.{name}: {rank + 1} axes)")
            raise BatchedLayerError(self, expected, f"layers.{name} of shape {shape}", FIX_BATCHED)

    def _check_unbatched(self, member: str) -> None:
        refuse_batched_members(self, f"stack{member}", "")

    def _with_member(self, i: int, value: Any, where: Any = ()) -> Stack:
        """A copy with member ``i`` replaced by ``value`` (``where``: the Stack's key path
        in the tree ``ft.set`` was given, for the error's fix)."""
        self._check_unbatched(f"[{i}]")
        _refuse_abstract(self, i, value, where)
        diff = _first_difference(self._member(i), value)
        if diff is not None:
            path = KeyPath(where) + KeyPath.parse(f"[{i}]")
            raise ValueError(BAD_MEMBER.format(path=path, name=quoted(path.name), expected=_describe(self._member(i)),
                                               given=_describe(value), where=diff[0], first=diff[1], other=diff[2]))
        return self._with_layers(jax.tree.map(lambda a, v: a.at[i].set(v), self.layers, value))

    def _with_layers(self, layers: Any) -> Stack:
        n = jnp.shape(jax.tree.leaves(layers)[0])[0] if jax.tree.leaves(layers) else self.n
        return from_fields(type(self), {"layers": layers, "n": n, "remat": self.remat, "ranks": self.ranks})


def member_ranks(layers: Any) -> tuple[tuple[str, int], ...]:
    """``((dotted name, rank of a member's leaf), ...)`` of stacked ``layers`` ([n, ...] leaves).

    Example:
      >>> import functree as ft, jax
      >>> member_ranks(jax.vmap(lambda k: ft.nn.Dense(2, 3, key=k))(jax.random.split(jax.random.key(0), 4)))
      (('weight', 2), ('bias', 1))
    """
    pairs, _ = jax.tree_util.tree_flatten_with_path(layers)
    return tuple((dotted_name(p), len(getattr(a, "shape", ())) - 1) for p, a in pairs)


def _item(a: Any, i: int) -> Any:
    """Member ``i`` of a stacked leaf; a value without a stack axis is every member's."""
    if not jnp.ndim(a):
        return a
    if isinstance(a, jax.ShapeDtypeStruct):  # a template of jax.eval_shape: a member's shape
        return _abstract_members(a, a.shape[1:])
    x = a[i]
    return bool(x) if isinstance(x, np.bool_) else x


def _take(a: Any, picked: jax.Array) -> Any:
    """The members ``picked`` of a stacked leaf (``stack[1:3]``)."""
    if isinstance(a, jax.ShapeDtypeStruct):
        return _abstract_members(a, (len(picked), *a.shape[1:]), keep_axis=True)
    return a[picked]


def _abstract_members(a: jax.ShapeDtypeStruct, shape: tuple[int, ...], keep_axis: bool = False) -> Any:
    """An abstract stacked leaf's members (one, or a slice with ``keep_axis``) as a
    ``jax.ShapeDtypeStruct`` of ``shape``: the dtype kept, a ``NamedSharding`` without the
    layer axis's entry for one member."""
    sharding = a.sharding
    if isinstance(sharding, jax.sharding.NamedSharding) and not keep_axis:
        sharding = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*sharding.spec[1:]))
    return jax.ShapeDtypeStruct(shape, a.dtype, sharding=sharding, weak_type=a.weak_type)


def _refuse_abstract(stack: Stack, i: int, value: Any, where: Any) -> None:
    """:data:`ABSTRACT_MEMBER` where a value is set into an abstract stacked leaf (a member
    of a ``jax.eval_shape`` template): no values to write it into."""
    pairs, _ = jax.tree_util.tree_flatten_with_path(stack.layers)
    given = jax.tree.leaves(value)
    for (path, a), v in zip(pairs, given):
        if isinstance(a, jax.ShapeDtypeStruct) and not isinstance(v, jax.ShapeDtypeStruct):
            base, leaf = KeyPath(where).name, dotted_name(path)
            name, stacked = join_names(base, str(i), leaf), join_names(base, "layers", leaf)
            raise ValueError(ABSTRACT_MEMBER.format(name=quoted(name), index=i, stacked=quoted(stacked),
                                                    leaf=short_array(a)))


# An eager call's compiled scan, one per structure and abstract signature of its inputs
# (tree definitions, the blocks' and the extra arguments' static values by exact type and
# value, every array's shape, dtype and weak type) and per value of what the blocks' Python reads (``_reads.reads_key``: a
# notebook's global, a patched ``__call__``): ``signature -> ((classes, functions), {reads:
# run})``. Keys hold no arrays, bounded like every tree-definition cache.
_SCANS: dict[Any, tuple[tuple[Any, Any], dict[Any, Callable[..., Any]]]] = {}

_ARRAY = object()  # an extra argument's leaf passed to the compiled scan as an array


def _eager_scan(stack: Stack, x: Any, keys: Any, cache: Any, args: tuple[Any, ...],
                kwargs: dict[str, Any], collect: bool) -> Callable[[], tuple[Any, Any, Any, list[KeyPath]]] | None:
    """The call run eagerly (at top level, under ``jax.grad`` or ``jax.vmap``: no jaxpr
    staged around it) as ``() -> (x, state values, caches, their key paths)``, or None.
    With ``collect`` (under ``ft.nn.collect_state``), the members' layer state comes back
    stacked, at the key paths the first trace found (one structure: the same paths).

    ``jax.lax.scan`` caches its trace on the body function: the body, a fresh closure at
    each call, was traced and compiled again at every eager call. Here the scan runs in a
    ``jax.jit`` made once per structure and signature (:data:`_SCANS`), the extra
    arguments' arrays passed in (a closure would bake the first call's into the trace) and
    their plain values (a flag, a Python number) kept static, as the closure kept them.
    Another kind of value (a function; a NumPy array without axes, which the closure made
    a literal) leaves the call to the plain scan."""
    if staged():
        return None
    extra, extra_def = jax.tree.flatten((args, kwargs))
    arrays, static = [], []
    for v in extra:
        if isinstance(v, jax.Array) or (isinstance(v, np.ndarray) and v.ndim):
            arrays.append(v)
            static.append(_ARRAY)
        elif (k := static_key(v)) is not None:
            static.append(k)
        else:
            return None
    run = eager_program(_SCANS, stack, (stack, x, keys, cache, arrays), (extra_def, tuple(static), collect),
                        lambda: _compiled_scan(extra_def, [v if v is _ARRAY else v[1] for v in static], collect))
    if run is None:
        return None
    return lambda: run(stack, x, keys, cache, arrays)


def _compiled_scan(extra_def: Any, static: list[Any], collect: bool) -> Callable[..., Any]:
    """The eager scan of one signature: ``run(stack, x, keys, caches, arrays) -> (x, state
    values, caches, their key paths)``, the extra arguments rebuilt from their arrays and
    static values. The key paths are found while the program is traced (a cache hit
    traces nothing): kept with it."""
    paths: list[KeyPath] = []

    def run(stack: Stack, x: Any, keys: Any, cache: Any, arrays: list[Any]) -> tuple[Any, Any, Any]:
        given = iter(arrays)
        args, kwargs = jax.tree.unflatten(extra_def, [next(given) if v is _ARRAY else v for v in static])
        return stack._scan(x, keys, cache, args, kwargs, paths if collect else None)

    compiled = jax.jit(run)

    def call(stack: Stack, x: Any, keys: Any, cache: Any, arrays: list[Any]) -> tuple[Any, Any, Any, list[KeyPath]]:
        return (*compiled(stack, x, keys, cache, arrays), list(paths))

    return call


def _check_carry(block: Any, x: Any, y: Any) -> None:
    same = jax.tree.structure(x) == jax.tree.structure(y) and all(
        _spec(a) == _spec(b) for a, b in zip(jax.tree.leaves(x), jax.tree.leaves(y))
    )
    if same:
        return
    xs, ys = jax.tree.leaves(x), jax.tree.leaves(y)
    if jax.tree.structure(x) == jax.tree.structure(y) and len(xs) == 1 and jnp.shape(xs[0]) == jnp.shape(ys[0]):
        given, returned = jnp.result_type(xs[0]), jnp.result_type(ys[0])
        params = sorted({str(leaf.dtype) for leaf in jax.tree.leaves(block) if hasattr(leaf, "dtype")
                         and jnp.issubdtype(leaf.dtype, jnp.inexact)})
        if str(returned) in params:  # the shape kept, x promoted to the weights' dtype
            raise ValueError(CHANGES_DTYPE.format(
                block=type(block).__name__, given=_describe(x), returned=_describe(y), params=" and ".join(params),
                given_dtype=given, given_dtype_name=given.name, returned_dtype_name=returned.name))
    raise ValueError(CHANGES_SHAPE.format(block=type(block).__name__, given=_describe(x), returned=_describe(y)))
