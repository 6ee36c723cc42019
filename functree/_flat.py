"""A jitted function of pytrees called over flat leaves: the tree work done once per tree.

``jax.jit`` flattens every argument and rebuilds every result on each call; for a Module
that means a Python function per node each way (a tiny Adam step moves 12 Modules in and
12 out), which is the whole gap between a functree step and a hand-written one with dicts.
:func:`flat_jit` keeps the same function and the same compiled program but moves the tree
work out of the loop:

* the program is ``jax.jit`` of a function of the donated arguments' leaves (a tuple) and
  the other arguments as they are (JAX flattens those in C++), one per combination of
  input tree definitions; it rebuilds the arguments and flattens the result while tracing
  only (another structure of the other arguments, a loop alternating two kinds of batch,
  is traced in the same program, and kept in JAX's cache, when its results have the same
  tree definition; otherwise the call looks up the program for it);
* results are rebuilt by straight-line Python generated once per output tree definition
  (:func:`builder`): Modules and functree's state records filled without ``__init__``,
  tuples, named tuples, lists, dicts and ``None`` inline, other nodes by their own
  registered unflatten;
* an argument that *is* one of the previous call's results (a training loop passes the
  model and optimizer state back) is passed by the leaves that call returned, without
  flattening, when its tree holds no mutable container (dicts and lists could have been
  changed in place since; those are flattened again).

A loop call whose results have many nodes (:data:`PAUSE_NODES`) runs with Python's cyclic
collector paused: its allocations would otherwise start a collection inside every call.

With ``tree_when_mutable=True`` (``ft.jit``'s donating path), a call whose donated
arguments hold a dict or list, so that no later call can pass them back by their leaves,
runs ``jax.jit`` of the function itself instead, and so do all later calls: JAX flattens
dicts and lists in C++, faster than the flat program's Python flattening (16 dict leaves
and their Adam state: 74 µs a call against 87 µs).

Example:
  >>> import jax, jax.numpy as jnp
  >>> from functree._flat import flat_jit
  >>> def sgd(w, g):
  ...     return jax.tree.map(lambda a, b: a - 0.5 * b, w, g), jnp.sum(w[0])
  >>> step = flat_jit(sgd, donate=(0,))
  >>> w = (jnp.ones(2), jnp.zeros(()))
  >>> for _ in range(3):
  ...     w, total = step(w, (jnp.ones(2), jnp.ones(())))
  >>> w, total
  ((Array([-0.5, -0.5], dtype=float32), Array(-1.5, dtype=float32)), Array(0., dtype=float32))
"""

from __future__ import annotations

import dataclasses
import gc
import inspect
import operator
import re
import types
from collections.abc import Callable, Sequence
from typing import Any

import jax

from functree._alias import LAST_DONOR, is_donated_twice
from functree._tree import bounded_put, cached, dotted_name

__all__ = ["flat_jit", "FlatJit", "builder"]

_NoneType = type(None)
_gc_isenabled, _gc_disable, _gc_enable = gc.isenabled, gc.disable, gc.enable
_flatten = jax.tree_util.default_registry.flatten  # jax.tree.flatten without its Python frames


def _is_module(kind: type) -> bool:
    from functree._module import Module

    return issubclass(kind, Module)


def _one_level(treedef: Any) -> Any:
    """The tree definition of ``treedef``'s root node alone, its children as leaves."""
    root = treedef.unflatten([0] * treedef.num_leaves)
    return jax.tree.structure(root, is_leaf=lambda x: x is not root)


PAUSE_NODES = 256
"""A loop call whose results have at least this many tree nodes runs its program and builder
with Python's cyclic collector paused (on again before it returns). Each node is one tracked
allocation a call makes (an array JAX returns, an object the builder fills), all alive when
the call ends, so results of hundreds of nodes pushed the collector's first generation (700
net allocations by default) over its threshold inside every call: a collection that found
the live model and state, promoted them, and so made the collector walk the whole heap every
few hundred calls. Measured on an MLP of 200 parameter leaves with Adam (921 result nodes,
2-core AMD EPYC): 91 collections per 100 calls, 0.3M-1.1M instructions a call of collector
work (up to 15% of raw JAX's whole step; raw's own 20k); 0.2 per 100 with the pause, as raw. The call's own allocations are
freed by the next call (the donation guard drops the inputs of two calls ago), so the count
is back under the threshold when the collector is on again. Smaller results (the dispatch
family's step: 48 nodes) never pause: their fast path tests this flag only."""

