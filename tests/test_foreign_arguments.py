"""Other libraries' constructor arguments get functree's name in the error (functree/_foreign_arguments.py)."""

import jax
import jax.numpy as jnp
import pytest

import functree as ft

KEY = jax.random.key(0)

# (the layer, its other arguments, the foreign keyword and value, functree's keywords)
CASES = [
    (ft.nn.Dense, (3, 4), {"key": KEY}, ("bias", False), {"use_bias": False}),
    (ft.nn.Dense, (3,), {"key": KEY}, ("units", 4), {"output_size": 4}),
    (ft.nn.LayerNorm, (16,), {}, ("eps", 1e-6), {"epsilon": 1e-6}),
    (ft.nn.LayerNorm, (16,), {}, ("elementwise_affine", False), {"use_scale": False, "use_offset": False}),
    (ft.nn.GroupNorm, (4, 16), {}, ("affine", False), {"use_scale": False, "use_offset": False}),
    (ft.nn.BatchNorm, (16,), {}, ("affine", False), {"use_scale": False, "use_offset": False}),
    (ft.nn.Dropout, (), {}, ("p", 0.5), {"rate": 0.5}),
    (ft.nn.Embedding, (10, 4), {"key": KEY}, ("padding_idx", 0), {"padding_index": 0}),
    (ft.nn.Conv2D, (3, 8, 3), {"key": KEY}, ("stride", 2), {"strides": 2}),
    (ft.nn.Conv2D, (3,), {"key": KEY, "kernel_size": 3}, ("filters", 8), {"out_channels": 8}),
    (ft.nn.MaxPool2D, (), {}, ("kernel_size", 2), {"pool_size": 2}),
    (ft.nn.MLP, (8, 3), {"key": KEY}, ("hidden_sizes", [16]), {"widths": [16]}),
    (ft.nn.LSTM, (4, 8), {"key": KEY, "batch_first": True}, ("use_bias", False), {"bias": False}),
    (ft.nn.TransformerEncoderLayer, (16, 4), {"key": KEY}, ("eps", 1e-6), {"layer_norm_eps": 1e-6}),
]


@pytest.mark.parametrize(("cls", "args", "kwargs", "foreign", "right"), CASES,
                         ids=[f"{c[0].__name__}-{c[3][0]}" for c in CASES])
def test_another_librarys_keyword_names_functrees_and_the_right_code_builds(cls, args, kwargs, foreign, right):
    name, value = foreign
    with pytest.raises(TypeError, match=rf"got an unexpected keyword argument {name!r}: .* is ") as info:
        cls(*args, **kwargs, **{name: value})
    message = str(info.value)
    assert message.startswith(f"ft.nn.{cls.__name__}()")
    assert f"wrong:  ft.nn.{cls.__name__}(..., {name}={value!r})" in message
    assert f"right:  ft.nn.{cls.__name__}(..., {', '.join(f'{k}={v!r}' for k, v in right.items())})" in message
    cls(*args, **kwargs, **right)  # the fix builds the layer


def test_every_foreign_keyword_is_named_in_one_error():
    with pytest.raises(TypeError, match=r"keyword arguments 'in_features', 'out_features', 'bias': torch's and "
                                        r"Flax's in_features= is input_size= here; .* torch's bias= is use_bias= here") as info:
        ft.nn.Dense(in_features=3, out_features=4, bias=False, key=KEY)  # pyright: ignore[reportCallIssue]
    assert "right:  ft.nn.Dense(..., input_size=3, output_size=4, use_bias=False)" in str(info.value)
    ft.nn.Dense(input_size=3, output_size=4, use_bias=False, key=KEY)


def test_a_misspelt_keyword_gets_the_close_names_and_an_unknown_one_the_arguments():
    with pytest.raises(TypeError, match=r"'activaton'; did you mean activation=\? Its arguments: input_size, "):
        ft.nn.Dense(3, 4, activaton=jax.nn.relu, key=KEY)  # pyright: ignore[reportCallIssue]
    with pytest.raises(TypeError, match=r"ft.nn.BatchNorm\(\) got an unexpected keyword argument 'nonsense'\. "
                                        r"Its arguments: feature_count, axis, momentum, epsilon,"):
        ft.nn.BatchNorm(16, nonsense=False)  # pyright: ignore[reportCallIssue]


class Net(ft.Module):
    scale: jax.Array

    def __init__(self, size, *, width=2):
        self.scale = jnp.ones((size, width))


class Inner(ft.Module):
    w: jax.Array

    def __init__(self, n):
        self.w = jnp.zeros(n)


class Outer(Inner):
    def __init__(self, n, **rest):
        super().__init__(n, **rest)  # the inner signature refuses what **rest carries


class Calls(ft.Module):
    w: jax.Array

    def __init__(self, n):
        self.w = jnp.zeros(n)
        sorted([], bogus=1)  # a TypeError of another call: left as it is  # pyright: ignore[reportCallIssue, reportArgumentType]


def test_a_users_module_gets_the_close_names_and_other_type_errors_are_left_alone():
    with pytest.raises(TypeError, match=r"^Net\(\) got an unexpected keyword argument 'widht'; did you mean width=\?"):
        Net(3, widht=4)  # pyright: ignore[reportCallIssue]
    # The outermost signature takes **rest: the inner __init__'s own error stands.
    with pytest.raises(TypeError, match=r"__init__\(\) got an unexpected keyword argument 'size'$"):
        Outer(3, size=2)
    with pytest.raises(TypeError, match=r"sort\(\) got an unexpected keyword argument 'bogus'|'bogus' is an invalid keyword"):
        Calls(3)
    # Missing arguments are Python's error, unchanged.
    with pytest.raises(TypeError, match=r"missing 1 required positional argument: 'size'"):
        Net()  # pyright: ignore[reportCallIssue]
    assert Net(3, width=4).scale.shape == (3, 4)
