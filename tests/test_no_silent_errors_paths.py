"""Issue 22's catalogue, key paths and start-up: each edge gives the right answer or a clear error.

Each test is named after the issue's item and shows the user's program that went wrong:
item 11, ``import functree`` started XLA's backend (``jax.distributed.initialize()`` then
raised, and ``XLA_FLAGS`` set after the import were ignored); item 12, ``ft.set`` wrote a
static field that ``ft.recursively_all_writable_key_paths`` lists as not writable.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from _devices import free_port, run

import functree as ft


def test_item11_import_functree_leaves_the_backend_unstarted_for_distributed_and_xla_flags():
    # Every module of the package is imported; then what a multi-host script and a notebook
    # do after their imports: set XLA_FLAGS (a device count), start jax.distributed.
    code = f"""
    import importlib, os, pkgutil
    import functree
    for module in pkgutil.walk_packages(functree.__path__, "functree."):
        if module.name != "functree.__main__":
            importlib.import_module(module.name)
    from jax._src import xla_bridge
    started = xla_bridge.backends_are_initialized()
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=3"
    jax.distributed.initialize("localhost:{free_port()}", num_processes=1, process_id=0)
    report({{"started": started, "devices": jax.device_count(), "processes": jax.process_count()}})
    """
    assert run(code, devices=1, timeout=120) == {"started": False, "devices": 3, "processes": 1}


class Dense(ft.Module):
    weight: jax.Array
    activation: str = ft.field(static=True, default="relu")


def test_item12_set_on_a_static_field_refuses_with_the_replace_fix():
    model = {"encoder": Dense(jnp.ones(2))}
    assert ft.key_path(model, "encoder.activation") not in ft.recursively_all_writable_key_paths(model)
    with pytest.raises(ValueError, match=r"static field") as info:
        ft.set(model, "encoder.activation", "tanh")  # was: a model with "tanh" there
    message = str(info.value)
    assert "ft.set(['encoder'].activation)" in message
    fix = """model = ft.set(model, "['encoder']", ft.get(model, "['encoder']").replace(activation=value))"""
    assert fix in message
    value = "tanh"
    model = eval(fix.removeprefix("model = "), {"ft": ft, "model": model, "value": value})
    assert model["encoder"].activation == "tanh"
    with pytest.raises(ValueError, match=r"model = model\.replace\(activation=value\)"):
        ft.set(Dense(jnp.ones(2)), ".activation", "tanh")
