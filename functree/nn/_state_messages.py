"""The messages of layer state and recorded intermediates (``_state.py``): each shows the
wrong code and the right code, and names the key path where one is known."""

NOT_STATE_FIELD = """\
ft.nn.record_state({cls}, {name}=...): {cls}.{name} is not a no_derivative field; only \
those hold layer state. Its no_derivative fields are {fields}.

    wrong:  {name}: jax.Array
    right:  {name}: jax.Array = ft.field(no_derivative=True)
"""

NOT_IN_MODEL = """\
A {cls} recorded state inside ft.nn.collect_state, but it is not part of the model passed \
to collect_state (or fn is jit-compiled, which rebuilds the model), so its key path is \
unknown. Call the layers of the model fn receives, and put jit around collect_state:

    wrong:  ft.nn.collect_state(lambda m: other_model(x), model)
    wrong:  ft.nn.collect_state(jax.jit(lambda m: m(x)), model)
    right:  jax.jit(lambda model: ft.nn.collect_state(lambda m: m(x), model))(model)
"""


REBUILT_BY_TRANSFORM = """\
A {cls} recorded layer state inside ft.nn.collect_state, under {transform} opened inside \
the function collect_state runs (the loss of value_with_gradient_and_state, \
Optimizer.minimize, ft.train.train_step), with the model passed to {transform} as an \
argument: {transform} rebuilt its layers, so their key paths are unknown. {fix}"""

FIX_REBUILT_ENSEMBLE = """\
For a model ensemble (a jax.vmap'ed constructor), collect each member's state inside the \
vmap, return it as aux and write it back:

    wrong:  loss = lambda e: jnp.sum(jax.vmap(lambda m: member_loss(m, batch))(e))
    right:  def loss(e):
                losses, state = jax.vmap(lambda m: ft.nn.collect_state(lambda mm: member_loss(mm, batch), m))(e)
                return jnp.sum(losses), state
            (value, state), grads = ft.value_with_gradient(loss, at=ensemble, has_aux=True)
            updates, opt_state = optimizer.update(grads, opt_state, ensemble)
            ensemble = ft.nn.apply_state(ft.move(ensemble, along=updates), state)"""

FIX_REBUILT_CHECKPOINT = """\
ft.with_recomputation_in_pullbacks is jax.checkpoint that records the state under the \
layers' key paths:

    wrong:  y = jax.checkpoint(lambda m, x: m(x))(model, x)
    right:  y = ft.with_recomputation_in_pullbacks(lambda m, x: m(x))(model, x)"""

FIX_REBUILT_OTHER = """\
Call the layers outside it, or collect the state inside it and return it (the \
branches of a jax.lax.cond each return theirs):

    wrong:  y = jax.lax.cond(p, lambda m: m(x), lambda m: 2 * m(x), model)
    right:  y, state = jax.lax.cond(p, lambda m: ft.nn.collect_state(lambda mm: mm(x), m),
                                    lambda m: ft.nn.collect_state(lambda mm: 2 * mm(x), m), model)
            # return state beside the loss (has_aux=True), then ft.nn.apply_state(model, state)"""

NOT_IN_REBUILT_MODEL = """\
A {cls} recorded layer state inside ft.nn.collect_state, but it is not part of the model \
passed to collect_state, so its key path is unknown. Call the layers of the model fn receives:

    wrong:  ft.nn.collect_state(lambda m: other_model(x), model)
    right:  ft.nn.collect_state(lambda m: m(x), model)"""

INTERMEDIATE_NOT_IN_REBUILT_MODEL = """\
A {cls} passed on the intermediates {paths} inside ft.nn.collect_intermediates, but it is \
not part of the model passed to collect_intermediates (a wrapper built inside fn: \
ft.nn.Remat(m), ft.nn.Stack.from_layers, a list of layers given to \
ft.with_recomputation_in_pullbacks), so their key paths are unknown. Build the wrapper \
outside and pass it in:

    wrong:  y, sown = ft.nn.collect_intermediates(lambda m: ft.nn.Remat(m)(x), model)
    right:  y, sown = ft.nn.collect_intermediates(lambda m: m(x), ft.nn.Remat(model))
"""

