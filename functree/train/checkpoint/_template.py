"""A saved part read back against a template: its leaves by key path into the template's
tree (:func:`functree.from_flat_dict`, shapes and dtypes checked; a running value that its
type names in :data:`CAST_ON_RESTORE`, the learning context's loss, cast), then its static values
compared with the template's (:func:`._treespec.static_differences`); either mismatch is a
:class:`CheckpointError` naming the call that reads the part as saved.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from functree._state_dict import (
    FLOAT_DIFFER,
    INT_DIFFER,
    FlatDictReport,
    from_flat_dict,
    to_flat_dict,
)
from functree.nn._lora import ADDED_FIELDS
from functree.train.checkpoint._decode import UPGRADE_ON_RESTORE, decode, decode_leaf, leaf_specs
from functree.train.checkpoint._errors import CheckpointError
from functree.train.checkpoint._treespec import layer_differences, static_differences

__all__ = ["rebuild", "with_template", "TemplateMismatch", "TEMPLATE_MISMATCH", "STATIC_MISMATCH", "TEMPLATE_WITH_SAVED",
           "LAYERS_DIFFER", "CAST_ON_LOAD", "CAST_CODE", "CAST_ON_RESTORE"]

# A type's opt-in: the fields named by this class attribute hold running values (a metric
# such as the learning context's latest loss), not parameters: a floating value saved in
# another floating dtype is cast into the template's (float32 <-> float64 when a job moves
# across jax_enable_x64). Every other leaf's dtype is checked, never cast.
CAST_ON_RESTORE = "__ft_cast_on_restore__"

class TemplateMismatch(CheckpointError):
    """A saved part that does not fit its template; ``part``: ``"model"``, ``"opt_state"``,
    ``"extra"`` (``""`` for ``ft.train.load``'s tree), for a caller that adds its own fix."""

    def __init__(self, message: str, part: str = ""):
        super().__init__(message)
        self.part = part


TEMPLATE_MISMATCH = """\
The checkpoint's {part}{at} does not fit the template:
{report}
Build the template the same way as the saved {part} (same layer sizes, dtypes and \
optimizer), or restore without a template to get the saved {part} back as it was:

    {plain}{hint}"""

CAST_ON_LOAD = """\
the loader never casts (a template checks the saved dtypes); read the saved {part} as it was \
saved and, on the template's devices, cast it into the template: {cast}   # {note}"""

KIND_ON_LOAD = """\
{{names}}: the checkpoint holds values of another kind than the template's leaves (the dtypes \
above: an integer for a floating leaf, or the reverse), which no loader converts (nor does \
from_flat_dict's cast=True): build the template with the saved dtypes, or read the saved {part} \
as it was saved (below) and convert these leaves yourself where that is meant"""

WRAPS_ON_LOAD = """\
{{names}}: the checkpoint holds integers beyond the template's integer dtypes (the dtypes above), \
which no loader converts (a cast would wrap them around): build the template with the saved \
dtypes (64-bit integers need jax_enable_x64), or read the saved {part} as it was saved (below) \
and clip these leaves yourself where that is meant"""

# The cast code: from_flat_dict's cast goes through NumPy and lands on the default device,
# so each array goes back where the template's is (its device, or its shards on a mesh).
CAST_CODE = ("ft.tree_map(lambda t, x: x.to_device(t.sharding) if hasattr(t, 'addressable_shards') else x, "
             "template, ft.from_flat_dict(template, ft.to_flat_dict({restore}), cast=True))")

# What the cast code's names are where it is printed: trainer.restore(path) opened the
# manager itself, so the user may hold none.
CAST_NOTE = {"": "ft.shard(tree, mesh, rules) places it by other rules",
             "manager": "manager: your CheckpointManager, or ft.train.CheckpointManager(path) for "
                        "trainer.restore(path)'s path"}

STATIC_MISMATCH = """\
{what} was saved with other static configuration than the template's. A template gives the \
saved arrays their structure; these fields change what the {part} computes, and the \
template's values would replace the saved ones silently:
{lines}
Build the template with the saved values, or restore without a template to get the saved \
{part} as it was saved:

    wrong:  {wrong}      # the template's {where} is {mine}; saved: {saved}
    right:  {right}"""

LAYERS_DIFFER = """\
{what} holds other layers than the template. A template gives the saved arrays their \
structure; a layer without arrays that it adds or drops (an activation, a pooling, a Flatten, \
a Dropout), or a layer of another class in a saved one's place, leaves every key path, shape \
and dtype as saved, and the {part} would compute another function silently:
{lines}
Build the template with the saved layers, or restore without a template to get the saved \
{part} as it was saved (and change its layers in code):

    wrong:  {wrong}      # {where}: the template's {mine}; saved: {saved}
    right:  {right}"""


LORA_ADDED = """

The missing leaves are LoRA adapters ({names}): the checkpoint holds the {part} before \
ft.nn.lora. Read it as saved, then adapt it (a Trainer: built on that model):

    right:  ft.nn.lora({plain}, pattern, rank=8, key=key)"""



TEMPLATE_WITH_SAVED = """\
{wrong}   # the template built with {field}={saved} (a text only a template gives back: no load without one)"""


def with_template(spec: dict[str, Any], arrays: dict[str, Any], template: Any, part: str,
                   ) -> tuple[Any, FlatDictReport]:
    """``from_flat_dict(template, the saved leaves under part)``: the tree and its report,
    the running values of :data:`CAST_ON_RESTORE` in the template's floating dtypes."""
    flat = {name: decode_leaf(s, arrays, s["key"]) for name, s in _template_names(spec, part).items()}
    return from_flat_dict(template, _running_values_cast(_upgraded(flat, template), template), strict=False)


def _opted_leaves(template: Any, attribute: str) -> dict[str, tuple[Any, str, Any]]:
    """``{flat name: (option, field, the template's leaf)}`` for each leaf inside a field that
    a node above it names in its type's ``attribute`` (:data:`CAST_ON_RESTORE`'s names,
    :data:`UPGRADE_ON_RESTORE`'s mapping): the one walk both opt-ins read."""
    def opted(node: Any) -> bool:
        return bool(getattr(type(node), attribute, ()))

    nodes = jax.tree_util.tree_flatten_with_path(template, is_leaf=opted)[0]
    options = {tuple(path): getattr(type(node), attribute) for path, node in nodes if opted(node)}
    if not options:
        return {}
    out: dict[str, tuple[Any, str, Any]] = {}
    paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(template)[0]]
    for (name, leaf), path in zip(to_flat_dict(template).items(), paths, strict=True):
        for k in range(len(path)):
            option, field = options.get(tuple(path[:k])), getattr(path[k], "name", None)
            if option is not None and field is not None and field in option:
                out[name] = (option, field, leaf)
    return out


