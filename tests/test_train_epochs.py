"""Epochs and the position in the data (functree/train/_epochs.py)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import functree as ft
from functree.train._epochs import Epochs, as_data, check_list_of_arrays, check_row_minibatch
from functree.train._job import JobState

ITEMS = [(np.full((2, 1), i, np.float32),) for i in range(5)]


def at(**position):
    return JobState.start(None, None).replace(**position)


def test_each_kind_of_data_continues_from_the_jobs_position():
    epochs = Epochs()
    assert [int(b[0][0, 0]) for b in epochs.iterate(ITEMS, at(batch_in_epoch=3))] == [3, 4]  # skips, read
    epochs.forget()
    stream = iter(ITEMS)
    assert epochs.iterate(stream, at(batch_in_epoch=2)) is stream  # a one-shot iterator continues as it is
    assert epochs.iterate(stream, at()) is stream  # the same data: the same epoch iterator
    data = ft.train.batches(np.arange(8, dtype=np.float32), 2, shuffle=False)
    assert [b.tolist() for b in Epochs().iterate(data, at(epoch=1, batch_in_epoch=3))] == [[6.0, 7.0]]


def test_a_restored_position_is_set_and_a_one_shot_restore_warns():
    class Positioned:
        def __init__(self):
            self.index = 0

        def __iter__(self):
            return self

        def __next__(self):
            self.index += 1
            return self.index

        def get_state(self):
            return {"index": self.index}

        def set_state(self, state):
            self.index = state["index"]

    epochs = Epochs()
    it = epochs.iterate(Positioned(), at(steps_run=4, batch_in_epoch=4, data_state={"index": 4}))
    assert next(it) == 5 and epochs.position(at(batch_in_epoch=5)) == {"index": 5}
    epochs.forget(restored=True)
    with pytest.warns(UserWarning, match="one-shot iterator that cannot report"):
        epochs.iterate(iter(ITEMS), at(steps_run=3, batch_in_epoch=3))


def test_counts_take_integer_scalars_and_refuse_the_rest():
    # np.int64 comes from arithmetic on array sizes (len(x) // batch): an int to fit.
    assert Epochs.check_counts(epochs=np.int64(3), steps=None, log_every=jnp.int32(5)) == [3, None, 5]
    assert all(type(n) is int for n in Epochs.check_counts(epochs=np.int64(3), log_every=np.uint8(2)))
    for bad in (0, -1, 2.0, np.float32(2), True, np.bool_(True), "3", np.int64(0)):
        with pytest.raises(ValueError, match=r"epochs must be a positive int, got"):
            Epochs.check_counts(epochs=bad)


def test_the_datas_errors():
    with pytest.raises(ValueError, match=r"log_every must be a positive int, got 0"):
        Epochs.check_counts(epochs=2, log_every=0)
    with pytest.raises(ValueError, match=r"one-shot iterator: it would run out"):
        Epochs().check_data(iter(ITEMS), 3, None, at())
    restored = Epochs()
    restored.forget(restored=True)
    with pytest.raises(ValueError, match=r"5 minibatches per epoch, but fit was given 4"):
        restored.check_data(ITEMS[:4], 3, None, at(batch_in_epoch=2, epoch_length=5))
    with pytest.raises(ValueError, match=r"minibatch 2 of epoch 1 is empty"):
        Epochs().minibatch_size((np.zeros((0, 1)),), at(epoch=1, batch_in_epoch=1), 1)
    with pytest.raises(ValueError, match=r"no get_state\(\)|not JSON"):
        class Odd:
            def __iter__(self):
                return self

            def __next__(self):
                return 1

            def get_state(self):
                return object()

            def set_state(self, state):
                pass

        epochs = Epochs()
        epochs.iterate(Odd(), at())
        epochs.position(at(batch_in_epoch=1))


def test_a_leaf_of_another_leading_size_is_refused_not_read_as_the_minibatch_size():
    """A dict batch's minibatch size was its first leaf's in key order: a per-batch
    ``class_weights`` (3,) beside x (10, 2) gave samples_seen 6 for 20 examples and the
    per_samples(0.1, 10) rate 0.03 for 0.1, silently. Leaves that disagree are now refused,
    naming both key paths and sizes."""
    from functree._examples import COUNTED, MIXED_EXAMPLE_AXIS
    from functree.train._metrics import shared_batch_size

    rng = np.random.default_rng(2)
    x = rng.normal(size=(20, 2)).astype(np.float32)
    y = (x @ np.array([1.0, -1.0], np.float32)).astype(np.float32)
    weights = np.ones(3, np.float32)
    why = COUNTED.format(first="['x']", other="['class_weights']")  # nothing cut on one device
    want = MIXED_EXAMPLE_AXIS.format(first="['x']", rows=10, other="['class_weights']", given=3, why=why)
    assert "is cut along" not in want and "minibatch size is its number of examples" in want
    with pytest.raises(ValueError) as info:
        shared_batch_size({"x": x[:10], "y": y[:10], "class_weights": weights})
    assert str(info.value) == want
    with pytest.raises(ValueError, match=r"\[2\] has 3"):  # a tuple too, past its fast path
        Epochs().minibatch_size((x[:10], y[:10], weights), at(), 0)
    assert shared_batch_size({"x": x[:10], "t": np.float32(2.0)}) == 10  # a scalar rides along

    def loss_fn(m, b):
        return jnp.mean(((b["x"] @ m["w"]) * b["class_weights"][0] - b["y"]) ** 2)

    trainer = ft.train.Trainer({"w": jnp.zeros(2)}, ft.optim.Optimizer(ft.optim.sgd(ft.optim.per_samples(0.1, 10))),
                               loss_fn)
    data = [{"x": x[i:i + 10], "y": y[i:i + 10], "class_weights": weights} for i in (0, 10)]
    with pytest.raises(ValueError) as info:
        trainer.fit(data, epochs=1, progress=False)
    assert str(info.value) == want and trainer.steps_run == 0
    assert info.value.__notes__ == ["step 1: minibatch 0 of epoch 0 (counted from 0); it was not run."]
    seen = []  # the fix (the weights in the loss's closure): 10 examples a step, the rate 0.1
    trainer = ft.train.Trainer({"w": jnp.zeros(2)}, ft.optim.Optimizer(ft.optim.sgd(ft.optim.per_samples(0.1, 10))),
                               lambda m, b: loss_fn(m, {**b, "class_weights": weights}))
    trainer.fit([{"x": b["x"], "y": b["y"]} for b in data], epochs=1, progress=False, callbacks=[seen.append])
    assert (seen[-1].samples_seen, seen[-1].minibatch_size) == (20, 10)
    w = np.zeros(2)  # reference: SGD at 0.1 on the mean squared error's gradient
    for i in (0, 10):
        xb, yb = x[i:i + 10].astype(np.float64), y[i:i + 10]
        w = w - 0.1 * 2 * xb.T @ (xb @ w - yb) / 10
    np.testing.assert_allclose(np.asarray(trainer.model["w"]), w, rtol=0, atol=1e-6)


def _pairs():
    rng = np.random.default_rng(0)
    x, y = (rng.normal(size=(11, 3)).astype(np.float32) for _ in range(2))
    trainer = ft.train.Trainer({"w": jnp.eye(3)}, ft.optim.sgd(0.1), lambda m, b: jnp.mean((b[0] @ m["w"] - b[1]) ** 2))
    return x, y, trainer


def test_torch_tensors_are_arrays_cut_by_batch_size_as_numpys():
    """A tuple of torch tensors was read as a list of minibatches (x the first, y the second)
    with batch_size= ignored: evaluate gave 0.3284 where the data's mean loss is 1.9768, fit
    ran 2 steps on wrong pairs, predict(x_tensor) returned (33,) rows of (11, 3)."""
    torch = pytest.importorskip("torch")
    x, y, trainer = _pairs()
    expected = float(np.mean((x - y) ** 2))  # w = I
    for data in ((x, y), (torch.tensor(x), torch.tensor(y))):
        np.testing.assert_allclose(trainer.evaluate(data, batch_size=4)["loss"], expected, rtol=0, atol=1e-6)
    got = trainer.predict(torch.tensor(x), lambda m, b: b @ m["w"], batch_size=4)
    np.testing.assert_array_equal(np.asarray(got), x)
    trainer.fit((torch.tensor(x), torch.tensor(y)), epochs=1, batch_size=4)
    assert trainer.steps_run == 3  # 11 examples in minibatches of 4: 4, 4, 3
    batch = next(iter(ft.train.batches({"x": torch.tensor(x)}, 4, shuffle=False)))
    np.testing.assert_array_equal(np.asarray(batch["x"]), x[:4])


@pytest.mark.parametrize("call", ["fit", "evaluate", "predict"])
def test_a_batch_size_the_data_would_ignore_is_refused_naming_the_tuple(call):
    """[x, y] (a list: x one minibatch, y another) with batch_size=4 gave evaluate 0.3284 for
    the data's 1.9768, silently; so did batch_size= beside a loader or a Batches of another size."""
    x, y, trainer = _pairs()
    method = getattr(trainer, call)
    args = (lambda m, b: b,) if call == "predict" else ()
    with pytest.raises(ValueError, match=rf"(?s)trainer\.{call}\(data, batch_size=4\).*a list of 2 items.*"
                                         rf"right:  trainer\.{call}\(\(x, y\), batch_size=4\)"):
        method([x, y], *args, batch_size=4)
    with pytest.raises(ValueError, match=r"(?s)ft\.train\.batches\(\.\.\.\).*its own batch_size=5"):
        method(ft.train.batches((x, y), 5), *args, batch_size=4)
    method(ft.train.batches((x, y), 4, shuffle=False), *args, batch_size=4)  # the same size: no conflict