INTERMEDIATE_IS_FIELD = """\
ft.nn.record_intermediate({cls}, {name}=...): {name!r} is a field of {cls}; a recorded \
intermediate is a value the layer computed, filed at the key path of a name the layer \
does not have (a field's path reads the field). Name it apart:

    wrong:  ft.nn.record_intermediate(self, {name}=value)
    right:  ft.nn.record_intermediate(self, {name}_out=value)
"""

INTERMEDIATE_NOT_ARRAY = """\
ft.nn.record_intermediate({cls}, {name}=...) got {given}; a recorded intermediate is one \
array (it is stacked by a Stack's scan and returned from jit-compiled code):

    wrong:  ft.nn.record_intermediate(self, {name}=(a, b))
    right:  ft.nn.record_intermediate(self, {name}_a=a, {name}_b=b)
"""

INTERMEDIATE_TWICE = """\
{path} was recorded twice while ft.nn.collect_intermediates ran: the layer was called \
twice in one forward pass, and one record per key path would drop a call's values. \
Collect each call on its own:

    wrong:  out, sown = ft.nn.collect_intermediates(lambda m: m(m(x)), model)
    right:  h, first = ft.nn.collect_intermediates(lambda m: m(x), model)
            y, second = ft.nn.collect_intermediates(lambda m: m(h), model)
"""

INTERMEDIATE_INSIDE_TRANSFORM = """\
The intermediate {path} was recorded inside {transform}, a transformation opened inside \
the function ft.nn.collect_intermediates runs: the value belongs to that transformation \
and cannot leave it (a leaked tracer). {fix}
"""

FIX_INTERMEDIATE_IN_GRADIENT = """\
Collect it inside the transformation and return it:

    wrong:  _, sown = ft.nn.collect_intermediates(lambda m: ft.gradient(lambda x: m(x).sum(), at=x), model)
    right:  def loss(x):
                y, sown = ft.nn.collect_intermediates(lambda m: m(x), model)
                return y.sum(), sown
            grads, sown = ft.gradient(loss, at=x, has_aux=True)"""

FIX_INTERMEDIATE_IN_VMAP = """\
Collect it inside the vmapped function and return it (each record gains the batch axis):

    wrong:  ys, sown = ft.nn.collect_intermediates(lambda m: jax.vmap(m)(xs), model)
    right:  ys, sown = jax.vmap(lambda x: ft.nn.collect_intermediates(lambda m: m(x), model))(xs)"""

FIX_INTERMEDIATE_IN_LOOP = """\
Collect it inside the loop's body and return it (a scan stacks each step's records), or use \
ft.nn.Stack / ft.nn.RNN, which collect inside their own scan:

    wrong:  ys, sown = ft.nn.collect_intermediates(lambda m: jax.lax.scan(lambda c, x: (c, m(x)), None, xs)[1], model)
    right:  def body(c, x):
                y, sown = ft.nn.collect_intermediates(lambda m: m(x), model)
                return c, (y, sown)
            _, (ys, sown) = jax.lax.scan(body, None, xs)"""

FIX_INTERMEDIATE_IN_CHECKPOINT = """\
Recompute with functree's checkpointing, which passes the records out (or ft.nn.Remat / \
ft.nn.Stack(..., remat=True) inside the model), the model given as an argument:

    wrong:  y, sown = ft.nn.collect_intermediates(lambda m: jax.checkpoint(lambda x: m(x))(x), model)
    right:  y, sown = ft.nn.collect_intermediates(
                lambda m: ft.with_recomputation_in_pullbacks(lambda mm, x: mm(x))(m, x), model)"""

FIX_INTERMEDIATE_IN_JIT = """\
Put jit around collect_intermediates:

    wrong:  y, sown = ft.nn.collect_intermediates(lambda m: jax.jit(lambda x: m(x))(x), model)
    right:  y, sown = jax.jit(lambda model: ft.nn.collect_intermediates(lambda m: m(x), model))(model)"""

