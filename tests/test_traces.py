"""functree/_traces.py: the current trace, a value's trace, and the transformation's name."""

import jax
import jax.numpy as jnp
import pytest

from functree._traces import current_trace, inner_trace, transform_name, under_transformation


def _seen(transform):
    """(whether under a transformation, the trace) seen inside ``transform``."""
    seen = []

    def probe(x):
        seen.append((under_transformation(), current_trace()))
        return x

    transform(probe)
    return seen[0]


@pytest.mark.parametrize("name, transform", [
    ("jax.vmap", lambda f: jax.vmap(f)(jnp.ones(2))),
    ("jax.jit", lambda f: jax.jit(f)(1.0)),
    ("jax.lax.scan (or jax.lax.map)", lambda f: jax.lax.scan(lambda c, x: (c, f(x)), 0.0, jnp.ones(2))),
    ("jax.lax.cond (or jax.lax.switch)", lambda f: jax.lax.cond(True, lambda: f(1.0), lambda: 1.0)),
    ("jax.lax.while_loop", lambda f: jax.lax.while_loop(lambda c: c < 1, lambda c: f(c) + 1, 0.0)),
    ("jax.checkpoint", lambda f: jax.checkpoint(f)(1.0)),
    ("jax.grad / jax.vjp / jax.linearize", lambda f: jax.grad(f)(1.0)),
    ("jax.jvp", lambda f: jax.jvp(f, (1.0,), (1.0,))),
])
def test_a_transformation_is_seen_and_named(name, transform):
    under, trace = _seen(transform)
    assert under and transform_name(trace) == name


def test_top_level_is_not_a_transformation():
    assert not under_transformation()


def test_inner_trace_finds_values_of_transformations_opened_inside_only():
    top, kept = current_trace(), []

    def keep(x):
        kept.append(x * 2)
        return x

    jax.vmap(keep)(jnp.ones(3))
    assert inner_trace([jnp.ones(2), 3.0], top) is None
    index, trace = inner_trace([jnp.ones(2), kept[0]], top)
    assert index == 1 and transform_name(trace) == "jax.vmap"

    def outer(x):  # values of the trace itself and of the traces around it are fine
        here = current_trace()
        y = x + 1
        inside = []
        jax.lax.scan(lambda c, z: (inside.append(z + c) or c, z), y, jnp.ones(2))
        assert inner_trace([x, y], here) is None
        assert inner_trace([y, inside[0]], here)[0] == 1
        return y

    jax.jit(jax.vmap(outer))(jnp.ones(2))
