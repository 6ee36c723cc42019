"""Epochs and the position in the data: where a job's next minibatch comes from.

``fit`` takes ``ft.train.batches``, arrays (cut into shuffled minibatches), or any iterable
of minibatches. :class:`Epochs` gives each epoch's iterator *from the job's position*:
``Batches`` replays from it; an iterator that reports its position (``get_state`` /
``set_state``, as grain's) is set to the saved one; another re-iterable skips the
minibatches the epoch already consumed (read, never computed on); a one-shot iterator
continues where it is. It also names a minibatch that cannot run (empty, or failing in
the step) by its step, epoch and index.
"""

from __future__ import annotations

import itertools
import operator
import sys
import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from functree._tree import is_array_value
from functree._warnings import warn
from functree.optim._checks import ConfigurationError
from functree.train._data import (
    STACKED,
    Batches,
    batches,
    example_rows,
    is_number_list,
    is_text,
    rows_error,
    to_arrays,
)
from functree.train._job import JobState
from functree.train._metrics import MetricCallError, describe_batch, shared_batch_size
from functree.train.checkpoint._position import DATA_STATE_NOT_STORABLE, storable

__all__ = ["Epochs", "as_data", "check_row_minibatch", "cut_by_batch_size", "epoch_length", "ran_out"]

BAD_LENGTH = """\
{what} must be a positive int, got {value!r}.
    right:  trainer.fit(data, epochs=10)   or   trainer.fit(data, steps=1000)"""

KERAS_POSITIONAL = """\
trainer.fit's second argument is epochs, but it got an array of shape {shape}: Keras's \
positional fit(x, y) is fit((x, y)) here (the data is one argument: a tuple of arrays, a \
loader, an iterator).

    wrong:  trainer.fit(x, y, epochs=5)
    right:  trainer.fit((x, y), epochs=5)"""

EMPTY_DATA = """\
The training data gave no minibatch{why}.

    right:  trainer.fit(ft.train.batches((x, y), batch_size=32), epochs=5)
       or:  trainer.fit(iterator, steps=1000)       # a one-shot iterator needs steps="""

ONE_SHOT = """\
trainer.fit(data, epochs={epochs}) needs data it can iterate once per epoch, but \
{kind} is a one-shot iterator: it would run out after the first epoch.
Pass something re-iterable, or count steps instead of epochs:

    wrong:  trainer.fit(generator(), epochs={epochs})
    right:  trainer.fit(ft.train.batches((x, y), batch_size=32), epochs={epochs})
       or:  trainer.fit(loader, epochs={epochs})          # a list, a DataLoader: re-iterable
       or:  trainer.fit(generator(), steps=1000)"""

ONE_SHOT_VALIDATION = """\
trainer.fit(data, {count}, validation_data=...) validates at every epoch's end, but \
validation_data is a one-shot iterator ({kind}): the first validation would use it up, and \
the next one find no minibatch. Pass something re-iterable:

    wrong:  trainer.fit(data, {count}, validation_data=(b for b in val_batches))
    right:  trainer.fit(data, {count}, validation_data=list(val_batches))
       or:  trainer.fit(data, {count}, validation_data=ft.train.batches((x_val, y_val), 32, shuffle=False))"""

ENDLESS_DATA = """\
trainer.fit(data, epochs={epochs}) ends an epoch where the data ends, but the data ({kind}) \
never ends: {why}. The first epoch would never end (fit would run until interrupted). Count \
steps instead (Keras's steps_per_epoch=S, which an endless dataset needs there, is \
steps=epochs * S here: the job's steps in all), or give data that ends:

    wrong:  trainer.fit(data, epochs={epochs})
    right:  trainer.fit(data, steps={epochs} * 1000)     # 1000 minibatches an epoch
       or:  trainer.fit({finite}, epochs={epochs})    # {note}"""

ENDLESS_VALIDATION = """\
trainer.fit(data, steps={steps}, validation_data=...) evaluates validation_data at every \
epoch's end, but the data ({kind}) never ends an epoch: {why}. validation_data would never \
be evaluated. Evaluate it after fit, or give data that ends:

    wrong:  trainer.fit(data, steps={steps}, validation_data=val)
    right:  trainer.fit(data, steps={steps}); trainer.evaluate(val)
       or:  trainer.fit({finite}, epochs=N, validation_data=val)    # {note}"""

ENDLESS_VALIDATION_DATA = """\
trainer.fit(data, ..., validation_data=...) evaluates all of validation_data at every epoch's \
end, but validation_data ({kind}) never ends: {why}. The first validation would never end. \
Give validation data that ends:

    wrong:  trainer.fit(data, epochs=N, validation_data=val)
    right:  trainer.fit(data, epochs=N, validation_data={finite})    # {note}"""

ONE_SHOT_RESUME = """\
The restored trainer is at step {step}, but {kind} is a one-shot iterator that cannot report \
or set its position (no get_state()/set_state()): it is used as if it started right after \
step {step}. If it starts at the beginning of the data, the job would train on those \
minibatches again. Give an iterator that starts where the job stopped, or one with a position:

    right:  trainer.fit(itertools.islice(generator(), trainer.steps_run, None), steps=1000)
       or:  an iterator with get_state() -> JSON or bytes and set_state(state) (as grain's iterators)"""

