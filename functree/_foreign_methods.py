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

__all__ = ["FOREIGN_METHOD", "FOREIGN_METHODS", "FOREIGN_FUNCTION", "FOREIGN_FUNCTIONS", "missing_attribute",
           "missing_module_attribute"]

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


FOREIGN_FUNCTION = """\
module {package!r} has no attribute {name!r}: {what}

    right:  {right}"""

# package -> name -> (what the name is in Equinox / Flax NNX, functree's way): the functions
# and classes a migrating user reaches for (ft.filter_jit, ft.nn.Linear), read by the
# packages' module __getattr__ (functree/_lazy.py).
FOREIGN_FUNCTIONS: dict[str, dict[str, tuple[str, str]]] = {
    "functree": {
        "filter_jit": ("Equinox's eqx.filter_jit is ft.jit here (a module's configuration is static "
                       "already; Python flags and sizes as arguments are static_argnames)",
                       "ft.jit(step)                               # ft.jit(step, static_leaves=True) for function leaves"),
        "filter_grad": ("Equinox's eqx.filter_grad is ft.gradient here (only parameters are differentiated)",
                        "grads = ft.gradient(loss_fn, at=model)     # or ft.gradient(loss_fn)(model, x, y)"),
        "filter_value_and_grad": ("Equinox's eqx.filter_value_and_grad is ft.value_with_gradient here",
                                  "loss, grads = ft.value_with_gradient(loss_fn)(model, x, y)"),
        "apply_updates": ("Equinox's eqx.apply_updates (optax.apply_updates) is ft.move here: it keeps "
                          "the non-parameters (BatchNorm statistics) the updates hold None for",
                          "model = ft.move(model, along=updates)"),
        "partition": ("Equinox's eqx.partition splits out the trained part; here the parameter view is "
                      "ft.parameters(model), and a part is trained by name with wrt=",
                      "ft.optim.Optimizer(ft.optim.adam(1e-3), wrt=\"head.*\")   # or ft.gradient(f, at=model, wrt=...)"),
        "combine": ("Equinox's eqx.combine puts a partition back together; here parameters go into a "
                    "model with ft.with_parameters",
                    "model = ft.with_parameters(model, params)"),
        "filter": ("Equinox's eqx.filter(model, eqx.is_array) is the parameter view here",
                   "params = ft.parameters(model)"),
        "tree_at": ("Equinox's eqx.tree_at replaces a leaf; here by key path (eqx.tree_at works too)",
                    "model = ft.set(model, \"head.weight\", w)     # or model.replace(head=...)"),
        "value_and_grad": ("Flax NNX's nnx.value_and_grad is ft.value_with_gradient here",
                           "loss, grads = ft.value_with_gradient(loss_fn, at=model)"),
        "grad": ("Flax NNX's nnx.grad is ft.gradient here", "grads = ft.gradient(loss_fn, at=model)"),
        "split": ("Flax NNX's nnx.split is not needed: the model is the pytree; its parameter view is "
                  "ft.parameters(model)", "params = ft.parameters(model)"),
        "merge": ("Flax NNX's nnx.merge is ft.with_parameters here", "model = ft.with_parameters(model, params)"),
        "state": ("Flax NNX's nnx.state is the flat dict by name here", "ft.to_flat_dict(model)"),
    },
    "functree.nn": {
        "Linear": ("Equinox's eqx.nn.Linear and NNX's nnx.Linear are ft.nn.Dense here (weight [in, out], "
                   "any leading batch axes)", "ft.nn.Dense(in_size, out_size, key=jax.random.key(0))"),
        "inference_mode": ("Equinox's eqx.nn.inference_mode is ft.nn.inference here",
                           "model = ft.nn.inference(model)             # ft.nn.training(model) the other way"),
        "make_with_state": ("Equinox's eqx.nn.make_with_state is not needed: layer state (BatchNorm) lives in "
                            "the model and train_step / the Trainer collect it",
                            "model = MyModel(..., key=key)              # by hand: ft.nn.value_with_gradient_and_state"),
        "Conv": ("Flax's nnx.Conv is ft.nn.Conv1D / ft.nn.Conv2D here (channels last)",
                 "ft.nn.Conv2D(in_channels, out_channels, 3, key=jax.random.key(0))"),
        "Conv2d": ("Equinox's eqx.nn.Conv2d is ft.nn.Conv2D here (channels last: [..., H, W, C])",
                   "ft.nn.Conv2D(in_channels, out_channels, 3, key=jax.random.key(0))"),
        "MultiHeadAttention": ("Flax NNX's nnx.MultiHeadAttention is ft.nn.MultiheadAttention here",
                               "ft.nn.MultiheadAttention(query_size, num_heads, key=jax.random.key(0))"),
        "Rngs": ("Flax NNX's nnx.Rngs is not needed: layers take key= at construction, and Dropout a key per call",
                 "ft.nn.Dense(4, 3, key=jax.random.key(0));  model(x, key=jax.random.fold_in(key, step))"),
    },
}


def missing_module_attribute(package: str, name: str) -> AttributeError:
    """The error for ``ft.<name>`` (``ft.nn.<name>``) that the package lacks: another
    library's name (:data:`FOREIGN_FUNCTIONS`) with functree's way, else Python's own message.

    Example:
      >>> import functree as ft
      >>> ft.filter_jit
      Traceback (most recent call last):
      ...
      AttributeError: module 'functree' has no attribute 'filter_jit': Equinox's eqx.filter_jit is ft.jit here ...
    """
    found = FOREIGN_FUNCTIONS.get(package, {}).get(name)
    if found is None:
        return AttributeError(f"module {package!r} has no attribute {name!r}")
    what, right = found
    return AttributeError(FOREIGN_FUNCTION.format(package=package, name=name, what=what, right=right))


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
