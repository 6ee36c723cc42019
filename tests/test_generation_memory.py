"""generate's key-value cache checked against the memory of the devices the model lives on
(functree/generation/_memory.py), with devices whose ``memory_stats`` the test gives."""

import jax
import jax.numpy as jnp
import pytest

import functree as ft
from functree.generation import _memory
from functree.generation._memory import CacheTooLarge, checked_cache, least_available, model_devices


class Stats:
    """A device as ``available_bytes`` reads it: its ``memory_stats()`` (an accelerator's)."""

    platform = "gpu"

    def __init__(self, limit: int, used: int):
        self.limit, self.used = limit, used

    def memory_stats(self) -> dict[str, int]:
        return {"bytes_limit": self.limit, "bytes_in_use": self.used}


class Cached(ft.Module):
    """A model whose cache is ``rows x length`` float32 values (4 bytes each)."""

    w: jax.Array

    def __init__(self, w: jax.Array):
        self.w = w

    def init_cache(self, rows: int, length: int) -> jax.Array:
        return jnp.zeros((rows, length), jnp.float32)


def test_the_cache_is_checked_against_the_least_free_of_the_models_devices():
    """The check read jax.devices()[0]'s memory whatever the model's devices: a model on
    device 2 (or a mesh) with 500 free bytes there passed when device 0 had room. It reads
    the model's devices now, the least any has: 16 x 16 float32 (1024 bytes) does not fit
    beside 500 free, whatever the other device has; 24000 free on both, it does."""
    roomy, full = Stats(limit=32_000, used=8_000), Stats(limit=32_000, used=31_500)
    assert least_available([roomy, full]) == (500, "gpu device's memory (the least of the model's 2 devices)")
    assert least_available([roomy]) == (24_000, "gpu device's memory")
    model = Cached(jnp.ones(2))
    with pytest.raises(CacheTooLarge) as e:
        checked_cache(model, 16, 16, abstract=True, devices=[roomy, full])
    assert (e.value.need, e.value.available) == (16 * 16 * 4, 500)
    assert checked_cache(model, 16, 16, devices=[roomy, roomy]).shape == (16, 16)


def test_the_models_devices_are_its_arrays_or_the_default_device_under_a_trace(monkeypatch):
    """A concrete model's devices are its arrays'; a traced one's are unknown (the default
    device is read, as before, unless the caller passes them); checked_cache asks
    available_bytes about exactly those."""
    device = jax.devices()[0]
    model = jax.device_put(Cached(jnp.ones(2)), device)
    assert model_devices(model) == (device,)
    seen = []
    jax.jit(lambda m: seen.append(model_devices(m)) or m.w)(model)
    assert seen == [(device,)]  # the default device (this process has one; 8 in test_parallel_rules.py)
    asked = []
    monkeypatch.setattr(_memory, "available_bytes", lambda d: asked.append(d) or (10**9, "test's memory"))
    checked_cache(model, 2, 2, abstract=True)
    assert asked == [device]
