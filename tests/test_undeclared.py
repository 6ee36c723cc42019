"""An undeclared attribute assigned in a Module's __init__ gets its declaration (functree/_undeclared.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import functree as ft
from functree.nn import Dense  # imported by name: the declaration still names ft.nn.Dense

KEY = jax.random.key(0)


class Net(ft.Module):
    conv2: ft.nn.Conv2D

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.conv1 = ft.nn.Conv2D(1, 4, 3, key=k1)
        self.conv2 = ft.nn.Conv2D(4, 4, 3, key=k2)
        self.norm = ft.nn.LayerNorm(4)
        self.fc = Dense(4, 2, key=k3)
        self.scale = jnp.ones(2)
        self.sizes = [4, 2]
        self.head, self.tail = ft.nn.Dropout(0.1), make_tail()


def make_tail():
    return ft.nn.Dropout(0.2)


def test_the_first_undeclared_layer_and_every_other_assignment_get_their_declarations():
    with pytest.raises(AttributeError) as info:
        Net(KEY)
    lines = [line.rstrip() for line in str(info.value).splitlines()]
    assert lines[0].startswith("Net.__init__ assigns self.conv1, which is not a declared field")
    assert "    conv1: ft.nn.Conv2D                          # a layer: its parameters train" in lines
    assert any("also assigns these, undeclared: norm, fc, scale, sizes, head, tail." in line for line in lines)
    # The declared conv2 is not listed; a call of a Module class names it, another call or value does not.
    assert [line for line in lines if line.startswith("    ") and ":" in line][1:] == [
        "    norm: ft.nn.LayerNorm                        # a layer",
        "    fc: ft.nn.Dense                              # a layer",
        "    scale: ...",
        "    sizes: ...",
        "    head: ft.nn.Dropout                          # a layer",
        "    tail: ...",
    ]


@pytest.mark.parametrize(("value", "declared"), [
    (np.zeros(3), ["    w: jax.Array                                 # a parameter",
                   "    w: jax.Array = ft.field(no_derivative=True)  # carried state"]),
    (jnp.zeros(3), ["    w: jax.Array                                 # a parameter"]),
    (3, ["    w: int = ft.field(static=True)               # configuration"]),
    (jax.nn.relu, ["    w: Callable = ft.field(static=True)          # configuration"]),
])
def test_the_declaration_follows_the_value(value, declared):
    class One(ft.Module):
        def __init__(self, v):
            self.w = v

    with pytest.raises(AttributeError) as info:
        One(value)
    lines = str(info.value).splitlines()
    assert all(line in lines for line in declared), lines
    assert "also assigns" not in str(info.value)


def test_a_class_without_source_gets_the_one_declaration():
    scope = {"ft": ft}
    exec("class Made(ft.Module):\n    def __init__(self):\n        self.a = 1\n        self.b = 2\n", scope)
    with pytest.raises(AttributeError, match=r"assigns self\.a, which is not a declared field") as info:
        scope["Made"]()  # pyright: ignore[reportCallIssue]
    assert "a: int = ft.field(static=True)" in str(info.value)
    assert "also assigns" not in str(info.value)
