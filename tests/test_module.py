"""ft.Module: a frozen dataclass and a JAX pytree (generated flatten/unflatten per class)."""

from __future__ import annotations

import copy
import dataclasses
import pickle
import warnings
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

try:  # the test extra's; the one test that needs them skips without them
    from beartype import beartype
    from jaxtyping import Array, Float, jaxtyped
except ImportError:
    beartype = None

import functree as ft
from functree import _field_checks, _module
from tests._errors import raises_named


class Dense(ft.Module):
    weight: jax.Array
    bias: jax.Array
    activation: Callable[[jax.Array], jax.Array] = ft.field(static=True, default=jax.nn.relu)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.activation(x @ self.weight + jax.lax.broadcast_to_rank(self.bias, x.ndim))


def make_dense() -> Dense:
    return Dense(jnp.arange(8.0).reshape(2, 4) / 8, jnp.zeros(4))


class Stateful(ft.Module):
    weight: jax.Array
    steps: jax.Array = ft.field(no_derivative=True, default_factory=lambda: jnp.zeros((), jnp.int32))
    previous: jax.Array = ft.field(no_derivative=True, default=None)
    name: str = ft.field(static=True, default="stateful")


def test_module_is_a_frozen_dataclass_registered_with_jax():
    d = make_dense()
    assert dataclasses.is_dataclass(d)
    assert [f.name for f in dataclasses.fields(d)] == ["weight", "bias", "activation"]
    leaves, treedef = jax.tree.flatten(d)
    assert len(leaves) == 2
    assert jax.tree.unflatten(treedef, leaves).activation is jax.nn.relu
    # The static field lives in the tree definition.
    other = d.replace(activation=jax.nn.tanh)
    assert jax.tree.structure(other) != treedef


def test_jit_grad_vmap_accept_models_directly():
    d = make_dense()
    x = jnp.ones((3, 2))
    out = jax.jit(lambda m, x: m(x))(d, x)
    np.testing.assert_allclose(out, d(x), rtol=1e-5, atol=1e-6)
    grads = jax.grad(lambda m: m(x).sum())(d)
    assert isinstance(grads, Dense) and grads.weight.shape == (2, 4)
    batched = jax.vmap(lambda m, x: m(x), in_axes=(None, 0))(d, jnp.ones((5, 3, 2)))
    assert batched.shape == (5, 3, 4)
    ensemble = jax.vmap(lambda k: Dense(jax.random.normal(k, (2, 4)), jnp.zeros(4)))(
        jax.random.split(jax.random.key(0), 3)
    )
    assert ensemble.weight.shape == (3, 2, 4) and ensemble.activation is jax.nn.relu


def test_optax_accepts_a_model_with_only_float_leaves_directly():
    d = make_dense()
    opt = optax.sgd(0.1)
    state = opt.init(d)
    grads = jax.grad(lambda m: m(jnp.ones((1, 2))).sum())(d)
    updates, _ = opt.update(grads, state, d)
    new = optax.apply_updates(d, updates)
    assert isinstance(new, Dense)
    np.testing.assert_allclose(new.weight, d.weight - 0.1 * grads.weight)


def test_orbax_saves_and_restores_a_model(tmp_path):
    import orbax.checkpoint as ocp

    model = Stateful(jnp.arange(3.0), previous=jnp.ones(2))
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "ckpt", model)
    checkpointer.wait_until_finished()
    restored = checkpointer.restore(tmp_path / "ckpt", model)
    assert isinstance(restored, Stateful)
    np.testing.assert_array_equal(restored.weight, model.weight)
    np.testing.assert_array_equal(restored.previous, model.previous)
    assert restored.name == "stateful"