TORCH_SHUFFLE_RESUME = """\
The restored trainer is at epoch {epoch}, step {step}, but the torch DataLoader shuffles \
(RandomSampler) and cannot report or set its position: a resumed process starts its \
generator afresh, so this epoch gets the first epoch's order, not the order the \
uninterrupted job would have used (other batches, other weights, silently). Give data whose \
order is a function of the epoch:

    wrong:  DataLoader(dataset, batch_size=32, shuffle=True, generator=g)   # resumed
    right:  ft.train.batches((x, y), 32, key=jax.random.key(0))            # order from (key, epoch)
       or:  a grain DataLoader / MapDataset.shuffle(seed) iterator (get_state()/set_state())"""

RAGGED_MINIBATCH = """\
The minibatch holds lists of unequal lengths at {paths} (token ids as a datasets map or a \
collator without padding return them): JAX cannot make one array of them. Pad them to one \
length (and pass the attention mask), in the collator or with the tokenizer:

    wrong:  tokenizer(texts)                                   # ragged input_ids
    right:  tokenizer(texts, padding="max_length", max_length=128, truncation=True)
       or:  DataCollatorWithPadding(tokenizer, return_tensors="np")"""

DATA_LENGTH_CHANGED = """\
The restored job was trained on data of {saved} minibatches per epoch, but fit was given \
{given}: its position (step {step}) would point into other data. Resume with the data the \
job was trained on, or start a new job (a fresh Trainer) for new data:

    wrong:  trainer.restore(path); trainer.fit(other_data, epochs=10)
    right:  trainer.restore(path); trainer.fit(same_data, epochs=10)"""

DATA_LENGTH_CHANGED_MID_EPOCH = """\
This job stopped inside epoch {epoch} (counted from 0), after {done} of its data's {saved} \
minibatches (step {step}), but fit was given data of {given} minibatches per epoch: the epoch \
would go on at minibatch {done} of the other data, {what}. Finish the epoch on the data it \
began with, then give the new data, or start a new job (a fresh Trainer) for it, from the trained model and its optimizer state:

    wrong:  trainer.fit(data, steps={step}); trainer.fit(other_data, epochs=...)
    right:  trainer.fit(data, epochs={finish}); trainer.fit(other_data, epochs=...)   # epoch {epoch} ended first
       or:  ft.train.Trainer(trainer.model, optimizer, loss_fn, opt_state=trainer.opt_state).fit(other_data, epochs=...)"""

LONGER_THAN_LEN = """\
step {step}: the data ({kind}) gave minibatch {index} of epoch {epoch} (counted from 0), but \
its len() is {length}: it yields more minibatches than len() says. len() counts the epoch \
(its end, the progress bar, and where a restored job resumes), so a checkpoint past it would \
point nowhere. The job stopped at step {last}, the last step of the {length} minibatches \
len() promised. Make len() the number of minibatches an epoch yields, or give the data no __len__:

    wrong:  def __len__(self): return len(self.examples)          # examples, not minibatches
    right:  def __len__(self): return math.ceil(len(self.examples) / self.batch_size)
       or:  no __len__ (the epoch ends when the iterator does)"""


EMPTY_MINIBATCH = """\
step {step}: minibatch {index} of epoch {epoch} is empty (0 examples; minibatches and epochs \
counted from 0, as trainer.batch_in_epoch and trainer.epoch). Its shapes: {shapes}.
A step needs at least one example; drop empty minibatches where the data is made:

    wrong:  loader = [(x[i:i + 32], y[i:i + 32]) for i in range(0, len(x) + 32, 32)]
    right:  loader = [(x[i:i + 32], y[i:i + 32]) for i in range(0, len(x), 32)]
       or:  ft.train.batches((x, y), batch_size=32)"""

ACCUMULATE_UNEVEN = """\
trainer.fit: Optimizer(accumulate={k}) splits every minibatch into {k} microbatches, but \
{which} has {rows} examples, not a multiple of {k}{when}. Give minibatches of a multiple of \
{k} examples (on a mesh: of devices x {k}):

    wrong:  trainer.fit({wrong}, ...)
    right:  trainer.fit({right}, ...){note}"""

MALFORMED_MINIBATCH = """\
step {step}: minibatch {index} of epoch {epoch} (counted from 0) failed in the training step. \
Its shapes: {shapes}{first}. The error:
{error}"""


ALL_DROPPED = """\
The training data gave no minibatch: ft.train.batches(..., batch_size={size}, drop_last=True) \
drops a last minibatch of fewer than {size} examples, and its {n} examples are all fewer.

    wrong:  ft.train.batches((x, y), batch_size={size}, drop_last=True)     # {n} examples
    right:  ft.train.batches((x, y), batch_size={fit}, drop_last=True)
       or:  ft.train.batches((x, y), batch_size={size})                     # one minibatch of {n}"""


def no_minibatch(data: Any) -> ValueError:
    """The error of data that gave no minibatch at all (:data:`ALL_DROPPED` for a
    ``drop_last`` :class:`Batches` whose examples are fewer than one minibatch)."""
    if isinstance(data, Batches) and data.drop_last and isinstance(data.batch_size, int) \
            and 0 < data.num_examples < data.batch_size:
        return ValueError(ALL_DROPPED.format(size=data.batch_size, n=data.num_examples, fit=data.num_examples))
    return ValueError(EMPTY_DATA.format(why=f" ({type(data).__name__})"))


