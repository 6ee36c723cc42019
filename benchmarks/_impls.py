"""One training step (same model, same Adam, same data) written the idiomatic way for each library.

``VARIANTS[name](spec)`` builds a fresh :class:`Runner` (a fresh jitted function, so its
first call traces and compiles). ``runner.block(n)`` runs ``n`` steps back to back and
blocks on the last output; ``runner.call()`` runs one step without blocking;
``runner.lower()`` gives the compiled program where the library exposes one.

- raw: ``jax.jit`` over a dict of arrays + ``optax.adam``, params and state donated.
- functree: ``ft.nn`` layers in ``ft.nn.Sequential``; ``ft.optim.Optimizer(ft.optim.adam)``;
  by hand under ``ft.jit(donate=(0, 1))`` (``opt.minimize``, or ``value_with_gradient`` +
  ``opt.update`` + ``ft.move``), and ``ft.train.train_step``.
- Equinox: ``eqx.filter_jit`` + ``eqx.filter_value_and_grad`` + optax; and the
  partition-outside-jit pattern (``jax.jit`` over the array half, donated).
- Flax linen: ``nn.Module`` + ``TrainState`` + ``jax.jit`` (state donated).
- Flax NNX: ``nnx.jit`` + ``nnx.Optimizer``; and the split/merge pattern under ``jax.jit``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from _models import CNN_CHANNELS, CNN_SIDE, LEARNING_RATE, Spec, data, init_params, loss_of

import functree as ft


class Runner:
    """A step and its carry: ``step(*carry, *args) -> (*carry, out)`` (functional style) or
    ``step(*carry, *args) -> out`` with the carry updated in place (``stateful``)."""

    def __init__(self, step: Callable[..., Any], carry: tuple, args: tuple, *,
                 stateful: bool = False, lowerable: Any = None):
        self.step, self.carry, self.args, self.stateful = step, carry, args, stateful
        self.lowerable = lowerable if lowerable is not None else step

    def call(self) -> Any:
        if self.stateful:
            return self.step(*self.carry, *self.args)
        *carry, out = self.step(*self.carry, *self.args)
        self.carry = tuple(carry)
        return out

    def block(self, n: int) -> None:
        step, args = self.step, self.args
        if self.stateful:
            carry = self.carry
            for _ in range(n):
                out = step(*carry, *args)
        elif len(self.carry) == 2:
            a, b = self.carry
            for _ in range(n):
                a, b, out = step(a, b, *args)
            self.carry = (a, b)
        else:
            (a,) = self.carry
            for _ in range(n):
                a, out = step(a, *args)
            self.carry = (a,)
        jax.block_until_ready(out)

    def lower(self) -> Any:
        """The compiled program (``jax.stages.Compiled``) or None."""
        lower = getattr(self.lowerable, "lower", None)
        if lower is None:
            return None
        compiled = lower(*self.carry, *self.args).compile()
        return compiled if hasattr(compiled, "cost_analysis") else None


# --- raw JAX + optax ---------------------------------------------------------------------

def _pool(x: jax.Array) -> jax.Array:
    return jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")


def raw_forward(spec: Spec, params: dict, x: jax.Array) -> jax.Array:
    n = len(params) // 2
    if spec.kind == "mlp":
        for i in range(n):
            x = x @ params[f"w{i}"] + params[f"b{i}"]
            if i < n - 1:
                x = jax.nn.relu(x)
        return x
    for i in range(n - 1):
        x = jax.lax.conv_general_dilated(x, params[f"w{i}"], (1, 1), "SAME",
                                         dimension_numbers=("NHWC", "HWIO", "NHWC"))
        x = _pool(jax.nn.relu(x + params[f"b{i}"]))
    x = x.reshape(x.shape[0], -1)
    return x @ params[f"w{n - 1}"] + params[f"b{n - 1}"]


def raw_params(spec: Spec) -> dict[str, jax.Array]:
    params = {}
    for i, (w, b) in enumerate(init_params(spec)):
        params[f"w{i}"], params[f"b{i}"] = jnp.asarray(w), jnp.asarray(b)
    return params


def raw(spec: Spec, gate: str | None = None) -> Runner:
    """``gate``: None, or a NaN gate written by hand in raw JAX, ``"cond"`` (``lax.cond``
    around the update) or ``"where"`` (a select per leaf) — ``benchmarks/gate_pipeline.py``."""
    tx = optax.adam(LEARNING_RATE)

    def loss_fn(params, x, y):
        return loss_of(spec, raw_forward(spec, params, x), y)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)

        def apply(carry):
            updates, s = tx.update(grads, carry[1], carry[0])
            return optax.apply_updates(carry[0], updates), s

        if gate is None:
            return (*apply((params, opt_state)), loss)
        ok = jnp.isfinite(loss) & jnp.all(jnp.stack([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)]))
        if gate == "cond":
            params, opt_state = jax.lax.cond(ok, apply, lambda carry: carry, (params, opt_state))
        else:
            params, opt_state = jax.tree.map(lambda n, o: jnp.where(ok, n, o), apply((params, opt_state)),
                                             (params, opt_state))
        return params, opt_state, loss

    params = raw_params(spec)
    return Runner(step, (params, tx.init(params)), data(spec))


def optax_update(params: Any) -> tuple[Callable[..., Any], Any, Any]:
    """The Adam update alone (families 4 and 12): ``(update, params, state)`` for
    :func:`_harness.carried_updates`, ``update(params, state, grads)`` jitted and donating."""
    tx = optax.adam(LEARNING_RATE)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def update(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return update, params, tx.init(params)


# --- functree ------------------------------------------------------------------------------

def functree_apply(model: Any) -> tuple[Callable[..., Any], Any, Any]:
    """:func:`optax_update` through ``Optimizer(ft.optim.adam).apply_gradients`` under
    ``ft.jit(donate=(0, 1))``."""
    opt = ft.optim.Optimizer(ft.optim.adam(LEARNING_RATE))

    @ft.jit(donate=(0, 1))
    def update(model, state, grads):
        return opt.apply_gradients(grads, model, state)

    return update, model, opt.init(model)


def _const(value: np.ndarray) -> Callable[..., jax.Array]:
    return lambda key, shape, dtype: jnp.asarray(value, dtype)


def functree_model(spec: Spec) -> Any:
    params, key = init_params(spec), jax.random.key(0)
    if spec.kind == "mlp":
        last = len(params) - 1
        return ft.nn.Sequential([
            ft.nn.Dense(w.shape[0], w.shape[1], jax.nn.relu if i < last else ft.nn.identity,
                        key=key, weight_initializer=_const(w), bias_initializer=_const(b))
            for i, (w, b) in enumerate(params)
        ])
    layers: list[Any] = []
    for (w, b), cin, cout in zip(params, CNN_CHANNELS[:-1], CNN_CHANNELS[1:]):
        layers += [ft.nn.Conv2D(cin, cout, 3, activation=jax.nn.relu, key=key,
                                weight_initializer=_const(w), bias_initializer=_const(b)),
                   ft.nn.MaxPool2D(2)]
    w, b = params[-1]
    layers += [ft.nn.Flatten(), ft.nn.Dense(w.shape[0], w.shape[1], key=key,
                                            weight_initializer=_const(w), bias_initializer=_const(b))]
    return ft.nn.Sequential(layers)


def functree_minimize(spec: Spec) -> Runner:
    opt = ft.optim.Optimizer(ft.optim.adam(LEARNING_RATE))

    def loss_fn(model, x, y):
        return loss_of(spec, model(x), y)

    @ft.jit(donate=(0, 1))
    def step(model, opt_state, x, y):
        return opt.minimize(loss_fn, model, opt_state, x, y)

    model = functree_model(spec)
    return Runner(step, (model, opt.init(model)), data(spec))


def functree_move(spec: Spec) -> Runner:
    opt = ft.optim.Optimizer(ft.optim.adam(LEARNING_RATE))

    def loss_fn(model, x, y):
        return loss_of(spec, model(x), y)

    @ft.jit(donate=(0, 1))
    def step(model, opt_state, x, y):
        loss, grad = ft.value_with_gradient(loss_fn)(model, x, y)
        updates, opt_state = opt.update(grad, opt_state, model)
        return ft.move(model, along=updates), opt_state, loss

    model = functree_model(spec)
    return Runner(step, (model, opt.init(model)), data(spec))


def functree_train_step(spec: Spec, on_nan: str = "stop") -> Runner:
    opt = ft.optim.Optimizer(ft.optim.adam(LEARNING_RATE))

    def loss_fn(model, batch):
        x, y = batch
        return loss_of(spec, model(x), y)

    step = ft.train.train_step(loss_fn, opt, on_nan=on_nan)
    model = functree_model(spec)
    return Runner(step, (model, opt.init(model)), (data(spec),))


# --- Equinox -------------------------------------------------------------------------------

def equinox_model(spec: Spec) -> Any:
    import equinox as eqx

    params, keys = init_params(spec), jax.random.split(jax.random.key(0), 8)

    def linear(w, b, key):
        layer = eqx.nn.Linear(w.shape[0], w.shape[1], key=key)
        return eqx.tree_at(lambda lin: (lin.weight, lin.bias), layer, (jnp.asarray(w.T), jnp.asarray(b)))

    class MLP(eqx.Module):
        layers: list

        def __call__(self, x):
            for layer in self.layers[:-1]:
                x = jax.nn.relu(layer(x))
            return self.layers[-1](x)

    class CNN(eqx.Module):
        convs: list
        pool: eqx.nn.MaxPool2d
        dense: eqx.nn.Linear

        def __call__(self, x):  # one CHW image
            for conv in self.convs:
                x = self.pool(jax.nn.relu(conv(x)))
            return self.dense(x.reshape(-1))

    if spec.kind == "mlp":
        return MLP([linear(w, b, k) for (w, b), k in zip(params, keys)])
    convs = []
    for (w, b), cin, cout, key in zip(params, CNN_CHANNELS[:-1], CNN_CHANNELS[1:], keys):
        conv = eqx.nn.Conv2d(cin, cout, 3, padding=1, key=key)
        convs.append(eqx.tree_at(lambda c: (c.weight, c.bias), conv,
                                 (jnp.asarray(w.transpose(3, 2, 0, 1)), jnp.asarray(b)[:, None, None])))
    w, b = params[-1]
    side, c = CNN_SIDE // 4, CNN_CHANNELS[-1]
    w_chw = w.reshape(side, side, c, -1).transpose(2, 0, 1, 3).reshape(w.shape)  # (c, h, w) rows
    return CNN(convs, eqx.nn.MaxPool2d(2, 2), linear(w_chw, b, keys[-1]))


def _equinox_data(spec: Spec) -> tuple[jax.Array, jax.Array]:
    x, y = data(spec)
    return (jnp.transpose(x, (0, 3, 1, 2)) if spec.kind == "cnn" else x), y


def equinox_filter_jit(spec: Spec) -> Runner:
    import equinox as eqx

    tx = optax.adam(LEARNING_RATE)

    def loss_fn(model, x, y):
        return loss_of(spec, jax.vmap(model)(x), y)

    @eqx.filter_jit
    def step(model, opt_state, x, y):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x, y)
        updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state, loss

    model = equinox_model(spec)
    return Runner(step, (model, tx.init(eqx.filter(model, eqx.is_array))), _equinox_data(spec))


def equinox_partitioned(spec: Spec) -> Runner:
    """Equinox's fast pattern: partition once outside, ``jax.jit`` over the arrays."""
    import equinox as eqx

    tx = optax.adam(LEARNING_RATE)
    params, static = eqx.partition(equinox_model(spec), eqx.is_array)

    def loss_fn(params, x, y):
        return loss_of(spec, jax.vmap(eqx.combine(params, static))(x), y)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return eqx.apply_updates(params, updates), opt_state, loss

    return Runner(step, (params, tx.init(params)), _equinox_data(spec))


