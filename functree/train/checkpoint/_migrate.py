"""Format 1 (functree before checksums) read once, explicitly, into a checked copy.

Reading never accepts format 1: a checkpoint relabelled ``functree-checkpoint-1`` cannot
switch the integrity checks off. :func:`migrate` reads a format-1 checkpoint as it is,
translates its private type names (``functree.nn._linear:Dense``) to public ones and its
``import`` static values to registered ``function`` names, and writes a format-2 copy
with checksums, nothing imported or run on the way.
"""

from __future__ import annotations

import os
from typing import Any

from functree.train.checkpoint._arrays import placement, saved_arrays
from functree.train.checkpoint._checkpoint import save_args
from functree.train.checkpoint._directory import STEP_DIR, local_path, read_path
from functree.train.checkpoint._registry import public_name
from functree.train.checkpoint._treespec import CheckpointError

__all__ = ["migrate"]

NOT_FORMAT_1 = """\
{path} is not a format-1 functree checkpoint ({why}); only those need migrating.

    wrong:  ft.train.migrate("{path}", destination)
    right:  ft.train.load("{path}")        # or manager.restore(): format 2 is read as it is"""


def _public(node: Any) -> Any:
    """The spec with format 2's names (a copy)."""
    if isinstance(node, list):
        return [_public(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: _public(v) for k, v in node.items()}
    if isinstance(out.get("class"), str):
        out["class"] = public_name(out["class"], "class")
    if set(out) == {"import"} and isinstance(out["import"], str):
        out = {"function": public_name(out["import"], "function")}
    return out


def migrate(source: str | os.PathLike[str], destination: str | os.PathLike[str]) -> None:
    """Write a format-2 copy (checksummed, public names) of a format-1 checkpoint.

    ``source`` is a checkpoint (``ft.train.save``'s path or one step of a manager's
    directory) or a manager's directory, whose steps are all migrated into
    ``destination/<step>``. ``destination`` must not exist. The arrays are copied as they
    are read: migrate only checkpoints you trust.

    Example:
      >>> import functree as ft, jax.numpy as jnp, tempfile
      >>> d = tempfile.mkdtemp()
      >>> ft.train.save(d + "/new", {"w": jnp.ones(2)})
      >>> ft.train.migrate(d + "/new", d + "/copy")
      Traceback (most recent call last):
      functree.train.checkpoint._treespec.CheckpointError: ...new is not a format-1 functree checkpoint (its format is 'functree-checkpoint-2'); only those need migrating...
    """
    import orbax.checkpoint as ocp  # on first use: import functree stays light
    source, destination = read_path(source, "ft.train.migrate"), local_path(destination)
    steps = [p for p in source.iterdir() if STEP_DIR.match(p.name)] if source.is_dir() else []
    if steps and not (source / "meta").exists():
        for step in steps:
            migrate(step, destination / step.name)
        return
    if not (source / "meta").exists():
        raise CheckpointError(NOT_FORMAT_1.format(path=source, why="it holds no checkpoint"))
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
        meta = checkpointer.restore(source, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        if not isinstance(meta, dict) or meta.get("format") != "functree-checkpoint-1":
            why = f"its format is {meta.get('format') if isinstance(meta, dict) else None!r}"
            raise CheckpointError(NOT_FORMAT_1.format(path=source, why=why))
        target = placement({})(saved_arrays(source / "arrays"), meta)  # the default device, not the writer's
        arrays = checkpointer.restore(source, args=ocp.args.Composite(arrays=ocp.args.StandardRestore(target)))["arrays"]
        fields = {k: meta[k] for k in ("step", "metrics", "config") if k in meta}
        args = save_args(dict(arrays), _public(meta.get("spec")), migrated_from=meta["format"], **fields)
        checkpointer.save(destination, args=args)
