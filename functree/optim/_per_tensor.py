"""The refusal of an optax per-tensor statistic over an ``ft.nn.Stack``'s stacked leaves.

A leaf of an ``ft.nn.Stack`` holds its ``n`` members on axis 0; optax takes it as one
tensor. Where a transform computes a statistic per tensor (a norm, an RMS, a factoring by
shape, an orthogonalisation) the Stack then trains otherwise than its blocks unrolled, with
no error: measured, 5 steps on a 3-block Stack come apart from the unrolled blocks' by this
share of the parameters' change: LARS 0.06 %, Adafactor 1.5 %, LAMB 2.3 %,
``clip_by_block_rms`` 23 %. :meth:`ft.optim.Optimizer.init`, where functree first sees a
transform with its parameters, refuses it (:data:`PER_TENSOR_ON_STACK`) when the
parameters hold a Stack and the transform holds a known per-tensor transform outside
``ft.optim.per_member`` (exact: each member its own tensor) and ``ft.optim.whole_stack``
(the stacked leaf's statistic, on purpose).

How a per-tensor transform is seen:

* by its update function (:data:`PER_TENSOR_FUNCTIONS`): optax builds every transform as
  closures, and the walk over the closure cells from the Optimizer's transform (chains,
  masks, partitions, ``inject_hyperparams``' factory, ``MultiSteps``' inner optimizer)
  finds ``scale_by_trust_ratio``'s update inside ``optax.lamb``, ``lars`` and
  ``fromage``, and the stateless ones (``clip_by_block_rms``, ``centralize``,
  ``scale_by_param_block_rms``), which no state shows;
* by its state's type (:data:`PER_TENSOR_STATES`): adafactor's ``FactoredState``,
  NovoGrad's, SM3's, layer-wise DoG's, Muon's and GaLore's, for a transform the walk cannot
  open (a class whose update is no closure). ``optax.ScaleByTrustRatioState`` is
  ``optax.EmptyState``, which every stateless transform returns: LAMB and LARS are seen
  by their update alone.

Not seen: a per-tensor transform of another library, or one written by hand; a transform
used without ``ft.optim.Optimizer`` (``tx.init(model)`` straight from optax, which
functree never sees). ``ft.optim.clip_by_norm`` and ``clip_per_sample`` already take each
member's norm.
"""

from __future__ import annotations

import functools
import types
from typing import Any

import jax

from functree._stacked import is_stacked, outermost
from functree.optim._per_member import STACK_CHOICE, PerMemberState, WholeStackState

__all__ = ["PER_TENSOR_ON_STACK", "PER_TENSOR_FUNCTIONS", "PER_TENSOR_STATES", "check_stack_statistics"]

PER_TENSOR_ON_STACK = """\
The optimizer's transform takes a statistic per tensor: {found}. The parameters hold an \
ft.nn.Stack at {path!r} whose every leaf stacks its {n} members on axis 0, and optax takes \
such a leaf as one tensor: the statistic would span all {n} members, where the blocks unrolled \
have one each, and train to other numbers without an error (5 steps on a 3-block Stack, apart \
from the unrolled blocks by this share of the parameters' change: LARS 0.06 %, Adafactor \
1.5 %, LAMB 2.3 %, clip_by_block_rms 23 %). Give each member its own statistic with \
ft.optim.per_member (the unrolled blocks' numbers, the state stacked as the parameters), or \
unroll the blocks; ft.optim.whole_stack keeps one statistic per stacked leaf, on purpose (or \
where the transform never reaches the Stack's leaves):

    wrong:  ft.optim.Optimizer({example})
    right:  ft.optim.Optimizer(ft.optim.per_member({example}))
       or:  {unroll}   # an ft.nn.Sequential of the members
       or:  ft.optim.Optimizer(ft.optim.whole_stack({example}))"""

# optax's functions computing a statistic per tensor: the name of the function building
# the transform (its update is ``<name>.<locals>.update_fn``), or of an optimizer that
# holds one (``inject_hyperparams(optax.lamb)`` keeps the factory): what it computes, and
# an optimizer built with it for the error's example.
_TRUST = ("the trust ratio ‖w‖ / ‖u‖ of optax.scale_by_trust_ratio (in optax.lamb, optax.lars, "
          "optax.fromage)", "optax.lamb(1e-3)")
