import jax
import optax

import functree as ft


def loss_fn(model, batch, *, key):
    x, y = batch
    return optax.softmax_cross_entropy_with_integer_labels(model(x, key=key), y).mean()


opt = ft.optim.Optimizer(optax.adam(1e-3))
step = ft.train.train_step(loss_fn, opt)


def train(batches, key):  # batches of (x [n, 8, 8, 1], y [n]): channels-last
    k1, k2 = jax.random.split(jax.random.key(0))
    model = ft.nn.training(ft.nn.Sequential(
        ft.nn.Conv2D(1, 8, 3, padding="VALID", key=k1), ft.nn.relu, ft.nn.MaxPool2D(2),
        ft.nn.Dropout(0.1), ft.nn.Flatten(), ft.nn.Dense(8 * 3 * 3, 10, key=k2)))
    state = opt.init(model)
    for batch in batches:
        model, state, metrics = step(model, state, batch, key=key)
    return metrics["loss"]
