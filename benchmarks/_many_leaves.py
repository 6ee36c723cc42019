"""Family 12: the update of a model with many small leaves, gated and ungated, µs per update.

The parameters of a 12-layer transformer at d = 64 (per block two LayerNorms, a fused QKV
projection, the output projection and a 4× MLP, each weight with its bias; embeddings, a
final LayerNorm and the head): 150 float32 leaves, 0.64M parameters. One jitted, donated
Adam update per call, the gradients given:

- optax ``adam`` + ``apply_updates`` leaf by leaf (the reference: no gate);
- functree ``Optimizer(ft.optim.adam).apply_gradients`` (no gate);
- functree's gated update (the second half of ``ft.train.train_step``'s default
  ``on_nan="stop"`` step: one finiteness reduction, then the update) through one ``cond``
  around the whole update (the default above ``functree.optim._leafwise.MAX_PARAMETERS``
  parameters), and leaf by leaf (one small ``cond`` per parameter, the CPU default for
  small models; forced here by raising that limit while it traces).

Goal: the gated update at least as fast as optax's ungated per-leaf update (ratio ≤ 1).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from _harness import Table, carried_updates, interleave, paired_rows
from _impls import functree_apply, optax_update
from _models import LEARNING_RATE

import functree as ft
import functree.optim._leafwise as leafwise
from functree.optim._optimizer import Gradients

D, LAYERS, VOCAB, CONTEXT = 64, 12, 256, 32
OPTAX = "optax adam + apply_updates (no gate)"


def _shapes() -> dict[str, tuple[int, ...]]:
    block = {"ln1.scale": (D,), "ln1.bias": (D,), "qkv.weight": (D, 3 * D), "qkv.bias": (3 * D,),
             "proj.weight": (D, D), "proj.bias": (D,), "ln2.scale": (D,), "ln2.bias": (D,),
             "fc1.weight": (D, 4 * D), "fc1.bias": (4 * D,), "fc2.weight": (4 * D, D), "fc2.bias": (D,)}
    shapes = {f"h{i:02d}.{k}": v for i in range(LAYERS) for k, v in block.items()}
    shapes.update({"embed": (VOCAB, D), "pos": (CONTEXT, D), "lnf.scale": (D,), "lnf.bias": (D,),
                   "head.weight": (D, VOCAB), "head.bias": (VOCAB,)})
    return shapes


def _tree(seed: int) -> dict[str, jax.Array]:
    rng = np.random.default_rng(seed)
    return {k: jnp.asarray(rng.standard_normal(s).astype(np.float32) * 0.02) for k, s in _shapes().items()}


def _gated(leaf_by_leaf: bool = False):
    opt = ft.optim.Optimizer(ft.optim.adam(LEARNING_RATE))

    @ft.jit(donate=(0, 1))
    def update(model, state, grads):
        loss = jnp.float32(1.0)
        result = opt.apply_step(Gradients(loss, loss, grads, {}), model, state, minibatch_size=1, on_nan="stop")
        return result.model, result.state

    model = _tree(0)
    state = opt.init(model)
    limit = leafwise.MAX_PARAMETERS
    leafwise.MAX_PARAMETERS = len(model) if leaf_by_leaf else limit
    try:  # read while the update traces: its first call
        model, state = update(model, state, _tree(1))
    finally:
        leafwise.MAX_PARAMETERS = limit
    return update, model, state


def many_leaves(quick: bool) -> list[Table]:
    rounds, calls = (3, 5) if quick else (15, 20)
    grads = _tree(1)
    variants = {OPTAX: optax_update(_tree(0)),
                "functree apply_gradients (no gate)": functree_apply(_tree(0)),
                "functree gated update (default: one cond)": _gated(),
                "functree gated update, leaf by leaf (forced)": _gated(leaf_by_leaf=True)}
    block = carried_updates(variants, grads, calls)

    for name in variants:
        block(name)()
    values = interleave({name: block(name) for name in variants}, rounds)
    rows = paired_rows(values, OPTAX, scale=1e6)
    for row in rows[1:3]:
        row.ok = row.ratio is not None and row.ratio <= 1.0  # issue 30: the gate at no extra cost
    n = sum(int(np.prod(s)) for s in _shapes().values())
    table = Table("many-leaves", f"12. Adam update of {len(_shapes())} small leaves ({n / 1e6:.2f}M float32 "
                  f"parameters: a {LAYERS}-layer transformer at d={D})", "µs/update",
                  "functree's updates ≤ 1× optax's per-leaf update (the gated one included)", rows,
                  ratio_label="× optax")
    table.notes.append(f"median of {rounds} interleaved rounds × {calls} updates; gradients given, "
                       "model and state donated")
    return [table]
