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

__all__ = ["FOREIGN_METHOD", "FOREIGN_METHODS", "OPTIMIZER_METHODS", "LINEN_SETUP", "FOREIGN_FUNCTION", "FOREIGN_FUNCTIONS", "missing_attribute",
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
    # torch's nn.Module habits
    "named_parameters": ("torch's model.named_parameters() pairs names and tensors; here the parameter "
                         "view is flattened by dotted key path.",
                         "for name, p in model.named_parameters(): ...",
                         "for name, p in ft.to_flat_dict(ft.parameters(model)).items(): ..."),
    "load_state_dict": ("torch's model.load_state_dict(sd) fills the model in place; a functree model is "
                        "immutable: the load returns a new model.",
                        "model.load_state_dict(sd)",
                        "model = ft.from_flat_dict(model, sd)       # a torch state_dict: ft.nn.load_torch_state_dict(model, sd)"),
    "to": ("torch's model.to(device) / .to(dtype) moves or casts in place; JAX places arrays on the "
           "default device (the accelerator) already, and a cast returns a new model.",
           "model.to(device)",
           "model = jax.device_put(model, jax.devices()[0])   # a dtype: model = ft.cast(model, jnp.bfloat16)"),
    "cuda": ("torch's model.cuda() moves the tensors to the GPU; JAX puts new arrays on the default "
             "device, which is the GPU when there is one: nothing to move.",
             "model.cuda()",
             "model = jax.device_put(model, jax.devices(\"gpu\")[0])   # only to choose a device"),
    "cpu": ("torch's model.cpu() moves the tensors to host memory; here a placement returns a new model.",
            "model.cpu()",
            "model = jax.device_put(model, jax.devices(\"cpu\")[0])   # NumPy arrays: jax.device_get(model)"),
    "half": ("torch's model.half() casts in place; ft.cast returns a new model with its floating "
             "parameters cast.", "model.half()", "model = ft.cast(model, jnp.float16)"),
    "bfloat16": ("torch's model.bfloat16() casts in place; ft.cast returns a new model with its floating "
                 "parameters cast.", "model.bfloat16()", "model = ft.cast(model, jnp.bfloat16)"),
    "zero_grad": ("torch accumulates gradients in .grad until zeroed; ft.gradient returns fresh gradients "
                  "each call, so there is nothing to zero.",
                  "model.zero_grad()",
                  "grads = ft.gradient(loss_fn, at=model)     # delete the zero_grad() line"),
    "forward": ("torch's model.forward(x) is the call itself here (a functree model's __call__).",
                "model.forward(x)", "model(x)"),
    "requires_grad_": ("torch's requires_grad_(False) freezes tensors in place; here the trained part is "
                       "chosen by key-path patterns where the gradient is taken.",
                       "model.backbone.requires_grad_(False)",
                       "ft.optim.Optimizer(ft.optim.adam(1e-3), wrt=\"head.*\")   # or ft.gradient(f, at=model, wrt=...)"),
    # Keras's Model habits
    "compile": ("Keras's model.compile(optimizer, loss, metrics) configures training on the model; here "
                "a Trainer holds the model, the optimizer and loss_fn(model, batch).",
                "model.compile(optimizer=\"adam\", loss=\"sparse_categorical_crossentropy\", metrics=[\"accuracy\"])",
                "trainer = ft.train.Trainer(model, ft.optim.adam(1e-3), loss_fn, metrics=[\"accuracy\"])"),
    "fit": ("Keras's model.fit trains the model in place; here the Trainer trains (and holds) it.",
            "model.fit(x, y, epochs=5, validation_data=(x_val, y_val))",
            "trainer.fit((x, y), epochs=5, validation_data=(x_val, y_val));  model = trainer.model"),
    "evaluate": ("Keras's model.evaluate(x, y) is the Trainer's here.",
                 "model.evaluate(x, y)", "trainer.evaluate((x, y))"),
    "predict": ("Keras's model.predict(x) is the call itself here (a fresh model is in inference mode), "
                "or the Trainer's predict in minibatches.",
                "model.predict(x)", "model(x)                                   # or trainer.predict(x, batch_size=256)"),
    "summary": ("Keras's model.summary() prints the layers; ft.summary(model) is the table of its leaves "
                "by key path, with parameter totals.", "model.summary()", "print(ft.summary(model))"),
    "count_params": ("Keras's model.count_params() is the summary's total here.",
                     "model.count_params()", "ft.summary(model).parameter_count"),
    "num_parameters": ("Hugging Face's model.num_parameters() is the summary's total here.",
                       "model.num_parameters()", "ft.summary(model).parameter_count"),
    "tabulate": ("Flax's nn.tabulate(model, ...) is ft.summary here: the table of the model's leaves by key path.",
                 "model.tabulate(x)", "print(ft.summary(model))"),
    **dict.fromkeys(("modules", "named_modules", "children"), (
        "torch's model.modules() walks the submodules; here their key paths are listed, by type if you "
        "like, and each read or replaced through its path (a new model: modules are immutable).",
        "for m in model.modules():  if isinstance(m, nn.Conv2d): nn.init.kaiming_normal_(m.weight)",
        "for path in ft.recursively_all_key_paths(model, to=ft.nn.Conv2D):  layer = path.get(model);  "
        "model = path.set(model, layer.replace(weight=ft.nn.initializers.kaiming_normal()(k, layer.weight.shape)))")),
    "get_weights": ("Keras's model.get_weights() lists the arrays; here the parameter view is a function of the "
                    "model (by name: ft.to_flat_dict).", "model.get_weights()", "ft.to_flat_dict(ft.parameters(model))"),
    "set_weights": ("Keras's model.set_weights(ws) fills the model in place; a functree model is immutable: a new "
                    "one is made with the arrays.", "model.set_weights(ws)", "model = ft.with_parameters(model, params)"),
    "trainable_variables": ("Keras's model.trainable_variables lists the trained tensors; here the "
                            "parameter view is a function of the model.",
                            "model.trainable_variables", "ft.parameters(model)"),
    "save_weights": ("Keras's model.save_weights(path) is ft.train.save here (any tree: a model, an "
                     "optimizer state).", "model.save_weights(path)", "ft.train.save(path, model)"),
    "load_weights": ("Keras's model.load_weights(path) fills the model in place; ft.train.load returns the "
                     "tree, checked leaf by leaf against the template.",
                     "model.load_weights(path)", "model = ft.train.load(path, model)"),
    "float": ("torch's model.float() casts in place; ft.cast returns a new model with its floating "
              "parameters cast.", "model.float()", "model = ft.cast(model, jnp.float32)"),
    "double": ("torch's model.double() casts in place; ft.cast returns a new model with its floating "
               "parameters cast (float64 needs jax.config.update(\"jax_enable_x64\", True)).",
               "model.double()", "model = ft.cast(model, jnp.float64)"),
    "save": ("Keras's model.save(path) is ft.train.save here (any tree: a model, an optimizer state).",
             "model.save(path)", "ft.train.save(path, model)"),
    # Flax linen's bound-module habits
    "bind": ("Flax linen's model.bind(variables) makes a module holding a parameter tree; a functree "
             "model holds its parameters, and other parameters go in with ft.with_parameters.",
             "bound = model.bind({\"params\": params})",
             "model = ft.with_parameters(model, params)"),
    "unbind": ("Flax linen's model.unbind() splits a bound module from its variables; a functree model "
               "is its parameters' tree, and the parameter view is ft.parameters(model).",
               "module, variables = model.unbind()", "params = ft.parameters(model)"),
    "init_with_output": ("Flax linen's init_with_output draws the parameters apart from the model and "
                         "runs it; a functree model is built with them, by its constructor's key.",
                         "out, variables = model.init_with_output(key, x)",
                         "model = MyModel(..., key=key);  out = model(x)"),
    "make_rng": ("Flax linen's self.make_rng(\"dropout\") draws from keys given to apply; here a layer "
                 "takes its key as an argument of the call.",
                 "key = self.make_rng(\"dropout\")",
                 "def __call__(self, x, *, key=None): ...   # model(x, key=jax.random.fold_in(key, step))"),
    "sow": ("Flax linen's self.sow stores intermediates in a collection; here the call returns them "
            "(the Trainer and ft.value_with_gradient take (loss, aux)).",
            "self.sow(\"intermediates\", \"h\", h)",
            "return out, {\"h\": h}                       # has_aux=True where it is differentiated"),
    "variables": ("Flax's model.variables (and nnx.state) is the flat dict by name here.",
                  "model.variables", "ft.to_flat_dict(model)                     # parameters only: ft.parameters(model)"),
}

