"""Generation's compiled loops: prefill and decode in one ``jax.jit`` call.

``generate_loop`` (greedy and sampling) runs the prompt through the model once (prefill), then a
``lax.while_loop`` feeds one token per step until ``limit`` tokens are made or every row has
emitted an end-of-sequence token. ``beam_search`` is Hugging Face's beam search: the beams are
``batch * num_beams`` rows of one batch in the same kind of loop; each step keeps the best
continuations of all beams of a prompt, moves the ended ones into a sorted set of finished
sequences, and gathers the cache rows of the beams that go on (each cache leaf's batch axis is
found from ``init_cache``'s shapes for two batch sizes).

Both take ``reads``, a static key of what the Python of the model's user classes reads now
(:func:`functree.nn._eager_keys.model_reads`): a notebook's ``SHIFT = 2`` read by the model's ``__call__``, or a patched
method, compiles the loop again, as an eager call of the model sees it.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from functree._repr import short_array
from functree.generation._controls import Control, Loop, Now, applied, updated
from functree.generation._logits import stop_hit, stop_window
from functree.generation._memory import checked_cache
from functree.nn._eager_keys import traced_afresh as afresh

BAD_MODEL_OUTPUT = """\
generate: model(input_ids, attention_mask=am, positions=pos, cache=cache) must return \
(logits [batch, T, vocab] float, cache of the same structure), got {given} for input_ids \
{ids}.

    right:  return self.head(x), cache"""

UNBATCHED_CACHE = """\
generate: beam search reorders the cache along its batch axis, but the cache leaf at {path} \
{shapes} (from model.init_cache with batch sizes {small} and {large}) has no single such axis.

    right:  every cache leaf is [..., batch, ...] (one axis of size batch_size), or has no batch axis"""

NEG = -1.0e9  # Hugging Face's "no score": a beam slot that cannot win


# The streamer of the generate call running: the compiled loop's host callback hands it each
# step's tokens (a module slot, not an argument: a new streamer must not compile the loop again).
STREAMERS: list[Any] = []


def _put(tokens: Any) -> None:
    STREAMERS[-1].put(np.asarray(tokens))


def _call(model: Any, ids: jax.Array, am: jax.Array, pos: jax.Array, cache: Any) -> tuple[jax.Array, Any]:
    out = model(ids, attention_mask=am, positions=pos, cache=cache)
    ok = isinstance(out, tuple) and len(out) == 2 and hasattr(out[0], "shape")
    if ok:
        logits, new = out
        ok = (logits.ndim == 3 and logits.shape[:2] == ids.shape and jnp.issubdtype(logits.dtype, jnp.floating)
              and jax.tree.structure(new) == jax.tree.structure(cache))
    if not ok:
        if hasattr(out, "shape") and hasattr(out, "dtype"):
            given = f"an array {short_array(out)}"
        elif isinstance(out, tuple) and len(out) == 2 and hasattr(out[0], "shape"):
            given = f"({short_array(out[0])}, a {type(out[1]).__name__})"
        else:
            given = f"a tuple of {len(out)}" if isinstance(out, tuple) else f"a {type(out).__name__}"
        raise TypeError(BAD_MODEL_OUTPUT.format(given=given, ids=short_array(ids)))
    return out


def _prefill_logits(model: Any, ids: jax.Array, new: int) -> jax.Array:
    batch, width = ids.shape
    cache = model.init_cache(batch, width + new)
    am = jnp.ones((batch, width + new), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (batch, width))
    return _call(model, ids, am, positions, cache)[0]


_PREFILL = jax.jit(_prefill_logits, static_argnames="new")


def vocabulary(model: Any) -> int:
    """The size of the vocabulary the model's logits span: the shapes of a one-token prefill,
    nothing computed. The probe's shape is fixed, so jit's trace cache serves every later call
    on a model of this structure (~1 ms), whatever its prompt's shape (a notebook's next prompt
    pays no trace for it)."""
    ids = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    return int(jax.eval_shape(partial(_PREFILL, new=1), model, ids).shape[-1])


def output_buffer(ids: jax.Array, prompt: jax.Array, new: int, fill: jax.Array) -> jax.Array:
    """The tokens a loop returns before it runs: the prompt's ``prompt`` real slots, then
    ``fill`` (pad, else eos) in every later column, the bucket's padding slots included, as
    HF pads a row that finished (or a batch that stopped) early."""
    width = ids.shape[1]
    columns = jnp.arange(width + new, dtype=jnp.int32)[None]
    return jnp.where(columns < prompt, jnp.pad(ids, ((0, 0), (0, new))), fill).astype(ids.dtype)


_LOOP_STATIC = ("new", "greedy", "ends", "scores", "stream", "reads")
_BEAM_STATIC = ("new", "scores", "beams", "returns", "eos_count", "reads")


def traced_afresh(compiled: Any) -> Callable[..., Any]:
    """A loop of ``compiled``'s function traced for this call alone (a model whose reads
    cannot be keyed: :func:`~functree.nn._eager_keys.model_reads` is None)."""
    return afresh(compiled, static_argnames=_BEAM_STATIC if compiled is beam_search else _LOOP_STATIC)


@partial(jax.jit, static_argnames=_LOOP_STATIC)
def generate_loop(model: Any, ids: jax.Array, prompt_mask: jax.Array, sizes: jax.Array, eos_ids: jax.Array,
              fill: jax.Array, stop_ids: jax.Array, key: Any, controls: tuple[Control, ...] = (), *, new: int,
              greedy: bool, ends: bool, scores: bool, stream: bool = False,
              reads: Any = None) -> tuple[jax.Array, jax.Array | None]:
    """Greedy or sampled tokens ``[batch, W + new]`` (and scores ``[batch, new]``): the prompt
    ``ids [batch, W]`` holds ``sizes[0]`` real slots (a bucket: slots from ``sizes[0]`` on are
    padding, overwritten by the new tokens), and the loop makes ``sizes[1] <= new`` tokens;
    each step's logits pass the ``controls`` (``_controls.py``) in turn."""
    batch, width = ids.shape
    prompt, limit = sizes[0], sizes[1]
    cache = checked_cache(model, batch, width + new)  # (its bytes checked: nothing is allocated yet)
    am = jnp.concatenate([prompt_mask, jnp.zeros((batch, new), jnp.int32)], axis=1)
    positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (batch, width))
    logits, cache = _call(model, ids, am, positions, cache)
    last = jax.lax.dynamic_index_in_dim(logits, prompt - 1, axis=1, keepdims=False)  # the last real slot's
    loop = Loop(ids, prompt_mask, prompt, new, logits.shape[-1], limit=limit)
    stopping = stop_ids.shape[0] > 0

    def choose(logits: jax.Array, state: dict[str, Any], t: Any) -> tuple[jax.Array, Any]:
        if greedy and not (controls or scores):  # the plain loop: nothing else traced
            return jnp.argmax(logits, axis=-1).astype(jnp.int32), None
        x = applied(controls, state["controls"], logits.astype(jnp.float32), Now(loop, t, state["tokens"]))
        if greedy:
            token = jnp.argmax(x, axis=-1).astype(jnp.int32)
        else:
            token = jax.random.categorical(jax.random.fold_in(key, t), x, axis=-1).astype(jnp.int32)
        if not scores:
            return token, None
        return token, jnp.take_along_axis(jax.nn.log_softmax(x, axis=-1), token[:, None], axis=-1)[:, 0]

    def emit(state: dict[str, Any], token: jax.Array, score: Any, t: Any) -> dict[str, Any]:
        state = dict(state)
        if ends:
            done = state["done"]
            token = jnp.where(done, fill, token)
            finished = jnp.isin(token, eos_ids)
            if stopping:
                hit, state["window"] = stop_hit(state["window"], token, stop_ids)
                finished = finished | hit
            if scores:
                score = jnp.where(done, jnp.float32(0.0), score)
            state["done"] = done | finished
        state["controls"] = updated(controls, state["controls"], token, Now(loop, t, state["tokens"]))
        state["tokens"] = jax.lax.dynamic_update_slice(state["tokens"], token[:, None], (jnp.int32(0), prompt + t))
        if scores:
            state["scores"] = jax.lax.dynamic_update_slice(state["scores"], score[:, None], (jnp.int32(0), t))
        if stream:  # in step order (ordered): the streamer prints as the loop runs
            io_callback(_put, None, token, ordered=True)
        state["token"] = token
        return state

    state: dict[str, Any] = {
        "tokens": output_buffer(ids, prompt, new, fill),
        "done": jnp.zeros((batch,), bool), "controls": tuple(c.init(loop) for c in controls),
    }
    if stopping:
        state["window"] = stop_window(ids, prompt_mask, prompt, stop_ids.shape[1])
    if scores:
        state["scores"] = jnp.zeros((batch, new), jnp.float32)
    first = jnp.int32(0)  # (not a Python 0: under x64 a weak int64 beside the int32 slot indices)
    state = emit(state, *choose(last, state, first), first)
    state.update(t=jnp.int32(1), cache=cache, am=am)

    def more(state: dict[str, Any]) -> jax.Array:
        return (state["t"] < limit) & ~jnp.all(state["done"]) if ends else state["t"] < limit

    def step(state: dict[str, Any]) -> dict[str, Any]:
        t = state["t"]
        slot = prompt + t - 1  # the slot of `token`, the last one emitted
        am = jax.lax.dynamic_update_slice(state["am"], jnp.ones((batch, 1), jnp.int32), (jnp.int32(0), slot))
        positions = jnp.full((batch, 1), slot, jnp.int32)
        logits, cache = _call(model, state["token"][:, None], am, positions, state["cache"])
        state = emit({**state, "am": am, "cache": cache}, *choose(logits[:, -1], state, t), t)
        return {**state, "t": t + 1}

    state = jax.lax.while_loop(more, step, state)
    return state["tokens"], state.get("scores")


