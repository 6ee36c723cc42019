"""Recurrent cells (``SimpleRNNCell``, ``GRUCell``, ``LSTMCell``) and ``RNN``, a ``lax.scan`` over time.

A cell maps ``(state, x) -> (new_state, output)`` — the signature of a ``lax.scan`` body —
for inputs ``[..., input_size]`` with any leading batch axes; ``cell.zero_state(batch_shape)``
gives the initial state.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer

from functree._activations import tanh
from functree._module import field
from functree._paths import ATTR, Entry, KeyPath
from functree._random import flat_key, one_key
from functree._repr import short_array
from functree._traces import staged
from functree.nn._abstract import initialized
from functree.nn._check import LayerInputError, check_input, check_unbatched, size_arguments
from functree.nn._eager_keys import eager_program
from functree.nn._linear import Initializer, add_bias
from functree.nn._mode import Layer
from functree.nn._remat import call_collecting, collecting, record_under
from functree.nn._sequential import takes_key
from functree.nn._state import Intermediate, apply_state, threaded_state
from functree.nn._window import is_int

__all__ = ["SimpleRNNCell", "GRUCell", "LSTMCell", "LSTMState", "RNN"]

_glorot = jax.nn.initializers.glorot_uniform()
_orthogonal = jax.nn.initializers.orthogonal()

STATE_EXPECTED = "initial_state {expected} (cell.zero_state({batch}) for inputs {xs})"

FIX_LSTM_STATE = """\
An LSTM's state is an ft.nn.LSTMState (hidden, cell), not a plain tuple or list:
    wrong:  rnn(xs, (h0, c0))
    right:  rnn(xs, ft.nn.LSTMState(h0, c0))"""

FIX_TORCH_AXIS = """\
torch's initial state has a leading (num_layers * num_directions) axis; ft.nn.RNN is one \
layer, one direction, and takes [*batch, hidden]:
    wrong:  rnn(xs, h0)           # h0 [1, batch, hidden], as torch.nn.GRU/LSTM take it
    right:  rnn(xs, h0[0])        # an LSTM: rnn(xs, ft.nn.LSTMState(h0[0], c0[0]))
       or:  ft.nn.LSTM(n_in, n_hidden, num_layers=..., bidirectional=..., batch_first=True, key=k)(xs, h0)   # torch's layout (or ft.nn.GRU, ft.nn.SimpleRNN)"""

FIX_STATE = """\
Pass the structure and shapes of the cell's zero state (batch axes {batch}, the axes of xs \
before the time axis), or build the cell for the hidden size you have:
    right:  rnn(xs, cell.zero_state({batch}))   # or arrays of those shapes"""

LENGTHS_EXPECTED = "lengths: integers of the batch's shape {batch}, each in [0, {time}] (the steps of xs {xs})"

FIX_LENGTHS = """\
Pass one length per sequence, as torch's pack_padded_sequence(xs, lengths) and Flax's \
seq_lengths take them: the real steps of each, the rest of its time axis padding:
    right:  rnn(xs, lengths=jnp.array([7, 3, 5]))   # xs [3, 7, features]: batch 3, 7 steps at most"""

LENGTHS_OUTSIDE = """\
A length above the time axis (or below 0) has no steps to run: torch's packed GRU raises on it \
(a length of 0 too), and JAX's comparison of steps with lengths would run the whole sequence \
(or none of it) silently. Where the lengths are concrete they are refused; under jax.jit, where \
their values are not seen, that sequence's outputs and final state are NaN. Clip the lengths \
to the steps kept, or pad xs to the longest:
    wrong:  rnn(xs[:, :T], lengths=lengths)                      # lengths measured before the crop
    right:  rnn(xs[:, :T], lengths=jnp.minimum(lengths, T))"""

LENGTHS_COLLECTING = """\
ft.nn.RNN: lengths= with a cell that records layer state (a BatchNorm in training mode, a \
recorded intermediate): its records would hold the padded steps too. Run it in inference \
mode (ft.nn.inference(model)), or without lengths= on sequences of one length."""

CHANGES_STATE = """\
ft.nn.RNN: the cell maps its state to the same structure, shapes and dtypes at every step \
(it is the carry of jax.lax.scan), but {cell} maps {given} to {returned}.
    right:  return new_state.astype(state.dtype), output   # in {cell}.__call__
       or:  rnn(xs, initial_state)   # a state of the structure, shapes and dtypes the cell returns"""


class LSTMState(NamedTuple):
    """An LSTM's state: ``hidden`` (the output) and ``cell`` (the memory).

    Example:
      >>> import functree as ft, jax, jax.numpy as jnp
      >>> cell = ft.nn.LSTMCell(3, 5, key=jax.random.key(0))
      >>> state = ft.nn.LSTMState(jnp.zeros((2, 5)), jnp.zeros((2, 5)))  # hidden, cell
      >>> state, y = cell(state, jnp.ones((2, 3)))
      >>> bool((state.hidden == y).all()), state.cell.shape
      (True, (2, 5))
    """

    hidden: jax.Array
    cell: jax.Array


def _drawn(dtype: Any) -> Any:
    """The dtype a cell's weights of ``dtype`` are drawn in: float32 below 32 bits (see :func:`_weights`)."""
    return jnp.float32 if jnp.issubdtype(dtype, jnp.floating) and jnp.finfo(dtype).bits < 32 else dtype