# name -> (why, wrong, right): torch's optimizer methods on ft.optim.Optimizer (its state is a
# value passed in and returned, the gradients are values: nothing is held to zero or step).
OPTIMIZER_METHODS: dict[str, tuple[str, str, str]] = {
    "zero_grad": ("torch accumulates gradients in the parameters' .grad until zeroed; here gradients "
                  "are values each call returns, so there is nothing to zero.",
                  "optimizer.zero_grad()",
                  "grads = ft.gradient(loss_fn, at=model)     # delete the zero_grad() line"),
    "param_groups": ("torch's param_groups hold per-group hyperparameters; here they live in the optimizer "
                     "state, and groups are chosen by key path.",
                     "optimizer.param_groups[0][\"lr\"] = 1e-4",
                     "ft.optim.hyperparameters(opt_state)[\"learning_rate\"]   # groups: ft.optim.groups({...})"),
    "state_dict": ("torch's optimizer.state_dict() is its state; here the state is the value optimizer.init "
                   "returned and each step passes on: save that.",
                   "torch.save(optimizer.state_dict(), path)", "ft.train.save(path, opt_state)"),
    "load_state_dict": ("torch's optimizer.load_state_dict(sd) fills the optimizer in place; here the state "
                        "is a value: load it.",
                        "optimizer.load_state_dict(sd)", "opt_state = ft.train.load(path, optimizer.init(model))"),
}

