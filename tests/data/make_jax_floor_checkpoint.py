"""Write ``tests/data/jax_floor_checkpoint/``: a checkpoint and a training job saved under
the oldest JAX functree supports, read by ``tests/test_checkpoint_versions.py`` under every
JAX (issue 44, item 5).

Run it with the floor environment of ``.ci/run`` (Python 3.11, jax==0.9.2, jaxlib==0.9.2):

    python3 -m venv /tmp/venv-floor
    /tmp/venv-floor/bin/pip install -e . "jax==0.9.2" "jaxlib==0.9.2" pytest hypothesis
    /tmp/venv-floor/bin/python tests/data/make_jax_floor_checkpoint.py

It writes (replacing the folder):

* ``tree/``: ``ft.train.save`` of a tree with a Module, a bfloat16 array, a PRNG key, a
  NumPy array and Python numbers;
* ``job/``: a Trainer job (a 3-4-1 MLP, Adam, minibatches of 8 shuffled by ``key(3)``)
  saved by ``trainer.save`` after 3 steps, mid-epoch;
* ``expected.json``: the JAX version that wrote it, the tree's values, and the job's
  parameters after 3 steps and after continuing to step 10 here (the reference a newer
  JAX continues to, equal to rounding).

Everything it uses is defined here (not in the tests' helpers), so the committed files
stay what this script writes.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import functree as ft

HERE = Path(__file__).resolve().parent / "jax_floor_checkpoint"
X = np.random.default_rng(0).normal(size=(40, 3)).astype(np.float32)
Y = (X @ np.array([[1.0], [-2.0], [0.5]], np.float32) + 0.1).astype(np.float32)


def model() -> ft.nn.Sequential:
    k1, k2 = jax.random.split(jax.random.key(0))
    return ft.nn.Sequential(ft.nn.Dense(3, 4, jax.nn.tanh, key=k1), ft.nn.Dense(4, 1, key=k2))


def loss_fn(m: ft.nn.Sequential, batch: tuple[jax.Array, jax.Array]) -> jax.Array:
    x, y = batch
    return jnp.mean((m(x) - y) ** 2)


def trainer() -> ft.train.Trainer:
    return ft.train.Trainer(model(), ft.optim.Optimizer(ft.optim.adam(0.05)), loss_fn)


def data() -> object:
    return ft.train.batches((X, Y), 8, key=jax.random.key(3))


def tree() -> dict:
    return {"model": model(), "half": jnp.arange(4, dtype=jnp.bfloat16) / 3, "key": jax.random.key(5),
            "counts": np.arange(3, dtype=np.int32), "rounds": 3, "rate": 0.25}


def leaves(x: object) -> list:
    """Every array leaf as a list of floats (PRNG keys as their data)."""
    out = []
    for leaf in jax.tree.leaves(x):
        if isinstance(leaf, jax.Array) and jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        out.append(np.asarray(leaf, np.float64).tolist())
    return out


def main() -> None:
    if HERE.exists():
        shutil.rmtree(HERE)
    HERE.mkdir(parents=True)
    ft.train.save(HERE / "tree", tree())
    t = trainer()
    t.fit(data(), steps=3, progress=False, log_every=1)
    t.save(HERE / "job")
    at_3 = leaves(t.model)
    t.fit(data(), steps=10, progress=False, log_every=1)
    expected = {"jax": jax.__version__, "python": sys.version.split()[0], "tree": leaves(tree()),
                "job_at_3": at_3, "job_at_10": leaves(t.model), "loss_at_10": t.history.steps["loss"][-1]}
    (HERE / "expected.json").write_text(json.dumps(expected, indent=1) + "\n")


if __name__ == "__main__":
    main()