@pytest.mark.parametrize("call", ["fit", "validation", "evaluate", "predict"])
def test_a_list_of_inputs_and_labels_is_refused_naming_the_tuple(call):
    """[x, labels] (arrays of other dtypes or ranks) was read as two minibatches, x alone and
    then the labels alone: a step on each, no error where the loss runs on a bare array."""
    x, y, trainer = _pairs()
    labels = np.arange(11, dtype=np.int32) % 3
    args = (lambda m, b: b,) if call == "predict" else ()
    method = trainer.fit if call == "validation" else getattr(trainer, call)
    caller = {"validation": "trainer.fit"}.get(call, f"trainer.{call}")
    wrong, right = (("trainer.fit(data, validation_data=[x, y])", "trainer.fit(data, validation_data=(x, y))")
                    if call == "validation" else (f"{caller}([x, y], ...)", f"{caller}((x, y), ...)"))
    for data, what, shapes in (([x, labels], "dtype and rank", "float32[11, 3], int32[11]"),
                               ([x, y[:, 0]], "rank", "float32[11, 3], float32[11]"),
                               ([x, y.astype(np.float16)], "dtype", "float32[11, 3], float16[11, 3]")):
        with pytest.raises(ValueError, match=rf"(?s)list's 2 arrays differ in {what} \({re.escape(shapes)}\).*"
                                             rf"wrong:  {re.escape(wrong)}.*right:  {re.escape(right)}"):
            if call == "validation":
                method((x, y), epochs=1, progress=False, validation_data=data)
            else:
                method(data, *args)
    # Minibatches of one dataset (one dtype and rank) are a list as before.
    got = trainer.evaluate([(x[:5], y[:5]), (x[5:], y[5:])])["loss"]
    np.testing.assert_allclose(got, float(np.mean((x - y) ** 2)), rtol=0, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(trainer.predict([x[:5], x[5:]], lambda m, b: b @ m["w"])), x)


