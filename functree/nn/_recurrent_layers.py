"""Bidirectional and multi-layer recurrence: ``Bidirectional``, ``StackedRNN`` and torch's
``nn.LSTM`` / ``nn.GRU`` / ``nn.RNN`` as ``LSTM``, ``GRU``, ``SimpleRNN``.

A :class:`StackedRNN` runs its layers (each an ``RNN`` or a ``Bidirectional`` pair of them)
one after the other, dropout between them in training, as torch's ``num_layers=`` does.
Its final state is a tuple of ``num_layers * num_directions`` cell states in torch's order
(layer 0 forward, layer 0 backward, layer 1 forward, ...); ``jax.tree.map(lambda *s:
jnp.stack(s), *states)`` gives torch's ``h_n`` (an LSTM's: ``LSTMState(h_n, c_n)``), and the
initial state is taken in either form. The layers are a tuple, not an ``ft.nn.Stack``:
layer 0 reads ``input_size`` features, the others ``num_directions * hidden_size``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from functree._activations import relu, tanh
from functree._paths import ATTR, INDEX, Entry
from functree._random import one_key
from functree.nn._check import LayerInputError, size_argument, size_arguments
from functree.nn._dropout import Dropout
from functree.nn._mode import Layer
from functree.nn._recurrent import RNN, GRUCell, LSTMCell, SimpleRNNCell, _show
from functree.nn._window import is_int

__all__ = ["Bidirectional", "StackedRNN", "LSTM", "GRU", "SimpleRNN"]

NOT_REVERSED = """\
ft.nn.Bidirectional: the {which} RNN has reverse={given}; the forward one reads the sequence \
from its start (reverse=False), the backward one from its end (reverse=True), and the \
backward outputs stay in input order (torch's bidirectional layer, its "_reverse" tensors).

    wrong:  ft.nn.Bidirectional(ft.nn.RNN(cell_f), ft.nn.RNN(cell_b))
    right:  ft.nn.Bidirectional(ft.nn.RNN(cell_f), ft.nn.RNN(cell_b, reverse=True))"""

TIME_AXES = """\
ft.nn.Bidirectional: the forward RNN reads time on axis {forward}, the backward one on axis \
{backward}; both directions read the same sequence.

    right:  ft.nn.RNN(cell_b, reverse=True, time_axis={forward})"""

LAYER_SIZES = """\
ft.nn.StackedRNN: layer {k} reads {inputs} features, but layer {previous} gives {outputs} \
(hidden_size {hidden} x {directions} direction(s)). Each layer after the first reads the \
previous layer's outputs:

    right:  ft.nn.{cell}({outputs}, hidden_size, key=k)   # layer {k}'s cell (a Bidirectional's: both)"""

STATE_COUNT = "initial_state of {count} cell states [*batch, hidden] (num_layers * num_directions, torch's order), " \
    "as a tuple, or stacked on a leading axis of {count} as torch takes h_0"

FIX_STATE_COUNT = """\
Give one state per layer and direction (layer 0 forward, layer 0 backward, layer 1 forward, ...):
    right:  stack(xs, h0)                      # h0 [{count}, *batch, hidden], as torch.nn.GRU takes it
       or:  stack(xs, ft.nn.LSTMState(h0, c0))  # an LSTM's (h_0, c_0), each [{count}, *batch, hidden]
       or:  stack(xs, tuple(states))           # {count} states, each as cell.zero_state(batch) gives"""

FIX_LSTM_PAIR = """\
An LSTM's (h_0, c_0) is an ft.nn.LSTMState, not a plain pair (read as one state per layer and direction):
    wrong:  lstm(xs, (h0, c0))
    right:  lstm(xs, ft.nn.LSTMState(h0, c0))   # each [{count}, *batch, hidden], as torch takes them"""

NONLINEARITY = """\
ft.nn.SimpleRNN: nonlinearity={given!r}; torch's nn.RNN takes "tanh" or "relu".

    right:  ft.nn.SimpleRNN(n_in, n_hidden, nonlinearity="relu", batch_first=True, key=k)
       or:  ft.nn.StackedRNN([ft.nn.RNN(ft.nn.SimpleRNNCell(n_in, n_hidden, activation=f, key=k))])   # another f"""

BATCH_FIRST = """\
ft.nn.{cls}: batch_first={given!r}; say where time is, True or False. torch's nn.{torch} reads \
[time, batch, features] unless batch_first=True, ft's layers read [*batch, time, features]: \
either default would read the other's inputs with their batch and time axes swapped, the \
shapes accepted and the numbers wrong.

    wrong:  ft.nn.{cls}(n_in, n_hidden, num_layers=2, key=k)
    right:  ft.nn.{cls}(n_in, n_hidden, num_layers=2, batch_first=True, key=k)    # xs [batch, time, features]
       or:  ft.nn.{cls}(n_in, n_hidden, num_layers=2, batch_first=False, key=k)   # xs [time, batch, features], torch's default"""

BAD_NUM_LAYERS = """\
ft.nn.{cls}: num_layers={given}; a recurrent stack has at least one layer.

    right:  ft.nn.{cls}(n_in, n_hidden, num_layers=1, batch_first=True, key=k)"""


class Bidirectional(Layer):
    """Two RNNs over one sequence, one from each end, their outputs concatenated:
    ``[..., time, features] -> [..., time, forward_hidden + backward_hidden]``.

    ``forward`` is an ``ft.nn.RNN`` (``reverse=False``), ``backward`` one with
    ``reverse=True`` (its outputs stay in input order): torch's ``bidirectional=True`` layer,
    whose output is ``[forward, backward]`` on the feature axis, and Flax's
    ``nn.Bidirectional`` (which reverses its backward RNN itself: here it is built reversed).
    ``initial_state`` and the final state are pairs ``(forward, backward)`` of the cells'
    states; ``key=`` is split between the two; ``lengths=`` goes to both (the backward RNN
    starts each sequence at its own last real step, as torch's packed sequences).

    Example:
      >>> import functree as ft, jax, jax.numpy as jnp
      >>> kf, kb = jax.random.split(jax.random.key(0))
      >>> bi = ft.nn.Bidirectional(ft.nn.RNN(ft.nn.GRUCell(3, 4, key=kf)),
      ...                          ft.nn.RNN(ft.nn.GRUCell(3, 4, key=kb), reverse=True))
      >>> ys, (h_forward, h_backward) = bi(jnp.ones((2, 7, 3)), return_state=True)
      >>> ys.shape, h_backward.shape
      ((2, 7, 8), (2, 4))
    """

    forward: Any
    backward: Any

    def __init__(self, forward: Any, backward: Any):
        for which, rnn, wanted in (("forward", forward, False), ("backward", backward, True)):
            if getattr(rnn, "reverse", wanted) != wanted:
                raise ValueError(NOT_REVERSED.format(which=which, given=rnn.reverse))
        axes = getattr(forward, "time_axis", None), getattr(backward, "time_axis", None)
        if None not in axes and axes[0] != axes[1]:
            raise ValueError(TIME_AXES.format(forward=axes[0], backward=axes[1]))
        self.forward, self.backward = forward, backward

    def __call__(self, xs: jax.Array, initial_state: Any = None, *, key: jax.Array | None = None,
                 return_state: bool = False, lengths: Any = None) -> Any:
        start = (None, None) if initial_state is None else _pair(self, initial_state, xs)
        keys = (None, None) if key is None else tuple(jax.random.split(one_key(key)))
        outs, finals = [], []
        given = {} if lengths is None else {"lengths": lengths}
        for name, state, k in zip(("forward", "backward"), start, keys):
            try:
                ys, final = getattr(self, name)(xs, state, key=k, return_state=True, **given)
            except LayerInputError as e:
                raise e.within(getattr(self, name), (Entry(ATTR, name),)) from None
            outs.append(ys)
            finals.append(final)
        ys = jnp.concatenate(outs, axis=-1)
        return (ys, tuple(finals)) if return_state else ys


def _pair(layer: Bidirectional, state: Any, xs: jax.Array) -> tuple[Any, Any]:
    if type(state) in (tuple, list) and len(state) == 2:
        return state[0], state[1]
    raise LayerInputError(layer, "initial_state (forward state, backward state)", _show(state),
                          "    right:  bi(xs, (forward_state, backward_state))   # each as its cell.zero_state(batch)")


class StackedRNN(Layer):
    """Recurrent layers run in turn, ``dropout`` on each one's outputs but the last in
    training: torch's ``nn.LSTM(..., num_layers=n, dropout=p)`` (built by :class:`LSTM`,
    :class:`GRU`, :class:`SimpleRNN`).

    ``layers`` is a tuple of ``ft.nn.RNN`` and ``ft.nn.Bidirectional`` layers; layer ``k > 0``
    reads layer ``k - 1``'s outputs. ``dropout`` is an ``ft.nn.Dropout`` (a rate is made
    one): off in inference (the default), on after ``ft.nn.training(model)``, where a call
    needs ``key=`` (split between the dropouts and the layers).

    ``stack(xs, initial_state, return_state=True)`` returns ``(outputs, final)``: ``final``
    is a tuple of the ``num_layers * num_directions`` cells' final states in torch's order
    (layer 0 forward, layer 0 backward, layer 1 forward, ...). torch's ``h_n`` is them
    stacked, ``jax.tree.map(lambda *s: jnp.stack(s), *final)`` (an LSTM's:
    ``LSTMState(h_n, c_n)``); ``initial_state`` is either form (``None``: zeros), an LSTM's
    stacked form an ``ft.nn.LSTMState(h_0, c_0)``. ``lengths=`` (one per sequence) goes to
    every layer: torch's ``pack_padded_sequence(xs, lengths, batch_first=...,
    enforce_sorted=False)`` through the module, its outputs ``pad_packed_sequence``'s (0 at
    the padded steps) and its final states each sequence's own (``ft.nn.RNN``).

    Example:
      >>> import functree as ft, jax, jax.numpy as jnp
      >>> lstm = ft.nn.LSTM(3, 5, num_layers=2, bidirectional=True, batch_first=True, key=jax.random.key(0))
      >>> ys, final = lstm(jnp.ones((4, 7, 3)), return_state=True)   # batch 4, 7 steps
      >>> ys.shape, len(final)
      ((4, 7, 10), 4)
      >>> h_n, c_n = jax.tree.map(lambda *s: jnp.stack(s), *final)   # torch's (h_n, c_n)
      >>> h_n.shape
      (4, 4, 5)
      >>> lstm(jnp.ones((4, 7, 3)), ft.nn.LSTMState(h_n, c_n)).shape   # torch's (h_0, c_0)
      (4, 7, 10)
    """

    layers: tuple[Any, ...]
    dropout: Dropout

    def __init__(self, layers: Any, dropout: float | Dropout = 0.0):
        self.layers = tuple(layers)
        self.dropout = dropout if isinstance(dropout, Dropout) else Dropout(dropout)
        _check_sizes(self.layers)

    @property
    def num_states(self) -> int:
        """``num_layers * num_directions``: the cell states of ``initial_state`` and the final state."""
        return sum(_directions(layer) for layer in self.layers)

    def __call__(self, xs: jax.Array, initial_state: Any = None, *, key: jax.Array | None = None,
                 return_state: bool = False, lengths: Any = None) -> Any:
        starts = self._grouped(initial_state, xs)
        given = {} if lengths is None else {"lengths": lengths}
        n = len(self.layers)
        keys: list[Any] = [None] * (2 * n) if key is None else list(jax.random.split(one_key(key), 2 * n))
        finals: list[Any] = []
        for k, (layer, start) in enumerate(zip(self.layers, starts)):
            if k:  # torch: dropout on every layer's outputs but the last's, in training
                xs = self.dropout(xs, key=keys[n + k])
            try:
                xs, final = layer(xs, start, key=keys[k], return_state=True, **given)
            except LayerInputError as e:
                raise e.within(layer, (Entry(ATTR, "layers"), Entry(INDEX, k))) from None
            finals.extend(final if isinstance(layer, Bidirectional) else (final,))
        return (xs, tuple(finals)) if return_state else xs

    def _grouped(self, state: Any, xs: jax.Array) -> list[Any]:
        """Each layer's initial state (None, a cell state, or a Bidirectional's pair)."""
        if state is None:
            return [None] * len(self.layers)
        count = self.num_states
        if type(state) in (tuple, list) and len(state) == 2 and _lstm(self.layers) and all(
                hasattr(s, "shape") for s in state):  # torch's (h_0, c_0): a pair of arrays, no LSTMState
            raise LayerInputError(self, STATE_COUNT.format(count=count), _show(state), FIX_LSTM_PAIR.format(count=count))
        if type(state) in (tuple, list) and len(state) == count:
            flat = list(state)
        else:  # torch's form: every leaf stacked on a leading axis of num_layers * num_directions
            leaves = jax.tree.leaves(state)
            rank = jnp.ndim(xs) if _own_cells(self.layers) else None  # [count, *batch, hidden]: xs's rank
            if not leaves or type(state) in (tuple, list) or any(
                    jnp.ndim(a) < 1 or jnp.shape(a)[0] != count or rank not in (None, jnp.ndim(a)) for a in leaves):
                raise LayerInputError(self, STATE_COUNT.format(count=count), _show(state),
                                      FIX_STATE_COUNT.format(count=count))
            flat = [jax.tree.map(lambda a, i=i: a[i], state) for i in range(count)]
        grouped, i = [], 0
        for layer in self.layers:
            d = _directions(layer)
            grouped.append(tuple(flat[i:i + d]) if d == 2 else flat[i])
            i += d
        return grouped


def _lstm(layers: tuple[Any, ...]) -> bool:
    """Whether the first layer's cell is an LSTMCell (its state an LSTMState)."""
    first = layers[0].forward if layers and isinstance(layers[0], Bidirectional) else (layers[0] if layers else None)
    return isinstance(getattr(first, "cell", None), LSTMCell)


def _own_cells(layers: tuple[Any, ...]) -> bool:
    """Whether every cell is functree's, whose state is ``[*batch, hidden]``: one axis fewer than the
    inputs ``[*batch, time, features]``, so a state stacked as torch's ``h_0`` has the inputs' rank
    (a per-cell state whose batch happens to equal the state count does not pass for it)."""
    rnns = [r for layer in layers for r in ((layer.forward, layer.backward) if isinstance(layer, Bidirectional)
                                             else (layer,))]
    return all(isinstance(getattr(r, "cell", None), (SimpleRNNCell, GRUCell, LSTMCell)) for r in rnns)


def _directions(layer: Any) -> int:
    return 2 if isinstance(layer, Bidirectional) else 1


def _sizes(layer: Any) -> tuple[int | None, int | None, str]:
    """A layer's (inputs, outputs, cell name) where its cells are functree's (else None)."""
    rnns = (layer.forward, layer.backward) if isinstance(layer, Bidirectional) else (layer,)
    cells = [getattr(r, "cell", None) for r in rnns]
    if not all(isinstance(c, (SimpleRNNCell, GRUCell, LSTMCell)) for c in cells):
        return None, None, ""
    inputs = int(cells[0].input_weight.shape[0])  # type: ignore[union-attr]
    return inputs, sum(int(c.output_size) for c in cells), type(cells[0]).__name__  # type: ignore[union-attr]


def _check_sizes(layers: tuple[Any, ...]) -> None:
    """:data:`LAYER_SIZES` where a layer's cells read another size than the layer before gives."""
    for k in range(1, len(layers)):
        _, outputs, _ = _sizes(layers[k - 1])
        inputs, _, cell = _sizes(layers[k])
        if outputs is not None and inputs is not None and inputs != outputs:
            d = _directions(layers[k - 1])
            raise ValueError(LAYER_SIZES.format(k=k, previous=k - 1, inputs=inputs, outputs=outputs,
                                                hidden=outputs // d, directions=d, cell=cell))


def _built(make: Callable[..., Any], input_size: int, hidden_size: int, num_layers: int, key: jax.Array,
           bidirectional: bool, batch_first: bool, output_size: int = 0) -> tuple[Any, ...]:
    """torch's layers: layer ``k``'s cells (forward, then backward) from ``split(key, 2 * num_layers)``;
    layer ``k > 0`` reads ``num_directions * output_size`` features (0: ``hidden_size``; an
    LSTM with projections: its ``proj_size``)."""
    keys = jax.random.split(one_key(key), 2 * num_layers)
    time_axis = -2 if batch_first else 0
    rnn: Any = RNN  # its dataclass __init__ (cell, time_axis, reverse), which pyright does not see
    layers = []
    for k in range(num_layers):
        n_in = input_size if k == 0 else (output_size or hidden_size) * (2 if bidirectional else 1)
        forward = rnn(make(n_in, hidden_size, key=keys[2 * k]), time_axis=time_axis)
        if bidirectional:
            forward = Bidirectional(forward, rnn(make(n_in, hidden_size, key=keys[2 * k + 1]), time_axis=time_axis,
                                                 reverse=True))
        layers.append(forward)
    return tuple(layers)


def _check_batch_first(cls: str, batch_first: Any) -> bool:
    """``batch_first``, or :data:`BATCH_FIRST` unless it is given as a bool: no default is safe here."""
    if not isinstance(batch_first, bool):
        raise ValueError(BATCH_FIRST.format(cls=cls, given=batch_first, torch="RNN" if cls == "SimpleRNN" else cls))
    return batch_first


def _checked_sizes(cls: str, input_size: Any, hidden_size: Any, num_layers: Any) -> tuple[int, int, int]:
    """The sizes as Python ints (NumPy's taken), each named at the call when it is none
    (:data:`BAD_SIZE_ARGUMENT`; :data:`BAD_NUM_LAYERS` for no layer)."""
    if is_int(num_layers) and num_layers < 1:
        raise ValueError(BAD_NUM_LAYERS.format(cls=cls, given=num_layers))
    input_size, hidden_size = size_arguments(cls, input_size=input_size, hidden_size=hidden_size)
    return input_size, hidden_size, size_argument(cls, "num_layers", num_layers, 1)


class LSTM(StackedRNN):
    """torch's ``nn.LSTM``: ``num_layers`` of ``ft.nn.LSTMCell``, ``bidirectional``, ``dropout``
    between layers in training (:class:`StackedRNN`).

    ``batch_first`` is required (:data:`BATCH_FIRST`): ``True`` reads ``[*batch, time,
    features]`` (ft's layers), ``False`` ``[time, *batch, features]`` (torch's default, which
    a default here would misread with no error: the shapes fit either way).
    ``bias=False`` builds the cells without biases. ``proj_size=p`` (Sak et al. 2014) gives
    each cell a ``projection`` (``LSTMCell(..., proj_size=p)``: ``h`` and the outputs have
    ``p`` features per direction, ``c`` ``hidden_size``; layer ``k > 0`` reads ``p *
    num_directions``), torch's ``h_n`` ``[layers * dirs, batch, p]``. The cells start as ``LSTMCell``'s do (glorot / orthogonal, forget
    bias 1), not as torch's uniform draws; ``ft.nn.load_torch_state_dict`` takes torch's
    ``weight_ih_l1_reverse``... tensors. ``two_biases=True`` (``LSTMCell(...,
    two_biases=True)``) keeps torch's ``bias_ih`` and ``bias_hh`` apart, each trained as
    torch trains it: a port trained step for step as torch's needs it (without it the one
    bias ``b_ih + b_hh`` moves half as far as torch's pair under SGD and Adam, and the
    global gradient norm counts its gradient once, not twice).

    Example:
      >>> import functree as ft, jax, jax.numpy as jnp
      >>> lstm = ft.nn.LSTM(3, 5, num_layers=3, batch_first=True, key=jax.random.key(0))
      >>> lstm(jnp.ones((2, 7, 3))).shape
      (2, 7, 5)
    """

    def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1, *, key: jax.Array,
                 bias: bool = True, batch_first: bool | None = None, dropout: float = 0.0, bidirectional: bool = False,
                 proj_size: int = 0, dtype: Any = jnp.float32, forget_bias: float = 1.0,
                 two_biases: bool = False):
        input_size, hidden_size, num_layers = _checked_sizes("LSTM", input_size, hidden_size, num_layers)
        batch_first = _check_batch_first("LSTM", batch_first)
        def make(n_in: int, n_hidden: int, key: jax.Array) -> LSTMCell:
            return LSTMCell(n_in, n_hidden, key=key, dtype=dtype, forget_bias=forget_bias, use_bias=bias,
                            proj_size=proj_size, two_biases=two_biases)
        super().__init__(_built(make, input_size, hidden_size, num_layers, key, bidirectional, batch_first,
                                proj_size), dropout)


class GRU(StackedRNN):
    """torch's ``nn.GRU``: ``num_layers`` of ``ft.nn.GRUCell``, ``bidirectional``, ``dropout``
    between layers in training (:class:`StackedRNN`; ``batch_first`` and ``bias`` as :class:`LSTM`'s).

    Example:
      >>> import functree as ft, jax, jax.numpy as jnp
      >>> gru = ft.nn.GRU(3, 5, num_layers=2, bidirectional=True, batch_first=True, key=jax.random.key(0))
      >>> ys, final = gru(jnp.ones((2, 7, 3)), return_state=True)
      >>> ys.shape, jnp.stack(final).shape   # torch's h_n: [num_layers * 2, batch, hidden]
      ((2, 7, 10), (4, 2, 5))
    """

    def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1, *, key: jax.Array,
                 bias: bool = True, batch_first: bool | None = None, dropout: float = 0.0, bidirectional: bool = False,
                 dtype: Any = jnp.float32):
        input_size, hidden_size, num_layers = _checked_sizes("GRU", input_size, hidden_size, num_layers)
        batch_first = _check_batch_first("GRU", batch_first)
        def make(n_in: int, n_hidden: int, key: jax.Array) -> GRUCell:
            return GRUCell(n_in, n_hidden, key=key, dtype=dtype, use_bias=bias)
        super().__init__(_built(make, input_size, hidden_size, num_layers, key, bidirectional, batch_first), dropout)


class SimpleRNN(StackedRNN):
    """torch's ``nn.RNN`` (``ft.nn.RNN`` is the scan of one cell): ``num_layers`` of
    ``ft.nn.SimpleRNNCell``, ``nonlinearity`` ``"tanh"`` or ``"relu"``, ``bidirectional``,
    ``dropout`` between layers in training (:class:`StackedRNN`; ``batch_first`` and
    ``bias`` as :class:`LSTM`'s).

    Example:
      >>> import functree as ft, jax, jax.numpy as jnp
      >>> rnn = ft.nn.SimpleRNN(3, 5, num_layers=2, nonlinearity="relu", batch_first=True, key=jax.random.key(0))
      >>> rnn(jnp.ones((2, 7, 3))).shape
      (2, 7, 5)
    """

    def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1, *, key: jax.Array,
                 nonlinearity: str = "tanh", bias: bool = True, batch_first: bool | None = None, dropout: float = 0.0,
                 bidirectional: bool = False, dtype: Any = jnp.float32):
        if nonlinearity not in ("tanh", "relu"):
            raise ValueError(NONLINEARITY.format(given=nonlinearity))
        input_size, hidden_size, num_layers = _checked_sizes("SimpleRNN", input_size, hidden_size, num_layers)
        batch_first = _check_batch_first("SimpleRNN", batch_first)
        activation = tanh if nonlinearity == "tanh" else relu
        def make(n_in: int, n_hidden: int, key: jax.Array) -> SimpleRNNCell:
            return SimpleRNNCell(n_in, n_hidden, key=key, dtype=dtype, activation=activation, use_bias=bias)
        super().__init__(_built(make, input_size, hidden_size, num_layers, key, bidirectional, batch_first), dropout)
