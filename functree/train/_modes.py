"""The modes a model trains in, as a train step and the Trainer read them: the layers with
a static ``training`` flag (:func:`mode_layers`), how a warning names them
(:func:`named_layers`), and :class:`TrainingModeWarning`, with the train step's own
first-call check (:func:`warn_step_in_inference`). Below both ``_step`` and ``_setup``,
which import it."""

from __future__ import annotations

import warnings
from typing import Any

import jax

from functree import nn
from functree._module import Module
from functree._tree import dotted_name

__all__ = ["SHOWN", "STEP_IN_INFERENCE", "TrainingModeWarning", "has_mode", "mode_layers", "named_layers",
           "warn_step_in_inference"]

SHOWN = 3  # layers named in a warning before "and N more"

# train_step keeps the modes it is given (the Trainer switches a fresh model): a user from
# Equinox, NNX or torch, whose layers start in training mode, trains a fresh functree model
# with Dropout off and BatchNorm frozen, the key given changing nothing.
STEP_IN_INFERENCE = """\
train_step was called with a key, but the model is wholly in inference mode: {paths} \
{run} as at inference (Dropout off, BatchNorm normalising with its fixed running statistics), \
so the step trains another model than one in training mode, and the key changes nothing there. \
functree's layers start in inference mode (Equinox's, NNX's and torch's start in training); \
the Trainer switches a fresh model, train_step keeps the modes it is given:

    wrong:  model, opt_state, metrics = step(model, opt_state, batch, key=key)   # a fresh model
    right:  model = ft.nn.training(model)                                         # once, before the loop
       or:  step(model, opt_state, batch)      # no key: inference mode meant (frozen statistics, no dropout)
       or:  warnings.filterwarnings("ignore", category=ft.train.TrainingModeWarning)   # inference meant, the key for the loss"""


class TrainingModeWarning(UserWarning):
    """``Trainer(training=None)`` had to guess the modes a model trains in, and the guess
    may not be the user's: a model mixing modes (kept as given, :data:`MIXED_MODES`; a
    fresh head's Dropout stays off), or one wholly in inference switched to training whose
    BatchNorm holds trained or loaded statistics (:data:`LOADED_STATE_SWITCHED`). Passing
    ``training=True`` or ``training=False`` says which and silences it. Also a
    ``train_step`` given a key and a model wholly in inference mode (:data:`STEP_IN_INFERENCE`:
    ``ft.nn.training(model)``, or no key, says which)."""


def named_layers(layers: list[tuple[Any, Any]]) -> str:
    """``backbone.layers.1 (BatchNorm), ...`` for the first :data:`SHOWN`, then a count."""
    names = [f"{dotted_name(path) or 'the model'} ({type(layer).__name__})" for path, layer in layers]
    more = len(names) - SHOWN
    return ", ".join(names[:SHOWN]) + (f" and {more} more" if more > 0 else "")


def mode_layers(model: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[tuple[Any, ...], Any]]:
    """The functree layers in ``model`` with a static ``training`` flag, with their key
    paths, outer before inner (an Attention and the Dropout inside it)."""
    found: list[tuple[tuple[Any, ...], Any]] = [(prefix, model)] if not prefix and has_mode(model) else []
    inner = jax.tree_util.tree_flatten_with_path(model, is_leaf=lambda x: x is not model and has_mode(x))[0]
    for path, node in inner:
        if has_mode(node):
            found.append((prefix + path, node))
            found += mode_layers(node, prefix + path)
    return found


def has_mode(x: Any) -> bool:
    return isinstance(x, Module) and "training" in type(x).__ft_static__  # type: ignore[attr-defined]


def warn_step_in_inference(model: Any) -> None:
    """:data:`STEP_IN_INFERENCE` (a :class:`TrainingModeWarning`) when ``model`` has layers
    that train otherwise than they infer (a BatchNorm, a Dropout of a rate above 0) and no
    functree layer in training mode; a train step's first call given a key."""
    layers = mode_layers(model)
    if not layers or any(layer.training for _, layer in layers):
        return
    acting = [(path, layer) for path, layer in layers if isinstance(layer, nn.BatchNorm)
              or float(getattr(layer, "rate", 0.0) or getattr(layer, "dropout", 0.0) or 0.0) > 0]
    if acting:
        warnings.warn(STEP_IN_INFERENCE.format(paths=named_layers(acting), run="run" if len(acting) > 1 else "runs"),
                      TrainingModeWarning, stacklevel=4)