def test_a_failing_step_on_a_list_of_arrays_says_each_item_is_a_minibatch():
    """[x, y] of one dtype and rank is a valid list of minibatches; when its step fails (here
    on y, of another width), the error says the list's items are minibatches, naming the tuple."""
    x, y, trainer = _pairs()
    with pytest.raises(Exception) as raised:
        trainer.fit([x, y[:, :1]], epochs=1, progress=False)
    notes = "\n".join(getattr(raised.value, "__notes__", []))
    assert "minibatch 1 of epoch 0" in str(raised.value)
    assert ("trainer.fit's data is a list of 2 arrays (float32[11, 3], float32[11, 1]): each item is one "
            "minibatch, so this minibatch is the array data[1] alone. If the list is [inputs, labels], pass "
            "the tuple (x, y): trainer.fit((x, y), ...).") in notes, notes


def test_a_list_of_minibatches_is_judged_by_the_dtypes_a_step_sees():
    """The [x, labels] check read np.dtype(tensor.dtype): a list of torch minibatches (float32,
    bfloat16) raised TypeError "Cannot interpret 'torch.float32' as a data type" in fit and
    predict, and NumPy float64/int64 minibatches beside JAX's float32/int32 ones (one dtype
    to a step without x64) were refused as [inputs, labels], a list of PRNG keys raised
    canonicalize_dtype's ValueError. A failing step's note named
    data[i] for a converted (torch) minibatch; it names the list's item."""
    torch = pytest.importorskip("torch")
    x, y, trainer = _pairs()
    rows = lambda m, b: jnp.sum(b.astype(jnp.float32), axis=-1)  # noqa: E731
    for data in ([torch.tensor(x[:5]), torch.tensor(x[5:])],
                 [torch.tensor(x[:5]).bfloat16(), torch.tensor(x[5:]).bfloat16()],
                 [x[:5].astype(np.float64), jnp.asarray(x[5:])],
                 [np.arange(15).reshape(5, 3), jnp.arange(18).reshape(6, 3)]):
        assert trainer.predict(data, rows).shape == (11,)
    keys = jax.random.split(jax.random.key(0), 4)  # key<fry>: a dtype JAX does not canonicalize by default
    check_list_of_arrays([keys[:2], keys[2:]], "trainer.predict")
    with pytest.raises(ValueError, match=re.escape("differ in dtype and rank (torch.float32[11, 3], torch.int64[11])")):
        trainer.fit([torch.tensor(x), torch.arange(11)], epochs=1, progress=False)
    with pytest.raises(Exception) as raised:
        trainer.fit([torch.tensor(x), torch.tensor(y[:, :1])], epochs=1, progress=False)
    assert "so this minibatch is the array data[1] alone" in "\n".join(getattr(raised.value, "__notes__", []))