PENDING = "__ft_pending__"
"""Instance-dict key of the fields built on first read: ``(((name, build), ...), leaves)``
(see ``__ft_lazy__``)."""


def builder(treedef: Any, offset: int = 0) -> Callable[[Sequence[Any]], Any]:
    """``build(leaves) == treedef.unflatten(leaves)``, as generated straight-line Python.

    Modules (their generated unflatten: ``object.__new__`` and the instance dict) and
    records registered by :func:`functree._tree.register_record` are filled inline, as
    are tuples, named tuples, lists, dicts and ``None``; any other node is rebuilt by its
    own registered unflatten (its one-level tree definition). A record class that names
    data fields in ``__ft_lazy__`` (a tuple) gets them built on first read: its instance
    dict holds ``(((name, build), ...), leaves)`` under :data:`PENDING` until then (the
    class's ``__getattr__`` builds them), so a loop that passes the record back never
    builds them (an optimizer state's learning context and moment trees: one object a
    call instead of two, and none of the trees).
    ``offset``: the index in ``leaves`` of the tree's first leaf.

    Example:
      >>> import jax
      >>> from functree._flat import builder
      >>> tree = {"a": (1, None), "b": [2, 3]}
      >>> builder(jax.tree.structure(tree))([1, 2, 3]) == tree
      True
    """
    names: dict[str, Any] = {"_new": object.__new__}
    lines: list[str] = []
    counter = [offset, 0]

    def constant(value: Any) -> str:
        name = f"_c{len(names)}"
        names[name] = value
        return name

    def emit(node: Any) -> str:
        data = node.node_data()
        if data is None:  # a leaf
            counter[0] += 1
            return f"L[{counter[0] - 1}]"
        kind, aux = data
        if kind is _NoneType:
            return "None"
        lazy = getattr(kind, "__ft_lazy__", None)
        if lazy is not None:
            return emit_lazy(node, kind, aux, lazy)
        kids = [emit(child) for child in node.children()]
        packed = "(" + "".join(k + ", " for k in kids) + ")"
        if kind is tuple:
            return packed
        if kind is list:
            return "[" + ", ".join(kids) + "]"
        if kind is dict:
            return "{" + ", ".join(f"{constant(k)}: {v}" for k, v in zip(aux, kids)) + "}"
        if issubclass(kind, tuple) and hasattr(kind, "_fields") and aux is None:  # a named tuple
            return f"{constant(kind)}{packed}"
        fields = _inline_fields(kind)
        if fields is None:
            return f"{constant(_one_level(node))}.unflatten({packed})"
        counter[1] += 1
        obj = f"o{counter[1]}"
        data_names, meta_names = fields
        entries = [*zip(data_names, kids), *((n, constant(v)) for n, v in zip(meta_names, aux))]
        lines.extend(_filled(obj, constant(kind), entries))
        return obj

    def emit_lazy(node: Any, kind: type, aux: Any, lazy: tuple[str, ...]) -> str:
        data_names, meta_names = kind.__ft_record__  # type: ignore[attr-defined]
        counter[1] += 1
        obj = f"o{counter[1]}"
        filled, parts = [], []
        for name, child in zip(data_names, node.children()):
            if name in lazy:
                parts.append((name, builder(child, counter[0])))
                counter[0] += child.num_leaves
            else:
                filled.append((name, emit(child)))
        filled.append((PENDING, f"({constant(tuple(parts))}, L)"))
        lines.extend(_filled(obj, constant(kind), filled + [(n, constant(v)) for n, v in zip(meta_names, aux)]))
        return obj

    top = emit(treedef)
    source = "def build(L):\n" + "".join(line + "\n" for line in lines) + f"    return {top}\n"
    exec(source, names)  # field names only appear as string literals
    return names["build"]


def _filled(obj: str, kind: str, entries: Sequence[tuple[str, str]]) -> list[str]:
    """Lines creating ``obj``, a bare instance of ``kind``, and setting its ``(name,
    value source)`` entries by item assignments into its instance dict. Measured with ``timeit``
    on this builder's MLP and Adam state (6 instances): 1.1-1.4 µs against 1.7-1.9 µs for
    one ``__dict__.update`` of a dict display (Python 3.11), 1.5 µs against 2.2 µs (3.12):
    fewer bytecodes, but a dict built and merged."""
    if len(entries) == 1:
        (name, value), = entries
        return [f"    {obj} = _new({kind})", f"    {obj}.__dict__[{name!r}] = {value}"]
    return [f"    {obj} = _new({kind})", f"    d = {obj}.__dict__",
            *(f"    d[{name!r}] = {value}" for name, value in entries)]


