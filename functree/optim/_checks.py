"""The optimizer's input check: a gradient tree against the model's parameter view."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from functree._parameters import first_difference
from functree._tree import WeakIdentity, bounded_put, cached, dotted_name, is_none
from functree.optim._complex import RealPair

__all__ = ["ConfigurationError", "StructureError", "named_structure_errors", "GRADIENT_DTYPE", "check_gradients", "checked_gradients", "check_state_fits", "check_redefined", "keep_unchanged", "descent_direction",
           "STATE_MISMATCH", "STATE_WITHOUT_MOMENT", "STATE_FOR_ALL_PARAMETERS", "STATE_OF_ANOTHER_OPTIMIZER",
           "STATE_CLASS_REDEFINED", "GRADIENT_AS_UPDATE", "check_not_passed_through"]

class ConfigurationError(ValueError):
    """A refusal of how the optimizer is built (no learning rate applied, a gradient passed
    through as its update), read from its transform and the parameters' structure, never from
    a minibatch's values: ``Trainer.fit`` lets it through as it is, without the minibatch's
    location and shapes it adds to a step's other errors (the data is not at fault)."""


class StructureError(ValueError):
    """A transform's tree-structure error named by functree (an outer naming lets it through)."""


@contextlib.contextmanager
def named_structure_errors(message: str) -> Iterator[None]:
    """Raise :class:`StructureError` with ``message`` (formatted with JAX's ``error``) for a
    tree-structure error inside: JAX's own names neither the tree at fault nor the fix. The
    innermost naming wins (``ft.optim.per_member``'s inside the Optimizer's)."""
    try:
        yield
    except ValueError as e:
        if isinstance(e, StructureError) or "pytree" not in str(e).lower():
            raise
        raise StructureError(message.format(error=str(e)[:1500])) from e


GRADIENT_MISMATCH = """\
The gradient does not fit the model's parameters at {path}: {detail}.
Gradients must have the parameter view's structure. Compute them from the same model:

    wrong:  grads = jax.grad(loss)(other_params)
    right:  grads = ft.gradient(loss, at=model)          # or opt.compute_gradients(...)
            updates, state = opt.update(grads, state, model)
"""


STATE_MISMATCH = """\
The optimizer state was made for a model of another structure: its moment {moment} differs \
from the gradients at {path}: {detail}. A state fits the model it was made for; after the \
model's structure changed (a list field appended to, a model rebuilt with other layers or \
shapes), make a new state (its moments start again from zero):

    wrong:  opt_state = optimizer.init(model);  model = model.replace(ws=[w1, w2])
            optimizer.update(grads, opt_state, model)         # or a train step
    right:  opt_state = optimizer.init(model)                 # again, for the model as it is now
"""


STATE_STATIC_CHANGED = """\
The optimizer state was made for the model before a static value changed: its moment \
{moment} differs from the gradients at {path}: {detail}. No parameter changed, so the \
moments still fit the model; carry them over to its new structure (or start them again):

    wrong:  opt_state = optimizer.init(model);  model = model.replace(...)   # a static field
            optimizer.update(grads, opt_state, model)         # or a train step
    right:  opt_state = jax.tree.unflatten(jax.tree.structure(optimizer.init(model)),
                                           jax.tree.leaves(opt_state))      # the same moments
       or:  opt_state = optimizer.init(model)                 # moments from zero
"""


STATE_CLASS_REDEFINED = """\
The optimizer state was made before a model class was defined again (a notebook cell re-run): \
at {path} {detail}. JAX tells the two classes apart although they have one name; the fields and \
shapes are the same, so the moments still fit the model: carry them over to the new class \
(or start them again):

    wrong:  opt_state = optimizer.init(model)         # then the cell with `class Net` re-run
            model = Net(...)
            optimizer.update(grads, opt_state, model)   # or a train step
    right:  opt_state = jax.tree.unflatten(jax.tree.structure(optimizer.init(model)),
                                           jax.tree.leaves(opt_state))      # the same moments
       or:  opt_state = optimizer.init(model)         # moments from zero
"""


STATE_WITHOUT_MOMENT = """\
The optimizer state has no moment {moment} for {path}, which has a gradient now ({detail}): \
the state was made by an optimizer that trained other parameters only \
(ft.optim.Optimizer(tx, wrt=...)). To train {path} too (unfreezing), make a state for all \
parameters; to keep the trained ones' moments and step count, take them from the old state:

    wrong:  state = ft.optim.Optimizer(tx, wrt="head.*").init(model)
            ft.optim.Optimizer(tx).apply_gradients(grads, model, state)
    right:  opt = ft.optim.Optimizer(tx)
            state = opt.init(model)                                   # moments start from zero
       or:  state = jax.tree.map(lambda old, new: new if old is None else old,   # the head's kept
                                 state, opt.init(model), is_leaf=lambda x: x is None)
"""

STATE_FOR_ALL_PARAMETERS = """\
The optimizer state has moments for {path}, which this optimizer does not train ({detail}): \
the state was made for all parameters and the optimizer trains only its wrt= selection (or \
{path} is no parameter now). The model did not change: to freeze parameters mid-run and keep \
every moment (torch's requires_grad_(False)), keep the optimizer of the state and give it \
partial gradients; a None gradient leaves its parameter and moments unchanged (for torch's \
per-parameter Adam counts, the frozen parameters need an ft.optim.groups group of their own: \
docs/guides/training.md):

    wrong:  ft.optim.Optimizer(tx, wrt="head.*").apply_gradients(grads, model, state)
    right:  grads = ft.gradient(loss_fn, at=model, wrt="head.*")      # loss_fn(model) -> loss
            model, state = ft.optim.Optimizer(tx).apply_gradients(grads, model, state)
"""


