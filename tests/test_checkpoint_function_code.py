"""functree/train/checkpoint/_function_code.py: a lambda's or a local function's code is part
of its stored name, so a template's other lambda is refused by key path (it replaced the saved
one silently: outputs 5.15 off), the same lambda (another object, a restarted process) loads,
and files without digests or of another Python version load by name as before."""

from __future__ import annotations

import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import functree as ft
from functree.train.checkpoint import _function_code
from functree.train.checkpoint._checkpoint import metadata_digest
from functree.train.checkpoint._template import TemplateMismatch

X = jnp.linspace(-2.0, 2.0, 8).reshape(2, 4)


def _saved(tmp_path, activation):
    model = ft.nn.Dense(4, 3, activation, key=jax.random.key(0))
    ft.train.save(tmp_path / "m", model)
    return model


def _stored(tmp_path):
    with open(tmp_path / "m" / "meta" / "metadata") as f:
        return json.load(f)["spec"]["static"]["activation"]["function"]


def _template(activation):
    return ft.nn.Dense(4, 3, activation, key=jax.random.key(1))


def test_the_same_lambda_written_again_loads_with_the_saved_weights(tmp_path):
    model = _saved(tmp_path, lambda v: v * 2.0)
    assert "<lambda>@py" in _stored(tmp_path)
    loaded = ft.train.load(tmp_path / "m", _template(lambda v: v * 2.0))  # another object, the same code
    np.testing.assert_array_equal(loaded(X), model(X))


@pytest.mark.parametrize("saved, template", [
    (lambda v: v * 2.0, lambda v: jnp.tanh(v)),   # other code
    (lambda v: v * 2.0, lambda v: v * 5.0),       # another constant
], ids=["code", "constant"])
def test_another_lambda_in_the_template_is_refused_naming_the_field(tmp_path, saved, template):
    _saved(tmp_path, saved)
    with pytest.raises(TemplateMismatch, match=r"(?s)other static configuration.*activation: saved \S*<lambda> "
                                               r"\(code [0-9a-f]{12}\), the template's \S*<lambda> \(code"):
        ft.train.load(tmp_path / "m", _template(template))


def test_a_closure_over_another_value_is_refused(tmp_path):
    scaled = lambda s: (lambda v: v * s)  # noqa: E731
    _saved(tmp_path, scaled(2.0))
    with pytest.raises(TemplateMismatch, match=r"activation: saved .*<locals>.<lambda> \(code [0-9a-f]{12}\), the "
                                               r"template's .*<locals>.<lambda> \(code [0-9a-f]{12}\)"):
        ft.train.load(tmp_path / "m", _template(scaled(5.0)))
    ft.train.load(tmp_path / "m", _template(scaled(2.0)))  # the same value captured: loads


@pytest.mark.parametrize("stored", ["{base}", "{base}@py27:000000000000"], ids=["before-digests", "other-python"])
def test_a_name_without_a_digest_or_of_another_python_loads_by_name(tmp_path, stored):
    """A file written before digests, or by another Python (other bytecode for the same
    source): the name alone decides, as it did."""
    model = _saved(tmp_path, lambda v: v * 2.0)
    path = tmp_path / "m" / "meta" / "metadata"
    meta = json.loads(path.read_text())
    base = meta["spec"]["static"]["activation"]["function"].partition("@")[0]
    meta["spec"]["static"]["activation"]["function"] = stored.format(base=base)
    meta["digest"] = metadata_digest(meta)  # (resealed: the file as that writer wrote it)
    path.write_text(json.dumps(meta))
    loaded = ft.train.load(tmp_path / "m", _template(lambda v: v * 3.0))
    np.testing.assert_array_equal(loaded.weight, model.weight)


def test_the_digest_is_the_same_in_a_fresh_process():
    """A restarted process computes the same digest for the same source (no addresses, no
    file names or line numbers in it)."""
    source = "from functree.train.checkpoint._function_code import code_digest\n" \
             "print(code_digest((lambda s: (lambda v: v * s + len('ab')))(3.0)))"
    runs = {subprocess.run([sys.executable, "-c", source], capture_output=True, text=True, check=True).stdout.strip()
            for _ in range(2)}
    assert len(runs) == 1
    assert runs == {_function_code.code_digest((lambda s: (lambda v: v * s + len('ab')))(3.0))}


def test_same_function_and_shown():
    same = _function_code.same_function
    assert same("m.<lambda>@py311:aaa", "m.<lambda>@py311:aaa")
    assert not same("m.<lambda>@py311:aaa", "m.<lambda>@py311:bbb")
    assert same("m.<lambda>@py311:aaa", "m.<lambda>@py312:bbb")  # another Python: by name
    assert same("m.<lambda>", "m.<lambda>@py311:bbb")            # a file before digests
    assert not same("m.<lambda>", "n.<lambda>@py311:bbb")
    assert _function_code.shown("m.<lambda>@py311:abc") == "m.<lambda> (code abc)"
    assert _function_code.with_code(jnp.tanh, "jax.numpy.tanh") == "jax.numpy.tanh"  # a named function: its name


def test_a_local_function_that_calls_itself_and_a_list_holding_itself_have_digests():
    def make(n):
        def countdown(v, k=n):
            return v if k == 0 else countdown(v * 0.5, k - 1)
        return countdown

    looped: list = [1.0]
    looped.append(looped)
    assert _function_code.code_digest(make(2)) != _function_code.code_digest(make(3))
    assert _function_code.code_digest(make(2)) == _function_code.code_digest(make(2))
    assert _function_code.code_digest(lambda v: v * looped[0]) is not None