def _inline_fields(kind: type) -> tuple[tuple[str, ...], tuple[str, ...]] | None:
    """``(data fields, static fields)`` of a node filled inline, or None."""
    if _is_module(kind):
        static = kind.__ft_static__  # type: ignore[attr-defined]
        return tuple(n for n in kind.__ft_fields__ if n not in static), static  # type: ignore[attr-defined]
    return getattr(kind, "__ft_record__", None)


def _immutable(treedef: Any) -> bool:
    """Whether no node of ``treedef`` can change in place: no dict, list or unknown node."""
    data = treedef.node_data()
    if data is not None:
        kind = data[0]
        known = kind in (tuple, _NoneType) or _is_module(kind) or hasattr(kind, "__ft_record__") or (
            issubclass(kind, tuple) and hasattr(kind, "_fields")) or (
            dataclasses.is_dataclass(kind) and kind.__dataclass_params__.frozen)  # type: ignore[attr-defined]
        if not known:
            return False
    return all(_immutable(child) for child in treedef.children())


def _taker(indices: tuple[int, ...]) -> Callable[[tuple], tuple]:
    """``args -> tuple(args[i] for i in indices)`` as one C call (a slice where they are
    contiguous and ascending: ``itemgetter`` of one index would return the item, not a
    tuple)."""
    if not indices or indices == tuple(range(indices[0], indices[-1] + 1)):
        start = indices[0] if indices else 0
        return operator.itemgetter(slice(start, start + len(indices)))
    return operator.itemgetter(*indices)


def _loop_taker(nargs: int, donate: tuple[int, ...], loop: tuple[int, ...],
                gather: Callable[[Sequence[Any]], tuple]) -> Callable[[tuple, tuple, Sequence[Any]], tuple | None]:
    """``take(args, results, leaves)``: the donated leaves (``gather(leaves)``) when ``args``
    has ``nargs`` items and the one at each donated position ``donate[k]`` *is* result
    ``loop[k]`` of the previous call, else None; generated once per program as straight-line
    identity tests (no tuples built, no C calls but the gather)."""
    tests = "".join(f" and a[{i}] is r[{j}]" for i, j in zip(donate, loop))
    source = f"def take(a, r, L):\n    if len(a) == {nargs}{tests}:\n        return _gather(L)\n"
    names: dict[str, Any] = {"_gather": gather}
    exec(source, names)  # only integers are formatted into it
    return names["take"]


def _gatherer(spans: Sequence[tuple[int, int]]) -> Callable[[Sequence[Any]], tuple]:
    """``leaves -> tuple(leaves[i] for each (start, stop) in spans, start <= i < stop)`` as
    one C call (``itemgetter`` of several indices returns a tuple; of one, the item): a
    loop's donated leaves taken from the previous results' in one step, the metrics
    between the state and a train step's log skipped."""
    indices = tuple(i for start, stop in spans for i in range(start, stop))
    if len(indices) >= 2:
        return operator.itemgetter(*indices)
    return lambda leaves: tuple(leaves[i] for i in indices)