STATE_OF_ANOTHER_OPTIMIZER = """\
The optimizer state was made by another optimizer than this one: at {path} the state holds \
{given}, this optimizer's state holds {expected}. A state continues the optimizer that made it; \
after rebuilding the optimizer (average=, optax.MultiSteps, optax.chain(clip, ...), optax.masked, \
adam -> adamw, a number -> a schedule), make a new state for it (its moments start again from zero):

    wrong:  state = ft.optim.Optimizer(tx).init(model)
            ft.optim.Optimizer(tx, average=ft.optim.ema(0.9)).apply_gradients(grads, model, state)
    right:  opt = ft.optim.Optimizer(tx, average=ft.optim.ema(0.9))
            state = opt.init(model)                                       # moments from zero
{settable}"""

# Added to STATE_OF_ANOTHER_OPTIMIZER where the old state holds settable hyperparameters.
_SET_INSTEAD = """\
       or, to change a hyperparameter's value only, keep the optimizer that made the state:
            state = ft.optim.set_hyperparameters(state, learning_rate=1e-4)  # no new state, no recompile
"""


def check_gradients(grads: Any, params: Any) -> tuple[list[bool], list[bool]]:
    """Check that ``grads`` fits ``params`` (a parameter view); ``(missing, narrower)``: the
    positions without a gradient, and those whose floating gradient is narrower than its
    parameter (a bfloat16 gradient for a float32 master weight: :func:`checked_gradients`
    widens it, exactly, or the transforms would round the update to bfloat16, Adam's 5e-4
    relative; a wider one stays: ``ft.move`` adds it in its dtype and rounds once).

    Raises naming the first key path where the structures or shapes differ, where a
    gradient is given for a non-parameter, or where its kind of number does not fit the
    parameter's (:data:`GRADIENT_DTYPE`: an integer, bool or complex gradient at a real
    parameter, whose update optax would round to an integer, no step, or a real one at a
    complex parameter, which fails deep in optax). A ``None`` gradient for a parameter is
    allowed (a partial gradient, e.g. ``ft.gradient(loss, wrt="head.*")``): ``missing`` has
    ``True`` at those leaf positions (flatten order of ``params`` with ``None`` leaves).
    Runs in Python: under ``jit`` only while tracing.
    """
    g_leaves, g_def = jax.tree.flatten(grads, is_leaf=is_none)
    p_leaves, p_def = jax.tree.flatten(params, is_leaf=is_none)
    if g_def != p_def:
        diff = first_difference(params, grads) or first_difference(params, grads, none_is_leaf=True)
        path, detail = diff or ("<root>", "different structures")
        raise ValueError(GRADIENT_MISMATCH.format(path=path or "<root>", detail=detail))
    missing, narrower = [], []
    for i, (g, p) in enumerate(zip(g_leaves, p_leaves)):
        missing.append(g is None and p is not None)
        if p is None and g is not None:
            detail = f"the leaf is not a parameter (None in the parameter view), the gradient has shape {np.shape(g)}"
            raise ValueError(GRADIENT_MISMATCH.format(path=_names(params, p_def)[i], detail=detail))
        if g is not None and np.shape(g) != np.shape(p):  # type: ignore[arg-type]  # p is an array here
            detail = f"expected shape {np.shape(p)} (the parameter's), given shape {np.shape(g)}"  # type: ignore[arg-type]
            raise ValueError(GRADIENT_MISMATCH.format(path=_names(params, p_def)[i], detail=detail))
        fits = g is None or p is None or not hasattr(p, "dtype")
        misfit = None if fits else _dtype_misfit(g, p)
        if misfit is not None:
            why, right = _DTYPE_WHY[misfit]
            raise TypeError(GRADIENT_DTYPE.format(path=_names(params, p_def)[i], expected=jnp.result_type(p),
                                                  given=jnp.result_type(g), why=why, right=right))
        narrower.append(not fits and _narrower(g, p))
    return missing, narrower


GRADIENT_DTYPE = """\
The gradient does not fit the model's parameters at {path}: the parameter is {expected}, the \
gradient is {given}. {why}

    wrong:  updates, state = opt.update(grads, state, model)   # {given} at {path}
    right:  updates, state = opt.update({right}, state, model)
       or:  grads = ft.gradient(loss, at=model)                 # {expected} at {path}
"""

_DTYPE_WHY = {
    "integer": ("An integer or bool gradient makes the update integer: -lr * g rounds to 0 (no step, "
                "silently) and a bool adds +1.", "jax.tree.map(lambda g: g.astype(jnp.float32), grads)"),
    "complex": ("Moving along it would drop the imaginary part; a real parameter's gradient is real.",
                "jax.tree.map(jnp.real, grads)"),
    "real": ("A complex parameter is trained as a pair of reals (torch.optim's view_as_real) and its "
             "gradient is complex: the real and imaginary parts' derivatives.",
             "jax.tree.map(lambda g: g.astype(jnp.complex64), grads)"),
}


def _dtype_misfit(g: Any, p: Any) -> str | None:
    """Why gradient ``g`` cannot update parameter ``p`` (a key of ``_DTYPE_WHY``), or None.
    A floating gradient of another width is fine: the update is added in the wider dtype
    and rounded once to the parameter's (``ft.move``)."""
    g_kind, p_kind = jnp.dtype(jnp.result_type(g)).kind, jnp.dtype(jnp.result_type(p)).kind
    if g_kind not in "fVc" and p_kind in "fVc":  # bool, int, uint ("V": bfloat16 and the ml_dtypes)
        return "integer"
    if g_kind == "c" and p_kind != "c":
        return "complex"
    if p_kind == "c" and g_kind != "c":
        return "real"
    return None


