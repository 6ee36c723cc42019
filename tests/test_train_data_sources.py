"""Users' data pipelines into ``Trainer.fit``: a torch DataLoader that shuffles, resumed."""

import jax
import jax.numpy as jnp
import pytest

import functree as ft
from functree.train._epochs import TORCH_SHUFFLE_RESUME

torch = pytest.importorskip("torch")
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402


def _fit(directory, epochs, restore=False, shuffle=True):
    """A torch user's job: DataLoader(shuffle=True, generator seeded), 70 examples of 32."""
    x = torch.arange(70.0).reshape(70, 1).repeat(1, 3) / 70
    data = DataLoader(TensorDataset(x, torch.zeros(70, 1)), batch_size=32, shuffle=shuffle,
                      generator=torch.Generator().manual_seed(0))
    checkpoints = ft.train.ModelCheckpoint(directory, every_steps=3)
    trainer = ft.train.Trainer(ft.nn.Dense(3, 1, key=jax.random.key(0)), ft.optim.sgd(1e-2),
                               lambda m, b: jnp.mean((m(b[0]) - b[1]) ** 2))
    if restore:
        trainer.restore(checkpoints.manager)
    trainer.fit(data, epochs=epochs, callbacks=[checkpoints], progress=False)
    return trainer


def test_resumed_torch_shuffle_warns(tmp_path):
    # Measured on the old code: the resumed job's epoch 3 replays epoch 1's order
    # ([63, 34, 21, ...] instead of [38, 66, 60, ...]); weights differ by 3.4e-3, no warning.
    _fit(tmp_path, 2)
    prefix = TORCH_SHUFFLE_RESUME.split(" is at ")[0]
    with pytest.warns(UserWarning, match=prefix):
        _fit(tmp_path, 3, restore=True)


def test_resumed_torch_in_order_is_silent(tmp_path, recwarn):
    _fit(tmp_path, 2, shuffle=False)
    _fit(tmp_path, 3, restore=True, shuffle=False)
    assert not [w for w in recwarn if "RandomSampler" in str(w.message)]


def test_ragged_token_ids_name_padding():
    # Old code: a TypeError from JAX ("Cannot concatenate arrays with shapes that differ ...")
    # with the minibatch's location, no word of padding.
    from functree.train._epochs import RAGGED_MINIBATCH

    trainer = ft.train.Trainer(ft.nn.Dense(3, 1, key=jax.random.key(0)), ft.optim.sgd(0.0),
                               lambda m, b: jnp.mean(jnp.asarray(b["input_ids"], jnp.float32)))
    with pytest.raises(TypeError) as info:
        trainer.fit([{"input_ids": [[1, 2, 3], [4, 5]]}], epochs=1, progress=False)
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert RAGGED_MINIBATCH.format(paths="['input_ids']") in notes
