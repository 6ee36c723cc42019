"""Checkpoints: the model, the optimizer state (with its learning context) and the
configuration at a step, written through orbax and rebuilt with their original types.

Each checkpoint is an orbax step directory with two items: ``arrays`` (every leaf by its
dotted key path, ``model.layers.0.weight``, ``opt_state.0.mu.layers.0.weight``) and
``meta`` (JSON: the tree's types by import path, the step, metrics and configuration).
Orbax writes into a temporary directory and renames it when complete, so a process killed
mid-save leaves the previous checkpoint loadable.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple, cast

import jax
import numpy as np
import orbax.checkpoint as ocp

from functree._state_dict import from_flat_dict
from functree.train._treespec import CheckpointError, _decode_leaf, decode, encode

__all__ = ["Checkpoint", "CheckpointManager", "save", "load", "CheckpointError"]

FORMAT = "functree-checkpoint-1"
_PARTS = ("model", "opt_state", "extra")

NOT_A_CHECKPOINT_DIRECTORY = """\
{path} is not a checkpoint directory: it holds {entries}, which are not checkpoint steps.
Nothing was written. Give the checkpoints a directory of their own:

    wrong:  ft.train.CheckpointManager("{path}")
    right:  ft.train.CheckpointManager("{path}/checkpoints")"""

NOT_A_DIRECTORY = """\
{path} exists and is a file, not a directory. Nothing was written.

    wrong:  ft.train.CheckpointManager("{path}")
    right:  ft.train.CheckpointManager("{path}_checkpoints")"""

NO_CHECKPOINT = """\
No checkpoint {what} in {path} (steps present: {steps}).

    wrong:  manager.restore({step})
    right:  manager.restore()          # the latest, or one of {steps}"""

CORRUPTED = """\
The checkpoint at {path} is corrupted or incomplete and cannot be read ({error}).
Nothing was changed on disk. Restore another step instead: {others}

    wrong:  manager.restore({step})
    right:  manager.restore({suggestion})"""

TEMPLATE_MISMATCH = """\
The checkpoint's {part} at step {step} does not fit the template:
{report}
Build the template the same way as the saved {part} (same layer sizes, dtypes and \
optimizer), or restore without a template to get the saved {part} back as it was:

    manager.restore(step).{part}"""

BAD_MODE = """\
mode must be "min" or "max", got {mode!r}.

    wrong:  CheckpointManager(path, best_metric="val_loss", mode={mode!r})
    right:  CheckpointManager(path, best_metric="val_loss", mode="min")"""

MISSING_METRIC = """\
The checkpoint at step {step} ranks by {metric!r} but its metrics are {given}.

    wrong:  manager.save(step, model, opt_state)
    right:  manager.save(step, model, opt_state, metrics={{"{metric}": value}})"""

STEP_EXISTS = """\
{path} already holds a checkpoint at step {step}. Nothing was overwritten.

    wrong:  manager.save({step}, model, opt_state)      # again
    right:  manager.delete({step}); manager.save({step}, model, opt_state)
       or:  manager.save(next_step, model, opt_state)"""

PATH_EXISTS = """\
{path} already exists. Nothing was overwritten.

    wrong:  ft.train.save("{path}", tree)
    right:  ft.train.save("{path}", tree, overwrite=True)"""


class Checkpoint(NamedTuple):
    """What :meth:`CheckpointManager.restore` returns.

    ``model``, ``opt_state`` and ``extra`` are the saved trees (None where not saved or
    not in ``include``); ``step``, ``metrics`` and ``config`` are as given to ``save``.

    Example:
      >>> import functree as ft, jax, tempfile
      >>> model = ft.nn.Dense(2, 1, key=jax.random.key(0))
      >>> with tempfile.TemporaryDirectory() as d, ft.train.CheckpointManager(d + "/run") as mngr:
      ...     mngr.save(5, model, metrics={"loss": 0.25}, config={"lr": 0.1})
      ...     ckpt = mngr.restore()
      >>> ckpt.step, ckpt.metrics, ckpt.config, ckpt.opt_state
      (5, {'loss': 0.25}, {'lr': 0.1}, None)
      >>> ckpt.model
      Dense(weight=f32[2,1], bias=f32[1], activation=identity)
    """

    model: Any
    opt_state: Any
    step: int
    metrics: dict[str, Any]
    config: dict[str, Any]
    extra: Any = None


