"""A job that trains a subset of its model saves that subset: the frozen base stays out.

A LoRA job (``ft.optim.Optimizer(tx, wrt="*.lora_*")``) changes its adapters and layer state
alone; writing the whole base at every save costs the base's size each time (about 14 GB a
save at 7B parameters in bfloat16, for megabytes of adapters). So the job's checkpoint holds
every leaf the step changes (the trained parameters, their optimizer state, layer state such
as PRNG keys and statistics, the rest of the job) and, for each frozen parameter, only a
*fingerprint* in the metadata (``frozen``): its dtype, shape and two sums of its bits,

    s1 = Σ_i bits_i · (2i + 1)   (mod 2³²),     s2 = Σ_i (bits_i ⊕ (i · 0x9E3779B9))   (mod 2³²),

with ``bits_i`` the i-th element's bit pattern as an unsigned integer. Integer sums modulo
2³² are exact in any order, so the fingerprint is the same on every device, platform and
sharding, with ``jax_enable_x64`` or without, and it is computed where the array lives (no
copy to the host). The base is
known by these fingerprints alone: a model's config keeps no path or name
(:data:`functree.hf._config.PROVENANCE`: the same model read from two paths is one
static configuration), so the messages say which template to pass, not where it came from
(a checkpoint written before names its base's ``_name_or_path``, as it recorded it).

Restoring needs the base: the template (a trainer's own model, built from the same base)
gives the frozen arrays, each checked against its fingerprint; a base that differs, or no
template, is refused naming the key path and the fix.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from functree._parameters import selected
from functree.train.checkpoint._treespec import CheckpointError, encode

__all__ = ["frozen_keys", "describe_frozen", "restore_frozen", "ABSTRACT_BASE"]

NEEDS_BASE = """\
The checkpoint at step {step} holds only what its job trained: the frozen base's {count} \
arrays ({first}, ...) were left out (the base is {source}). Restore it into a model built \
from that base, which gives those arrays back:

    wrong:  ft.train.JobState.restore(path)
    right:  trainer.restore(path)        # a Trainer whose model is the base with its adapters
       or:  ft.train.JobState.restore(path, like=trainer.state)
       or:  manager.restore(step, template=model, opt_state_template=opt_state)"""

BASE_DIFFERS = """\
The checkpoint at step {step} was trained on another base: its frozen leaf {key!r} \
({saved}) {problem}. The base is {source}. Restore into a model built from that base \
(the same weights), e.g.:

    wrong:  ft.nn.lora(other_base, ...)          # then trainer.restore(path)
    right:  {build}"""


ABSTRACT_BASE = """\
The checkpoint at step {step} holds only what its job trained: its frozen leaf {key!r} \
({saved}) is not in it, and the template holds no values there ({given}: an abstract \
template, from jax.eval_shape, gives shapes, not the base's weights). Restore into a model \
built from the base, whose frozen arrays are checked against the saved fingerprints:

    wrong:  manager.restore(step, template=jax.eval_shape(make_model))
    right:  manager.restore(step, template=make_model())    # the base with its adapters, as built for the job"""


def frozen_keys(model: Any, wrt: Sequence[str] | None, part: str = "model") -> tuple[str, ...]:
    """The checkpoint names (``model.layers.0.weight``) of ``model``'s parameters that an
    optimizer with ``wrt`` patterns never changes (none without ``wrt``). A leaf of a
    ``Stack`` partly trained is saved whole."""
    if wrt is None:
        return ()
    chosen, _ = encode(selected(model, tuple(wrt), strict=False))
    return tuple(f"{part}.{k}" for k, trained in chosen.items() if not np.any(trained))


def _bits(x: jax.Array) -> jax.Array:
    """Each element's bit pattern as uint32 (64-bit elements as two)."""
    size = jnp.dtype(x.dtype).itemsize
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32).reshape(-1)
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[size]
    return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32).reshape(-1)


@jax.jit
def _fingerprint(x: jax.Array) -> jax.Array:
    """``[s1, s2]`` as uint32. The sums accumulate in uint32 (wrapping is the mod 2³²):
    left to its default, ``jnp.sum`` of uint32 widens to uint64 under ``jax_enable_x64`` and
    the fingerprint changed with the flag."""
    bits = _bits(x)
    i = jnp.arange(bits.size, dtype=jnp.uint32)
    return jnp.stack([jnp.sum(bits * (2 * i + 1), dtype=jnp.uint32),
                      jnp.sum(bits ^ (i * jnp.uint32(0x9E3779B9)), dtype=jnp.uint32)])


