"""A PEFT adapter's tensors per ft ``Dense`` member, for :mod:`functree.hf._peft`.

Reading: a file's tensors may carry an adapter name (``lora_A.default.weight``, a state
dict of a ``PeftModel``); :func:`chosen_adapter` takes the one ``PeftModel.from_pretrained``
takes (no name, or ``default``), one name for the whole file, and refuses tensors under another. :func:`loaded_layer` puts a layer's members together into one
``LoraDense``: each member keeps PEFT's ``A`` and ``B`` and its own scale ``s_i``
(``alpha_i / r_i``; ``LoraDense.member_scale`` where the members' differ), the ranks padded
with zeros to the largest (zero columns of ``A`` with zero rows of ``B``: they add nothing and
their gradients are zero, so training moves exactly PEFT's parameters).

Writing: :func:`member_adapters` takes a layer apart again, each member at its true rank
(that padding trimmed) and scale, and :func:`written_alpha` is the ``lora_alpha`` giving that
scale, so PEFT reads back the same ``A``, ``B`` and scale per module.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from functree.nn._lora import DenseLayer, LoraDense, member_layer_names
from functree.nn._precision import statistics_dtype

__all__ = ["member_arrays", "chosen_adapter", "adapter_dtype", "loaded_layer", "member_adapters", "written_alpha"]

SEVERAL_ADAPTERS = """\
ft.nn.load_lora: {file} holds the adapter of {module!r} under the adapter names {names} \
({why}). PeftModel.from_pretrained reads the one without a name, or named 'default', and \
ignores the others: which one is this adapter is not in the file.
    wrong:  safetensors.torch.save_file(peft_model.state_dict(), ...)   # every adapter's tensors
    right:  peft_model.save_pretrained(directory, selected_adapters=["default"])   # one adapter per directory"""

OTHER_ADAPTERS = """\
ft.nn.load_lora: {file} holds the tensors of several adapters: {chosen} (the one \
PeftModel.from_pretrained reads) and {others} (on {modules}{more}). PEFT ignores the other \
adapters' tensors, leaving a module that only they hold at its initialization; taking each \
module's from whichever adapter holds it would load a mix of adapters, no adapter that was \
trained. A directory holds one adapter.
    wrong:  safetensors.torch.save_file(peft_model.state_dict(), ...)   # every adapter's tensors
    right:  peft_model.save_pretrained(directory, selected_adapters=["default"])   # the one meant
       or:  peft_model.save_pretrained(directory)   # each adapter in a directory of its own: directory/<name>"""


def member_arrays(a: Any, sizes: tuple[int, ...]) -> list[np.ndarray]:
    """A stacked array's members in C order over its stack axes (itself when not stacked)."""
    array = np.asarray(a)
    return list(array.reshape((-1, *array.shape[len(sizes):]))) if sizes else [array]


def chosen_adapter(named: dict[str, dict[str | None, dict[str, np.ndarray]]], file: str
                   ) -> dict[str, dict[str, np.ndarray]]:
    """The tensors (``{module: {"lora_A": ..., "lora_B": ...}}``) of the one adapter name
    PEFT loads from the file, chosen per file (``named``: each module's tensors per adapter
    name): none, else ``default`` (``PeftModel.from_pretrained``'s adapter name: its keys
    match the model's own), else the file's only name (a file of one adapter written with
    its name kept). Refused: several other names, the unnamed and the ``default`` tensors of
    a module with other values (PEFT keeps whichever the file lists last), and tensors under
    another name beside the chosen one (:data:`OTHER_ADAPTERS`: taking each module's own
    name would load a mix of adapters)."""
    for module, by_name in named.items():
        _same_unnamed_and_default(by_name, module, file)
    names = {name for by_name in named.values() for name in by_name}
    chosen = {None, "default"} & names
    if not chosen:
        if len(names) > 1:
            module = max(named, key=lambda m: len(named[m]))  # one holding the most names
            raise ValueError(SEVERAL_ADAPTERS.format(file=file, module=module, names=sorted(map(str, names)),
                                                     why="and none without a name or named 'default'"))
        chosen = names
    others = sorted(str(n) for n in names - chosen)
    if others:
        modules = sorted(m for m, by_name in named.items() if set(by_name) - chosen)
        raise ValueError(OTHER_ADAPTERS.format(file=file, chosen="'default'" if "default" in chosen else "the unnamed",
                                               others=", ".join(map(repr, others)), modules=modules[:3],
                                               more=f" and {len(modules) - 3} more" if len(modules) > 3 else ""))
    return {module: next(iter(by_name.values())) for module, by_name in named.items()}  # one name (or equal two)


def _same_unnamed_and_default(by_name: dict[str | None, dict[str, np.ndarray]], module: str, file: str) -> None:
    """Refuse a module's unnamed and ``default`` tensors unless they are one adapter's (equal)."""
    if None in by_name and "default" in by_name:
        same = by_name[None].keys() == by_name["default"].keys() and all(
            np.array_equal(by_name[None][k], by_name["default"][k]) for k in by_name[None])
        if not same:
            raise ValueError(SEVERAL_ADAPTERS.format(file=file, module=module, names=[None, "default"],
                                                     why="both PeftModel's names of one adapter, with other values"))


