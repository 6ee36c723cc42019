"""The key an eager compiled call is cached under (functree/nn/_eager_keys.py): static values
by exact type and value, the code a call runs, and UNKEYED where neither keys a value."""

import enum
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np

import functree as ft
from functree.nn._eager_keys import UNKEYED, code_roots, exact_key, static_key, static_values_key


def test_static_values_equal_in_python_but_not_in_a_program_have_other_keys():
    for a, b in ((1, 1.0), (1, True), (0.0, -0.0), (0.5, np.float32(0.5)), ((0.0,), (-0.0,))):
        assert a == b and exact_key(a) != exact_key(b), (a, b)
    assert exact_key({"a": (1, 2.0)}) == exact_key({"a": (1, 2.0)})
    assert static_key(object()) is None and static_key(jnp.ones(1)) is None


class _Knobs:
    gain = 1.0


class _Mode(enum.Enum):
    ON = 1


def test_a_mutable_object_is_unkeyed_a_member_or_a_function_keyed_by_itself():
    assert exact_key(_Knobs()) is UNKEYED  # edited in place, it would keep its old program
    assert exact_key((1, _Knobs())) is UNKEYED
    assert exact_key(types.SimpleNamespace(a=1)) is not UNKEYED  # (compares by value: keyed by it)
    assert exact_key(_Mode.ON) == (_Mode, _Mode.ON)
    assert exact_key(jnp.tanh) == (type(jnp.tanh), jnp.tanh)


class _Scaled(ft.Module):
    w: jax.Array
    scale: float = ft.field(static=True, default=1.0)

    def __call__(self, x):
        return self.scale * self.w * x


def test_static_fields_and_code_roots_of_a_model():
    one, zero, negative = _Scaled(jnp.ones(2)), _Scaled(jnp.ones(2), 0.0), _Scaled(jnp.ones(2), -0.0)
    assert static_values_key(zero) != static_values_key(negative)  # the tree definitions call them equal
    assert jax.tree.structure(zero) == jax.tree.structure(negative)
    assert static_values_key(one) == static_values_key(_Scaled(jnp.zeros(2)))
    classes, functions = code_roots(ft.nn.Sequential(one, ft.nn.Dense(2, 2, jax.nn.gelu, key=jax.random.key(0))))
    assert classes == (_Scaled,)  # the user's class; Sequential and Dense are library code
    assert functions == (jax.nn.gelu,)


def test_eager_program_is_made_once_per_signature_and_none_without_a_key():
    from functree.nn._eager_keys import eager_program

    cache, made = {}, []

    def make():
        made.append(None)
        return jax.jit(lambda m, x: m(x))

    model = _Scaled(jnp.ones(2))
    first = eager_program(cache, model, (model, jnp.ones(2)), "flags", make)
    assert eager_program(cache, _Scaled(jnp.zeros(2)), (_Scaled(jnp.zeros(2)), jnp.ones(2)), "flags", make) is first
    assert len(made) == 1  # new arrays of the same signature: the same program
    eager_program(cache, model, (model, jnp.ones(3)), "flags", make)  # another shape
    eager_program(cache, _Scaled(jnp.ones(2), 2.0), (_Scaled(jnp.ones(2), 2.0), jnp.ones(2)), "flags", make)
    assert len(made) == 3
    assert eager_program(cache, model, (model, 1.0), "flags", make) is None  # a Python number: no key
    knobbed = _Scaled(jnp.ones(2), _Knobs())  # a mutable object as a static value
    assert eager_program(cache, knobbed, (knobbed, jnp.ones(2)), "flags", make) is None


def test_the_hf_ports_are_library_classes_before_their_recorded_module_is_imported(monkeypatch):
    """The ports' ``__module__`` is ``functree.nn._hf_models`` (checkpoints' recorded name), a
    module only a pickle imports. Before one was unpickled, ``library_class`` took them for a
    user's classes and ``generate``, ``update_bn`` and eager scans re-read their code at every
    call (2.6 ms of ``model_reads`` against 0.02 ms for a tiny GPT-2): an answer depending on
    import order. The process's import state and answers are set as a fresh process has them."""
    from functree.hf import _models
    from functree.nn import _reads

    monkeypatch.delitem(sys.modules, _models.RECORDED_HOME, raising=False)  # as before any unpickling
    monkeypatch.setattr(_reads, "_CLASSES", {})  # (no answer kept from earlier tests)
    for cls in _models.RECORDED:
        assert cls.__module__ == _models.RECORDED_HOME
        assert _reads.library_class(cls), cls
        assert _reads.reads_key([cls]) == (cls,)  # by identity alone, its code not read
    namespace = {"__name__": "functree.hf._gpt2"}  # a class exec'd under a library's name stays the user's
    exec("class GPT2LMHeadModel:\n    def __call__(self, x):\n        return x\n", namespace)
    assert not _reads.library_class(namespace["GPT2LMHeadModel"])