def test_fits_batch_size_still_cuts_training_arrays_beside_a_validation_loader():
    x, y, trainer = _pairs()
    trainer.fit((x, y), epochs=1, batch_size=4, validation_data=[(x, y)])
    np.testing.assert_allclose(trainer.history["val_loss"][-1], trainer.evaluate([(x, y)])["loss"], rtol=0, atol=1e-7)


def test_drop_last_dropping_every_example_says_so():
    """Was the generic 'The training data gave no minibatch (Batches)' with a fix that repeats
    the mistake (batch_size=32 over 7 examples)."""
    trainer = ft.train.Trainer({"w": jnp.ones(())}, ft.optim.sgd(0.1), lambda m, b: m["w"] * jnp.sum(b))
    with pytest.raises(ValueError, match=r"(?s)batch_size=30, drop_last=True\) drops.*its 7 examples.*"
                                         r"right:  ft\.train\.batches\(\(x, y\), batch_size=7, drop_last=True\)"):
        trainer.fit(ft.train.batches(np.arange(7.0), 30, drop_last=True), epochs=1, progress=False)


def test_data_that_runs_out_before_the_steps_asked_warns():
    """fit(generator(), steps=10) over a generator of 3 minibatches returned at step 3 with no
    word (its second epoch empty), as did fit(data, epochs=3) over a dataset whose iter() gives
    one shared iterator: a job of 3 steps for the 10 (or 3 epochs) asked."""
    trainer = ft.train.Trainer({"w": jnp.ones(())}, ft.optim.sgd(0.1), lambda m, b: m["w"] * jnp.sum(b[0]))
    with pytest.warns(UserWarning, match=r"(?s)fit\(data, steps=10\) stopped short of steps=10, at step 3: "
                                         r"the data \(list_iterator\) gave no minibatch for epoch 1.*"
                                         r"or:  trainer\.fit\(generator\(\), steps=3\)"):
        trainer.fit(iter(ITEMS[:3]), steps=10, progress=False)
    assert (trainer.steps_run, trainer.epoch) == (3, 1)
    trainer.fit(iter(ITEMS[:2]), steps=5, progress=False)  # exactly the steps asked: no warning
    assert trainer.steps_run == 5