def _weights(key: jax.Array, n_in: int, n_hidden: int, gates: int, dtype: Any,
             input_init: Initializer, hidden_init: Initializer, n_state: int = 0) -> tuple[jax.Array, jax.Array]:
    """``input_weight [n_in, gates * n_hidden]`` and ``hidden_weight [n_state, gates * n_hidden]``
    (``n_state`` 0: ``n_hidden``; an LSTM with projections reads a state of ``proj_size``)."""
    # Narrow floats (bfloat16, float16) are drawn in float32 and rounded: the orthogonal
    # initializer's QR has no LAPACK kernel below float32, and a bfloat16 cell is then the
    # float32 cell of the same key, rounded. float32 and float64 draw as they always did.
    drawn = _drawn(dtype)
    k_in, k_h = jax.random.split(one_key(key))
    w_in = initialized(input_init, k_in, (n_in, gates * n_hidden), drawn)  # the keys' draws (functree/_random.py)
    w_h = jnp.concatenate(
        [hidden_init(flat_key(k), (n_state or n_hidden, n_hidden), drawn) for k in jax.random.split(k_h, gates)],
        axis=1
    )
    return w_in.astype(dtype), w_h.astype(dtype)


def _plus(y: jax.Array, bias: jax.Array | None) -> jax.Array:
    """``y + bias`` (:func:`add_bias`), or ``y`` for a cell built with ``use_bias=False``."""
    return y if bias is None else add_bias(y, bias)


class _Cell(Layer):
    """What the cells share: ``hidden_size`` (``hidden_weight [hidden_size, gates * hidden_size]``)
    and a zero state ``[*batch_shape, hidden_size]`` (the LSTM's: a pair of them). No field
    of its own: each cell's fields keep their order (its leaves', its checkpoints')."""

    _ranks: ClassVar[tuple[tuple[str, int], ...]] = (  # each parameter's axes in one cell
        ("input_weight", 2), ("hidden_weight", 2), ("input_bias", 1), ("hidden_bias", 1))

    def _check_unbatched(self) -> None:
        """:class:`BatchedLayerError` for an ensemble's cell (``jax.vmap``-built) called outside
        ``jax.vmap``: its ``[models, in, hidden]`` weights broadcast over the batch rows (and the
        biases against them, silently where the rows equal the models), or read the models'
        count as the input size."""
        check_unbatched(self, **dict(self._ranks))

    @property
    def hidden_size(self) -> int:
        return self.hidden_weight.shape[0]  # type: ignore[attr-defined]  # each cell's field

    @property
    def output_size(self) -> int:
        """The features of each step's output (an LSTM with projections: its ``proj_size``)."""
        return self.hidden_size

    def zero_state(self, batch_shape: tuple[int, ...] = ()) -> Any:
        """Zeros ``[*batch_shape, hidden_size]``."""
        return jnp.zeros((*batch_shape, self.hidden_size), self.hidden_weight.dtype)  # type: ignore[attr-defined]


ACTIVATION_NAME = """\
SimpleRNNCell: activation={given!r} is a name; it takes the function (torch's nonlinearity= \
names it, a state dict does not carry it).

    wrong:  ft.nn.SimpleRNNCell(3, 5, activation={given!r}, key=k)
    right:  ft.nn.SimpleRNNCell(3, 5, activation=ft.nn.{name}, key=k)
"""


