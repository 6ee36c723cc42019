"""A batch's example axis: the leading axis of every array leaf, one example per row.

A step that splits a batch (over a mesh's data devices, or into ``accumulate``
microbatches) cuts every array leaf along its leading axis, so every leaf must have one
row per example. A leaf of another leading size (per-class weights ``(4,)`` beside
``x: (16, 3)``) would be cut as if it had examples, each part reading a slice of it,
silently. :func:`check_example_axis` refuses such a batch, naming the leaf and the fix.

Example:
  >>> import numpy as np
  >>> from functree._examples import check_example_axis
  >>> check_example_axis({"x": np.ones((8, 3)), "y": np.ones(8), "t": np.float32(1)}, "a mesh of 2 devices")
  >>> try:
  ...     check_example_axis({"x": np.ones((8, 3)), "w": np.ones(4)}, "a mesh of 2 devices")
  ... except ValueError as e:
  ...     print(str(e).splitlines()[0][:80])
  The batch's leaves do not share one example axis: ['x'] has 8 rows, ['w'] has 4.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import jax
import numpy as np

__all__ = ["check_example_axis", "MIXED_EXAMPLE_AXIS"]

MIXED_EXAMPLE_AXIS = """\
The batch's leaves do not share one example axis: {first} has {rows} rows, {other} has \
{given}. {why} Keep values that are not per example out of the batch (in the model, or the \
loss's closure), or give them one row per example:

    wrong:  step(model, state, {{"x": x, "y": y, "class_weights": w}})   # w: one per class
    right:  loss_fn = functools.partial(weighted_loss, class_weights=w)    # or w[y]: one per example"""


SPLIT = ("Split over {split}, every array leaf is cut along its leading axis as if each row were an "
         "example, so {other} would be sliced (each part reading other rows of it).")
COUNTED = ("The minibatch size is its number of examples (samples_seen, per_samples learning rates and "
           "the means' weights count them), which {first} and {other} give differently.")


def check_example_axis(batch: Any, split: str | None) -> None:
    """Raise :data:`MIXED_EXAMPLE_AXIS` unless every array leaf of ``batch`` with a leading
    axis has the same number of rows (scalars ride along whole). The example axis is the
    size most leaves share (the larger on a tie); the first other leaf is named, by its path
    in the batch (a step's argument tuple holding the batch alone is read as the batch).
    ``split`` names what cuts the batch (:data:`SPLIT`); None where nothing does and the
    batch's size is only counted (:data:`COUNTED`)."""
    if type(batch) is tuple and len(batch) == 1:
        batch = batch[0]
    leaves = [(jax.tree_util.keystr(path) or "the batch", np.shape(x)[0])
              for path, x in jax.tree_util.tree_flatten_with_path(batch)[0] if np.ndim(x) >= 1]
    sizes = Counter(rows for _, rows in leaves)
    if len(sizes) <= 1:
        return
    examples = max(sizes, key=lambda rows: (sizes[rows], rows))
    first = next(where for where, rows in leaves if rows == examples)
    other, given = next((where, rows) for where, rows in leaves if rows != examples)
    why = (COUNTED if split is None else SPLIT).format(split=split, first=first, other=other)
    raise ValueError(MIXED_EXAMPLE_AXIS.format(first=first, rows=examples, other=other, given=given, why=why))
