"""``ft.jit``: jit for functions of Modules, with no per-call filtering.

Static fields already live in each Module's tree definition, so a Module passes through
``jax.jit`` as it is: each Module class flattens through small functions generated
once for it (and rebuilds without calling ``__init__``), nothing is partitioned in
Python, and the call returns without blocking (asynchronous dispatch).

Two things cost Python work, and only where asked for or needed:

* ``static_leaves=True`` makes every leaf JAX cannot trace (the functions an Equinox
  module keeps as leaves, strings) static, as ``eqx.filter_jit`` does: a tree map over the
  arguments and results per call;
* a donating ``ft.jit`` runs over flat leaves (:mod:`functree._flat`): its results are
  rebuilt by code generated once per tree definition, and the model and state a loop
  passes back are passed by their leaves, not flattened again;
* a donating ``ft.jit`` looks for aliased arguments (one array at two leaves) only in
  arguments that are not its previous call's outputs (a training loop passes those
  back): it then warns (:class:`ft.AliasWarning`, naming both key paths) and copies the
  repeated leaf. A call on its own outputs costs one Python frame and identity checks.

``ft.jit(f)`` re-wrapped at every call (``ft.jit(f)(x)`` in a loop) compiles once, as
``jax.jit(f)(x)`` does: the function JAX traces is made once per ``f`` (:func:`_traced`,
held while ``f`` lives), so JAX's caches, keyed on it and the options, find it again.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import linecache
import reprlib
import struct
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from functree._alias import (
    DonationGuard,
    copy_aliases,
    is_deletion_error,
    is_donated_twice,
    stale_error,
    warn_aliases,
)
from functree._flat import flat_jit
from functree._parameters import parameters
from functree._tree import dotted_name
from functree._where import devices_error

__all__ = ["jit", "unchecked_jit", "has_untraceable_leaves", "eval_shape", "explain_control_flow"]


TRACED_BOOL = """\
Python control flow on a traced value inside ft.jit{where}:
{source}
Under jit the value is not known until run time, so Python cannot branch on it. Use

    wrong:  if x > 0: y = f(x)
            else:     y = g(x)
    right:  y = jnp.where(x > 0, f(x), g(x))               # choose between two values
       or:  y = jax.lax.cond(x > 0, f, g, x)               # choose between two computations
       or:  jax.lax.while_loop(cond_fn, body_fn, init)     # a loop on a traced condition

or, if the value is configuration, make it static: ft.jit(f, static_argnames=("flag",)).

JAX said: {error}"""

TRACED_INTEGER = """\
A traced value is used as a Python integer inside ft.jit{where}:
{source}
Under jit the value is not known until run time (`range(n)`, `int(x)`, `my_list[i]` need it \
now). Use

    wrong:  for i in range(n): x = step(i, x)
    right:  x = jax.lax.fori_loop(0, n, step, x)       # a loop with a traced bound
       or:  y = jnp.asarray(my_list)[i]                  # index an array, not a list

or, if the value is configuration, make it static: ft.jit(f, static_argnames=("n",)).

JAX said: {error}"""

UNTRACEABLE_LEAF = """\
ft.jit({fn}): the argument {path} is a {type}, not an array: JAX cannot trace it.
A function (or another object) kept as a leaf of a model, such as Equinox's \
`layers: list` holding `jax.nn.relu`, has to be static data:

    wrong:  ft.jit(f)(model, x)                        # {path} is a {type}
    right:  ft.jit(f, static_leaves=True)(model, x)    # non-array leaves static, as eqx.filter_jit
       or:  layers = ft.nn.Sequential([ft.nn.Dense(2, 8, key=key), jax.nn.relu])   # functions kept static