def _upgraded(flat: dict[str, Any], template: Any) -> dict[str, Any]:
    """``flat`` with each leaf that its template node's type upgrades (:data:`UPGRADE_ON_RESTORE`:
    a layout an older release saved) in today's layout; from_flat_dict checks the result."""
    out = dict(flat)
    for name, (upgrades, field, _) in _opted_leaves(template, UPGRADE_ON_RESTORE).items():
        if out.get(name) is not None:
            out[name] = upgrades[field](out[name])
    return out


def _running_values_cast(flat: dict[str, Any], template: Any) -> dict[str, Any]:
    """``flat`` with each saved running value (a field its type names in
    :data:`CAST_ON_RESTORE`) in the floating dtype of the template's leaf: ``x.astype(t)``
    where both are floating and the shapes agree, else as saved (from_flat_dict reports it)."""
    out = dict(flat)
    for name, (_, _, want) in _opted_leaves(template, CAST_ON_RESTORE).items():
        saved: Any = out.get(name)
        if _floats_of_one_shape(saved, want) and saved.dtype != want.dtype:
            out[name] = saved.astype(want.dtype)
    return out


def _floats_of_one_shape(saved: Any, want: Any) -> bool:
    dtypes = [getattr(x, "dtype", None) for x in (saved, want)]  # (np.dtype == None holds for float64)
    return (all(d is not None and jnp.issubdtype(d, jnp.floating) for d in dtypes)
            and saved.shape == want.shape)


