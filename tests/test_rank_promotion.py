"""functree under a user's ``jax.config.update("jax_numpy_rank_promotion", "raise")``.

Users who want shape mistakes to fail set JAX's rank promotion to "raise": a vector added to
a matrix must then be broadcast by hand. functree's own layers, losses and ports broadcast
explicitly (``jax.lax.broadcast_to_rank``: the leading axes implicit promotion would add), so
they run under either setting with the same numbers. Before, ``ft.nn.Dense`` on a batch
failed ("Operands could not be broadcast together for add on shapes (2, 4) (4,)"), and so did
the norms, attention, pooling, rotary embeddings, the Hugging Face ports and their generation.
"""

import doctest
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import functree as ft

# The modules whose docstring examples failed under "raise" (each runs batched inputs through
# its layers, losses or ports): their examples are run again with the setting on.
MODULES = (
    "functree.nn._linear", "functree.nn._conv", "functree.nn._normalization", "functree.nn._pooling",
    "functree.nn._attention", "functree.nn._transformer", "functree.nn._rotary", "functree.nn._lora",
    "functree.nn._recurrent", "functree.nn._recurrent_layers", "functree.nn._resample",
    "functree.nn._fractional_pool", "functree.losses._margin", "functree.losses._sequence",
    "functree.losses._classification", "functree.hf._causal", "functree.hf._distilbert",
    "functree.hf._heads", "functree.generation._generate",
)


@pytest.mark.parametrize("name", MODULES)
def test_the_modules_examples_run_with_rank_promotion_raising(name):
    module = importlib.import_module(name)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    tests = doctest.DocTestFinder().find(module, name, globs=dict(vars(module)))
    assert any(t.examples for t in tests), f"{name} has no examples to run"
    report: list[str] = []
    with jax.numpy_rank_promotion("raise"):
        for test in tests:
            runner.run(test, out=report.append)
    assert runner.failures == 0, "".join(report)[-3000:]


def _under_both(f, *args):
    """``f(*args)`` under JAX's default and under "raise": the same numbers, exactly."""
    with jax.numpy_rank_promotion("allow"):
        allowed = f(*args)
    with jax.numpy_rank_promotion("raise"):
        raised = f(*args)
    jax.tree.map(np.testing.assert_array_equal, raised, allowed)
    return raised


def test_a_strict_users_training_step_gives_the_default_settings_numbers():
    """A user's own code broadcasting explicitly, functree's layers inside, one training step."""
    k = jax.random.split(jax.random.key(0), 4)
    model = ft.nn.Sequential(ft.nn.Conv2D(1, 4, (3, 3), key=k[0]), ft.nn.GroupNorm(2, 4),
                             ft.nn.AvgPool2D((2, 2), padding=((1, 1), (1, 1)), count_include_pad=False),
                             ft.nn.Flatten(), ft.nn.Dense(64, 3, key=k[1]), ft.nn.PReLU(3))
    x = jax.random.normal(k[2], (5, 6, 6, 1))
    y = jnp.arange(5) % 3
    weight = jnp.asarray([1.0, 2.0, 0.5])

    def loss(m):
        return ft.losses.softmax_cross_entropy(m(x), y, weight=weight, label_smoothing=0.1)

    _under_both(ft.value_with_gradient(loss), model)


def test_losses_with_per_class_weights_and_attention_with_masks_give_the_same_numbers():
    logits = jnp.linspace(-2.0, 2.0, 12).reshape(4, 3)
    labels = jnp.asarray([[0.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 1.0], [1.0, 1.0, 0.0]])
    _under_both(lambda: ft.losses.sigmoid_cross_entropy(logits, labels, pos_weight=jnp.asarray([1.0, 2.0, 3.0])))
    _under_both(lambda: ft.losses.multilabel_soft_margin(logits, labels, weight=jnp.asarray([1.0, 2.0, 3.0])))
    attention = ft.nn.MultiheadAttention(8, 2, key=jax.random.key(1))
    q = jax.random.normal(jax.random.key(2), (2, 5, 8))
    _under_both(lambda: attention(q, q, q, mask=jnp.tril(jnp.ones((5, 5), bool))))
    layer = ft.nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, batch_first=True, key=jax.random.key(3))
    padding = jnp.asarray([[False] * 5, [False] * 3 + [True] * 2])
    _under_both(lambda: layer(q, src_key_padding_mask=padding, is_causal=True,
                              src_mask=~jnp.tril(jnp.ones((5, 5), bool))))
