"""Optimizers whose hyperparameters are their signature's ``Hyper`` arguments (functree.optim._signature)."""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import functree as ft
from functree.optim._signature import Hyper, optimizer


@optimizer("scaled", off_at_zero=("shift",))
def scaled(factor: Hyper = 2.0, shift: Hyper = 0.0, *, flip: bool = False) -> optax.GradientTransformationExtraArgs:
    """Scale by ``factor`` (negated when ``flip``), then add ``shift``."""
    scale = optax.scale(-factor if flip else factor)
    if shift is None:
        return optax.chain(scale)
    return optax.chain(scale, optax.GradientTransformation(optax.init_empty_state,
                                                           lambda u, s, p=None: (jax.tree.map(lambda x: x + shift, u), s)))


def test_hyperparameters_are_the_hyper_arguments_in_signature_order():
    g = {"w": jnp.ones(2)}
    state = scaled(3.0, 0.5).init(g)
    assert state.names == ("factor", "shift")
    np.testing.assert_allclose(scaled(3.0, 0.5).update(g, state)[0]["w"], [3.5, 3.5], rtol=0, atol=0)
    assert scaled(3.0).init(g).names == ("factor",)  # shift=0: not stored, the body gets None


def test_positional_keyword_and_default_arguments_bind_as_the_signature():
    g = {"w": jnp.ones(1)}
    for tx in (scaled(4.0, flip=True), scaled(factor=4.0, flip=True)):
        np.testing.assert_allclose(tx.update(g, tx.init(g))[0]["w"], [-4.0], rtol=0, atol=0)
    with pytest.raises(TypeError, match="too many positional arguments"):
        scaled(1.0, 0.0, True)  # flip is keyword-only, as the signature says


def test_the_public_function_keeps_the_signature_and_docstring():
    assert list(inspect.signature(scaled).parameters) == ["factor", "shift", "flip"]
    assert scaled.__doc__.startswith("Scale by")
    assert list(inspect.signature(ft.optim.adam).parameters) == [
        "learning_rate", "beta1", "beta2", "epsilon", "weight_decay"]


def test_a_set_hyperparameter_drives_the_next_step():
    g = {"w": jnp.ones(1)}
    tx = scaled(2.0)
    state = ft.optim.set_hyperparameters(tx.init(g), factor=5.0)
    np.testing.assert_allclose(tx.update(g, state)[0]["w"], [5.0], rtol=0, atol=0)


def test_static_options_are_checked_at_construction():
    with pytest.raises(ValueError, match="Nesterov needs the literature form"):
        ft.optim.sgd(0.1, momentum=0.9, nesterov=True, momentum_form="additive")
    with pytest.raises(ValueError, match="momentum_form='heavy'"):
        ft.optim.sgd(0.1, momentum_form="heavy")


def test_weight_decay_zero_stores_no_hyperparameter():
    params = {"w": jnp.ones(2)}
    assert ft.optim.adam(1e-3).init(params).names == ("learning_rate", "beta1", "beta2", "epsilon")
    assert ft.optim.adam(1e-3, weight_decay=0.1).init(params).names[-1] == "weight_decay"


def test_a_body_without_hyper_arguments_is_refused():
    with pytest.raises(TypeError, match="annotate them with Hyper"):
        @optimizer("plain")
        def plain(factor=1.0):
            return optax.scale(factor)


def test_off_at_zero_must_name_a_hyperparameter():
    with pytest.raises(TypeError, match=r"off_at_zero names \['decay'\]"):
        @optimizer("bad", off_at_zero=("decay",))
        def bad(factor: Hyper = 1.0):
            return optax.scale(factor)