@pytest.mark.parametrize("call", ["fit", "validation", "evaluate", "predict"])
def test_a_list_of_example_rows_is_refused_naming_the_stacked_arrays(call):
    """[(x_i, y_i), ...] (a torch Dataset's items, HF's rows as dicts) was read as minibatches,
    one per row: fit ran a step per row counting its 3 features as 3 examples (samples_seen 33
    for 11 rows), its label riding along whole; with batch_size= the error spoke of [x, y]."""
    from functree.train._data import LIST_OF_ROWS

    x, _, trainer = _pairs()
    labels = np.arange(11, dtype=np.int32) % 3
    rows = [(x[i], int(labels[i])) for i in range(11)]
    args = (lambda m, b: b,) if call == "predict" else ()
    caller = "trainer.fit(validation_data=...)" if call == "validation" else f"trainer.{call}"
    wrong, right = (("trainer.fit(data, validation_data=rows)",
                     "trainer.fit(data, validation_data=jax.tree.map(lambda *r: np.stack(r), *rows))")
                    if call == "validation" else
                    (f"trainer.{call}(rows, ...)", f"trainer.{call}(jax.tree.map(lambda *r: np.stack(r), *rows), ...)"))
    for data in (rows, [{"x": x[i], "y": labels[i]} for i in range(11)], [{"ids": [1, 2, 3], "y": 0}] * 2):
        with pytest.raises(ValueError) as raised:
            if call == "validation":
                trainer.fit((x, x), epochs=1, progress=False, validation_data=data)
            else:
                getattr(trainer, call)(data, *args)
        text = str(raised.value)
        assert text.startswith(f"{caller}: the data is a list of {len(data)} rows of one example each"), text
        assert f"    wrong:  {wrong}\n    right:  {right}\n" in text
    assert trainer.steps_run == 0  # refused before any step
    if call != "fit":
        return
    with pytest.raises(ValueError) as raised:  # batch_size= asks for cutting: rows without a label too
        trainer.fit([(x[i], x[i]) for i in range(11)], batch_size=4)
    assert "right:  trainer.fit(jax.tree.map(lambda *r: np.stack(r), *rows), batch_size=4, ...)" in str(raised.value)
    with pytest.raises(ValueError, match=re.escape("(rows of unequal lengths padded to one first")):
        trainer.fit([(x[0], 0), (x[1, :2], 1)])
    assert LIST_OF_ROWS.startswith("{caller}: the data is a list of {n} rows")
    minibatches = [(x[:4], labels[:4]), (x[4:], labels[4:])]  # labels with the example axis: a list as before
    assert as_data(minibatches, None, None) is minibatches
    stacked = as_data(jax.tree.map(lambda *r: np.stack(r), *rows), 4, None)  # the fix: 11 examples, cut by 4
    assert stacked.num_examples == 11 and len(stacked) == 3


class _RowDataset:
    """A map-style dataset (torch's Dataset protocol): __getitem__ gives one example."""

    def __init__(self, x, labels):
        self.x, self.labels = x, labels

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        if i >= len(self.x):
            raise IndexError(i)
        return self.x[i], int(self.labels[i])


