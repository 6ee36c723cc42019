"""Host copies of loaded tensors (functree/interop/_host.py): the blocked copy of a transposed view,
XLA's host transpose and the copies cut into pieces on threads write exactly what NumPy's plain
assignment writes, for every layout and cast, into aligned memory the CPU device takes as it is."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from functree.interop import _host
from functree.interop._host import ALIGNMENT, BLOCK, copied, copy_all, copy_into, empty

RNG = np.random.default_rng(0)
MATRIX = RNG.normal(size=(3 * BLOCK + 5, 2 * BLOCK + 7))


@pytest.mark.parametrize("view", ["transposed", "plain", "reversed", "sliced", "narrow", "3-d", "broadcast"])
@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16, np.float64])
def test_the_copy_equals_numpys(view, dtype):
    source = {"transposed": MATRIX.T, "plain": MATRIX, "reversed": MATRIX.T[::-1, ::-1], "sliced": MATRIX.T[::2, 1:],
              "narrow": MATRIX[:, :3].T, "3-d": MATRIX[:-5].reshape(3, BLOCK, -1).transpose(2, 1, 0),
              "broadcast": np.broadcast_to(MATRIX[0], (BLOCK + 9, MATRIX.shape[1])).T}[view]
    out = copied(source, dtype)
    assert out.dtype == np.dtype(dtype) and out.flags.c_contiguous and out.shape == source.shape
    np.testing.assert_array_equal(out, source.astype(dtype))
    assert not np.shares_memory(out, MATRIX)
    into = np.zeros((2, *source.shape), dtype)
    copy_into(into[1], source)
    np.testing.assert_array_equal(into[1], source.astype(dtype))
    assert not into[0].any()


@pytest.mark.parametrize("shape", [(0,), (3,), (5, 7), (33, 2, 3), (1000, 130)])
@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16, np.int8, np.float64])
def test_empty_is_aligned_for_the_device(shape, dtype):
    a = empty(shape, dtype)
    assert a.shape == shape and a.dtype == np.dtype(dtype) and a.flags.c_contiguous and a.flags.writeable
    assert a.ctypes.data % ALIGNMENT == 0 or a.size == 0  # (NumPy's empty slice points anywhere: nothing to alias)


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_a_copy_becomes_the_device_buffer_without_a_second_copy(dtype):
    """An aligned copy is the CPU device's buffer (NumPy's 16-byte aligned memory was copied
    again by device_put)."""
    for shape in [(700, 300), (4, 5), (64, 64, 3)]:
        host = copied(RNG.normal(size=shape).T, dtype)
        device = jax.device_put(host, may_alias=True)
        assert device.unsafe_buffer_pointer() == host.ctypes.data
        np.testing.assert_array_equal(np.asarray(device), host)


def copies_of(dtype):
    """A load's copies: transposed matrices of the same dtype (XLA's host transpose) and cast
    (blocks), plain, 3-D, small and broadcast ones, into slices of one stacked array and
    arrays of their own."""
    big = RNG.normal(size=(700, 3 * BLOCK + 1)).astype(dtype)
    sources = [big.T, big, RNG.normal(size=(300, 200)).T, MATRIX[:-5].reshape(3, BLOCK, -1).transpose(2, 1, 0),
               MATRIX[:4, :3].T, np.broadcast_to(MATRIX[0], (BLOCK + 9, MATRIX.shape[1])).T]
    stacked = np.zeros((2, *big.T.shape), dtype)
    outs = [stacked[0], stacked[1]] + [np.zeros(s.shape, dtype) for s in sources[1:]]
    return list(zip(outs, [big.T, *sources])), stacked


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
def test_copy_all_on_threads_equals_one_copy_after_another(dtype, monkeypatch):
    """Cut into pieces on four threads (the bound lowered so that these small copies are
    cut too), the copies write exactly what NumPy's assignments write."""
    monkeypatch.setattr(_host, "PIECE", 4096)
    monkeypatch.setattr(_host, "PARALLEL", 0)
    monkeypatch.setattr(_host, "_cores", lambda: 4)
    copies, stacked = copies_of(dtype)
    assert len([p for out, value in copies for p in _host._pieces(out, value)]) > 3 * len(copies)
    copy_all(copies)
    for out, value in copies:
        np.testing.assert_array_equal(out, value.astype(dtype))
    assert not np.shares_memory(stacked, MATRIX)


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16, np.float16, np.int32])
def test_the_host_transpose_equals_numpys_blocks_and_compiles_nothing(dtype, monkeypatch):
    """XLA's host transpose (a strided device_put: no program compiled) writes what the
    blocked NumPy copy writes, bit for bit; without a CPU device the blocks are used."""
    from _compiles import compiled

    source = (RNG.normal(size=(3 * BLOCK + 5, 2 * BLOCK + 7)) * 100).astype(dtype)
    fast = np.zeros(source.T.shape, dtype)
    with compiled() as names:
        copy_into(fast, source.T)
    assert names == []
    monkeypatch.setattr(_host, "_cpu", lambda: None)
    blocks = np.zeros(source.T.shape, dtype)
    copy_into(blocks, source.T)
    np.testing.assert_array_equal(fast, blocks)
    np.testing.assert_array_equal(fast, source.T)
    assert not np.shares_memory(fast, source)