# --- Flax linen ------------------------------------------------------------------------------

def linen_model(spec: Spec) -> tuple[Any, dict]:
    from flax import linen as nn

    class MLP(nn.Module):
        sizes: tuple

        @nn.compact
        def __call__(self, x):
            for i, size in enumerate(self.sizes[1:]):
                x = nn.Dense(size)(x)
                if i < len(self.sizes) - 2:
                    x = nn.relu(x)
            return x

    class CNN(nn.Module):
        @nn.compact
        def __call__(self, x):
            for channels in CNN_CHANNELS[1:]:
                x = nn.relu(nn.Conv(channels, (3, 3), padding="SAME")(x))
                x = nn.max_pool(x, (2, 2), strides=(2, 2))
            return nn.Dense(10)(x.reshape(x.shape[0], -1))

    params = init_params(spec)
    if spec.kind == "mlp":
        names = [f"Dense_{i}" for i in range(len(params))]
        module: Any = MLP(spec.sizes)
    else:
        names = ["Conv_0", "Conv_1", "Dense_0"]
        module = CNN()
    tree = {n: {"kernel": jnp.asarray(w), "bias": jnp.asarray(b)} for n, (w, b) in zip(names, params)}
    return module, {"params": tree}


def linen(spec: Spec) -> Runner:
    from flax.training import train_state

    module, variables = linen_model(spec)
    state = train_state.TrainState.create(apply_fn=module.apply, params=variables,
                                          tx=optax.adam(LEARNING_RATE))

    @functools.partial(jax.jit, donate_argnums=0)
    def step(state, x, y):
        def loss_fn(params):
            return loss_of(spec, state.apply_fn(params, x), y)

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    return Runner(step, (state,), data(spec))