class _Program:
    """One ``jax.jit`` of the flat function, for one set of input tree definitions."""

    __slots__ = ("build", "carry", "gather", "jitted", "loop", "loops", "nargs", "other_treedef", "others",
                 "out_treedef", "parts", "passed", "pause", "several", "spans", "take")

    def __init__(self, fn: Callable[..., Any], nargs: int, donate: tuple[int, ...], donated_treedef: Any,
                 other_treedef: Any, options: dict[str, Any], owned: tuple[int, ...] = ()):
        self.other_treedef = other_treedef
        # Whether a later call can pass the donated arguments back by their leaves: each is
        # owned or holds no mutable container (read once, from the tree definitions).
        self.loops = all(i in owned or _immutable(t) for i, t in zip(donate, donated_treedef.children()))
        self.nargs = nargs
        self.passed = tuple(i for i in range(nargs) if i not in donate)
        self.others = _taker(self.passed)  # args -> the tuple of the arguments not donated
        self.parts = tuple(donated_treedef.children())  # each donated argument's tree definition
        self.build: Any = None
        self.out_treedef: Any = None
        self.several = False  # the result is a tuple (its items may be passed back one by one)
        self.pause = False  # a loop call pauses the collector (PAUSE_NODES; set with the results' tree)
        self.spans: tuple[tuple[int, int], ...] = ()  # leaves of each top-level result
        self.carry: tuple[bool, ...] = ()  # results whose leaves may be passed back as they are
        self.loop: tuple[int, ...] | None = None  # the result each donated argument is, in a loop
        # Set with ``loop``: the result leaves that are the donated leaves (the flat program
        # takes them as a tuple), and :func:`_loop_taker`'s function of the call.
        self.gather: Callable[[Sequence[Any]], tuple] = _gatherer(())
        self.take: Callable[[tuple, tuple, Sequence[Any]], tuple | None] | None = None

        def flat(donated: tuple, others: tuple) -> list[Any]:
            # ``others``: the arguments not donated, as they are (JAX flattens them in C++
            # and keys its cache on their structure). Another structure than this
            # program's (a loop alternating two kinds of batch) is traced here too, and
            # kept in JAX's cache, when its results have this program's tree definition;
            # otherwise the caller looks up the program for it (see ``_set_output``).
            restructured = jax.tree.structure(others) != other_treedef
            args: list[Any] = [None] * nargs
            for i, x in zip(donate, donated_treedef.unflatten(donated)):
                args[i] = x
            for i, x in zip(self.passed, others):
                args[i] = x
            try:
                out = fn(*args)
            except Exception as e:  # at trace time only: name leaves as the caller knows them
                _name_arguments(e, fn, (donate, donated_treedef), self.passed)
                raise
            leaves, treedef = jax.tree.flatten(out)
            if restructured and treedef != self.out_treedef:
                raise _Restructured  # results of another structure: the program for them
            self._set_output(treedef)
            return leaves

        self.jitted = jax.jit(flat, donate_argnums=(0,) if donate else (), keep_unused=True, **options)

    def _set_output(self, treedef: Any) -> None:
        if self.out_treedef is not None:
            if treedef != self.out_treedef:  # a retrace (new shapes) with another result tree
                raise TypeError(CHANGED_OUTPUT.format(before=self.out_treedef, after=treedef))
            return
        self.out_treedef, self.build = treedef, builder(treedef)
        self.pause = treedef.num_nodes >= PAUSE_NODES
        data = treedef.node_data()
        self.several = data is not None and data[0] is tuple
        parts = treedef.children() if self.several else [treedef]
        spans, start = [], 0
        for part in parts:
            spans.append((start, start + part.num_leaves))
            start += part.num_leaves
        self.spans = tuple(spans)
        self.carry = tuple(_immutable(part) for part in parts)


class _CollectorPaused:
    """Python's cyclic garbage collector off while a call off the loop's fast path runs (the
    first call: JAX traces and lowers the step, Python work that allocates hundreds of
    thousands of objects that live on in the jaxpr). With the collector on, those
    allocations start collections that walk the whole heap (the model's build leaves a large
    one), again and again: 0.11 s of the 0.37 s trace of benchmarks/_lm.py's first
    functree step when it is the first in its process. The garbage is collected at the next
    collection after the call. Only a collector this call turned off is turned on again (a
    caller that turned it off keeps it off); ``gc.disable`` and ``gc.enable`` cost 0.1 µs."""

    __slots__ = ("paused",)

    def __enter__(self) -> None:
        self.paused = gc.isenabled()
        if self.paused:
            gc.disable()

    def __exit__(self, *_: Any) -> None:
        if self.paused:
            gc.enable()


class _Restructured(Exception):
    """Raised while tracing a flat program for arguments not donated whose structure is not
    the program's and whose results have another tree definition than the program's: the
    call goes the full way (which finds or makes the right program). A structure whose
    results have the program's tree definition runs in this program (JAX keeps its trace)."""


# JAX's refusal of a call whose committed arguments lie on different devices (raised at
# dispatch, before the program runs).
_INCOMPATIBLE_DEVICES = "incompatible devices for jitted computation"

