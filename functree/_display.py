"""``ft.summary``: a model's leaves as a table (the one-line repr is ``functree._repr``)."""

from __future__ import annotations

import dataclasses
import html
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from functree._parameters import parameters
from functree._stacked import outermost
from functree._state_dict import to_flat_dict

__all__ = ["summary", "Summary"]

@dataclasses.dataclass(frozen=True)
class Row:
    path: str
    shape: tuple[int, ...]
    dtype: str
    count: int
    nbytes: int
    parameter: bool
    leaves: int = 0  # > 0: a group of that many leaves under ``path`` (summary(depth=k))
    label: str = ""  # shown instead of the shape: "12 × Block (3,200 each)" for a Stack


@dataclasses.dataclass(frozen=True)
class Summary:
    """A table of a model's leaves: key path, shape, dtype, count, bytes, with totals.

    Prints as text; shows as an HTML table in notebooks.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> ft.summary({"w": jnp.ones((2, 3)), "b": jnp.zeros(3)}).parameter_count
      9
    """

    name: str
    rows: tuple[Row, ...]

    @property
    def parameter_count(self) -> int:
        return sum(r.count for r in self.rows if r.parameter)

    @property
    def parameter_bytes(self) -> int:
        return sum(r.nbytes for r in self.rows if r.parameter)

    def _table(self) -> list[tuple[str, ...]]:
        out = [("path", "shape", "dtype", "count", "bytes", "kind")]
        for r in self.rows:
            kind = "parameter" if r.parameter else "carried"
            shape = r.label or (f"{r.leaves} leaves" if r.leaves else str(r.shape))
            out.append((r.path, shape, r.dtype, f"{r.count:,}", _bytes(r.nbytes), kind))
        return out

    def __str__(self) -> str:
        table = self._table()
        widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
        lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in table]
        lines.insert(1, "-" * len(lines[0]))
        carried = sum(r.count for r in self.rows if not r.parameter)
        lines.append("-" * len(lines[0]))
        lines.append(
            f"{self.name}: {self.parameter_count:,} parameters ({_bytes(self.parameter_bytes)})"
            + (f", {carried:,} carried values" if carried else "")
        )
        return "\n".join(lines)

    __repr__ = __str__

    def _repr_html_(self) -> str:
        table = self._table()
        head = "".join(f"<th>{html.escape(c)}</th>" for c in table[0])
        body = "".join(
            "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in table[1:]
        )
        foot = html.escape(str(self).splitlines()[-1])
        return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table><p>{foot}</p>"


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:,} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


def _is_data(leaf: Any) -> bool:
    return hasattr(leaf, "dtype") or isinstance(leaf, (bool, int, float, complex))


def summary(model: Any, depth: int | None = None) -> Summary:
    """A table of every data leaf of ``model`` by key path, with parameter totals.

    Leaves that hold no data (the functions an Equinox module keeps as leaves) are left
    out. ``depth=k`` groups the rows by the first ``k`` parts of their dotted paths (one
    row per submodule, its parameters and carried values apart), with leaf counts:
    ``ft.summary(model, depth=1)`` lists the top-level layers. An ``ft.nn.Stack`` shows
    once, as ``12 × Block (3,200 each)`` with its total count.

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> print(ft.summary({"w": jnp.ones((2, 3)), "b": jnp.zeros(3)}))  # doctest: +NORMALIZE_WHITESPACE
      path  shape   dtype    count  bytes  kind
      -----------------------------------------
      b     (3,)    float32  3      12 B   parameter
      w     (2, 3)  float32  6      24 B   parameter
      -----------------------------------------
      dict: 9 parameters (36 B)
    """
    params = to_flat_dict(parameters(model))
    rows = []
    for path, leaf in to_flat_dict(model).items():
        if not _is_data(leaf):
            continue  # a function kept as a leaf (inside an Equinox module): no data
        # A Python scalar leaf is what JAX makes of it (0.5 -> float32 unless x64 is on).
        arr = leaf if hasattr(leaf, "dtype") else jax.ShapeDtypeStruct((), jnp.result_type(leaf))
        count = int(np.prod(arr.shape)) if arr.shape else 1
        nbytes = count * np.dtype(arr.dtype).itemsize
        rows.append(Row(path, tuple(arr.shape), str(arr.dtype), count, nbytes, path in params))
    rows = _stacks_once(model, rows)
    if depth is not None:
        if not isinstance(depth, int) or isinstance(depth, bool) or depth < 1:
            raise ValueError(BAD_DEPTH.format(depth=depth))
        rows = _grouped(rows, depth)
    return Summary(type(model).__name__, tuple(rows))


BAD_DEPTH = """\
ft.summary(model, depth=k) groups rows by the first k parts of their key paths; k must be \
a positive int, got {depth!r}.

    right:  ft.summary(model, depth=1)     # one row per top-level submodule
"""


def _stacks_once(model: Any, rows: list[Row]) -> list[Row]:
    """Each outermost ``ft.nn.Stack``'s rows as one row (parameters and carried apart)."""
    stacks = outermost(model)
    if not stacks:
        return rows
    out: list[Row] = []
    groups: dict[tuple[str, bool], int] = {}  # (stack name, parameter) -> position in out
    for r in rows:
        hit = next(((name, s) for name, s in stacks if not name or r.path.startswith(name + ".")), None)
        if hit is None:
            out.append(r)
            continue
        name = hit[0]
        at = groups.get((name, r.parameter))
        if at is None:
            groups[(name, r.parameter)] = len(out)
            out.append(dataclasses.replace(r, path=name or "<root>", shape=(), leaves=1))
            continue
        g = out[at]
        dtypes = ",".join(dict.fromkeys(g.dtype.split(",") + [r.dtype]))
        out[at] = dataclasses.replace(g, dtype=dtypes, count=g.count + r.count, nbytes=g.nbytes + r.nbytes,
                                      leaves=g.leaves + 1)
    by_name = dict(stacks)
    for (name, _), at in groups.items():
        stack, g = by_name[name], out[at]
        n = len(stack)
        # A jax.vmap-ed ensemble of models: leading axes before the member axis.
        batch = int(np.prod(stack._batch_shape())) if hasattr(stack, "_batch_shape") else 1
        models = f" in each of {batch:,} models" if batch > 1 else ""
        label = f"{n} × {type(stack.layers).__name__} ({g.count // (n * batch):,} each){models}"
        out[at] = dataclasses.replace(g, label=label)
    return out


def _grouped(rows: list[Row], depth: int) -> list[Row]:
    groups: dict[tuple[str, bool], list[Row]] = {}
    for r in rows:
        prefix = ".".join(r.path.split(".")[:depth])
        groups.setdefault((prefix, r.parameter), []).append(r)
    out = []
    for (prefix, parameter), members in groups.items():
        if len(members) == 1 and members[0].label:  # a Stack's row is already one row
            out.append(dataclasses.replace(members[0], path=prefix))
            continue
        dtypes = ",".join(dict.fromkeys(m.dtype for m in members))
        out.append(Row(prefix, (), dtypes, sum(m.count for m in members), sum(m.nbytes for m in members),
                       parameter, leaves=sum(m.leaves or 1 for m in members)))
    return out

