"""Several processes: each its share of every batch (batches(shard=)), one global step.

The two-process tests (a DataParallelStep and a Trainer fit on a 4-device mesh over 2
processes, ``jax.distributed`` with gloo collectives on CPU, 2 simulated devices each) run
in tests/test_train_processes.py's two worker processes, with that file's other 2-process
claims: one start-up and one ``jax.distributed`` rendezvous for all of them.
"""

import jax
import numpy as np
import pytest

import functree as ft


def data():
    rng = np.random.default_rng(1)
    return rng.normal(size=(256, 16)).astype(np.float32), rng.integers(0, 4, 256).astype(np.int32)


def test_shares_concatenate_to_the_same_shuffled_batches():
    x, y = data()
    whole = list(ft.train.batches((x, y), 32, key=jax.random.key(3)))
    shares = [list(ft.train.batches((x, y), 32, key=jax.random.key(3), shard=(i, 4))) for i in range(4)]
    assert len(whole) == 8 and all(len(s) == 8 for s in shares)
    for b, parts in zip(whole, zip(*shares)):
        assert all(p[0].shape == (8, 16) for p in parts)
        np.testing.assert_array_equal(np.concatenate([p[0] for p in parts]), b[0])
        np.testing.assert_array_equal(np.concatenate([p[1] for p in parts]), b[1])
    unshuffled = ft.train.batches(np.arange(12), 6, shuffle=False, shard=(1, 3))
    assert [b.tolist() for b in unshuffled] == [[2, 3], [8, 9]]


def test_bad_shard_and_indivisible_minibatch():
    with pytest.raises(ValueError, match=r"got shard=\(2, 2\)"):
        ft.train.batches(np.arange(8), 4, shard=(2, 2))
    data = ft.train.batches(np.arange(10), 4, shuffle=False, shard=(0, 2))
    with pytest.raises(ValueError, match="a minibatch of 2 examples does not split evenly into 4 shares "
                                         r"\(use a batch size that is a multiple of 4, and drop_last=True\)"):
        list(ft.train.batches(np.arange(10), 4, shuffle=False, shard=(0, 4)))
    assert [b.tolist() for b in data] == [[0, 1], [4, 5], [8]]  # the last minibatch has 2: one each
    assert [b.tolist() for b in ft.train.batches(np.arange(10), 4, shuffle=False, shard=(1, 2))] == [
        [2, 3], [6, 7], [9]]
