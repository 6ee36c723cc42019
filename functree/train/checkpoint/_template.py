"""A saved part read back against a template: its leaves by key path into the template's
tree (:func:`functree.from_flat_dict`, shapes and dtypes checked), then its static values
compared with the template's (:func:`._treespec.static_differences`); either mismatch is a
:class:`CheckpointError` naming the call that reads the part as saved.
"""

from __future__ import annotations

from typing import Any

from functree._state_dict import FLOAT_DIFFER, FlatDictReport, from_flat_dict
from functree.train.checkpoint._decode import decode, decode_leaf, leaf_specs
from functree.train.checkpoint._errors import CheckpointError
from functree.train.checkpoint._treespec import static_differences

__all__ = ["rebuild", "with_template", "TEMPLATE_MISMATCH", "STATIC_MISMATCH", "CAST_ON_LOAD"]

TEMPLATE_MISMATCH = """\
The checkpoint's {part}{at} does not fit the template:
{report}
Build the template the same way as the saved {part} (same layer sizes, dtypes and \
optimizer), or restore without a template to get the saved {part} back as it was:

    {plain}{hint}"""

CAST_ON_LOAD = """\
the loader never casts (a template checks the saved dtypes); read the saved {part} as it was \
saved and cast it into the template: {cast}   # then ft.shard(tree, mesh, rules) for a mesh"""

STATIC_MISMATCH = """\
{what} was saved with other static configuration than the template's. A template gives the \
saved arrays their structure; these fields change what the {part} computes, and the \
template's values would replace the saved ones silently:
{lines}
Build the template with the saved values, or restore without a template to get the saved \
{part} as it was saved:

    wrong:  {wrong}      # the template's {where} is {mine}; saved: {saved}
    right:  {right}"""


def with_template(spec: dict[str, Any], arrays: dict[str, Any], template: Any, part: str,
                   ) -> tuple[Any, FlatDictReport]:
    """``from_flat_dict(template, the saved leaves under part)``: the tree and its report."""
    flat = {name: decode_leaf(s, arrays, s["key"]) for name, s in _template_names(spec, part).items()}
    return from_flat_dict(template, flat, strict=False)


def rebuild(spec: dict[str, Any], arrays: dict[str, Any], template: Any, part: str = "",
             step: Any = "-", hint: str = "", plain: str = "") -> Any:
    """The tree ``spec`` describes: with its saved types, or checked against ``template``
    (``plain``: the call reading it as saved, for the message; default ``.{part}``)."""
    if template is None:
        return decode(spec, arrays, part)
    tree, report = with_template(spec, arrays, template, part)
    if not report.ok:
        at, plain = ((f" at step {step}", plain or f"manager.restore({step}).{part}") if part else
                     ("", "ft.train.load(path)       # ft.train.save's tree, no template"))
        report = _loader_hints(report, part or "tree", plain.split("#")[0].strip())
        raise CheckpointError(TEMPLATE_MISMATCH.format(part=part or "tree", at=at, plain=plain, report=report,
                                                       hint=hint))
    differences = static_differences(spec, template, part)
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
        raise CheckpointError(STATIC_MISMATCH.format(what=what, part=part or "tree", lines=lines + more, wrong=wrong,
                                                     right=right, where=where, mine=mine, saved=saved))
    return tree


_TEMPLATE_PARAMETERS = {"model": "template", "opt_state": "opt_state_template", "extra": "extra_template"}


def _template_names(spec: Any, part: str) -> dict[str, dict[str, Any]]:
    """``{the name from_flat_dict gives a leaf: its spec}``: the stored keys without the
    part's prefix (``model.``). A tree that is one leaf (a bare array or number) is stored as
    ``"value"`` (or as its part, ``"model"``) and is the template's root, named ``""``."""
    if isinstance(spec, dict) and spec.get("kind") in ("leaf", "function") and isinstance(spec.get("key"), str):
        return {"": spec}
    prefix = part + "." if part else ""
    return {s["key"][len(prefix):]: s for _, s in leaf_specs(spec, part) if s["key"].startswith(prefix)}


def _loader_hints(report: FlatDictReport, part: str, restore: str) -> FlatDictReport:
    """``report`` with from_flat_dict's ``cast=True`` hint, which no loader takes, given as
    the code that casts a restored tree (``restore``: the call reading it as saved)."""
    cast = f"ft.from_flat_dict(template, ft.to_flat_dict({restore}), cast=True)"
    cast = cast.replace("{", "{{").replace("}", "}}")  # with_hint formats the text ({names}): a dict's braces kept
    return report.with_hint("float", FLOAT_DIFFER + CAST_ON_LOAD.format(part=part, cast=cast))