# --- Flax NNX --------------------------------------------------------------------------------

def nnx_model(spec: Spec) -> Any:
    from flax import nnx

    rngs, params = nnx.Rngs(0), init_params(spec)

    def filled(layer, w, b):
        layer.kernel[...] = jnp.asarray(w)
        layer.bias[...] = jnp.asarray(b)
        return layer

    class MLP(nnx.Module):
        def __init__(self):
            self.layers = nnx.List([filled(nnx.Linear(*w.shape, rngs=rngs), w, b) for w, b in params])

        def __call__(self, x):
            for layer in self.layers[:-1]:
                x = nnx.relu(layer(x))
            return self.layers[-1](x)

    class CNN(nnx.Module):
        def __init__(self):
            self.convs = nnx.List([
                filled(nnx.Conv(cin, cout, (3, 3), padding="SAME", rngs=rngs), w, b)
                for (w, b), cin, cout in zip(params, CNN_CHANNELS[:-1], CNN_CHANNELS[1:])
            ])
            self.dense = filled(nnx.Linear(*params[-1][0].shape, rngs=rngs), *params[-1])

        def __call__(self, x):
            for conv in self.convs:
                x = nnx.max_pool(nnx.relu(conv(x)), (2, 2), strides=(2, 2))
            return self.dense(x.reshape(x.shape[0], -1))

    return MLP() if spec.kind == "mlp" else CNN()