# A Flax linen port: submodules made in setup(), which linen calls lazily and functree never
# does; the first read of one found no attribute.
LINEN_SETUP = """\
'{cls}' object has no attribute {name!r}: {cls} defines setup(), where Flax linen makes its \
submodules; functree never calls it. Declare the fields on the class and set them in __init__:

    wrong:  def setup(self): self.{name} = ft.nn.Dense(4, 3, key=key)
    right:  {name}: ft.nn.Dense                  # a field of the class
            def __init__(self, *, key): self.{name} = ft.nn.Dense(4, 3, key=key)"""


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
        "value_and_grad": ("JAX's jax.value_and_grad and Flax NNX's nnx.value_and_grad are ft.value_with_gradient "
                           "here (argnums is wrt=)",
                           "loss, grads = ft.value_with_gradient(loss_fn, at=model)"),
        "grad": ("JAX's jax.grad and Flax NNX's nnx.grad are ft.gradient here (argnums is wrt=)",
                 "grads = ft.gradient(loss_fn, at=model)"),
        # JAX's and torch's differentiation names: Swift's names here (functree's operators)
        "stop_gradient": ("JAX's jax.lax.stop_gradient is ft.without_derivative here (jax.lax.stop_gradient "
                          "works too)", "y = ft.without_derivative(x)"),
        "detach": ("torch's x.detach() is ft.without_derivative(x) here", "y = ft.without_derivative(x)"),
        "vjp": ("JAX's jax.vjp(f, x) is ft.value_with_pullback here (the pullback is vjp's function)",
                "y, pb = ft.value_with_pullback(f, at=x);  dx = pb(jnp.ones_like(y))"),
        "jvp": ("JAX's jax.jvp(f, (x,), (t,)) is ft.value_with_differential here: the differential "
                "pushes any tangent forward", "y, df = ft.value_with_differential(f, at=x);  dy = df(t)"),
        "linearize": ("JAX's jax.linearize(f, x) is ft.value_with_differential here",
                      "y, df = ft.value_with_differential(f, at=x);  dy = df(t)"),
        "jacrev": ("JAX's jax.jacrev is ft.jacobian here (reverse mode is its default)", "J = ft.jacobian(f, at=x)"),
        "jacfwd": ("JAX's jax.jacfwd is ft.jacobian(mode=\"forward\") here",
                   "J = ft.jacobian(f, at=x, mode=\"forward\")"),
        "checkpoint": ("JAX's jax.checkpoint (jax.remat) is ft.with_recomputation_in_pullbacks here "
                       "(Swift's name; policy= takes jax.checkpoint_policies' names)",
                       "g = ft.with_recomputation_in_pullbacks(f)   # or @ft.with_recomputation_in_pullbacks(policy=...)"),
        "remat": ("JAX's jax.remat (jax.checkpoint) is ft.with_recomputation_in_pullbacks here (Swift's name)",
                  "g = ft.with_recomputation_in_pullbacks(f)   # or @ft.with_recomputation_in_pullbacks(policy=...)"),
        "custom_vjp": ("JAX's jax.custom_vjp with f.defvjp(fwd, bwd) is Swift's @ft.derivative(of=f) here: one "
                       "rule returns (value, pullback)",
                       "f = ft.derivative(of=f)(rule)   # def rule(x): return f(x), lambda v: v * dfdx"),
        "custom_jvp": ("JAX's jax.custom_jvp with f.defjvp(rule) is @ft.derivative(of=f, mode=\"forward\") here: "
                       "one rule returns (value, differential)",
                       "f = ft.derivative(of=f, mode=\"forward\")(rule)   # def rule(x): return f(x), lambda t: dfdx * t"),
        "enable_grad": ("torch.enable_grad() switches a gradient tape back on; JAX records none: every "
                        "function is differentiated where an operator takes it", "grads = ft.gradient(loss_fn, at=model)   # no context needed"),
        "set_grad_enabled": ("torch.set_grad_enabled(mode) switches a gradient tape; JAX records none: code "
                             "outside ft.gradient computes no derivative",
                             "grads = ft.gradient(loss_fn, at=model)   # no context needed"),
        "autograd": ("torch.autograd.grad(loss, params) differentiates a value a tape recorded; here the "
                     "function is differentiated",
                     "grads = ft.gradient(loss_fn, at=model)     # loss_fn(model) returns the loss"),
        "split": ("Flax NNX's nnx.split is not needed: the model is the pytree; its parameter view is "
                  "ft.parameters(model)", "params = ft.parameters(model)"),
        "merge": ("Flax NNX's nnx.merge is ft.with_parameters here", "model = ft.with_parameters(model, params)"),
        "state": ("Flax NNX's nnx.state is the flat dict by name here", "ft.to_flat_dict(model)"),
        "no_grad": ("torch.no_grad() switches off a gradient tape; JAX records none: code outside "
                    "ft.gradient computes no derivative, and ft.without_derivative(at=x) stops one "
                    "through x inside it", "out = model(x)                            # no context needed"),
        "inference_mode": ("torch.inference_mode() is no_grad here (JAX records no tape); the model's "
                           "inference mode (Dropout off, BatchNorm's running statistics) is ft.nn.inference",
                           "out = ft.nn.inference(model)(x)"),
        "manual_seed": ("torch.manual_seed(seed) sets a global generator; JAX's keys are values passed "
                        "where randomness is drawn", "key = jax.random.key(seed);  model = MyModel(..., key=key)"),
        "save": ("torch.save(obj, path) is ft.train.save here (any tree: a model, an optimizer state; the "
                 "path first)", "ft.train.save(path, model)"),
        "load": ("torch.load(path) is ft.train.load here (with the model as template, checked leaf by leaf)",
                 "model = ft.train.load(path, model)"),
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
        "Module": ("torch's nn.Module and Flax's nn.Module are ft.Module here (a frozen dataclass: fields "
                   "are declared on the class, set in __init__)",
                   "class Net(ft.Module):  layer: ft.nn.Dense;  def __call__(self, x): ..."),
        "ReLU": ("torch's and Keras's activation layers are functions here; Sequential takes them as layers",
                 "ft.nn.Sequential(ft.nn.Dense(4, 8, key=k), ft.nn.relu, ...)   # or ft.nn.relu(x)"),
        **{name: (f"torch's nn.{name}(dim=...) is the function ft.nn.{fn} here; Sequential takes it as a layer "
                  "(torch's dim=1 of [N, C] or NCHW is the last axis here: channels last)",
                  f"ft.nn.Sequential(..., ft.nn.{fn}, ...)   # or ft.nn.{fn}(x, axis=-1)")
           for name, fn in (("Softmax", "softmax"), ("LogSoftmax", "log_softmax"))},
        "Identity": ("torch's nn.Identity is the function ft.nn.identity here (Sequential takes functions as layers)",
                     "ft.nn.Sequential(..., ft.nn.identity, ...)   # a field: head = ft.nn.identity (a static function)"),
        **dict.fromkeys(("ModuleList", "ParameterList"), (
            "torch's nn.ModuleList / nn.ParameterList are plain lists here: a field holding a list of layers or "
            "arrays (their key paths are layers.0, layers.1, ... as torch's names)",
            "class Net(ft.Module):  layers: list[ft.nn.Dense];   self.layers = [ft.nn.Dense(8, 8, key=k) for k in keys]"
            "   # same layers in a loop: ft.nn.Stack")),
        **dict.fromkeys(("ModuleDict", "ParameterDict"), (
            "torch's nn.ModuleDict / nn.ParameterDict are plain dicts here: a field holding a dict of layers or "
            "arrays (key paths heads.cls, heads.box, as torch's names)",
            "class Net(ft.Module):  heads: dict[str, ft.nn.Dense];   self.heads = {\"cls\": ft.nn.Dense(8, 3, key=k)}")),
        "one_hot": ("torch's F.one_hot(labels, n) is jax.nn.one_hot(labels, n) (floats; torch's are integers)",
                    "jax.nn.one_hot(labels, num_classes)"),
        "scaled_dot_product_attention": ("torch's F.scaled_dot_product_attention is jax.nn.dot_product_attention "
                                         "([batch, seq, heads, head_dim], JAX's layout; torch's is [batch, heads, "
                                         "seq, head_dim]), the kernel ft.nn.MultiheadAttention calls",
                                         "jax.nn.dot_product_attention(q, k, v, is_causal=True)   # q, k, v [B, T, H, D]"),
        "layer_norm": ("torch's F.layer_norm(x, shape, weight, bias) is the layer ft.nn.LayerNorm here (its "
                       "scale and offset are its parameters)", "ft.nn.LayerNorm(shape, epsilon=1e-5)(x)"),
        "dropout": ("torch's F.dropout(x, p, training) is the layer ft.nn.Dropout here, given a key when training",
                    "ft.nn.training(ft.nn.Dropout(p))(x, key=key)   # off in inference mode"),
        "BatchNorm1d": ("torch's nn.BatchNorm1d is ft.nn.BatchNorm here (features on the last axis; "
                        "torch's momentum m is 1 - m here)", "ft.nn.BatchNorm(num_features, momentum=0.9, epsilon=1e-5, unbiased_running_variance=True)   # torch's defaults"),
        "BatchNorm2d": ("torch's nn.BatchNorm2d is ft.nn.BatchNorm here (channels last: [..., H, W, C]; "
                        "torch's momentum m is 1 - m here)", "ft.nn.BatchNorm(num_channels, momentum=0.9, epsilon=1e-5, unbiased_running_variance=True)   # torch's defaults"),
        "CrossEntropyLoss": ("torch's nn.CrossEntropyLoss is a function in ft.losses, (predicted, expected)",
                             "loss = ft.losses.softmax_cross_entropy(logits, labels)"),
        "MSELoss": ("torch's nn.MSELoss is a function in ft.losses, (predicted, expected)",
                    "loss = ft.losses.mean_squared_error(predicted, expected)"),
        "BCEWithLogitsLoss": ("torch's nn.BCEWithLogitsLoss is a function in ft.losses, (predicted, expected)",
                              "loss = ft.losses.sigmoid_cross_entropy(logits, labels)"),
        # torch's other loss classes: each its function in ft.losses (torch's numbers, classes last)
        **{cls: (f"torch's nn.{cls} is the function ft.losses.{call.partition('(')[0]} here (torch's numbers; "
                 "classes and vectors on the last axis, the batch first)", f"loss = ft.losses.{call}")
           for cls, call in {
               "NLLLoss": "nll(log_probs, labels)", "BCELoss": "binary_cross_entropy(probs, labels)",
               "L1Loss": "l1(predicted, expected)", "SmoothL1Loss": "smooth_l1(predicted, expected, beta=1.0)",
               "HuberLoss": "huber(predicted, expected, delta=1.0)", "KLDivLoss": "kl_divergence(jnp.exp(log_q), p)",
               "GaussianNLLLoss": "gaussian_nll(mean, target, variance)",
               "PoissonNLLLoss": "poisson_nll(log_rate, target)",
               "CTCLoss": "ctc(logits, labels, input_lengths, label_lengths)   # batch first: [B, T, C]",
               "CosineEmbeddingLoss": "cosine_embedding(x1, x2, y)", "MarginRankingLoss": "margin_ranking(x1, x2, y)",
               "TripletMarginLoss": "triplet_margin(anchor, positive, negative)",
               "TripletMarginWithDistanceLoss": "triplet_margin_with_distance(anchor, positive, negative, distance=d)",
               "HingeEmbeddingLoss": "hinge_embedding(distances, labels)", "SoftMarginLoss": "soft_margin(scores, labels)",
               "MultiLabelSoftMarginLoss": "multilabel_soft_margin(logits, labels)",
               "MultiMarginLoss": "multi_margin(scores, labels)", "MultiLabelMarginLoss": "multilabel_margin(scores, labels)",
           }.items()},
        "functional": ("torch.nn.functional's activations are ft.nn's functions, its losses ft.losses'",
                       "ft.nn.relu(x);  ft.losses.softmax_cross_entropy(logits, labels)"),
        "utils": ("torch.nn.utils.clip_grad_norm_ clips in place after backward(); here clipping is a "
                  "transformation chained before the optimizer",
                  "optax.chain(ft.optim.clip_by_global_norm(1.0), ft.optim.adam(1e-3))"),
        "clip_grad_norm_": ("torch's clip_grad_norm_ clips in place after backward(); here clipping is a "
                            "transformation chained before the optimizer",
                            "optax.chain(ft.optim.clip_by_global_norm(1.0), ft.optim.adam(1e-3))"),
        "CosineSimilarity": ("torch's nn.CosineSimilarity is the function ft.nn.cosine_similarity here (over the "
                             "last axis by default: torch's dim=1 is axis=1)",
                             "ft.nn.cosine_similarity(x1, x2, axis=-1, eps=1e-8)"),
        "PairwiseDistance": ("torch's nn.PairwiseDistance is the function ft.nn.pairwise_distance here",
                             "ft.nn.pairwise_distance(x1, x2, p=2.0, eps=1e-6)"),
        # torch's 1d/2d/3d image and sequence layers: ft.nn's 1D/2D/3D, channels last
        **{f"{base}{n}d": (f"torch's nn.{base}{n}d is ft.nn.{base}{n}D here (channels last: [..., "
                           f"{('length', 'height, width', 'depth, height, width')[n - 1]}, channels]{note})",
                           f"ft.nn.{base}{n}D({args})")
           for base, (args, note) in {
               "ZeroPad": ("1", "; pads per axis in the input's order, ((top, bottom), (left, right)), "
                           "not torch's flat (left, right, top, bottom)"),
               "ConstantPad": ("1, 0.5", "; pads per axis in the input's order"),
               "ReflectionPad": ("1", "; pads per axis in the input's order"),
               "ReplicationPad": ("1", "; pads per axis in the input's order"),
               "CircularPad": ("1", "; pads per axis in the input's order"),
               "InstanceNorm": ("4, affine=True", "; torch's momentum m is momentum=1 - m here"),
               "Dropout": ("0.5", ""),
               "LPPool": ("2, 3", "; norm_type, pool_size, strides"),
           }.items() for n in (1, 2, 3)},
        "Upsample": ("torch's nn.Upsample is ft.nn.Upsample1D / Upsample2D / Upsample3D here (one per number of "
                     "spatial axes, channels last; modes linear / bilinear, bicubic / trilinear)",
                     'ft.nn.Upsample2D(scale_factor=2, mode="bilinear")'),
        "UpsamplingNearest2d": ("torch's nn.UpsamplingNearest2d is ft.nn.UpsamplingNearest2D here (channels last)",
                                "ft.nn.UpsamplingNearest2D(scale_factor=2)"),
        "UpsamplingBilinear2d": ("torch's nn.UpsamplingBilinear2d is ft.nn.UpsamplingBilinear2D here (channels "
                                 "last; align_corners=True, as torch's)", "ft.nn.UpsamplingBilinear2D(scale_factor=2)"),
        "pad": ("torch's F.pad is jnp.pad here (or a layer: ft.nn.ZeroPad2D, ReflectionPad2D... pairs per axis in "
                "the input's order)", "ft.nn.ReflectionPad2D(((1, 1), (2, 2)))"),
        "Rngs": ("Flax NNX's nnx.Rngs is not needed: layers take key= at construction, and Dropout a key per call",
                 "ft.nn.Dense(4, 3, key=jax.random.key(0));  model(x, key=jax.random.fold_in(key, step))"),
    },
    "functree.train": {
        "restore": ("Orbax's restore(path) is ft.train.load here, given the tree it fills as its template "
                    "(a Trainer's trainer.restore(path) continues a whole job)",
                    "model = ft.train.load(path, MyModel(..., key=jax.random.key(0)))"),
        **dict.fromkeys(("load_checkpoint", "restore_checkpoint"), (
            "a checkpoint is read with ft.train.load (any tree: a model, an optimizer state), given the tree "
            "it fills as its template", "model = ft.train.load(path, model)")),
        **dict.fromkeys(("save_checkpoint", "save_model"), (
            "a checkpoint is written with ft.train.save (any tree: a model, an optimizer state)",
            "ft.train.save(path, model)")),
        "TensorBoard": ("Keras's callbacks.TensorBoard is ft.train.TensorBoardLogger here",
                        "trainer.fit(data, epochs=5, callbacks=[ft.train.TensorBoardLogger(log_dir)])"),
        "LearningRateScheduler": ("Keras's LearningRateScheduler callback is a schedule given as the learning "
                                  "rate here (the optimizer's state counts the steps)",
                                  "ft.optim.adam(ft.optim.cosine_decay(1e-3, 1000))"),
        "fit": ("Keras's model.fit is Trainer.fit here: a Trainer holds the model, the optimizer and the loss",
                "ft.train.Trainer(model, ft.optim.adam(1e-3), loss_fn).fit((x, y), epochs=5)"),
    },
    "functree.optim": {
        "Adam": ("torch's torch.optim.Adam(model.parameters(), lr) holds the parameters; ft.optim.adam takes "
                 "the hyperparameters alone, and its state is made from the model",
                 "tx = ft.optim.adam(1e-3);  opt_state = tx.init(ft.parameters(model))"),
        "AdamW": ("torch's torch.optim.AdamW(model.parameters(), lr) holds the parameters; ft.optim.adamw "
                  "takes the hyperparameters alone (weight_decay=0.01 as torch's default)",
                  "tx = ft.optim.adamw(1e-3);  opt_state = tx.init(ft.parameters(model))"),
        "SGD": ("torch's torch.optim.SGD(model.parameters(), lr, momentum) holds the parameters; "
                "ft.optim.sgd takes the hyperparameters alone",
                "tx = ft.optim.sgd(0.1, momentum=0.9);  opt_state = tx.init(ft.parameters(model))"),
        **{torch: (f"torch's torch.optim.{torch}(model.parameters(), lr) holds the parameters; ft.optim.{ours} "
                   f"takes the hyperparameters alone (torch's numbers{note})",
                   f"tx = ft.optim.{ours}({args});  opt_state = tx.init(ft.parameters(model))")
           for torch, (ours, args, note) in {
               "NAdam": ("nadam", "2e-3", "; NAdamW: decoupled_weight_decay=True"),
               "Rprop": ("rprop", "1e-2, etas=(0.5, 1.2), step_sizes=(1e-6, 50)", ""),
               "ASGD": ("asgd", "1e-2", "; its averaged parameters ax: ft.optim.averaged(opt_state, model)"),
               "RAdam": ("radam", "1e-3", ""),
               "Adamax": ("adamax", "2e-3", ""),
               "Adagrad": ("adagrad", "1e-2, initial_accumulator_value=0.0", "; torch's accumulator starts at 0"),
               "Adadelta": ("adadelta", "1.0, rho=0.9", "; torch's rho is 0.9, ε 1e-6"),
               "RMSprop": ("rmsprop", "1e-2, rho=0.99", "; torch's alpha is rho here"),
           }.items()},
        **dict.fromkeys(("LBFGS", "lbfgs"), (
            "torch's torch.optim.LBFGS steps with a closure (up to max_iter iterations a step); here optax.lbfgs, "
            "one iteration a step with its zoom line search (other numbers than torch's), runs through "
            "ft.optim.Optimizer, whose minimize gives it the loss and its function",
            "opt = ft.optim.Optimizer(optax.lbfgs());  model, opt_state, loss = opt.minimize(loss_fn, model, "
            "opt_state, x, y)")),
        "lr_scheduler": ("torch's lr_scheduler objects are stepped by hand; here a schedule is given as the "
                         "learning rate and the optimizer's state counts the steps",
                         "ft.optim.adam(ft.optim.schedule(optax.cosine_decay_schedule(1e-3, 1000), unit=\"steps\"))"),
        "clip_grad_norm_": ("torch's clip_grad_norm_ clips in place after backward(); here clipping is a "
                            "transformation chained before the optimizer",
                            "optax.chain(ft.optim.clip_by_global_norm(1.0), ft.optim.adam(1e-3))"),
    },
}


