import jax
import optax
from eqx_cnn import CNN

import functree as ft


def loss_fn(model, batch, *, key):
    x, y = batch
    logits = jax.vmap(model)(x, jax.random.split(key, len(x)))
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


opt = ft.optim.Optimizer(optax.adam(1e-3))
step = ft.train.train_step(loss_fn, opt)


def train(batches, key):  # the Equinox model itself, in functree's step
    model = CNN(jax.random.key(0))
    state = opt.init(model)
    for batch in batches:
        model, state, metrics = step(model, state, batch, key=key)
    return metrics["loss"]