@pytest.mark.parametrize("call", ["fit", "validation", "evaluate", "predict"])
def test_a_loader_of_example_rows_is_refused_showing_both_readings(call):
    """A map-style Dataset given for its DataLoader (or a generator of records) yields rows
    (x_i, y_i), which fit read as minibatches with no error: 11 steps of one example each,
    samples_seen 33 (each row's 3 features counted as examples), its label riding along
    whole. Refused at the first item, before any step; the fixes batch the rows."""
    from functree.train._epochs import ROWS_FROM_LOADER

    x, _, trainer = _pairs()
    labels = np.arange(11) % 3
    args = (lambda m, b: b[0],) if call == "predict" else ()
    caller = "trainer.fit(validation_data=...)" if call == "validation" else f"trainer.{call}"
    for data in (_RowDataset(x, labels), (row for row in _RowDataset(x, labels))):
        with pytest.raises(ValueError) as raised:
            if call == "validation":
                trainer.fit((x, x), epochs=1, progress=False, validation_data=data)
            else:
                getattr(trainer, call)(data, *args)
        text = str(raised.value)
        assert text.startswith(f"{caller}: the data ({type(data).__name__}) gives rows of one example each"), text
        assert "leaf [1] 0-d (a label) beside leaf [0] of 3 values (features)" in text
        assert "this row is a minibatch of 3 examples" in text and "it is 1 example" in text
        assert "DataLoader(dataset, batch_size=32)" in text and "jax.tree.map(lambda *r: np.stack(r), *rows)" in text
    assert trainer.steps_run == (1 if call == "validation" else 0)  # (validation: after the epoch's step)
    assert ROWS_FROM_LOADER.startswith("{caller}: the data ({kind}) gives rows")
    if call != "fit":
        return
    rows = list(_RowDataset(x, labels))
    stacked = as_data(jax.tree.map(lambda *r: np.stack(r), *rows), 4, None)  # the fix: 11 examples
    assert stacked.num_examples == 11 and [b[1].shape for b in stacked] == [(4,), (4,), (3,)]
    check_row_minibatch((x, jax.random.key(0)), [], "trainer.fit")  # a per-minibatch key is no label
    check_row_minibatch({"ids": [[1, 2], [3]], "mask": np.ones(2)}, [], "trainer.fit")  # lists: arrays, no label


def test_minibatches_with_a_per_minibatch_value_are_shown_the_way_through_and_it_trains():
    """A loader of minibatches (x, y, t) with t one value for the whole minibatch (a
    temperature) has the shapes of a row (x_i, y_i, label): ROWS_FROM_LOADER cannot tell them
    apart, and its message only batched rows. It shows the legit form too (t once per
    example), and that code trains on the whole minibatches."""
    x, y, _ = _pairs()

    def loss(m, b):
        return jnp.mean((b[0] @ m["w"] - b[1]) ** 2) * b[2][0]

    minibatches = [(x[:4], y[:4], np.float32(0.5)), (x[4:], y[4:], np.float32(0.5))]
    trainer = ft.train.Trainer({"w": jnp.eye(3)}, ft.optim.sgd(0.1), loss)
    with pytest.raises(ValueError) as raised:
        trainer.fit(iter(minibatches), epochs=1, progress=False)
    right = str(raised.value).splitlines()[-1]
    assert "and read it in the loss as batch[2][0]" in str(raised.value)
    assert right == ("    right:  trainer.fit([jax.tree.map(lambda v: np.full(len(b[0]), v) if np.ndim(v) == 0 "
                     "else v, b) for b in minibatches], ...)"), right
    data = eval(right.split("trainer.fit(", 1)[1].rsplit(", ...)", 1)[0])  # the message's code, as pasted
    seen = []
    trainer.fit(data, epochs=1, progress=False, callbacks=[seen.append])
    assert trainer.steps_run == 2 and (seen[-1].samples_seen, seen[-1].minibatch_size) == (11, 7)