def test_three_kinds_of_field():
    m = Stateful(jnp.ones(2))
    kinds = {f.name: f.metadata.get("functree.kind", "parameter") for f in dataclasses.fields(m)}
    assert kinds == {
        "weight": "parameter",
        "steps": "no_derivative",
        "previous": "no_derivative",
        "name": "static",
    }
    assert m.steps.dtype == jnp.int32 and m.previous is None and m.name == "stateful"
    # Static in the treedef, no_derivative carried as leaves (and traced), parameters leaves.
    assert len(jax.tree.leaves(m)) == 2
    params = ft.parameters(m)
    assert params.steps is None and params.weight is m.weight


def test_default_factory_makes_a_fresh_value_per_instance():
    class Bag(ft.Module):
        items: list = ft.field(default_factory=list)

    assert Bag().items is not Bag().items


def test_field_cannot_be_both_static_and_no_derivative():
    with pytest.raises(ValueError, match="either static=True or no_derivative=True"):
        ft.field(static=True, no_derivative=True)


@pytest.mark.parametrize("construct", ["positional", "keywords", "default", "replace"])
def test_unhashable_static_value_is_an_error_naming_the_field(construct):
    class Config(ft.Module):
        weight: jax.Array
        sizes: tuple = ft.field(static=True, default=(1, 2))

    w = jnp.ones(2)
    with pytest.raises(TypeError) as info:
        if construct == "positional":
            Config(w, [1, 2])
        elif construct == "keywords":
            Config(weight=w, sizes=[1, 2])
        elif construct == "replace":
            Config(w).replace(sizes=[1, 2])
        else:

            class Listed(ft.Module):
                weight: jax.Array
                sizes: tuple = ft.field(static=True, default_factory=lambda: [1, 2])

            Listed(w)

    message = str(info.value)
    assert "sizes" in message
    assert "unhashable" in message
    assert "right:" in message and "tuple" in message


@pytest.mark.parametrize("array", [jnp.ones(3), np.ones(3)])
def test_array_in_static_field_is_an_error(array):
    class Config(ft.Module):
        table: object = ft.field(static=True)

    for make in (lambda: Config(array), lambda: Config(table=array)):
        with pytest.raises(TypeError) as info:
            make()
        message = str(info.value)
        assert "Config.table" in message and "(3,)" in message
        assert "ft.field(no_derivative=True)" in message


def test_assignment_raises_and_shows_the_functional_fix():
    d = make_dense()
    with pytest.raises(ft.FrozenModuleError) as info:
        d.weight = jnp.zeros((2, 4))
    message = str(info.value)
    assert "model = model.replace(weight=value)" in message
    assert 'ft.set(model, ".weight", value)' in message
    assert isinstance(info.value, dataclasses.FrozenInstanceError)
    with pytest.raises(ft.FrozenModuleError):
        del d.bias


def test_assigning_a_name_that_is_no_field_says_so_and_shows_the_declaration():
    # An NNX or torch habit (self.cache = h in __call__): model.replace(cache=...) would fail
    # too, so the message must not offer it as the fix for a name the class lacks.
    d = make_dense()
    for act in (lambda: setattr(d, "cache", jnp.zeros(2)), lambda: delattr(d, "cache")):
        with pytest.raises(ft.FrozenModuleError) as info:
            act()
        message = str(info.value)
        assert "'cache'" in message and "not one of its fields" in message
        assert "cache: jax.Array = ft.field(no_derivative=True)" in message
        assert "Cannot assign to field" not in message


def test_custom_init_assigns_fields_like_a_normal_class():
    calls = []

    class Linear(ft.Module):
        weight: jax.Array
        bias: jax.Array
        features: int = ft.field(static=True)

        def __init__(self, n_in: int, n_out: int, *, key: jax.Array):
            calls.append((n_in, n_out))
            self.weight = jax.random.normal(key, (n_in, n_out))
            self.bias = jnp.zeros(n_out)
            self.features = n_out

    layer = Linear(3, 2, key=jax.random.key(0))
    assert layer.weight.shape == (3, 2) and layer.features == 2
    # JAX's unflatten rebuilds the instance without calling __init__.
    rebuilt = jax.jit(lambda m: m)(layer)
    assert calls == [(3, 2)]
    assert rebuilt.features == 2
    with pytest.raises(ft.FrozenModuleError):
        layer.features = 3


