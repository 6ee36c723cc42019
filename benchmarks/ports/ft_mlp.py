import jax
import optax

import functree as ft


def loss_fn(model, batch, *, key):
    x, y = batch
    return optax.softmax_cross_entropy_with_integer_labels(model(x, key=key), y).mean()


opt = ft.optim.Optimizer(optax.adam(1e-3))
step = ft.train.train_step(loss_fn, opt)


def train(batches, key):  # batches of (x [n, 64], y [n])
    k1, k2 = jax.random.split(jax.random.key(0))
    model = ft.nn.Sequential(ft.nn.Dense(64, 32, key=k1), ft.nn.BatchNorm(32, epsilon=1e-5), ft.nn.relu,
                             ft.nn.Dropout(0.1), ft.nn.Dense(32, 10, key=k2))
    state = opt.init(model)  # before ft.nn.training: NNX's order works
    model = ft.nn.training(model)
    for batch in batches:
        model, state, metrics = step(model, state, batch, key=key)
    return metrics["loss"]