_STEP_DIR = re.compile(r"^\d+$")
_TMP = ".orbax-checkpoint-tmp"


def _check_directory(path: Path) -> None:
    if path.exists() and not path.is_dir():
        raise CheckpointError(NOT_A_DIRECTORY.format(path=path))
    if not path.exists():
        return
    foreign = sorted(
        e.name for e in path.iterdir() if not (_STEP_DIR.match(e.name) or _TMP in e.name)
    )
    if foreign:
        shown = ", ".join(repr(n) for n in foreign[:5]) + (" ..." if len(foreign) > 5 else "")
        raise CheckpointError(NOT_A_CHECKPOINT_DIRECTORY.format(path=path, entries=shown))


def _json_value(x: Any) -> Any:
    """Metrics and configuration as JSON: arrays become numbers or lists."""
    if isinstance(x, Mapping):
        return {str(k): _json_value(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_value(v) for v in x]
    if isinstance(x, (jax.Array, np.ndarray, np.generic)):
        return np.asarray(x).tolist()
    return x


def _leaf_specs(spec: dict[str, Any]) -> list[dict[str, Any]]:
    out, stack = [], [spec]
    while stack:
        s = stack.pop()
        if s["kind"] == "leaf":
            out.append(s)
        stack.extend(s.get("items", []))
        stack.extend(s.get("fields", {}).values())
    return out


def _rebuild(part: str, spec: dict[str, Any], arrays: dict[str, Any], template: Any, step: int) -> Any:
    if template is None:
        return decode(spec, arrays, part)
    prefix = part + "."
    flat = {
        s["key"][len(prefix):]: _decode_leaf(s, arrays)
        for s in _leaf_specs(spec)
        if s["key"].startswith(prefix)
    }
    tree, report = from_flat_dict(template, flat, strict=False)
    if not report.ok:
        raise CheckpointError(TEMPLATE_MISMATCH.format(part=part, step=step, report=report))
    return tree


def _read(mngr: ocp.CheckpointManager, step: int) -> tuple[dict[str, Any], dict[str, Any]]:
    args = ocp.args.Composite(arrays=ocp.args.StandardRestore(), meta=ocp.args.JsonRestore())
    restored = mngr.restore(step, args=args)
    meta = restored["meta"]
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ValueError(f"no {FORMAT} metadata")
    return dict(restored["arrays"]), meta


class CheckpointManager:
    """Save checkpoints at steps; keep the last ``max_to_keep`` and the best by a metric.

    ``save(step, model, opt_state, metrics=..., config=...)`` writes one checkpoint
    atomically (orbax: temporary directory, renamed when complete). ``restore()`` returns
    the latest :class:`Checkpoint`, rebuilt with the saved types (Modules, NamedTuples,
    Python scalars, PRNG keys) or, given ``template=``, checked against it leaf by leaf
    (key path, shape and dtype) with every mismatch reported.

    With ``best_metric="val_loss"`` the checkpoint with the lowest (``mode="min"``) or
    highest (``mode="max"``) value is kept as well as the last ``max_to_keep``.

    Example:
      >>> import functree as ft, jax, tempfile
      >>> model = ft.nn.Dense(2, 1, key=jax.random.key(0))
      >>> manager = ft.train.CheckpointManager(tempfile.mkdtemp() + "/run", max_to_keep=2)
      >>> for step in (10, 20, 30):
      ...     manager.save(step, model.replace(bias=model.bias + step), metrics={"loss": 1 / step})
      >>> manager.all_steps()
      [20, 30]
      >>> manager.restore().model
      Dense(weight=f32[2,1], bias=f32[1], activation=identity)
      >>> manager.restore(20).model.bias
      Array([20.], dtype=float32)
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        max_to_keep: int | None = 3,
        best_metric: str | None = None,
        mode: str = "min",
        *,
        asynchronous: bool = False,
    ):
        if mode not in ("min", "max"):
            raise ValueError(BAD_MODE.format(mode=mode))
        self.directory = Path(directory).absolute()
        _check_directory(self.directory)
        self.best_metric, self.mode = best_metric, mode
        self.max_to_keep = max_to_keep
        self._metrics: dict[int, dict[str, Any]] = {}
        # Retention (last k plus the best) is applied here, from the metrics stored in
        # each checkpoint's own JSON, so it also holds across processes.
        options = ocp.CheckpointManagerOptions(
            enable_async_checkpointing=asynchronous,
            cleanup_tmp_directories=True,
            save_root_metadata=False,
            create=True,
        )
        self._mngr = ocp.CheckpointManager(self.directory, options=options)

    def save(
        self,
        step: int,
        model: Any,
        opt_state: Any = None,
        *,
        metrics: Mapping[str, Any] | None = None,
        config: Mapping[str, Any] | None = None,
        extra: Any = None,
    ) -> None:
        """Write a checkpoint of ``model``, ``opt_state`` and ``extra`` (any tree) at ``step``.

        ``metrics`` (numbers) rank checkpoints for ``best_metric``; ``config`` is any JSON:
        optimizer and trainer options, data position, notes.
        """
        step = int(step)
        metrics = cast("dict[str, Any]", _json_value(dict(metrics or {})))
        if self.best_metric is not None and self.best_metric not in metrics:
            raise CheckpointError(
                MISSING_METRIC.format(step=step, metric=self.best_metric, given=sorted(metrics))
            )
        arrays, spec = encode({"model": model, "opt_state": opt_state, "extra": extra})
        meta = {
            "format": FORMAT,
            "step": step,
            "spec": spec,
            "metrics": metrics,
            "config": _json_value(dict(config or {})),
        }
        args = ocp.args.Composite(
            arrays=ocp.args.StandardSave(arrays), meta=ocp.args.JsonSave(meta)
        )
        if (self.directory / str(step)).exists():
            raise CheckpointError(STEP_EXISTS.format(path=self.directory, step=step))
        self._mngr.save(step, args=args, force=True)
        self._metrics[step] = metrics
        self._prune(step)

    def _prune(self, newest: int) -> None:
        steps = sorted(set(self._mngr.all_steps()) | {newest})
        keep = set(steps if self.max_to_keep is None else steps[-self.max_to_keep:])
        best = self.best_step(steps)
        if best is not None:
            keep.add(best)
        for step in steps:
            if step not in keep:
                self._mngr.delete(step)
                self._metrics.pop(step, None)

    def _step_metrics(self, step: int) -> dict[str, Any]:
        if step not in self._metrics:
            args = ocp.args.Composite(meta=ocp.args.JsonRestore())
            try:
                meta = self._mngr.restore(step, args=args)["meta"]
            except Exception:  # an unreadable checkpoint never ranks as the best
                return {}
            self._metrics[step] = meta.get("metrics", {}) if isinstance(meta, dict) else {}
        return self._metrics[step]

    def delete(self, step: int) -> None:
        """Remove the checkpoint at ``step``."""
        self._mngr.delete(int(step))

    def wait_until_finished(self) -> None:
        """Block until an asynchronous save has been written."""
        self._mngr.wait_until_finished()

    def all_steps(self) -> list[int]:
        """The steps with a complete checkpoint, ascending."""
        self._mngr.reload()
        return sorted(self._mngr.all_steps())

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step, or None."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def best_step(self, steps: list[int] | None = None) -> int | None:
        """The kept step with the best ``best_metric`` (None without one)."""
        if self.best_metric is None:
            return None
        scored = []
        for step in self.all_steps() if steps is None else steps:
            value = self._step_metrics(step).get(self.best_metric)
            if isinstance(value, (int, float)) and value == value:  # not NaN
                scored.append((value, step))
        if not scored:
            return None
        return (min(scored) if self.mode == "min" else max(scored))[1]

    def restore(
        self,
        step: int | None = None,
        *,
        template: Any = None,
        opt_state_template: Any = None,
        extra_template: Any = None,
        include: tuple[str, ...] = ("model", "opt_state", "extra"),
    ) -> Checkpoint:
        """The :class:`Checkpoint` at ``step`` (default: the latest).

        ``template`` (a model), ``opt_state_template`` and ``extra_template`` are checked
        against the saved leaves by key path, shape and dtype, every mismatch reported at
        once; parts without a template are rebuilt from the saved type information.
        Parts left out of ``include`` come back as None (e.g. ``include=("model",)`` to
        continue a saved model with new optimizer options).
        """
        steps = self.all_steps()
        chosen = steps[-1] if step is None and steps else step
        if chosen is None or chosen not in steps:
            what = "at all" if not steps else f"at step {step}"
            raise CheckpointError(
                NO_CHECKPOINT.format(what=what, path=self.directory, steps=steps, step=step or "")
            )
        try:
            arrays, meta = _read(self._mngr, chosen)
        except Exception as e:  # orbax raises many types for damaged files
            others = [s for s in steps if s != chosen]
            raise CheckpointError(
                CORRUPTED.format(
                    path=self.directory / str(chosen),
                    error=f"{type(e).__name__}: {str(e)[:300]}",
                    others=f"steps {others}" if others else "none is left",
                    step=chosen,
                    suggestion=others[-1] if others else "",
                )
            ) from e
        templates = {"model": template, "opt_state": opt_state_template, "extra": extra_template}
        parts = dict(zip(_PARTS, meta["spec"]["items"]))
        rebuilt = {
            p: _rebuild(p, parts[p], arrays, templates[p], chosen) if p in include else None
            for p in _PARTS
        }
        return Checkpoint(
            model=rebuilt["model"],
            opt_state=rebuilt["opt_state"],
            step=int(meta["step"]),
            metrics=meta["metrics"],
            config=meta["config"],
            extra=rebuilt["extra"],
        )

    def close(self) -> None:
        """Finish pending saves and release orbax's resources."""
        self._mngr.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"CheckpointManager({str(self.directory)!r}, steps={self.all_steps()})"


def save(path: str | os.PathLike[str], tree: Any, *, overwrite: bool = False) -> None:
    """Save one tree (a model, an optimizer state, anything) to ``path``, atomically.

    Example:
      >>> import functree as ft, jax.numpy as jnp, tempfile
      >>> path = tempfile.mkdtemp() + "/model"
      >>> ft.train.save(path, {"w": jnp.ones(2), "steps": 3})
      >>> ft.train.load(path)
      {'w': Array([1., 1.], dtype=float32), 'steps': 3}
    """
    path = Path(path).absolute()
    if path.exists() and not overwrite:
        raise CheckpointError(PATH_EXISTS.format(path=path))
    arrays, spec = encode(tree)
    meta = {"format": FORMAT, "spec": spec}
    args = ocp.args.Composite(arrays=ocp.args.StandardSave(arrays), meta=ocp.args.JsonSave(meta))
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
        checkpointer.save(path, args=args, force=overwrite)


def load(path: str | os.PathLike[str], template: Any = None) -> Any:
    """Load a tree written by :func:`save`; with ``template``, check it leaf by leaf.

    Without a template the tree is rebuilt with its saved types (Modules, NamedTuples,
    Python scalars); with one, every leaf must match it in key path, shape and dtype.

    Example:
      >>> import functree as ft, jax, jax.numpy as jnp, tempfile
      >>> model = ft.nn.Dense(2, 1, key=jax.random.key(0))
      >>> with tempfile.TemporaryDirectory() as d:
      ...     ft.train.save(d + "/model", model)
      ...     restored, checked = ft.train.load(d + "/model"), ft.train.load(d + "/model", model)
      >>> restored, bool(jnp.all(checked.weight == model.weight))
      (Dense(weight=f32[2,1], bias=f32[1], activation=identity), True)
    """
    path = Path(path).absolute()
    args = ocp.args.Composite(arrays=ocp.args.StandardRestore(), meta=ocp.args.JsonRestore())
    try:
        with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
            restored = checkpointer.restore(path, args=args)
        meta, arrays = restored["meta"], dict(restored["arrays"])
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise ValueError(f"no {FORMAT} metadata")
    except Exception as e:
        raise CheckpointError(
            f"{path} is not a readable functree checkpoint ({type(e).__name__}: {str(e)[:300]}).\n"
            "Pass the directory written by ft.train.save(path, tree)."
        ) from e
    if template is None:
        return decode(meta["spec"], arrays)
    return _rebuild_single(meta["spec"], arrays, template)


def _rebuild_single(spec: dict[str, Any], arrays: dict[str, Any], template: Any) -> Any:
    flat = {s["key"]: _decode_leaf(s, arrays) for s in _leaf_specs(spec)}
    tree, report = from_flat_dict(template, flat, strict=False)
    if not report.ok:
        raise CheckpointError(TEMPLATE_MISMATCH.format(part="tree", step="-", report=report))
    return tree