def missing_module_attribute(package: str, name: str) -> AttributeError:
    """The error for ``ft.<name>`` (``ft.nn.<name>``) that the package lacks: another
    library's name (:data:`FOREIGN_FUNCTIONS`) with functree's way, else Python's own message
    with up to three public names like it (``ft.paths``: ``ft.all_key_paths``, ...).

    Example:
      >>> import functree as ft
      >>> ft.filter_jit
      Traceback (most recent call last):
      ...
      AttributeError: module 'functree' has no attribute 'filter_jit': Equinox's eqx.filter_jit is ft.jit here ...
    """
    found = FOREIGN_FUNCTIONS.get(package, {}).get(name)
    if found is None and name.startswith("_"):  # a probe (__wrapped__, _repr_html_): Python's own message
        return AttributeError(f"module {package!r} has no attribute {name!r}")
    if found is None:
        public = _public_names(package)
        close = _close_names(name, public)
        short = {"functree": "ft"}.get(package, package.replace("functree.", "ft."))
        hint = "" if not close else ": did you mean " + ", ".join(f"{short}.{n}" for n in close) + "?"
        error = AttributeError(f"module {package!r} has no attribute {name!r}{hint}")
        # Python's own "Did you mean" reads dir(obj): the package's public names only, never
        # a private module (ft.paths suggested functree._paths, the module of key paths).
        error.name, error.obj = name, _PublicNames(public)
        return error
    what, right = found
    return AttributeError(FOREIGN_FUNCTION.format(package=package, name=name, what=what, right=right))


