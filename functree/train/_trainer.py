"""``ft.train.Trainer``: seed 003's trainer: model, loss, learner, reader, progress callback.

The loop never blocks per step: each step is one call of the :class:`TrainStep`'s own
jitted, donated program (with ``steps_per_call=k``, one call per ``k`` steps), which also
writes its metrics into a device buffer (:meth:`TrainStep.record`); every ``log_every``
steps the host closes the buffer and reads the one closed before it (``_intervals.py``:
the read never waits for queued steps), and at epoch ends all of them (one transfer
each), then updates the history, the progress bar and the callbacks.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import json
import logging
import math
import signal
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from functree import nn
from functree._alias import copy_aliases, warn_aliases
from functree._jit import eval_shape, has_untraceable_leaves, unchecked_jit
from functree.optim import next_sweep
from functree.optim._average import averaged as averaged_parameters
from functree.optim._average import keeps_average
from functree.optim._hyper import learning_rate_names
from functree.optim._optimizer import with_wrt
from functree.optim._skip import DEFAULT_ON_NAN
from functree.train._callbacks import Callback, ModelCheckpoint, TrainingContext, _copy, as_callback
from functree.train._checkpoint import Checkpoint, CheckpointManager
from functree.train._data import Batches, batches, to_arrays
from functree.train._history import History
from functree.train._intervals import Interval, next_buffer, snapshot, to_host
from functree.train._metrics import batch_size_of, describe_batch
from functree.train._progress import Progress
from functree.train._scan import check_steps_per_call, stack_batches
from functree.train._step import (
    NONFINITE,
    NonFiniteError,
    TrainStep,
    eval_step,
    nonfinite_error,
    parameter_names,
    step_provenance,
)
from functree.train._step import train_step as make_train_step

__all__ = ["Trainer", "NonFiniteError"]

WRT_WITH_STEP = """\
Trainer(wrt=...) cannot change a TrainStep instance's optimizer: the step was built with its own.
Give the patterns to the optimizer the step is built with:

    wrong:  ft.train.Trainer(model, opt, loss_fn, train_step=ft.train.TrainStep(loss_fn, opt), wrt="head.*")
    right:  opt = ft.optim.Optimizer(ft.optim.adam(1e-3), wrt="head.*")
            ft.train.Trainer(model, opt, loss_fn, train_step=ft.train.TrainStep(loss_fn, opt))"""

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

BAD_LENGTH = """\
{what} must be a positive int, got {value!r}.
    right:  trainer.fit(data, epochs=10)   or   trainer.fit(data, steps=1000)"""

BAD_TRAIN_STEP = """\
train_step= takes a ft.train.TrainStep subclass or instance, got {given}.

    right:  class MyStep(ft.train.TrainStep):
                def compute_loss(self, model, batch, key=None): ...
            ft.train.Trainer(model, optimizer, loss_fn, train_step=MyStep)"""


LOSS_NEEDS_KEY = """\
The loss function {name}{signature} requires a PRNG key, but the Trainer has none: \
every training step calls loss_fn(model, batch, key=...) with a fresh key derived from \
the Trainer's.

    wrong:  ft.train.Trainer(model, optimizer, loss_fn)
    right:  ft.train.Trainer(model, optimizer, loss_fn, key=jax.random.key(0))"""

LOSS_TAKES_NO_KEY = """\
The Trainer has a PRNG key, so every training step calls loss_fn(model, batch, key=...) \
with a fresh key derived from it, but the loss function {name}{signature} takes no key. \
Pass the key on to the model's random layers (Dropout), or give the Trainer none (arrays \
are shuffled either way):

    wrong:  ft.train.Trainer(model, optimizer, lambda m, b: mse(m(b[0]), b[1]), key=jax.random.key(0))
    right:  ft.train.Trainer(model, optimizer, lambda m, b, key=None: mse(m(b[0], key=key), b[1]),
                             key=jax.random.key(0))
       or:  ft.train.Trainer(model, optimizer, lambda m, b: mse(m(b[0]), b[1]))"""

EMPTY_MINIBATCH = """\
step {step}: minibatch {index} of epoch {epoch} is empty (0 examples; minibatches and epochs \
counted from 0, as trainer.batch_in_epoch and trainer.epoch). Its shapes: {shapes}.
A step needs at least one example; drop empty minibatches where the data is made:

    wrong:  loader = [(x[i:i + 32], y[i:i + 32]) for i in range(0, len(x) + 32, 32)]
    right:  loader = [(x[i:i + 32], y[i:i + 32]) for i in range(0, len(x), 32)]
       or:  ft.train.batches((x, y), batch_size=32)"""

MALFORMED_MINIBATCH = """\
step {step}: minibatch {index} of epoch {epoch} (counted from 0) failed in the training step. \
Its shapes: {shapes}{first}. The error:
{error}"""

ONE_SHOT_RESUME = """\
The restored trainer is at step {step}, but {kind} is a one-shot iterator that cannot report \
or set its position (no get_state()/set_state()): it is used as if it started right after \
step {step}. If it starts at the beginning of the data, the job would train on those \
minibatches again. Give an iterator that starts where the job stopped, or one with a position:

    right:  trainer.fit(itertools.islice(generator(), trainer.steps_run, None), steps=1000)
       or:  an iterator with get_state() -> JSON and set_state(state) (as grain's iterators)"""

DATA_LENGTH_CHANGED = """\
The restored job was trained on data of {saved} minibatches per epoch, but fit was given \
{given}: its position (step {step}) would point into other data. Resume with the data the \
job was trained on, or start a new job (a fresh Trainer) for new data:

    wrong:  trainer.restore(path); trainer.fit(other_data, epochs=10)
    right:  trainer.restore(path); trainer.fit(same_data, epochs=10)"""

DATA_STATE_NOT_JSON = """\
The data iterator ({kind}) reports its position with get_state(), but {given} is not \
JSON (numbers, strings, lists, dicts), so it cannot go into the checkpoint's metadata.
Return a JSON-able position from get_state(), e.g. {{"epoch": 3, "index": 120}}."""

BAD_EXTRA = """\
extra= must be a tree (dicts, lists, tuples, None) of arrays and plain numbers, but \
{path} is {given}.

    wrong:  trainer.save(path, extra={{"note": object()}})
    right:  trainer.save(path, extra={{"rounds": 3, "ema": ema_params, "data": np.asarray(position)}})"""

CALLBACK_MISMATCH = """\
The restored checkpoint holds the state of callback {key!r} ({cls}), but this fit's \
callbacks are {given}; the checkpoint's stateful callbacks are {saved}.
Pass the same callbacks as the run that saved it (in the same order, or each with the \
same callback.name), or restore without their states:

    right:  trainer.fit(data, epochs=10, callbacks=[ft.train.EarlyStopping(patience=6), checkpoints])
       or:  trainer.restore(path, callbacks=False)"""

ALREADY_DONE = "Trainer.fit at step {step}, epoch {epoch}: nothing to train, the job {why}."

_LOG = logging.getLogger("functree.train")

_KEEP: Any = object()
"""``Trainer.save(extra=)`` not given: the trainer's :attr:`extra` is saved."""

EVAL_KEY_SALT = 0x5EED
"""Folded into the trainer's key for evaluation and prediction keys (distinct from the
training steps' ``fold_in(key, step)`` and the shuffling key ``fold_in(key, 1)``)."""


def _is_array(x: Any) -> bool:
    return isinstance(x, (np.ndarray, jax.Array))


def _batch_size(batch: Any) -> int:
    """:func:`batch_size_of`, with a fast path for the common ``(x, y)`` tuple of arrays."""
    if type(batch) is tuple and batch:
        shape = getattr(batch[0], "shape", ())
        if len(shape) >= 1:
            return int(shape[0])
    return batch_size_of(batch)


def _batch_signature(batch: Any) -> tuple[Any, ...]:
    """A minibatch's structure and leaf shapes: those of one signature stack."""
    leaves, tree = jax.tree.flatten(batch)
    return tree, *(np.shape(x) for x in leaves)


def _is_array_tree(data: Any) -> bool:
    """An array, or a tuple/dict of arrays: in-memory data to cut into minibatches."""
    if _is_array(data):
        return True
    if isinstance(data, (tuple, Mapping)):
        leaves = jax.tree.leaves(data)
        return bool(leaves) and all(_is_array(x) and np.ndim(x) >= 1 for x in leaves)
    return False


def _inputs(batch: Any) -> Any:
    """The model inputs of a batch: ``batch[0]``, ``batch["x"]``-like, or the batch."""
    if isinstance(batch, (tuple, list)):
        return batch[0]
    if isinstance(batch, Mapping):
        for name in ("x", "inputs", "input", "image", "images", "features"):
            if name in batch:
                return batch[name]
    return batch


def key_parameter(fn: Callable[..., Any]) -> str | None:
    """Whether ``fn`` takes ``key=``: ``"required"``, ``"optional"`` (a default, or
    ``**kwargs``) or None (no such keyword, or no signature to read).

    Example:
      >>> key_parameter(lambda m, b, *, key: 0), key_parameter(lambda m, b, key=None: 0)
      ('required', 'optional')
      >>> key_parameter(lambda m, b: 0) is None
      True
    """
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return None
    p = params.get("key")
    if p is None:
        return "optional" if any(q.kind is q.VAR_KEYWORD for q in params.values()) else None
    if p.kind in (p.POSITIONAL_ONLY, p.VAR_POSITIONAL):
        return None
    return "required" if p.default is p.empty else "optional"


def _positive(what: str, value: Any) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ValueError(BAD_LENGTH.format(what=what, value=value))


class _Means:
    """Host-side weighted means: Σ n·v / Σ n over the steps applied. A step skipped under
    ``on_nan="skip"`` is left out of the means and counted in ``skipped``; a non-finite
    value of an applied step (``on_nan="ignore"``) makes its mean NaN."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.weight = 0.0
        self.skipped = 0

    @staticmethod
    def terms(values: Mapping[str, np.ndarray], weights: np.ndarray,
              applied: np.ndarray | None = None) -> tuple[dict[str, list[float]], list[float], int]:
        """``(n·v per name, n, steps skipped)`` of an interval's steps, for :meth:`add_terms`
        (once for the log window and the epoch)."""
        skipped = 0
        if applied is not None and not applied.all():
            skipped = int(np.sum(~applied))
            values = {k: v[applied] for k, v in values.items()}
            weights = weights[applied]
        return {name: (column * weights).tolist() for name, column in values.items()}, weights.tolist(), skipped

    def add_terms(self, products: Mapping[str, list[float]], weights: list[float], skipped: int) -> None:
        self.skipped += skipped
        # Step by step in float64: the sums do not depend on where the intervals were cut
        # (a resumed job's means equal the uninterrupted job's bit for bit). A plain loop,
        # not sum(): Python 3.12's sum() of floats compensates (another result).
        for name, column in products.items():
            total = self.sums.get(name, 0.0)
            for x in column:
                total += x
            self.sums[name] = total if math.isfinite(total) else math.nan
        weight = self.weight
        for w in weights:
            weight += w
        self.weight = weight

    def means(self) -> dict[str, float]:
        """The means (NaN where every step added was skipped)."""
        return {k: v / self.weight if self.weight else math.nan for k, v in self.sums.items()}

    def state(self) -> dict[str, Any]:
        return {"sums": dict(self.sums), "weight": self.weight, "skipped": self.skipped}

    @staticmethod
    def load(state: Any) -> _Means:
        means = _Means()
        if isinstance(state, Mapping):
            means.sums = {str(k): float(v) for k, v in state.get("sums", {}).items()}
            means.weight = float(state.get("weight", 0.0))
            means.skipped = int(state.get("skipped", 0))
        return means


_NO_BAR = Progress(None, enabled=False)


def _has_position(it: Any) -> bool:
    """An iterator that reports and takes its position (grain's ``DatasetIterator``)."""
    return callable(getattr(it, "get_state", None)) and callable(getattr(it, "set_state", None))


def _reads_model(cb: Callback) -> bool:
    """A callback whose ``on_log`` may read ``trainer.model``: log intervals are read at once."""
    return type(cb).on_log is not Callback.on_log and bool(getattr(cb, "reads_model", True))


def _callback_keys(cbs: Sequence[Callback]) -> list[str]:
    """Each callback's name for its saved state: ``name``, else ``Class[i]`` (the i-th of its class)."""
    counts: dict[str, int] = {}
    keys = []
    for cb in cbs:
        cls = type(cb).__name__
        if cb.name:
            keys.append(str(cb.name))
        else:
            keys.append(f"{cls}[{counts.get(cls, 0)}]")
            counts[cls] = counts.get(cls, 0) + 1
    return keys


_PLAIN = (jax.Array, np.ndarray, np.generic, bool, int, float, complex)


def _check_extra(extra: Any) -> None:
    for path, leaf in jax.tree_util.tree_flatten_with_path(extra)[0]:
        if not isinstance(leaf, _PLAIN) or (isinstance(leaf, np.ndarray) and leaf.dtype.hasobject):
            where = f"extra{jax.tree_util.keystr(path)}" if path else "extra"
            raise TypeError(BAD_EXTRA.format(path=where, given=f"{type(leaf).__name__} {repr(leaf)[:60]}"))


class Trainer:
    """Fit a model: ``Trainer(model, optimizer, loss_fn, metrics=...).fit(data, epochs=...)``.

    Args:
      model: the initial model (copied: the caller's arrays stay valid; the trainer's
        steps donate their own). Trained in ``ft.nn.training`` mode, evaluated in
        ``ft.nn.inference`` mode: ``trainer.model`` is the training-mode model (Dropout
        there needs a key), :attr:`inference_model` the one to call for predictions.
        Leaves that are not arrays (an Equinox module's functions) are kept static.
      optimizer: a ``ft.optim.Optimizer`` or an optax transformation.
      loss_fn: ``loss_fn(model, batch)`` → loss or ``(loss, aux)``; with ``key=`` given to
        the Trainer, ``loss_fn(model, batch, *, key)`` (a fresh key every step).
        :meth:`evaluate` and validation call a loss that takes ``key`` with a fixed
        evaluation key (the model is in inference mode there, so Dropout ignores it).
      metrics: ``{name: fn(StepOutput)}`` or a list (``ft.train.accuracy``,
        ``ft.train.mean("mse")``); ``loss`` is always recorded.
      key: base PRNG key for the loss (dropout) and for shuffling in-memory data.
      on_nan: ``"stop"`` (default, as in :class:`TrainStep`: raise :class:`NonFiniteError`
        naming the step and the first parameter whose gradient was not finite; that step
        is not applied), ``"skip"`` (skip such steps, recorded in ``trainer.skipped``) or
        ``"ignore"``. A step an optimizer handles itself (a loss-scale overflow) is
        neither.
      opt_state: an optimizer state to continue from (default ``optimizer.init(model)``).
      train_step: a :class:`TrainStep` subclass (or instance) with overridden stages.
      wrt: key-path patterns of the parameters to train (``ft.optim.Optimizer(wrt=)``);
        the others stay bit for bit and get no optimizer state.
      steps_per_call: run ``k`` steps per compiled call (``TrainStep(steps_per_call=k)``):
        the Trainer stacks ``k`` minibatches from any iterable (a shorter group, at the
        end of an epoch or of ``steps=``, or minibatches of another shape, run as single
        steps). The history still has one row per step; callbacks, logging and
        checkpoints happen between calls. Default: the ``train_step`` instance's, else 1.

    What callbacks see: ``on_log`` gets the :class:`TrainingContext` of a log interval
    (``context.step`` its last step), read one interval late so that the host never waits
    for the device; a callback that overrides ``on_log`` and reads ``trainer.model`` /
    ``trainer.opt_state`` (``Callback.reads_model``, True by default) makes the Trainer
    read each interval as it ends, so the model it sees is the one after
    ``context.step``. ``on_epoch_end``, ``on_train_end`` and checkpoints
    (:class:`ModelCheckpoint`) always see the model of their step. ``fit(epochs=N)`` /
    ``fit(steps=N)`` count the whole job; :meth:`save` / :meth:`restore` carry all of it
    (guide: ``docs/guides/training-jobs.md``).

    Example:
      >>> import functree as ft, jax, jax.numpy as jnp, numpy as np
      >>> x = np.random.default_rng(0).normal(size=(64, 3)).astype(np.float32)
      >>> y = x @ np.array([[1.0], [-2.0], [0.5]], np.float32)
      >>> def loss_fn(model, batch):
      ...     x, y = batch
      ...     return jnp.mean((model(x) - y) ** 2)
      >>> trainer = ft.train.Trainer(ft.nn.Dense(3, 1, key=jax.random.key(0)),
      ...                            ft.optim.Optimizer(ft.optim.adam(0.1)), loss_fn)
      >>> history = trainer.fit(ft.train.batches((x, y), 16), epochs=30, progress=False)
      >>> len(history.steps["loss"]), len(history.epochs["loss"])
      (120, 30)
      >>> bool(history.epochs["loss"][-1] < 1e-2)
      True
      >>> sorted(trainer.evaluate((x, y)))
      ['loss']
      >>> trainer.inference_model(x[:2]).shape  # the trained model, for predictions
      (2, 1)
    """

    def __init__(
        self,
        model: Any,
        optimizer: Any,
        loss_fn: Callable[..., Any],
        *,
        metrics: Mapping[str, Any] | Sequence[Any] | None = None,
        key: jax.Array | None = None,
        on_nan: str | None = DEFAULT_ON_NAN,
        opt_state: Any = None,
        train_step: type[TrainStep] | TrainStep | None = None,
        mesh: Any = None,
        data_axis: str = "data",
        sharding: Any = None,
        compute_dtype: Any = None,
        wrt: Any = None,
        steps_per_call: int | None = None,
    ):
        parallel: dict[str, Any] = {}
        if mesh is not None or sharding is not None or compute_dtype is not None:
            parallel = {"mesh": mesh, "data_axis": data_axis, "sharding": sharding, "compute_dtype": compute_dtype}
        if wrt is not None and isinstance(train_step, TrainStep):
            raise ValueError(WRT_WITH_STEP)
        optimizer = with_wrt(optimizer, wrt)
        self.train_step = self._make_step(train_step, loss_fn, optimizer, metrics, on_nan, parallel)
        self.optimizer = self.train_step.optimizer
        self.eval_step = eval_step(loss_fn, metrics=self.train_step.metrics, **parallel)
        self.on_nan = self.train_step.on_nan
        self.steps_per_call = check_steps_per_call(
            getattr(self.train_step, "steps_per_call", 1) if steps_per_call is None else steps_per_call)
        self._loss_key = key_parameter(loss_fn)
        if self._loss_key == "required" and key is None and train_step is None:
            raise ValueError(LOSS_NEEDS_KEY.format(
                name=getattr(loss_fn, "__name__", "loss_fn"), signature=_signature(loss_fn)))
        if self._loss_key is None and key is not None and train_step is None and _signature(loss_fn):
            raise ValueError(LOSS_TAKES_NO_KEY.format(
                name=getattr(loss_fn, "__name__", "loss_fn"), signature=_signature(loss_fn)))
        # An accidental tie (one array at two leaves) is named once here; _copy unties it.
        warn_aliases(model, what="The model given to ft.train.Trainer")
        self.model = _copy(nn.training(model))
        # Every buffer is the Trainer's own: the copies above, and Optimizer.init's state
        # (which never shares a buffer with the model).
        self.opt_state = self.optimizer.init(self.model) if opt_state is None else _copy(opt_state)
        placement = getattr(self.train_step, "placement", None)
        if placement is not None:  # a step over a mesh: arrays on it by its rules
            self.model, self.opt_state = placement.place(self.model, self.opt_state)
        self.key = key
        self.history = History()
        self.steps_run = 0
        self.epoch = 0
        self.batch_in_epoch = 0
        self.stop_training = False
        self.skipped: list[tuple[int, str]] = []
        self.nan_report: Any = None  # ft.NaNReport of the first stopped or skipped step
        self._buffer: Any = None
        self._buffered = 0
        self._capacity = 0  # rows of the buffer: log_every + steps_per_call - 1
        self._pending: list[Interval] = []  # closed log intervals not read yet (_intervals.py)
        self._names: list[str] | None = None
        self._rates: list[str] = []  # the learning rates' names: the buffer's last columns
        self._first_shapes = ""  # the first minibatch's shapes, for the error of a malformed one
        self._param_names: list[str] | None = None
        self._last_context: Any = None
        # (batch, size) of each step since the last read: references, no copies; the sizes,
        # known when each step ran, weigh the means
        self._inflight: list[tuple[Any, int]] = []
        self._window, self._epoch_means = _Means(), _Means()  # the log window's and the epoch's means
        self._since_log = 0  # steps since the last log point (or epoch end)
        self._last_log: dict[str, float] = {}  # the last log interval's metrics
        self._sync_logs = False  # a callback reads the model at on_log: read intervals at once
        self._save_every: list[int] = []  # ModelCheckpoint(every_steps=) of the current fit
        self._callbacks: list[Callback] = []  # the last fit's: their states go into checkpoints
        self._saved_callbacks: Any = None  # restored callback states, for the next fit
        self._iterator: Any = None  # the current epoch's data iterator
        self._iterator_of: Any = None  # the data it iterates
        self._data_state: Any = None  # a restored iterator position (get_state())
        self._saved_length: int | None = None  # minibatches per epoch of the job's data
        self._restored = False  # restored: the next epoch iterator is positioned
        self._bar: Progress | None = None
        self._critical = self._deferred = self._terminate = False  # signals inside fit
        self.preempted = False  # the last fit stopped at a SIGTERM
        self.extra: Any = None  # user state saved with every checkpoint (Trainer.save(extra=))
        self.checkpoint: Checkpoint | None = None  # the Checkpoint the last restore read
        static = has_untraceable_leaves(self.model)  # Equinox submodules keep functions
        self._eval_fused = self.eval_step.summing(static)  # one program per configuration in the process
        self._predict = unchecked_jit(_call_predict, static_argnums=2, static_leaves=static)

    @staticmethod
    def _make_step(train_step: Any, loss_fn: Any, optimizer: Any, metrics: Any, on_nan: Any,
                   parallel: dict[str, Any]) -> TrainStep:
        if train_step is None:
            return make_train_step(loss_fn, optimizer, metrics=metrics, on_nan=on_nan, **parallel)
        if isinstance(train_step, TrainStep):
            return train_step
        if isinstance(train_step, type) and issubclass(train_step, TrainStep):
            return train_step(loss_fn, optimizer, metrics=metrics, on_nan=on_nan, **parallel)
        raise TypeError(BAD_TRAIN_STEP.format(given=repr(train_step)[:80]))

    # --- the jitted programs -------------------------------------------------------------
    def _new_buffer(self, capacity: int) -> Any:
        assert self._names is not None
        self._rates = learning_rate_names(self.opt_state)  # "learning_rate", or "<group>/learning_rate" each
        columns = len(self._names) + len(self._rates)
        return {"halt": jnp.array([0, -1, -1], jnp.int32),  # steps, the step that stopped, its report
                "rows": jnp.zeros((capacity, columns), jnp.float32)}  # one row per step: TrainStep.record

    def _metric_means(self, means: _Means) -> dict[str, float]:
        """``means.means()``, with ``skipped`` (steps left out) under ``on_nan="skip"``."""
        values = means.means()
        if self.on_nan == "skip":
            values["skipped"] = means.skipped
        return values

    def _located(self, error: Exception, batch: Any, offset: int) -> Exception:
        """``error`` of the step on the minibatch ``offset`` after the current position,
        its message prefixed with the step, the minibatch, the epoch and the shapes (an
        exception whose text is not its message gets them as a note)."""
        first = f"; the trainer's first minibatch had {self._first_shapes}" if self._first_shapes else ""
        text = MALFORMED_MINIBATCH.format(step=self.steps_run + offset + 1, index=self.batch_in_epoch + offset,
                                          epoch=self.epoch, shapes=describe_batch(batch), first=first,
                                          error=error)
        original = error.args
        error.args = (text,)
        if str(error) != text:
            error.args = original
            error.add_note(text.split(" The error:")[0])
        return error

    def _check_minibatch(self, batch: Any, offset: int) -> int:
        """The minibatch's size; an empty minibatch is an error naming it (before it
        reaches a step)."""
        size = _batch_size(batch)
        if size == 0:
            raise ValueError(EMPTY_MINIBATCH.format(step=self.steps_run + offset + 1,
                                                    index=self.batch_in_epoch + offset, epoch=self.epoch,
                                                    shapes=describe_batch(batch)))
        return size

    def _metric_names(self, batch: Any) -> list[str]:
        """The step's metrics in the order it returns them (``nonfinite`` included)."""
        if type(self.train_step).compute_metrics is TrainStep.compute_metrics:
            return ["loss", *self.train_step.metrics, *([NONFINITE] if self.on_nan != "ignore" else [])]
        # An overridden compute_metrics: trace once (no compilation) to learn its names.
        shapes = eval_shape(self.train_step.step, self.model, self.opt_state, batch, self.key)
        return list(shapes[2])

    # --- data ----------------------------------------------------------------------------
    def _as_data(self, data: Any, batch_size: int | None, shuffle: bool = True) -> Any:
        if isinstance(data, Batches) or not _is_array_tree(data):
            return data
        key = jax.random.fold_in(jax.random.key(0) if self.key is None else self.key, 1)
        return batches(data, 32 if batch_size is None else batch_size, shuffle=shuffle, key=key)

    def _epoch_iter(self, data: Any) -> Iterator[Any]:
        """The current epoch's minibatches from the trainer's position: ``Batches`` replays
        from it; an iterator that reports its position (``get_state``/``set_state``) is set
        to the saved one; another re-iterable skips the minibatches the epoch already
        consumed (read, never computed on); a one-shot iterator continues where it is."""
        if isinstance(data, Batches):
            return data.iterate(self.epoch, self.batch_in_epoch)
        if self._iterator is not None and self._iterator_of is data:
            return self._iterator  # the same fit data, continued: iter() once per epoch
        state, self._data_state = self._data_state, None
        it = iter(data)
        stream = it is data
        if state is not None and _has_position(it):
            it.set_state(state)
        elif self._restored and (self.batch_in_epoch or (stream and self.steps_run)):
            if stream:
                warnings.warn(ONE_SHOT_RESUME.format(kind=type(data).__name__, step=self.steps_run),
                              stacklevel=4)
            else:
                it = itertools.islice(it, self.batch_in_epoch, None)
        elif self.batch_in_epoch and not stream:  # an epoch ended early by an exception or a stop
            it = itertools.islice(it, self.batch_in_epoch, None)
        self._restored = False
        self._iterator, self._iterator_of = it, data
        return it

    @staticmethod
    def _epoch_length(data: Any) -> int | None:
        try:
            return len(data)
        except TypeError:
            return None

    def _data_position(self) -> Any:
        """The position of the data iterator that reports one (for a checkpoint)."""
        it = self._iterator
        if it is None or not _has_position(it) or not (self.batch_in_epoch or it is self._iterator_of):
            return None
        state = it.get_state()
        try:
            json.dumps(state)
        except (TypeError, ValueError):
            raise ValueError(DATA_STATE_NOT_JSON.format(kind=type(it).__name__, given=repr(state)[:120])) from None
        return state

    # --- reading the device buffer (log intervals, one interval late) --------------------
    def _close(self, log: bool) -> None:
        """The open buffer's steps (all dispatched) become a pending interval; the next
        buffer opens on device, carrying a stop (one dispatch, no wait)."""
        # The learning context is snapshotted only for callbacks (their TrainingContext):
        # without any, the dispatch passes the buffer alone.
        buffer, ctx = next_buffer(self._buffer["halt"], self._buffer["rows"],
                                  self.opt_state if self._callbacks else None)
        if jax.default_backend() != "cpu":  # (the CPU's arrays are in host memory: nothing to copy)
            for x in jax.tree.leaves((self._buffer, ctx)):
                x.copy_to_host_async()  # queued behind the interval's steps: done when it is read
        self._critical = True  # the steps move to the pending interval at once: a Ctrl-C waits
        self._pending.append(Interval(self._buffer, ctx, self.steps_run - self._buffered + 1, self._buffered,
                                      self._inflight, log))
        self._buffer, self._buffered, self._inflight = buffer, 0, []
        self._critical = False
        self._safe_point()

    def _log_point(self, bar: Progress, cbs: Sequence[Callback]) -> None:
        """Every ``log_every`` steps: close the open interval and read the ones before it
        (one interval late: nothing waits), or all of them when a callback reads the model
        in ``on_log`` (it then sees the model after ``context.step``)."""
        self._close(log=True)
        self._since_log = 0
        keep = 0 if self._sync_logs else 1
        while len(self._pending) > keep:
            self._read_interval(bar, cbs)

    def _read(self, bar: Progress | None, cbs: Sequence[Callback] = ()) -> None:
        """Read every interval, the open buffer last (save points, epoch ends, fit ends)."""
        if self._buffered:
            self._close(log=False)
        while self._pending:
            self._read_interval(bar or _NO_BAR, cbs)

    def _read_interval(self, bar: Progress, cbs: Sequence[Callback]) -> None:
        interval = self._pending[0]
        host, ctx = to_host((interval.buffer, interval.context))
        n = int(host["halt"][0])
        steps = list(range(interval.first, interval.first + n))
        assert self._names is not None
        rows = host["rows"][:n]
        values = {k: rows[:, i] for i, k in enumerate(self._names) if k != NONFINITE}
        nonfinite = rows[:, self._names.index(NONFINITE)] if NONFINITE in self._names else np.full(n, -1.0)
        weights = np.array([size for _, size in interval.inflight[:n]], np.float32)
        columns = {k: v.tolist() for k, v in values.items()}
        rates = {name: rows[:, len(self._names) + i].tolist() for i, name in enumerate(self._rates)}
        self._critical = True  # the interval is read once: a Ctrl-C waits for the bookkeeping
        self._pending.pop(0)
        self.history.add_steps(steps, {**columns, **rates})
        self._last_context = None if self._pending or self._buffered else ctx  # the current one
        self._critical = False
        self._check_finite(steps, nonfinite.astype(np.int32), host["halt"], interval.inflight)
        applied = nonfinite == -1 if self.on_nan == "skip" else None  # skipped steps: out of the means
        self._critical = True
        terms = _Means.terms(values, weights, applied)
        self._window.add_terms(*terms)
        self._epoch_means.add_terms(*terms)
        self._critical = False
        self._safe_point()
        means = self._metric_means(self._window)
        shown = dict(means)
        if self.on_nan == "skip":
            shown["skipped"] = self._epoch_means.skipped  # the epoch's so far
        for name, column in rates.items():
            shown[name.replace("learning_rate", "lr")] = column[-1]
        bar.update(n, shown)
        if interval.log:
            self._window = _Means()
            self._last_log = means
            if cbs:
                log = self._context("log", means, ctx, step=interval.first + n - 1)
                for cb in cbs:
                    cb.on_log(self, log)

    def _applied_later(self) -> int:
        """Steps applied after the intervals read so far (blocks: the first skip's report only)."""
        col = self._names.index(NONFINITE) if self._names and NONFINITE in self._names else None
        buffers = [i.buffer for i in self._pending] + ([self._buffer] if self._buffered else [])
        if col is None:
            return sum(i.steps for i in self._pending) + self._buffered
        return sum(int(np.sum(b["rows"][: int(b["halt"][0]), col] == -1)) for b in jax.device_get(buffers))

    def _check_finite(self, steps: list[int], nonfinite: np.ndarray, halt: np.ndarray,
                      inflight: list[tuple[Any, int]]) -> None:
        if self.on_nan == "skip":
            bad = np.flatnonzero(nonfinite != -1)
            if len(bad) and self._param_names is None:
                self._param_names = parameter_names(self.model, self.optimizer.wrt)
            if len(bad) and self.nan_report is None:  # the first skipped step's provenance
                after = int(np.sum(nonfinite[bad[0]:] == -1)) + self._applied_later()
                self.nan_report = step_provenance(self.train_step, steps[bad[0]], self.model, self.opt_state,
                                                  inflight[bad[0]][0], self.key, applied_after=after)
            self.skipped.extend((steps[i], self._what(int(nonfinite[i]))) for i in bad)
            return
        stopped = int(halt[1])
        if stopped < 0:
            return
        step = steps[stopped]
        self.batch_in_epoch -= self.steps_run - (step - 1)
        self.steps_run = step - 1
        self._buffer, self._buffered, self._inflight, self._pending = None, 0, [], []
        error = nonfinite_error(step, int(halt[2]), train_step=self.train_step, model=self.model,
                                opt_state=self.opt_state, batch=inflight[stopped][0], key=self.key,
                                holder="trainer.model and trainer.opt_state are",
                                history=", and trainer.history holds the values up to here")
        self.nan_report = error.report
        raise error

    def _what(self, index: int) -> str:
        assert self._param_names is not None
        return "the loss" if index < 0 else f"the gradient of parameter {self._param_names[index]!r}"

    def _context(self, event: str, metrics: Mapping[str, float], arrays: Any = None,
                 step: int | None = None) -> TrainingContext:
        if arrays is None and self._last_context is None:  # valid until the next step
            self._last_context = to_host(snapshot(self.opt_state))
        ctx, rates = arrays or self._last_context
        rates = {name: float(v) for name, v in rates.items()}
        return TrainingContext(
            event=event,
            step=self.steps_run if step is None else step,
            sweep=int(ctx.sweep),
            samples_seen=int(ctx.samples_seen),
            minibatch_size=int(ctx.minibatch_size),
            learning_rate=rates.get("learning_rate"),
            metrics=dict(metrics),
            learning_rates=rates,
        )

    # --- fit -----------------------------------------------------------------------------
    def fit(
        self,
        data: Any,
        epochs: int | None = None,
        *,
        steps: int | None = None,
        validation_data: Any = None,
        callbacks: Sequence[Callback | Callable[[TrainingContext], Any]] = (),
        progress: bool = True,
        log_every: int = 50,
        batch_size: int | None = None,
        steps_per_call: int | None = None,
    ) -> History:
        """Train until the job has run ``epochs`` epochs or ``steps`` steps in all.

        ``epochs`` and ``steps`` count the whole job, as Lightning's ``max_epochs`` /
        ``max_steps``: a fresh trainer trains ``N``; a restored (or already trained) one
        continues to ``N``; one already there, or stopped by a callback
        (``trainer.stop_training``), returns at once and logs so. Run twice, a script that
        restores its latest checkpoint and calls ``fit(data, epochs=N)`` ends where the
        uninterrupted job ends.

        ``data`` is ``ft.train.batches(...)``, arrays / a tuple or dict of arrays (cut into
        shuffled minibatches of ``batch_size``, default 32), or any iterable of batches
        (a list, a torch DataLoader, a tf.data Dataset; ``iter(data)`` once per epoch).
        Continuing inside an epoch, ``Batches`` replays from its position, an iterator with
        ``get_state()``/``set_state(state)`` (grain's) is set to the saved position, and
        another re-iterable skips the minibatches already consumed (read, not computed on).
        Metrics reach the host every ``log_every`` steps, one interval late (the read
        never waits for the steps queued since), and at epoch ends and save points; callbacks
        get the :class:`TrainingContext` of each interval as it is read, and a callback that
        reads ``trainer.model`` in ``on_log`` (``Callback.reads_model``) sees the model
        after ``context.step``. ``steps_per_call`` (default: the Trainer's) runs that many
        steps per compiled call on stacked minibatches; the history keeps one row per step.
        Returns :attr:`history` (the whole job's).

        Ctrl-C (KeyboardInterrupt) or any exception leaves ``trainer.model`` and
        ``trainer.opt_state`` at the last completed step, ready to ``fit`` again or save.
        SIGTERM stops ``fit`` after the current step, saving a checkpoint there through each
        :class:`ModelCheckpoint` given (``trainer.preempted`` is then True).
        """
        _positive("epochs", epochs)
        _positive("steps", steps)
        _positive("log_every", log_every)
        k = self.steps_per_call if steps_per_call is None else check_steps_per_call(steps_per_call)
        if epochs is None and steps is None:
            epochs = 1
        data = self._as_data(data, batch_size)
        if steps is None and epochs is not None and epochs - self.epoch > 1 and isinstance(data, Iterator):
            raise ValueError(ONE_SHOT.format(epochs=epochs, kind=type(data).__name__))
        cbs = [as_callback(c) for c in callbacks]
        self._load_callback_states(cbs)
        length = self._epoch_length(data)
        if (self._restored and self.batch_in_epoch and length is not None and self._saved_length is not None
                and length != self._saved_length):
            raise ValueError(DATA_LENGTH_CHANGED.format(saved=self._saved_length, given=length,
                                                        step=self.steps_run))
        self._callbacks = cbs
        self.preempted = False
        # An epoch whose steps all ran but whose end (validation, callbacks) did not: the
        # run that stopped there (an interrupt, a checkpoint at its last step) goes on here.
        end_pending = length is not None and 0 < length <= self.batch_in_epoch and not self.stop_training
        if (self.stop_training or self._reached(epochs, steps)) and not end_pending:
            if self.stop_training:
                why = "was stopped by a callback (trainer.stop_training is True); set it to False to train on"
            else:
                more = (f"steps={self.steps_run + 100}" if steps is not None and self.steps_run >= steps
                        else f"epochs={self.epoch + 1}")
                why = (f"has already run {f'{steps} steps' if more.startswith('steps') else f'{epochs} epochs'} "
                       f"(fit(epochs=N) and fit(steps=N) count the whole job): ask for more to train on, "
                       f"e.g. trainer.fit(data, {more})")
            _LOG.warning(ALREADY_DONE.format(step=self.steps_run, epoch=self.epoch, why=why))
            return self.history
        self._saved_length = length
        remaining = steps - self.steps_run if steps is not None else (
            (epochs - self.epoch) * length - self.batch_in_epoch if length is not None and epochs else None)
        bar = Progress(remaining, enabled=progress and jax.process_index() == 0)  # one bar for all processes
        self._bar = bar
        self._last_context = None
        self._sync_logs = any(_reads_model(cb) for cb in cbs)
        self._save_every = sorted({int(cb.every_steps) for cb in cbs
                                   if isinstance(cb, ModelCheckpoint) and cb.every_steps})
        start = self.steps_run
        try:
            with self._signals():
                self._read(bar)  # an interrupted fit's steps, if any
                if self._capacity != log_every + k - 1:
                    self._buffer, self._capacity = None, log_every + k - 1  # room for the call that passes log_every
                for cb in cbs:
                    cb.on_train_begin(self)
                while not (self.stop_training or self._terminate) and (end_pending or not self._reached(epochs, steps)):
                    end_pending = False
                    ran, complete = self._run_epoch(data, steps, log_every, cbs, bar, k)
                    if complete:
                        self._read(bar, cbs)
                        self._end_epoch(bar, validation_data, cbs, batch_size)
                    elif ran == 0 and not self._terminate:
                        if self.steps_run == start:
                            raise ValueError(EMPTY_DATA.format(why=f" ({type(data).__name__})"))
                        break  # a one-shot iterator is exhausted
                self._read(bar, cbs)
                if self._terminate:
                    self._preempt(cbs)
        except BaseException:
            if not isinstance(data, Iterator):
                self._iterator = None  # the next epoch iterator skips to the position instead
            raise
        finally:
            bar.close()
            self._bar = None
        if not cbs:
            return self.history
        end = self._context("end", self._metric_means(self._window))
        for cb in cbs:  # the final checkpoints first: no on_train_end (restore_best) has replaced the model
            if isinstance(cb, ModelCheckpoint):
                cb._save_point(self, end, "end")
        for cb in cbs:
            cb.on_train_end(self, end)
        return self.history

    def _reached(self, epochs: int | None, steps: int | None) -> bool:
        return (steps is not None and self.steps_run >= steps) or (epochs is not None and self.epoch >= epochs)

    def _boundary(self, steps: int | None, k: int) -> int:
        """Steps until the next save point or the end of ``steps=`` (at most ``k``)."""
        n = k if steps is None else min(k, steps - self.steps_run)
        for every in self._save_every:
            n = min(n, every - self.steps_run % every)
        return n

    def _run_epoch(self, data: Any, steps: int | None, log_every: int, cbs: list[Callback],
                   bar: Progress, k: int = 1) -> tuple[int, bool]:
        """Steps of one epoch: ``(steps run, whether the epoch's end is reached)``."""
        ran = 0
        length = self._epoch_length(data)
        bar.set_description(f"epoch {self.epoch + 1}")
        run = self.train_step.run
        group: list[Any] = []  # k > 1: the minibatches of the next call, of one signature
        signature: Any = None
        save_every = self._save_every

        def after_call() -> bool:
            """Log and save points after a call; True when fit must leave the epoch."""
            if self._since_log >= log_every:
                self._log_point(bar, cbs)
            if save_every and any(self.steps_run % e == 0 for e in save_every):
                self._save_step(bar, cbs)
            return self.stop_training or self._terminate or (steps is not None and self.steps_run >= steps)

        for batch in self._epoch_iter(data):
            batch = to_arrays(batch)
            size = self._check_minibatch(batch, len(group))
            if self._names is None:
                self._first_shapes = describe_batch(batch)
                self._names = self._metric_names(batch)
            if self._buffer is None:
                self._buffer = self._new_buffer(self._capacity)
            if k == 1:  # the plain loop, kept lean
                self._critical = True  # a Ctrl-C now waits: the call donates the model's buffers
                try:
                    self.model, self.opt_state, _, self._buffer = run(self.model, self.opt_state, batch, self.key,
                                                                      self._buffer, owned=True)
                except (ValueError, TypeError) as e:  # raised while tracing: nothing was donated
                    self._critical = False
                    raise self._located(e, batch, 0) from e.__cause__
                self._inflight.append((batch, size))
                self.steps_run += 1
                self.batch_in_epoch += 1
                self._buffered += 1
                self._since_log += 1
                self._critical = False
                if self._deferred:
                    self._safe_point()
                ran += 1
            else:
                new = _batch_signature(batch)
                if group and new != signature:
                    ran += self._run_group(group, k)  # minibatches of another shape: single steps
                    group = []
                    if after_call():
                        return ran, False
                group.append((batch, size))
                signature = new
                if len(group) < self._boundary(steps, k):
                    continue
                ran += self._run_group(group, k)
                group = []
            if after_call():
                return ran, (not self._terminate and length is not None and self.batch_in_epoch >= length)
        if group:  # the epoch's last minibatches, fewer than k: single steps
            ran += self._run_group(group, k)
            if after_call() and self._terminate:
                return ran, False
        return ran, self.batch_in_epoch > 0

    def _run_group(self, group: list[tuple[Any, int]], k: int) -> int:
        """``k`` minibatches (``(batch, size)`` pairs) as one call of ``k`` steps; fewer as
        single steps."""
        assert self._buffered + len(group) <= self._capacity, "the log buffer would overflow"
        calls = [(stack_batches([b for b, _ in group]), k)] if len(group) == k else [(b, 1) for b, _ in group]
        for i, (batch, n) in enumerate(calls):
            self._critical = True
            try:
                self.model, self.opt_state, _, self._buffer = self.train_step.run(
                    self.model, self.opt_state, batch, self.key, self._buffer, owned=True, steps=n)
            except (ValueError, TypeError) as e:  # raised while tracing: nothing was donated
                self._critical = False
                raise self._located(e, group[i][0], i) from e.__cause__
            self._inflight.extend(group if n == k else [group[i]])
            self.steps_run += n
            self.batch_in_epoch += n
            self._buffered += n
            self._since_log += n
            self._critical = False
        self._safe_point()
        return len(group)

    def _save_step(self, bar: Progress, cbs: Sequence[Callback]) -> None:
        """A save point (``ModelCheckpoint(every_steps=)``): every step read, then saved."""
        self._read(bar, cbs)
        ctx = self._context("step", self._metric_means(self._window) if self._window.weight else self._last_log)
        for cb in cbs:
            if isinstance(cb, ModelCheckpoint):
                cb._save_point(self, ctx, "step")

    def _preempt(self, cbs: Sequence[Callback]) -> None:
        """SIGTERM: a checkpoint at the current step through every ModelCheckpoint, then stop."""
        ctx = self._context("step", self._metric_means(self._window) if self._window.weight else self._last_log)
        saved = [cb for cb in cbs if isinstance(cb, ModelCheckpoint)]
        for cb in saved:
            cb._save_point(self, ctx, "terminate")
        self.preempted, self._terminate = True, False
        where = f"saved a checkpoint at step {self.steps_run}" if saved else "no ModelCheckpoint to save through"
        _LOG.warning(f"SIGTERM during fit: stopped after step {self.steps_run}, {where}. "
                     "Run the job again: trainer.restore(...) then fit(...) continues from there.")

    def _end_epoch(self, bar: Progress, validation_data: Any, cbs: list[Callback], batch_size: int | None) -> None:
        values = self._metric_means(self._epoch_means)
        if validation_data is not None:  # may raise: nothing has changed yet
            val = self.evaluate(validation_data, batch_size=batch_size)
            values.update({f"val_{k}": v for k, v in val.items()})
            if keeps_average(self.opt_state):  # Optimizer(average=) or lookahead: validate that model too
                val = self.evaluate(validation_data, batch_size=batch_size, averaged=True)
                values.update({f"val_averaged_{k}": v for k, v in val.items()})
        opt_state = next_sweep(self.opt_state)
        self._critical = True  # one step of bookkeeping: a Ctrl-C waits for all of it
        self.opt_state = opt_state
        self.epoch += 1
        self.batch_in_epoch = 0
        self._last_context = None
        self._iterator = None
        self._window, self._epoch_means, self._since_log = _Means(), _Means(), 0
        self.history.add_epoch(self.epoch, {**values, "last_step": self.steps_run})
        self._critical = False
        self._safe_point()
        bar.end_epoch(values)
        if not cbs:  # the context would be read from the device for nobody
            return
        ctx = self._context("epoch", values)
        for cb in cbs:
            cb.on_epoch_end(self, ctx)
        for cb in cbs:
            if isinstance(cb, ModelCheckpoint):
                cb._save_point(self, ctx, "epoch")

    # --- interrupts ----------------------------------------------------------------------
    def _safe_point(self) -> None:
        """Raise a KeyboardInterrupt that arrived inside a critical section."""
        if self._deferred:
            self._deferred = False
            raise KeyboardInterrupt

    @contextlib.contextmanager
    def _signals(self) -> Iterator[None]:
        """Inside ``fit`` (main thread only): SIGINT raises KeyboardInterrupt at once, but
        between a donating call and the assignment of its outputs it waits for the end of
        that bookkeeping; SIGTERM asks the loop to save and stop after the current step.
        The previous handlers are put back afterwards."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous_int, previous_term = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)

        def on_int(signum: int, frame: Any) -> None:
            if self._critical:
                self._deferred = True
            elif callable(previous_int):
                previous_int(signum, frame)
            else:
                raise KeyboardInterrupt

        def on_term(signum: int, frame: Any) -> None:
            self._terminate = True

        self._critical = self._deferred = self._terminate = False
        if previous_int is signal.default_int_handler or (callable(previous_int) and previous_int is not on_int):
            signal.signal(signal.SIGINT, on_int)
        if previous_term in (signal.SIG_DFL, None):
            signal.signal(signal.SIGTERM, on_term)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, previous_int if previous_int is not None else signal.SIG_DFL)
            signal.signal(signal.SIGTERM, previous_term if previous_term is not None else signal.SIG_DFL)
            self._critical = self._terminate = False
            if self._deferred:  # arrived in the last bookkeeping: delivered now
                self._deferred = False
                raise KeyboardInterrupt

    # --- evaluate / predict --------------------------------------------------------------
    @property
    def inference_model(self) -> Any:
        """The trained model in inference mode (``ft.nn.inference(trainer.model)``): call
        it for predictions. ``trainer.model`` is in training mode, where Dropout needs a
        key.

        Example:
          >>> import functree as ft, jax, jax.numpy as jnp
          >>> model = ft.nn.Sequential(ft.nn.Dense(2, 2, key=jax.random.key(0)), ft.nn.Dropout(0.5))
          >>> trainer = ft.train.Trainer(model, ft.optim.sgd(0.1), lambda m, b: 0.0)
          >>> ft.nn.is_training(trainer.model), ft.nn.is_training(trainer.inference_model)
          (True, False)
          >>> trainer.inference_model(jnp.ones((1, 2))).shape
          (1, 2)
        """
        return nn.inference(self.model)

    @property
    def averaged_model(self) -> Any:
        """The model with the optimizer's averaged parameters (``ft.optim.averaged``:
        ``Optimizer(tx, average=ft.optim.ema(0.999))``, or lookahead's slow weights), in
        inference mode."""
        return nn.inference(averaged_parameters(self.opt_state, self.model))

    def _eval_key(self, fn: Callable[..., Any]) -> Any:
        """A fixed key for ``fn`` when it takes ``key=`` (else None): derived from the
        trainer's key, the same for every evaluation."""
        if key_parameter(fn) is None:
            return None
        base = jax.random.key(0) if self.key is None else self.key
        return jax.random.fold_in(base, EVAL_KEY_SALT)

    def evaluate(self, data: Any, *, batch_size: int | None = None, averaged: bool = False) -> dict[str, float]:
        """The loss and metrics of the model (inference mode) over ``data``: means
        weighted by minibatch size, accumulated on device, read once at the end.
        ``averaged=True`` evaluates :attr:`averaged_model` instead.

        A loss function that takes ``key=`` gets ``fold_in(eval_key, batch index)`` with a
        fixed evaluation key derived from the trainer's: evaluations are reproducible.
        """
        data = self._as_data(data, batch_size, shuffle=False)
        model = self.averaged_model if averaged else self.inference_model
        key = self._eval_key(self.eval_step.loss_fn)
        sums: Any = None
        batches_iter: Iterable[Any] = data.iterate(0) if isinstance(data, Batches) else data
        for batch in batches_iter:
            batch = self.eval_step.shard_batch(to_arrays(batch))
            if sums is None:
                shapes = eval_shape(self.eval_step.step, model, batch, key)
                sums = {"values": {k: jnp.zeros((), jnp.float32) for k in shapes},
                        "weight": jnp.zeros((), jnp.float32), "count": jnp.zeros((), jnp.int32)}
            sums = self._eval_fused(model, sums, batch, key)
        if sums is None:
            raise ValueError(EMPTY_DATA.format(why=" to evaluate"))
        host = jax.device_get(sums)
        return {k: float(v) / float(host["weight"]) for k, v in host["values"].items()}

    def predict(self, data: Any, fn: Callable[[Any, Any], Any] | None = None, *,
                batch_size: int | None = None) -> Any:
        """``fn(model, batch)`` over ``data`` (inference mode), concatenated along axis 0.

        ``fn`` defaults to ``model(inputs)`` with inputs ``batch[0]`` (tuples),
        ``batch["x"]`` (dicts) or the batch itself (arrays). An ``fn`` that takes ``key=``
        gets ``fold_in(eval_key, batch index)`` (see :meth:`evaluate`). For one batch,
        call :attr:`inference_model` directly.
        """
        fn = fn or _default_predict
        if _is_array(data):
            data = batches(data, batch_size or 32, shuffle=False)
        data = self._as_data(data, batch_size, shuffle=False)
        model = self.inference_model
        key = self._eval_key(fn)
        batches_iter: Iterable[Any] = data.iterate(0) if isinstance(data, Batches) else data
        outputs = [
            self._predict(model, self.eval_step.shard_batch(to_arrays(b)), fn,
                          None if key is None else jax.random.fold_in(key, i))
            for i, b in enumerate(batches_iter)
        ]
        if not outputs:
            raise ValueError(EMPTY_DATA.format(why=" to predict"))
        return jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=0), *outputs)

    # --- checkpoints ---------------------------------------------------------------------
    def save(self, manager: CheckpointManager | str, *, metrics: Mapping[str, Any] | None = None,
             extra: Any = _KEEP) -> None:
        """Checkpoint the job at the current step, atomically: model (with its layer
        state), optimizer state (with its learning context), PRNG key, position in the data
        (with a positioned iterator's ``get_state()``), history, the states of the last
        ``fit``'s callbacks, and ``extra`` (a tree of arrays and plain values, default
        :attr:`extra`; it becomes :attr:`extra`). Every process of a multi-process job
        calls it (each writes its shards).

        Example:
          >>> import functree as ft, jax, jax.numpy as jnp, numpy as np, tempfile
          >>> x = np.ones((8, 2), np.float32)
          >>> loss_fn = lambda m, b: jnp.mean(m(b) ** 2)
          >>> make = lambda: ft.train.Trainer(ft.nn.Dense(2, 1, key=jax.random.key(0)), ft.optim.sgd(0.1), loss_fn)
          >>> trainer, path = make(), tempfile.mkdtemp() + "/ckpt"
          >>> _ = trainer.fit(ft.train.batches(x, 4), epochs=1, progress=False)
          >>> trainer.save(path, extra={"rounds": 3})
          >>> restored = make().restore(path)
          >>> restored.steps_run, restored.epoch, restored.extra
          (2, 1, {'rounds': 3})
        """
        if extra is not _KEEP:
            _check_extra(extra)
            self.extra = extra
        if not isinstance(manager, CheckpointManager):
            with CheckpointManager(manager) as owned:
                return self.save(owned, metrics=metrics)
        if self._pending or self._buffered:  # inside fit: every step up to now read first
            self._read(self._bar, self._callbacks)
        keys = _callback_keys(self._callbacks)
        states = [cb.state_dict() for cb in self._callbacks]
        kept = [i for i, s in enumerate(states) if s]
        config = {
            "trainer": {"steps_run": self.steps_run, "epoch": self.epoch,
                        "batch_in_epoch": self.batch_in_epoch, "on_nan": self.on_nan,
                        "stopped": bool(self.stop_training), "epoch_length": self._saved_length,
                        "since_log": self._since_log, "data_state": self._data_position(),
                        "means": {"window": self._window.state(), "epoch": self._epoch_means.state()},
                        "history": {"steps": self.history.steps, "epochs": self.history.epochs},
                        "skipped": [list(s) for s in self.skipped]},
            "callbacks": [[keys[i], type(self._callbacks[i]).__name__] for i in kept],
            "optimizer": repr(self.optimizer),
            "train_step": repr(self.train_step),
        }
        manager.save(self.steps_run, self.model, self.opt_state, metrics=metrics, config=config,
                     extra={"key": self.key, "user": self.extra, "callbacks": [states[i] for i in kept]})

    def restore(self, manager: CheckpointManager | str, step: int | None = None, *,
                optimizer_state: bool = True, callbacks: bool = True) -> Trainer:
        """Continue from a checkpoint (default: the latest) and return this trainer.

        Model and optimizer state are checked against the trainer's (key path, shape,
        dtype); position, key, history, :attr:`extra` and the stop flag are restored, and
        the saved callback states are handed to the callbacks of the next ``fit`` (matched
        by ``Callback.name``, else by class and position; ``callbacks=False`` drops them).
        The :class:`Checkpoint` read is :attr:`checkpoint`. Then ``fit(data, epochs=N)``
        continues the job to ``N`` epochs in all, bit for bit as if never interrupted.

        ``optimizer_state=False`` restores the model, position and key only and keeps this
        trainer's optimizer state: a saved model continued with new optimizer options
        (seed 003); the learning context then starts from this trainer's.
        """
        if not isinstance(manager, CheckpointManager):
            with CheckpointManager(manager) as owned:
                return self.restore(owned, step, optimizer_state=optimizer_state, callbacks=callbacks)
        include = ("model", "opt_state", "extra") if optimizer_state else ("model", "extra")
        where = self.train_step.placement  # a step over a mesh: arrays read straight into their shards
        placed = {} if where is None else {"mesh": where.mesh, "sharding": where.sharding,
                                           "data_axis": where.data_axis}
        ckpt = manager.restore(step, template=self.model, opt_state_template=self.opt_state,
                               include=include, **placed)
        opt_state = ckpt.opt_state if optimizer_state else self.opt_state
        self.model, self.opt_state = copy_aliases((ckpt.model, opt_state))
        position = ckpt.config.get("trainer", {})
        self.steps_run = int(position.get("steps_run", ckpt.step))
        self.epoch = int(position.get("epoch", 0))
        self.batch_in_epoch = int(position.get("batch_in_epoch", 0))
        self.stop_training = bool(position.get("stopped", False))
        self._saved_length = position.get("epoch_length")
        self._since_log = int(position.get("since_log", 0))
        self._data_state = position.get("data_state")
        means = position.get("means", {})
        self._window, self._epoch_means = _Means.load(means.get("window")), _Means.load(means.get("epoch"))
        if "history" in position:
            saved = position["history"]
            self.history = History(steps=saved["steps"], epochs=saved["epochs"])
        self.skipped = [(int(s), str(w)) for s, w in position.get("skipped", [])]
        extra = ckpt.extra if isinstance(ckpt.extra, Mapping) else {}
        if extra.get("key") is not None:
            self.key = extra["key"]
        self.extra = extra.get("user")
        names = ckpt.config.get("callbacks", [])
        self._saved_callbacks = [(key, cls, state) for (key, cls), state in zip(names, extra.get("callbacks", []))
                                 ] if callbacks else None
        self._buffer, self._buffered, self._inflight, self._pending = None, 0, [], []
        self._iterator, self._iterator_of, self._restored = None, None, True
        self.checkpoint = ckpt
        return self

    def _load_callback_states(self, cbs: list[Callback]) -> None:
        """The first fit after a restore: every saved callback state to its callback."""
        saved = self._saved_callbacks
        if not saved:
            return
        given = dict(zip(_callback_keys(cbs), cbs))
        for key, cls, _ in saved:
            cb = given.get(key)
            if cb is None or type(cb).__name__ != cls:
                raise ValueError(CALLBACK_MISMATCH.format(
                    key=key, cls=cls, saved=[f"{k} ({c})" for k, c, _ in saved],
                    given=[f"{k} ({type(c).__name__})" for k, c in given.items()] or "none"))
        for key, _, state in saved:
            given[key].load_state_dict(state)
        self._saved_callbacks = None

    def __repr__(self) -> str:
        return f"Trainer({self.train_step!r}, steps_run={self.steps_run}, epoch={self.epoch})"


def _default_predict(model: Any, batch: Any) -> Any:
    return model(_inputs(batch))


def _call_predict(model: Any, batch: Any, fn: Callable[..., Any], key: Any) -> Any:
    return fn(model, batch) if key is None else fn(model, batch, key=key)


def _signature(fn: Callable[..., Any]) -> str:
    try:
        return str(inspect.signature(fn))
    except (TypeError, ValueError):
        return ""