def test_custom_init_missing_field_is_an_error():
    class Half(ft.Module):
        a: jax.Array
        b: jax.Array

        def __init__(self):
            self.a = jnp.ones(1)

    with pytest.raises(TypeError, match=r"did not set field\(s\) \['b'\]"):
        Half()


def test_custom_init_assigning_an_undeclared_attribute_is_an_error():
    class Sloppy(ft.Module):
        weight: jax.Array

        def __init__(self):
            self.weight = jnp.ones(2)
            self.size = 2

    with pytest.raises(AttributeError) as info:
        Sloppy()
    message = str(info.value)
    assert "self.size" in message and "size: int = ft.field(static=True)" in message


def test_super_init_in_a_custom_init_is_harmless():
    class Base(ft.Module):
        w: jax.Array

        def __init__(self, n: int = 2):
            super().__init__()
            self.w = jnp.ones(n)

    class Child(Base):
        extra: jax.Array

        def __init__(self):
            super().__init__(3)
            self.extra = jnp.zeros(1)

    assert Base().w.shape == (2,)
    child = Child()
    assert child.w.shape == (3,) and child.extra.shape == (1,)
    assert jax.tree.map(lambda x: x, child).w.shape == (3,)


def test_subclass_of_a_dataclass_style_module_calls_super_with_fields():
    class Point(ft.Module):
        x: jax.Array
        y: jax.Array

    class Labeled(Point):
        label: str = ft.field(static=True, default="p")

        def __init__(self, x: jax.Array, label: str):
            super().__init__(x=x, y=x * 2)
            self.label = label

    p = Labeled(jnp.ones(2), "q")
    np.testing.assert_array_equal(p.y, [2.0, 2.0])
    assert p.label == "q"


def test_replace_returns_a_copy_and_checks_names():
    d = make_dense()
    e = d.replace(bias=jnp.ones(4))
    assert e is not d and e.weight is d.weight
    np.testing.assert_array_equal(d.bias, np.zeros(4))
    with pytest.raises(AttributeError, match=r"Dense has no field 'bais'; its fields are \['weight', 'bias', 'activation'\]"):
        d.replace(bais=1.0)


def test_dataclass_style_construction_errors():
    with pytest.raises(TypeError, match="missing field"):
        Dense(jnp.ones((2, 4)))
    with pytest.raises(TypeError, match="no field 'wieght'"):
        Dense(wieght=1.0, bias=1.0)
    with pytest.raises(TypeError, match=r"multiple values for (field|argument) 'weight'"):
        Dense(jnp.ones(1), weight=jnp.ones(1), bias=jnp.ones(1))
    with pytest.raises(TypeError, match="takes 3 field"):
        Dense(1, 2, 3, 4)


def test_field_holding_one_of_several_module_types():
    class A(ft.Module):
        w: jax.Array

    class B(ft.Module):
        u: jax.Array
        v: jax.Array

    class Holder(ft.Module):
        inner: A | B

    traces = []

    @jax.jit
    def total(h: Holder) -> jax.Array:
        traces.append(type(h.inner).__name__)
        return sum(x.sum() for x in jax.tree.leaves(h))

    assert float(total(Holder(A(jnp.ones(2))))) == 2.0
    assert float(total(Holder(B(jnp.ones(2), jnp.ones(3))))) == 5.0
    assert traces == ["A", "B"]
    grads = ft.gradient(total, at=Holder(B(jnp.ones(2), jnp.ones(3))))
    assert isinstance(grads.inner, B)