class SimpleRNNCell(_Cell):
    """A plain (Elman) recurrent cell, torch's ``nn.RNNCell`` / one layer of ``nn.RNN``::

        h' = activation(x W_ih + b_ih + h W_hh + b_hh)

    ``activation`` is ``ft.nn.tanh`` (default) or ``ft.nn.relu`` for torch's
    ``nonlinearity="relu"`` (a state dict does not carry it: give it when porting), or any
    elementwise function. ``input_weight`` is ``[input_size, hidden_size]`` (glorot-uniform),
    ``hidden_weight`` ``[hidden_size, hidden_size]`` (orthogonal), the two biases torch holds
    zero (added in float32 in bfloat16 and float16, as ``Dense`` adds its; ``use_bias=False``:
    none, torch's ``bias=False``). ``cell(h, x)``
    returns ``(h', h')``; ``ft.nn.RNN(cell)`` runs it over a sequence (torch's ``weight_ih_l0``...).

    Example:
      >>> import functree as ft, jax, jax.numpy as jnp
      >>> cell = ft.nn.SimpleRNNCell(3, 5, key=jax.random.key(0), activation=ft.nn.relu)
      >>> h, y = cell(cell.zero_state((2,)), jnp.ones((2, 3)))
      >>> h.shape, bool((h >= 0).all())
      ((2, 5), True)
      >>> ft.nn.RNN(cell)(jnp.ones((2, 7, 3))).shape
      (2, 7, 5)
    """

    input_weight: jax.Array
    hidden_weight: jax.Array
    input_bias: jax.Array | None = field(decay=False)
    hidden_bias: jax.Array | None = field(decay=False)
    activation: Callable[[Any], Any] = field(static=True, default=tanh)

    def __init__(self, input_size: int, hidden_size: int, *, key: jax.Array, dtype: Any = jnp.float32,
                 activation: Callable[[Any], Any] = tanh, input_initializer: Initializer = _glorot,
                 hidden_initializer: Initializer = _orthogonal, use_bias: bool = True):
        if isinstance(activation, str):  # torch's nonlinearity="relu": called at the first step, "str is not callable"
            name = activation if activation in ("tanh", "relu") else "tanh"
            raise ValueError(ACTIVATION_NAME.format(given=activation, name=name))
        input_size, hidden_size = size_arguments("SimpleRNNCell", input_size=input_size, hidden_size=hidden_size)
        self.input_weight, self.hidden_weight = _weights(
            key, input_size, hidden_size, 1, dtype, input_initializer, hidden_initializer
        )
        self.input_bias = jnp.zeros((hidden_size,), dtype) if use_bias else None
        self.hidden_bias = jnp.zeros((hidden_size,), dtype) if use_bias else None
        self.activation = activation

    def __call__(self, state: jax.Array, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        self._check_unbatched()  # an ensemble's cell outside jax.vmap
        check_input(self, x, (self.input_weight.shape[0],))
        # biases added in float32 below float32 (add_bias): their gradients sum every batch row
        pre = _plus(x @ self.input_weight, self.input_bias) + _plus(state @ self.hidden_weight, self.hidden_bias)
        h = self.activation(pre)
        return h, h


class GRUCell(_Cell):
    """A gated recurrent unit (Cho et al. 2014, the cuDNN / PyTorch variant).

    With ``[r, z, n]`` blocks of the weights::

        r  = sigmoid(x W_ir + b_ir + h W_hr + b_hr)
        z  = sigmoid(x W_iz + b_iz + h W_hz + b_hz)
        n  = tanh(x W_in + b_in + r * (h W_hn + b_hn))
        h' = (1 - z) * n + z * h

    ``input_weight`` is ``[input_size, 3 * hidden_size]`` (glorot-uniform),
    ``hidden_weight`` ``[hidden_size, 3 * hidden_size]`` (orthogonal blocks), biases zero
    (none with ``use_bias=False``, torch's ``bias=False``)
    (added in float32 in bfloat16 and float16, as ``Dense`` adds its: their gradients sum every row).
    ``cell(h, x)`` returns ``(h', h')``.

    Example:
      >>> import functree as ft, jax, jax.numpy as jnp
      >>> cell = ft.nn.GRUCell(3, 5, key=jax.random.key(0))
      >>> h = cell.zero_state((2,))
      >>> h, y = cell(h, jnp.ones((2, 3)))
      >>> h.shape
      (2, 5)
    """

    input_weight: jax.Array
    hidden_weight: jax.Array
    input_bias: jax.Array | None = field(decay=False)
    hidden_bias: jax.Array | None = field(decay=False)

    def __init__(self, input_size: int, hidden_size: int, *, key: jax.Array,
                 dtype: Any = jnp.float32, input_initializer: Initializer = _glorot,
                 hidden_initializer: Initializer = _orthogonal, use_bias: bool = True):
        input_size, hidden_size = size_arguments("GRUCell", input_size=input_size, hidden_size=hidden_size)
        self.input_weight, self.hidden_weight = _weights(
            key, input_size, hidden_size, 3, dtype, input_initializer, hidden_initializer
        )
        self.input_bias = jnp.zeros((3 * hidden_size,), dtype) if use_bias else None
        self.hidden_bias = jnp.zeros((3 * hidden_size,), dtype) if use_bias else None

    def __call__(self, state: jax.Array, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        self._check_unbatched()  # an ensemble's cell outside jax.vmap
        check_input(self, x, (self.input_weight.shape[0],))
        # biases added in float32 below float32 (add_bias): their gradients sum every batch row
        xi = _plus(x @ self.input_weight, self.input_bias)
        hh = _plus(state @ self.hidden_weight, self.hidden_bias)
        x_r, x_z, x_n = jnp.split(xi, 3, axis=-1)
        h_r, h_z, h_n = jnp.split(hh, 3, axis=-1)
        r = jax.nn.sigmoid(x_r + h_r)
        z = jax.nn.sigmoid(x_z + h_z)
        n = jnp.tanh(x_n + r * h_n)
        h = (1 - z) * n + z * state
        return h, h


BAD_PROJ_SIZE = """\
ft.nn.LSTMCell: proj_size={given}; torch's LSTM with projections projects the hidden state \
to fewer features, 0 < proj_size < hidden_size ({hidden}), and proj_size=0 (the default) has none.

    right:  ft.nn.LSTMCell(n_in, {hidden}, proj_size={fix}, key=k)"""

TWO_BIASES_WITHOUT_BIAS = """\
ft.nn.LSTMCell: two_biases=True with use_bias=False; two_biases holds torch's two biases \
(b_ih and b_hh) apart, and use_bias=False (torch's bias=False) has none.

    wrong:  ft.nn.LSTMCell(n_in, n_hidden, use_bias=False, two_biases=True, key=k)
    right:  ft.nn.LSTMCell(n_in, n_hidden, two_biases=True, key=k)    # torch's bias=True
     or:    ft.nn.LSTMCell(n_in, n_hidden, use_bias=False, key=k)     # torch's bias=False"""


class LSTMCell(_Cell):
    """A long short-term memory cell (Hochreiter & Schmidhuber 1997).

    With ``[i, f, g, o]`` blocks of ``x W_i + h W_h + b``::

        i, f, o = sigmoid(.), sigmoid(.), sigmoid(.);  g = tanh(.)
        c' = f * c + i * g;   h' = o * tanh(c')

    ``bias`` (None with ``use_bias=False``, torch's ``bias=False``) starts at zero except the
    forget block at ``forget_bias`` (default 1,
    Jozefowicz et al. 2015), added in float32 in bfloat16 and float16 (as ``Dense``: its gradient
    sums every row). ``cell(LSTMState(h, c), x)`` returns ``(LSTMState(h', c'), h')``.

    ``proj_size=p`` (``0 < p < hidden_size``) is torch's LSTM with projections (Sak et al.
    2014): ``h' = (o * tanh(c')) W_hr`` with ``projection`` ``W_hr [hidden_size, p]``
    (glorot-uniform; torch's ``weight_hr_l0`` transposed), so ``h`` and the output have ``p``
    features, ``c`` keeps ``hidden_size``, and ``hidden_weight`` is ``[p, 4 * hidden_size]``.
    Without it ``projection`` is None (no leaf: the cell computes what it always did).

    ``two_biases=True`` holds torch's two biases apart, ``bias`` (``b_ih``) and
    ``hidden_bias`` (``b_hh``, zeros at the start), added as ``x W_i + b_ih + h W_h + b_hh``:
    the same outputs as one bias ``b_ih + b_hh``, but torch trains the two, each with the
    gradient ``g`` of their sum, so SGD moves the sum by ``2 lr g`` and Adam by twice its step,
    and both count in a global gradient norm. A port that trains as torch (step for step, from
    ``ft.nn.load_torch_state_dict``) needs it; by default ``hidden_bias`` is None (no leaf,
    the one bias of Keras and Flax).

    Example:
      >>> import functree as ft, jax, jax.numpy as jnp
      >>> cell = ft.nn.LSTMCell(3, 5, key=jax.random.key(0))
      >>> state, y = cell(cell.zero_state((2,)), jnp.ones((2, 3)))
      >>> state.cell.shape, y.shape
      ((2, 5), (2, 5))
      >>> cell = ft.nn.LSTMCell(3, 5, proj_size=2, key=jax.random.key(0))
      >>> state, y = cell(cell.zero_state((2,)), jnp.ones((2, 3)))
      >>> state.cell.shape, y.shape
      ((2, 5), (2, 2))
      >>> ft.nn.LSTMCell(3, 5, two_biases=True, key=jax.random.key(0)).hidden_bias.shape   # torch's b_hh
      (20,)
    """

    input_weight: jax.Array
    hidden_weight: jax.Array
    bias: jax.Array | None = field(decay=False)
    projection: jax.Array | None = None  # [hidden_size, proj_size]; None: no projection
    hidden_bias: jax.Array | None = field(decay=False, default=None)  # torch's b_hh; None: one bias
    _ranks: ClassVar[tuple[tuple[str, int], ...]] = (
        ("input_weight", 2), ("hidden_weight", 2), ("bias", 1), ("projection", 2), ("hidden_bias", 1))
    # files written before them: None
    __ft_added_static__: ClassVar[tuple[str, ...]] = ("projection", "hidden_bias")

    def __init__(self, input_size: int, hidden_size: int, *, key: jax.Array,
                 dtype: Any = jnp.float32, forget_bias: float = 1.0,
                 input_initializer: Initializer = _glorot,
                 hidden_initializer: Initializer = _orthogonal, use_bias: bool = True, proj_size: int = 0,
                 two_biases: bool = False):
        if two_biases and not use_bias:
            raise ValueError(TWO_BIASES_WITHOUT_BIAS)
        input_size, hidden_size = size_arguments("LSTMCell", input_size=input_size, hidden_size=hidden_size)
        if not is_int(proj_size) or not 0 <= proj_size < hidden_size:
            fix = max(1, hidden_size // 2) if hidden_size > 1 else 0
            raise ValueError(BAD_PROJ_SIZE.format(given=proj_size, hidden=hidden_size, fix=fix))
        proj_size = int(proj_size)
        self.input_weight, self.hidden_weight = _weights(
            key, input_size, hidden_size, 4, dtype, input_initializer, hidden_initializer, n_state=proj_size
        )
        self.bias = (jnp.zeros((4 * hidden_size,), dtype).at[hidden_size:2 * hidden_size].set(forget_bias)
                     if use_bias else None)
        # its own key (folded, not split): the other leaves draw as a cell without projection's
        self.projection = initialized(_glorot, jax.random.fold_in(key, 1), (hidden_size, proj_size),
                                      _drawn(dtype)).astype(dtype) if proj_size else None
        self.hidden_bias = jnp.zeros((4 * hidden_size,), dtype) if two_biases else None

    @property
    def hidden_size(self) -> int:
        """The cell state's features (``c``); ``hidden_weight``'s rows are ``h``'s, ``output_size``."""
        return self.input_weight.shape[1] // 4

    @property
    def proj_size(self) -> int:
        """torch's ``proj_size``: ``projection``'s columns, 0 without one."""
        return 0 if self.projection is None else self.projection.shape[1]

    @property
    def output_size(self) -> int:
        """``h``'s features: ``proj_size``, or ``hidden_size`` without a projection."""
        return self.proj_size or self.hidden_size

    def zero_state(self, batch_shape: tuple[int, ...] = ()) -> LSTMState:
        """Zero hidden ``[*batch_shape, output_size]`` and cell states ``[*batch_shape, hidden_size]``."""
        dtype = self.hidden_weight.dtype
        cell = jnp.zeros((*batch_shape, self.hidden_size), dtype)
        hidden = cell if self.projection is None else jnp.zeros((*batch_shape, self.proj_size), dtype)
        return LSTMState(hidden, cell)

    def __call__(self, state: LSTMState, x: jax.Array) -> tuple[LSTMState, jax.Array]:
        self._check_unbatched()  # an ensemble's cell outside jax.vmap
        check_input(self, x, (self.input_weight.shape[0],))
        h, c = state
        # float32 below float32, as Dense; torch's b_hh added after b_ih, as torch's gates
        gates = _plus(_plus(x @ self.input_weight + h @ self.hidden_weight, self.bias), self.hidden_bias)
        i, f, g, o = jnp.split(gates, 4, axis=-1)
        c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
        h = jax.nn.sigmoid(o) * jnp.tanh(c)
        if self.projection is not None:  # Sak et al. 2014, torch's weight_hr: h' = (o * tanh(c')) W_hr
            h = h @ self.projection
        return LSTMState(h, c), h


def _nan_outside(lengths: jax.Array, time: int, ys: Any, final: Any) -> tuple[Any, Any]:
    """``ys`` (time first, then the batch axes) and ``final`` (batch axes first) with the
    floating leaves of each sequence whose traced length lies outside ``[0, time]`` NaN
    (:data:`LENGTHS_OUTSIDE`): the step mask ``t < length`` ran all ``time`` steps for a longer
    one and none for a negative one, a valid-looking result."""
    wide = jnp.dtype(jnp.int32) if lengths.dtype.itemsize < 4 else lengths.dtype  # uint8 cannot hold 300
    bad = (lengths.astype(wide) < 0) | (lengths.astype(wide) > time)

    def nan(leaf: Any, lead: int) -> Any:
        leaf = jnp.asarray(leaf)
        if not jnp.issubdtype(leaf.dtype, jnp.inexact) or leaf.ndim < lead + bad.ndim:
            return leaf
        at = bad.reshape((1,) * lead + bad.shape + (1,) * (leaf.ndim - lead - bad.ndim))
        return jnp.where(at, jnp.asarray(jnp.nan, leaf.dtype), leaf)

    return jax.tree.map(lambda a: nan(a, 1), ys), jax.tree.map(lambda a: nan(a, 0), final)


class RNN(Layer):
    """Run a cell over a sequence with ``jax.lax.scan``: ``[..., time, features] -> [..., time, hidden]``.

    ``time_axis`` (static, default ``-2``) is the sequence axis; the axes before it are
    batch axes. ``reverse=True`` scans from the end (outputs stay in input order).
    ``rnn(xs)`` returns the outputs; ``rnn(xs, initial_state, return_state=True)``
    also returns the final state. ``initial_state`` has the structure and shapes of
    ``cell.zero_state(batch_shape)`` (an LSTM's is an :class:`LSTMState`, without torch's
    leading layers axis). A cell that returns its state in a wider floating dtype than it
    was given, as NumPy promotion does (a bfloat16 ``ft.cast`` of the model on float32
    inputs, as ``Dense`` gives float32 there; a bfloat16 ``initial_state`` with float32
    weights), runs from the initial state cast to that dtype: what a Python loop over the
    steps computes. A cell's bfloat16/float16 weights sum their gradients over the steps in
    float32 (they ride in the scan's carry as float32), as torch's RNNs sum theirs.

    ``key=`` gives step ``t`` the key ``jax.random.split(key, time)[t]`` for a cell whose
    ``__call__`` takes ``key=`` (a Dropout inside it); other cells ignore it. Layer state the
    cell records (a BatchNorm in training mode, under ``ft.nn.collect_state``) is
    collected at the cell's key path (a recorded intermediate, ``ft.nn.record_intermediate``:
    every step's, time on axis 0). A floating state recorded at every step (running
    statistics) is updated in turn, each step from the previous step's record, and ends as
    the last step's (time ``T - 1``, or ``0`` with ``reverse=True``): what the same cell
    called step by step in a Python loop inside one ``collect_state`` records, as torch's
    loop over a cell does.

    ``lengths=`` (integers of the batch's shape; torch's ``pack_padded_sequence(xs,
    lengths)``, Flax's ``seq_lengths``) runs each sequence over its first ``lengths[b]``
    steps alone, the rest of its time axis padding: the state is carried unchanged over the
    padded steps and their outputs are 0, as torch's ``pad_packed_sequence`` pads them, so
    the final state is each sequence's own last step's; ``reverse=True`` starts each at its
    own last real step (torch's packed backward direction). Without it every step is read,
    padding included: a padded batch's final states are the padding's. A length outside
    ``[0, T]`` is refused where the lengths are concrete (:data:`FIX_LENGTHS`); under
    ``jax.jit`` that sequence's outputs and final state are NaN (:data:`LENGTHS_OUTSIDE`),
    never the whole sequence's or none of it.

    Example:
      >>> import functree as ft, jax, jax.numpy as jnp
      >>> rnn = ft.nn.RNN(ft.nn.LSTMCell(3, 5, key=jax.random.key(0)))
      >>> xs = jnp.ones((2, 7, 3))                 # batch 2, 7 steps
      >>> rnn(xs).shape
      (2, 7, 5)
      >>> ys, state = rnn(xs, return_state=True)
      >>> state.hidden.shape
      (2, 5)
      >>> h0 = ft.nn.LSTMState(jnp.zeros((2, 5)), jnp.zeros((2, 5)))  # not a plain (h, c)
      >>> rnn(xs, h0).shape
      (2, 7, 5)
      >>> ys, state = rnn(xs, lengths=jnp.array([7, 3]), return_state=True)   # the second: 3 real steps
      >>> _, alone = rnn(xs[1:, :3], return_state=True)                       # its 3 steps alone
      >>> bool(jnp.all(ys[1, 3:] == 0)), bool(jnp.allclose(state.hidden[1], alone.hidden[0], atol=1e-6))
      (True, True)
    """

    cell: Any  # a SimpleRNNCell, GRUCell, LSTMCell or any Module with __call__(state, x) and zero_state
    time_axis: int = field(static=True, default=-2)
    reverse: bool = field(static=True, default=False)

    def __call__(self, xs: jax.Array, initial_state: Any = None, *, key: jax.Array | None = None,
                 return_state: bool = False, lengths: Any = None) -> Any:
        if isinstance(self.cell, _Cell):  # before its state, sized by the models' count, is read
            try:
                self.cell._check_unbatched()
            except LayerInputError as e:
                raise e.within(self.cell, (Entry(ATTR, "cell"),)) from None
        check_input(self, xs, ("time", "features"))
        axis = self.time_axis % xs.ndim
        steps = jnp.moveaxis(xs, axis, 0)
        batch = steps.shape[1:-1]
        state = self.cell.zero_state(batch) if initial_state is None else self._checked(initial_state, batch, xs)
        keys = jax.random.split(one_key(key), steps.shape[0]) if key is not None and takes_key(self.cell) else None
        real = None if lengths is None else self._real_steps(lengths, steps, xs)
        try:
            try:
                final, ys, paths, values = self._scan(state, steps, keys, real, widen=True)
            except _Widened as w:  # the cell promotes its state (bfloat16 weights, float32 xs)
                state = jax.tree.map(lambda s, d: jnp.asarray(s).astype(d), state, w.dtypes)
                final, ys, paths, values = self._scan(state, steps, keys, real, widen=False)
        except LayerInputError as e:
            raise e.within(self.cell, (Entry(ATTR, "cell"),)) from None
        if isinstance(lengths, Tracer):  # traced lengths, unchecked: a sequence's outside [0, T] reads NaN
            ys, final = _nan_outside(lengths, steps.shape[0], ys, final)
        if paths and steps.shape[0]:  # the last step run: time T - 1, or 0 scanning backwards
            last = 0 if self.reverse else -1
            # layer state: the last step's; a recorded intermediate: every step's, time on axis 0
            record_under(self, "cell", paths, [v if isinstance(v, Intermediate) else v[last] for v in values])
        ys = jnp.moveaxis(ys, 0, axis)
        return (ys, final) if return_state else ys

    def _scan(self, state: Any, steps: jax.Array, keys: Any, real: Any, *,
              widen: bool) -> tuple[Any, Any, list[KeyPath], Any]:
        """One ``lax.scan`` of the cell: ``(final state, outputs, state paths, state values)``.

        The cell's half-precision leaves ride in the carry as float32 (``wide``), cast back
        inside the body (exact): scan's transpose sums a weight's gradient over the steps in
        its carry's dtype, so a bfloat16 bias summed 256 steps of cotangents in bfloat16.
        ``real`` (``[time, *batch]`` booleans, or None): the steps each sequence runs."""
        wide = _widened(self.cell)
        if not collecting() or (real is not None and not self._records(state, steps, keys)):
            eager = _eager_scan(self, state, wide, steps, keys, real, widen)
            if eager is not None:  # compiled once per signature, not at every call
                (final, _), (ys, values) = eager()
                return final, ys, [], values
            body = _step(self.cell, keys is not None, widen, bool(wide), real is not None)
            (final, _), (ys, values) = jax.lax.scan(body, (state, wide), (steps, keys, real), reverse=self.reverse)
            return final, ys, [], values
        if real is not None:
            raise ValueError(LENGTHS_COLLECTING)
        # Running statistics are threaded through the carry: step t reads step t - 1's record.
        threaded = threaded_state(self.cell)
        paths: list[KeyPath] = []
        body = _Step(self.cell, keys is not None, widen, paths, threaded=tuple(threaded), wide=bool(wide))
        ((final, _), _), (ys, values) = jax.lax.scan(body, ((state, tuple(threaded.values())), wide),
                                                     (steps, keys, None), reverse=self.reverse)
        return final, ys, paths, values

    def _records(self, state: Any, steps: jax.Array, keys: Any) -> bool:
        """Whether one step of the cell records anything (layer state, an intermediate):
        traced abstractly (``jax.eval_shape``), nothing compiled. A cell that records
        nothing runs the plain scan under ``collect_state`` too (``lengths=`` included)."""
        paths: list[KeyPath] = []

        def step(cell: Any, carry: Any, steps: jax.Array, keys: Any) -> Any:
            kw = {} if keys is None else {"key": keys[0]}
            return call_collecting(lambda c: c(carry, steps[0], **kw), cell, paths)[0]

        jax.eval_shape(step, self.cell, state, steps, keys)
        return bool(paths)

    def _real_steps(self, lengths: Any, steps: jax.Array, xs: jax.Array) -> Any:
        """``[time, *batch]``: whether step ``t`` of each sequence is real (``t < lengths``),
        ``lengths`` checked (its values where they are known: not under ``jit``). Known
        lengths give a NumPy array (compared on the host: an eager call compiles nothing
        for them), traced ones a traced array."""
        time, batch = steps.shape[0], steps.shape[1:-1]
        given = lengths if isinstance(lengths, jax.Array) else np.asarray(lengths)
        ok = given.shape == batch and jnp.issubdtype(given.dtype, jnp.integer)
        index = (time,) + (1,) * len(batch)
        if ok and isinstance(given, Tracer):
            # the steps and lengths in one integer type that holds every step: int32 (int64 for
            # a 64-bit array under x64), never the lengths' own narrow one (uint8 wraps at 256)
            wide = jnp.dtype(jnp.int32) if given.dtype.itemsize < 4 else given.dtype
            return jnp.arange(time, dtype=wide).reshape(index) < given.astype(wide)[None]
        known = np.asarray(given)  # known values: checked and compared on the host, no program compiled
        if not (ok and ((known >= 0) & (known <= time)).all()):
            fix = f"{FIX_LENGTHS}\n{LENGTHS_OUTSIDE}" if ok else FIX_LENGTHS  # the values outside [0, T]
            raise LayerInputError(self, LENGTHS_EXPECTED.format(batch=batch, time=time, xs=short_array(xs)),
                                  f"{short_array(given)} {_values(given)}", fix)
        return np.arange(time).reshape(index) < known

    def _checked(self, state: Any, batch: tuple[int, ...], xs: jax.Array) -> Any:
        """``state`` if it has the structure and shapes of ``cell.zero_state(batch)``."""
        expected = jax.eval_shape(lambda: self.cell.zero_state(batch))
        given_leaves = jax.tree.leaves(state)
        same_structure = jax.tree.structure(state) == jax.tree.structure(expected)
        shapes = [jnp.shape(a) for a in given_leaves]
        wanted = [a.shape for a in jax.tree.leaves(expected)]
        if same_structure and shapes == wanted:
            return state
        torch_axis = len(shapes) == len(wanted) and all(
            len(g) == len(w) + 1 and g[1:] == w for g, w in zip(shapes, wanted)
        )
        if torch_axis and not same_structure and isinstance(expected, LSTMState):
            fix = f"{FIX_LSTM_STATE}\n{FIX_TORCH_AXIS}"
        elif not same_structure and isinstance(expected, LSTMState) and isinstance(state, (tuple, list)):
            fix = FIX_LSTM_STATE
        elif torch_axis:
            fix = FIX_TORCH_AXIS
        else:
            fix = FIX_STATE.format(batch=batch)
        raise LayerInputError(
            self, STATE_EXPECTED.format(expected=_show(expected), batch=batch, xs=short_array(xs)),
            f"{_show(state)}", fix,
        )


def _values(given: Any) -> str:
    """A known integer array's range, for an error (nothing for a traced one)."""
    if isinstance(given, Tracer) or given.size == 0 or not jnp.issubdtype(given.dtype, jnp.number):
        return ""
    return f"(from {given.min()} to {given.max()})"


def _show(tree: Any) -> str:
    """``f32[2,4]``, ``LSTMState(hidden=f32[2,4], cell=f32[2,4])``, ``tuple(f32[2,4], ...)``."""
    if hasattr(tree, "shape") and hasattr(tree, "dtype"):
        return short_array(tree)
    fields: tuple[str, ...] | None = getattr(type(tree), "_fields", None)  # a NamedTuple
    if isinstance(tree, tuple) and fields is not None:
        return f"{type(tree).__name__}(" + ", ".join(f"{n}={_show(v)}" for n, v in zip(fields, tree)) + ")"
    if isinstance(tree, (tuple, list)):
        return f"{type(tree).__name__}(" + ", ".join(_show(v) for v in tree) + ")"
    if isinstance(tree, dict):
        return "{" + ", ".join(f"{k!r}: {_show(v)}" for k, v in tree.items()) + "}"
    return f"{type(tree).__name__} {jax.tree.map(lambda a: str(jnp.shape(a)), tree)}"


class _Step:
    """The scan body ``(carry, (x, k, real)) -> (new, (y, values))``: the cell, given its step's
    key if ``keyed``, its new state checked (where ``masked``, kept and the output 0 at a
    step that is not ``real``: padding); with ``paths``, the cell (traced by scan: new
    tracers, not the model's arrays) records its layer state into a collection of its own,
    stacked by the scan (``values``), its key paths stored into ``paths`` while tracing.

    The non-collecting body is one per cell (:func:`_step`), held weakly, so eager calls hit
    JAX's trace and compile caches (a fresh closure would retrace and recompile the scan at
    every call) without the cache keeping the cell alive."""

    def __init__(self, cell: Any, keyed: bool, widen: bool, paths: list[KeyPath] | None = None,
                 weak: bool = False, threaded: tuple[KeyPath, ...] = (), wide: bool = False,
                 masked: bool = False) -> None:
        self.cell: Callable[[], Any] = weakref.ref(cell) if weak else (lambda: cell)
        self.keyed, self.widen, self.paths, self.threaded, self.wide = keyed, widen, paths, threaded, wide
        self.masked = masked

    def __call__(self, carry: Any, step: tuple[jax.Array, Any, Any]) -> tuple[Any, Any]:
        carry, wide = carry
        cell: Any = _narrowed(self.cell(), wide) if self.wide else self.cell()
        new, out = self._call(cell, carry, step)
        return (new, wide), out

    def _call(self, cell: Any, carry: Any, step: tuple[jax.Array, Any, Any]) -> tuple[Any, Any]:
        x, k, real = step
        kw = {"key": k} if self.keyed else {}
        if self.paths is None:
            (new, y), values = cell(carry, x, **kw), ()
            _check_carry(cell, carry, new, self.widen)
            if self.masked:  # a padded step: the state carried on, the output 0 (pad_packed_sequence's)
                new = jax.tree.map(lambda n, o: jnp.where(_over(real, n), n, o), new, carry)
                y = jax.tree.map(lambda v: jnp.where(_over(real, v), v, jnp.zeros_like(v)), y)
            return new, (y, values)
        carry, stats = carry  # collecting: (the cell's state, the threaded running statistics)
        cell = apply_state(cell, dict(zip(self.threaded, stats)))
        (new, y), values = call_collecting(lambda c: c(carry, x, **kw), cell, self.paths)
        _check_carry(cell, carry, new, self.widen)
        recorded = dict(zip(self.paths, values))
        stats = tuple(recorded.get(path, old) for path, old in zip(self.threaded, stats))
        return (new, stats), (y, values)


def _over(real: jax.Array, value: jax.Array) -> jax.Array:
    """``real`` (``[*batch]``) broadcast over ``value``'s trailing axes (``[*batch, ...]``)."""
    return real.reshape(real.shape + (1,) * (jnp.ndim(value) - real.ndim))


_STEPS: weakref.WeakKeyDictionary[Any, dict[tuple[bool, bool, bool, bool], _Step]] = weakref.WeakKeyDictionary()


def _step(cell: Any, keyed: bool, widen: bool, wide: bool, masked: bool = False) -> _Step:
    try:
        steps = _STEPS.setdefault(cell, {})
    except TypeError:  # not weakly referable: a fresh body (retraced at each eager call)
        return _Step(cell, keyed, widen, wide=wide, masked=masked)
    found = steps.get((keyed, widen, wide, masked))
    if found is None:
        found = steps[keyed, widen, wide, masked] = _Step(cell, keyed, widen, weak=True, wide=wide, masked=masked)
    return found


# An eager call's compiled scan, one per structure and abstract signature of the cell and
# its inputs, and per value of what the cell's Python reads (as Stack's: ``_stack._SCANS``).
_SCANS: dict[Any, tuple[tuple[Any, Any], dict[Any, Callable[..., Any]]]] = {}


def _eager_scan(rnn: RNN, state: Any, wide: Any, steps: jax.Array, keys: Any, real: Any,
                widen: bool) -> Callable[[], Any] | None:
    """The non-collecting scan run eagerly (at top level, under ``jax.grad`` or ``jax.vmap``:
    no jaxpr staged around it) as ``() -> ((final, wide), (ys, values))``, or None.

    The body closes over the cell: ``ft.gradient`` rebuilds the model from new tracers at
    every call and ``ft.move`` makes a new cell, so a body cached per cell object (``_step``)
    was traced and compiled again at every eager gradient, and at the first call of every
    moved model. Here the scan runs in a ``jax.jit`` made once per structure and signature,
    the cell passed in as an argument."""
    if staged():
        return None
    flags = (keys is not None, widen, bool(wide), real is not None, rnn.reverse)
    run = eager_program(_SCANS, rnn.cell, (rnn.cell, state, wide, steps, keys, real), flags,
                        lambda: jax.jit(functools.partial(_compiled_scan, *flags)))
    if run is None:
        return None
    return lambda: run(rnn.cell, state, wide, steps, keys, real)


def _compiled_scan(keyed: bool, widen: bool, is_wide: bool, masked: bool, reverse: bool, cell: Any,
                   state: Any, wide: Any, steps: jax.Array, keys: Any, real: Any) -> Any:
    body = _Step(cell, keyed, widen, wide=is_wide, masked=masked)
    return jax.lax.scan(body, (state, wide), (steps, keys, real), reverse=reverse)


def _half(leaf: Any) -> bool:
    """A floating array of fewer than 32 bits (bfloat16, float16)."""
    dtype = getattr(leaf, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jnp.floating) and jnp.finfo(dtype).bits < 32


def _widened(cell: Any) -> tuple[jax.Array, ...]:
    """The cell's half-precision leaves as float32, in leaf order (``()`` if it has none)."""
    return tuple(leaf.astype(jnp.float32) for leaf in jax.tree.leaves(cell) if _half(leaf))


def _narrowed(cell: Any, wide: tuple[jax.Array, ...]) -> Any:
    """``cell`` with its half-precision leaves read from ``wide``, cast back to their dtypes."""
    leaves, treedef = jax.tree.flatten(cell)
    carried = iter(wide)
    return jax.tree.unflatten(treedef, [next(carried).astype(a.dtype) if _half(a) else a for a in leaves])


class _Widened(Exception):
    """The cell returned its state in wider floating dtypes (``dtypes``): scan again from them."""

    def __init__(self, dtypes: Any) -> None:
        super().__init__()
        self.dtypes = dtypes


def _check_carry(cell: Any, carry: Any, new: Any, widen: bool) -> None:
    """Raise unless ``new`` has ``carry``'s structure, shapes and dtypes; :class:`_Widened`
    (when ``widen``) if only floating dtypes grew to more bits (as NumPy promotion grows
    them: casting the initial state there is exact)."""
    old_leaves, new_leaves = jax.tree.leaves(carry), jax.tree.leaves(new)
    if jax.tree.structure(carry) == jax.tree.structure(new) and all(
        jnp.shape(a) == jnp.shape(b) for a, b in zip(old_leaves, new_leaves)
    ):
        old = [jnp.result_type(a) for a in old_leaves]
        returned = [jnp.result_type(b) for b in new_leaves]
        if old == returned:
            return
        if widen and all(
            o == r or (jnp.issubdtype(o, jnp.floating) and jnp.issubdtype(r, jnp.floating)
                       and jnp.finfo(r).bits > jnp.finfo(o).bits)  # exact: bf16/f16 -> f32 -> f64
            for o, r in zip(old, returned)
        ):
            raise _Widened(jax.tree.unflatten(jax.tree.structure(carry), returned))
    raise ValueError(CHANGES_STATE.format(cell=type(cell).__name__, given=_show(carry), returned=_show(new)))
