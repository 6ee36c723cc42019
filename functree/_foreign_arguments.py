"""Other libraries' constructor arguments, named with functree's when a layer refuses them.

A migrating user writes torch's ``nn.Linear(3, 4, bias=False)``, ``nn.LayerNorm(16,
eps=1e-6)`` or ``nn.Dropout(p=0.5)``, Keras's ``Dense(units=4)`` or Flax's
``nnx.Linear(in_features=3, out_features=4)`` out of habit, with functree's class names;
Python's ``__init__() got an unexpected keyword argument 'bias'`` says neither that the
argument exists under another name nor which. :func:`foreign_argument` makes the error for
the constructor wrapper of ``functree._module`` (a Module's ``__init__`` as written), and
only after the call failed: nothing runs on a construction that succeeds. It answers only
when the outermost ``__init__``'s own signature refuses a keyword (an error raised inside
the constructor is left as it is): with the other library's name and functree's, where
the layer has that parameter, else with the parameters whose names are close.
"""

from __future__ import annotations

import difflib
import inspect
from typing import Any

__all__ = ["FOREIGN_ARGUMENT", "UNKNOWN_ARGUMENT", "FOREIGN_ARGUMENTS", "foreign_argument", "public_name"]

FOREIGN_ARGUMENT = """\
{cls}() got an unexpected keyword argument{plural} {names}: {why}

    wrong:  {cls}(..., {wrong})
    right:  {cls}(..., {right})"""

UNKNOWN_ARGUMENT = """\
{cls}() got an unexpected keyword argument {name!r}{close} Its arguments: {params}."""

# The other library's keyword -> (whose, functree's parameters it may be, in order of
# preference; the first the layer has is named). A target may be "a+b": both set to the value
# (torch's elementwise_affine=False is use_scale=False, use_offset=False here).
FOREIGN_ARGUMENTS: dict[str, tuple[str, tuple[str, ...]]] = {
    "bias": ("torch's bias=", ("use_bias",)),
    "use_bias": ("Keras's and Flax's use_bias=", ("bias",)),
    "eps": ("torch's and Flax's eps=", ("epsilon", "layer_norm_eps")),
    "p": ("torch's Dropout(p=)", ("rate",)),
    "stride": ("torch's stride=", ("strides",)),
    "kernel_size": ("torch's kernel_size= of a pool", ("pool_size",)),
    "window_shape": ("Flax's window_shape=", ("pool_size",)),
    "padding_idx": ("torch's padding_idx=", ("padding_index",)),
    "in_features": ("torch's and Flax's in_features=", ("input_size", "in_size")),
    "out_features": ("torch's and Flax's out_features=", ("output_size", "out_size")),
    "features": ("Flax's features=", ("output_size", "out_channels", "embedding_size", "feature_count")),
    "units": ("Keras's units=", ("output_size",)),
    "filters": ("Keras's filters=", ("out_channels",)),
    "num_embeddings": ("torch's and Flax's num_embeddings=", ("vocabulary_size",)),
    "embedding_dim": ("torch's embedding_dim=", ("embedding_size",)),
    "input_dim": ("Keras's input_dim=", ("vocabulary_size", "input_size")),
    "output_dim": ("Keras's output_dim=", ("embedding_size", "output_size")),
    "num_features": ("torch's num_features=", ("feature_count",)),
    "normalized_shape": ("torch's normalized_shape=", ("shape",)),
    "num_groups": ("torch's num_groups=", ("groups",)),
    "num_channels": ("torch's num_channels=", ("channels",)),
    "embed_dim": ("torch's embed_dim=", ("query_size",)),
    "elementwise_affine": ("torch's elementwise_affine=", ("use_scale+use_offset",)),
    "affine": ("torch's affine=", ("use_scale+use_offset",)),
    "center": ("Keras's center=", ("use_offset",)),
    "scale": ("Keras's scale=", ("use_scale",)),
    "kernel_init": ("Flax's kernel_init=", ("weight_initializer",)),
    "kernel_initializer": ("Keras's kernel_initializer=", ("weight_initializer",)),
    "bias_init": ("Flax's bias_init=", ("bias_initializer",)),
    "embedding_init": ("Flax's embedding_init=", ("initializer",)),
    "embeddings_initializer": ("Keras's embeddings_initializer=", ("initializer",)),
    "dropout_rate": ("Flax's dropout_rate=", ("dropout", "rate")),
    "hidden_sizes": ("an MLP's hidden_sizes=", ("widths",)),
    "hidden_dims": ("an MLP's hidden_dims=", ("widths",)),
    "hidden": ("an MLP's hidden=", ("widths",)),
    "batch_first": ("torch's batch_first=", ()),
}

def foreign_argument(cls: type, init: Any, args: tuple, kwargs: dict[str, Any]) -> TypeError | None:
    """The error for ``cls(*args, **kwargs)`` when ``init``'s signature refuses one of the
    keywords (None otherwise: the constructor's own TypeError stands). Every refused
    keyword that is another library's name for one of the layer's parameters is named in
    one error, with the call that works; a keyword that is not gets the close names.

    Example:
      >>> import functree as ft, jax
      >>> try:
      ...     ft.nn.Dense(3, 4, bias=False, key=jax.random.key(0))
      ... except TypeError as e:
      ...     print(str(e).splitlines()[0])
      ft.nn.Dense() got an unexpected keyword argument 'bias': torch's bias= is use_bias= here.
    """
    try:
        params = inspect.signature(init).parameters
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return None
    unknown = [k for k in kwargs if k not in params]
    if not unknown:
        return None
    shown = public_name(cls)
    known = [n for n, p in list(params.items())[1:]
             if p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.POSITIONAL_ONLY)]
    found = {name: _renamed(name, params) for name in unknown}
    strange = [n for n, r in found.items() if r is None]
    if strange:
        close = difflib.get_close_matches(strange[0], known, n=3, cutoff=0.6)
        hint = f"; did you mean {' or '.join(c + '=' for c in close)}?" if close else "."
        return TypeError(UNKNOWN_ARGUMENT.format(cls=shown, name=strange[0], close=hint, params=", ".join(known)))
    names = ", ".join(repr(n) for n in unknown)
    why = "; ".join(found[n][0] for n in unknown)  # type: ignore[index]
    wrong = ", ".join(f"{n}={kwargs[n]!r}" for n in unknown)
    right = ", ".join(f"{p}={kwargs[n]!r}" for n in unknown for p in found[n][1])  # type: ignore[index]
    plural = "s" if len(unknown) > 1 else ""
    return TypeError(FOREIGN_ARGUMENT.format(cls=shown, plural=plural, names=names, why=why + ".", wrong=wrong,
                                     right=right))


def _renamed(name: str, params: Any) -> tuple[str, tuple[str, ...]] | None:
    """``(why, functree's parameters)`` for another library's keyword ``name`` where this
    signature has them, else None."""
    foreign = FOREIGN_ARGUMENTS.get(name)
    if foreign is None:
        return None
    whose, targets = foreign
    for target in targets:
        parts = tuple(target.split("+"))
        if all(p in params for p in parts):
            return f"{whose} is {' and '.join(p + '=' for p in parts)} here", parts
    return None


def public_name(cls: type) -> str:
    """``ft.nn.Dense`` for a class of ``functree.nn._linear``; a user's class by its name."""
    parts = cls.__module__.split(".")
    if parts[0] != "functree":
        return cls.__name__
    package = parts[1] if len(parts) > 1 and not parts[1].startswith("_") else ""
    return ".".join(p for p in ("ft", package, cls.__name__) if p)