def adapter_dtype(dtypes: list[np.dtype]) -> np.dtype:
    """The one dtype of a layer's adapters from its tensors' (``lora_A`` and ``lora_B`` of
    each member): theirs when they agree, else the widest, at least float32 (bfloat16 with
    float16 has no common 16-bit type; PEFT computes every adapter in float32)."""
    unique = {np.dtype(d) for d in dtypes}
    if len(unique) == 1:
        return unique.pop()
    widest = max(unique, key=lambda d: d.itemsize)
    return widest if widest.itemsize > 4 else np.dtype(np.float32)


def loaded_layer(layer: DenseLayer, given: list[tuple[int, tuple[str, np.ndarray, np.ndarray, float]]],
           dropout: float, key: jax.Array | None) -> LoraDense:
    """The LoraDense of one layer from its members' adapters (``given``: member index,
    ``(module, a [in, r_i], b [r_i, out], s_i)``).

    Each member keeps PEFT's ``a`` and ``b`` (padded with zeros to the largest rank ``r``)
    and its scale: ``alpha = s r`` for one scale ``s`` of all, else ``member_scale`` holds
    each member's (float32, the stack axes' shape), so every member computes PEFT's
    ``s_i x A_i B_i`` and trains PEFT's parameters. A member without an adapter in the file
    gets zeros (which stay zero in training: their gradients are zero) and the first scale."""
    n_in, n_out = layer.node.weight.shape[-2:]
    sizes = layer.info.sizes
    rank = max(a.shape[1] for _, (_, a, _, _) in given)
    dtype = adapter_dtype([x.dtype for _, (_, a, b, _) in given for x in (a, b)])
    scales = np.full(math.prod(sizes), given[0][1][3], np.float64)
    a_all = np.zeros((math.prod(sizes), n_in, rank), dtype)
    b_all = np.zeros((math.prod(sizes), rank, n_out), dtype)
    for i, (_, a, b, s) in given:
        a_all[i, :, : a.shape[1]] = a  # exact: the dtype holds each tensor's values
        b_all[i, : b.shape[0], :] = b
        scales[i] = s
    uniform = bool(np.all(scales == scales[0]))
    wide = statistics_dtype(layer.node.weight.dtype)  # PEFT's Python floats: float64 beside float64 weights
    node = LoraDense(layer.node, rank, 1.0, dropout, key=jax.random.key(0) if key is None else key)
    return node.replace(lora_a=jnp.asarray(a_all.reshape((*sizes, n_in, rank))),
                        lora_b=jnp.asarray(b_all.reshape((*sizes, rank, n_out))),
                        alpha=float(scales[0]) * rank, dropout_key=None if key is None else node.dropout_key,
                        member_scale=None if uniform else jnp.asarray(scales.reshape(sizes), wide))


def member_adapters(layer: DenseLayer) -> Iterator[tuple[str, np.ndarray, np.ndarray, float]]:
    """``(member name, a [in, r_i], b [r_i, out], s_i)`` of each member of an adapted layer:
    its own scale, its rank without the zero padding :func:`loaded_layer` added (trailing columns
    of ``a`` that are zero, with their rows of ``b``; a member all zero keeps its rank)."""
    node, sizes = layer.node, layer.info.sizes
    count = max(1, math.prod(sizes))
    scales = (np.full(count, node.alpha / node.rank) if node.member_scale is None
              else np.asarray(node.member_scale, np.float64).reshape(-1))
    for name, a, b, s in zip(member_layer_names(layer), member_arrays(node.lora_a, sizes), member_arrays(node.lora_b, sizes),
                             scales, strict=True):
        used = np.flatnonzero(np.any(a != 0, axis=0) | np.any(b != 0, axis=1))
        r = int(used[-1]) + 1 if used.size else a.shape[1]
        yield name, a[:, :r], b[:r], float(s)


def written_alpha(scale: float, rank: int, dtype: Any = np.float32) -> float:
    """The ``lora_alpha`` of an adapter of scale ``scale`` at rank ``rank``: ``scale · rank``,
    in its shortest decimal form that gives the same scale in the adapter's ``dtype`` (the
    scale it computes with; float32 at least): ``10.0`` for a scale of ``10 / 3`` held in
    float32, not ``10.000000476837158``; a float64 adapter's scale to the last bit (an rslora
    adapter's ``7 / sqrt(3)``: 12.12435565298214 at rank 3, not float32's 12.124356, which
    moved a float64 model's logits 3.3e-8 of scale)."""
    exact = scale * rank
    kind = np.float64 if np.dtype(dtype).itemsize >= 8 else np.float32
    target = kind(scale)
    for digits in range(17 if kind is np.float64 else 10):
        short = round(exact, digits)
        if kind(short / rank) == target:
            return short
    return exact