DATA_RAN_OUT = """\
trainer.fit(data, {asked}) stopped short of {asked}, at step {step}: the data ({kind}) gave no \
minibatch for epoch {epoch} (counted from 0). A generator, an iterator (iter(loader)) or a dataset whose iter() returns one \
shared iterator is read once: the epochs after its end are empty. fit returns here (as \
Keras's "Your input ran out of data"); pass data that iter() restarts, or ask for what it holds:

    wrong:  trainer.fit(generator(), {asked})        # fewer minibatches than asked
    right:  trainer.fit(ft.train.batches((x, y), batch_size=32), {asked})
       or:  trainer.fit(loader, {asked})             # a list, a DataLoader: iter() once per epoch
       or:  trainer.fit(generator(), steps={step})"""


def ran_out(data: Any, epochs: int | None, steps: int | None, job: JobState) -> None:
    """:data:`DATA_RAN_OUT` (a warning): an epoch after the first of this ``fit`` gave no
    minibatch before ``epochs``/``steps`` were reached (fit stops there, as Keras's)."""
    asked = f"steps={steps}" if steps is not None else f"epochs={epochs}"
    warn(DATA_RAN_OUT.format(asked=asked, step=job.steps_run, epoch=job.epoch, kind=type(data).__name__),
         UserWarning)  # (at the user's fit line)


BATCH_SIZE_UNUSED = """\
{caller}(data, batch_size={size}): batch_size= cuts in-memory arrays (an array, or a tuple or \
dict of arrays) into minibatches, but the data is {kind}, which is read as minibatches as it \
is (each of its items one minibatch{own}): batch_size would be ignored.

    wrong:  {caller}([x, y], batch_size={size})        # a list: two minibatches, x and y
    right:  {caller}((x, y), batch_size={size})        # a tuple of arrays: cut into minibatches
       or:  {caller}(ft.train.batches((x, y), batch_size={size}))"""


LIST_OF_ARRAYS = """\
{caller}: a list is read as minibatches, one per item, but this list's {n} arrays differ \
in {what} ({shapes}), which one dataset's minibatches share: it looks like [inputs, labels]. \
Inputs and labels are a tuple, cut into minibatches:

    wrong:  {wrong}
    right:  {right}                       # batch_size=32 by default
       or:  {batches}"""

LIST_ITEM_IS_MINIBATCH = """\
{caller}'s data is a list of {n} arrays ({shapes}): each item is one minibatch, so this \
minibatch is the array {item} alone. If the list is [inputs, labels], pass the tuple (x, y): \
{caller}((x, y), ...)."""


VALIDATION = "trainer.fit(validation_data=...)"  # as_data's caller for fit's validation data


def list_of_arrays(data: Any) -> list[Any] | None:
    """``data``'s items when it is a list of two or more bare arrays (what ``[x, y]``
    written for ``(x, y)`` is), else None."""
    if type(data) is list and len(data) >= 2 and all(_array_like(x) for x in data):
        return data
    return None


def check_list_of_arrays(data: Any, caller: str) -> None:
    """:data:`LIST_OF_ARRAYS` for a list of arrays of more than one dtype or rank: read as
    minibatches, each item would be a step of its own (``[x, y]``: a step on ``x`` alone,
    then one on ``y``), a silent misreading of inputs and labels where the loss runs."""
    items = list_of_arrays(data)
    if items is None:
        return
    kinds = {(_step_dtype(x), len(x.shape)) for x in items}
    if len(kinds) > 1:
        what = "dtype" if len({k for k, _ in kinds}) > 1 else "rank"
        if what == "dtype" and len({r for _, r in kinds}) > 1:
            what = "dtype and rank"
        raise ValueError(LIST_OF_ARRAYS.format(
            caller=caller, n=len(items), what=what, shapes=_shapes(items), wrong=_called(caller, "[x, y]"),
            right=_called(caller, "(x, y)"), batches=_called(caller, "ft.train.batches((x, y), batch_size=32)")))


_ROWS_AS_MINIBATCHES = ("a list is read as minibatches, one per item: each row would be a minibatch of {size} "
                        "examples, counted along its first axis (its features; {counted}), its label riding "
                        "along whole")
_ROWS_COUNTED = {"trainer.fit": "samples_seen, per_samples learning rates and accumulate= count them",
                 "trainer.predict": "its outputs concatenated along their first axis"}
_ROWS_CUT = ("batch_size={size} cuts arrays into minibatches, but a list is read as minibatches as it is, "
             "one per item: each row one")
_ROWS_MINIBATCHES = "[(x, y, np.full(len(x), t)) for x, y, t in minibatches]"  # a per-minibatch value t, per example