def test_integer_and_boolean_leaves_are_not_differentiated():
    class Mixed(ft.Module):
        weight: jax.Array
        index: jax.Array
        mask: jax.Array

    m = Mixed(jnp.ones(3), jnp.arange(3), jnp.array([True, False, True]))
    params = ft.parameters(m)
    assert params.index is None and params.mask is None
    grads = ft.gradient(lambda m: (m.weight[m.index] * m.mask.astype(jnp.float32)).sum(), at=m)
    np.testing.assert_array_equal(grads.weight, [1.0, 0.0, 1.0])
    assert grads.index is None and grads.mask is None


def test_copy_and_pickle_round_trip():
    m = Stateful(jnp.arange(3.0), previous=jnp.ones(2))
    for clone in (copy.copy(m), copy.deepcopy(m), pickle.loads(pickle.dumps(m))):
        assert isinstance(clone, Stateful)
        np.testing.assert_array_equal(clone.weight, m.weight)
        np.testing.assert_array_equal(clone.previous, m.previous)
        assert clone.name == "stateful"
        with pytest.raises(ft.FrozenModuleError):
            clone.weight = 1.0


def test_module_with_arrays_in_a_static_field_is_an_error():
    class PReLU(ft.Module):
        slope: jax.Array

        def __call__(self, x: jax.Array) -> jax.Array:
            return jnp.where(x > 0, x, self.slope * x)

    class Layer(ft.Module):
        weight: jax.Array
        activation: Callable[[jax.Array], jax.Array] = ft.field(static=True, default=jax.nn.relu)

    with pytest.raises(TypeError) as info:
        Layer(jnp.ones(2), PReLU(jnp.full(2, 0.1)))
    message = str(info.value)
    assert "Layer.activation holds a PReLU with 1 array leaves" in message
    assert "activation: PReLU                          # a submodule is a parameter field" in message
    with pytest.raises(TypeError, match="holds a PReLU"):
        Layer(jnp.ones(2)).replace(activation=PReLU(jnp.ones(2)))

    class Empty(ft.Module):
        pass

    assert isinstance(Layer(jnp.ones(2), Empty()).activation, Empty)  # no arrays: allowed


def test_generated_init_carries_the_field_annotations_for_beartype_and_jaxtyping():
    import inspect

    if beartype is None:
        pytest.skip("beartype and jaxtyping (the test extra's) are not installed here")

    class Affine(ft.Module):
        weight: Float[Array, "a b"]  # noqa: F722 (jaxtyping's shape string)
        bias: Float[Array, " b"]  # noqa: F722
        scale: float = 1.0

    params = inspect.signature(Affine).parameters
    assert str(params["weight"].annotation) == str(Float[Array, "a b"]) and params["scale"].default == 1.0
    checked = jaxtyped(typechecker=beartype)(Affine)
    checked(jnp.ones((2, 3)), jnp.ones(3))
    with pytest.raises(Exception, match="parameter 'bias'"):
        checked(jnp.ones((2, 3)), jnp.ones(4))  # b is 3 in weight, 4 in bias

    @beartype
    class Plain(ft.Module):
        weight: Float[Array, "a b"]  # noqa: F722 (jaxtyping's shape string)

    with pytest.raises(Exception, match="weight"):
        Plain(jnp.ones(3))  # one dimension, two annotated
    with pytest.raises(TypeError, match=r"missing field\(s\) \['weight'\]"):
        Plain()  # functree's binding errors are kept
    with pytest.raises(TypeError, match="has no field 'wieght'"):
        Plain(wieght=jnp.ones((2, 2)))


def test_a_class_rebuilt_by_cloudpickle_still_fills_its_defaults(tmp_path):
    """cloudpickle rebuilds a ``__main__`` class's generated ``__init__`` by value, its
    not-given marker with it: a copy of the marker read as a given value, so every later
    ``D(w)`` got ``scale=<required>`` (and a missing field went unreported)."""
    pytest.importorskip("cloudpickle")
    import subprocess
    import sys
    import textwrap

    script = tmp_path / "main.py"
    script.write_text(textwrap.dedent("""
        import cloudpickle, jax.numpy as jnp, functree as ft
        class D(ft.Module):
            w: jnp.ndarray
            scale: float = ft.field(static=True, default=2.0)
        cloudpickle.loads(cloudpickle.dumps(D(jnp.ones(2))))
        print(D(jnp.ones(2)).scale)
        try:
            D()
        except TypeError as e:
            print("missing:", "w" in str(e))
    """))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["2.0", "missing:", "True"]
    assert pickle.loads(pickle.dumps(_module._REQUIRED)) is _module._REQUIRED