_FLAT_ARGUMENT = re.compile(r"\bdonated\[(\d+)\]")
_FLAT_OTHER = re.compile(r"\bothers\[(\d+)\]((?:\[[^\[\]]*\])*)")  # others[1][0] / others[1]['x']
_FLAT_FUNCTION = re.compile(r"the function flat at \S+_flat\.py:\d+")


def _name_arguments(error: Exception, fn: Callable[..., Any], donated: tuple[tuple[int, ...], Any],
                    passed: tuple[int, ...]) -> None:
    """Rewrite, in ``error``'s message, the flat program's argument names as the caller knows
    them, by ``fn``'s parameter names: ``donated[1]`` (JAX's name for a donated leaf) as its
    key path (``model.hidden_size``), ``others[1][0]`` (an argument not donated, passed as it
    is, and the path into it) as ``batch.0``, and ``the function flat`` as ``fn``'s name.
    ``donated``: the donated arguments' positions and tree definition; ``passed``: the
    positions of the others."""
    if not error.args or not isinstance(error.args[0], str):
        return
    message = error.args[0]
    if not (_FLAT_ARGUMENT.search(message) or _FLAT_OTHER.search(message) or _FLAT_FUNCTION.search(message)):
        return
    try:
        params = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        params = []
    if params[:1] == ["self"]:  # a class's method shared by its instances (TrainStep._logged): self is not traced
        params = params[1:]

    def base(position: int) -> str:
        return params[position] if position < len(params) else f"args[{position}]"

    positions, treedef = donated
    leaves: list[str] = []
    for position, tree in zip(positions, treedef.unflatten([0] * treedef.num_leaves)):
        for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]:
            rest = dotted_name(path)
            leaves.append(f"{base(position)}.{rest}" if rest else base(position))

    def donated_leaf(match: re.Match[str]) -> str:
        index = int(match.group(1))
        return leaves[index] if index < len(leaves) else match.group(0)

    def other(match: re.Match[str]) -> str:
        index = int(match.group(1))
        if index >= len(passed):
            return match.group(0)
        keys = [k.strip("'\"") for k in re.findall(r"\[([^\[\]]*)\]", match.group(2))]
        return ".".join([base(passed[index]), *keys])

    message = _FLAT_ARGUMENT.sub(donated_leaf, message)
    message = _FLAT_OTHER.sub(other, message)
    message = _FLAT_FUNCTION.sub(f"the function {getattr(fn, '__qualname__', 'f')}", message)
    error.args = (message, *error.args[1:])


CHANGED_OUTPUT = """\
The jitted function returned a different tree structure for the same input structure \
(traced again for new shapes or dtypes):
    before: {before}
    after:  {after}
Return the same structure for every shape, or jit one function per structure."""