def check_rows(data: Any, caller: str, size: int | None) -> None:
    """:data:`~functree.train._data.LIST_OF_ROWS` for a list of rows of one example each
    (:func:`~functree.train._data.example_rows`; with a ``batch_size=``, ``size``, which asks
    for cutting, a list of tuples or dicts of one structure too): read as minibatches, a row's
    features were counted as its examples, silently."""
    rows = example_rows(data, containers=size is not None)
    if rows is None:
        return
    if size is None:
        counted = _ROWS_COUNTED.get(caller, "the means weigh each minibatch by them")
        how = _ROWS_AS_MINIBATCHES.format(size=shared_batch_size(to_arrays(rows[0])), counted=counted)
        right = _called(caller, STACKED)
        other = _called(caller, _ROWS_MINIBATCHES) + "   # minibatches with one value t each: one per example"
    else:
        how, right = _ROWS_CUT.format(size=size), _called(caller, f"{STACKED}, batch_size={size}")
        other = _called(caller, "rows") + "   # items that are minibatches: no batch_size="
    wrong = _called(caller, "rows" if size is None else f"rows, batch_size={size}")
    raise rows_error(caller, rows, how, wrong, right, other)


ROWS_FROM_LOADER = """\
{caller}: the data ({kind}) gives rows of one example each, not minibatches: its first item \
is {shapes}, leaf {label} 0-d (a label) beside leaf {features} of {size} values (features). \
Every item is read as one minibatch, its examples counted along every leaf's first axis. \
Read so, this row is a minibatch of {size} examples (the {size} features; {counted}) sharing \
the one label, and each step computes on one example, with no error. Read as a row (a \
map-style Dataset's item, a generator's record) it is 1 example: batch the rows into \
minibatches, every leaf with a leading (example) axis:

    wrong:  {wrong}                # items (x_i, y_i): one example each
    right:  {right}
       or:  {other}   # rows = list(dataset)

Items that are minibatches after all, with leaf {label} one value for the whole minibatch \
(a temperature, a loss weight), are read the same way: give that value once per example, \
and read it in the loss as batch{label}[0]:

    right:  {per_example}"""

# ROWS_FROM_LOADER's way through for minibatches with a per-minibatch 0-d leaf: it is broadcast
# along the features leaf's axis (the example axis then), the list re-iterable for every epoch.
_PER_EXAMPLE = "[jax.tree.map(lambda v: np.full(len(b{features}), v) if np.ndim(v) == 0 else v, b) for b in minibatches]"


def check_row_minibatch(batch: Any, data: Any, caller: str) -> None:
    """:data:`ROWS_FROM_LOADER` for a loader's first minibatch (as given, or converted by
    :func:`~functree.train.to_arrays`) that is one example: a 0-d leaf (not a PRNG key: a
    label) beside a leaf with an axis (its features), what a torch ``Dataset`` given for its
    ``DataLoader`` or a generator of records yields. Read as a minibatch it trained one
    example a step, its features counted as examples (lists of such rows are
    :func:`check_rows`'s)."""
    leaves = [(p, x, _rank(x)) for p, x in jax.tree_util.tree_flatten_with_path(batch, is_leaf=is_number_list)[0]]
    label = next((p for p, x, rank in leaves if rank == 0 and not _is_key(x)), None)
    features = next(((p, x) for p, x, rank in leaves if rank), None)
    if label is None or features is None:
        return
    size = len(features[1]) if is_number_list(features[1]) else np.shape(features[1])[0]
    name = jax.tree_util.keystr
    raise ValueError(ROWS_FROM_LOADER.format(
        caller=caller, kind=type(data).__name__, shapes=describe_batch(batch), label=name(label),
        features=name(features[0]) or "the item", size=size,
        counted=_ROWS_COUNTED.get(caller, "the means weigh each minibatch by them"),
        wrong=_called(caller, "dataset"), right=_called(caller, "torch.utils.data.DataLoader(dataset, batch_size=32)"),
        other=_called(caller, STACKED),
        per_example=_called(caller, _PER_EXAMPLE.format(features=name(features[0])))))


def _rank(x: Any) -> int:
    """A leaf's number of axes (a list of numbers, ragged too, has one at least)."""
    if is_number_list(x):
        return 1
    return np.ndim(x) if hasattr(x, "ndim") or isinstance(x, (int, float, complex)) else -1  # (-1: no number)


def _is_key(x: Any) -> bool:
    """A typed PRNG key (a per-minibatch key is no label)."""
    return jnp.issubdtype(getattr(x, "dtype", np.float32), jax.dtypes.prng_key)


def _shapes(items: list[Any]) -> str:
    """The first four items' ``dtype[shape]``, for the messages of a list of arrays."""
    return ", ".join(describe_batch(x) for x in items[:4]) + (", ..." if len(items) > 4 else "")


def _step_dtype(x: Any) -> str:
    """The name of the dtype a step sees of the minibatch ``x``: a torch or TF tensor's as
    :func:`~functree.train.to_arrays` converts it (an empty slice converted: ``torch.float32``
    is no NumPy dtype), then JAX's canonical one (float64 and int64 are float32 and int32
    without ``jax_enable_x64``: a list of NumPy float64 and JAX float32 minibatches is one
    dataset's)."""
    try:
        dtype = np.dtype(x.dtype)
    except (AttributeError, TypeError):  # torch.float32; an __array__ object without a dtype
        try:
            dtype = to_arrays(x[:0]).dtype
        except (TypeError, IndexError, AttributeError):  # not sliceable: the whole array read
            dtype = np.asarray(x).dtype
    return str(jax.dtypes.canonicalize_dtype(dtype, allow_extended_dtype=True))  # (key<fry>: a name too)


