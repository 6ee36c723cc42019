"""functree/_compat.py: the one reader of JAX internals, for every form in the declared range."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import functree as ft
from functree import _compat as compat


def _eqn(f, *args, name):
    closed = jax.make_jaxpr(f)(*args)
    names = {name, "pjit"} if name == "jit" else {name}  # jit's primitive was "pjit" before 0.7
    (eqn,) = [e for e in closed.jaxpr.eqns if e.primitive.name in names]
    return eqn


class _FlatTree:
    """The jax 0.11 form of scan's ``ft_in``: a tuple-like tree of (consts, carry, xs)."""

    def __init__(self, *parts):
        self.parts = parts

    def unpack(self):
        return self.parts


def test_scan_counts_read_this_jax_s_scan():
    c = jnp.ones(2)
    eqn = _eqn(lambda carry, xs: jax.lax.scan(lambda k, x: (k + x * c, k), carry, xs),
               jnp.zeros(2), jnp.ones((3, 2)), name="scan")
    consts, carry = compat.scan_counts(eqn.params)
    assert carry == 1
    assert consts + carry + 1 == len(eqn.invars)


def test_scan_counts_read_the_jax_0_11_form():
    params = {"ft_in": _FlatTree([None] * 2, [None] * 3, [None]), "length": 4, "jaxpr": None}
    assert compat.scan_counts(params) == (2, 3)
    assert compat.scan_counts({"num_consts": 1, "num_carry": 0}) == (1, 0)


def test_an_unknown_form_names_the_primitive_and_the_jax_version():
    with pytest.raises(compat.UnsupportedJaxError, match=r"scan equation .*" + jax.__version__):
        compat.scan_counts({"length": 3})
    with pytest.raises(compat.UnsupportedJaxError, match="while equation"):
        compat.while_counts({"body_jaxpr": None})


def test_while_counts_and_call_bodies():
    k = jnp.float32(3.0)
    eqn = _eqn(lambda x: jax.lax.while_loop(lambda v: v < k, lambda v: v + 1.0, x), 0.0, name="while")
    cond_n, body_n = compat.while_counts(eqn.params)
    assert cond_n + body_n + 1 == len(eqn.invars)
    call = _eqn(lambda x: jax.jit(jnp.sin)(x), 1.0, name="jit")
    jaxpr, _ = compat.body_of_call(call)
    assert [e.primitive.name for e in jaxpr.eqns] == ["sin"]
    assert compat.body_of_call(_eqn(jnp.sin, 1.0, name="sin")) is None


def test_bind_runs_an_equation_on_concrete_inputs():
    eqn = _eqn(lambda x, y: x * y, 2.0, 3.0, name="mul")
    assert float(compat.bind_eqn(eqn, [jnp.float32(2.0), jnp.float32(5.0)])[0]) == 10.0


def test_jax_version_is_integers():
    v = compat.jax_version()
    assert len(v) == 3 and all(isinstance(p, int) for p in v)
    assert v >= (0, 9, 2), "below the declared floor (pyproject.toml: jax>=0.9.2)"


def test_weakly_typed_promotes_as_a_python_number_and_keeps_values():
    # (the checkpoint reader's: a restored jnp.asarray(0.5) must not turn bfloat16 * it into float32)
    x = compat.weakly_typed(jnp.asarray([0.5, -2.0], jnp.float32))
    assert x.weak_type and x.dtype == jnp.float32
    np.testing.assert_array_equal(x, [0.5, -2.0])
    assert (jnp.ones(2, jnp.bfloat16) * x).dtype == jnp.bfloat16


def test_nan_provenance_and_diagnostics_enter_a_scan():
    """Every ft.nn.Stack model is a lax.scan: both walks must read it (jax 0.11 broke this)."""

    def loss(w):
        def body(c, x):
            return c + jnp.log(x * w), None
        return jax.lax.scan(body, 0.0, jnp.array([1.0, -1.0, 2.0]))[0]

    report = ft.diagnose(loss, at=jnp.float32(1.0), nan=True)
    assert not report.ok
    assert "scan iteration 1 of 3" in str(report)