_FACTORED = ("Adafactor's second moments, factored by each tensor's shape, and its update "
             "clipping by each tensor's RMS (optax.adafactor)", "optax.adafactor(1e-3)")
_MUON = ("Muon's orthogonalisation of each matrix (optax.contrib.muon: it gives a 3-D stacked "
         "leaf to AdamW instead)", "optax.contrib.muon(1e-3)")
_GALORE = ("GaLore's low-rank projection of each matrix (optax.contrib.galore: it leaves a 3-D "
           "stacked leaf unprojected)", "optax.contrib.galore(1e-3)")
PER_TENSOR_FUNCTIONS: dict[str, tuple[str, str]] = {
    "scale_by_trust_ratio": _TRUST, "lamb": _TRUST, "lars": _TRUST, "fromage": _TRUST,
    "scale_by_factored_rms": _FACTORED, "adafactor": _FACTORED,
    "clip_by_block_rms": ("optax.clip_by_block_rms's u / max(1, rms(u) / t) per tensor",
                          "optax.chain(optax.clip_by_block_rms(1.0), optax.adam(1e-3))"),
    "scale_by_param_block_rms": ("optax.scale_by_param_block_rms's scale rms(w) per tensor",
                                 "optax.chain(optax.adam(1e-3), optax.scale_by_param_block_rms())"),
    "scale_by_param_block_norm": ("optax.scale_by_param_block_norm's scale ‖w‖ per tensor",
                                  "optax.chain(optax.adam(1e-3), optax.scale_by_param_block_norm())"),
    "scale_by_novograd": ("NovoGrad's second moment of ‖g‖² per tensor (optax.novograd)", "optax.novograd(1e-3)"),
    "novograd": ("NovoGrad's second moment of ‖g‖² per tensor (optax.novograd)", "optax.novograd(1e-3)"),
    "scale_by_sm3": ("SM3's accumulators over each tensor's axes (optax.sm3)", "optax.sm3(1e-3)"),
    "sm3": ("SM3's accumulators over each tensor's axes (optax.sm3)", "optax.sm3(1e-3)"),
    "scale_by_distance_over_gradients": ("layer-wise DoG's step size per tensor "
                                         "(optax.scale_by_distance_over_gradients)",
                                         "optax.scale_by_distance_over_gradients()"),
    "adaptive_grad_clip": ("adaptive gradient clipping's unit-wise norms, chosen by each tensor's rank "
                           "(optax.adaptive_grad_clip)", "optax.chain(optax.adaptive_grad_clip(0.01), optax.sgd(1e-3))"),
    "centralize": ("optax.centralize's mean over each tensor's axes after the first",
                   "optax.chain(optax.centralize(), optax.sgd(1e-3))"),
    "scale_by_muon": _MUON, "muon": _MUON,
    "scale_by_galore": _GALORE, "galore": _GALORE,
}

# optax's state types that only a per-tensor transform keeps (by class name: some are not
# exported), with the function they stand for in PER_TENSOR_FUNCTIONS.
PER_TENSOR_STATES: dict[str, str] = {
    "FactoredState": "scale_by_factored_rms",
    "ScaleByNovogradState": "scale_by_novograd",
    "ScaleBySM3State": "scale_by_sm3",
    "ScaleByDistanceOverGradientsState": "scale_by_distance_over_gradients",
    "MuonState": "scale_by_muon",
    "GaLoreState": "scale_by_galore",
}

_DEPTH = 24  # closures nest one level per wrapper: chain, masked, partition, inject ...


def _optax_name(fn: Any) -> str | None:
    """The key of :data:`PER_TENSOR_FUNCTIONS` that ``fn`` (an optax function) is, or None."""
    if not str(getattr(fn, "__module__", "")).startswith("optax"):
        return None
    head = str(getattr(fn, "__qualname__", "")).split(".<locals>")[0]
    return head if head in PER_TENSOR_FUNCTIONS else None


