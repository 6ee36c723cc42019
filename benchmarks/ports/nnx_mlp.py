import optax
from flax import nnx


class MLP(nnx.Module):
    def __init__(self, rngs):
        self.l1, self.bn = nnx.Linear(64, 32, rngs=rngs), nnx.BatchNorm(32, rngs=rngs)
        self.drop, self.l2 = nnx.Dropout(0.1, rngs=rngs), nnx.Linear(32, 10, rngs=rngs)

    def __call__(self, x):
        return self.l2(self.drop(nnx.relu(self.bn(self.l1(x)))))


def loss_fn(model, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()


@nnx.jit
def step(model, optimizer, x, y):
    loss, grads = nnx.value_and_grad(loss_fn)(model, x, y)
    optimizer.update(model, grads)
    return loss


def train(batches, key=None):  # batches of (x [n, 64], y [n])
    model = MLP(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    model.train()
    for x, y in batches:
        loss = step(model, optimizer, x, y)
    return loss