def _narrower(g: Any, p: Any) -> bool:
    """Whether floating gradient ``g`` converts exactly to its parameter's other, wider dtype."""
    g_dtype, p_dtype = jnp.result_type(g), jnp.result_type(p)
    if g_dtype == p_dtype or not hasattr(g, "astype"):
        return False
    with jax.numpy_dtype_promotion("standard"):
        return jnp.promote_types(g_dtype, p_dtype) == p_dtype


_NAMES: dict[Any, list[str]] = {}


def _names(tree: Any, treedef: Any) -> list[str]:
    names = _NAMES.get(treedef)
    if names is None:
        path_leaves, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_none)
        names = [dotted_name(p) or "<root>" for p, _ in path_leaves]
        bounded_put(_NAMES, treedef, names)
    return names


# The fields of optax's states that hold a tree shaped like the parameters (Adam's ``mu``
# and ``nu``, momentum's ``trace``, adafactor's factored ``v_row``, ``v_col``, ``v``, Rprop's
# ``step_sizes`` and ``previous`` ...): ``ft.optim.moments`` reads them, and a state's are
# checked against the gradients' shapes (Rprop's (1,) were broadcast into a (3,) layer's).
MOMENT_FIELDS = ("mu", "nu", "nu_max", "trace", "velocity", "sum_of_squares", "e_g", "e_x", "v_row", "v_col", "v",
                 "step_sizes", "previous")
# Of those, the running sums of the gradient itself: shaped like it, leaf for leaf.
_GRADIENT_SHAPED = ("mu", "trace", "velocity", "step_sizes", "previous", "average")
# Second-moment-like sums: the gradient's shape, or reduced to one scalar per parameter
# (NovoGrad's ``nu``). Unchecked, an old accumulator of another shape broadcast silently
# into a changed layer's (adagrad, adadelta, rmsprop).
_SECOND_MOMENTS = ("nu", "nu_max", "sum_of_squares", "e_g", "e_x")
# Adafactor's factored moments (optax.adafactor's FactoredState): ``v`` is the full second
# moment of an unfactored parameter, else the placeholder (1,); ``v_row``/``v_col`` are the
# gradient's shape less one axis for a factored parameter, else (1,).
_FULL_OR_PLACEHOLDER = ("v",)
_ONE_AXIS_LESS = ("v_row", "v_col")
# Read on adafactor's state only: another optax state's ``v`` is no per-parameter tree
# (optax.contrib.mechanize's MechanicState.v: one array of its betas).
FACTORED = ("v_row", "v_col", "v")


def moment_fields(node: Any) -> tuple[str, ...]:
    """The fields of the optax/functree state ``node`` that hold per-parameter moments."""
    fields = getattr(node, "_fields", ())
    factored = type(node).__name__ == "FactoredState"
    return tuple(f for f in MOMENT_FIELDS if f in fields and (factored or f not in FACTORED))


def _shape_fits(name: str, gradient: tuple[int, ...], moment: tuple[int, ...]) -> bool:
    """Whether moment ``name`` of shape ``moment`` may belong to a gradient of shape ``gradient``."""
    if moment == gradient or name in _GRADIENT_SHAPED:
        return moment == gradient
    if name in _SECOND_MOMENTS:
        return moment == ()
    if name in _FULL_OR_PLACEHOLDER:
        return moment == (1,)
    if name in _ONE_AXIS_LESS:
        return moment == (1,) or any(moment == gradient[:i] + gradient[i + 1:] for i in range(len(gradient)))
    return True

_FITS: dict[Any, bool] = {}  # (the state's signature, the gradients') -> checked: they fit


def _signature(tree: Any) -> tuple[Any, tuple[tuple[int, ...], ...]]:
    """``tree``'s definition and leaf shapes: what the check reads (jit's cache key reads
    them too, so under ``jit`` the check runs once per compilation)."""
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple(np.shape(x) for x in leaves)