def _reachable(value: Any) -> list[Any]:
    """The functions and objects a closure cell's ``value`` leads to: a transformation's
    update, the items of a tuple, list or dict (optax.chain keeps its functions in a
    tuple), a partial's function and arguments."""
    if isinstance(value, (tuple, list)) and not hasattr(value, "update"):
        return [f for v in value for f in _reachable(v)]
    if isinstance(value, dict):
        return [f for v in value.values() for f in _reachable(v)]
    if isinstance(value, functools.partial):
        return [value.func, *_reachable(list(value.args)), *_reachable(value.keywords)]
    update = getattr(value, "update", None)
    if callable(update) and hasattr(value, "init"):
        return [update]
    return [value] if isinstance(value, (types.FunctionType, types.MethodType)) else []


def _found_in_functions(fn: Any, seen: set[int], depth: int = 0) -> str | None:
    """The first per-tensor optax function reachable from ``fn`` through closure cells (and a
    bound method's object: ``optax.MultiSteps.update``), not inside ``per_member`` or
    ``whole_stack``; None if there is none."""
    if depth > _DEPTH or id(fn) in seen or getattr(fn, STACK_CHOICE, None) is not None:
        return None
    seen.add(id(fn))
    name = _optax_name(fn)
    if name is not None:
        return name
    # A bound method's object holds the transforms (MultiSteps' inner optimizer), a
    # function's closure cells hold what it was built from.
    owner = fn.__self__ if isinstance(fn, types.MethodType) else None
    values: list[Any] = list(vars(owner).values()) if hasattr(owner, "__dict__") else []
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            values.append(cell.cell_contents)
        except ValueError:  # an empty cell
            continue
    for value in values:
        for f in _reachable(value):
            found = _found_in_functions(f, seen, depth + 1)
            if found is not None:
                return found
    return None


def _is_state_node(x: Any) -> bool:
    return isinstance(x, (PerMemberState, WholeStackState)) or _state_name(x) is not None


def _state_name(x: Any) -> str | None:
    kind = type(x)
    if not str(kind.__module__).startswith("optax"):
        return None
    return PER_TENSOR_STATES.get(kind.__name__)


def _found_in_state(inner: Any) -> str | None:
    """The function a per-tensor state type in ``inner`` stands for, outside the states of
    ``per_member`` and ``whole_stack``; None if there is none."""
    for node in jax.tree.leaves(inner, is_leaf=_is_state_node):
        name = _state_name(node)
        if name is not None:
            return name
    return None


def _stacks(params: Any) -> list[tuple[str, Any]]:
    """``[(dotted name, stack)]`` of the outermost stacks of ``params`` holding a parameter
    (a Stack that ``wrt=`` leaves out entirely is no transform's business)."""
    return [(name, s) for name, s in outermost(params) if is_stacked(s) and jax.tree.leaves(s)]


def check_stack_statistics(transform: Any, inner: Any, params: Any) -> None:
    """:data:`PER_TENSOR_ON_STACK` where ``params`` holds an ``ft.nn.Stack`` and
    ``transform`` (or its state ``inner``) a known per-tensor optax transform outside
    ``ft.optim.per_member`` and ``ft.optim.whole_stack``.

    Example:
      >>> import functree as ft, jax, optax
      >>> stack = ft.nn.Stack(lambda k: ft.nn.Dense(4, 4, key=k), 3, key=jax.random.key(0))
      >>> check_stack_statistics(optax.adam(1e-3), None, {"blocks": stack})      # elementwise
      >>> try:
      ...     check_stack_statistics(optax.lamb(1e-3), None, {"blocks": stack})
      ... except ValueError as e:
      ...     print(str(e)[:70])
      The optimizer's transform takes a statistic per tensor: the trust rati
    """
    stacks = _stacks(params)
    if not stacks:
        return
    found = _found_in_functions(getattr(transform, "update", None), set())
    if found is None:
        found = _found_in_state(inner)
    if found is None:
        return
    what, example = PER_TENSOR_FUNCTIONS[found]
    path, stack = stacks[0]
    unroll = (f"model = ft.set(model, {path!r}, ft.get(model, {path!r}).unstack())" if path
              else "model = model.unstack()")
    raise ValueError(PER_TENSOR_ON_STACK.format(found=what, path=path or "<root>", n=len(stack),
                                                example=example, unroll=unroll))
