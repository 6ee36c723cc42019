"""A checkpoint's ``extra`` part read back: a dict ``extra_template`` reads a saved dict
entry by entry (a template per entry, None as saved, :data:`SKIP` not at all), and a
Module of the model's class that does not decode alone (its class edited since the save,
or a static value in it only a template gives back) is read with the model as its
template, as the model part is.
"""

from __future__ import annotations

from typing import Any

from functree._module import Module
from functree._tree import child_name
from functree.train.checkpoint._decode import EditedReader, decode, dict_entries
from functree.train.checkpoint._errors import CheckpointError
from functree.train.checkpoint._registry import type_name
from functree.train.checkpoint._template import rebuild, with_template
from functree.train.checkpoint._treespec import same_classes, static_differences

__all__ = ["SKIP", "read_extra", "placed_templates", "NO_EXTRA_ENTRY", "ENTRY_AS_SAVED"]

NO_EXTRA_ENTRY = """\
extra_template gives a template for {where}, but the checkpoint's extra at step {step} has \
no entry {key!r}: its entries are {saved}. Name the entries it has (the others are read \
as saved):

    wrong:  manager.restore({step}, extra_template={{{key!r}: template}})
    right:  manager.restore({step}, extra_template={right})"""

ENTRY_AS_SAVED = "manager.restore({step}, extra_template={{{key!r}: None}}).extra[{key!r}]   # this entry as saved"


class _Skip:
    """The type of :data:`SKIP`."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "CheckpointManager.SKIP"

SKIP: Any = _Skip()  # an entry of extra_template not read at all (CheckpointManager.SKIP)


def _like_model(model: Any) -> EditedReader | None:
    """Reads a Module of ``model``'s class (by its stored name: nothing looked up) that does
    not decode alone, its class (or one inside it) edited since the save (a static field
    added) or shared by several live classes (a class made by a function called twice), or
    a static value in it that only a template gives back (a ``functools.partial`` or a
    script's own function as activation: :class:`StaticNeedsTemplateError`), with ``model``
    as its template, as the model part is read, where it fits: the same classes at the same
    key paths (:func:`same_classes`), the same leaf key paths, shapes and dtypes
    (:func:`from_flat_dict`'s report) and the same static values, a value stored as its
    text compared as text (``texts=True``: a teacher's ``partial(leaky_relu,
    negative_slope=0.1)`` is not the model's ``0.3``). The best model
    of ``EarlyStopping(restore_best=True)`` in ``extra`` then reads as the model does; one
    that does not fit keeps its error. A Module that decodes by name is read as saved."""
    if not isinstance(model, Module):
        return None
    name = type_name(type(model))

    def read(spec: dict[str, Any], arrays: dict[str, Any], path: str) -> tuple[bool, Any]:
        if spec.get("class") != name:
            return False, None
        if not same_classes(spec, model):  # another layer class inside (a MaxPool2D where the model has AvgPool2D)
            return False, None
        tree, report = with_template(spec, arrays, model, path)
        return (True, tree) if report.ok and not static_differences(spec, model, path, texts=True) else (False, None)

    return read


def read_extra(spec: Any, arrays: dict[str, Any], template: Any, model: Any, step: int) -> Any:
    """The checkpoint's ``extra``: a dict ``template`` reads a saved dict entry by entry
    (:func:`_extra_entries`); None, or a dict naming no template (only None and
    :data:`SKIP`) when the saved extra is no dict, reads it as saved; any other template is
    the whole extra's. Read as saved, a Module of ``model``'s class edited since the save is
    read like the model (:func:`_like_model`)."""
    edited = _like_model(model)
    if isinstance(template, dict) and isinstance(spec, dict) and spec.get("kind") == "dict":
        return _extra_entries(spec, arrays, template, edited, step)
    if isinstance(template, dict) and template and all(t is None or t is SKIP for t in template.values()):
        template = None  # nothing to check: a saved extra that is no dict has no entry to skip
    if template is None:
        return decode(spec, arrays, "extra", edited=edited)
    return rebuild(spec, arrays, template, "extra", step)


def _extra_entries(spec: dict[str, Any], arrays: dict[str, Any], templates: dict[Any, Any],
                   edited: EditedReader | None, step: int) -> dict[Any, Any]:
    """A saved dict ``extra``, each entry read by its template in ``templates``: a tree
    (checked as a part is: key path ``extra.<entry>``, shape, dtype, static values), None or
    no mention (as saved), :data:`SKIP` (left out of the result, its types never read; its
    arrays are checked with the others'). A template for an entry the checkpoint lacks is
    :data:`NO_EXTRA_ENTRY`."""
    entries = dict_entries(spec, "extra")
    saved = [key for key, _, _ in entries]
    for key, template in templates.items():
        if key not in saved and template is not None and template is not SKIP:
            right = f"{{{saved[0]!r}: template}}" if saved else "None   # it has no entry"
            raise CheckpointError(NO_EXTRA_ENTRY.format(where=child_name("extra", key), step=step, key=key,
                                                        saved=saved, right=right))
    out = {}
    for key, at, child in entries:
        template = templates.get(key)
        if template is SKIP:
            continue
        out[key] = decode(child, arrays, at, edited=edited) if template is None else rebuild(
            child, arrays, template, at, step, plain=ENTRY_AS_SAVED.format(step=step, key=key))
    return out


def placed_templates(templates: dict[str, Any]) -> dict[str, Any]:
    """The templates that place arrays: ``extra``'s entries without :data:`SKIP`."""
    extra = templates["extra"]
    if isinstance(extra, dict):
        templates = {**templates, "extra": {k: t for k, t in extra.items() if t is not SKIP}}
    return templates
