"""Minibatches: CNTK's minibatch sources, with a minibatch size that may be a function.

``ft.train.batches(arrays, batch_size, shuffle=True, key=...)`` cuts a tree of arrays
(an array, a tuple ``(x, y)``, a dict) along its leading axis. Epoch ``e`` is shuffled by
``jax.random.fold_in(key, e)``, so any epoch and any batch within it can be reproduced
(exact resume). Arrays on an accelerator stay there (one dispatch per minibatch, from starts put
on the device once an epoch: no host value sent per step); arrays in
host memory (NumPy, or jax arrays on the CPU backend) are sliced as NumPy views. Any other
iterable of batches (NumPy arrays, tuples or dicts of arrays, a
``torch.utils.data.DataLoader``, a ``tf.data.Dataset``) is accepted by the Trainer as it is.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from functree._naming import names as _leaf_names
from functree._random import key_batch
from functree._state_dict import tensor_to_numpy
from functree._tree import dotted_name
from functree._where import placement_of
from functree.train._metrics import describe_batch

__all__ = ["batches", "Batches", "DataContext", "to_arrays", "example_rows", "rows_error", "LIST_OF_ROWS",
           "TEXT_LEAF", "is_text"]

LENGTH_MISMATCH = """\
ft.train.batches: all arrays must have the same number of examples (leading axis), but \
{first} has {n} and {name} has {m}.

    wrong:  ft.train.batches((x[:100], y), 32)
    right:  ft.train.batches((x, y), 32)          # x.shape[0] == y.shape[0]"""

NO_ARRAYS = """\
ft.train.batches needs arrays with a leading (example) axis, got {what}.

    wrong:  ft.train.batches([], 32)
    right:  ft.train.batches((x, y), 32)"""

SCALAR_LEAF = """\
ft.train.batches cuts every leaf of the data along its leading (example) axis, but leaf \
{name} is {what}, with no such axis{hint}.

    wrong:  ft.train.batches((x, 0.5), 32)
    right:  ft.train.batches((x, y), 32)          # every leaf of shape (n, ...)"""

PYTHON_NUMBERS = """: a list of numbers of unequal lengths (ragged) is a tree of scalars to JAX, \
not an array; pad it to one length first (a list of one length is read as np.asarray(values))"""

NARROWED_INTEGERS = """\
{where}: leaf {name} holds {dtype} values outside the {narrow} range JAX computes in \
without jax_enable_x64 ({value} at index {index}): the step would get it wrapped to \
{wrapped}, with no error.

    wrong:  ft.train.batches((x, ids), 32)                 # ids: int64, some >= 2**31
    right:  jax.config.update("jax_enable_x64", True)      # at startup: int64 kept
       or:  ft.train.batches((x, ids % num_buckets), 32)   # hashed ids folded into range first
       or:  ft.train.batches((x, np.unique(ids, return_inverse=True)[1]), 32)   # ids as categories"""

TEXT_LEAF = """\
{where}: leaf {name} holds text ({what}). A step computes on numbers, and JAX refuses text \
deep inside it ("Error interpreting argument ... as an abstract array"). Class names (a label \
column, a torch DataLoader's collated str labels) are given as class indices:

    wrong:  {wrong}
    right:  classes, ids = np.unique(names, return_inverse=True)     # class i is named classes[i]
            {right}
       or:  label2id = {{name: i for i, name in enumerate(classes)}}   # in a Dataset's __getitem__:
            return x, label2id[name]
A column of raw text the tokenizer has read already is left out of the minibatch instead \
(dataset.remove_columns(["text"]), or a __getitem__ that does not return it)."""

_TEXT_KINDS = frozenset("UST")  # NumPy's str, bytes and StringDType arrays


def is_text(x: Any) -> bool:
    """A string, a list or tuple of strings (torch's ``default_collate`` of str labels),
    or a NumPy array of text (an object array of strings: a pandas column's ``to_numpy()``)."""
    if isinstance(x, (str, bytes)):
        return True
    if type(x) in (list, tuple):
        return bool(x) and all(isinstance(v, (str, bytes)) for v in x)
    if not isinstance(x, np.ndarray):
        return False
    return x.dtype.kind in _TEXT_KINDS or (x.dtype.kind == "O" and x.size > 0 and isinstance(x.flat[0], (str, bytes)))


