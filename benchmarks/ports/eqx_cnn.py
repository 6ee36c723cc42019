import equinox as eqx
import jax
import jax.numpy as jnp
import optax


class CNN(eqx.Module):
    layers: list

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.layers = [eqx.nn.Conv2d(1, 8, 3, key=k1), jax.nn.relu, eqx.nn.MaxPool2d(2, 2),
                       eqx.nn.Dropout(0.1), jnp.ravel, eqx.nn.Linear(8 * 3 * 3, 10, key=k2)]

    def __call__(self, x, key):
        for layer in self.layers:
            x = layer(x, key=key) if isinstance(layer, eqx.nn.Dropout) else layer(x)
        return x


def loss_fn(model, x, y, key):
    logits = jax.vmap(model)(x, jax.random.split(key, len(x)))
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


optim = optax.adam(1e-3)


@eqx.filter_jit
def step(model, opt_state, x, y, key):
    loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x, y, key)
    updates, opt_state = optim.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    return eqx.apply_updates(model, updates), opt_state, loss


def train(batches, key):  # batches of (x [n, 1, 8, 8], y [n])
    model = CNN(jax.random.key(0))
    opt_state = optim.init(eqx.filter(model, eqx.is_array))
    for i, (x, y) in enumerate(batches):
        model, opt_state, loss = step(model, opt_state, x, y, jax.random.fold_in(key, i))
    return loss
