"""Names a pattern cannot tell apart (functree/_collisions.py): refused by every pattern
consumer, naming both key paths and the key to rename, while a flat dict still tells them
apart where it can."""

import jax
import jax.numpy as jnp
import optax
import pytest

import functree as ft


def dense_stack(n, seed):
    return ft.nn.Stack(lambda k: ft.nn.Dense(2, 2, key=k), n, key=jax.random.key(seed))


def test_a_stack_under_the_key_empty_beside_its_names_is_refused_by_patterns():
    tree = {"": dense_stack(3, 0), "layers": {"weight": jnp.ones((3, 2, 2)), "bias": jnp.ones((3, 2))}}
    assert len(ft.to_flat_dict(tree)) == 4
    with pytest.raises(ValueError, match=r"ft\.select: the leaf at .* cannot tell them apart \('\.layers' selects"
                                         r"(.|\n)*wrong:  \{'': \.\.\.\}\n    right:  \{'_': \.\.\.\}"):
        ft.select(tree, "layers.weight")


def test_a_member_name_spelled_by_a_dotted_key_is_refused():
    tree = {"h": dense_stack(2, 0), "h.0": {"weight": jnp.ones((2, 2))}}
    with pytest.raises(ValueError, match=r"ft\.select: the leaf at \['h'\]\.layers\.weight is named 'h\.0\.weight' "
                                         r"and the leaf at \['h\.0'\]\['weight'\] is also named 'h\.0\.weight'"
                                         r"(.|\n)*right:  \{'h_0': \.\.\.\}"):
        ft.select(tree, "h.1.*")
    with pytest.raises(ValueError, match="cannot tell them apart"):  # refused again: a refused tree is not cached
        ft.select(tree, "h.1.*")


def test_a_dotted_key_beside_its_path_is_refused_by_patterns_as_by_names():
    nested = {"a": {"b": jnp.ones(2)}, "a.b": jnp.ones(2), "c": jnp.ones(2)}
    with pytest.raises(ValueError, match=r"ft\.select: the leaf at \['a'\]\['b'\] is named 'a\.b' and the leaf at "
                                         r"\['a\.b'\] is also named 'a\.b'.*\n.*wrong:  \{'a\.b': \.\.\.\}\n.*"
                                         r"right:  \{'a_b': \.\.\.\}"):
        ft.select(nested, "a.b")
    prefix = {"a": jnp.ones(2), "a.b": jnp.ones(2)}
    with pytest.raises(ValueError, match=r"ft\.gradient\(wrt=\): the leaf at \['a'\] is named 'a' and the leaf at "
                                         r"\['a\.b'\] is named 'a\.b', so a pattern cannot tell them apart \('a' selects"):
        ft.gradient(lambda t: jnp.sum(t["a"]) + jnp.sum(t["a.b"] * 3), at=prefix, wrt="a")
    with pytest.raises(ValueError, match="cannot tell them apart"):
        ft.optim.groups({"a": optax.sgd(0.0)}, default=optax.sgd(1.0)).init(prefix)
    assert list(ft.to_flat_dict(prefix)) == ["a", "a.b"]  # a flat dict tells them apart