class _PublicNames:
    """An object whose ``dir()`` is a package's public names (Python's suggestions read it)."""

    def __init__(self, names: list[str]):
        self._names = names

    def __dir__(self) -> list[str]:
        return list(self._names)


def _public_names(package: str) -> list[str]:
    import sys

    module = sys.modules.get(package)
    names = getattr(module, "__all__", None)
    return sorted(str(n) for n in names) if names is not None else []


def _close_names(name: str, public: list[str]) -> list[str]:
    """Up to three public names like ``name``: those containing it (``paths`` ->
    ``all_key_paths``), then the closest spellings."""
    import difflib

    lowered = name.lower().strip("_")
    within = [n for n in public if len(lowered) >= 3 and lowered in n.lower()]
    spelled = difflib.get_close_matches(name, public, n=3, cutoff=0.75)
    return list(dict.fromkeys([*within[:3], *spelled]))[:3]


# torch's and Hugging Face's names of a layer's parts -> functree's field, by class (the
# names a user who reads a state dict types: attn.q_proj, embed_tokens.weight, norm.weight)
TORCH_FIELDS: dict[str, dict[str, str]] = {
    "MultiheadAttention": {"q_proj": "query_projection", "k_proj": "key_projection", "v_proj": "value_projection",
                           "o_proj": "output_projection", "out_proj": "output_projection", "query": "query_projection",
                           "key": "key_projection", "value": "value_projection", "dense": "output_projection"},
    "Embedding": {"weight": "embeddings", "padding_idx": "padding_index"},
    "LayerNorm": {"weight": "scale", "bias": "offset", "eps": "epsilon", "variance_epsilon": "epsilon"},
    "RMSNorm": {"weight": "scale", "eps": "epsilon", "variance_epsilon": "epsilon"},
}