def _called(caller: str, data: str) -> str:
    """``caller``'s call with ``data``: ``trainer.fit([x, y], ...)``, and for fit's
    validation data ``trainer.fit(data, validation_data=[x, y])``."""
    if caller == VALIDATION:
        return f"trainer.fit(data, validation_data={data})"
    return f"{caller}({data}, ...)"


def _array_like(x: Any) -> bool:
    """An array of at least one axis: JAX's, NumPy's, or another library's that NumPy reads
    (``__array__``: a torch tensor, a TF tensor), cut by :func:`batches` as NumPy's."""
    if is_array_value(x):
        return np.ndim(x) >= 1
    shape = getattr(x, "shape", None)
    return hasattr(x, "__array__") and isinstance(shape, Sequence) and len(shape) >= 1


def _is_array_tree(data: Any) -> bool:
    """An array, or a tuple/dict of arrays (or of lists of numbers, which :func:`batches`
    reads as arrays, or of text, which it refuses naming the class indices to give):
    in-memory data to cut into minibatches. (A dict is never a loader:
    iterating it gives its keys.)"""
    if _array_like(data):
        return True
    if isinstance(data, (tuple, Mapping)):
        leaves = jax.tree.leaves(data, is_leaf=lambda x: is_number_list(x) or is_text(x))
        return bool(leaves) and all(_array_like(x) or is_number_list(x) or is_text(x) for x in leaves)
    return False


def cut_by_batch_size(data: Any) -> bool:
    """In-memory arrays that :func:`as_data` cuts into minibatches of ``batch_size``."""
    return not isinstance(data, Batches) and _is_array_tree(data)


def as_data(data: Any, batch_size: int | None, key: Any, shuffle: bool = True,
            caller: str = "trainer.fit") -> Any:
    """``data`` as minibatches: in-memory arrays (torch tensors too) cut by :func:`batches`
    (shuffled with ``fold_in(key, 1)``), anything else as it is; a ``batch_size`` that would
    not cut it is :data:`BATCH_SIZE_UNUSED`."""
    if isinstance(data, Batches) or not _is_array_tree(data):
        check_list_of_arrays(data, caller)
        check_rows(data, caller, batch_size)
        if batch_size is not None and not (isinstance(data, Batches) and data.batch_size == batch_size):
            own = f"; its own batch_size={data.batch_size!r}" if isinstance(data, Batches) else ""
            raise ValueError(BATCH_SIZE_UNUSED.format(caller=caller, size=batch_size,
                                                      kind=_kind(data), own=own))
        return data
    key = jax.random.fold_in(jax.random.key(0) if key is None else key, 1)
    return batches(data, 32 if batch_size is None else batch_size, shuffle=shuffle, key=key)


def _kind(data: Any) -> str:
    """``a list of 2 items``, ``a DataLoader``, ``ft.train.batches(...)``."""
    if isinstance(data, Batches):
        return "ft.train.batches(...)"
    if isinstance(data, (list, tuple)):
        return f"a {type(data).__name__} of {len(data)} items"
    return f"a {type(data).__name__}"


def _mid_epoch_change(job: JobState, length: int) -> str:
    """:data:`DATA_LENGTH_CHANGED_MID_EPOCH`: ``fit(data, steps=3)``, then ``fit(other, epochs=1)``
    with ``other`` of another length went on at minibatch 3 of ``other``: of 3 minibatches,
    the epoch ended at once and fit trained nothing on it, with no error (a restored job got
    :data:`DATA_LENGTH_CHANGED`)."""
    done = job.batch_in_epoch
    what = ("which has no such minibatch: the epoch would end with none of it trained on" if length <= done
            else f"its first {done} minibatches skipped")
    return DATA_LENGTH_CHANGED_MID_EPOCH.format(epoch=job.epoch, done=done, saved=job.epoch_length, step=job.steps_run,
                                                given=length, what=what, finish=job.epoch + 1)


def epoch_length(data: Any) -> int | None:
    """``len(data)``, None where it has none (or it fails: an endless tf.data dataset's raises)."""
    try:
        return len(data)
    except (TypeError, ValueError, OverflowError):
        return None


def endless(data: Any) -> tuple[str, str] | None:
    """``(why, a finite spelling of it)`` where ``data`` is known never to end (an epoch over it
    never ends), else None: it may end, or nothing tells (a generator, a torch
    IterableDataset end when they end). Known: ``itertools.cycle``/``count``, ``repeat``
    without ``times``; a length of ``sys.maxsize`` (grain's ``MapDataset.repeat()``), a
    grain ``DataLoader`` whose sampler repeats forever (``num_epochs=None``), a tf.data
    dataset of ``INFINITE_CARDINALITY`` (``Dataset.repeat()``)."""
    if isinstance(data, (itertools.cycle, itertools.count)):  # (count: of numbers, no minibatch)
        return f"itertools.{type(data).__name__} never runs out", "loader  # the iterable it cycled"
    if isinstance(data, itertools.repeat) and _hint(data) is None:
        return "itertools.repeat without times= repeats forever", "itertools.repeat(batch, 100)  # 100 a pass"
    length = epoch_length(data)
    if length is not None and length >= sys.maxsize:
        return ("len(data) is sys.maxsize, an endless dataset's (grain's MapDataset.repeat() with no "
                "num_epochs)", "dataset  # one pass: no .repeat()")
    module = getattr(type(data), "__module__", None) or ""
    if module.startswith("grain") and (epoch_length(getattr(data, "_sampler", None)) or 0) >= sys.maxsize:
        return ("its sampler repeats forever (grain's IndexSampler(num_epochs=None))",
                "loader  # grain.DataLoader(..., sampler=grain.samplers.IndexSampler(..., num_epochs=1))")
    if module.startswith("tensorflow") and _cardinality(data) == -1:  # tf.data.INFINITE_CARDINALITY
        return "its cardinality() is tf.data.INFINITE_CARDINALITY (Dataset.repeat())", "dataset  # one pass: no .repeat()"
    return None