def check_state_fits(inner: Any, grads: Any, init: Any = None, params: Any = None) -> None:
    """Raise :data:`STATE_MISMATCH` where a moment tree of the transform's state ``inner``
    (an optax state's ``mu``, ``nu``, ``trace`` ...) does not have the structure and shapes
    of ``grads`` (the mode-free parameter view's), naming the first differing key path:
    optax's own error, raised inside ``jax.tree.map``, names neither the state nor the fix;
    and, given the transform's ``init`` and ``params``, :data:`STATE_OF_ANOTHER_OPTIMIZER`
    where ``inner``'s tree definition is not that of a fresh state (made by another
    optimizer: a wrapper added, adam -> adamw).

    The fresh state is ``jax.eval_shape(init, params)`` (no device work), once per
    transform and definition and shapes of ``params``. A moment whose fresh tree is not
    shaped like the gradients (``optax.flatten``'s one vector, GaLore's low-rank
    projection) is compared with the fresh one instead of the gradients.

    Runs where the update is traced (once per compilation under ``jit``), and on an eager
    update once per transform and pair of definitions and leaf shapes (a flatten and a
    dict lookup afterwards). A masked parameter's moment (``optax.MaskedNode``) fits any gradient,
    and any moment subtree but ``None`` fits a gradient leaf (a complex parameter's
    :class:`RealPair`); every moment leaf's shape is checked: the gradient's running sums
    (``mu``, ``trace``, ``velocity``) have its shape, second moments (``nu``,
    ``sum_of_squares``, ``e_g``, ``e_x`` ...) its shape or one scalar, adafactor's factored
    ``v_row``/``v_col`` its shape less one axis and ``v`` its shape (each else the
    placeholder ``(1,)``). A ``None`` moment at a gradient (a state made by
    ``Optimizer(wrt=...)``) and a moment where the gradient is ``None`` (a state made for
    all parameters, given to ``Optimizer(wrt=...)``) each get their own message.

    Example:
      >>> import optax, jax.numpy as jnp
      >>> inner = optax.adam(0.1).init({"ws": [jnp.ones(2)]})
      >>> check_state_fits(inner, {"ws": [jnp.ones(2)]})
      >>> try:
      ...     check_state_fits(inner, {"ws": [jnp.ones(2), jnp.ones(2)]})
      ... except ValueError as e:
      ...     print(str(e).splitlines()[0][:80])
      The optimizer state was made for a model of another structure: its moment mu dif
    """
    who = _identity(init)
    key, fits = cached(_FITS, (_signature(inner), _signature(grads), who))
    if fits:
        return
    fresh = None if init is None else _fresh_state(init, grads if params is None else params, who)
    expected = {} if fresh is None else {(where, f): m for where, f, m in _moments(fresh)}
    for where, name, moment in _moments(inner):
        found = _moment_misfit(grads, moment, name, expected.get((where, name), _UNKNOWN), fresh is not None)
        if found is not None:
            path, detail, kind = found
            raise ValueError(_MESSAGES[kind].format(moment=name, path=path, detail=detail))
    if fresh is not None:
        _check_made_here(inner, fresh)
        _check_fresh_shapes(inner, fresh, grads)
    if key is not None and (init is None or who is not None):
        bounded_put(_FITS, key, True)


def check_redefined(inner: Any, grads: Any) -> None:
    """:data:`STATE_CLASS_REDEFINED` where a moment tree of ``inner`` holds a model class
    that was defined again since (one module and qualified name, the same leaves): what a
    bare transformation's failed update is read for. Other misfits are left to its error."""
    for _, name, moment in _moments(inner):
        found = _first_misfit(grads, moment, name)
        if found is not None and found[2] == "redefined":
            raise ValueError(STATE_CLASS_REDEFINED.format(path=found[0], detail=found[1]))


_UNKNOWN = object()  # no fresh state to compare with (no ``init`` given, or its eval_shape failed)


def _moment_misfit(grads: Any, moment: Any, name: str, fresh: Any, known: bool) -> tuple[str, str, str] | None:
    """Where ``moment`` does not fit: the gradients, or the fresh state's moment ``fresh``
    where that is not per-parameter (it does not fit the gradients itself). A moment the
    fresh state lacks (another optimizer's) is left to :func:`_check_made_here`."""
    if fresh is _UNKNOWN:
        return None if known else _first_misfit(grads, moment, name)
    if _first_misfit(grads, fresh, name) is None:  # per-parameter: the named checks
        return _first_misfit(grads, moment, name)
    return _first_other_shape(fresh, moment)


def _first_other_shape(fresh: Any, moment: Any) -> tuple[str, str, str] | None:
    """The first key path where ``moment`` differs from the fresh state's ``fresh`` in
    structure or a leaf's shape (a moment not shaped like the parameters)."""
    f_paths, f_def = jax.tree_util.tree_flatten_with_path(fresh)
    m_leaves, m_def = jax.tree.flatten(moment)
    if f_def != m_def:
        return "<root>", f"a state made for this model has {_describe(fresh)}, the given {_describe(moment)}", "structure"
    for (path, f), m in zip(f_paths, m_leaves):
        if np.shape(f) != np.shape(m):
            detail = f"a state made for this model has a moment of shape {np.shape(f)} there, the given {np.shape(m)}"
            return dotted_name(path) or "<root>", detail, "structure"
    return None


_FRESH: dict[Any, Any] = {}  # (the transform's init, the parameters' signature) -> its state's shapes


def _identity(init: Any) -> Any:
    """A cache key's part for ``init`` (by identity, held weakly); None where there is none."""
    if init is None:
        return None
    try:
        return WeakIdentity(init)
    except TypeError:  # an init taking no weak reference: checked, never cached
        return None


def _fresh_state(init: Any, params: Any, who: Any) -> Any:
    """``init(params)``'s shapes as :meth:`Optimizer.init` stores them (functree transforms'
    contexts released), or None where ``init`` cannot run on shapes alone."""
    leaves, treedef = jax.tree.flatten(params, is_leaf=is_none)
    key, fresh = cached(_FRESH, (who, treedef, tuple(None if x is None else (np.shape(x), jnp.result_type(x))
                                                      for x in leaves)))
    if fresh is None:
        try:
            with jax.numpy_dtype_promotion("standard"):  # as Optimizer.init: optax mixes floats and ints
                fresh = (release_contexts(jax.eval_shape(init, params)),)
        except Exception:  # an init reading its parameters' values: only the named moment checks run
            fresh = (None,)
        if key is not None and who is not None:
            bounded_put(_FRESH, key, fresh)
    return fresh[0]