TORCH_FIELD = """\
'{cls}' object has no attribute {name!r}: torch and Hugging Face call it {name}, functree's \
{cls} calls it {field} (ft.to_flat_dict(model) lists every parameter's key path; \
ft.nn.to_hf_state_dict gives Hugging Face's names).

    wrong:  layer.{name}
    right:  layer.{field}"""


def missing_attribute(obj: Any, name: str, table: dict[str, tuple[str, str, str]] = FOREIGN_METHODS) -> AttributeError:
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
    if name in table:  # (an optimizer's table: OPTIMIZER_METHODS)
        why, wrong, right = table[name]
        text = FOREIGN_METHOD.format(cls=cls.__name__, name=name, why=why, wrong=wrong, right=right)
    elif (field := next((TORCH_FIELDS[k.__name__][name] for k in cls.__mro__
                         if name in TORCH_FIELDS.get(k.__name__, {}) and k.__module__.startswith("functree.")),
                        None)) is not None:
        text = TORCH_FIELD.format(cls=cls.__name__, name=name, field=field)
    elif any("setup" in vars(k) for k in cls.__mro__[:-1] if k.__module__.split(".")[0] != "functree"):
        text = LINEN_SETUP.format(cls=cls.__name__, name=name)
    else:
        text = f"'{cls.__name__}' object has no attribute {name!r}"
    return AttributeError(text, name=name, obj=obj)  # name, obj: Python's "Did you mean" hint
