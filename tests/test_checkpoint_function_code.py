"""functree/train/checkpoint/_function_code.py: a lambda's or a local function's code is part
of its stored name, so a template's other lambda is refused by key path (it replaced the saved
one silently: outputs 5.15 off), the same lambda (another object, a restarted process) loads,
and files without digests load by name as before; a source digest is compared across Python
versions (a 3.12 file's lambda replaced by another in a 3.11 template loaded silently)."""

from __future__ import annotations

import importlib.util
import json
import linecache
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
                                               r"\(code [0-9a-f]{12}, source [0-9a-f]{12}\), the template's "
                                               r"\S*<lambda> \(code"):
        ft.train.load(tmp_path / "m", _template(template))


def test_a_closure_over_another_value_is_refused(tmp_path):
    scaled = lambda s: (lambda v: v * s)  # noqa: E731
    _saved(tmp_path, scaled(2.0))
    with pytest.raises(TemplateMismatch, match=r"activation: saved .*<locals>.<lambda> \(code [0-9a-f]{12}, source "
                                               r"[0-9a-f]{12}\), the template's .*<locals>.<lambda> \(code "):
        ft.train.load(tmp_path / "m", _template(scaled(5.0)))
    ft.train.load(tmp_path / "m", _template(scaled(2.0)))  # the same value captured: loads


def test_a_closure_over_a_prng_key_saves_and_another_key_is_refused(tmp_path):
    # ft.train.save of a model whose activation closes over a typed key (a noise
    # activation) failed inside JAX ("PRNGKey dtype cannot be converted to a NumPy array"):
    # the digest read the key with np.asarray. A key is digested by its bits and impl.
    noisy = lambda key: (lambda v: v + 0.1 * jax.random.normal(key, v.shape))  # noqa: E731
    model = _saved(tmp_path, noisy(jax.random.key(0)))
    loaded = ft.train.load(tmp_path / "m", _template(noisy(jax.random.key(0))))
    np.testing.assert_array_equal(loaded(X), model(X))
    with pytest.raises(TemplateMismatch, match=r"activation: saved .*<locals>.<lambda> \(code "):
        ft.train.load(tmp_path / "m", _template(noisy(jax.random.key(1))))
    with pytest.raises(TemplateMismatch, match=r"activation: saved .*<locals>.<lambda> \(code "):
        ft.train.load(tmp_path / "m", _template(noisy(jax.random.key(0, impl="rbg"))))


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
    assert same("m.<lambda>@py311:aaa", "m.<lambda>@py312:bbb")  # another Python, no source digest: by name
    assert same("m.<lambda>", "m.<lambda>@py311:bbb")            # a file before digests
    assert not same("m.<lambda>", "n.<lambda>@py311:bbb")
    assert same("m.<lambda>@py311:aaa:sss", "m.<lambda>@py312:bbb:sss")      # another Python, the same source
    assert not same("m.<lambda>@py311:aaa:sss", "m.<lambda>@py312:bbb:ttt")  # another Python, other source
    assert not same("m.<lambda>@py311:aaa:sss", "m.<lambda>@py311:bbb:sss")  # one Python: bytecode compared
    assert not same("m.<lambda>@py311:aaa", "m.<lambda>@py311:bbb:sss")      # (a file before source digests)
    assert same("m.<lambda>@py311:aaa", "m.<lambda>@py311:aaa:sss")
    assert _function_code.shown("m.<lambda>@py311:abc") == "m.<lambda> (code abc)"
    assert _function_code.shown("m.<lambda>@py311:abc:def") == "m.<lambda> (code abc, source def)"
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


def _restamped(tmp_path, stored):
    """The saved file's activation name replaced by ``stored`` (resealed: as another Python
    would have written it)."""
    path = tmp_path / "m" / "meta" / "metadata"
    meta = json.loads(path.read_text())
    meta["spec"]["static"]["activation"]["function"] = stored
    meta["digest"] = metadata_digest(meta)
    path.write_text(json.dumps(meta))