ft.train.train_step and ft.train.Trainer do this on their own."""

UNTRACEABLE_ARGUMENT = """\
ft.jit({fn}): the argument {path} is a {type}, not an array: JAX cannot trace it. An argument \
that is configuration (a mode string, a function, an options object) is static: the program \
is compiled for each value it is given (jax.jit's static_argnums and static_argnames):

    wrong:  ft.jit(f)                        # {path} given a {type} ({value})
    right:  ft.jit(f, {static})
       or:  ft.jit(f, static_leaves=True)    # every argument's non-array leaves static"""

# Flax NNX's `@nnx.jit def train_step(model, optimizer, x, y)` passes the nnx.Optimizer, which
# holds the state; here the optimizer is configuration and its state the array argument.
OPTIMIZER_ARGUMENT = """\
ft.jit({fn}): the argument {path} is an optimizer ({type}), not an array: JAX cannot trace \
it. Flax NNX's nnx.jit takes the nnx.Optimizer, which holds its state; a functree (or optax) \
optimizer is configuration and its state is the argument: close over the optimizer and pass \
the state.

    wrong:  step(model, optimizer, batch)
    right:  opt_state = optimizer.init(model)
            @ft.jit
            def step(model, opt_state, batch):          # optimizer from the enclosing scope
                grads = ft.gradient(lambda m: loss_fn(m, batch), at=model)
                updates, opt_state = optimizer.update(grads, opt_state, model)
                return ft.move(model, along=updates), opt_state
       or:  step = ft.train.train_step(loss_fn, optimizer)   # the whole step, compiled"""

BAD_DONATE = """\
ft.jit({fn}, donate={donate!r}): {problem}. donate= takes indices or names of the \
arguments of {fn}{signature}:

    wrong:  ft.jit({fn}, donate={donate!r})
    right:  ft.jit({fn}, donate={right!r})           # by name, or by index: donate=0 (several: donate=(0, 1))"""

_INTERNAL = ("/jax/", "/jaxlib/", "functree/_jit.py")


def _user_frame(tb: Any) -> Any:
    """The innermost traceback entry outside JAX and this module (the user's line)."""
    found = None
    while tb is not None:
        if not any(part in tb.tb_frame.f_code.co_filename for part in _INTERNAL):
            found = tb
        tb = tb.tb_next
    return found


def _explain(template: str, error: Exception) -> str:
    tb = _user_frame(error.__traceback__)
    if tb is None:
        return template.format(where="", source="", error=error)
    filename, lineno = tb.tb_frame.f_code.co_filename, tb.tb_lineno
    line = linecache.getline(filename, lineno).strip()
    source = f"\n    {line}\n" if line else ""
    return template.format(where=f" at {filename}:{lineno}", source=source, error=error)


def explain_control_flow(f: Callable[..., Any], fn: Callable[[], Any] | None = None) -> Callable[..., Any]:
    # Runs at trace time only: steady-state calls never enter this wrapper. ``fn`` returns
    # the function to call (a weak reference to ``f``, see _traced); default ``f`` itself.
    call = (lambda: f) if fn is None else fn

    @functools.wraps(f)
    def traced(*args: Any, **kwargs: Any) -> Any:
        try:
            return call()(*args, **kwargs)
        except jax.errors.TracerBoolConversionError as e:
            error = ControlFlowError(_explain(TRACED_BOOL, e))
            raise error.with_traceback(e.__traceback__) from None
        except jax.errors.TracerIntegerConversionError as e:
            error = ControlFlowError(_explain(TRACED_INTEGER, e))
            raise error.with_traceback(e.__traceback__) from None

    return traced


class ControlFlowError(TypeError):
    """Python control flow on a traced value inside ``ft.jit``: ``if``/``while``/``bool()``
    on a traced value, or a traced value used as a Python integer (``range(n)``).

    The message names the file and line and shows the ``jnp.where`` / ``jax.lax.cond`` /
    ``jax.lax.fori_loop`` rewrite. It is a ``TypeError``, like JAX's own errors.

    Example:
      >>> import functree as ft
      >>> try:
      ...     ft.jit(lambda x: x if x > 0 else -x)(1.0)
      ... except ft.ControlFlowError as e:
      ...     print(next(line for line in str(e).splitlines() if "right:" in line))
          right:  y = jnp.where(x > 0, f(x), g(x))               # choose between two values
    """


def jit(
    f: Callable[..., Any] | None = None,
    *,
    donate: int | str | Sequence[int | str] | None = None,
    static_leaves: bool = False,
    **jax_jit_options: Any,
) -> Any:
    """``jax.jit`` for functions of Modules.

    ``donate`` names arguments whose buffers XLA may reuse for the outputs (argument
    indices or names; a training step donates the model and optimizer state; one that names
    no argument, or ``True``, is refused here: :data:`BAD_DONATE`). Donated
    arguments holding one array at two leaves are copied apart, with an
    :class:`ft.AliasWarning` naming both key paths. ``static_leaves=True`` makes every
    leaf that is not an array static (``eqx.filter_jit``'s rule): the functions and Python
    numbers inside an Equinox module (``Dropout.p``, ``MaxPool2d.init``) stay Python
    values, at the cost of a Python tree map per call.
    Other options (``static_argnames``, ``in_shardings``, ``out_shardings`` ...) pass
    through to ``jax.jit``. Usable as ``@ft.jit`` or ``@ft.jit(donate=(0, 1))``.

    A global the function reads is read while it is traced, as ``jax.jit`` reads it: its
    value is a constant of the compiled program until the function is traced again (another
    shape or dtype). A notebook cell that sets ``G = 3.0`` after the first call is not seen,
    and ``ft.jit(f)`` again of the same ``f`` finds the old program in JAX's cache. Pass a
    value that changes as an argument (traced: a new value compiles nothing), or run the
    cell that defines ``f`` again (a new function, traced anew).

    Example:
      >>> import functree as ft, jax, jax.numpy as jnp
      >>> @ft.jit
      ... def f(x):
      ...     return 2 * x
      >>> f(jnp.ones(2))
      Array([2., 2.], dtype=float32)
      >>> apply = ft.jit(lambda layer, x: layer["fn"](x), static_leaves=True)
      >>> apply({"fn": jax.nn.relu}, jnp.array([-1.0, 2.0]))  # a function as a leaf
      Array([0., 2.], dtype=float32)
      >>> # a global read while tracing, then set by a later cell (as with jax.jit):
      >>> G = 2.0
      >>> def scaled(x):
      ...     return G * x
      >>> fast = ft.jit(scaled)
      >>> fast(jnp.ones(1))
      Array([2.], dtype=float32)
      >>> G = 3.0  # a later cell
      >>> fast(jnp.ones(1)), ft.jit(scaled)(jnp.ones(1))  # wrong: both traced with G = 2.0
      (Array([2.], dtype=float32), Array([2.], dtype=float32))
      >>> scale = ft.jit(lambda x, g: g * x)  # right: the value as an argument
      >>> scale(jnp.ones(1), G)
      Array([3.], dtype=float32)
      >>> def scaled(x):  # or: the cell defining the function run again
      ...     return G * x
      >>> ft.jit(scaled)(jnp.ones(1))
      Array([3.], dtype=float32)
    """
    if f is None:
        return functools.partial(jit, donate=donate, static_leaves=static_leaves, **jax_jit_options)
    if donate is None:
        jitted = unchecked_jit(f, static_leaves=static_leaves, **jax_jit_options)
        return jitted if static_leaves else _leaves_explained(f, jitted)
    _check_donate(f, donate)
    nums, names = _donated(f, donate)
    if static_leaves or jax_jit_options or not nums or min(nums) < 0:
        jitted = unchecked_jit(f, donate=donate, static_leaves=static_leaves, **jax_jit_options)
        # One wrapper: the donation guard, with the errors explained unless static_leaves
        # made every leaf traceable.
        return _alias_checked(f, jitted, (nums, names), explain=not static_leaves)
    # A training loop's step: over flat leaves, its results passed back without flattening,
    # the guard inside (a step that passes them back runs one Python frame, no wrapper).
    return _flat(f, nums, names)


def _explained(f: Callable[..., Any], error: Exception, args: Sequence[Any], kwargs: dict[str, Any]) -> Exception | None:
    """The error to raise instead of JAX's ``error`` from calling ``f``'s jitted function, or
    None: a deleted (donated) array named by its key path, :data:`OPTIMIZER_ARGUMENT` for an
    optimizer passed as an argument (NNX's habit), :data:`UNTRACEABLE_ARGUMENT` for a whole
    argument that is configuration (a mode string: ``static_argnums``), or
    :data:`UNTRACEABLE_LEAF` for a function kept as a leaf (its key path and ``static_leaves=True``)."""
    if isinstance(error, (RuntimeError, ValueError)):  # a donated array passed again, or devices apart
        if is_deletion_error(error):
            return stale_error(named_arguments(f, args, kwargs))
        return devices_error(f"ft.jit({getattr(f, '__name__', 'f')})", error, named_arguments(f, args, kwargs))
    if isinstance(error, TypeError) and "abstract array" in str(error):
        found = untraceable_leaf(f, args, kwargs)
        if found is not None:
            path, leaf = found
            optimizer = _optimizer_argument(f, args, kwargs)
            if optimizer is not None:
                name, given = optimizer
                return TypeError(OPTIMIZER_ARGUMENT.format(fn=getattr(f, "__name__", "f"), path=name,
                                                           type=type(given).__name__))
            static = _static_argument(f, args, kwargs, leaf)
            if static is not None:
                return TypeError(UNTRACEABLE_ARGUMENT.format(fn=getattr(f, "__name__", "f"), path=path, static=static,
                                                             type=type(leaf).__name__, value=reprlib.repr(leaf)))
            return TypeError(UNTRACEABLE_LEAF.format(fn=getattr(f, "__name__", "f"), path=path,
                                                     type=type(leaf).__name__))
    return None


def _static_argument(f: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any], leaf: Any) -> str | None:
    """``static_argnums=(i,)`` (positional) or ``static_argnames=("mode",)`` (keyword) when the
    untraceable ``leaf`` is a whole argument that jit can hold static (hashable); None for a
    leaf inside an argument (a model's function: ``static_leaves``)."""
    try:
        hash(leaf)
    except TypeError:
        return None
    for i, (name, value) in enumerate(named_arguments(f, args, kwargs)):
        if value is leaf:
            return f"static_argnums=({i},)" if i < len(args) else f"static_argnames=({name!r},)"
    return None