def _hint(it: Any) -> int | None:
    """``it.__length_hint__()``, None where it raises (``itertools.repeat`` without times)."""
    try:
        return operator.index(it.__length_hint__())
    except TypeError:
        return None


def _cardinality(data: Any) -> int | None:
    try:
        return int(data.cardinality())
    except Exception:  # (a duck-typed read: anything else is not tf.data's)
        return None


def _has_position(it: Any) -> bool:
    """An iterator that reports and takes its position (grain's ``DatasetIterator``)."""
    return callable(getattr(it, "get_state", None)) and callable(getattr(it, "set_state", None))


def _torch_shuffles(data: Any) -> bool:
    """A torch ``DataLoader`` drawing its order from a ``RandomSampler`` (``shuffle=True``),
    whose generator's state is not in the checkpoint (torch not imported: named by type)."""
    if not type(data).__module__.startswith("torch.utils.data"):
        return False
    sampler = getattr(getattr(data, "batch_sampler", None), "sampler", getattr(data, "sampler", None))
    return type(sampler).__name__ == "RandomSampler"


def batch_size(batch: Any) -> int:
    """:func:`shared_batch_size` (the leading axis every array leaf shares, else an error
    naming two leaves), with a fast path for the common ``(x, y)`` tuple of arrays."""
    if type(batch) is tuple and batch:
        sizes = {shape[0] if shape else -1 for shape in (getattr(x, "shape", None) for x in batch)}
        if len(sizes) == 1 and -1 not in sizes:  # arrays of one leading size (no nested or 0-d leaf)
            return int(sizes.pop())
    return shared_batch_size(batch)


def batch_signature(batch: Any) -> tuple[Any, ...]:
    """A minibatch's structure, leaf shapes and dtypes: those of one stack. (A loader's int
    labels beside float ones stack into neither: ``stack_batches`` refuses the promotion, so
    each runs in a call of its own kind.)"""
    leaves, tree = jax.tree.flatten(batch)
    return tree, *((np.shape(x), getattr(x, "dtype", type(x))) for x in leaves)