def rebuild(spec: dict[str, Any], arrays: dict[str, Any], template: Any, part: str = "",
             step: Any = "-", hint: str = "", plain: str = "") -> Any:
    """The tree ``spec`` describes: with its saved types, or checked against ``template``
    (``plain``: the call reading it as saved, for the message; default ``.{part}``)."""
    if template is None:
        return decode(spec, arrays, part)
    at, plain = ((f" at step {step}", plain or f"manager.restore({step}).{part}") if part else
                 ("", "ft.train.load(path)       # ft.train.save's tree, no template"))
    try:
        tree, report = with_template(spec, arrays, template, part)
    except ValueError as e:  # from_flat_dict's own refusal (a tie the saved arrays break): a mismatch too
        if isinstance(e, CheckpointError):
            raise
        raise TemplateMismatch(TEMPLATE_MISMATCH.format(part=part or "tree", at=at, plain=plain, hint=hint,
                                                        report=_refusal(e)), part) from None
    if not report.ok:
        hint += _lora_added(report, part or "tree", plain.split("#")[0].strip())
        report = _loader_hints(report, part or "tree", plain.split("#")[0].strip())
        raise TemplateMismatch(TEMPLATE_MISMATCH.format(part=part or "tree", at=at, plain=plain, report=report,
                                                        hint=hint), part)
    layers = layer_differences(spec, template, part)
    differences = layers or static_differences(spec, template, part)
    if differences:
        lines = "\n".join(f"    {where}: saved {saved}, the template's {mine}" for where, saved, mine in differences[:8])
        more = f"\n    ... and {len(differences) - 8} more" if len(differences) > 8 else ""
        where, saved, mine = differences[0]
        if step == "-":  # ft.train.load
            what, wrong, right = "This checkpoint's tree", "ft.train.load(path, template)", "ft.train.load(path)"
        else:
            what = f"The checkpoint's {part} at step {step}"
            given = _TEMPLATE_PARAMETERS.get(part.split(".")[0], "template")
            wrong, right = f"manager.restore({step}, {given}=...)", (plain or f"manager.restore({step}).{part}") + hint
        if saved.startswith("functools.partial("):  # read as saved, it would need a template again
            right = TEMPLATE_WITH_SAVED.format(wrong=wrong, field=where.rsplit(".", 1)[-1], saved=saved)
        message = LAYERS_DIFFER if layers else STATIC_MISMATCH
        raise TemplateMismatch(message.format(what=what, part=part or "tree", lines=lines + more, wrong=wrong,
                                              right=right, where=where, mine=mine, saved=saved), part)
    return tree


def _lora_added(report: FlatDictReport, part: str, plain: str) -> str:
    """:data:`LORA_ADDED` where the template lacks nothing but ft.nn.lora's adapters (a base's
    checkpoint read into the adapted model), else ``""``."""
    if not report.missing or report.unexpected or report.mismatched or part == "opt_state":
        return ""
    if not all(name.rsplit(".", 1)[-1] in ADDED_FIELDS for name in report.missing):
        return ""
    names = ", ".join(report.missing[:4]) + (", ..." if len(report.missing) > 4 else "")
    if plain.startswith("manager."):  # trainer.restore(path) opened the manager itself
        plain = "ft.train.CheckpointManager(path)." + plain.removeprefix("manager.")
    return LORA_ADDED.format(names=names, part=part, plain=plain)


def _refusal(e: ValueError) -> str:
    """from_flat_dict's refusal as a report line, without its own fix (for a flat dict in
    hand, not a checkpoint): two saved arrays at the places a template's tie holds once."""
    line = str(e).splitlines()[0].removeprefix("ft.from_flat_dict: ")
    if " A tie holds one value" in line:
        line = line.split(" A tie holds one value")[0].rstrip(".") + ": the tree was saved without the tie"
    return "  " + line


_TEMPLATE_PARAMETERS = {"model": "template", "opt_state": "opt_state_template", "extra": "extra_template"}


def _template_names(spec: Any, part: str) -> dict[str, dict[str, Any]]:
    """``{the name from_flat_dict gives a leaf: its spec}``: the stored keys without the
    part's prefix (``model.``). A tree that is one leaf (a bare array or number) is stored as
    ``"value"`` (or as its part, ``"model"``) and is the template's root, named ``""``."""
    if isinstance(spec, dict) and spec.get("kind") in ("leaf", "function") and isinstance(spec.get("key"), str):
        return {"": spec}
    prefix = part + "." if part else ""
    # the stored key, but "" for the leaf whose key path is "" (a dict's "" key at the root),
    # stored as "value" (no name orbax takes); positional paths name an old file's leaves
    return {"" if at == "" else s["key"][len(prefix):]: s for at, s in leaf_specs(spec, part)
            if s["key"].startswith(prefix)}


def _loader_hints(report: FlatDictReport, part: str, restore: str) -> FlatDictReport:
    """``report`` with from_flat_dict's ``cast=True`` hint, which no loader takes, given as
    the code that casts a restored tree (``restore``: the call reading it as saved), and its
    conversion of values of another kind (a flat dict's code) as the loader's way."""
    # with_hint formats the text ({names}): the braces of a dict in the code are kept
    cast = CAST_CODE.format(restore=restore).replace("{", "{{").replace("}", "}}")
    note = CAST_NOTE["manager" if restore.startswith("manager.") else ""]
    report = report.with_hint("kind", KIND_ON_LOAD.format(part=part)).with_hint("wraps", WRAPS_ON_LOAD.format(part=part))
    report = report.with_hint("int", INT_DIFFER + CAST_ON_LOAD.format(part=part, cast=cast, note=note))
    return report.with_hint("float", FLOAT_DIFFER + CAST_ON_LOAD.format(part=part, cast=cast, note=note))
