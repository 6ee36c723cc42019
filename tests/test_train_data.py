"""ft.train.batches: coverage of every example, reproducible shuffles, functional sizes."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import functree as ft
from functree.train._data import DataContext, to_arrays


def test_every_example_once_per_epoch_and_epochs_differ():
    x = np.arange(10)
    data = ft.train.batches({"x": x, "y": x * 2}, 3, key=jax.random.key(1))
    first = [b for b in data]
    second = [b for b in data]
    assert [len(b["x"]) for b in first] == [3, 3, 3, 1] and len(data) == 4
    for epoch in (first, second):
        seen = np.concatenate([b["x"] for b in epoch])
        assert sorted(seen.tolist()) == list(range(10))
        for b in epoch:
            np.testing.assert_array_equal(b["y"], b["x"] * 2)
    assert np.concatenate([b["x"] for b in first]).tolist() != np.concatenate(
        [b["x"] for b in second]
    ).tolist()


def test_epochs_are_reproducible_and_resumable():
    x = np.arange(20.0)
    a = ft.train.batches(x, 4, key=jax.random.key(5))
    b = ft.train.batches(x, 4, key=jax.random.key(5))
    full = list(a.iterate(3))
    resumed = list(b.iterate(3, start=2))
    assert len(resumed) == 3
    for u, v in zip(full[2:], resumed):
        np.testing.assert_array_equal(u, v)


@pytest.mark.parametrize("key", [jax.random.key(5), jax.random.PRNGKey(5)], ids=["typed key", "raw key"])
def test_each_epochs_order_is_the_documented_permutation_in_one_dispatch(key):
    # epoch e is ordered by jax.random.permutation(fold_in(key, e), n), as documented; it is
    # computed by one jitted program (compiled once for every epoch), not a dozen eager ops.
    from functree.train._data import _permutation

    x = np.arange(23)
    data = ft.train.batches(x, 5, key=key)
    compiled = _permutation._cache_size()
    for epoch in range(4):
        order = np.concatenate(list(data))
        expected = np.asarray(jax.random.permutation(jax.random.fold_in(key, epoch), 23))
        np.testing.assert_array_equal(order, x[expected])
    assert _permutation._cache_size() <= compiled + 1


def test_no_shuffle_keeps_order_and_drop_last():
    x = np.arange(7)
    data = ft.train.batches(x, 3, shuffle=False, drop_last=True)
    assert [b.tolist() for b in data] == [[0, 1, 2], [3, 4, 5]]
    assert len(data) == 2


def test_cpu_jax_arrays_are_sliced_on_the_host():
    x = jnp.arange(8.0)
    batch = next(iter(ft.train.batches(x, 4, key=jax.random.key(0))))
    on_cpu = jax.devices()[0].platform == "cpu"
    assert isinstance(batch, np.ndarray if on_cpu else jax.Array) and batch.shape == (4,)


@pytest.mark.parametrize("shuffle", [True, False], ids=["shuffled", "in order"])
def test_minibatches_of_device_arrays_take_no_host_value_per_step(monkeypatch, shuffle):
    # On an accelerator, jax arrays stay there (this CPU test keeps them as jax arrays as an
    # accelerator does): each minibatch is one gather from a start put on the device once
    # per epoch, no Python int sent with every minibatch, and nothing compiles after the
    # first (same size); the rows are the documented ones, a shorter last minibatch too.
    from _compiles import compiled

    import functree.train._data as data_module

    monkeypatch.setattr(data_module, "_host_if_cpu", lambda x: x)
    x = jnp.arange(26.0).reshape(13, 2)
    data = ft.train.batches({"x": x, "i": jnp.arange(13)}, 3, shuffle=shuffle, key=jax.random.key(4))
    minibatches = data.iterate(1)
    got = [next(minibatches), next(minibatches)]  # the epoch's order and starts, and the compile
    with compiled(clear=False) as names, jax.transfer_guard("disallow"):
        got += [next(minibatches), next(minibatches)]
    assert names == []
    got += list(minibatches)  # its last minibatch, of 1 row
    order = np.asarray(jax.random.permutation(jax.random.fold_in(jax.random.key(4), 1), 13)) if shuffle \
        else np.arange(13)
    assert [len(b["i"]) for b in got] == [3, 3, 3, 3, 1]
    np.testing.assert_array_equal(np.concatenate([b["i"] for b in got]), order)
    for b in got:
        assert isinstance(b["x"], jax.Array)
        np.testing.assert_array_equal(b["x"], np.asarray(x)[np.asarray(b["i"])])


def test_functional_batch_size_sees_the_context():
    seen = []

    def size(ctx):
        seen.append(ctx)
        return 2 if ctx.sweep == 0 else 5

    data = ft.train.batches(np.arange(10), size, shuffle=False)
    assert [len(b) for b in data] == [2, 2, 2, 2, 2]
    assert [len(b) for b in data] == [5, 5]
    assert seen[:2] == [DataContext(0, 0, 0), DataContext(1, 0, 2)]
    assert DataContext(5, 1, 10) in seen
    with pytest.raises(TypeError, match=r"functional batch size"):
        len(data)


def test_bad_inputs_name_the_problem():
    with pytest.raises(ValueError, match=r"but x has 5 and y has 4"):
        ft.train.batches({"x": np.zeros(5), "y": np.zeros(4)}, 2)
    with pytest.raises(ValueError, match=r"positive int, got 0"):
        ft.train.batches(np.zeros(5), 0)
    with pytest.raises(ValueError, match=r"positive int, got -1 from batch_size\(DataContext"):
        list(ft.train.batches(np.zeros(5), lambda c: -1))
    with pytest.raises(ValueError, match=r"leading .example. axis"):
        ft.train.batches([], 2)


@pytest.mark.parametrize("size", [0, -3, 2.5, True])
def test_bad_batch_size_in_batches_and_in_fit(size):
    with pytest.raises(ValueError, match=rf"(?s)positive int, got {size!r}.*batch_size={size!r}"):
        ft.train.batches(np.zeros((5, 1), np.float32), batch_size=size)
    trainer = ft.train.Trainer(ft.nn.Dense(1, 1, key=jax.random.key(0)),
                               ft.optim.Optimizer(ft.optim.sgd(0.1)),
                               lambda m, b: jnp.mean(m(b[0]) ** 2))
    x = np.zeros((5, 1), np.float32)
    with pytest.raises(ValueError, match=rf"(?s)positive int, got {size!r}.*batch_size={size!r}"):
        trainer.fit((x, x), epochs=1, batch_size=size, progress=False)  # was: silently 32
    assert trainer.steps_run == 0


class FakeTensor:
    """Stands in for a torch tensor: detach().cpu().numpy()."""

    def __init__(self, value):
        self.value = np.asarray(value)

    def detach(self):
        return self

    def cpu(self):
        return self

    def numpy(self):
        return self.value


def test_to_arrays_converts_foreign_tensors():
    batch = to_arrays((FakeTensor([1.0, 2.0]), [FakeTensor([3])]))
    assert isinstance(batch[0], np.ndarray) and isinstance(batch[1], list)
    np.testing.assert_array_equal(batch[1][0], [3])


def test_torch_bfloat16_tensors_become_bfloat16_arrays():
    """torch refuses .numpy() for bfloat16 ("Got unsupported ScalarType BFloat16"): a bf16
    DataLoader crashed inside torch. Its bits are read as ml_dtypes' bfloat16, exactly."""
    torch = pytest.importorskip("torch")
    values = torch.tensor([[1.5, -2.25], [3.0e-3, 65280.0]], dtype=torch.bfloat16)
    batch = to_arrays({"x": values, "y": torch.tensor([1, 0])})
    assert batch["x"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(batch["x"].astype(np.float32), values.float().numpy())
    assert batch["y"].dtype == np.int64


def test_in_order_reads_every_example_once_unshuffled(key):
    data = ft.train.batches(np.arange(7), 3, key=key, drop_last=True)
    assert [b.tolist() for b in data.in_order()] == [[0, 1, 2], [3, 4, 5], [6]]
    assert sorted(np.concatenate(list(data.iterate(0))).tolist()) != list(range(7))  # drop_last: 6 of 7


@pytest.mark.parametrize("key", [0, 7, 1.5, "seed"])
def test_a_key_that_is_no_prng_key_is_refused_at_the_call(key):
    """key=0 built, then failed at the first epoch inside JAX ('invalid PRNG key data')."""
    seed = key if isinstance(key, int) else 0
    right = rf"right:  {{call}}\(\.\.\., key=jax\.random\.key\({seed}\)\)"
    with pytest.raises(TypeError, match=right.format(call=r"ft\.train\.batches")):
        ft.train.batches(np.arange(10.0), 4, key=key)
    with pytest.raises(TypeError, match=right.format(call=r"ft\.train\.Trainer")):
        ft.train.Trainer({"w": jnp.ones(())}, ft.optim.sgd(0.1), lambda m, b: m["w"] * b.sum(), key=key)
    assert len(ft.train.batches(np.arange(10.0), 4, key=jax.random.PRNGKey(0))) == 3  # raw key data too



def test_several_keys_are_refused_at_the_call_naming_one_of_them():
    """key=jax.random.split(key) (not its first key) passed the key check and failed at the
    first epoch inside JAX's fold_in ('accepts a single key'), away from the call."""
    for keys, what in ((jax.random.split(jax.random.key(0)), r"a key array of shape \(2,\)"),
                       (jax.random.split(jax.random.PRNGKey(0), 3), r"raw uint32 key data of shape \(3, 2\)")):
        n = len(keys)
        for call, make in (("ft.train.batches", lambda k: ft.train.batches(np.arange(10.0), 4, key=k)),
                           ("ft.train.Trainer", lambda k: ft.train.Trainer(
                               {"w": jnp.ones(())}, ft.optim.sgd(0.1), lambda m, b: m["w"] * b.sum(), key=k))):
            with pytest.raises(ValueError, match=rf"(?s)^{re.escape(call)}: key= is one JAX PRNG key, but it got "
                                                 rf"{n} keys \({what}.*right:  {re.escape(call)}\(\.\.\., "
                                                 rf"key=jax\.random\.split\(key, {n}\)\[0\]\)"):
                make(keys)
    assert len(ft.train.batches(np.arange(10.0), 4, key=jax.random.split(jax.random.key(0))[0])) == 3

def test_a_leaf_without_an_example_axis_is_named_by_its_key_path():
    """Was: "needs arrays with a leading (example) axis, got (array([[0., 0.], ..." (the
    tree's repr cut at 80 characters, the 0-d leaf not in it)."""
    x = np.zeros((5, 2), np.float32)
    with pytest.raises(ValueError, match=r"but leaf 1 is a 0-d float32 array, with no such axis"):
        ft.train.batches((x, np.float32(1)), 2)
    with pytest.raises(ValueError, match=r"leaf b\.0\.0 is the int 1, with no such axis: a list of numbers of "
                                         r"unequal lengths \(ragged\)"):
        ft.train.batches({"a": x[:2], "b": [[1, 2], [3]]}, 2)


def test_a_length_mismatch_names_the_leaf_past_a_none():
    """None is no leaf: the mismatch named the None's key (b), not the leaf of 4 rows (c)."""
    with pytest.raises(ValueError, match=r"but a has 5 and c has 4\."):
        ft.train.batches({"a": np.zeros(5), "b": None, "c": np.zeros(4)}, 2)


BIG = np.array([3, 2**31 + 5, 7, 1], np.int64)  # JAX without x64 holds it as int32: -2**31 + 5


def test_int64_values_past_int32_are_refused_not_wrapped():
    """The step got 2**31 + 5 as -2147483643 (JAX's int64 -> int32 without x64), silently."""
    x = np.zeros((4, 2), np.float32)
    wrapped = r"leaf 1 holds int64 values outside the int32 range .* \(2147483653 at index 1\): .*to -2147483643"
    with pytest.raises(ValueError, match=r"ft\.train\.batches: " + wrapped):
        ft.train.batches((x, BIG), 2)
    with pytest.raises(ValueError, match=r"\(ft\.train\.to_arrays, .*\): " + wrapped):
        to_arrays((x, BIG))  # a loader's minibatch, as the Trainer reads each one
    with pytest.raises(ValueError, match=r"leaf y holds uint64 values outside the uint32 range .*\(1, 0\)"):
        to_arrays({"x": x, "y": np.array([[1], [2**32]], np.uint64)})
    assert to_arrays((x, BIG % 2**31))[1].dtype == np.int64  # in range: kept as it is
    with jax.enable_x64(True):
        assert ft.train.batches((x, BIG), 2).num_examples == 4  # JAX keeps int64
    trainer = ft.train.Trainer({"w": jnp.zeros(())}, ft.optim.sgd(0.1), lambda m, b: m["w"] * 0.0)
    with pytest.raises(ValueError, match=r"leaf 1 holds int64"):
        trainer.fit([(x, BIG)], epochs=1, progress=False)
    assert trainer.steps_run == 0


def test_torch_int64_labels_past_int32_are_refused():
    torch = pytest.importorskip("torch")
    labels = torch.tensor(BIG)
    with pytest.raises(ValueError, match=r"leaf 1 holds int64 .*\(2147483653 at index 1\)"):
        ft.train.batches((torch.zeros(4, 2), labels), 2)
    with pytest.raises(ValueError, match=r"leaf 1 holds int64"):
        to_arrays([torch.zeros(4, 2), labels])  # a DataLoader's minibatch


def test_a_shard_that_cannot_split_the_last_minibatch_is_refused_at_the_call():
    """Was raised at the epoch's last minibatch, after its other steps had run."""
    with pytest.raises(ValueError, match=r"a minibatch of 4 examples does not split evenly into 8 shares .*"
                                         r"it is the last minibatch of each epoch \(100 examples in minibatches of 32\)"):
        ft.train.batches(np.arange(100), 32, shard=(0, 8))
    with pytest.raises(ValueError, match=r"a minibatch of 32 examples does not split evenly into 3 shares"):
        ft.train.batches(np.arange(96), 32, shard=(1, 3))
    data = ft.train.batches(np.arange(100), 32, shard=(7, 8), drop_last=True, shuffle=False)
    assert [b.tolist() for b in data] == [[28, 29, 30, 31], [60, 61, 62, 63], [92, 93, 94, 95]]


def test_stack_batches_refuses_a_promotion_that_changes_values_or_kind():
    """np.stack made int64 beside uint64 float64 (2**60 + 1 became 2**60) and a bool mask
    beside int32 an int32 array, silently."""
    with pytest.raises(ValueError, match=r"leaf \[1\] has dtype int64 in minibatch 0 and uint64 in "
                                         r"minibatch 1: stacked, both would become float64, changing values"):
        ft.train.stack_batches([(np.zeros(2), np.full(2, 2**60 + 1)), (np.zeros(2), np.ones(2, np.uint64))])
    with pytest.raises(ValueError, match=r"leaf \['mask'\] has dtype bool in minibatch 0 and int32 in minibatch 2"):
        ft.train.stack_batches([{"mask": np.ones(2, bool)}] * 2 + [{"mask": np.ones(2, np.int32)}])
    wide = ft.train.stack_batches([np.ones(2, np.float32), np.ones(2, np.float64)])  # widened: values kept
    assert wide.dtype == np.float64 and wide.shape == (2, 2)


def test_a_mapping_that_jax_takes_for_a_leaf_is_read_as_a_dict():
    """Hugging Face's BatchEncoding (a UserDict: a tokenizer's or collator's output) was one
    leaf to JAX: its tensors were left unconverted and the step failed inside jit ("Error
    interpreting argument ... of type BatchEncoding")."""
    from collections import UserDict

    batch = to_arrays(UserDict({"ids": FakeTensor([[1, 2], [3, 4]]), "labels": np.arange(2)}))
    assert type(batch) is dict and isinstance(batch["ids"], np.ndarray)
    data = ft.train.batches(UserDict({"ids": np.arange(10).reshape(5, 2), "labels": np.arange(5)}), 2, shuffle=False)
    assert [b["labels"].tolist() for b in data] == [[0, 1], [2, 3], [4]]
    trainer = ft.train.Trainer({"w": jnp.zeros(())}, ft.optim.sgd(0.1),
                               lambda m, b: m["w"] * jnp.sum(b["labels"]).astype(jnp.float32))
    trainer.fit([UserDict({"labels": np.arange(3)})], epochs=1, progress=False)
    assert trainer.steps_run == 1 and trainer.history.steps["loss"] == [0.0]


def test_lists_of_numbers_are_read_as_arrays_and_counted_by_their_rows():
    """A collator without return_tensors gives lists: each number was a leaf of its own, so
    the minibatch counted as 1 example (samples_seen 2 for 30 examples; the epoch's loss
    0.44 where the examples' mean is 0.67: minibatches of 3 and 27 weighed alike)."""
    y = np.random.default_rng(0).normal(size=30).astype(np.float32)
    batch = to_arrays({"ids": [[1, 2], [3, 4]], "y": [0.5, 1.5], "ragged": [[1], [2, 3]]})
    assert batch["ids"].shape == (2, 2) and batch["y"].dtype == np.float64 and batch["ragged"] == [[1], [2, 3]]
    data = ft.train.batches({"y": y.tolist(), "ids": [[i, i] for i in range(30)]}, 8, shuffle=False)
    assert [b["ids"].shape for b in data] == [(8, 2)] * 3 + [(6, 2)]
    trainer = ft.train.Trainer({"w": jnp.zeros(())}, ft.optim.sgd(0.0),
                               lambda m, b: jnp.mean((jnp.asarray(b["y"], jnp.float32) - m["w"]) ** 2))
    history = trainer.fit([{"y": y[:3].tolist()}, {"y": y[3:].tolist()}], epochs=1, progress=False)
    assert int(ft.optim.context(trainer.opt_state).samples_seen) == 30
    # float32 means of float32 squares, summed in float64: ~1e-7 of the value 0.67
    np.testing.assert_allclose(history.epochs["loss"][-1], np.mean(y.astype(np.float64) ** 2), atol=1e-6)
    # in-memory data as a dict of lists, given to fit with batch_size (a dict is never a loader:
    # iterating it gave its keys, "Its shapes: str[]"): cut as the arrays are
    listed = ft.train.Trainer({"w": jnp.zeros(())}, ft.optim.sgd(0.0),
                              lambda m, b: jnp.mean((jnp.asarray(b["y"], jnp.float32) - m["w"]) ** 2))
    history = listed.fit({"y": y.tolist()}, batch_size=8, epochs=1, progress=False)
    assert listed.steps_run == 4 and int(ft.optim.context(listed.opt_state).samples_seen) == 30
    np.testing.assert_allclose(history.epochs["loss"][-1], np.mean(y.astype(np.float64) ** 2), atol=1e-6)


def test_a_list_of_example_rows_is_refused_naming_the_stacked_arrays():
    """ft.train.batches([(x_i, y_i), ...]) read the list as columns: a scalar label was
    SCALAR_LEAF's "leaf 0.1 is a 0-d int32 array" (no fix for rows), rows of two (4,) arrays
    were 4 examples whose minibatches were lists of slices (an error deep in the step)."""
    from functree.train._data import LIST_OF_ROWS

    x = np.arange(24, dtype=np.float32).reshape(6, 4)
    for rows in ([(x[i], i % 3) for i in range(6)], [{"x": x[i], "y": np.int32(i)} for i in range(6)],
                 [(x[i], x[i]) for i in range(6)]):
        with pytest.raises(ValueError) as raised:
            ft.train.batches(rows, 2)
        text = str(raised.value)
        assert text.startswith("ft.train.batches: the data is a list of 6 rows of one example each"), text
        assert "right:  ft.train.batches(jax.tree.map(lambda *r: np.stack(r), *rows), 32)" in text
    assert LIST_OF_ROWS.count("{right}") == 1
    stacked = ft.train.batches(jax.tree.map(lambda *r: np.stack(r), *rows), 2, shuffle=False)
    assert stacked.num_examples == 6 and [b[0].shape for b in stacked] == [(2, 4)] * 3
    assert ft.train.batches([x, x + 1], 2).num_examples == 6  # a list of columns (bare arrays) as before


def test_torch_tensors_on_the_meta_device_are_refused_naming_the_leaf():
    """A torch tensor on the "meta" device (made under torch.device("meta")) in the data, or in
    a DataLoader's minibatch, failed inside torch with "Cannot copy out of meta tensor; no
    data!", naming no leaf: ft.train.batches, fit, evaluate and predict all crashed so."""
    torch = pytest.importorskip("torch")
    from functree.train._data import META_LEAF

    with torch.device("meta"):
        empty = torch.zeros(4, 2)
    labels = torch.zeros(4, 1)
    what = r"is a torch tensor on the \"meta\" device \(torch\.float32 of shape \([24], 2\)\)"
    with pytest.raises(ValueError, match=r"^ft\.train\.batches: leaf 0 " + what):
        ft.train.batches((empty, labels), 2)
    with pytest.raises(ValueError, match=r"^A minibatch \(ft\.train\.to_arrays, .*\): leaf inputs\.x " + what):
        to_arrays({"inputs": {"x": empty}, "y": labels})
    trainer = ft.train.Trainer(ft.nn.Dense(2, 1, key=jax.random.key(0)), ft.optim.sgd(0.1),
                               lambda m, b: jnp.mean((m(b[0]) - b[1]) ** 2))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(labels, labels), batch_size=2,
                                         collate_fn=lambda items: (empty[:2], labels[:2]))  # its minibatches: meta
    for call in (lambda: trainer.fit(loader, epochs=1, progress=False), lambda: trainer.evaluate(loader),
                 lambda: trainer.predict(empty)):
        with pytest.raises(ValueError, match=r"leaf (0|\(the data itself\)) " + what) as raised:
            call()
        assert "right:  x = torch.tensor(values)" in str(raised.value)
    assert trainer.steps_run == 0
    assert META_LEAF.startswith("{where}: leaf {name} is a torch tensor on the \"meta\" device")
    np.testing.assert_array_equal(to_arrays((labels, torch.ones(4)))[1], np.ones(4, np.float32))  # others as before