# ---- beam search ------------------------------------------------------------------------------

def _batch_axes(model: Any, batch: int, rows: int, length: int) -> list[int | None]:
    """Each cache leaf's batch axis (None: a leaf without one), found by making the cache's
    shapes for ``batch`` and ``rows`` sequences (no arrays are made)."""
    small = jax.tree.leaves_with_path(jax.eval_shape(lambda: model.init_cache(batch, length)))
    large = jax.tree.leaves(jax.eval_shape(lambda: model.init_cache(rows, length)))
    axes: list[int | None] = []
    for (path, a), b in zip(small, large):
        differ = [i for i, (m, n) in enumerate(zip(a.shape, b.shape)) if m != n]
        if a.ndim != b.ndim or len(differ) > 1 or (differ and (a.shape[differ[0]], b.shape[differ[0]]) != (batch, rows)):
            raise ValueError(UNBATCHED_CACHE.format(path=jax.tree_util.keystr(path) or "(root)",
                                                    shapes=f"is {a.shape} and {b.shape}", small=batch, large=rows))
        axes.append(differ[0] if differ else None)
    return axes


def _on_axes(cache: Any, axes: list[int | None], f: Any) -> Any:
    leaves, treedef = jax.tree.flatten(cache)
    return jax.tree.unflatten(treedef, [leaf if ax is None else f(leaf, ax) for leaf, ax in zip(leaves, axes)])


