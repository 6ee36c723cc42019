"""Recurrent cells (``GRUCell``, ``LSTMCell``) and ``RNN``, a ``lax.scan`` over time.

A cell maps ``(state, x) -> (new_state, output)`` — the signature of a ``lax.scan`` body —
for inputs ``[..., input_size]`` with any leading batch axes; ``cell.zero_state(batch_shape)``
gives the initial state.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from functree._module import field
from functree._paths import ATTR, Entry
from functree.nn._check import LayerInputError, check_input
from functree.nn._linear import Initializer
from functree.nn._mode import Layer

__all__ = ["GRUCell", "LSTMCell", "LSTMState", "RNN"]

_glorot = jax.nn.initializers.glorot_uniform()
_orthogonal = jax.nn.initializers.orthogonal()


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


def _weights(key: jax.Array, n_in: int, n_hidden: int, gates: int, dtype: Any,
             input_init: Initializer, hidden_init: Initializer) -> tuple[jax.Array, jax.Array]:
    k_in, k_h = jax.random.split(key)
    w_in = input_init(k_in, (n_in, gates * n_hidden), dtype)
    w_h = jnp.concatenate(
        [hidden_init(k, (n_hidden, n_hidden), dtype) for k in jax.random.split(k_h, gates)], axis=1
    )
    return w_in, w_h


class GRUCell(Layer):
    """A gated recurrent unit (Cho et al. 2014, the cuDNN / PyTorch variant).

    With ``[r, z, n]`` blocks of the weights::

        r  = sigmoid(x W_ir + b_ir + h W_hr + b_hr)
        z  = sigmoid(x W_iz + b_iz + h W_hz + b_hz)
        n  = tanh(x W_in + b_in + r * (h W_hn + b_hn))
        h' = (1 - z) * n + z * h

    ``input_weight`` is ``[input_size, 3 * hidden_size]`` (glorot-uniform),
    ``hidden_weight`` ``[hidden_size, 3 * hidden_size]`` (orthogonal blocks), biases zero.
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
    input_bias: jax.Array = field(decay=False)
    hidden_bias: jax.Array = field(decay=False)

    def __init__(self, input_size: int, hidden_size: int, *, key: jax.Array,
                 dtype: Any = jnp.float32, input_initializer: Initializer = _glorot,
                 hidden_initializer: Initializer = _orthogonal):
        self.input_weight, self.hidden_weight = _weights(
            key, input_size, hidden_size, 3, dtype, input_initializer, hidden_initializer
        )
        self.input_bias = jnp.zeros((3 * hidden_size,), dtype)
        self.hidden_bias = jnp.zeros((3 * hidden_size,), dtype)

    @property
    def hidden_size(self) -> int:
        return self.hidden_weight.shape[0]

    def zero_state(self, batch_shape: tuple[int, ...] = ()) -> jax.Array:
        """Zeros ``[*batch_shape, hidden_size]``."""
        return jnp.zeros((*batch_shape, self.hidden_size), self.hidden_weight.dtype)

    def __call__(self, state: jax.Array, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        check_input(self, x, (self.input_weight.shape[0],))
        xi = x @ self.input_weight + self.input_bias
        hh = state @ self.hidden_weight + self.hidden_bias
        x_r, x_z, x_n = jnp.split(xi, 3, axis=-1)
        h_r, h_z, h_n = jnp.split(hh, 3, axis=-1)
        r = jax.nn.sigmoid(x_r + h_r)
        z = jax.nn.sigmoid(x_z + h_z)
        n = jnp.tanh(x_n + r * h_n)
        h = (1 - z) * n + z * state
        return h, h


class LSTMCell(Layer):
    """A long short-term memory cell (Hochreiter & Schmidhuber 1997).

    With ``[i, f, g, o]`` blocks of ``x W_i + h W_h + b``::

        i, f, o = sigmoid(.), sigmoid(.), sigmoid(.);  g = tanh(.)
        c' = f * c + i * g;   h' = o * tanh(c')

    ``bias`` starts at zero except the forget block at ``forget_bias`` (default 1,
    Jozefowicz et al. 2015). ``cell(LSTMState(h, c), x)`` returns ``(LSTMState(h', c'), h')``.

    Example:
      >>> import functree as ft, jax, jax.numpy as jnp
      >>> cell = ft.nn.LSTMCell(3, 5, key=jax.random.key(0))
      >>> state, y = cell(cell.zero_state((2,)), jnp.ones((2, 3)))
      >>> state.cell.shape, y.shape
      ((2, 5), (2, 5))
    """

    input_weight: jax.Array
    hidden_weight: jax.Array
    bias: jax.Array = field(decay=False)

    def __init__(self, input_size: int, hidden_size: int, *, key: jax.Array,
                 dtype: Any = jnp.float32, forget_bias: float = 1.0,
                 input_initializer: Initializer = _glorot,
                 hidden_initializer: Initializer = _orthogonal):
        self.input_weight, self.hidden_weight = _weights(
            key, input_size, hidden_size, 4, dtype, input_initializer, hidden_initializer
        )
        self.bias = jnp.zeros((4 * hidden_size,), dtype).at[hidden_size:2 * hidden_size].set(forget_bias)

    @property
    def hidden_size(self) -> int:
        return self.hidden_weight.shape[0]

    def zero_state(self, batch_shape: tuple[int, ...] = ()) -> LSTMState:
        """Zero hidden and cell states ``[*batch_shape, hidden_size]``."""
        zeros = jnp.zeros((*batch_shape, self.hidden_size), self.hidden_weight.dtype)
        return LSTMState(zeros, zeros)

    def __call__(self, state: LSTMState, x: jax.Array) -> tuple[LSTMState, jax.Array]:
        check_input(self, x, (self.input_weight.shape[0],))
        h, c = state
        gates = x @ self.input_weight + h @ self.hidden_weight + self.bias
        i, f, g, o = jnp.split(gates, 4, axis=-1)
        c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
        h = jax.nn.sigmoid(o) * jnp.tanh(c)
        return LSTMState(h, c), h


class RNN(Layer):
    """Run a cell over a sequence with ``jax.lax.scan``: ``[..., time, features] -> [..., time, hidden]``.

    ``time_axis`` (static, default ``-2``) is the sequence axis; the axes before it are
    batch axes. ``reverse=True`` scans from the end (outputs stay in input order).
    ``rnn(xs)`` returns the outputs; ``rnn(xs, initial_state, return_state=True)``
    also returns the final state.

    Example:
      >>> import functree as ft, jax, jax.numpy as jnp
      >>> rnn = ft.nn.RNN(ft.nn.LSTMCell(3, 5, key=jax.random.key(0)))
      >>> xs = jnp.ones((2, 7, 3))                 # batch 2, 7 steps
      >>> rnn(xs).shape
      (2, 7, 5)
      >>> ys, state = rnn(xs, return_state=True)
      >>> state.hidden.shape
      (2, 5)
    """

    cell: Any  # a GRUCell, LSTMCell or any Module with __call__(state, x) and zero_state
    time_axis: int = field(static=True, default=-2)
    reverse: bool = field(static=True, default=False)

    def __call__(self, xs: jax.Array, initial_state: Any = None, *,
                 return_state: bool = False) -> Any:
        check_input(self, xs, ("time", "features"))
        axis = self.time_axis % xs.ndim
        steps = jnp.moveaxis(xs, axis, 0)
        state = self.cell.zero_state(steps.shape[1:-1]) if initial_state is None else initial_state
        try:
            final, ys = jax.lax.scan(self.cell, state, steps, reverse=self.reverse)
        except LayerInputError as e:
            raise e.under((Entry(ATTR, "cell"),)) from None
        ys = jnp.moveaxis(ys, 0, axis)
        return (ys, final) if return_state else ys
