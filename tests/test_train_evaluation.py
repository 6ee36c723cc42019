"""functree.train._evaluation: Trainer.evaluate / Trainer.predict."""

import jax
import jax.numpy as jnp
import numpy as np

import functree as ft


def test_predict_computes_in_the_trainers_compute_dtype_as_evaluate_does():
    # predict ran the float32 model (0.0117 off the bfloat16 outputs) while evaluate ran in
    # bfloat16; Keras predicts in its policy's dtype.
    rng = np.random.default_rng(10)
    x = rng.standard_normal((32, 6)).astype(np.float32)
    y = rng.integers(0, 5, 32).astype(np.int32)
    model = ft.nn.Dense(6, 5, key=jax.random.key(0))
    trainer = ft.train.Trainer(model, ft.optim.sgd(0.0),
                               lambda m, b: ft.losses.softmax_cross_entropy(m(b[0]), b[1]),
                               compute_dtype=jnp.bfloat16)
    # by hand: one compiled program as predict's (an eager add after the matmul would round
    # the matmul's output to bfloat16 before the bias, a fused one need not)
    hand = jax.jit(lambda m, x: ft.cast(m, jnp.bfloat16)(x.astype(jnp.bfloat16)))(model, jnp.asarray(x))
    out = trainer.predict(x, batch_size=8)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(hand, np.float32))
    given = trainer.predict(ft.train.batches((x, y), 8, shuffle=False), lambda m, b: m(b[0]))
    np.testing.assert_array_equal(np.asarray(given, np.float32), np.asarray(hand, np.float32))
    assert trainer.predict(x, lambda m, b: m.weight).dtype == jnp.bfloat16  # fn sees the cast model
    loss = trainer.evaluate(ft.train.batches((x, y), 32, shuffle=False))["loss"]
    np.testing.assert_allclose(loss, float(ft.losses.softmax_cross_entropy(hand, jnp.asarray(y))),
                               rtol=0, atol=1e-6)