def test_data_known_never_to_end_is_refused_without_steps_and_finite_data_ends_its_epoch():
    """fit(itertools.cycle(loader)) (or grain's MapDataset.repeat(), a DataLoader whose
    sampler has num_epochs=None) ran its first epoch forever: an epoch ends where the data
    does. Without steps= it is refused (ENDLESS_DATA, Keras's steps_per_epoch as steps=);
    with steps= it trains, but validation_data, read at epoch ends, is refused
    (ENDLESS_VALIDATION), as endless validation data is. A generator without len() still
    ends its epoch where it runs out."""
    import itertools
    import types

    grain = pytest.importorskip("grain")
    from functree.train._epochs import (
        ENDLESS_DATA,
        ENDLESS_VALIDATION,
        ENDLESS_VALIDATION_DATA,
        endless,
    )

    x = np.ones((8, 2), np.float32)
    minibatches = [(x[:4], x[:4, :1]), (x[4:], x[4:, :1])]
    trainer = ft.train.Trainer(ft.nn.Dense(2, 1, key=jax.random.key(0)), ft.optim.sgd(0.1),
                               lambda m, b: jnp.mean((m(b[0]) - b[1]) ** 2))
    sampler = grain.samplers.IndexSampler(2, shard_options=grain.sharding.NoSharding(), num_epochs=None)
    kinds = {"cycle": itertools.cycle(minibatches), "repeat": itertools.repeat(minibatches[0]),
             "RepeatMapDataset": grain.MapDataset.source(minibatches).repeat(),
             "DataLoader": grain.DataLoader(data_source=minibatches, sampler=sampler)}
    for kind, data in kinds.items():
        why, fix = endless(data)
        finite, _, note = fix.partition("  # ")
        for given, epochs in (({}, 1), ({"epochs": 3}, 3)):
            with pytest.raises(ValueError) as e:
                trainer.fit(data, progress=False, **given)
            assert str(e.value) == ENDLESS_DATA.format(epochs=epochs, kind=kind, why=why, finite=finite, note=note)
        with pytest.raises(ValueError, match=re.escape(ENDLESS_VALIDATION.format(
                steps=2, kind=kind, why=why, finite=finite, note=note))):
            trainer.fit(data, steps=2, progress=False, validation_data=minibatches)
        with pytest.raises(ValueError, match=re.escape(ENDLESS_VALIDATION_DATA.split("{")[0])):
            trainer.fit(minibatches, epochs=1, progress=False, validation_data=data)
    assert trainer.steps_run == 0
    trainer.fit(itertools.cycle(minibatches), steps=3, progress=False)
    assert (trainer.steps_run, trainer.epoch) == (3, 0)  # steps= bounds it

    fresh = ft.train.Trainer(ft.nn.Dense(2, 1, key=jax.random.key(0)), ft.optim.sgd(0.1),
                             lambda m, b: jnp.mean((m(b[0]) - b[1]) ** 2))
    fresh.fit((b for b in minibatches), epochs=1, progress=False)  # no len(): ends where it runs out
    assert (fresh.steps_run, fresh.epoch) == (2, 1)
    once = grain.samplers.IndexSampler(2, shard_options=grain.sharding.NoSharding(), num_epochs=1)
    assert endless(grain.DataLoader(data_source=minibatches, sampler=once)) is None
    assert endless(itertools.repeat(minibatches[0], 3)) is None and endless(grain.MapDataset.source(minibatches)) is None
    # tf.data's Dataset.repeat(): len() raises, cardinality() is INFINITE_CARDINALITY (-1); -2 is unknown
    tf_like = types.new_class("RepeatDataset", exec_body=lambda ns: ns.update(
        __module__="tensorflow.python.data.ops.repeat_op", cardinality=lambda self: self.n))
    endless_tf, unknown_tf = tf_like(), tf_like()
    endless_tf.n, unknown_tf.n = -1, -2
    assert "INFINITE_CARDINALITY" in endless(endless_tf)[0] and endless(unknown_tf) is None