class Epochs:
    """The current epoch's iterator over the fit's data, continued across ``fit`` calls
    (``iter(data)`` once per epoch), and whether the next one resumes a restored job."""

    __slots__ = ("accumulate", "first_shapes", "iterator", "of", "restored")

    def __init__(self) -> None:
        self.iterator: Any = None  # the current epoch's data iterator
        self.of: Any = None  # the data it iterates
        self.restored = False  # a restored job: the next epoch iterator is positioned
        self.first_shapes = ""  # the first minibatch's shapes, for the error of a malformed one
        self.accumulate = 1  # the optimizer's microbatches per step: each minibatch a multiple of it

    @staticmethod
    def check_counts(**counts: Any) -> list[int | None]:
        """Each of ``fit``'s counts (``epochs=``, ``steps=``, ``log_every=``) as a Python int
        (or None): a positive integer of any integer type (``np.int64`` from arithmetic on
        array sizes is common), never a bool or a float."""
        checked: list[int | None] = []
        for what, value in counts.items():
            if value is not None:
                try:  # operator.index: ints and integer scalars (NumPy, JAX), not 10.0 or True
                    value = None if isinstance(value, (bool, np.bool_)) else operator.index(value)
                except TypeError:
                    value = None
                if value is None and what == "epochs" and np.ndim(counts[what]) >= 1:
                    raise ValueError(KERAS_POSITIONAL.format(shape=np.shape(counts[what])))
                if value is None or value < 1:
                    raise ValueError(BAD_LENGTH.format(what=what, value=counts[what]))
            checked.append(value)
        return checked

    def forget(self, restored: bool = False) -> None:
        """No live iterator: the next epoch's is made from the job's position."""
        self.iterator = self.of = None
        self.restored = self.restored or restored

    def iterate(self, data: Any, job: JobState) -> Iterator[Any]:
        """The minibatches from the job's position (a restored ``job.data_state`` is used
        once: the caller commits it as consumed)."""
        if isinstance(data, Batches):
            return data.iterate(job.epoch, job.batch_in_epoch)
        if self.iterator is not None and self.of is data:
            return self.iterator  # the same fit data, continued: iter() once per epoch
        it = iter(data)
        stream = it is data
        if self.restored and job.epoch and _torch_shuffles(data):  # (epoch 0: the fresh generator's order is right)
            warnings.warn(TORCH_SHUFFLE_RESUME.format(epoch=job.epoch, step=job.steps_run), stacklevel=4)
        if job.data_state is not None and _has_position(it):
            it.set_state(job.data_state)
        elif self.restored and (job.batch_in_epoch or (stream and job.steps_run)):
            if stream:
                warnings.warn(ONE_SHOT_RESUME.format(kind=type(data).__name__, step=job.steps_run), stacklevel=4)
            else:
                it = itertools.islice(it, job.batch_in_epoch, None)
        elif job.batch_in_epoch and not stream:  # an epoch ended early by an exception or a stop
            it = itertools.islice(it, job.batch_in_epoch, None)
        self.restored = False
        self.iterator, self.of = it, data
        return it

    def position(self, job: JobState) -> Any:
        """The position of the data iterator that reports one (for a checkpoint)."""
        it = self.iterator
        if it is None or not _has_position(it) or not (job.batch_in_epoch or it is self.of):
            return None
        state = it.get_state()
        if not storable(state):  # (JSON values and bytes: grain's DataLoader gives bytes)
            raise ValueError(DATA_STATE_NOT_STORABLE.format(kind=type(it).__name__, given=repr(state)[:120]))
        return state

    def check_data(self, data: Any, epochs: int | None, steps: int | None, job: JobState,
                   accumulate: int = 1, validation_data: Any = None) -> None:
        """A one-shot iterator cannot run several epochs, nor validate at several epoch
        ends; a restored job mid-epoch continues only on data of the length it was trained
        on; under ``accumulate=k``, ``ft.train.batches`` of a fixed size must cut
        minibatches of multiples of ``k`` (refused here, not at the epoch's last step);
        validation data that is ``[x, y]``, or sharded batches whose last minibatch the shares
        cannot split, is refused before the first epoch, not at its end."""
        self.accumulate = accumulate
        _check_ends(data, epochs, steps, validation_data)
        check_list_of_arrays(validation_data, VALIDATION)
        check_rows(validation_data, VALIDATION, None)
        if isinstance(validation_data, Batches):  # its last minibatch, read at the epoch's end
            validation_data.check_in_order()
        if isinstance(validation_data, Iterator) and _epoch_ends(data, epochs, steps, job) > 1:
            count = f"steps={steps}" if steps is not None else f"epochs={epochs}"
            raise ValueError(ONE_SHOT_VALIDATION.format(count=count, kind=type(validation_data).__name__))
        if accumulate > 1 and isinstance(data, Batches):
            _check_accumulable(data, accumulate, steps, job)
        if steps is None and epochs is not None and epochs - job.epoch > 1 and isinstance(data, Iterator):
            raise ValueError(ONE_SHOT.format(epochs=epochs, kind=type(data).__name__))
        length = epoch_length(data)
        if job.batch_in_epoch and length is not None and job.epoch_length is not None and length != job.epoch_length:
            if self.restored:
                raise ValueError(DATA_LENGTH_CHANGED.format(saved=job.epoch_length, given=length, step=job.steps_run))
            raise ValueError(_mid_epoch_change(job, length))

    @staticmethod
    def past_length(data: Any, length: int, job: JobState) -> ValueError:
        """The error of a minibatch past ``len(data)``, raised before it runs: its step would
        store a position past the epoch's end, which a restore refuses
        (``_job.PAST_EPOCH_END``). (An error, not torch's warning with the length then
        unknown: a wrong len() is wrong again at every resume, which skips by it.)"""
        return ValueError(LONGER_THAN_LEN.format(step=job.steps_run + 1, kind=type(data).__name__,
                                                 index=job.batch_in_epoch, epoch=job.epoch, length=length,
                                                 last=job.steps_run))

    def minibatch_size(self, batch: Any, job: JobState, offset: int) -> int:
        """The minibatch's size; an empty minibatch is an error naming it (before it
        reaches a step)."""
        try:
            size = batch_size(batch)
        except ValueError as e:  # leaves of two leading sizes: which minibatch (the data may mix)
            e.add_note(f"step {job.steps_run + offset + 1}: minibatch {job.batch_in_epoch + offset} of epoch "
                       f"{job.epoch} (counted from 0); it was not run.")
            raise
        if size % self.accumulate:  # (data of unknown sizes: found here, before its step)
            k, step = self.accumulate, job.steps_run + offset + 1
            raise ValueError(ACCUMULATE_UNEVEN.format(
                k=k, which=f"minibatch {job.batch_in_epoch + offset} of epoch {job.epoch} (counted from 0)",
                rows=size, when=f": step {step} was not run, the steps before it were", wrong="loader",
                right=f"torch.utils.data.DataLoader(dataset, batch_size={4 * k}, drop_last=True)",
                note=f"\n       or:  trainer.fit(ft.train.batches((x, y), {4 * k}, drop_last=True), ...)"))
        if size == 0:
            raise ValueError(EMPTY_MINIBATCH.format(step=job.steps_run + offset + 1, index=job.batch_in_epoch + offset,
                                                    epoch=job.epoch, shapes=describe_batch(batch)))
        return size

    def located(self, error: Exception, batch: Any, job: JobState, offset: int) -> Exception:
        """``error`` of the step on the minibatch ``offset`` after the job's position, its
        message prefixed with the step, the minibatch, the epoch and the shapes (an
        exception whose text is not its message gets them as a note). A refusal of the
        optimizer's configuration (:class:`ConfigurationError`) or of a metric's signature
        (:class:`MetricCallError`) is returned as it is: any minibatch would get it."""
        if isinstance(error, (ConfigurationError, MetricCallError)):
            return error
        first = f"; the trainer's first minibatch had {self.first_shapes}" if self.first_shapes else ""
        text = MALFORMED_MINIBATCH.format(step=job.steps_run + offset + 1, index=job.batch_in_epoch + offset,
                                          epoch=job.epoch, shapes=describe_batch(batch), first=first, error=error)
        located = with_location(error, text)
        ragged = _ragged_paths(batch)
        if ragged:  # (the step's own error, deep in JAX, does not say padding)
            located.add_note(RAGGED_MINIBATCH.format(paths=", ".join(ragged)))
        items = list_of_arrays(self.of)
        if items is not None:  # [x, y] for (x, y): each array a minibatch of its own
            item = f"data[{job.batch_in_epoch + offset}]"  # the list's item (batch: it converted)
            located.add_note(LIST_ITEM_IS_MINIBATCH.format(caller="trainer.fit", n=len(items), shapes=_shapes(items),
                                                           item=item))
        return located