INTERMEDIATE_NOT_IN_MODEL = """\
A {cls} recorded an intermediate inside ft.nn.collect_intermediates, but it is not part of \
the model passed to collect_intermediates, so its key path is unknown: fn called another \
model's layers, or passed the model through a transformation that rebuilds it (jax.jit, \
jax.checkpoint, ft.gradient(..., at=m)). Call the layers of the model fn receives (another \
model outside fn), and put the transformation around collect_intermediates:

    wrong:  ft.nn.collect_intermediates(lambda m: other_model(x), model)
    wrong:  ft.nn.collect_intermediates(jax.jit(lambda m: m(x)), model)
    right:  jax.jit(lambda model: ft.nn.collect_intermediates(lambda m: m(x), model))(model)
    wrong:  ft.nn.collect_intermediates(lambda m: ft.gradient(lambda mm: mm(x).sum(), at=m), model)
    right:  def loss(m):
                y, sown = ft.nn.collect_intermediates(lambda mm: mm(x), m)
                return y.sum(), sown
            grads, sown = ft.gradient(loss, at=model, has_aux=True)
"""

STATE_INSIDE_TRANSFORM = """\
The layer state at {path} was recorded inside {transform}, a transformation opened inside \
the function ft.nn.collect_state runs (the loss of value_with_gradient_and_state, \
Optimizer.minimize, ft.train.train_step): the recorded value belongs to that \
transformation and cannot leave it (stored into the model, it is a leaked tracer that \
fails at the next call). {fix}"""

FIX_STATE_IN_VMAP = """\
A BatchNorm in training mode normalises over the batch, and under a per-example jax.vmap \
each call sees one example. Call the model on the whole batch (per-example values come \
from its output), or use the running statistics inside the vmap (nothing recorded):

    wrong:  loss = lambda m: jnp.sum(jax.vmap(lambda xi: m(xi[None])[0])(x) ** 2)
    right:  loss = lambda m: jnp.sum(m(x) ** 2)
       or:  loss = lambda m: jnp.sum(jax.vmap(lambda xi: ft.nn.inference(m)(xi[None])[0])(x) ** 2)"""

FIX_STATE_IN_LOOP = """\
Call the layer outside the transformation, use ft.nn.Stack / ft.nn.RNN / ft.nn.Remat \
(they collect the state inside their own loop), or collect it inside the transformation \
and return it:

    wrong:  def loss(m):
                _, ys = jax.lax.scan(lambda c, xb: (c, m(xb)), None, xs)
                return jnp.sum(ys ** 2)
    right:  def loss(m):
                def body(c, xb):
                    y, state = ft.nn.collect_state(lambda mm: mm(xb), m)  # inside the scan
                    return c, (y, state)
                _, (ys, states) = jax.lax.scan(body, None, xs)
                return jnp.sum(ys ** 2), {{p: v[-1] for p, v in states.items()}}  # the last step's
            (loss_value, state), grads = ft.value_with_gradient(loss, at=model, has_aux=True)
            model = ft.nn.apply_state(ft.move(model, along=updates), state)"""

UNCOLLECTED_STATE = """\
{cls}{where} ran in training mode and recorded new {fields}, but nothing collects layer \
state here: the values are dropped and {cls}.{first} keeps its initial value (a \
BatchNorm then trains on batch statistics but predicts with its initial ones). Collect \
the state and write it back:

    wrong:  loss, grads = ft.value_with_gradient(lambda m: loss_fn(m, x, y), at=model)
            model = ft.move(model, along=updates)
    right:  loss, grads, state = ft.nn.value_with_gradient_and_state(loss_fn, model, x, y)
            model = ft.nn.apply_state(ft.move(model, along=updates), state)
       or:  out, state = ft.nn.collect_state(lambda m: m(x), model)
            model = ft.nn.apply_state(model, state)
       or:  ft.train.train_step / ft.train.Trainer, which collect it for you.

To only evaluate, use ft.nn.inference(model). This warning is shown once per layer \
(ft.nn.UncollectedStateWarning).
"""
