"""The benchmark models, their initial values (shared by every library) and their data.

An MLP ``sizes[0]-...-sizes[-1]`` (ReLU between layers) or a small CNN on 28×28×1 images
(conv 3×3 → 8, ReLU, max-pool 2; conv 3×3 → 16, ReLU, max-pool 2; dense → 10). Weights
are drawn once with NumPy (glorot-uniform, zero biases) and copied into each library's
own structures, so every variant starts from the same float32 values.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np
import optax

LEARNING_RATE = 1e-3


@dataclass(frozen=True)
class Spec:
    """``kind`` is ``"mlp"`` (``sizes``) or ``"cnn"``; ``loss`` is ``"mse"`` or ``"xent"``."""

    name: str
    kind: str
    batch: int
    sizes: tuple[int, ...] = ()
    loss: str = "xent"

    @property
    def label(self) -> str:
        if self.kind == "mlp":
            return f"MLP {'-'.join(map(str, self.sizes))}, batch {self.batch}"
        return f"CNN (conv 8, conv 16, dense 10) on 28×28×1, batch {self.batch}"


TINY = Spec("mlp-8-16-16-1", "mlp", 4, (8, 16, 16, 1), loss="mse")
MNIST_MLP = Spec("mlp-784-512-512-10", "mlp", 128, (784, 512, 512, 10))
CNN = Spec("cnn", "cnn", 32)
WIDE_MLP = Spec("mlp-4096x3", "mlp", 4096, (4096, 4096, 4096, 4096), loss="mse")
"""A step of a few milliseconds on a GPU (family 5 there: MNIST_MLP's step is ~0.3 ms)."""

CNN_CHANNELS = (1, 8, 16)
CNN_SIDE = 28
CNN_FLAT = (CNN_SIDE // 4) ** 2 * CNN_CHANNELS[-1]  # 7 · 7 · 16, flattened (h, w, c)


def _glorot(rng: np.random.Generator, shape: tuple[int, ...], fan_in: int, fan_out: int) -> np.ndarray:
    limit = np.sqrt(6.0 / (fan_in + fan_out))
    return rng.uniform(-limit, limit, size=shape).astype(np.float32)


def init_params(spec: Spec, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """``[(weight, bias), ...]``: dense weights ``[in, out]``, conv kernels ``HWIO``."""
    rng = np.random.default_rng(seed)
    if spec.kind == "mlp":
        return [(_glorot(rng, (i, o), i, o), np.zeros(o, np.float32))
                for i, o in zip(spec.sizes[:-1], spec.sizes[1:])]
    layers = []
    for cin, cout in itertools.pairwise(CNN_CHANNELS):
        layers.append((_glorot(rng, (3, 3, cin, cout), 9 * cin, 9 * cout), np.zeros(cout, np.float32)))
    layers.append((_glorot(rng, (CNN_FLAT, 10), CNN_FLAT, 10), np.zeros(10, np.float32)))
    return layers


def data(spec: Spec, seed: int = 1) -> tuple[jnp.ndarray, jnp.ndarray]:
    """One batch ``(x, y)``: ``x`` NHWC images or feature rows; ``y`` targets or labels."""
    rng = np.random.default_rng(seed)
    shape = (spec.batch, spec.sizes[0]) if spec.kind == "mlp" else (spec.batch, CNN_SIDE, CNN_SIDE, 1)
    x = rng.normal(size=shape).astype(np.float32)
    if spec.loss == "mse":
        y = rng.normal(size=(spec.batch, spec.sizes[-1])).astype(np.float32)
    else:
        y = rng.integers(0, 10, size=spec.batch).astype(np.int32)
    return jnp.asarray(x), jnp.asarray(y)


def loss_of(spec: Spec, prediction: jnp.ndarray, y: jnp.ndarray) -> jnp.ndarray:
    """Mean squared error or mean softmax cross-entropy over integer labels."""
    if spec.loss == "mse":
        return jnp.mean((prediction - y) ** 2)
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(prediction, y))


def n_params(spec: Spec) -> int:
    return sum(w.size + b.size for w, b in init_params(spec))