def _check_made_here(inner: Any, fresh: Any) -> None:
    """:data:`STATE_OF_ANOTHER_OPTIMIZER` at the first node where ``inner`` and ``fresh``
    differ (type, fields or static values). A difference at a functree transform's own
    state (other hyperparameter names) or in a group's state is left to that transform's
    update, whose message names the hyperparameters or the group."""
    if jax.tree.structure(inner) == jax.tree.structure(fresh):
        return
    found = _first_other_node(inner, fresh)
    if found is None:
        return
    path, given, expected = found
    redefined = _redefined(expected, given, lambda a, b: a == b)
    if redefined is not None:  # a model class defined again, held outside the moments (an EMA, SAM's cache)
        raise ValueError(STATE_CLASS_REDEFINED.format(path=dotted_name(path) or "<root>", detail=redefined))
    if _left_to_the_transform(given, expected, path, inner, fresh):
        return
    settable = _SET_INSTEAD if any(_settable(x) for x in jax.tree.leaves(inner, is_leaf=_settable)) else ""
    raise ValueError(STATE_OF_ANOTHER_OPTIMIZER.format(path=dotted_name(path) or "<root>", given=_node(given),
                                                       expected=_node(expected), settable=settable))


def _check_fresh_shapes(inner: Any, fresh: Any, grads: Any) -> None:
    """:data:`STATE_MISMATCH` at the first leaf of ``inner`` whose shape is not the fresh
    state's, where the two have one tree definition: per-parameter state under names the
    moment checks do not read (lookahead's slow weights, schedule-free's ``z``, ``optax.ema``'s
    average, Adan's ``m``/``v``/``n``, Prodigy's) would otherwise broadcast an old model's
    shapes into the new one's. Named by the state's field and the parameter's key path."""
    if jax.tree.structure(inner) != jax.tree.structure(fresh):
        return  # (another optimizer's: _check_made_here's, or left to the transform)
    given = jax.tree_util.tree_flatten_with_path(inner)[0]
    for (path, x), f in zip(given, jax.tree.leaves(fresh)):
        if np.shape(x) != np.shape(f):
            field, where = _state_and_parameter(path, grads)
            detail = f"the state holds shape {np.shape(x)} where a state made for this model holds {np.shape(f)}"
            raise ValueError(STATE_MISMATCH.format(moment=field, path=where, detail=detail))


def _state_and_parameter(path: tuple[Any, ...], grads: Any) -> tuple[str, str]:
    """A state leaf's key path split into the state's part (``inner.0.slow``) and the
    parameter's (``head.weight``): the longest tail that is a key path of ``grads``."""
    params = {tuple(p) for p, _ in jax.tree_util.tree_flatten_with_path(grads)[0]}
    for i in range(len(path)):
        if tuple(path[i:]) in params:
            return dotted_name(path[:i]) or "<root>", dotted_name(path[i:]) or "<root>"
    return dotted_name(path) or "<root>", "<root>"


def _first_other_node(inner: Any, fresh: Any) -> tuple[tuple[Any, ...], Any, Any] | None:
    """``(key path, given node, fresh node)`` at the first node where the two trees differ,
    other than where this optimizer's transform keeps no state (``optax.EmptyState``: a
    learning rate that was a schedule and is now a number), whose update ignores what the
    old state holds there and returns its own, as the fresh state's."""
    stack: list[tuple[tuple[Any, ...], Any, Any]] = [((), inner, fresh)]
    while stack:
        path, g, f = stack.pop()
        if isinstance(f, optax.EmptyState):  # stateless here (a schedule -> a number): its update drops the old state
            continue
        g_node, g_children = _one_level(g)
        f_node, f_children = _one_level(f)
        if g_node != f_node:
            return path, g, f
        stack.extend((path + (k,), gc, fc) for (k, gc), (_, fc) in reversed(list(zip(g_children, f_children))))
    return None


def _is_hyper(x: Any) -> bool:
    return type(x).__name__ == "HyperState" and (type(x).__module__ or "").startswith("functree")


def release_contexts(inner: Any) -> Any:
    """``inner`` with every functree transform's own context removed (the optimizer owns one)."""
    return jax.tree.map(lambda x: x.replace(context=None) if _is_hyper(x) else x, inner, is_leaf=_is_hyper)


def group_kinds(state: Any) -> tuple[Any, ...]:
    """What a group's state was made by: its node types, and each functree optimizer's
    stored and scheduled hyperparameter names (static: read from tree definitions)."""
    found = [("HyperState", x.names, x.scheduled_names)
             for x in jax.tree.leaves(state, is_leaf=_is_hyper) if _is_hyper(x)]
    top = state
    while hasattr(top, "inner_state"):  # optax.masked's wrapper, ft.optim.masked's
        top = top.inner_state
    return (type(top).__name__, *found)


def _settable(x: Any) -> bool:
    """A node whose hyperparameters ``ft.optim.set_hyperparameters`` sets: functree's, optax.inject_hyperparams'."""
    return _is_hyper(x) or isinstance(x, (optax.InjectHyperparamsState, optax.InjectStatefulHyperparamsState))


def _left_to_the_transform(given: Any, expected: Any, path: tuple[Any, ...], inner: Any, fresh: Any) -> bool:
    """Whether a named check downstream raises for this difference: a functree transform's
    (two HyperStates of other hyperparameter names) or ``ft.optim.groups``' (a group's
    state of another kind)."""
    if _is_hyper(given) and _is_hyper(expected):
        return True
    for depth in range(len(path) + 1):
        g, f = _at(inner, path[:depth]), _at(fresh, path[:depth])
        g_states, f_states = getattr(g, "inner_states", None), getattr(f, "inner_states", None)
        if isinstance(g_states, dict) and isinstance(f_states, dict):
            given_kinds = {k: group_kinds(v) for k, v in g_states.items()}
            if any(given_kinds.get(k, ("missing state",)) != group_kinds(v) for k, v in f_states.items()):
                return True
    return False