def check_no_text(tree: Any, where: str, wrong: str, right: str) -> None:
    """:data:`TEXT_LEAF` naming ``tree``'s first leaf of text (:func:`is_text`)."""
    for path, x in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_text)[0]:
        if is_text(x):
            raise ValueError(TEXT_LEAF.format(where=where, name=dotted_name(path) or "(the data itself)",
                                              what=_text_what(x), wrong=wrong, right=right))


def _text_what(x: Any) -> str:
    """``the str 'cat'``, ``a tuple of 4 strings, first 'cat'``, ``an array of dtype <U3 and shape (10,), first 'cat'``."""
    if isinstance(x, (str, bytes)):
        return f"the {type(x).__name__} {x!r:.40}"
    first = x.flat[0] if isinstance(x, np.ndarray) else x[0]
    first = repr(first.item() if isinstance(first, np.generic) else first)[:40]  # 'cat', not np.str_('cat')
    if isinstance(x, np.ndarray):
        return f"an array of dtype {x.dtype} and shape {x.shape}, first {first}"
    return f"a {type(x).__name__} of {len(x)} strings, first {first}"


META_LEAF = """\
{where}: leaf {name} is a torch tensor on the "meta" device ({what}): a shape without values \
(made under torch.device("meta") or torch.set_default_device("meta"), as an empty-weights \
model's are), nothing to compute on; torch's own error ("Cannot copy out of meta tensor") \
names no leaf. Make the data's tensors outside the meta device, with their values:

    wrong:  with torch.device("meta"): x = torch.tensor(values)     # a shape, no values
    right:  x = torch.tensor(values)                                 # on the CPU: values"""


def converted(tree: Any, where: str) -> Any:
    """``tree`` with its leaves made arrays (:func:`_leaf_to_array`); a torch tensor on the
    "meta" device, whose conversion fails in torch naming no leaf, is :data:`META_LEAF`
    naming its key path (looked for only once torch has refused: no cost per minibatch)."""
    try:
        return jax.tree.map(_leaf_to_array, tree, is_leaf=is_number_list)
    except (NotImplementedError, RuntimeError):
        plain = jax.tree.map(lambda x: dict(x) if isinstance(x, Mapping) else x, tree, is_leaf=is_number_list)
        for path, x in jax.tree_util.tree_flatten_with_path(plain, is_leaf=is_number_list)[0]:
            if getattr(x, "is_meta", False) is True:
                raise ValueError(META_LEAF.format(where=where, name=dotted_name(path) or "(the data itself)",
                                                  what=f"{x.dtype} of shape {tuple(x.shape)}")) from None
        raise


LIST_OF_ROWS = """\
{caller}: the data is a list of {n} rows of one example each (items of one structure, the \
first {first}): {how}. Stack the rows into arrays with a leading (example) axis{ragged}:

    wrong:  {wrong}
    right:  {right}
       or:  {other}"""

STACKED = "jax.tree.map(lambda *r: np.stack(r), *rows)"
"""The rows of :data:`LIST_OF_ROWS` stacked: one array per leaf, its leading axis the examples."""

RAGGED_ROWS = " (rows of unequal lengths padded to one first: np.stack needs one shape)"

BAD_BATCH_SIZE = """\
The minibatch size must be a positive int, got {size!r}{where}.

    wrong:  ft.train.batches(data, batch_size={size!r})
    right:  ft.train.batches(data, batch_size=32)
       or:  ft.train.batches(data, batch_size=lambda c: 32 if c.sweep < 2 else 128)"""


BAD_SHARD = """\
shard=(index, count) gives process `index` of `count` its share of every minibatch; \
got shard={shard!r}{why}.

    right:  ft.train.batches(data, 64, shard=(jax.process_index(), jax.process_count()))"""


IN_ORDER_SHARD_TAIL = """\
trainer.evaluate, trainer.predict and fit's validation_data read every example once, the \
last partial minibatch too (drop_last=True drops it from training alone), but these \
batches' last {tail} examples ({n} in minibatches of {size}) do not split into the {count} \
processes' shares of shard=. Evaluate the first {cut} examples, whose last minibatch splits \
evenly (the other {left} left out), or a batch size whose last minibatch is a multiple of \
{count}:

    wrong:  trainer.evaluate(ft.train.batches(data, {size}, drop_last=True, shard=shard))
    right:  trainer.evaluate(ft.train.batches(jax.tree.map(lambda a: a[:{cut}], data), {size}, shuffle=False, shard=shard))"""


