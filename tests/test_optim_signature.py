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
        "learning_rate", "beta1", "beta2", "epsilon", "weight_decay", "maximize"]


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


def test_optax_and_torch_names_are_refused_with_functree_names_and_the_fix_matches_optax():
    """adam(1e-3, b1=0.9) raised a bare "got an unexpected keyword argument 'b1'"."""
    with pytest.raises(TypeError, match=r"ft\.optim\.adam: got an unexpected keyword argument 'b1'\. Its arguments: "
                                        r"learning_rate, beta1, beta2, epsilon, weight_decay, maximize\.\n.*b1 → beta1") as info:
        ft.optim.adam(1e-3, b1=0.8, eps=1e-6)
    right = next(line.split("right:")[1].strip() for line in str(info.value).splitlines() if "right:" in line)
    assert right == "ft.optim.adam(0.001, beta1=0.8, epsilon=1e-06)"
    ours, theirs = eval(right, {"ft": ft}), optax.adam(1e-3, b1=0.8, eps=1e-6)
    g = {"w": jnp.array([0.5, -2.0])}
    s1, s2 = ours.init(g), theirs.init(g)
    other = ft.optim.adam(1e-3, epsilon=1e-6)  # beta1 0.9: what dropping b1= would give
    s3 = other.init(g)
    for k in (1.0, -3.0, 2.0):  # gradients that change, so that beta1 matters
        gk = {"w": g["w"] * k}
        u1, s1 = ours.update(gk, s1)
        u3, s3 = other.update(gk, s3)
        with jax.numpy_dtype_promotion("standard"):  # optax mixes float and int counts
            u2, s2 = theirs.update(gk, s2)
    # updates of size 1e-3; epsilon's placement differs from optax's by ~1e-8 (1e-6 / sqrt(v))
    np.testing.assert_allclose(u1["w"], u2["w"], rtol=0, atol=2e-8)
    assert np.abs(np.asarray(u3["w"]) - np.asarray(u2["w"])).max() > 1e-5
    with pytest.raises(TypeError, match=r"lr → learning_rate, betas → beta1, beta2") as info:
        ft.optim.adam(lr=1e-3, betas=(0.9, 0.99))
    assert "right:  ft.optim.adam(learning_rate=0.001, beta1=0.9, beta2=0.99)" in str(info.value)
    with pytest.raises(TypeError, match=r"ft\.optim\.rmsprop: (.|\n)* alpha → rho"):
        ft.optim.rmsprop(1e-3, alpha=0.99)
    with pytest.raises(TypeError, match=r"ft\.optim\.sgd: too many positional arguments\. Its arguments: learning_rate"):
        ft.optim.sgd(0.1, 0.9, False, 0.0, "torch", 5)


def test_a_single_betas_value_gets_a_rename_that_runs():
    """``adam(1e-3, betas=0.9)`` suggested ``beta1=Ellipsis, beta2=Ellipsis``, itself refused."""
    with pytest.raises(TypeError) as info:
        ft.optim.adam(1e-3, betas=0.9)
    right = next(line.split(":", 1)[1].strip() for line in str(info.value).splitlines() if "right:" in line)
    assert right == "ft.optim.adam(0.001, beta1=0.9, beta2=0.999)"
    eval(right, {"ft": ft})  # runs