def _at(tree: Any, path: tuple[Any, ...]) -> Any:
    for k in path:
        tree = dict(_one_level(tree)[1])[k]
    return tree


def _node(x: Any) -> str:
    """A node in a few words: its type, and a HyperState's hyperparameter names."""
    if _is_hyper(x):
        return f"a HyperState (hyperparameters {', '.join(x.names) or 'none'}; scheduled {', '.join(x.scheduled_names) or 'none'})"
    if hasattr(x, "_fields"):
        name = type(x).__name__
        return f"{'an' if name[:1] in 'AEIOU' else 'a'} {name} (fields {', '.join(x._fields) or 'none'})"
    return _describe(x)


_MESSAGES = {"structure": STATE_MISMATCH, "static": STATE_STATIC_CHANGED, "redefined": STATE_CLASS_REDEFINED, "untrained": STATE_WITHOUT_MOMENT,
             "not_trained_here": STATE_FOR_ALL_PARAMETERS}


def _is_moment_state(x: Any) -> bool:
    """An optax or functree state holding moments: a user's own state class may name a field
    ``mu`` for something else (a running mean of the gradient norm: a scalar), so only the
    libraries' classes, whose fields are known to be per-parameter, are read."""
    if not isinstance(x, tuple) or not moment_fields(x):
        return False
    return (getattr(type(x), "__module__", "") or "").split(".", 1)[0] in ("optax", "functree")


def _moments(inner: Any) -> list[tuple[Any, str, Any]]:
    """The moment trees of ``inner``, each with its state's key path and its field name;
    an :class:`ft.optim.AverageState`'s averaged parameters (ASGD's, ``average=``'s) are
    one: an average of another model's shapes would broadcast into the new one's."""
    nodes, _ = jax.tree_util.tree_flatten_with_path(inner, is_leaf=lambda x: _is_moment_state(x) or _is_average(x))
    return [(path, f, getattr(node, f)) for path, node in nodes
            for f in (("average",) if _is_average(node) else moment_fields(node) if _is_moment_state(node) else ())]


def _is_average(x: Any) -> bool:
    """functree's :class:`AverageState` (by name: ``_average`` imports this module, through ``_hyper``)."""
    return type(x).__name__ == "AverageState" and type(x).__module__ == "functree.optim._average"


def _one_level(x: Any) -> tuple[Any, list[tuple[Any, Any]]]:
    """``x``'s node (its one-level tree definition: type, static data, arity) and its
    children with their keys; a leaf's node is JAX's leaf, with no children."""
    children, node = jax.tree_util.tree_flatten_with_path(x, is_leaf=lambda y: y is not x)
    if node == _LEAF:
        return node, []
    return node, [(path[0], child) for path, child in children]


_LEAF = jax.tree.structure(0)


def _first_misfit(grads: Any, moment: Any, name: str) -> tuple[str, str, str] | None:
    """The first key path (dotted) where moment ``name``'s tree ``moment`` does not fit
    ``grads``: ``(path, what each has, kind)``, the kind choosing the message.

    As ``jax.tree.map(f, grads, moment)`` (optax's form) reads them: ``grads`` is the
    prefix, so at a gradient leaf any moment subtree but ``None`` fits (SM3's per-axis
    accumulators, a complex parameter's :class:`RealPair`); a moment leaf's shape must fit
    its gradient's (:func:`_shape_fits`)."""
    stack: list[tuple[tuple[Any, ...], Any, Any]] = [((), grads, moment)]
    while stack:
        path, g, m = stack.pop()
        if isinstance(m, optax.MaskedNode):  # a masked parameter's place
            continue
        where = dotted_name(path) or "<root>"
        g_node, g_children = _one_level(g)
        m_node, m_children = _one_level(m)
        if g_node == _LEAF:
            if m is None:  # optax would multiply the gradient by None, deep inside
                return where, f"the gradient has shape {np.shape(g)}, the state no moment", "untrained"
            if m_node == _LEAF and not _shape_fits(name, np.shape(g), np.shape(m)):
                return where, f"the gradient has shape {np.shape(g)}, the moment {np.shape(m)}", "structure"
            continue
        if g is None and m_node == _LEAF:  # a parameter with moments that this optimizer does not train
            return where, f"the state has a moment of shape {np.shape(m)}, the gradients none", "not_trained_here"
        if g_node != m_node:
            redefined = _redefined(g, m, lambda a, b: _shape_fits(name, a, b))
            if redefined is not None:
                return where, redefined, "redefined"
            changed = _static_change(g, m)
            if changed is not None:
                return where, changed, "static"
            return where, _node_difference(g, m), "structure"
        stack.extend((path + (k,), gc, mc) for (k, gc), (_, mc) in reversed(list(zip(g_children, m_children))))
    return None


def _redefined(g: Any, m: Any, fits: Callable[[tuple[int, ...], tuple[int, ...]], bool]) -> str | None:
    """``"the gradients have a __main__.Net defined after the state's ..."`` when the nodes
    ``g`` (the model's side) and ``m`` (the state's) are of two classes with one module and
    qualified name (a class statement run again) whose leaves have the same key paths, in
    order, and shapes that ``fits(gradient's, state's)``: the state's leaves map one to one
    onto the model's. Else None."""
    a, b = type(g), type(m)
    if a is b or (a.__module__, a.__qualname__) != (b.__module__, b.__qualname__):
        return None
    g_leaves = jax.tree_util.tree_flatten_with_path(g)[0]
    m_leaves = jax.tree_util.tree_flatten_with_path(m)[0]
    if [p for p, _ in g_leaves] != [p for p, _ in m_leaves]:
        return None
    if not all(fits(np.shape(x), np.shape(y)) for (_, x), (_, y) in zip(g_leaves, m_leaves)):
        return None
    name = f"{a.__module__}.{a.__qualname__}"
    return (f"the model has a {name} of the class defined now, the state one of the earlier class "
            f"{name} ({len(g_leaves)} leaves, at the same key paths, of the same shapes)")