def _optimizer_argument(f: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[str, Any] | None:
    """The first argument that is an optimizer (``init`` and ``update`` functions: an
    ``ft.optim.Optimizer``, an optax transformation), by name; None if none is."""
    for name, value in named_arguments(f, args, kwargs):
        if callable(getattr(value, "init", None)) and callable(getattr(value, "update", None)):
            return name, value
    return None


def _leaves_explained(f: Callable[..., Any], jitted: Any) -> Callable[..., Any]:
    """``jitted``, its errors :func:`_explained`."""

    @functools.wraps(f)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return jitted(*args, **kwargs)
        except (RuntimeError, ValueError, TypeError) as e:
            better = _explained(f, e, args, kwargs)
            if better is None:
                raise
            raise better from None

    _expose(call, jitted)
    call._jitted = jitted  # type: ignore[attr-defined]
    return call


def named_arguments(f: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]) -> list[tuple[str, Any]]:
    """``[(name, argument)]`` by ``f``'s parameter names (:func:`positional_name`), then ``kwargs``."""
    params = positional_parameters(f)
    return [*((positional_name(i, params), a) for i, a in enumerate(args)), *kwargs.items()]


def positional_parameters(f: Callable[..., Any]) -> tuple[list[str], str | None]:
    """The names of ``f``'s positional parameters and of its ``*args`` (None without one):
    what names a call's positional arguments (:func:`positional_name`). A keyword-only
    parameter or ``**kwargs`` takes none (read by index, ``def f(model, *args, scale)``
    named argument 2 ``scale``); ``([], None)`` without a signature."""
    try:
        parameters = inspect.signature(f).parameters.values()
    except (TypeError, ValueError):
        return [], None
    positional = [p.name for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    star = next((p.name for p in parameters if p.kind is p.VAR_POSITIONAL), None)
    return positional, star


def positional_name(i: int, params: tuple[Sequence[str], str | None]) -> str:
    """Positional argument ``i`` of a call by :func:`positional_parameters` ``params``: its
    parameter's name (``model``), ``args[j]`` for the ``j``-th one ``f``'s ``*args`` takes
    (as ``f`` reads it: ``def f(model, *args)`` gets argument 2 as ``args[1]``), else
    ``args[i]`` (past them, or no signature)."""
    names, star = params
    if i < len(names):
        return names[i]
    return f"{star}[{i - len(names)}]" if star else f"args[{i}]"


def untraceable_leaf(f: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[str, Any] | None:
    """``(name, leaf)`` of the first leaf of the arguments that JAX cannot trace (not an
    array or number), named as ``model.layers.1`` by ``f``'s argument names; or None."""
    for name, tree in named_arguments(f, args, kwargs):
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
            if not (_traceable(leaf) or isinstance(leaf, (int, float, complex))):
                rest = dotted_name(path)
                return (f"{name}.{rest}" if rest else name), leaf
    return None


def unchecked_jit(
    f: Callable[..., Any],
    *,
    donate: int | str | Sequence[int | str] | None = None,
    static_leaves: bool = False,
    **jax_jit_options: Any,
) -> Any:
    """:func:`jit` without the aliasing check: for callers that untie their donated state
    once when they create it (``ft.train.Trainer``, ``TrainStep``). Without
    ``static_leaves`` this is ``jax.jit`` itself (no Python frame per call)."""
    if donate is not None:
        nums, names = _donated(f, donate)
        jax_jit_options["donate_argnums"] = nums
        jax_jit_options["donate_argnames"] = names
        # A donated leaf the program overwrites without reading (the learning context's
        # loss) would be pruned, and then neither donated nor aliased to its output.
        jax_jit_options.setdefault("keep_unused", True)
    if static_leaves:
        return _static_leaves_jit(f, jax_jit_options)
    return _keeping(jax.jit(_traced(f, static_leaves=False), **jax_jit_options), f)


# --- one traced function per f: JAX's caches key on it ----------------------------------
# f -> {static_leaves: the function jax.jit traces}. The values hold f weakly (a strong
# reference from a value would keep its weak key alive forever); the jitted function
# returned holds f (_keeping), so f lives as long as either is used.
_TRACED: weakref.WeakKeyDictionary[Any, dict[bool, tuple[Any, Callable[..., Any]]]] = weakref.WeakKeyDictionary()


def _traced(f: Callable[..., Any], *, static_leaves: bool) -> Callable[..., Any]:
    """The function ``jax.jit`` traces for ``f``: the same object for the same ``f`` (so a
    re-wrapped ``ft.jit(f)`` hits JAX's compilation cache), or a new one for a function
    that cannot be weakly referenced or hashed (some builtins, a Module holding arrays)."""
    try:
        per_f = _TRACED.get(f)
        if per_f is None:
            per_f = _TRACED.setdefault(f, {})
    except (TypeError, ValueError):  # no weak reference or no hash: no cache
        return _make_traced(f, lambda: f, static_leaves)
    found = per_f.get(static_leaves)
    if found is not None and found[0]() is f:
        return found[1]
    ref = weakref.ref(f)
    traced = _make_traced(f, ref, static_leaves)
    if found is None:  # (an equal but distinct f keeps the first one's entry)
        per_f[static_leaves] = (ref, traced)
    return traced


def _make_traced(f: Callable[..., Any], fn: Callable[[], Any], static_leaves: bool) -> Callable[..., Any]:
    if static_leaves:
        def inner(*args: Any, **kwargs: Any) -> Any:
            return _hide(fn()(*_show(args), **_show(kwargs)))

        traced = explain_control_flow(f, lambda: inner)
    else:
        traced = explain_control_flow(f, fn)
    # functools.wraps set __wrapped__ = f (a strong reference): keep its signature only.
    del traced.__wrapped__  # type: ignore[attr-defined]
    with contextlib.suppress(TypeError, ValueError):  # no signature (some builtins)
        traced.__signature__ = inspect.signature(f)  # type: ignore[attr-defined]
    return traced


# f -> {(donated numbers, names): its table of flat programs}: shared by every ft.jit of f
# with that donation, so a re-wrapped donating ft.jit finds its compiled programs again.
_FLAT: weakref.WeakKeyDictionary[Any, dict[Any, Any]] = weakref.WeakKeyDictionary()


def _flat(f: Callable[..., Any], nums: tuple[int, ...], names: tuple[str, ...]) -> Any:
    """The :func:`flat_jit` of ``f`` donating ``nums``, guarded (see :func:`_guarded`),
    with ``f``'s name, docstring and signature."""
    guard, before, explain = _guarded(f, nums, names, explain=True)
    options = {"donate": nums, "tree_options": {"donate_argnames": names}, "tree_when_mutable": True,
               "guard": guard, "before": before, "explain": explain}
    try:
        per_f = _FLAT.get(f)
        if per_f is None:
            per_f = _FLAT.setdefault(f, {})
    except (TypeError, ValueError):  # no weak reference or no hash: no cache
        jitted = flat_jit(explain_control_flow(f), **options)
    else:
        traced = _traced(f, static_leaves=False)
        found = per_f.get((nums, names))
        if found is None or found[0] is not traced:  # (an equal but distinct f: its own table)
            found = (traced, {})
            if (nums, names) not in per_f and _TRACED[f][False][1] is traced:  # f's own (not an equal f's)
                per_f[(nums, names)] = found
        jitted = flat_jit(traced, programs=found[1], **options)
    functools.update_wrapper(jitted, f, updated=())  # (FlatJit's own attributes stay)
    return jitted


def _keeping(jitted: Any, f: Callable[..., Any]) -> Any:
    """``jitted`` holding ``f`` (its traced function holds it weakly), as ``__wrapped__``."""
    with contextlib.suppress(AttributeError, TypeError):
        jitted.__wrapped__ = f
    return jitted


# --- leaves JAX cannot trace, made static -----------------------------------------------
# Arrays are traced; every other leaf (a Python number, a function, a string) is static
# data, as in ``eqx.filter_jit``: ``eqx.nn.Dropout``'s ``p`` stays a float its code can
# branch on, ``eqx.nn.MaxPool2d``'s ``init=-inf`` a constant, never a parameter.
_TRACEABLE = (jax.Array, np.ndarray, np.generic)


def _traceable(x: Any) -> bool:
    return isinstance(x, _TRACEABLE) or hasattr(x, "__jax_array__")


class _Static:
    """A leaf JAX cannot trace, held in a pytree node with no children: it is its own
    auxiliary data, so it travels in the tree definition (hashed into the jit cache key,
    returned as it is on output).

    Two are one cache entry only where eager code cannot tell them apart (:func:`_identity`):
    ``==`` says ``0.0 == -0.0`` and ``1 == 1.0 == True``, and a program traced for the
    first (``1 / 0.0 = inf``, an int's dtype) is wrong for the second."""

    __slots__ = ("_key", "value")

    def __init__(self, value: Any):
        self.value = value
        self._key = _identity(value)

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, _Static) and self._key == other._key

    def __hash__(self) -> int:
        return hash(self._key)

    def __repr__(self) -> str:
        return f"_Static({self.value!r})"


def _identity(value: Any) -> tuple[Any, ...]:
    """What tells static values apart: the type (``True``, ``1`` and ``1.0`` trace to bool,
    int32 and float32), and a float's bits (``-0.0`` is not ``0.0``: ``1 / -0.0 = -inf``; a
    NaN equals a NaN of the same bits, so a NaN static compiles once, not at every call).
    A numpy scalar by its dtype and bytes, complex numbers by both parts' bits; any other
    value by ``==`` (a function by identity)."""
    kind = type(value)
    if isinstance(value, np.generic):  # (before float: np.float64 is a float)
        return kind, value.dtype, value.tobytes()
    if isinstance(value, float):
        return kind, struct.pack("<d", value)
    if isinstance(value, complex):
        return kind, struct.pack("<dd", value.real, value.imag)
    return kind, value


jax.tree_util.register_pytree_node(_Static, lambda s: ((), s), lambda s, _: s)


def _is_static(x: Any) -> bool:
    return isinstance(x, _Static)


def _hide(tree: Any) -> Any:
    return jax.tree.map(lambda x: x if _traceable(x) else _Static(x), tree)


def _show(tree: Any) -> Any:
    return jax.tree.map(lambda x: x.value if _is_static(x) else x, tree, is_leaf=_is_static)


def has_untraceable_leaves(tree: Any) -> bool:
    """Whether ``tree`` has a leaf that is not an array (an Equinox module's functions and
    Python numbers): such a tree needs ``ft.jit(..., static_leaves=True)``.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> has_untraceable_leaves({"w": jnp.ones(2)}), has_untraceable_leaves([jax.nn.relu])
      (False, True)
      >>> has_untraceable_leaves({"w": jnp.ones(2), "p": 0.5})  # a Python number: static
      True
    """
    return not all(_traceable(x) for x in jax.tree.leaves(tree))


def eval_shape(f: Callable[..., Any], *args: Any) -> Any:
    """``jax.eval_shape`` that also takes arguments with untraceable leaves (kept static).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> eval_shape(lambda fn, x: fn(x), jax.nn.relu, jnp.ones(3))
      ShapeDtypeStruct(shape=(3,), dtype=float32)
    """
    return _show(jax.eval_shape(lambda *a: _hide(f(*_show(a))), *_hide(args)))


def _static_leaves_jit(f: Callable[..., Any], options: dict[str, Any]) -> Callable[..., Any]:
    jitted = _keeping(jax.jit(_traced(f, static_leaves=True), **options), f)

    @functools.wraps(f)
    def call(*args: Any, **kwargs: Any) -> Any:
        return _show(jitted(*_hide(args), **_hide(kwargs)))

    _expose(call, jitted, ("clear_cache", "_cache_size"))
    return call


# --- donation of aliased arguments ------------------------------------------------------
def _alias_checked(f: Callable[..., Any], jitted: Any, donated: tuple[Any, Any], *,
                   explain: bool = True) -> Callable[..., Any]:
    """``jitted``, copying apart donated arguments that hold one array at two leaves
    (looked for by :class:`DonationGuard`: structurally, never from XLA's error), its
    errors :func:`_explained` when ``explain``."""
    guard, before, explained = _guarded(f, *donated, explain=explain)

    @functools.wraps(f)
    def call(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = before(args, kwargs)
        try:
            result = jitted(*args, **kwargs)
        except (RuntimeError, ValueError, TypeError) as e:
            if is_donated_twice(e) and guard.forget():  # a previous result at two places: all checked
                return call(*args, **kwargs)
            better = explained(e, args, kwargs)
            if better is None:
                raise
            raise better from None
        guard.remember(result, args)
        return result

    _expose(call, jitted)
    call._jitted = jitted  # type: ignore[attr-defined]
    return call


def _guarded(f: Callable[..., Any], nums: tuple[int, ...], names: tuple[str, ...], *,
             explain: bool) -> tuple[DonationGuard, Callable[..., Any], Callable[..., Any]]:
    """``(guard, before, explain)`` of a call of ``f`` donating ``nums`` / ``names``:
    ``before(args, kwargs)`` names a deleted donated array and copies apart arguments
    that hold one array at two leaves, for inputs that are not the guard's previous
    results; ``explain(error, args, kwargs)`` is :func:`_explained` (or None when not
    ``explain``)."""
    params = positional_parameters(f)
    fname = getattr(f, "__name__", "f")
    what = f"The arguments of {fname}"
    step = f"ft.jit({fname}, donate={nums or names})"
    guard = DonationGuard(step)
    no_donation = f"ft.jit({fname})    # without donate=: the inputs stay valid (more memory)"

    top = max(nums, default=-1)

    def before(args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
        if kwargs or len(args) <= top or top < 0:  # donated arguments given by name (or missing)
            fresh = guard.fresh(*[args[i] for i in nums if i < len(args)], *[kwargs[n] for n in names if n in kwargs])
        else:
            fresh = guard.fresh_in(args, nums)
        if fresh:
            guard.check_donated(_named(args, kwargs, nums, names, params), what="The argument", step=step,
                                no_donation=no_donation)
            pairs = warn_aliases((args, kwargs), what=what, rename=lambda n: _argument_name(n, params),
                                 trained=lambda: parameters((args, kwargs)))
            args, kwargs = copy_aliases((args, kwargs), pairs)
        return args, kwargs

    def explained(error: Exception, args: tuple, kwargs: dict[str, Any]) -> Exception | None:
        return _explained(f, error, args, kwargs) if explain else None

    return guard, before, explained


def _named(args: tuple, kwargs: dict[str, Any], nums: tuple[int, ...], names: tuple[str, ...],
           params: tuple[list[str], str | None]) -> list[tuple[str, Any]]:
    """The donated arguments given, each with its name (:func:`positional_name`)."""
    named = [(positional_name(i % len(args), params), args[i]) for i in nums if -len(args) <= i < len(args)]
    return named + [(n, kwargs[n]) for n in names if n in kwargs]


def _argument_name(dotted: str, params: list[str] | tuple[list[str], str | None]) -> str:
    """``0.1.weight`` of the ``(args, kwargs)`` tree → ``model.weight`` (argument 1's name:
    :func:`positional_name` of ``params``, a list of names or :func:`positional_parameters`)."""
    kind, _, rest = dotted.partition(".")
    head, _, tail = rest.partition(".")
    if kind == "0" and head.isdigit():
        head = positional_name(int(head), params if isinstance(params, tuple) else (params, None))
    return f"{head}.{tail}" if tail else head


def _expose(call: Any, jitted: Any,
            names: Sequence[str] = ("lower", "trace", "eval_shape", "clear_cache", "_cache_size")) -> None:
    """Keep ``lower``, ``trace``, ``eval_shape`` and the cache helpers of the jitted function."""
    for name in names:
        if hasattr(jitted, name):
            setattr(call, name, getattr(jitted, name))


def _check_donate(f: Callable[..., Any], donate: int | str | Sequence[int | str]) -> None:
    """Refuse a ``donate=`` item that names no argument of ``f`` (:data:`BAD_DONATE`): an index
    past its positional arguments or a name not among its parameters would donate nothing
    (``jax.jit`` refuses those only at the call), and ``True`` is the index 1 to Python (the
    batch donated, the model not)."""
    try:
        signature = inspect.signature(f)
    except (TypeError, ValueError):  # no signature (some builtins): nothing to check against
        return
    kinds = [p.kind for p in signature.parameters.values()]
    positional = [p.name for p in signature.parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    named = [p.name for p in signature.parameters.values() if p.kind is not p.VAR_POSITIONAL and p.kind is not p.VAR_KEYWORD]
    for item in (donate,) if isinstance(donate, (int, str)) else tuple(donate):
        if isinstance(item, bool):
            problem = f"{item} is the index {int(item)} to Python: argument {int(item)} would be donated, not every one"
        elif isinstance(item, int) and inspect.Parameter.VAR_POSITIONAL not in kinds and not (
                -len(positional) <= item < len(positional)):
            problem = f"{item} is past its {len(positional)} positional arguments: nothing would be donated"
        elif isinstance(item, str) and inspect.Parameter.VAR_KEYWORD not in kinds and item not in named:
            problem = f"{item!r} is not one of its parameters"
        else:
            continue
        fn = getattr(f, "__name__", "f")
        right = named[0] if named else 0
        raise ValueError(BAD_DONATE.format(fn=fn, donate=donate, problem=problem, signature=signature, right=right))


def _donated(
    f: Callable[..., Any], donate: int | str | Sequence[int | str]
) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """Both the indices and the names of the donated arguments.

    JAX applies ``donate_argnums`` to positional and ``donate_argnames`` to keyword
    arguments; giving both complete sets donates an argument however it is passed.
    """
    items = (donate,) if isinstance(donate, (int, str)) else tuple(donate)
    try:
        params = [
            p.name
            for p in inspect.signature(f).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
    except (TypeError, ValueError):  # no signature (some builtins): take items as given
        params = []
    nums = {i for i in items if isinstance(i, int)}
    names = {i for i in items if isinstance(i, str)}
    nums |= {params.index(n) for n in names if n in params}
    names |= {params[i] for i in nums if -len(params) <= i < len(params)}
    return tuple(sorted(nums)), tuple(sorted(names))