def test_a_refusal_of_the_optimizer_while_the_first_step_traces_is_not_blamed_on_the_minibatch():
    # Trainer(model, optax.chain(optax.scale_by_adam()), loss).fit(...) said "step 1: minibatch 0
    # ... failed in the training step. Its shapes: ..." before NO_LEARNING_RATE: the data is not
    # at fault. A configuration refusal passes as it is; a data-dependent failure stays located.
    import optax

    from functree.optim._rate import check_rate_applied

    def loss(m, b):
        return jnp.mean((b[0] @ m["w"] - b[1]) ** 2)

    model, data = {"w": jnp.zeros((3, 1))}, [(jnp.ones((4, 3)), jnp.ones((4, 1)))]
    with pytest.raises(ValueError) as raised:
        ft.train.Trainer(model, optax.chain(optax.scale_by_adam()), loss).fit(data, steps=1, progress=False)
    with pytest.raises(ValueError) as direct:
        check_rate_applied(optax.chain(optax.scale_by_adam()), model, None)
    assert str(raised.value) == str(direct.value) and "minibatch" not in str(raised.value)
    assert not any("minibatch" in note for note in getattr(raised.value, "__notes__", []))
    wide = [(jnp.ones((4, 2)), jnp.ones((4, 1)))]  # the data's own fault: the step and shapes named
    with pytest.raises(TypeError, match=r"^step 1: minibatch 0 of epoch 0 \(counted from 0\) failed in the "
                                        r"training step\. Its shapes: \('float32\[4, 2\]'"):
        ft.train.Trainer(model, ft.optim.sgd(0.1), loss).fit(wide, steps=1, progress=False)


def test_a_second_fit_inside_an_epoch_on_data_of_another_length_is_refused_not_run_as_its_end():
    # session 60: fit(data, steps=3) over 5 minibatches, then fit(other, epochs=1) with other
    # of 3 minibatches went on at minibatch 3 of other: the epoch ended at once and fit
    # trained nothing on it, with no error (a restored job was refused, DATA_LENGTH_CHANGED)
    from functree.train._epochs import DATA_LENGTH_CHANGED_MID_EPOCH

    assert "stopped inside epoch {epoch}" in DATA_LENGTH_CHANGED_MID_EPOCH
    x = np.arange(40.0, dtype=np.float32).reshape(20, 2) / 40
    y = x[:, :1] * 2
    loss_fn = lambda m, b: jnp.mean((m(b[0]) - b[1]) ** 2)  # noqa: E731
    trainer = ft.train.Trainer(ft.nn.Dense(2, 1, key=jax.random.key(0)), ft.optim.sgd(0.1), loss_fn)
    trainer.fit(ft.train.batches((x, y), 4, shuffle=False), steps=3, progress=False)
    before = np.asarray(trainer.model.weight)
    with pytest.raises(ValueError) as e:
        trainer.fit(ft.train.batches((x, y), 8, shuffle=False), epochs=1, progress=False)
    assert str(e.value).startswith("This job stopped inside epoch 0 (counted from 0), after 3 of its data's 5 "
                                   "minibatches (step 3), but fit was given data of 3 minibatches per epoch")
    assert "right:  trainer.fit(data, epochs=1); trainer.fit(other_data, epochs=...)" in str(e.value)
    np.testing.assert_array_equal(np.asarray(trainer.model.weight), before)
    trainer.fit(ft.train.batches((x, y), 4, shuffle=False), epochs=1, progress=False)  # the right lines run
    history = trainer.fit(ft.train.batches((x, y), 8, shuffle=False), epochs=2, progress=False)
    assert len(history.steps["loss"]) == 5 + 3 and trainer.steps_run == 8
    # the other way through: a new job from the trained model and its optimizer state
    halfway = ft.train.Trainer(ft.nn.Dense(2, 1, key=jax.random.key(0)), ft.optim.adam(0.1), loss_fn)
    halfway.fit(ft.train.batches((x, y), 4, shuffle=False), steps=3, progress=False)
    with pytest.raises(ValueError, match=r"or:  ft\.train\.Trainer\(trainer\.model, optimizer, loss_fn, "
                                         r"opt_state=trainer\.opt_state\)\.fit\(other_data"):
        halfway.fit(ft.train.batches((x, y), 8, shuffle=False), epochs=1, progress=False)
    moments = np.asarray(optax.tree_utils.tree_get(halfway.opt_state, "mu").weight)
    again = ft.train.Trainer(halfway.model, ft.optim.adam(0.1), loss_fn, opt_state=halfway.opt_state)
    again.fit(ft.train.batches((x, y), 8, shuffle=False), epochs=1, progress=False)
    assert again.steps_run == 3 and not np.array_equal(np.asarray(optax.tree_utils.tree_get(again.opt_state, "mu").weight), moments)