def test_post_init_runs_after_the_fields_are_set_and_may_check_or_set_them():
    """``__post_init__`` was never called: a dataclass's or Equinox's checks there passed silently."""

    class Positive(ft.Module):
        scale: jax.Array
        half: jax.Array = ft.field(no_derivative=True, default=None)

        def __post_init__(self):
            if not bool(jnp.all(self.scale > 0)):
                raise ValueError("scale must be positive")
            self.half = self.scale / 2  # still being built: fields may be set

    assert float(Positive(jnp.float32(4.0)).half) == 2.0
    with pytest.raises(ValueError, match="scale must be positive"):
        Positive(-jnp.ones(2))
    with pytest.raises(ft.FrozenModuleError):
        Positive(jnp.float32(1.0)).scale = jnp.float32(2.0)


class LeakyReLU(ft.Module):
    slope: float = ft.field(static=True, default=0.1)

    def __call__(self, x):
        return jnp.where(x > 0, x, self.slope * x)


def test_a_leafless_module_as_a_static_value_compares_by_its_fields():
    """An activation written as a module (a slope, no arrays) compared by identity: two
    models built alike had two tree definitions (jit traced each, a pickled model did not
    fit its own optimizer state). Leafless modules of one class with equal fields are equal
    and hash alike; modules with leaves stay compared by identity."""
    assert LeakyReLU() == LeakyReLU() and hash(LeakyReLU()) == hash(LeakyReLU()) and LeakyReLU() != LeakyReLU(0.2)
    models = [ft.nn.Dense(2, 2, LeakyReLU(), key=jax.random.key(0)) for _ in range(3)]
    assert len({jax.tree.structure(m) for m in models}) == 1
    traces = []

    @jax.jit
    def run(m, x):
        traces.append(1)
        return m(x)

    for m in models:
        run(m, jnp.ones((1, 2)))
    assert len(traces) == 1
    restored = pickle.loads(pickle.dumps(models[0]))
    assert jax.tree.structure(restored) == jax.tree.structure(models[0])
    dense = ft.nn.Dense(2, 2, key=jax.random.key(0))
    assert dense != ft.nn.Dense(2, 2, key=jax.random.key(0)) and dense == dense  # with leaves: identity
    assert hash(dense) == object.__hash__(dense)


