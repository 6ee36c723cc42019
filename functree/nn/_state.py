"""Layer state (BatchNorm's running statistics) as explicit, pure values.

A layer in training mode calls ``ft.nn.record_state(self, running_mean=...)`` with new
values for its ``no_derivative`` fields. ``ft.nn.collect_state(fn, model)`` runs
``fn(model)`` while collecting those records and returns them as ``{KeyPath: value}``;
``ft.nn.apply_state(model, updates)`` writes them back. Nothing is mutated: the records
are ordinary outputs of the traced function, so they pass through ``jax.jit``,
``jax.grad(..., has_aux=True)`` and ``ft.value_with_gradient(..., has_aux=True)``.
A layer called twice while ``fn`` runs updates in turn, as torch does: its second call
reads the first call's record (restored when ``collect_state`` returns).

A hand-written training loop uses :func:`value_with_gradient_and_state`::

    loss, grads, state = ft.nn.value_with_gradient_and_state(loss_fn, model, x, y)
    updates, opt_state = optimizer.update(grads, opt_state, model)
    model = ft.nn.apply_state(ft.move(model, along=updates), state)

Outside ``collect_state`` nothing is recorded, and a layer that records state there (a
BatchNorm in training mode under a plain ``ft.value_with_gradient``) warns once per key
path with :class:`UncollectedStateWarning`: its statistics would never update.

Recorded intermediates are the other kind of record: values a layer computes on the way
(a sparse MoE's router logits, for its load-balancing loss) that a caller may ask for
(Flax's ``sow``). ``ft.nn.record_intermediate(self, router_logits=...)`` is a no-op unless
``ft.nn.collect_intermediates(fn, model)`` runs; that returns them as ``{KeyPath: value}``,
the path ending with the record's name, gradients kept. They travel the same way as
state: an ``ft.nn.Stack``'s scan stacks its members' records (``[n, ...]``), a Remat
passes them out. Each collector returns its own kind and hands the other to the collector
around it, so a BatchNorm's statistics recorded inside ``collect_intermediates`` still
reach the training step's ``collect_state``.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from functree import _diagnostics
from functree._key_path_names import key_path
from functree._module import Module
from functree._operators import value_with_gradient
from functree._paths import ATTR, Entry, KeyPath, walk
from functree._traces import Tracer, current_trace, inner_trace, opened_inside, transform_name
from functree._warnings import warn
from functree.nn._check import LayerInputError
from functree.nn._state_messages import (
    FIX_INTERMEDIATE_IN_CHECKPOINT,
    FIX_INTERMEDIATE_IN_GRADIENT,
    FIX_INTERMEDIATE_IN_JIT,
    FIX_INTERMEDIATE_IN_LOOP,
    FIX_INTERMEDIATE_IN_VMAP,
    FIX_REBUILT_CHECKPOINT,
    FIX_REBUILT_ENSEMBLE,
    FIX_REBUILT_OTHER,
    FIX_STATE_IN_LOOP,
    FIX_STATE_IN_VMAP,
    INTERMEDIATE_INSIDE_TRANSFORM,
    INTERMEDIATE_IS_FIELD,
    INTERMEDIATE_NOT_ARRAY,
    INTERMEDIATE_NOT_IN_MODEL,
    INTERMEDIATE_NOT_IN_REBUILT_MODEL,
    INTERMEDIATE_TWICE,
    NOT_IN_MODEL,
    NOT_IN_REBUILT_MODEL,
    NOT_STATE_FIELD,
    REBUILT_BY_TRANSFORM,
    STATE_INSIDE_TRANSFORM,
    UNCOLLECTED_STATE,
)

__all__ = [
    "record_state",
    "collect_state",
    "record_intermediate",
    "collect_intermediates",
    "apply_state",
    "value_with_gradient_and_state",
    "UncollectedStateWarning",
]

# Frames searched (outwards) for a model holding a layer that records uncollected state,
# and how many such searches one layer class may cost before it is no longer reported.
_FRAME_DEPTH = 48
_SEARCH_BUDGET = 64


class UncollectedStateWarning(UserWarning):
    """A layer recorded state (BatchNorm's running statistics) that nothing collects.

    Raised once per layer key path (per class and fields when the path cannot be found)
    when ``ft.nn.record_state`` runs outside :func:`collect_state`, e.g. a BatchNorm in
    training mode under a plain ``ft.value_with_gradient``. Fix: collect the state with
    :func:`value_with_gradient_and_state` or :func:`collect_state` and write it back with
    :func:`apply_state`.

    Example:
      >>> import functree as ft, warnings
      >>> issubclass(ft.nn.UncollectedStateWarning, UserWarning)
      True
    """


_WARNED: set[tuple[str, str]] = set()
_SEARCHES: dict[type, int] = {}


class _Collector:
    def __init__(self, model: Any) -> None:
        # Every node that holds layers is registered, the root whatever its type: ft.cast of
        # a dict, a list or a Module's list field is followed from it (see follow).
        self.paths: dict[int, list[KeyPath]] = {id(model): [KeyPath()]}
        for path, value in walk(model):
            if _holds_layers(value):
                self.paths.setdefault(id(value), []).append(path)
        self.updates: dict[KeyPath, Any] = {}
        self.followed: list[Any] = []  # copies whose layers record here (ids stay theirs)
        self.trace = current_trace()  # recorded values must belong to it or to a trace around it
        self.replaced: list[tuple[Any, str, Any]] = []  # (layer, field, value before): see substitute
        self.provisional: set[KeyPath] = set()  # intermediates recorded by a differentiation check's trace
        self.checks = _diagnostics._TRACE.depth  # check traces running when it opened (one opened inside: deeper)


@jax.tree_util.register_pytree_node_class
class Intermediate:
    """A recorded intermediate while collectors carry it (a pytree of its one array, so a
    Stack's scan stacks it), told apart from layer state by its type alone."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def tree_flatten(self) -> tuple[tuple[Any], None]:
        return (self.value,), None

    @classmethod
    def tree_unflatten(cls, aux: None, children: Any) -> Intermediate:
        return cls(children[0])


def _holds_layers(value: Any) -> bool:
    """Whether ``value`` is a node that may hold layers (a Module, a dict, list or tuple):
    leaves (arrays, numbers, ``None``) are never registered, as their ids may be shared."""
    return isinstance(value, (Module, dict, list, tuple))


_LOCAL = threading.local()


def collector_stack() -> list[_Collector]:
    stack = getattr(_LOCAL, "stack", None)
    if stack is None:
        stack = _LOCAL.stack = []
    return stack


def _handed_out() -> tuple[tuple[int, ...], ...]:
    """What the open collectors hold (a differentiated function's trace that records into a
    collector opened outside it hands values out: :data:`_diagnostics.SIDE_CHANNELS`)."""
    return tuple((id(c), len(c.followed), *map(id, c.updates.values())) for c in collector_stack())


_diagnostics.SIDE_CHANNELS.append(_handed_out)


def record_state(layer: Module, **values: Any) -> None:
    """Record new values for ``layer``'s ``no_derivative`` fields (no-op outside collect_state).

    Called by layers in training mode; values are stopped from carrying gradients and cast
    to the field's dtype.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> class Counter(ft.Module):
      ...     count: jnp.ndarray = ft.field(no_derivative=True)
      ...     def __call__(self, x):
      ...         ft.nn.record_state(self, count=self.count + 1)
      ...         return x
      >>> y, updates = ft.nn.collect_state(lambda m: m(2.0), Counter(jnp.zeros(())))
      >>> updates
      {KeyPath('.count'): Array(1., dtype=float32)}
    """
    stack = collector_stack()
    cls = type(layer)
    if not stack:
        _warn_uncollected(layer, tuple(values))
        return
    for name in values:
        if name not in cls.__ft_no_derivative__:
            raise TypeError(
                NOT_STATE_FIELD.format(cls=cls.__name__, name=name, fields=list(cls.__ft_no_derivative__))
            )
    collector = next((c for c in reversed(stack) if id(layer) in c.paths), None)
    if collector is None:
        raise ValueError(_not_in_model(layer, stack[-1]))
    for name, value in values.items():
        old = layer.__dict__[name]
        value = jax.lax.stop_gradient(value)
        if hasattr(old, "dtype"):
            value = jnp.asarray(value).astype(old.dtype)
        for path in collector.paths[id(layer)]:
            collector.updates[KeyPath((*path, Entry(ATTR, name)))] = value
        substitute(collector, layer, name, value)


def _not_in_model(layer: Module, collector: _Collector) -> str:
    """Why ``layer`` is unknown to the collectors: :data:`REBUILT_BY_TRANSFORM` when a
    transformation opened inside ``collector``'s function runs (the model passed to it as an
    argument: JAX made a copy of each layer), with that transformation's fix; else
    :data:`NOT_IN_MODEL` (another model's layer, or a jit, whose fix it shows)."""
    trace = opened_inside(collector.trace)
    transform = None if trace is None else transform_name(trace)
    if transform is None or transform == "jax.jit":
        return NOT_IN_MODEL.format(cls=type(layer).__name__)
    if transform == "jax.vmap":
        batched = inner_trace(jax.tree.leaves(layer), collector.trace) is not None
        fix = FIX_REBUILT_ENSEMBLE if batched else FIX_STATE_IN_VMAP
    else:
        fix = FIX_REBUILT_CHECKPOINT if transform == "jax.checkpoint" else FIX_REBUILT_OTHER
    return REBUILT_BY_TRANSFORM.format(cls=type(layer).__name__, transform=transform, fix=fix)


def record_intermediate(layer: Module, **values: Any) -> None:
    """Record values ``layer`` computed (a router's logits, attention weights) for a caller
    that asks with :func:`collect_intermediates`; a no-op (one check) otherwise.

    Each is one array (a NumPy array or a number is recorded as a JAX array), filed at
    ``layer``'s key path plus its name, and keeps its gradient (unlike layer state): a
    loss may use it. Inside an ``ft.nn.Stack`` the members' records are
    stacked on a leading axis of ``n``.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> class Scaled(ft.Module):
      ...     w: jnp.ndarray
      ...     def __call__(self, x):
      ...         h = self.w * x
      ...         ft.nn.record_intermediate(self, pre_activation=h)
      ...         return jnp.tanh(h)
      >>> y, sown = ft.nn.collect_intermediates(lambda m: m(jnp.ones(2)), Scaled(jnp.array(0.5)))
      >>> sown
      {KeyPath('.pre_activation'): Array([0.5, 0.5], dtype=float32)}
    """
    if not getattr(_LOCAL, "sowing", 0):
        return
    cls = type(layer)
    for name, value in values.items():
        if name in getattr(cls, "__ft_field_set__", ()):
            raise TypeError(INTERMEDIATE_IS_FIELD.format(cls=cls.__name__, name=name))
        if isinstance(value, (np.ndarray, np.generic, bool, int, float, complex)):
            values[name] = jnp.asarray(value)  # a host array or a number: the array it is
        elif not isinstance(value, (jax.Array, Tracer)):
            given = f"a {type(value).__name__}"
            raise TypeError(INTERMEDIATE_NOT_ARRAY.format(cls=cls.__name__, name=name, given=given))
    collector = next((c for c in reversed(collector_stack()) if id(layer) in c.paths), None)
    if collector is None:
        raise ValueError(INTERMEDIATE_NOT_IN_MODEL.format(cls=cls.__name__))
    for name, value in values.items():
        for path in collector.paths[id(layer)]:
            file_record(collector, KeyPath((*path, Entry(ATTR, name))), Intermediate(value))


def file_record(collector: _Collector, path: KeyPath, value: Any) -> None:
    """Store a record at ``path``; an intermediate recorded twice is refused
    (:data:`INTERMEDIATE_TWICE`), unless the earlier record was made by functree's
    differentiation check of an operator called inside ``fn``, which traces its function
    once before running it (the run's record replaces it). A second call in another trace
    (inside a ``jax.grad`` or ``jax.vmap`` of a value the record does not depend on) is a
    second call: its record is no tracer of that transformation, and replacing the first
    call's would drop it silently. A collector opened inside a check's trace (the loss of
    a jitted ``ft.gradient``, whose jaxpr may be replayed) refuses its second record there."""
    if isinstance(value, Intermediate):
        if path in collector.updates and path not in collector.provisional:
            raise ValueError(INTERMEDIATE_TWICE.format(path=path))
        if _diagnostics._TRACE.depth > collector.checks:
            collector.provisional.add(path)
        else:
            collector.provisional.discard(path)
    collector.updates[path] = value


def record_in(owner: Any, paths: list[KeyPath], values: Any) -> None:
    """File records made by a rebuilt copy of ``owner`` (at ``paths``, relative to
    ``owner``) under ``owner``'s key path in the collector that knows it."""
    if not paths:
        return

    collector = next((c for c in reversed(collector_stack()) if id(owner) in c.paths), None)
    if collector is None:
        sown = [str(path) for path, value in zip(paths, values) if isinstance(value, Intermediate)]
        if sown:
            raise ValueError(INTERMEDIATE_NOT_IN_REBUILT_MODEL.format(cls=type(owner).__name__, paths=", ".join(sown)))
        raise ValueError(NOT_IN_REBUILT_MODEL.format(cls=type(owner).__name__))
    for where in collector.paths[id(owner)]:
        for path, value in zip(paths, values):
            file_record(collector, KeyPath((*where, *path)), value)
    for path, value in zip(paths, values):
        parent = None if isinstance(value, Intermediate) else _parent(owner, path)
        if parent is not None:  # a second call of owner reads it (substitute)
            substitute(collector, parent, tuple(path)[-1].key, value)


def _parent(root: Any, path: KeyPath) -> Any:
    """The object holding the field ``path`` ends with (``root.a[0]`` for ``.a[0].b``), or
    None where the path does not end with a Module's field."""
    entries = tuple(path)
    if not entries or entries[-1].kind != ATTR:
        return None
    try:
        for entry in entries[:-1]:
            root = getattr(root, entry.key) if entry.kind == ATTR else root[entry.key]
    except (AttributeError, KeyError, IndexError, TypeError):
        return None
    return root


def substitute(collector: _Collector, layer: Any, name: str, value: Any) -> None:
    """Let ``layer.<name>`` read ``value`` until ``collector`` closes, then restore it.

    A layer called twice in one forward (a GAN's discriminator on real then fake data, two
    views, ``bn(bn(x))``) updates its state in turn, as torch does: the second call reads
    the first call's record, ``m * (m * r + (1 - m) s_1) + (1 - m) s_2``, where reading the
    field itself would drop ``s_1``. The layer object is only changed while ``fn`` runs, so
    the model the caller holds is unchanged afterwards. A value of a transformation opened
    inside ``fn`` is not substituted (it may not leave it; :func:`_check_traces` reports it).
    """
    if not isinstance(layer, Module) or name not in layer.__dict__:
        return
    if inner_trace([value], collector.trace) is not None:
        return
    collector.replaced.append((layer, name, layer.__dict__[name]))
    layer.__dict__[name] = value


def _restore(collector: _Collector) -> None:
    """Undo :func:`substitute`, latest first (so each field gets its value from before ``fn``)."""
    for layer, name, value in reversed(collector.replaced):
        layer.__dict__[name] = value
    collector.replaced.clear()


def follow(original: Any, derived: Any) -> None:
    """While :func:`collect_state` runs on a model holding ``original``: the layers of
    ``derived`` (a rebuilt copy of ``original`` with its structure, such as ``ft.cast``'s
    compute-dtype model) record their state at the key paths of ``original``'s layers.
    A no-op outside ``collect_state`` or when ``original`` is not in its model.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> bn = ft.nn.training(ft.nn.BatchNorm(1))  # ft.cast(bn, ...) is a new BatchNorm; cast follows it
      >>> _, updates = ft.nn.collect_state(lambda m: ft.cast(m, jnp.bfloat16)(jnp.ones((2, 1))), bn)
      >>> sorted(str(p) for p in updates)
      ['.running_mean', '.running_variance']
    """
    for collector in collector_stack():
        prefixes = collector.paths.get(id(original))
        if not prefixes or derived is original:
            continue
        collector.followed.append(derived)
        for path, value in [(KeyPath(), derived), *walk(derived)]:
            if _holds_layers(value):
                known = collector.paths.setdefault(id(value), [])
                known.extend(p for p in (prefix + path for prefix in prefixes) if p not in known)


def _path_in(root: Any, layer: Any) -> KeyPath | None:
    if root is layer:
        return KeyPath()
    for path, value in walk(root):
        if value is layer:
            return path
    return None


def _find_path(layer: Any) -> KeyPath | None:
    """The key path of ``layer`` in the largest model found in the callers' local variables.

    A layer does not know where it sits; the loss function (or a Sequential, or the user's
    module) that called it holds a model containing it. The longest path found belongs to
    the outermost such model. Only called when a warning may be shown.
    """
    best: KeyPath | None = None
    frame = sys._getframe(3)
    for _ in range(_FRAME_DEPTH):
        if frame is None:
            break
        for value in list(frame.f_locals.values()):
            if isinstance(value, Module) and value is not layer:
                path = _path_in(value, layer)
                if path is not None and (best is None or len(path) >= len(best)):
                    best = path
        frame = frame.f_back
    return best


def _warn_uncollected(layer: Any, names: tuple[str, ...]) -> None:
    if _diagnostics._TRACE.active and not _diagnostics._TRACE.holding:
        return  # ft's silent pre-trace: the real trace that follows warns (a held one warns itself)
    cls = type(layer)
    searches = _SEARCHES.get(cls, 0)
    if searches >= _SEARCH_BUDGET:
        return
    _SEARCHES[cls] = searches + 1
    try:
        path = _find_path(layer)
    except Exception:  # naming the path is best effort
        path = None
    marker = (cls.__qualname__, str(path) if path is not None else "?" + ",".join(names))
    if marker in _WARNED:
        return
    _WARNED.add(marker)
    where = f" at {path}" if path else ""
    fields = " and ".join(names) if names else "state"
    message = UNCOLLECTED_STATE.format(
        cls=cls.__name__, where=where, fields=fields, first=names[0] if names else "state"
    )
    warn(message, UncollectedStateWarning)  # at the user's line, however deep the layer


def collect_state(fn: Callable[[Any], Any], model: Any) -> tuple[Any, dict[KeyPath, Any]]:
    """``(fn(model), updates)``: run ``fn`` and collect the state its layers record.

    ``updates`` maps key paths to new values (``{KeyPath('.layers[1].running_mean'): ...}``);
    it is a pytree, so a training step returns it as ``aux`` of a gradient and then calls
    :func:`apply_state`. Layer input errors raised inside ``fn`` get the layer's key path.
    Jit-compile around ``collect_state`` (the whole step), not ``fn`` alone. Recorded
    intermediates go to a :func:`collect_intermediates` around it, if one knows ``model``.

    Example:
      >>> import functree as ft, jax, jax.numpy as jnp
      >>> model = ft.nn.training(ft.nn.BatchNorm(2))
      >>> def loss(m, x):
      ...     y, updates = ft.nn.collect_state(lambda m: m(x), m)
      ...     return jnp.sum(y ** 2), updates
      >>> x = jnp.array([[0.0, 1.0], [2.0, 5.0]])
      >>> grads, updates = jax.grad(loss, has_aux=True)(model, x)
      >>> ft.nn.apply_state(model, updates).running_mean
      Array([0.01, 0.03], dtype=float32)
    """
    out, records = collect_records(fn, model)
    state, sown = _split(records)
    _hand_out(model, sown)
    return out, state


def collect_intermediates(fn: Callable[[Any], Any], model: Any) -> tuple[Any, dict[KeyPath, Any]]:
    """``(fn(model), intermediates)``: run ``fn`` and collect the values its layers record
    with :func:`record_intermediate` (``{KeyPath: array}``, each path ending with the
    record's name; a Stack's members' stacked on axis 0). Gradients flow through them, so a
    loss may add a term of them (a sparse MoE's load-balancing loss of its router logits,
    one forward pass). Layer state recorded meanwhile goes to the ``collect_state`` around
    it (the training step's), as if this collector were not there.

    Example:
      >>> import functree as ft, jax, jax.numpy as jnp
      >>> moe = ft.nn.SparseMoE(8, 16, num_experts=4, top_k=2, key=jax.random.key(0))
      >>> stack = ft.nn.Stack(lambda k: moe.replace(gate=ft.nn.Dense(8, 4, use_bias=False, key=k)), 3,
      ...                     key=jax.random.key(1))
      >>> y, sown = ft.nn.collect_intermediates(lambda m: m(jnp.ones((5, 8))), stack)
      >>> {str(path): value.shape for path, value in sown.items()}     # 3 members, 5 rows, 4 experts
      {'.layers.router_logits': (3, 5, 4)}
    """
    _LOCAL.sowing = getattr(_LOCAL, "sowing", 0) + 1
    try:
        out, records = collect_records(fn, model)
    finally:
        _LOCAL.sowing -= 1
    state, sown = _split(records)
    _hand_out(model, state)
    return out, {path: value.value for path, value in sown.items()}


def _split(records: dict[KeyPath, Any]) -> tuple[dict[KeyPath, Any], dict[KeyPath, Intermediate]]:
    state = {p: v for p, v in records.items() if not isinstance(v, Intermediate)}
    return state, {p: v for p, v in records.items() if isinstance(v, Intermediate)}


def _hand_out(model: Any, records: dict[KeyPath, Any]) -> None:
    """Give records of the kind this collector does not return to the collector around it
    that knows ``model``; with none, layer state warns as uncollected state does (its values
    are dropped) and intermediates, which nobody asked for, are dropped."""
    if not records:
        return
    if any(id(model) in c.paths for c in collector_stack()):
        record_in(model, list(records), list(records.values()))
        return
    for path in records:
        if not isinstance(records[path], Intermediate):
            layer = _parent(model, path)
            if layer is not None:
                _warn_uncollected(layer, (tuple(path)[-1].key,))


def collect_records(fn: Callable[[Any], Any], model: Any) -> tuple[Any, dict[KeyPath, Any]]:
    """``(fn(model), records)``: both kinds (layer state, and :class:`Intermediate`s), for a
    layer that passes its rebuilt copy's records on (``ft.nn.Stack``, ``ft.nn.Remat``)."""
    collector = _Collector(model)
    stack = collector_stack()
    stack.append(collector)
    try:
        out = fn(model)
    except LayerInputError as e:
        paths = collector.paths.get(id(e.layer))
        if paths:
            raise e.at(paths[0]) from None
        raise
    finally:
        stack.pop()
        _restore(collector)
    _check_traces(collector)
    return out, collector.updates


def _check_traces(collector: _Collector) -> None:
    """Raise if a recorded value is a tracer of a transformation opened inside ``fn``
    (a BatchNorm called under the user's ``jax.vmap`` / ``lax.scan`` / ``lax.cond`` in the
    loss): returned, it would be a leaked tracer in the model. Checked once ``fn`` returned,
    as functree's differentiation check may trace ``fn``'s inside first and then run it
    again, recording the values that stay."""
    found = inner_trace([v.value if isinstance(v, Intermediate) else v for v in collector.updates.values()],
                        collector.trace)
    if found is None:
        return
    index, trace = found
    path = list(collector.updates)[index]
    transform = transform_name(trace)
    if isinstance(collector.updates[path], Intermediate):
        raise ValueError(INTERMEDIATE_INSIDE_TRANSFORM.format(path=path, transform=transform,
                                                              fix=_intermediate_fix(transform)))
    fix = FIX_STATE_IN_VMAP if transform == "jax.vmap" else FIX_STATE_IN_LOOP
    raise ValueError(STATE_INSIDE_TRANSFORM.format(path=path, transform=transform, fix=fix))


def _intermediate_fix(transform: str) -> str:
    """The way out of :data:`INTERMEDIATE_INSIDE_TRANSFORM` for the transformation named
    ``transform`` (:func:`functree._traces.transform_name`'s words)."""
    if transform == "jax.vmap":
        return FIX_INTERMEDIATE_IN_VMAP
    if any(word in transform for word in ("scan", "cond", "switch", "while", "fori")):
        return FIX_INTERMEDIATE_IN_LOOP
    if transform == "jax.checkpoint":
        return FIX_INTERMEDIATE_IN_CHECKPOINT
    if transform == "jax.jit":
        return FIX_INTERMEDIATE_IN_JIT
    return FIX_INTERMEDIATE_IN_GRADIENT


def apply_state(model: Any, updates: dict[KeyPath, Any]) -> Any:
    """``model`` with the recorded state written back (``ft.set`` at each key path).

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> bn = ft.nn.BatchNorm(1)
      >>> ft.nn.apply_state(bn, {ft.key_path(bn, ".running_mean"): jnp.ones(1)}).running_mean
      Array([1.], dtype=float32)
    """
    for path, value in updates.items():
        model = path.set(model, value) if isinstance(path, KeyPath) else _set_named(model, path, value)
    return model


def threaded_state(model: Any) -> dict[KeyPath, Any]:
    """``{KeyPath: value}`` of every floating or signed-integer ``no_derivative`` field of
    ``model``'s layers (BatchNorm's running statistics, and the count of training batches a
    ``momentum=None`` BatchNorm weighs them by): the state the accumulation loop threads
    from one microbatch to the next. PRNG keys (``dropout_key``, uint32 key data) are not in
    it: each microbatch draws from the stored key salted by its index (``functree.nn._salt.salted_keys``).

    Example:
      >>> import functree as ft
      >>> from functree.nn._state import threaded_state
      >>> sorted(map(str, threaded_state({"bn": ft.nn.BatchNorm(2)})))
      ["['bn'].running_mean", "['bn'].running_variance"]
    """
    out: dict[KeyPath, Any] = {}
    for path, layer in [(KeyPath(), model), *walk(model)]:
        if not isinstance(layer, Module):
            continue
        for name in type(layer).__ft_no_derivative__:
            value = layer.__dict__.get(name)
            dtype = getattr(value, "dtype", None)
            if dtype is not None and (jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.signedinteger)):
                out[KeyPath((*path, Entry(ATTR, name)))] = value
    return out


def _set_named(model: Any, path: Any, value: Any) -> Any:
    return key_path(model, path).set(model, value)


def value_with_gradient_and_state(
    loss_fn: Callable[..., Any], model: Any, *args: Any, has_aux: bool = False, **kwargs: Any
) -> tuple[Any, Any, dict[KeyPath, Any]]:
    """``(loss, gradient, state)`` of ``loss_fn(model, *args, **kwargs)`` with respect to ``model``.

    ``ft.value_with_gradient`` with :func:`collect_state` inside: ``state`` holds the new
    values the model's layers recorded (BatchNorm's running statistics in training mode),
    to be written back with :func:`apply_state` after the optimizer's update. With
    ``has_aux=True``, ``loss_fn`` returns ``(loss, aux)`` and the first result is
    ``(loss, aux)``. The gradient has the parameter view's structure, as with
    ``ft.value_with_gradient``. Works inside ``jax.jit``.

    Example: the hand-written loop (``Optimizer.minimize`` and ``ft.train`` do the same):
      >>> import functree as ft, jax, jax.numpy as jnp
      >>> model = ft.nn.training(ft.nn.Sequential(
      ...     ft.nn.Dense(2, 3, key=jax.random.key(0)), ft.nn.BatchNorm(3, momentum=0.5)))
      >>> optimizer = ft.optim.sgd(0.1)
      >>> opt_state = optimizer.init(model)
      >>> def loss_fn(m, x, y):
      ...     return ft.losses.mean_squared_error(m(x), y)
      >>> x, y = jnp.array([[5.0, 6.0], [4.0, 5.0]]), jnp.zeros((2, 3))
      >>> for _ in range(3):
      ...     loss, grads, state = ft.nn.value_with_gradient_and_state(loss_fn, model, x, y)
      ...     updates, opt_state = optimizer.update(grads, opt_state, model)
      ...     model = ft.nn.apply_state(ft.move(model, along=updates), state)
      >>> sorted(map(str, state))
      ['.layers[1].running_mean', '.layers[1].running_variance']
      >>> bool(jnp.all(model.layers[1].running_mean != 0))
      True
    """
    def objective(m: Any, *a: Any, **kw: Any) -> tuple[Any, Any]:
        out, state = collect_state(lambda mm: loss_fn(mm, *a, **kw), m)
        if has_aux:
            loss, aux = out
            return loss, (aux, state)
        return out, state

    (loss, extra), grads = value_with_gradient(objective, wrt=0, has_aux=True)(model, *args, **kwargs)
    if has_aux:
        aux, state = extra
        return (loss, aux), grads, state
    return loss, grads, extra