def _fingerprints(arrays: Mapping[str, Any]) -> dict[str, list[int]]:
    """Every array's fingerprint, computed where it lives, read back together."""
    sums = {k: _fingerprint(x if isinstance(x, jax.Array) else jnp.asarray(x)) for k, x in arrays.items()}
    return {k: [int(s) for s in np.asarray(v)] for k, v in jax.device_get(sums).items()}


def _base(source: Any) -> tuple[str, str]:
    """How the messages name the base, and the call that builds it."""
    if isinstance(source, str):
        return repr(source), f'ft.nn.lora(ft.nn.from_hf("{source}"), ...)   # the same base, the same adapters'
    return ("not recorded in the checkpoint (its fingerprints are)",
            "ft.nn.lora(ft.nn.from_hf(base_directory), ...)   # the base the job started from, as built then")


def describe_frozen(arrays: dict[str, Any], keys: Sequence[str], model: Any) -> dict[str, Any]:
    """Take ``keys`` out of ``arrays`` (in place) and describe them for the metadata."""
    frozen = {k: arrays.pop(k) for k in keys if k in arrays}
    sums = _fingerprints(frozen)
    return {"source": None, "leaves": {  # "source": older checkpoints' name of the base
        k: {"dtype": str(x.dtype), "shape": list(np.shape(x)), "fingerprint": sums[k]} for k, x in frozen.items()}}


def restore_frozen(arrays: dict[str, Any], about: Any, template: Any, step: Any, part: str = "model") -> None:
    """Put the template's frozen arrays into ``arrays`` (in place), each checked against the
    metadata's description ``about``; none, or one that differs, raises."""
    leaves = about.get("leaves") if isinstance(about, dict) else None
    if not isinstance(leaves, dict):
        raise CheckpointError(f"The checkpoint at step {step} has a damaged description of its frozen base.")
    source, build = _base(about.get("source"))
    if template is None:
        raise CheckpointError(NEEDS_BASE.format(step=step, count=len(leaves), first=next(iter(leaves), "-"),
                                                source=source))
    given, _ = encode({part: template})
    found = {k: given[k] for k in leaves if k in given}
    for key, x in found.items():  # jax.ShapeDtypeStruct: no values to give or to fingerprint
        if not hasattr(x, "__array__"):
            want = leaves[key] if isinstance(leaves[key], dict) else {}
            raise CheckpointError(ABSTRACT_BASE.format(step=step, key=key, saved=f"{want.get('dtype')}{want.get('shape')}",
                                                       given=type(x).__name__))
    sums = _fingerprints({k: x for k, x in found.items() if _same_kind(x, leaves[k])})
    for key, want in leaves.items():
        saved = f"{want.get('dtype')}{want.get('shape')}"
        if key not in found:
            problem = "is not in the template"
        elif not _same_kind(found[key], want):
            problem = f"is {found[key].dtype}{list(np.shape(found[key]))} in the template"
        elif sums[key] != _saved_fingerprint(want):
            problem = "holds other values in the template (its fingerprint differs)"
        else:
            arrays[key] = found[key]
            continue
        raise CheckpointError(BASE_DIFFERS.format(step=step, key=key, saved=saved, problem=problem, source=source,
                                                  build=build))


def _saved_fingerprint(want: dict[str, Any]) -> Any:
    """The saved fingerprint mod 2³²: a job under ``jax_enable_x64`` wrote the sums unreduced
    (uint64, before they were summed in uint32), and Σ mod 2⁶⁴ mod 2³² = Σ mod 2³²."""
    saved = want.get("fingerprint")
    if not isinstance(saved, list) or not all(isinstance(s, int) for s in saved):
        return saved  # (damaged: differs from any fingerprint)
    return [s % 2**32 for s in saved]


def _same_kind(x: Any, want: Any) -> bool:
    return isinstance(want, dict) and str(x.dtype) == want.get("dtype") and list(np.shape(x)) == want.get("shape")