def example_rows(data: Any, containers: bool = False) -> list[Any] | None:
    """``data``'s items where it is a list of two or more rows, one example each (a torch
    ``Dataset``'s items, ``[(x_i, y_i), ...]``), else None: items of one tree structure, a
    leaf of each rank at each place, some scalar (a label) beside one with an axis (its
    features). A list is read as minibatches (or, by :func:`batches`, as columns), which
    counts a row's feature axis as its examples and lets its label ride along whole. With
    ``containers``, tuples, lists or dicts of one structure count too: read as columns (or
    as minibatches of a ``batch_size=`` that asks for cutting) they are rows just as well."""
    if type(data) is not list or len(data) < 2:
        return None
    first, tree = jax.tree.flatten(data[0], is_leaf=is_number_list)
    ranks = [np.ndim(x) for x in first]
    labelled = 0 in ranks and any(ranks)
    if not (labelled or (containers and not jax.tree_util.treedef_is_leaf(tree))):
        return None
    for item in data[1:]:
        leaves, other = jax.tree.flatten(item, is_leaf=is_number_list)
        if other != tree or [np.ndim(x) for x in leaves] != ranks:
            return None
    return data


def rows_error(caller: str, rows: list[Any], how: str, wrong: str, right: str, other: str) -> ValueError:
    """:data:`LIST_OF_ROWS` for ``rows`` (:func:`example_rows`) given to ``caller``."""
    shapes = {tuple(np.shape(x) for x in jax.tree.leaves(r, is_leaf=is_number_list)) for r in rows}
    first = describe_batch(to_arrays(rows[0]))
    return ValueError(LIST_OF_ROWS.format(caller=caller, n=len(rows), first=first, how=how, wrong=wrong,
                                          right=right, other=other, ragged=RAGGED_ROWS if len(shapes) > 1 else ""))


def _check_shard(shard: Any) -> tuple[int, int]:
    ok = isinstance(shard, tuple) and len(shard) == 2 and all(isinstance(v, (int, np.integer)) for v in shard)
    if not ok or not 0 <= shard[0] < shard[1]:
        raise ValueError(BAD_SHARD.format(shard=shard, why=""))
    return int(shard[0]), int(shard[1])


def _rows(offset: int, size: int, shard: tuple[int, int] | None, last: str = "") -> tuple[int, int]:
    """(first, end) of this process's rows of the minibatch of ``size`` rows at ``offset``."""
    if shard is None:
        return offset, offset + size
    index, count = shard
    if size % count:
        why = f": a minibatch of {size} examples does not split evenly into {count} shares " \
              f"(use a batch size that is a multiple of {count}, and drop_last=True){last}"
        raise ValueError(BAD_SHARD.format(shard=shard, why=why))
    share = size // count
    return offset + index * share, offset + (index + 1) * share


_ROWS_AS_COLUMNS = ("ft.train.batches reads a list as a tree of columns, each leaf cut along its leading "
                    "axis, which in a row is its features (a label without one is refused): its minibatches "
                    "would be lists of feature slices")


class DataContext(NamedTuple):
    """What a functional minibatch size sees: CNTK's learning context, on the host.

    Before each minibatch ``batch_size(DataContext(step, sweep, samples_seen))`` is called;
    ``samples_seen`` is the sum of the sizes of the minibatches read before it.

    Example:
      >>> import functree as ft, numpy as np
      >>> seen = []
      >>> data = ft.train.batches(np.arange(5), lambda c: seen.append(c) or 2, shuffle=False)
      >>> [b.tolist() for b in data], seen[-1]
      ([[0, 1], [2, 3], [4]], DataContext(step=2, sweep=0, samples_seen=4))
    """

    step: int  # minibatches read before this one (all epochs)
    sweep: int  # the epoch
    samples_seen: int  # examples read before this minibatch (all epochs)


def _check_size(size: Any, where: str = "") -> int:
    if isinstance(size, (bool, np.bool_)) or not isinstance(size, (int, np.integer)) or size < 1:
        raise ValueError(BAD_BATCH_SIZE.format(size=size, where=where))
    return int(size)