def test_a_lambda_saved_under_another_python_is_compared_by_its_source(tmp_path):
    """A file written under another Python (other bytecode: its digest is not compared)
    still names the source's digest: a template's other lambda is refused, the same loads."""
    saved = lambda v: v * 2.0  # noqa: E731
    model = _saved(tmp_path, saved)
    base = _stored(tmp_path).partition("@")[0]
    source = _function_code.source_digest(saved)
    assert source is not None and _stored(tmp_path).endswith(f":{source}")
    _restamped(tmp_path, f"{base}@py399:000000000000:{source}")
    with pytest.raises(TemplateMismatch, match=rf"activation: saved \S*<lambda> \(code 000000000000, source "
                                               rf"{source}\), the template's \S*<lambda> \(code "):
        ft.train.load(tmp_path / "m", _template(lambda v: v * 5.0))
    loaded = ft.train.load(tmp_path / "m", _template(lambda v: (v * 2.0)))  # another layout: the same source
    np.testing.assert_array_equal(loaded(X), model(X))


def test_the_source_digest_is_of_each_lambda_exactly():
    """Several lambdas on one line, a lambda over lines and a lambda in a lambda each have
    their own text's digest; layout and comments are no part of it."""
    two = (lambda v: v * 2, lambda v: v * 5)
    over_lines = lambda v: (v  # noqa: E731
                            * 2)  # (a comment)
    outer = lambda v: (lambda v: v * 5)  # noqa: E731
    digest = _function_code.source_digest
    assert None not in {digest(two[0]), digest(two[1]), digest(outer), digest(outer(0))}
    assert digest(two[0]) != digest(two[1])
    assert digest(two[0]) == digest(over_lines)
    assert digest(outer(0)) == digest(two[1]) != digest(outer)
    table = {"scale": 2.0}
    reads = lambda v: v * table["scale"]  # noqa: E731  (a captured dict: its items)
    assert digest(reads) is not None and _function_code.code_digest(reads) is not None


def test_a_renamed_parameter_is_the_same_function_and_a_keyword_only_one_is_not():
    """Renaming a positional parameter changes neither bytecode nor what is computed: the
    same source digest (loads as the saved function); a global read instead of the parameter,
    or a keyword-only parameter (callers pass it by name) renamed, is another function."""
    digest = _function_code.source_digest
    x = 3.0
    by_v, by_x, reads_x = (lambda v: v * 2), (lambda x: x * 2), (lambda v: x * 2)
    two = (lambda a, b: a - b, lambda b, a: b - a, lambda a, b: b - a)
    assert None not in {digest(by_v), digest(reads_x), *map(digest, two)}
    assert digest(by_v) == digest(by_x) != digest(reads_x)
    assert digest(two[0]) == digest(two[1]) != digest(two[2])
    assert digest(lambda v, *, s: v * s) != digest(lambda v, *, t: v * t)


def test_a_function_made_by_exec_has_a_source_digest_only_where_linecache_holds_its_text():
    """A string run by ``exec`` has no file: the bytecode digest alone, as before. A notebook
    cell's text is in ``linecache`` (IPython puts it there): it has its source digest."""
    text = "act = lambda v: v * 2\n"
    scope: dict = {}
    exec(compile(text, "<string>", "exec"), scope)
    assert _function_code.source_digest(scope["act"]) is None
    assert _function_code.with_code(scope["act"], "m.<lambda>").count(":") == 1
    cell = "<ipython-input-7-0123456789ab>"
    linecache.cache[cell] = (len(text), None, text.splitlines(True), cell)
    try:
        exec(compile(text, cell, "exec"), scope)
        assert _function_code.source_digest(scope["act"]) == _function_code.source_digest(lambda v: v * 2)
    finally:
        del linecache.cache[cell]


def test_a_function_whose_file_was_edited_since_has_no_source_digest(tmp_path):
    """The file's text is no longer what the function runs: its digest would name other
    code (``v + 20.0`` for ``v * 2``), so there is none."""
    file = tmp_path / "edited_module.py"
    file.write_text("def make():\n    def act(v):\n        return v * 2\n    return act\n")
    spec = importlib.util.spec_from_file_location("edited_module", file)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    act = module.make()
    assert _function_code.source_digest(act) is not None
    file.write_text("def make():\n    def act(v):\n        return v + 20.0\n    return act\n")
    linecache.checkcache(str(file))
    assert _function_code.source_digest(act) is None