def _static_change(g: Any, m: Any) -> str | None:
    """``"the field 'remat' is True in the model, False in the state's"`` when the nodes ``g``
    and ``m`` are dataclasses of one type whose children line up and one of their
    non-array fields differs (a static value changed after ``init``); else None."""
    if type(g) is not type(m) or not dataclasses.is_dataclass(g):
        return None
    shapes = [[np.shape(x) for x in jax.tree.leaves(t) if hasattr(x, "shape")] for t in (g, m)]
    if shapes[0] != shapes[1]:  # a parameter added or reshaped too: the moments do not carry over
        return None
    for name, a, b in _differing_fields(g, m)[:1]:
        return f"the field {name!r} is {_short(a)} in the model, {_short(b)} in the state's"
    return None


def _differing_fields(g: Any, m: Any) -> list[tuple[str, Any, Any]]:
    """The non-array fields of the dataclass nodes ``g`` and ``m`` (one type) that differ."""
    found = []
    for f in dataclasses.fields(g):
        a, b = getattr(g, f.name, None), getattr(m, f.name, None)
        if any(hasattr(x, "shape") for x in jax.tree.leaves([a, b])):  # parameters: compared elsewhere
            continue
        try:
            same = bool(a == b)
        except Exception:  # a value without a plain == (an array-like static)
            same = a is b
        if not same:
            found.append((f.name, a, b))
    return found


def _node_difference(g: Any, m: Any) -> str:
    """What tells the nodes ``g`` (the gradients') and ``m`` (the state's) apart, for
    :data:`STATE_MISMATCH`: their static values where one class holds both (an
    ``AdaptiveLogSoftmaxWithLoss`` of 60 classes, the state's of 50), else each described."""
    if type(g) is type(m) and dataclasses.is_dataclass(g):
        differing = _differing_fields(g, m)
        if differing:
            ours = ", ".join(f"{n}={_short(a)}" for n, a, _ in differing)
            theirs = ", ".join(f"{n}={_short(b)}" for n, _, b in differing)
            return f"the gradients have {_article(type(g).__name__)} with {ours}, the state one with {theirs}"
    return f"the gradients have {_describe(g)}, the state {_describe(m)}"


def _article(name: str) -> str:
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


def _short(x: Any) -> str:
    return getattr(x, "__name__", None) or repr(x)[:60]


def _describe(x: Any) -> str:
    if x is None:
        return "None"
    if isinstance(x, dict):
        return f"a dict with keys {sorted(map(str, x))}"
    if isinstance(x, (list, tuple)) and not hasattr(x, "_fields"):
        return f"a {type(x).__name__} of length {len(x)}"
    if _one_level(x)[0] == _LEAF:
        return f"a leaf of shape {np.shape(x)}"
    return f"{_article(type(x).__name__)} node (other fields or static values)"


def checked_gradients(grads: Any, params: Any) -> tuple[Any, Any]:
    """``(grads, partial)``: grads with zeros where a parameter has a ``None`` gradient and a
    narrower floating gradient widened to its parameter's dtype (:func:`check_gradients`),
    and the positions of the parameters without one (``None`` when every parameter has a
    gradient)."""
    if params is None:
        return grads, None
    missing, narrower = check_gradients(grads, params)
    if not any(missing) and not any(narrower):
        return grads, None
    g_leaves, treedef = jax.tree.flatten(grads, is_leaf=is_none)
    p_leaves = jax.tree.leaves(params, is_leaf=is_none)
    filled = treedef.unflatten([jnp.zeros_like(p) if m else g.astype(p.dtype) if n else g
                                for g, p, m, n in zip(g_leaves, p_leaves, missing, narrower)])
    return filled, (jax.tree.structure(params, is_leaf=is_none), tuple(missing)) if any(missing) else None


def _unit(x: Any) -> bool:
    return x is None or isinstance(x, RealPair)


def _place(x: Any) -> bool:
    """A parameter's place in a state's per-parameter tree: its moment, or ``optax.MaskedNode``
    where a group's state (``ft.optim.groups``) holds another group's parameter."""
    return _unit(x) or isinstance(x, optax.MaskedNode)