class Batches:
    """Re-iterable minibatches of a tree of arrays; see :func:`batches`.

    Each ``iter()`` is the next epoch; ``iterate(epoch, start)`` replays minibatch
    ``start`` on of any epoch (exact resume). ``len()`` is ``ceil(n / batch_size)``
    (``floor`` with ``drop_last``).

    Example:
      >>> import functree as ft, numpy as np
      >>> data = ft.train.batches(np.arange(6), batch_size=4, shuffle=False)
      >>> data, len(data)
      (Batches(6 examples, batch_size=4, shuffle=False, drop_last=False), 2)
      >>> [b.tolist() for b in data], [b.tolist() for b in data.iterate(0, start=1)]
      ([[0, 1, 2, 3], [4, 5]], [[4, 5]])
    """

    def __init__(
        self,
        arrays: Any,
        batch_size: int | Callable[[DataContext], int],
        *,
        shuffle: bool,
        key: jax.Array | None,
        drop_last: bool,
        shard: tuple[int, int] | None = None,
    ):
        self.shard = None if shard is None else _check_shard(shard)
        rows = example_rows(arrays, containers=True)
        if rows is not None:
            raise rows_error("ft.train.batches", rows, _ROWS_AS_COLUMNS, "ft.train.batches(rows, 32)",
                             f"ft.train.batches({STACKED}, 32)",
                             "ft.train.batches((np.stack([x for x, _ in rows]), np.array([y for _, y in rows])), 32)")
        arrays = converted(arrays, "ft.train.batches")  # to_arrays' reading
        leaves = jax.tree.leaves(arrays)
        if not leaves:
            raise ValueError(NO_ARRAYS.format(what=repr(arrays)[:80]))
        check_no_text(arrays, "ft.train.batches", "ft.train.batches((x, names), 32)   # names: ['cat', 'dog', ...]",
                      "ft.train.batches((x, ids), 32)")
        names = _array_names(arrays)
        for name, x in zip(names, leaves):
            if np.ndim(x) == 0:
                hint = PYTHON_NUMBERS if isinstance(x, (int, float, complex)) else ""
                raise ValueError(SCALAR_LEAF.format(name=name or "(the data itself)", what=_what(x), hint=hint))
        lengths = [np.shape(x)[0] for x in leaves]
        for name, m in zip(names, lengths):
            if m != lengths[0]:
                raise ValueError(
                    LENGTH_MISMATCH.format(first=names[0] or "the first array", n=lengths[0],
                                           name=name, m=m)
                )
        if not callable(batch_size):
            _check_size(batch_size)
        self.arrays, self.batch_size = jax.tree.map(_host_if_cpu, arrays), batch_size
        self.shuffle, self.drop_last = shuffle, drop_last
        self.key = jax.random.key(0) if key is None else checked_key(key, "ft.train.batches")
        self.num_examples = int(lengths[0])
        for name, x in zip(names, jax.tree.leaves(self.arrays)):
            if type(x) is np.ndarray:  # in memory (a memmap's minibatches are checked as they are read)
                check_integer_range(x, name, "ft.train.batches")
        if self.shard is not None and not callable(batch_size):  # at the call, not at the epoch's end
            _rows(0, batch_size, self.shard)
            tail = self.num_examples % batch_size
            if tail and not drop_last:
                _rows(0, tail, self.shard, f"; it is the last minibatch of each epoch "
                                           f"({self.num_examples} examples in minibatches of {batch_size})")
        self._epochs_started = 0
        self._starts: list[tuple[int, int]] = [(0, 0)]  # (step, samples) at each epoch start

    def __len__(self) -> int:
        """Minibatches per epoch (only for an int batch size)."""
        if callable(self.batch_size):
            raise TypeError("len() of ft.train.batches with a functional batch size is unknown.")
        full, rest = divmod(self.num_examples, self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    def _sizes(self, epoch: int) -> list[int]:
        """The minibatch sizes of ``epoch`` (calls a functional batch size in order)."""
        while len(self._starts) <= epoch:
            e = len(self._starts) - 1
            sizes = self._epoch_sizes(e, *self._starts[e])
            self._starts.append((self._starts[e][0] + len(sizes), self._starts[e][1] + sum(sizes)))
        return self._epoch_sizes(epoch, *self._starts[epoch])

    def _epoch_sizes(self, epoch: int, step: int, seen: int) -> list[int]:
        sizes, taken = [], 0
        while taken < self.num_examples:
            size = self.batch_size
            if callable(size):
                context = DataContext(step + len(sizes), epoch, seen + taken)
                size = _check_size(size(context), f" from batch_size({context})")
            if size > self.num_examples - taken and self.drop_last:
                break
            size = min(size, self.num_examples - taken)
            sizes.append(size)
            taken += size
        return sizes

    def _order(self, epoch: int) -> Any:
        """Epoch ``epoch``'s permutation on device (None: in order), placed with the data."""
        if not self.shuffle:
            return None
        return jax.device_put(_permutation(self.key, epoch, self.num_examples), self._place)

    def iterate(self, epoch: int, start: int = 0) -> Iterator[Any]:
        """The minibatches of ``epoch``, from minibatch number ``start`` on."""
        every = self._sizes(epoch)
        sizes, offset = every[start:], sum(every[:start])
        order = self._order(epoch)
        host = None if order is None or not self._on_host else np.asarray(order)  # once per epoch
        firsts = self._device_firsts(offset, sizes)
        leaves, treedef = jax.tree.flatten(self.arrays)
        for n, size in enumerate(sizes):
            first, end = _rows(offset, size, self.shard)  # with shard=: this process's rows
            offset += size
            gathered = iter(_gather(self._on_device(leaves), order, firsts[n], end - first) if firsts else ())
            yield treedef.unflatten([next(gathered) if isinstance(x, jax.Array) else _host_rows(x, host, first, end)
                                     for x in leaves])

    def _device_firsts(self, offset: int, sizes: list[int]) -> list[jax.Array]:
        """Each minibatch's first row as a device scalar, put there in one explicit transfer
        per epoch: a minibatch of arrays on an accelerator is then one dispatch that takes
        no host value (a Python start was a host-to-device transfer every step). Empty when
        every leaf is in host memory."""
        if not self._on_device(jax.tree.leaves(self.arrays)):
            return []
        firsts = []
        for size in sizes:
            share = size if self.shard is None else size // self.shard[1]  # (_rows checks the split)
            firsts.append(offset + (0 if self.shard is None else self.shard[0] * share))
            offset += size
        return list(jax.device_put(np.asarray(firsts, np.int32), self._place))

    @staticmethod
    def _on_device(leaves: list[Any]) -> list[jax.Array]:
        return [x for x in leaves if isinstance(x, jax.Array)]

    @functools.cached_property
    def _place(self) -> Any:
        """Where the permutation and starts go: beside the data's device arrays."""
        return placement_of(self._on_device(jax.tree.leaves(self.arrays)))

    @functools.cached_property
    def _on_host(self) -> bool:
        return any(not isinstance(x, jax.Array) for x in jax.tree.leaves(self.arrays))

    def __iter__(self) -> Iterator[Any]:
        epoch = self._epochs_started
        self._epochs_started += 1
        return self.iterate(epoch)

    def check_in_order(self) -> None:
        """:data:`IN_ORDER_SHARD_TAIL` where :meth:`in_order`'s last minibatch (one that
        ``drop_last=True`` drops from training) does not split into ``shard=``'s shares (fit
        checks its validation data so, before the first epoch)."""
        if self.shard is not None and isinstance(self.batch_size, int):
            tail = self.num_examples % self.batch_size
            if tail % self.shard[1]:
                raise ValueError(IN_ORDER_SHARD_TAIL.format(
                    tail=tail, n=self.num_examples, size=self.batch_size, count=self.shard[1],
                    cut=self.num_examples - tail % self.shard[1], left=tail % self.shard[1]))

    def in_order(self) -> Batches:
        """These minibatches unshuffled and with the last partial one kept: what
        ``Trainer.evaluate`` and ``predict`` read (every example once, in order; the
        training data's shuffled epoch 0 gave ``predict`` its rows permuted).

        Example:
          >>> import functree as ft, numpy as np, jax
          >>> data = ft.train.batches(np.arange(5), 2, key=jax.random.key(0), drop_last=True)
          >>> [b.tolist() for b in data.in_order()]
          [[0, 1], [2, 3], [4]]
        """
        self.check_in_order()
        return Batches(self.arrays, self.batch_size, shuffle=False, key=self.key, drop_last=False, shard=self.shard)

    def __repr__(self) -> str:
        size = getattr(self.batch_size, "__name__", self.batch_size)
        return (f"Batches({self.num_examples} examples, batch_size={size}, "
                f"shuffle={self.shuffle}, drop_last={self.drop_last})")


NOT_A_PRNG_KEY = """\
{caller}: key= is a JAX PRNG key (it seeds the shuffling and the loss's dropout), and \
{given} ({kind}) is none. An integer seed makes one:

    wrong:  {caller}(..., key={given})
    right:  {caller}(..., key=jax.random.key({seed}))"""


SEVERAL_KEYS = """\
{caller}: key= is one JAX PRNG key, but it got {n} keys ({what} of shape {shape}: a \
jax.random.split's whole output), which jax.random.fold_in refuses inside JAX. Pass one of \
them:

    wrong:  {caller}(..., key=jax.random.split(key, {n}))
    right:  {caller}(..., key=jax.random.split(key, {n})[0])
       or:  key, sub = jax.random.split(key); {caller}(..., key=sub)"""


def checked_key(key: Any, caller: str) -> Any:
    """``key`` if it is one PRNG key: a typed key (``jax.random.key``) or raw ``uint32``
    key data ``[2]`` (``jax.random.PRNGKey``); else :data:`NOT_A_PRNG_KEY` (or, for
    several keys, :data:`SEVERAL_KEYS`) at the call, not deep inside the first shuffle."""
    if key_batch(key) is not None:
        several = several_keys(key, caller)
        if several is not None:
            raise several
        return key
    seed = int(key) if isinstance(key, (int, np.integer)) and not isinstance(key, bool) else 0
    raise TypeError(NOT_A_PRNG_KEY.format(caller=caller, given=repr(key)[:60], kind=type(key).__name__, seed=seed))


def several_keys(key: Any, caller: str) -> ValueError | None:
    """:data:`SEVERAL_KEYS` for a key (typed, or raw ``uint32`` data ``[..., 2]``) that is a
    batch of keys; None for one key."""
    batch = key_batch(key)
    if not batch:
        return None
    typed = jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
    return ValueError(SEVERAL_KEYS.format(caller=caller, n=int(np.prod(batch)), shape=np.shape(key),
                                          what="a key array" if typed else "raw uint32 key data"))


@functools.partial(jax.jit, static_argnums=2)
def _permutation(key: Any, epoch: Any, n: int) -> jax.Array:
    """Epoch ``epoch``'s order of ``n`` examples: one dispatch (eagerly, the fold-in and the
    shuffle's sorts were a dozen: ~0.3 ms an epoch, most of a short epoch's cost)."""
    return jax.random.permutation(jax.random.fold_in(key, epoch), n)


_NUMBERS = (int, float, bool)


def is_number_list(x: Any) -> bool:
    """A list of Python numbers, or of such lists (a collator's ``input_ids`` without
    ``return_tensors``): one array of the minibatch, not a tree of scalar leaves."""
    return type(x) is list and bool(x) and all(
        isinstance(v, _NUMBERS) if not isinstance(v, list) else is_number_list(v) for v in x)


def _array_names(arrays: Any) -> list[str]:
    """The dotted names of the leaves ``jax.tree.leaves(arrays)`` gives (``None`` is no leaf)."""
    nodes = jax.tree.leaves(arrays, is_leaf=lambda x: x is None)
    return [name for name, x in zip(_leaf_names(arrays), nodes) if x is not None]


def _what(x: Any) -> str:
    """``a 0-d float64 array``, ``the float 0.5``: a leaf without a leading axis."""
    if hasattr(x, "dtype"):
        return f"a 0-d {x.dtype} array"
    return f"the {type(x).__name__} {repr(x)[:40]}"


_WIDE = frozenset({np.dtype(np.int64), np.dtype(np.uint64)})
_NARROW = {np.dtype(np.int32): (-(2**31), 2**31 - 1), np.dtype(np.uint32): (0, 2**32 - 1)}


def check_integer_range(x: Any, name: str, where: str) -> None:
    """:data:`NARROWED_INTEGERS` for a NumPy ``int64``/``uint64`` array (or scalar) with a
    value that the dtype JAX holds it in (``int32``/``uint32`` without ``jax_enable_x64``)
    cannot represent: JAX would wrap it (``2**31 + 5`` to ``-2**31 + 5``) where the step
    reads it. (Two reductions of the leaf: JAX's own conversion to ``int32`` is a pass too.)"""
    if not (isinstance(x, (np.ndarray, np.generic)) and x.dtype in _WIDE and x.size):
        return
    narrow = jax.dtypes.canonicalize_dtype(x.dtype)
    bounds = _NARROW.get(narrow)
    if bounds is None or (bounds[0] <= x.min() and x.max() <= bounds[1]):  # (None: x64 keeps it)
        return
    values = np.asarray(x).reshape(-1)
    flat = int(np.flatnonzero(np.less(values, bounds[0]) | np.greater(values, bounds[1]))[0])
    index = tuple(int(i) for i in np.unravel_index(flat, np.shape(x)))
    value = values[flat]
    raise ValueError(NARROWED_INTEGERS.format(
        where=where, name=name or "(the data itself)", dtype=x.dtype, narrow=narrow, value=int(value),
        index=index[0] if len(index) == 1 else index, wrapped=int(value.astype(narrow))))


def _host_if_cpu(x: Any) -> Any:
    """A CPU-resident jax array as a NumPy view: slicing it costs ~1 µs instead of an
    eager device op per minibatch (tens of µs); the jitted step reads it directly."""
    on_cpu = isinstance(x, jax.Array) and all(d.platform == "cpu" for d in x.devices())
    if on_cpu and not jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        return np.asarray(x)
    if not isinstance(x, (jax.Array, np.ndarray)) and hasattr(x, "__array__"):  # a torch/TF tensor
        return tensor_to_numpy(x) if type(x).__module__.startswith("torch") else np.asarray(x)
    return x


def _host_rows(x: Any, order: Any, first: int, end: int) -> Any:
    """Rows ``first .. end`` of a leaf in host memory (of ``order``'s rows where shuffled)."""
    return x[first:end] if order is None else np.take(x, order[first:end], axis=0)


@functools.partial(jax.jit, static_argnums=3)
def _gather(leaves: list[jax.Array], order: jax.Array | None, first: jax.Array, size: int) -> list[jax.Array]:
    """Rows ``first .. first + size`` of each leaf, of ``order``'s rows where shuffled: one
    minibatch of device arrays in one dispatch (compiled once per minibatch size)."""
    if order is None:
        return [jax.lax.dynamic_slice_in_dim(x, first, size) for x in leaves]
    index = jax.lax.dynamic_slice_in_dim(order, first, size)
    return [jnp.take(x, index, axis=0) for x in leaves]


def batches(
    arrays: Any,
    batch_size: int | Callable[[DataContext], int] = 32,
    *,
    shuffle: bool = True,
    key: jax.Array | None = None,
    drop_last: bool = False,
    shard: tuple[int, int] | None = None,
) -> Batches:
    """Minibatches of ``arrays`` (a tree of arrays with a common leading axis; a list of
    Python numbers of one length per level is read as ``np.asarray`` of it, a mapping
    that is no pytree node, as Hugging Face's ``BatchEncoding``, as a dict).

    Each iteration is one epoch (sweep); epoch ``e`` is ordered by a permutation drawn from
    ``jax.random.fold_in(key, e)`` (``key`` defaults to ``jax.random.key(0)``), so runs
    are reproducible. ``batch_size`` may be a function of the :class:`DataContext`
    (``step``, ``sweep``, ``samples_seen``), CNTK's functional minibatch size; every
    distinct size compiles the training step once. ``drop_last`` drops a final short
    minibatch (no extra compilation). ``shard=(jax.process_index(), jax.process_count())``
    yields each process its share of every minibatch (rows ``i·b/P`` to ``(i+1)·b/P`` of
    the same shuffled minibatch in every process); the data-parallel step assembles the
    global minibatch from the shares. A batch size (or, without ``drop_last``, a last
    minibatch) that does not split into ``count`` shares is refused here, at the call.
    NumPy ``int64`` values outside ``int32`` without ``jax_enable_x64`` are refused
    (:data:`NARROWED_INTEGERS`: JAX would wrap them).

    Example:
      >>> import functree as ft, numpy as np
      >>> x, y = np.arange(10.0).reshape(5, 2), np.arange(5)
      >>> data = ft.train.batches((x, y), batch_size=2, shuffle=False)
      >>> [b[1].tolist() for b in data]
      [[0, 1], [2, 3], [4]]
      >>> growing = ft.train.batches(x, batch_size=lambda c: 1 + c.step, shuffle=False)
      >>> [len(b) for b in growing]
      [1, 2, 2]
    """
    return Batches(arrays, batch_size, shuffle=shuffle, key=key, drop_last=drop_last, shard=shard)


def _leaf_to_array(x: Any) -> Any:
    if isinstance(x, (jax.Array, np.ndarray, np.generic, int, float, bool)):
        return x
    if type(x) is list:  # (only a list of numbers is a leaf here) of one length per level: an array
        try:
            return np.asarray(x)
        except ValueError:  # ragged: kept as it is
            return x
    if isinstance(x, Mapping):  # a mapping JAX takes for a leaf (Hugging Face's BatchEncoding): a dict
        return jax.tree.map(_leaf_to_array, dict(x), is_leaf=is_number_list)
    if hasattr(x, "detach") and hasattr(x, "cpu"):  # torch.Tensor (bfloat16 kept: its bits)
        return tensor_to_numpy(x)
    if hasattr(x, "__array__") or hasattr(x, "numpy"):  # tf.Tensor, other array-likes
        return np.asarray(x)
    return x


def to_arrays(batch: Any) -> Any:
    """A batch from any loader with its tensors turned into NumPy/JAX arrays.

    Torch and TensorFlow tensors become NumPy arrays; a list of Python numbers (or of
    such lists, of one length per level: a collator's ``input_ids`` without
    ``return_tensors``) becomes one NumPy array (as leaves, its numbers counted as one
    example and compiled as one scalar argument each); other lists stay lists; a mapping
    that is no pytree node to JAX (Hugging Face's ``BatchEncoding``, a collator's output)
    becomes a dict (JAX would take it for one leaf, and fail in the step). An array or a
    tuple of arrays is returned as it is (no tree traversal). A NumPy ``int64``/``uint64``
    leaf with values that JAX without ``jax_enable_x64`` would wrap into ``int32``/``uint32``
    is refused (:data:`NARROWED_INTEGERS`).

    Example:
      >>> import functree as ft, numpy as np
      >>> class Tensor:  # stands in for a torch.Tensor or tf.Tensor
      ...     def __array__(self, dtype=None, copy=None): return np.arange(3.0)
      >>> ft.train.to_arrays({"x": Tensor(), "y": [1, 2]})
      {'x': array([0., 1., 2.]), 'y': array([1, 2])}
    """
    if isinstance(batch, _ARRAYS):
        if batch.dtype in _WIDE:
            check_integer_range(batch, "", _TO_ARRAYS)
        elif _maybe_text(batch):
            _check_no_text(batch)
        return batch
    if type(batch) is tuple and all(isinstance(x, _ARRAYS) for x in batch):
        for i, x in enumerate(batch):  # the common case, without a tree traversal
            if x.dtype in _WIDE:
                check_integer_range(x, str(i), _TO_ARRAYS)
            elif _maybe_text(x):
                _check_no_text(batch)
        return batch
    out = converted(batch, _TO_ARRAYS)
    leaves = jax.tree.leaves(out)
    for i, x in enumerate(leaves):
        if isinstance(x, (str, bytes)) or _maybe_text(x):
            _check_no_text(out)
        if getattr(x, "dtype", None) in _WIDE:
            try:
                check_integer_range(x, "", _TO_ARRAYS)
            except ValueError:  # named by its key path (built only now)
                check_integer_range(x, _array_names(out)[i], _TO_ARRAYS)
    return out


_TO_ARRAYS = "A minibatch (ft.train.to_arrays, as the Trainer reads it)"

_MAYBE_TEXT = _TEXT_KINDS | {"O"}  # the dtype kinds of an array that may hold text


def _maybe_text(x: Any) -> bool:
    """A NumPy array of a dtype that may hold text (a JAX array holds none; a key's dtype has no kind)."""
    return isinstance(x, np.ndarray) and x.dtype.kind in _MAYBE_TEXT


def _check_no_text(batch: Any) -> None:
    """:data:`TEXT_LEAF` for a loader's minibatch with text (class names) in it."""
    check_no_text(batch, _TO_ARRAYS, "trainer.fit(loader, ...)   # its labels: ('cat', 'dog', ...)",
                  "trainer.fit(ft.train.batches((x, ids), 32), ...)")


_ARRAYS = (jax.Array, np.ndarray)