def nnx_jit(spec: Spec) -> Runner:
    from flax import nnx

    model = nnx_model(spec)
    optimizer = nnx.Optimizer(model, optax.adam(LEARNING_RATE), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, x, y):
        def loss_fn(model):
            return loss_of(spec, model(x), y)

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    return Runner(step, (model, optimizer), data(spec), stateful=True)


def nnx_split_merge(spec: Spec) -> Runner:
    """NNX's fast pattern: split once, ``jax.jit`` over the state, merge inside."""
    from flax import nnx

    model = nnx_model(spec)
    optimizer = nnx.Optimizer(model, optax.adam(LEARNING_RATE), wrt=nnx.Param)
    graphdef, state = nnx.split((model, optimizer))

    @functools.partial(jax.jit, donate_argnums=0)
    def step(state, x, y):
        model, optimizer = nnx.merge(graphdef, state)

        def loss_fn(model):
            return loss_of(spec, model(x), y)

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer)), loss

    return Runner(step, (state,), data(spec))


RAW = "raw jax.jit + optax"
FT_MINIMIZE = "functree ft.jit + opt.minimize"
FT_MOVE = "functree ft.jit + value_with_gradient + ft.move"
FT_TRAIN_STEP = "functree ft.train.train_step"

VARIANTS: dict[str, Callable[[Spec], Runner]] = {
    RAW: raw,
    FT_MINIMIZE: functree_minimize,
    FT_MOVE: functree_move,
    FT_TRAIN_STEP: functree_train_step,
    "Equinox filter_jit": equinox_filter_jit,
    "Equinox partition + jax.jit": equinox_partitioned,
    "Flax linen + TrainState": linen,
    "Flax NNX nnx.jit": nnx_jit,
    "Flax NNX split/merge + jax.jit": nnx_split_merge,
}
FUNCTREE = (FT_MINIMIZE, FT_MOVE, FT_TRAIN_STEP)


def available(names: tuple[str, ...] | None = None) -> dict[str, Callable[[Spec], Runner]]:
    """The variants whose library is installed (Equinox and Flax come with the ``bench`` extra)."""
    out = {}
    for name, build in VARIANTS.items():
        if names is not None and name not in names:
            continue
        lib = {"Equinox": "equinox", "Flax": "flax"}.get(name.split()[0])
        if lib is not None:
            try:
                __import__(lib)
            except ImportError:
                continue
        out[name] = build
    return out