class FlatJit:
    """``jax.jit(fn, donate_argnums=donate)`` called over flat leaves (see the module docstring).

    Positional calls run the flat program; keyword arguments go to ``jax.jit`` of ``fn``
    itself (the same computation), and so do ``lower``, ``trace`` and ``eval_shape``.

    ``guard`` (a :class:`functree._alias.DonationGuard`) remembers each call's results and
    inputs; ``before(args, kwargs) -> (args, kwargs)`` runs for a call whose donated
    arguments are not all the previous call's results (it checks them and may copy them
    apart); ``explain(error, args, kwargs)`` returns the error to raise instead of JAX's,
    or None. A loop that passes the results back runs none of them: one Python frame a
    step, and the builder's.
    """

    def __init__(self, fn: Callable[..., Any], donate: tuple[int, ...] = (), owned: tuple[int, ...] = (),
                 tree_options: dict[str, Any] | None = None, programs: dict[Any, Any] | None = None,
                 tree_when_mutable: bool = False, guard: Any = None,
                 before: Callable[[tuple, dict[str, Any]], tuple[tuple, dict[str, Any]]] | None = None,
                 explain: Callable[[Exception, tuple, dict[str, Any]], Exception | None] | None = None,
                 **options: Any):
        self._fn = fn
        self._tree_when_mutable = tree_when_mutable
        self._tree_only = False  # set once donated arguments held a dict or list (tree_when_mutable)
        self._tree_options = {**options, **(tree_options or {})}
        self._donate = tuple(sorted(donate))
        self._owned = owned
        self._options = options
        self._programs: dict[Any, _Program] = {} if programs is None else programs  # may be shared
        self._last: Any = None  # (program, results, result leaves) of the latest call
        self._tree: Any = None
        self.guard, self._before, self._explain = guard, before, explain

    def _tree_jit(self) -> Any:
        if self._tree is None:
            self._tree = jax.jit(self._fn, donate_argnums=self._donate, keep_unused=True, **self._tree_options)
        return self._tree

    def _program(self, args: tuple) -> tuple[_Program | None, tuple, tuple]:
        """The program for these arguments, the donated arguments' leaves and the other
        arguments (as the program takes them); None when a tree definition cannot be hashed
        (then ``jax.jit`` of ``fn`` runs, and says so)."""
        donated = [args[i] for i in self._donate if i < len(args)]
        others = tuple(x for i, x in enumerate(args) if i not in self._donate)
        donated_leaves, donated_treedef = jax.tree.flatten(donated)
        other_treedef = jax.tree.structure(others)
        key, program = cached(self._programs, (len(args), donated_treedef, other_treedef))
        if key is None:
            return None, tuple(donated_leaves), others
        if program is None:
            donate = tuple(i for i in self._donate if i < len(args))
            program = _Program(self._fn, len(args), donate, donated_treedef, other_treedef, self._options,
                               self._owned)
            bounded_put(self._programs, key, program)
        return program, tuple(donated_leaves), others

    def _loop(self, program: _Program, args: tuple) -> None:
        """Remember which previous result each donated argument is (when it is one that
        may be passed back by its leaves), for the next calls' fast path."""
        last = self._last
        if last is None or last[0] is not program or program.loop is not None:
            return
        results = last[1]
        loop = []
        for i in self._donate:
            j = next((j for j, r in enumerate(results) if args[i] is r), -1) if i < len(args) else -1
            if j < 0 or not (program.carry[j] or i in self._owned):
                return
            loop.append(j)
        program.gather = _gatherer([program.spans[j] for j in loop])
        program.take = _loop_taker(program.nargs, self._donate, tuple(loop), program.gather)
        program.loop = tuple(loop)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        last = self._last
        if last is not None and not kwargs:
            program, results, leaves = last
            take = program.take
            if take is not None:
                # The loop's common case: the donated arguments are the previous results,
                # their leaves taken from those results' (a train step's metrics skipped).
                donated = take(args, results, leaves)
                if donated is None and len(args) == program.nargs:
                    donated = self._replaced(program, args, results, leaves)
                if donated is not None:
                    paused = program.pause and _gc_isenabled()  # (see _Program.pause)
                    if paused:
                        _gc_disable()
                    try:  # the other arguments as they are: JAX flattens and checks them in C++
                        leaves = program.jitted(donated, program.others(args))
                    except _Restructured:  # (traced only) another structure: the full way
                        if paused:
                            _gc_enable()
                        return self._call(args, kwargs)
                    except (RuntimeError, ValueError, TypeError) as e:
                        if paused:
                            _gc_enable()
                        if self._before is not None and (_INCOMPATIBLE_DEVICES in str(e) or is_donated_twice(e)):
                            # (refused before it ran: nothing donated) the arguments not
                            # donated moved to other devices (a model put on device 5 for a
                            # step that donates only its own log, still on device 2), or a
                            # result passed back also at another place: the full way, whose
                            # ``before`` places the step's own arguments (see _call)
                            return self._call(args, kwargs)
                        self._reraise(e, args, kwargs)
                        raise
                    results = program.build(leaves)
                    outs = results if program.several else (results,)
                    self._last = (program, outs, leaves)
                    guard = self.guard
                    if guard is not None:  # DonationGuard.remember, inline: a loop's every step
                        guard._last, guard._given = outs, args
                        guard.calls += 1
                        LAST_DONOR[0] = guard
                    if paused:
                        _gc_enable()
                    return results
        return self._call(args, kwargs)

    def __get__(self, instance: Any, owner: Any = None) -> Any:
        """A method when it is a class's attribute (``@ft.jit`` on a Module's method), as a
        function and ``jax.jit`` are: ``model.step(x)`` calls it with ``model`` first."""
        return self if instance is None else types.MethodType(self, instance)

    def _replaced(self, program: _Program, args: tuple, results: tuple, leaves: list[Any]) -> tuple | None:
        """The donated leaves when an owned argument is another tree in a loop's place (the
        Trainer's new log buffer): flattened alone, it keeps the fast path if its structure
        is the same. None otherwise: the full path (with ``before``: another argument in
        a donated place may alias, or hold a deleted array)."""
        donated: list[Any] = []
        spans = program.spans
        for i, j, part in zip(self._donate, program.loop or (), program.parts):
            arg = args[i]
            if arg is results[j]:
                start, stop = spans[j]
                donated += leaves[start:stop]
                continue
            if i not in self._owned:
                return None
            arg_leaves, arg_treedef = _flatten(arg, None)
            if arg_treedef != part:
                return None
            donated += arg_leaves
        return tuple(donated)

    def _call(self, args: tuple, kwargs: dict[str, Any]) -> Any:
        """A call off the loop's fast path: checked by ``before``, errors explained, the
        inputs and results remembered by ``guard``."""
        if self._before is not None:
            args, kwargs = self._before(args, kwargs)
        try:
            results = self._full(args, kwargs)
        except (RuntimeError, ValueError, TypeError) as e:
            if self._before is not None and is_donated_twice(e) and self.guard.forget():
                # (refused before it ran) a previous result given at two places, which
                # ``before`` does not look into: again with every input checked as new
                # (one array at two leaves copied apart, with AliasWarning naming both)
                return self._call(args, kwargs)
            self._reraise(e, args, kwargs)
            raise
        if self.guard is not None:
            self.guard.remember(results, args)
        return results

    def _reraise(self, error: Exception, args: tuple, kwargs: dict[str, Any]) -> None:
        """Raise ``explain``'s error for ``error``, if it has one."""
        better = None if self._explain is None else self._explain(error, args, kwargs)
        if better is not None:
            raise better from None

    def _full(self, args: tuple, kwargs: dict[str, Any]) -> Any:
        if kwargs or self._tree_only:
            self._last = None
            with _CollectorPaused():  # (a call that may trace: see _CollectorPaused)
                return self._tree_jit()(*args, **kwargs)
        program, donated, others = self._program(args)
        if program is None or (self._tree_when_mutable and not program.loops):
            self._last = None
            self._tree_only = program is not None
            with _CollectorPaused():
                return self._tree_jit()(*args)
        self._loop(program, args)
        with _CollectorPaused():
            leaves = program.jitted(donated, others)
        results = program.build(leaves)
        self._last = (program, results if program.several else (results,), leaves)
        return results

    def lower(self, *args: Any, **kwargs: Any) -> Any:
        """``jax.jit(fn).lower(*args, **kwargs)``: the same computation as a call runs (the
        flat program's HLO differs only in how its parameters are grouped), and its
        ``compile()`` takes these arguments as they are."""
        return self._tree_jit().lower(*args, **kwargs)

    def trace(self, *args: Any, **kwargs: Any) -> Any:
        return self._tree_jit().trace(*args, **kwargs)

    def eval_shape(self, *args: Any, **kwargs: Any) -> Any:
        return self._tree_jit().eval_shape(*args, **kwargs)

    def clear_cache(self) -> None:
        self._programs.clear()
        self._last = None
        if self._tree is not None:
            self._tree.clear_cache()

    def _cache_size(self) -> int:
        flat = sum(p.jitted._cache_size() for p in self._programs.values())  # pyright: ignore[reportAttributeAccessIssue]
        return flat + (0 if self._tree is None else self._tree._cache_size())


def flat_jit(fn: Callable[..., Any], *, donate: Sequence[int] = (), owned: Sequence[int] = (),
             tree_options: dict[str, Any] | None = None, programs: dict[Any, Any] | None = None,
             tree_when_mutable: bool = False, guard: Any = None, before: Any = None, explain: Any = None,
             **options: Any) -> FlatJit:
    """``fn`` jitted, called over flat leaves (see :class:`FlatJit`); ``donate`` holds the
    indices of the donated positional arguments, ``owned`` those of arguments whose
    containers only the caller builds and never changes in place (a step's own log dict):
    passed back by their leaves even when they hold dicts or lists. ``tree_options`` go
    only to the ``jax.jit`` of ``fn`` that keyword calls use (``donate_argnames``).
    ``programs``: the table of compiled flat programs, shared by several FlatJits of one
    computation (``ft.train.TrainStep``'s process-wide programs); by default its own.
    ``guard``, ``before``, ``explain``: see :class:`FlatJit`."""
    return FlatJit(fn, tuple(donate), tuple(owned), tree_options, programs, tree_when_mutable, guard, before,
                   explain, **options)
