"""Other libraries' model methods, named with functree's equivalent when a model lacks them.

A migrating user calls Flax's ``model.apply(params, x)`` or ``model.init(key, x)``, NNX's or
torch's ``model.train()`` / ``model.eval()``, torch's ``model.parameters()`` or
``model.state_dict()`` out of habit; Python's ``'Net' object has no attribute 'apply'``
says neither why (a functree model holds its parameters and is called directly) nor what
to write. :func:`missing_attribute` makes the error for ``Module.__getattr__``, which
Python calls only for a name that normal lookup did not find (a field, a method or a
property of the class always wins; no cost on any other attribute read). A property of the
class that raised ``AttributeError`` itself is run again by ``Module.__getattr__`` so that
its own error, not "no attribute", is the one raised.
"""

from __future__ import annotations

from typing import Any

__all__ = ["FOREIGN_METHOD", "FOREIGN_METHODS", "missing_attribute"]

FOREIGN_METHOD = """\
'{cls}' object has no attribute {name!r}: {why}

    wrong:  {wrong}
    right:  {right}"""

# name -> (why, wrong, right): the library whose method it is and functree's way.
FOREIGN_METHODS: dict[str, tuple[str, str, str]] = {
    "apply": ("Flax's model.apply(params, x) runs a model on a parameter tree held apart; a functree "
              "model holds its parameters and is called directly (its parameter view is "
              "ft.parameters(model); other parameters go in with ft.with_parameters).",
              "model.apply(params, x)",
              "model(x)                                   # or ft.with_parameters(model, params)(x)"),
    "init": ("Flax's model.init(key, x) draws the parameters apart from the model; a functree "
             "model is built with them, by its constructor's key.",
             "params = model.init(jax.random.key(0), x)",
             "model = MyModel(..., key=jax.random.key(0));  params = ft.parameters(model)"),
    "train": ("NNX's and torch's model.train() switch the model in place; a functree model is "
              "an immutable value, and the mode switch returns a new model.",
              "model.train()",
              "model = ft.nn.training(model)"),
    "eval": ("NNX's and torch's model.eval() switch the model in place; a functree model is "
             "an immutable value, and the mode switch returns a new model.",
             "model.eval()",
             "model = ft.nn.inference(model)             # or ft.nn.inferring(model, x) for one call"),
    "parameters": ("torch's model.parameters() lists the tensors to train; functree's parameter "
                   "view is a function of the model.",
                   "model.parameters()",
                   "ft.parameters(model)                       # or ft.to_flat_dict(model) by name"),
    "state_dict": ("torch's model.state_dict() is a flat dict by name; functree's is a function of "
                   "the model.",
                   "model.state_dict()",
                   "ft.to_flat_dict(model)                     # or ft.nn.torch_state_dict(model) in torch's layout"),
}


def missing_attribute(obj: Any, name: str) -> AttributeError:
    """The error for ``model.<name>`` that the class lacks: another library's method
    (:data:`FOREIGN_METHODS`) with functree's equivalent, else Python's own message.

    Example:
      >>> import functree as ft, jax
      >>> ft.nn.Dense(2, 3, key=jax.random.key(0)).eval()
      Traceback (most recent call last):
      ...
      AttributeError: 'Dense' object has no attribute 'eval': NNX's and torch's model.eval() ...
      <BLANKLINE>
          wrong:  model.eval()
          right:  model = ft.nn.inference(model)             # or ft.nn.inferring(model, x) for one call
    """
    cls = type(obj)
    if name in FOREIGN_METHODS:
        why, wrong, right = FOREIGN_METHODS[name]
        text = FOREIGN_METHOD.format(cls=cls.__name__, name=name, why=why, wrong=wrong, right=right)
    else:
        text = f"'{cls.__name__}' object has no attribute {name!r}"
    return AttributeError(text, name=name, obj=obj)  # name, obj: Python's "Did you mean" hint