def keep_unchanged(partial: tuple[Any, tuple[bool, ...]], updates: Any, new_inner: Any,
                   old_inner: Any) -> tuple[Any, Any]:
    """No update for parameters without a gradient: ``None`` updates, their moments as they were
    (a complex parameter's moment is a :class:`RealPair`: one unit, as the parameter).

    An entry of ``partial`` may be a boolean member array (a stacked leaf partly frozen by
    ``Optimizer(wrt="h.2.*")``): those members only.

    A state that holds moments of parameters without a gradient only (the state of an
    ``ft.optim.groups`` group whose parameters all have ``None`` gradients) is kept whole,
    its step count too: that group's optimizer does not step, as torch's Adam counts each
    parameter's own steps. One optimizer's state shares its count among its parameters
    (optax's), so it advances while any of them has a gradient."""
    treedef, missing = partial

    def per_parameter(x: Any) -> bool:
        return jax.tree.structure(x, is_leaf=_place) == treedef

    def idle(x: Any) -> bool:
        """``x`` holds per-parameter trees, each only at parameters without a gradient."""
        trees = [t for t in jax.tree.leaves(x, is_leaf=per_parameter) if per_parameter(t)]
        return bool(trees) and not per_parameter(x) and all(
            isinstance(p, optax.MaskedNode) or (isinstance(m, (bool, np.bool_)) and bool(m))
            for t in trees for p, m in zip(jax.tree.leaves(t, is_leaf=_place), missing))

    def keep(new: Any, old: Any) -> Any:
        if not per_parameter(new):
            return old if idle(new) else new
        news, olds = jax.tree.leaves(new, is_leaf=_place), jax.tree.leaves(old, is_leaf=_place)
        return treedef.unflatten([_kept(n, o, m) for n, o, m in zip(news, olds, missing)])

    inner = jax.tree.map(keep, new_inner, old_inner, is_leaf=lambda x: per_parameter(x) or idle(x))
    leaves = jax.tree.leaves(updates, is_leaf=is_none)
    updates = treedef.unflatten([_no_update(u, m) for u, m in zip(leaves, missing)])
    return updates, inner


def _kept(new: Any, old: Any, m: Any) -> Any:
    """``old`` where ``m`` (a bool, or a member array of a partly frozen stacked leaf)."""
    if not isinstance(m, np.ndarray):
        return old if m else new
    if isinstance(new, RealPair):  # a complex parameter's moment: each half
        return RealPair(_kept(new.real, old.real, m), _kept(new.imag, old.imag, m))
    if new is None or np.ndim(new) < m.ndim or np.shape(new)[: m.ndim] != m.shape:
        return new  # a state leaf not shaped like its parameter (a count, a factored moment)
    return jnp.where(m.reshape(m.shape + (1,) * (np.ndim(new) - m.ndim)), old, new)


def _no_update(u: Any, m: Any) -> Any:
    """None where ``m``; ``-0.0`` at the frozen members of a member array (``w + -0.0 == w``
    bit for bit, whatever ``w``)."""
    if not isinstance(m, np.ndarray):
        return None if m else u
    return jnp.where(m.reshape(m.shape + (1,) * (np.ndim(u) - m.ndim)), jnp.asarray(-0.0, u.dtype), u)


def _complex(g: Any) -> bool:
    dtype = getattr(g, "dtype", None)
    return dtype is not None and dtype.kind == "c"


def descent_direction(grads: Any) -> Any:
    """``grads`` (``ft.gradient``'s convention, JAX's) in the convention of optax and
    torch.optim: the conjugate at complex leaves, real leaves as they are.

    For a real loss ``L`` of ``z = x + iy``, JAX's gradient is ``∂L/∂x − i ∂L/∂y``, the
    conjugate of the steepest-ascent direction ``∂L/∂x + i ∂L/∂y`` that an optimizer
    steps against (torch's ``z.grad``; optax expects it too). ``ft.optim.Optimizer``
    conjugates here, once, where gradients enter the transform; a model without complex
    parameters pays one pass over the dtypes, at trace time under jit.

    Example:
      >>> import jax.numpy as jnp
      >>> descent_direction({"z": jnp.array(1 - 2j, jnp.complex64), "w": jnp.ones(())})
      {'w': Array(1., dtype=float32), 'z': Array(1.+2.j, dtype=complex64)}
    """
    if not any(_complex(g) for g in jax.tree.leaves(grads)):
        return grads
    return jax.tree.map(lambda g: jnp.conj(g) if _complex(g) else g, grads)


GRADIENT_AS_UPDATE = """\
The optimizer's transform returned the gradient itself as the update of {paths} ({count} of \
{total} parameters), and the update is added to the parameter: p + g, a step up the loss with \
rate 1. optax.masked (and ft.optim.masked) passes the leaves its mask leaves out through \
unchanged: it is for a part of a chain (a weight decay on some parameters), not for choosing \
which parameters train (optax.identity() as a group's transform is the same step).

    wrong:  ft.optim.Optimizer(optax.masked(optax.adam(1e-3), mask))      # the others: p + g
    right:  ft.optim.Optimizer(optax.adam(1e-3), wrt="head.*")            # the others frozen
       or:  ft.optim.Optimizer(ft.optim.groups({{"head.*": optax.adam(1e-3)}}, default=ft.optim.freeze()))"""


def check_not_passed_through(grads: Any, updates: Any) -> None:
    """Raise :data:`GRADIENT_AS_UPDATE` if an update leaf is its gradient leaf, the same
    object: the transform left that parameter's gradient as it came (``optax.masked``'s
    pass-through at the end of the optimizer), which ``apply_updates`` would add: a step up
    the loss. Every transform that moves a parameter down makes a new array (``-lr * g``);
    read while the step traces (identity of tracers), so no work per compiled call."""
    gs, ups = jax.tree.leaves(grads, is_leaf=is_none), jax.tree.leaves(updates, is_leaf=is_none)
    if len(ups) != len(gs) or not any(g is not None and u is g for g, u in zip(gs, ups)):
        return  # (another structure: named elsewhere, by the state's and gradients' checks)
    flat = jax.tree_util.tree_flatten_with_path(grads, is_leaf=is_none)[0]  # key paths for the message only
    same = [dotted_name(path) for (path, g), u in zip(flat, ups) if g is not None and u is g]
    if same:
        shown = ", ".join(same[:4]) + (f" and {len(same) - 4} more" if len(same) > 4 else "")
        total = sum(g is not None for g in gs)
        raise ConfigurationError(GRADIENT_AS_UPDATE.format(paths=shown, count=len(same), total=total))
