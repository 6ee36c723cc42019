"""Host copies of loaded tensors (functree/interop/_host.py): the blocked copy of a transposed view
writes exactly what NumPy's plain assignment writes, for every layout and cast."""

import jax.numpy as jnp
import numpy as np
import pytest

from functree.interop._host import BLOCK, copied, copy_into

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
