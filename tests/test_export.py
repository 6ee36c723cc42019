"""ft.export: a function of Modules compiled ahead of time, kept as bytes and called again.

The bytes are read back in this process without the exported objects (the header's
descriptions and JAX's program are all that is used), so what a fresh process does is
what these tests do; results are compared bit for bit with ``jax.jit`` of the same
function on this machine (the same program, compiled once each).
"""

from __future__ import annotations

import json
import typing

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _errors import raises_named

import functree as ft
from functree.train import _export


class Scaled(ft.Module):
    w: jax.Array
    scale: float = ft.field(static=True, default=2.0)

    def __call__(self, x, key, *, noise=0.0):
        return jnp.tanh(x @ self.w) * self.scale + noise * jax.random.normal(key, (x.shape[0], self.w.shape[1]))


def mlp(activation=ft.nn.relu):
    k1, k2 = jax.random.split(jax.random.key(0))
    return ft.nn.Sequential(ft.nn.Dense(3, 8, activation=activation, key=k1), ft.nn.Dense(8, 1, key=k2))


X = jnp.asarray(np.random.default_rng(0).normal(size=(4, 3)), jnp.float32)
Y = jnp.asarray(np.random.default_rng(1).normal(size=(4, 1)), jnp.float32)
OPT = ft.optim.Optimizer(ft.optim.adam(1e-2))


def step(model, opt_state, x, y):
    return OPT.minimize(lambda m: jnp.mean((m(x) - y) ** 2), model, opt_state)


def roundtrip(exported):
    return ft.Exported.deserialize(exported.serialize())


@pytest.fixture(scope="module")
def exported_step():
    model = mlp()
    return roundtrip(ft.export(step)(model, OPT.init(model), X, Y))


def test_a_training_step_read_back_trains_as_jit_bit_for_bit(exported_step):
    model, state = mlp(), OPT.init(mlp())
    ref_model, ref_state = model, state
    jitted = jax.jit(step)
    for _ in range(3):
        model, state, loss = exported_step(model, state, X, Y)
        ref_model, ref_state, ref_loss = jitted(ref_model, ref_state, X, Y)
        for a, b in zip(jax.tree.leaves((model, state, loss)), jax.tree.leaves((ref_model, ref_state, ref_loss))):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert type(model) is ft.nn.Sequential and type(state) is type(ref_state)
    assert model.layers[0].activation is ft.nn.relu
    assert str(exported_step) == "Exported(step(model, opt_state, x, y) -> 17 arrays, platforms ('cpu',))"
    assert exported_step.inputs["model.layers.0.weight"].shape == (3, 8) and exported_step.inputs["x"].shape == (4, 3)


def test_keys_keywords_and_a_symbolic_batch():
    model = Scaled(jnp.asarray(np.random.default_rng(2).normal(size=(3, 2)), jnp.float32))
    key = jax.random.key(1)
    b = jax.export.symbolic_shape("b")[0]
    f = lambda model, x, key, *, noise=0.0: model(x, key, noise=noise)  # noqa: E731
    exported = roundtrip(ft.export(f)(model, jax.ShapeDtypeStruct((b, 3), jnp.float32), key, noise=0.5))
    for rows in (4, 7):
        x = X[:1].repeat(rows, 0)
        np.testing.assert_array_equal(exported(model, x, key, noise=0.5), jax.jit(f)(model, x, key, noise=0.5))
    raises_named(lambda: exported(model, X, key), ft.ExportError, _export.DIFFERENT_TREE, "at noise it has a value")
    raises_named(lambda: exported(model, X, jnp.zeros(2, jnp.uint32), noise=0.5), ft.ExportError,
                 _export.KEY_EXPECTED, "takes key as a PRNG key")
    # noise is keyword-only: the fix read "exported(model, x, key, noise)", itself a TypeError
    raises_named(lambda: exported(model, X), ft.ExportError, _export.BAD_CALL,
                 "(model, x, key, *, noise): missing a required argument: 'key'")
    raises_named(lambda: exported(model, X), ft.ExportError, _export.BAD_CALL, "right:  exported(model, x, key, noise=noise)")
    assert str(exported).startswith("Exported(fn(model, x, key, *, noise) -> 1 array")