def test_class_names_as_labels_are_refused_naming_the_class_indices():
    """String labels (a label column, torch's default_collate of str labels) failed deep in
    the jitted step ("Error interpreting argument ... as an abstract array"), or, in
    evaluate, in the loss with the fix ``labels.astype(jnp.int32)``, which text has not."""
    x = np.zeros((4, 2), np.float32)
    names = np.array(["cat", "dog", "cat", "dog"])
    fix = "classes, ids = np.unique(names, return_inverse=True)"
    for labels, what in ((names, r"an array of dtype <U3 and shape \(4,\), first 'cat'"),
                         (names.astype(object), "an array of dtype object"),  # a pandas column's to_numpy()
                         (list(names), "a list of 4 strings, first 'cat'")):
        with pytest.raises(ValueError, match=r"^ft\.train\.batches: leaf 1 holds text \(" + what) as raised:
            ft.train.batches((x, labels), 2)
        assert fix in str(raised.value)
    with pytest.raises(ValueError, match=r"\(ft\.train\.to_arrays, .*\): leaf 1 holds text \(a tuple of 4 strings"):
        to_arrays((x, tuple(names)))  # a torch DataLoader's minibatch of (tensor, str) items
    with pytest.raises(ValueError, match=r"leaf y holds text \(the str 'cat'\)"):
        to_arrays({"x": x, "y": "cat"})
    trainer = ft.train.Trainer(ft.nn.Dense(2, 2, key=jax.random.key(0)), ft.optim.sgd(0.1),
                               lambda m, b: ft.losses.softmax_cross_entropy(m(b[0]), b[1]))
    for data in ([(x, tuple(names))], (x, list(names))):
        with pytest.raises(ValueError, match=r"leaf 1 holds text"):
            trainer.fit(data, epochs=1, progress=False)
    with pytest.raises(ValueError, match=r"leaf 1 holds text"):
        trainer.evaluate([(x, names)])
    assert trainer.steps_run == 0
    ids = np.unique(names, return_inverse=True)[1]
    assert trainer.fit((x, ids), epochs=1, progress=False).epochs["epoch"] == [1]