def test_python_floats_in_a_parameter_fields_list_warn_that_they_are_not_trained():
    """Seed 002's podcast model, written literally (``categoryMultipliers: [Float]`` as a list
    of Python floats), trained only its scalar fields: the lists' gradients were None, with
    no warning. A parameter field holding only Python numbers in a list, tuple or dict warns."""

    class Podcast(ft.Module):
        min_speed: float
        multipliers: list

    with pytest.warns(ft.NonDifferentiableFieldWarning, match=r"Podcast.multipliers is a parameter field whose list "
                                                               r"holds Python numbers \(\[0.5, 1.0\]\)"):
        Podcast(1.0, [0.5, 1.0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = Podcast(1.0, [jnp.float32(0.5), jnp.float32(1.0)])  # the fix: trained
        Podcast(1.0, [])
    grads = ft.gradient(lambda m: m.min_speed * (m.multipliers[0] + 2 * m.multipliers[1]), at=model)
    assert [float(g) for g in grads.multipliers] == [1.0, 2.0]


def test_an_int_in_a_float_annotated_field_names_the_float_to_write():
    """Swift's `var bias: Float = 0` written `bias: float = 0` held an int: untrained, with a
    warning that suggested static=True or no_derivative=True, never 0.0."""
    class P(ft.Module):
        w: jnp.ndarray
        bias: float = 0

    with pytest.warns(ft.NonDifferentiableFieldWarning, match=r"(?s)P.bias is annotated float but holds the int 0.*bias: float = 0.0"):
        P(jnp.ones(2))


# --- field declarations and values JAX would reject late (functree/_field_checks.py) --------------
@pytest.mark.parametrize("option, value, fix", [
    ("converter", jnp.asarray, "def __post_init__(self): self.w = jnp.asarray(self.w)"),
    ("init", False, "n: int = ft.field(static=True, default=3)"),
    ("repr", False, "secret: str = ft.field(static=True)"),
    ("hash", False, "n: int = ft.field(static=True)"),
    ("compare", False, "n: int = ft.field(static=True)"),
    ("kw_only", True, "Cls(w, n=2)"),
    ("metadata", {"decay": False}, "ft.field(decay=False)"),
])
def test_field_refuses_dataclass_and_equinox_options_it_would_ignore(option, value, fix):
    # was: stored as metadata and ignored (converter not applied, init=False still an argument ...)
    with pytest.raises(TypeError, match=rf"ft.field does not take {option}= \(an option of dataclasses.field") as e:
        ft.field(static=option != "converter", default=3, **{option: value})
    assert fix in str(e.value)


def test_the_kw_only_marker_is_refused_at_class_definition():
    # was: ignored, the fields after it still taken positionally
    with pytest.raises(TypeError, match=r"C\._: dataclasses.KW_ONLY is not supported by ft.Module"):
        class C(ft.Module):
            w: jax.Array
            _: dataclasses.KW_ONLY
            n: int = ft.field(static=True, default=1)


def test_field_keeps_the_users_own_metadata():
    class Scaled(ft.Module):
        w: jax.Array = ft.field(decay=False)

    assert Scaled.__dataclass_fields__["w"].metadata["decay"] is False


class Heads(ft.Module):
    heads: dict
    counts: dict = ft.field(no_derivative=True, default_factory=dict)


@pytest.mark.parametrize("field", ["heads", "counts"])
def test_a_dict_field_with_keys_jax_cannot_sort_is_refused_at_construction(field):
    mixed = {0: jnp.ones(2), "aux": jnp.ones(2)}
    values = {"heads": {"a": jnp.ones(2)}, field: mixed}
    # was: accepted; then ft.parameters, ft.gradient, optimizer.init failed inside JAX
    # ("Comparator raised exception while sorting pytree dictionary keys"), naming no field
    with pytest.raises(TypeError, match=rf"Heads\.{field} is a dict whose keys cannot be sorted together \(int, str\)"):
        Heads(**values)
    with pytest.raises(TypeError, match=rf"Heads\.{field} is a dict"):
        Heads({"a": jnp.ones(2)}).replace(**{field: mixed})
    ok = Heads({0: jnp.ones(2), 1: jnp.zeros(2)}, {"0": jnp.ones(1), "aux": jnp.ones(1)})  # one key type each
    assert len(jax.tree.leaves(ok)) == 4


def test_replace_documents_that_post_init_does_not_run():
    class Wide(ft.Module):
        w: jax.Array
        n_out: int = ft.field(static=True, default=0)

        def __post_init__(self):
            self.n_out = self.w.shape[1]

    m = Wide(jnp.ones((3, 4))).replace(w=jnp.ones((3, 5)))
    assert m.n_out == 4 and dataclasses.replace(m, w=jnp.ones((3, 5))).n_out == 5  # the documented behaviour
    assert "__post_init__" in ft.Module.replace.__doc__ and "dataclasses.replace" in ft.Module.replace.__doc__


def _declared(message: str) -> list[str]:
    """The field declarations a warning offers (``name: type = ft.field(...)``), as pasted."""
    lines = [line.split("#")[0].replace("right:", "").strip() for line in message.splitlines()]
    return [line for line in lines if "= ft.field(" in line]


def _module_with(declaration: str) -> type:
    """A module whose field is declared by ``declaration`` beside a trained ``w``."""
    namespace = {"ft": ft, "jax": jax, "jnp": jnp}
    exec(f"class F(ft.Module):\n    w: jax.Array\n    {declaration}\n"
         "    def __call__(self, x):\n        return self.w * x\n", namespace)
    return namespace["F"]


def _runs_everywhere(model: ft.Module) -> None:
    """ft.jit, jax.jit, ft.gradient and a train step take ``model``, with the right numbers."""
    x = jnp.full(2, 2.0)
    np.testing.assert_array_equal(ft.jit(lambda m, x: m(x))(model, x), [2.0, 2.0])
    np.testing.assert_array_equal(jax.jit(lambda m, x: m(x))(model, x), [2.0, 2.0])
    np.testing.assert_array_equal(ft.gradient(lambda m: m(x).sum(), at=model).w, [2.0, 2.0])
    step = ft.train.train_step(lambda m, batch: m(batch[0]).sum(), ft.optim.sgd(0.25))
    new = step(model, step.optimizer.init(model), (x,))[0]
    np.testing.assert_allclose(new.w, [0.5, 0.5], rtol=0, atol=1e-7)  # 1 - 0.25 * 2


@pytest.mark.parametrize(("annotation", "value", "state"), [("str", "encoder", None), ("int", 3, jnp.asarray(3)),
                                                            ("bool", True, jnp.asarray(True))])
def test_a_non_differentiable_field_warning_offers_only_declarations_that_jit_and_train(annotation, value, state):
    """``name: str = ft.field(no_derivative=True)``, once offered, broke jit, gradients and
    train steps (a str is no array leaf): a str is configuration, a number's state an array."""
    with pytest.warns(ft.NonDifferentiableFieldWarning) as rec:
        _module_with(f"name: {annotation}")
    declarations = _declared(str(rec[0].message))
    assert len(declarations) == (1 if state is None else 2)
    assert declarations[0] == f"name: {annotation} = ft.field(static=True)"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _runs_everywhere(_module_with(declarations[0])(jnp.ones(2), value))
        if state is not None:
            assert declarations[1] == "name: jax.Array = ft.field(no_derivative=True)"
            _runs_everywhere(_module_with(declarations[1])(jnp.ones(2), state))


def test_floats_in_a_list_warning_offers_a_static_declaration_that_is_accepted():
    """``w: list = ft.field(static=True)``, once offered, was refused (a list is unhashable)."""
    class Mix(ft.Module):
        w: list

    with pytest.warns(ft.NonDifferentiableFieldWarning) as rec:
        Mix([0.5, 0.5])
    message = str(rec[0].message)
    (declaration,) = _declared(message)
    assert declaration == "w: tuple = ft.field(static=True)"
    given = eval(message.split("configuration, hashed: w=")[1].splitlines()[0])  # the value it shows
    namespace = {"ft": ft}
    exec(f"class Mix(ft.Module):\n    {declaration}\n    def __call__(self, x):\n        return sum(wi * x for wi in self.w)\n",
         namespace)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mix = namespace["Mix"](given)
        np.testing.assert_allclose(ft.jit(lambda m, x: m(x))(mix, jnp.float32(2.0)), 2.0, rtol=0, atol=1e-7)


def test_a_field_hidden_by_a_property_of_the_same_name_is_refused_at_class_definition():
    class Base(ft.Module):
        w: jax.Array

        @property
        def n(self):
            return self.w.shape[0]

    # was: accepted; Sub(w, n=5).n ran Base's property (2) while the tree held, trained and saved 5
    raises_named(lambda: type("Sub", (Base,), {"__annotations__": {"n": int}, "n": ft.field(static=True)}),
                 TypeError, _field_checks.HIDDEN_FIELD, "@property def n_derived(self)")

    class Counted(ft.Module):
        w: jax.Array
        n: int = ft.field(static=True, default=5)

    with pytest.raises(TypeError, match=r"Late\.n is a field, and Late\.n is a property of the same name"):
        class Late(Counted):  # a subclass's property over its base's field
            @property
            def n(self):
                return 2

    class Overridden(Base):  # a field with a default is the class attribute: it is what model.n reads
        n: int = ft.field(static=True, default=3)

    assert Overridden(jnp.ones(2)).n == 3


def test_a_field_named_like_a_method_of_module_itself_is_refused_at_class_definition():
    # was: accepted; the field hid Module.replace on the instance, so ft.set(model, ".replace", v)
    # failed deep inside with "'ArrayImpl' object is not callable" and model.replace(...) likewise
    raises_named(lambda: type("Edit", (ft.Module,), {"__annotations__": {"replace": jax.Array}}),
                 TypeError, _field_checks.MODULE_METHOD_FIELD, "right:  replace_: jax.Array")

    class Methods(ft.Module):  # other libraries' method names are fields like any other
        apply: jax.Array
        parameters: jax.Array

    m = ft.set(Methods(jnp.ones(2), jnp.ones(2)), ".apply", jnp.zeros(2))
    np.testing.assert_allclose(m.apply, np.zeros(2))


def test_submodules_or_arrays_inside_a_static_tuple_are_refused_naming_where():
    class Net(ft.Module):
        blocks: tuple = ft.field(static=True)

    layers = (make_dense(), make_dense())
    # was: accepted (a tuple of layers hashes by their identity); the layers' weights were no
    # leaves, so gradients and optimizers left them untrained, and the gradient's .blocks held
    # the weights themselves
    raises_named(lambda: Net(layers), TypeError, _module.MODULE_IN_STATIC,
                 "Net.blocks holds a Dense with 2 array leaves at blocks[0]")
    raises_named(lambda: Net((jax.nn.relu, {"table": jnp.ones(3)})), TypeError, _module.ARRAY_IN_STATIC,
                 "at blocks[1]['table']")  # was: "unhashable tuple", with list -> tuple as the fix
    raises_named(lambda: Net((1, 2)).replace(blocks=layers), TypeError, _module.MODULE_IN_STATIC,
                 "right:  blocks: tuple ")
    assert Net((jax.nn.relu, "gelu", 2, None)).blocks[1] == "gelu"  # configuration stays static


@pytest.mark.parametrize("value, fix", [
    ({"a": 1}, '(("a", 1),)       # dict(self.cfg) where it is read'),
    ({1, 2}, "cfg: frozenset = ft.field(static=True)"),
    ((1, [2, 3]), "(1, (2, 3))       # its items hashable too"),
])
def test_an_unhashable_static_value_names_the_hashable_form_of_its_own_type(value, fix):
    class Config(ft.Module):
        cfg: object = ft.field(static=True)

    # was: every unhashable value was told "wrong: list, right: tuple", even a tuple
    raises_named(lambda: Config(value), TypeError, _module.UNHASHABLE_STATIC, fix)


def test_an_init_var_is_refused_at_class_definition():
    # was: accepted and left out of the fields: Scaled(w, 3.0) raised "takes 1 field(s) ['w'],
    # got 2 positional", and Scaled(w) called __post_init__ without it
    def define():
        class Scaled(ft.Module):
            w: jax.Array
            scale: dataclasses.InitVar[float] = 1.0

            def __post_init__(self, scale):
                self.w = self.w * scale

    raises_named(define, TypeError, _field_checks.INIT_VAR, "def __init__(self, w, scale=1.0):")
    raises_named(lambda: type("Late", (ft.Module,), {"__annotations__": {"scale": "dataclasses.InitVar[float]"}}),
                 TypeError, _field_checks.INIT_VAR, "Late.scale")  # from __future__ import annotations