def _beams_of(x: jax.Array, index: jax.Array) -> jax.Array:
    """``x [batch, beams, ...]`` at the beams ``index [batch, k]``: ``[batch, k, ...]``."""
    return jnp.take_along_axis(x, index.reshape(index.shape + (1,) * (x.ndim - 2)), axis=1)


@partial(jax.jit, static_argnames=_BEAM_STATIC)
def beam_search(model: Any, ids: jax.Array, prompt_mask: jax.Array, sizes: jax.Array, eos_ids: jax.Array, fill: jax.Array,
                 stop_ids: jax.Array, length_penalty: jax.Array, early: jax.Array, never: jax.Array,
                 controls: tuple[Control, ...] = (), *, new: int, scores: bool, beams: int, returns: int,
                 eos_count: int, reads: Any = None) -> tuple[jax.Array, jax.Array | None]:
    """Hugging Face's beam search; ``early`` (bool): early_stopping=True, ``never`` (bool):
    early_stopping="never" (both False: HF's default heuristic); ``ids``, ``sizes``,
    ``controls``: as ``generate_loop``'s (the controls see ``log_softmax(logits)``)."""
    batch, width = ids.shape
    prompt, limit = sizes[0], sizes[1]
    rows, total = batch * beams, width + new
    axes = _batch_axes(model, batch, rows, total)
    checked_cache(model, rows, total, abstract=True)  # the beams' cache, before any is made
    am = jnp.concatenate([prompt_mask, jnp.zeros((batch, new), jnp.int32)], axis=1)
    positions = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), (batch, width))
    logits, cache = _call(model, ids, am, positions, model.init_cache(batch, total))  # prefill once per prompt
    logits = jax.lax.dynamic_slice_in_dim(logits, prompt - 1, 1, axis=1)  # the last real slot's
    cache = _on_axes(cache, axes, lambda leaf, ax: jnp.repeat(leaf, beams, axis=ax))  # row b * beams + k: prompt b
    vocab = logits.shape[-1]
    loop = Loop(ids, prompt_mask, prompt, new, vocab, beams, limit=limit)
    keep = max(2, 1 + eos_count) * beams  # HF's candidates per prompt: enough for `beams` that do not end
    stopping = stop_ids.shape[0] > 0
    first_k = (jnp.arange(keep) < beams)[None]  # (a row: rank promotion may raise)
    lowest = jnp.float32(NEG)

    def select(state: dict[str, Any], logits: jax.Array, t: Any, reorder: bool) -> dict[str, Any]:
        s = dict(state)
        now = Now(loop, t, s["sequences"].reshape(rows, total))
        logp = applied(controls, s["controls"], jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1), now)
        flat = logp.reshape(batch, beams * vocab)
        top, index = jax.lax.top_k((logp.reshape(batch, beams, vocab) + s["running"][..., None]).reshape(batch, -1),
                                   keep)
        parent, token = index // vocab, (index % vocab).astype(jnp.int32)  # [batch, keep]
        sequences = jax.lax.dynamic_update_slice(_beams_of(s["sequences"], parent), token[..., None],
                                                 (jnp.int32(0), jnp.int32(0), prompt + t))
        ends = jnp.isin(token, eos_ids) | (t == limit - 1)
        if stopping:
            hit, window = stop_hit(_beams_of(s["window"].reshape(batch, beams, -1), parent), token, stop_ids)
            ends = ends | hit
        if scores:
            own = jnp.take_along_axis(flat, index, axis=1)
            token_scores = jax.lax.dynamic_update_slice(_beams_of(s["token_scores"], parent), own[..., None],
                                                        (jnp.int32(0), jnp.int32(0), t))
        # the best `beams` candidates that go on
        going = top + ends.astype(jnp.float32) * lowest
        pick = jax.lax.top_k(going, beams)[1]
        s["sequences"], s["running"] = _beams_of(sequences, pick), _beams_of(going, pick)
        if scores:
            s["token_scores"] = _beams_of(token_scores, pick)
        # the finished ones: the best `beams` so far, old and new (only the first `beams` candidates may enter)
        just = ends & first_k
        candidate = top / ((t + 1).astype(jnp.float32) ** length_penalty)
        full = jnp.all(s["finished"], axis=1, keepdims=True) & early  # early_stopping=True: no more once full
        candidate = candidate + full.astype(jnp.float32) * lowest
        candidate = candidate + (~s["improvable"]).astype(jnp.float32) * lowest
        candidate = candidate + (~just).astype(jnp.float32) * lowest
        best = jax.lax.top_k(jnp.concatenate([s["final"], candidate], axis=1), beams)[1]
        merge = lambda old, fresh: _beams_of(jnp.concatenate([old, fresh], axis=1), best)  # noqa: E731
        s["final_sequences"] = merge(s["final_sequences"], sequences)
        s["final"] = merge(s["final"], candidate)
        s["finished"] = merge(s["finished"], just)
        if scores:
            s["final_scores"] = merge(s["final_scores"], token_scores)
        # the next step's inputs: the going beams' tokens, their parents' caches
        s["token"] = _beams_of(token, pick).reshape(rows)
        source = (jnp.arange(batch)[:, None] * beams + _beams_of(parent, pick)).reshape(rows)
        if reorder:  # (at the first step every beam of a prompt is the same)
            s["cache"] = _on_axes(s["cache"], axes, lambda leaf, ax: jnp.take(leaf, source, axis=ax))
            s["controls"] = jax.tree.map(lambda x: x[source], s["controls"])
        s["controls"] = updated(controls, s["controls"], s["token"], now)
        if stopping:
            s["window"] = _beams_of(window, pick).reshape(rows, -1)
        # whether a running beam can still beat a finished one (HF's heuristic), and whether to go on
        length = jnp.where(never & (length_penalty > 0), limit, t + 1)  # the best length a running beam may reach
        hope = s["running"][:, :1] / (length.astype(jnp.float32) ** length_penalty)
        worst = jnp.where(s["finished"], jnp.min(s["final"], axis=1, keepdims=True), lowest)
        s["improvable"] = s["improvable"] & jnp.any(hope > worst, axis=-1, keepdims=True)
        s["go"] = jnp.any(s["improvable"]) & ~jnp.all(ends) & ~(jnp.all(s["finished"]) & early)
        return s

    start = jnp.broadcast_to(output_buffer(ids, prompt, new, fill)[:, None], (batch, beams, total))
    state: dict[str, Any] = {
        "sequences": start, "final_sequences": start,
        "running": jnp.where(jnp.arange(beams) == 0, 0.0, lowest)[None].repeat(batch, 0).astype(jnp.float32),
        "final": jnp.full((batch, beams), lowest), "finished": jnp.zeros((batch, beams), bool),
        "improvable": jnp.ones((batch, 1), bool), "cache": cache,
        "controls": jax.tree.map(lambda x: jnp.repeat(x, beams, axis=0), tuple(c.init(loop) for c in controls)),
    }
    if stopping:
        state["window"] = jnp.repeat(stop_window(ids, prompt_mask, prompt, stop_ids.shape[1]), beams, axis=0)
    if scores:
        state["token_scores"] = state["final_scores"] = jnp.zeros((batch, beams, new), jnp.float32)
    state = select(state, jnp.repeat(logits[:, -1], beams, axis=0), jnp.int32(0), reorder=False)
    state.update(t=jnp.int32(1), am=jnp.repeat(am, beams, axis=0))

    def more(state: dict[str, Any]) -> jax.Array:
        return (state["t"] < limit) & state["go"]

    def step(state: dict[str, Any]) -> dict[str, Any]:
        t = state["t"]
        slot = prompt + t - 1
        am = jax.lax.dynamic_update_slice(state["am"], jnp.ones((rows, 1), jnp.int32), (jnp.int32(0), slot))
        logits, cache = _call(model, state["token"][:, None], am, jnp.full((rows, 1), slot, jnp.int32),
                              state["cache"])
        state = select({**state, "am": am, "cache": cache}, logits[:, -1], t, reorder=True)
        return {**state, "t": t + 1}

    state = jax.lax.while_loop(more, step, state)
    tokens = state["final_sequences"][:, :returns].reshape(batch * returns, total)
    return tokens, state["final_scores"][:, :returns].reshape(batch * returns, new) if scores else None