def test_a_python_number_is_traced_weakly_as_jit_traces_it():
    f = lambda x, scale: x * scale  # noqa: E731
    exported = roundtrip(ft.export(f)(jnp.ones(2, jnp.bfloat16), 0.5))
    out = exported(jnp.ones(2, jnp.bfloat16), 0.25)
    assert out.dtype == jnp.bfloat16 and float(out[0]) == 0.25
    scaled = roundtrip(ft.export(f)(X, np.float32(0.5)))  # a NumPy scalar: a float32 array, as jit takes it
    np.testing.assert_array_equal(scaled(X, np.float32(0.25)), X * np.float32(0.25))
    np.testing.assert_array_equal(scaled(X, 3), X * np.float32(3))  # an int where a float was traced, as jit
    counted = ft.export(f)(X, 2)  # int32: a float is no int, and NumPy would wrap 2**40 around to 0
    np.testing.assert_array_equal(counted(X, -7), X * np.float32(-7))
    raises_named(lambda: counted(X, 3.5), ft.ExportError, _export.DIFFERENT_ARRAY,
                 "takes scale as int32[]; this call gives float32[]. Pass")
    raises_named(lambda: counted(X, 3.5), ft.ExportError, _export.DIFFERENT_ARRAY, "wrong:  exported(..., 3.5, ...)")
    raises_named(lambda: counted(X, 2**40), ft.ExportError, _export.INT_OUT_OF_RANGE,
                 "the Python int 1099511627776 is outside int32's range [-2147483648, 2147483647]")


def test_another_static_configuration_or_shape_is_refused_by_key_path(exported_step):
    tanh = mlp(ft.nn.tanh)
    raises_named(lambda: exported_step(tanh, OPT.init(tanh), X, Y), ft.ExportError, _export.DIFFERENT_TREE,
                 'at model.layers.0.activation it has the static value {"function": "jax.nn.relu"}')
    raises_named(lambda: exported_step(mlp(), OPT.init(mlp()), X[:2], Y[:2]), ft.ExportError,
                 _export.DIFFERENT_ARRAY, "takes x as float32[4, 3]; this call gives float32[2, 3]")
    raises_named(lambda: exported_step(mlp(), OPT.init(mlp()), X.astype(jnp.bfloat16), Y), ft.ExportError,
                 _export.DIFFERENT_ARRAY, "this call gives bfloat16[4, 3]")
    raises_named(lambda: exported_step(X, OPT.init(mlp()), X, Y), ft.ExportError, _export.DIFFERENT_TREE,
                 "at model it has a Sequential, this call gives an array")


def test_a_function_at_a_leaf_is_checked_on_every_call():
    f = lambda x, fns: fns[0](x)  # noqa: E731
    exported = ft.export(f)(X, [jax.nn.relu])
    np.testing.assert_array_equal(exported(X, [jax.nn.relu]), jax.nn.relu(X))
    raises_named(lambda: exported(X, [jax.nn.tanh]), ft.ExportError, _export.DIFFERENT_TREE, "at fns.0")


class Unregistered(typing.NamedTuple):
    w: jax.Array


def test_a_value_that_is_no_array_or_a_result_no_process_could_rebuild_is_refused_at_export():
    raises_named(lambda: ft.export(lambda x, mode: x)(X, "train"), ft.ExportError, _export.NOT_AN_ARRAY,
                 "the argument at mode is a str")
    raises_named(lambda: ft.export(lambda x: (x, lambda y: y))(X), ft.ExportError, _export.RESULT_NOT_AN_ARRAY,
                 "the result at 1 is a function")
    raises_named(lambda: ft.export(lambda x: Unregistered(x))(X), ft.ExportError, _export.RESULT_NOT_REBUILT,
                 "@ft.train.register on the class")
    # collect_state's {KeyPath: value}: a CheckpointError ("Nothing was written", the fix {".layers_[1]_.x": v})
    bn = ft.nn.training(ft.nn.Sequential(ft.nn.BatchNorm(3)))
    raises_named(lambda: ft.export(lambda m, x: ft.nn.collect_state(lambda m: m(x), m))(bn, X), ft.ExportError,
                 _export.RESULT_LAYER_STATE, "the key KeyPath('.layers[0].running_mean'), a KeyPath; a dict's keys")
    # Any other key: a dict's fix, not the layer state's (which every such error offered)
    raises_named(lambda: ft.export(lambda x: {(1, 2): x})(X), ft.ExportError, _export.RESULT_NOT_DESCRIBED,
                 "the root has the key (1, 2), a tuple; a dict's keys are kept as text (str, int and bool keys). "
                 "Key the dict by text or integers, or return its values in a list:\n\n"
                 "    wrong:  return {(1, 2): y}\n    right:  return {\"1_2\": y}")
    # an np.str_ key: its trailing NULs shown and kept in the fix (str() dropped them: another key)
    raises_named(lambda: ft.export(lambda x: {np.str_("y\x00"): x})(X), ft.ExportError, _export.RESULT_NOT_DESCRIBED,
                 "    wrong:  return {np.str_('y\\x00'): y}\n    right:  return {\"y\\x00\": y}")