def _ragged_paths(batch: Any) -> list[str]:
    """Key paths of the lists of numbers of unequal lengths in ``batch``."""
    leaves = jax.tree_util.tree_leaves_with_path(batch, is_leaf=is_number_list)
    return [jax.tree_util.keystr(path) for path, x in leaves if is_number_list(x) and not _rectangular(x)]


def _rectangular(x: list[Any]) -> bool:
    try:
        np.asarray(x)
    except ValueError:
        return False
    return True


def _check_ends(data: Any, epochs: int | None, steps: int | None, validation_data: Any) -> None:
    """Refuse data known never to end (:func:`endless`) where fit needs an epoch's end:
    without ``steps=`` (:data:`ENDLESS_DATA`: the first epoch never ends, fit hung), or with
    ``validation_data`` (:data:`ENDLESS_VALIDATION`: it would never be evaluated), and
    endless validation data (:data:`ENDLESS_VALIDATION_DATA`). Finite data without a length
    (a generator) ends its epoch where it runs out, as before."""
    if validation_data is not None and (ends := endless(validation_data)) is not None:
        finite, _, note = ends[1].partition("  # ")
        raise ValueError(ENDLESS_VALIDATION_DATA.format(kind=type(validation_data).__name__, why=ends[0],
                                                        finite=finite, note=note))
    ends = endless(data)
    if ends is None:
        return
    why, (finite, _, note) = ends[0], ends[1].partition("  # ")
    if steps is None:
        raise ValueError(ENDLESS_DATA.format(epochs=epochs, kind=type(data).__name__, why=why, finite=finite,
                                             note=note))
    if validation_data is not None:
        raise ValueError(ENDLESS_VALIDATION.format(steps=steps, kind=type(data).__name__, why=why, finite=finite,
                                                   note=note))


def _epoch_ends(data: Any, epochs: int | None, steps: int | None, job: JobState) -> int:
    """How many epoch ends ``fit`` reaches at most (1 where unknown: steps of data of
    unknown length)."""
    ends = epochs - job.epoch if epochs is not None else None
    length = epoch_length(data)
    if steps is not None and length:  # the ends within the steps left, from the job's position
        by_steps = (job.batch_in_epoch + steps - job.steps_run) // length
        ends = by_steps if ends is None else min(ends, by_steps)
    return 1 if ends is None else ends


def _check_accumulable(data: Batches, k: int, steps: int | None, job: JobState) -> None:
    """:data:`ACCUMULATE_UNEVEN` for ``ft.train.batches`` of a fixed size whose minibatches
    (or its last one, of ``n % batch_size`` rows, where ``steps=`` reaches it) are not
    multiples of ``k``. The fix: a multiple of ``k`` near the size, and ``drop_last=True``
    where ``n % size`` still is not (no size fixes it when ``n`` is not a multiple of ``k``:
    ``n % size ≡ n (mod k)``)."""
    size, n = data.batch_size, data.num_examples
    if not isinstance(size, int) or data.shard is not None:  # sizes known only as they come
        return
    reached = steps is None or steps - job.steps_run >= len(data) - job.batch_in_epoch
    rest = n % size if reached and not data.drop_last else 0
    if size % k == 0 and rest % k == 0:
        return
    good = k * max(1, round(size / k))
    drop = n % good % k != 0 or data.drop_last
    which = f"each minibatch (batch_size={size})" if size % k else \
        f"the last minibatch of each epoch ({n} examples in minibatches of {size})"
    left = f"   # the last {n % good} examples of each shuffled epoch left out" if drop and n % good else ""
    raise ValueError(ACCUMULATE_UNEVEN.format(
        k=k, which=which, rows=size if size % k else rest, when=" (refused before the first step)",
        wrong=f"ft.train.batches(data, {size}{', drop_last=True' if data.drop_last else ''})",
        right=f"ft.train.batches(data, {good}{', drop_last=True' if drop else ''})", note=left))


def with_location(error: Exception, text: str) -> Exception:
    """``error`` with ``text`` (which ends with " The error:" and the error itself) as its
    message; an exception whose text is not its message gets the location as a note."""
    original = error.args
    error.args = (text,)
    if str(error) != text:
        error.args = original
        error.add_note(text.split(" The error:")[0])
    return error