def test_damaged_bytes_are_refused_before_anything_runs(exported_step):
    data = exported_step.serialize()
    raises_named(lambda: ft.Exported.deserialize(b"PK\x03\x04" + data[4:]), ft.ExportError, _export.NOT_EXPORTED,
                 "read the bytes that Exported.serialize() wrote")
    flipped = bytearray(data)
    flipped[-50] ^= 1
    raises_named(lambda: ft.Exported.deserialize(bytes(flipped)), ft.ExportError, _export.DAMAGED, "SHA-256")
    raises_named(lambda: ft.Exported.deserialize(data[:40]), ft.ExportError, _export.DAMAGED, "the header alone needs")
    start = len(_export.MAGIC) + 8
    size = int.from_bytes(data[len(_export.MAGIC):start], "little")
    header = json.loads(data[start:start + size])

    def with_header(**changes):
        raw = json.dumps({**header, **changes}).encode()
        return _export.MAGIC + len(raw).to_bytes(8, "little") + raw + data[start + size:]

    raises_named(lambda: ft.Exported.deserialize(with_header(format=2)), ft.ExportError, _export.NEWER_FORMAT,
                 "pip install -U git+https://github.com/functree/functree")
    raises_named(lambda: ft.Exported.deserialize(with_header(in_keys=header["in_keys"][:-1])), ft.ExportError,
                 _export.DAMAGED, "arrays and their descriptions differ")
    raises_named(lambda: ft.Exported.deserialize(with_header(parameters=[["model", 9, False]])), ft.ExportError,
                 _export.DAMAGED, "no [name, kind, default]")
    broken = with_header()
    broken = broken[:start] + b"x" + broken[start + 1:]
    raises_named(lambda: ft.Exported.deserialize(broken), ft.ExportError, _export.DAMAGED, "no JSON")


def test_an_edited_header_is_refused_as_damage_not_run(exported_step):
    """The digest covered the program alone: the header's key names place the arrays, so two
    names swapped in out_keys swapped two results (in in_keys, two inputs of one shape) and a
    result's static field edited (an activation relu -> gelu, 1e-05 -> 1e-01) came back as written, silently;
    over every one-bit flip of a small export's header 7 of 1758 ran with other results.
    The header's digest (with the program's) is checked, and an entry renamed is damage."""
    data = exported_step.serialize()
    start = len(_export.MAGIC) + 8
    size = int.from_bytes(data[len(_export.MAGIC):start], "little")
    header, raw = json.loads(data[start:start + size]), data[start:start + size]

    def with_raw(raw):
        return _export.MAGIC + len(raw).to_bytes(8, "little") + raw + data[start + size:]

    keys = header["out_keys"]
    swapped = json.dumps({**header, "out_keys": [keys[1], keys[0], *keys[2:]]}).encode()
    relu = raw.rindex(b'"jax.nn.relu"')  # the result's Dense's activation (the argument's comes first)
    for edited in (swapped, raw[:relu] + b'"jax.nn.gelu"' + raw[relu + len(b'"jax.nn.relu"'):]):
        raises_named(lambda e=edited: ft.Exported.deserialize(with_raw(e)), ft.ExportError, _export.DAMAGED,
                     "the header's SHA-256 digest differs")
    raises_named(lambda: ft.Exported.deserialize(with_raw(raw.replace(b'"digest"', b'"digesu"'))), ft.ExportError,
                 _export.DAMAGED, "entries no functree writes: ['digesu']")
    assert ft.Exported.deserialize(with_raw(json.dumps(header, indent=1).encode())).name == "step"  # spaces: no damage
    older = {k: v for k, v in header.items() if k != "digest"}  # written before the header's digest: read
    assert ft.Exported.deserialize(with_raw(json.dumps(older).encode())).name == "step"


def test_an_array_the_tree_does_not_flatten_is_refused_not_baked_in(monkeypatch):
    keys_by_position = _export._keys_by_position
    monkeypatch.setattr(_export, "_keys_by_position", lambda *a: dict(list(keys_by_position(*a).items())[1:]))
    raises_named(lambda: ft.export(lambda model, x: model(x))(mlp(), X), ft.ExportError, _export.UNMATCHED,
                 "the arrays at model.layers.0.weight")
