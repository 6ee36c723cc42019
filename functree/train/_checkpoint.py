"""Checkpoints: the model, the optimizer state (with its learning context) and the
configuration at a step, written through orbax and rebuilt with their original types.

Each checkpoint is an orbax step directory with two items: ``arrays`` (every leaf by its
dotted key path, ``model.layers.0.weight``, ``opt_state.0.mu.layers.0.weight``) and
``meta`` (JSON: the tree's types by public name, the step, metrics, configuration, a
CRC-32 of every array's bytes and one of the metadata itself). Restoring verifies both.
Orbax writes into a temporary directory and renames it when complete, so a process killed
mid-save leaves the previous checkpoint loadable.

One writer at a time: a save holds ``.functree-writer.lock`` (pid and host) in the
directory; a second writer gets a :class:`CheckpointError`, a lock left by a dead process
on this host is taken over. Opening a manager never deletes anything; leftovers of killed
saves are removed by the next writer, under the lock. Retention re-reads the directory.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import time
import uuid
import zlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple, cast

import jax
import numpy as np
import orbax.checkpoint as ocp

from functree._state_dict import from_flat_dict
from functree.train._treespec import (
    CheckpointError,
    SpecError,
    _decode_leaf,
    decode,
    encode,
    leaf_specs,
)

__all__ = ["Checkpoint", "CheckpointManager", "save", "load", "CheckpointError"]

FORMAT = "functree-checkpoint-2"
_READABLE_FORMATS = ("functree-checkpoint-1", FORMAT)
_PARTS = ("model", "opt_state", "extra")
LOCK_NAME = ".functree-writer.lock"

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
The checkpoint at step {step} ({path}) is corrupted or incomplete and cannot be read ({error}).
Nothing was changed on disk. Restore another step instead: {others}

    wrong:  manager.restore({step})
    right:  manager.restore({suggestion})"""

TEMPLATE_MISMATCH = """\
The checkpoint's {part} at step {step} does not fit the template:
{report}
Build the template the same way as the saved {part} (same layer sizes, dtypes and \
optimizer), or restore without a template to get the saved {part} back as it was:

    manager.restore(step).{part}{hint}"""

OLD_OPTIMIZER_LAYOUT = """

This checkpoint was written before functree's one-context optimizer state (format \
functree-checkpoint-1). Restore the old state without a template and convert it:

    old = manager.restore(step, opt_state_template=None).opt_state
    opt_state = ft.optim.upgrade_state(old, optimizer, model)"""

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

BAD_MAX_TO_KEEP = """\
max_to_keep must be a positive int (how many recent checkpoints to keep) or None (keep
all), got {value!r}.

    wrong:  CheckpointManager(path, max_to_keep={value!r})
    right:  CheckpointManager(path, max_to_keep=3)       # or max_to_keep=None: keep all"""

CHECKSUM_MISMATCH = """\
The checkpoint at step {step} in {path} is corrupted: the array {key!r} {why}.
Its bytes changed after it was written (disk or copy error, or tampering); nothing was
loaded. Restore another step instead: {others}

    wrong:  manager.restore({step})
    right:  manager.restore({suggestion})"""

BAD_METADATA = """\
The checkpoint at step {step} in {path} has damaged metadata: {why}.
Nothing was loaded. Restore another step instead: {others}

    wrong:  manager.restore({step})
    right:  manager.restore({suggestion})"""

WRITER_ACTIVE = """\
Another writer is saving checkpoints into {path}: {lock} names pid {pid} on host {host!r}
(since {since}). Two writers in one directory would delete each other's checkpoints, so
nothing was written. Give each run its own directory:

    wrong:  CheckpointManager("{path}")                 # in two processes at once
    right:  CheckpointManager("{path}/run_2")
If that process is gone (e.g. it ran on another host and was killed), delete {lock}."""

_STEP_DIR = re.compile(r"^\d+$")
_TMP = ".orbax-checkpoint-tmp"


def _check_max_to_keep(value: Any) -> None:
    if value is None:
        return
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(BAD_MAX_TO_KEEP.format(value=value))


def _check_directory(path: Path) -> None:
    if path.exists() and not path.is_dir():
        raise CheckpointError(NOT_A_DIRECTORY.format(path=path))
    if not path.exists():
        return
    foreign = sorted(
        e.name
        for e in path.iterdir()
        if not (_STEP_DIR.match(e.name) or _TMP in e.name or e.name.startswith(LOCK_NAME))
    )
    if foreign:
        shown = ", ".join(repr(n) for n in foreign[:5]) + (" ..." if len(foreign) > 5 else "")
        raise CheckpointError(NOT_A_CHECKPOINT_DIRECTORY.format(path=path, entries=shown))


class _WriterLock:
    """``LOCK_NAME`` in the directory, created exclusively, holding ``{pid, host, time}``."""

    def __init__(self, directory: Path):
        self.path = directory / LOCK_NAME
        self.held = False
        self.token = uuid.uuid4().hex

    def _owner(self) -> dict[str, Any]:
        try:
            owner = json.loads(self.path.read_text())
            return owner if isinstance(owner, dict) else {}
        except (OSError, ValueError):
            return {}

    def _stale(self, owner: dict[str, Any]) -> bool:
        if not owner:  # unreadable: being written right now, or left half-written long ago
            try:
                return time.time() - self.path.stat().st_mtime > 60
            except OSError:
                return True
        if owner.get("host") != socket.gethostname() or not isinstance(owner.get("pid"), int):
            return False
        try:
            os.kill(owner["pid"], 0)
        except ProcessLookupError:
            return True
        except OSError:
            return False
        return False

    def acquire(self) -> bool:
        """Take the lock; False if this object already held it."""
        if self.held:
            return False
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                owner = self._owner()
                if not self._stale(owner):
                    raise CheckpointError(WRITER_ACTIVE.format(
                        path=self.path.parent, lock=self.path, pid=owner.get("pid", "?"),
                        host=owner.get("host", "?"),
                        since=time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(owner.get("time", 0))),
                    )) from None
                self._break()
                continue
            with os.fdopen(fd, "w") as f:
                json.dump({"pid": os.getpid(), "host": socket.gethostname(), "time": time.time(),
                           "token": self.token}, f)
            self.held = True
            return True
        raise CheckpointError(f"Could not take the writer lock {self.path}; retry the save.")

    def _break(self) -> None:
        """Remove a stale lock: rename first, so two breakers never remove a fresh lock."""
        moved = self.path.with_name(f"{LOCK_NAME}.stale-{uuid.uuid4().hex}")
        try:
            os.rename(self.path, moved)
            os.unlink(moved)
        except OSError:
            pass

    def release(self) -> None:
        if not self.held:
            return
        self.held = False
        try:
            if json.loads(self.path.read_text()).get("token") == self.token:
                self.path.unlink()
        except (OSError, ValueError):
            pass


def _remove_leftovers(directory: Path) -> None:
    """Temporary directories of saves that were killed (only called under the lock)."""
    for entry in directory.iterdir():
        if _TMP in entry.name:
            shutil.rmtree(entry, ignore_errors=True)


def _json_value(x: Any) -> Any:
    """Metrics and configuration as JSON: arrays become numbers or lists."""
    if isinstance(x, Mapping):
        return {str(k): _json_value(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_value(v) for v in x]
    if isinstance(x, (jax.Array, np.ndarray, np.generic)):
        return np.asarray(x).tolist()
    return x


def checksum(x: Any) -> int:
    """CRC-32 (zlib) of an array's bytes in C order."""
    a = np.ascontiguousarray(np.asarray(x)).reshape(-1)
    return zlib.crc32(cast(Any, a.view(np.uint8)))


def _local(x: Any) -> bool:
    """Whether this process holds all of ``x`` (an array spread over processes does not)."""
    return not isinstance(x, jax.Array) or x.is_fully_addressable


def _describe(arrays: dict[str, Any]) -> dict[str, Any]:
    """Each array's dtype, shape and CRC-32. An array spread over several processes is
    written collectively by orbax and never gathered here: its CRC is not taken (None)."""
    return {
        k: {"crc32": checksum(v) if _local(v) else None, "dtype": str(v.dtype), "shape": list(np.shape(v))}
        for k, v in arrays.items()
    }


def _mesh_of(tree: Any) -> dict[str, int]:
    from functree.parallel import mesh_shape  # functree.parallel imports ft.train

    return mesh_shape(tree)


def _digest(meta: dict[str, Any]) -> int:
    body = {k: v for k, v in meta.items() if k != "digest"}
    return zlib.crc32(json.dumps(body, sort_keys=True, allow_nan=True).encode())


def _sealed(meta: dict[str, Any]) -> dict[str, Any]:
    meta = json.loads(json.dumps(meta, allow_nan=True))
    meta["digest"] = _digest(meta)
    return meta


def _verify_meta(meta: Any, manager: bool) -> str | None:
    """What is wrong with ``meta`` (None when it is whole)."""
    if not isinstance(meta, dict) or meta.get("format") not in _READABLE_FORMATS:
        return f"no {FORMAT} metadata"
    if meta["format"] != "functree-checkpoint-1" and meta.get("digest") != _digest(meta):
        return "its CRC-32 does not match its contents (it was changed after it was written)"
    spec = meta.get("spec")
    if not isinstance(spec, dict):
        return "the type description is missing"
    if manager:
        if not isinstance(meta.get("step"), int) or isinstance(meta.get("step"), bool):
            return f"the step is {meta.get('step')!r}"
        for key in ("metrics", "config"):
            if not isinstance(meta.get(key), dict):
                return f"{key!r} is {type(meta.get(key)).__name__}, not a dict"
        items = spec.get("items")
        if spec.get("kind") != "dict" or not isinstance(items, list) or len(items) != len(_PARTS):
            return "the type description does not hold model, opt_state and extra"
    return None


def _verify_arrays(meta: dict[str, Any], arrays: dict[str, Any]) -> tuple[str, str] | None:
    """``(key, what is wrong)`` for the first array that does not match its checksum."""
    if meta["format"] == "functree-checkpoint-1":
        return None
    sums = meta.get("checksums")
    if not isinstance(sums, dict):
        return ("<all>", "has no checksums in the metadata")
    if set(sums) != set(arrays):
        extra = sorted(set(sums) ^ set(arrays))[:5]
        return (extra[0], f"is missing or unexpected (arrays {extra} differ from the metadata)")
    for key, want in sums.items():
        x = arrays[key]
        if not isinstance(want, dict):
            return (key, "has a damaged checksum entry")
        if str(x.dtype) != want.get("dtype") or list(np.shape(x)) != want.get("shape"):
            return (key, f"is {x.dtype}{list(np.shape(x))}, written as {want.get('dtype')}{want.get('shape')}")
        if want.get("crc32") is None or not _local(x):  # spread over processes: not gathered
            continue
        if checksum(x) != want.get("crc32"):
            return (key, f"fails its CRC-32 check (stored {want.get('crc32')}, read {checksum(x)})")
    return None


def _rebuild(part: str, spec: dict[str, Any], arrays: dict[str, Any], template: Any, step: int,
             old_format: bool = False) -> Any:
    if template is None:
        return decode(spec, arrays, part)
    prefix = part + "."
    flat = {
        s["key"][len(prefix):]: _decode_leaf(s, arrays, s["key"])
        for s in leaf_specs(spec, part)
        if s["key"].startswith(prefix)
    }
    tree, report = from_flat_dict(template, flat, strict=False)
    if not report.ok:
        hint = OLD_OPTIMIZER_LAYOUT if old_format and part == "opt_state" else ""
        raise CheckpointError(TEMPLATE_MISMATCH.format(part=part, step=step, report=report, hint=hint))
    return tree


def _read(restore: Callable[[Any], Any], placement: Any = None) -> tuple[dict[str, Any], Any]:
    """The arrays and metadata of one checkpoint: the metadata first (it says where the
    arrays go: ``placement(meta)`` gives orbax's restore target, by default
    :func:`_default_placement`), then the arrays alone. ``restore(args)`` is orbax's."""
    meta = restore(ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    target = (placement or _default_placement)(meta)
    arrays = restore(ocp.args.Composite(arrays=ocp.args.StandardRestore(target)))["arrays"]
    return dict(arrays), meta


def _default_placement(meta: Any) -> Any:
    """Arrays written from a mesh, restored without one: onto the default device (orbax
    refuses to guess a target for another topology). None: restore as saved."""
    sums = meta.get("checksums") if isinstance(meta, dict) else None
    if not isinstance(meta, dict) or not meta.get("mesh") or not isinstance(sums, dict):
        return None
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])

    def one(w: dict[str, Any]) -> Any:
        dtype = np.dtype(w["dtype"])
        if jax.dtypes.canonicalize_dtype(dtype) != dtype:  # float64 without x64: on the host
            return np.zeros(tuple(w["shape"]), dtype)
        return jax.ShapeDtypeStruct(tuple(w["shape"]), dtype, sharding=device)

    return {k: one(w) for k, w in sums.items()}


def _placement(templates: dict[str, Any], mesh: Any, sharding: Any, data_axis: str) -> Any:
    """Orbax's restore target on ``mesh``: each part with a template placed by the rules;
    the arrays of a part without one (shape and dtype from the metadata) on the host."""
    from functree.parallel import sharded_target  # functree.parallel imports ft.train

    placed = {p: None if t is None else sharded_target(t, mesh, sharding, data_axis=data_axis)
              for p, t in templates.items()}
    known, _ = encode(placed)

    def target(meta: Any) -> dict[str, Any]:
        sums = meta.get("checksums") if isinstance(meta, dict) else None
        if not isinstance(sums, dict):  # format 1 or damaged: restored as saved, checked later
            return None  # type: ignore[return-value]
        # arrays of parts without a template come back as host NumPy arrays, as saved
        return {k: known[k] if k in known else np.zeros(tuple(w["shape"]), np.dtype(w["dtype"]))
                for k, w in sums.items()}

    return target


class CheckpointManager:
    """Save checkpoints at steps; keep the last ``max_to_keep`` and the best by a metric.

    ``save(step, model, opt_state, metrics=..., config=...)`` writes one checkpoint
    atomically (orbax: temporary directory, renamed when complete). ``restore()`` returns
    the latest :class:`Checkpoint`, rebuilt with the saved types (Modules, NamedTuples,
    Python scalars, PRNG keys) or, given ``template=``, checked against it leaf by leaf
    (key path, shape and dtype) with every mismatch reported. Every array's CRC-32 is
    checked on restore.

    With ``best_metric="val_loss"`` the checkpoint with the lowest (``mode="min"``) or
    highest (``mode="max"``) value is kept as well as the last ``max_to_keep`` (a
    positive int, or None to keep all). One process writes a directory at a time.

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
        _check_max_to_keep(max_to_keep)
        self.directory = Path(directory).absolute()
        _check_directory(self.directory)
        self.best_metric, self.mode = best_metric, mode
        self.max_to_keep = max_to_keep
        self._metrics: dict[int, dict[str, Any]] = {}
        self._lock = _WriterLock(self.directory)
        self._asynchronous = asynchronous
        # Retention (last k plus the best) is applied here, from the metrics stored in
        # each checkpoint's own JSON and the steps on disk, so it holds across processes.
        # Orbax's temporary-directory cleanup is off: it would delete another writer's
        # in-flight save; leftovers are removed under the writer lock instead.
        options = ocp.CheckpointManagerOptions(
            enable_async_checkpointing=asynchronous,
            cleanup_tmp_directories=False,
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
        arrays = {k: np.asarray(v) if not isinstance(v, jax.Array) else v for k, v in arrays.items()}
        meta = _sealed({
            "format": FORMAT,
            "step": step,
            "spec": spec,
            "metrics": metrics,
            "config": _json_value(dict(config or {})),
            "checksums": _describe(arrays),
            "mesh": _mesh_of(arrays),  # {axis: size} it was written from ({} off any mesh)
        })
        args = ocp.args.Composite(
            arrays=ocp.args.StandardSave(arrays), meta=ocp.args.JsonSave(meta)
        )
        if self._lock.acquire():
            try:
                self._mngr.wait_until_finished()
                _remove_leftovers(self.directory)
            except BaseException:
                self._lock.release()
                raise
        try:
            self._mngr.reload()
            if (self.directory / str(step)).exists():
                raise CheckpointError(STEP_EXISTS.format(path=self.directory, step=step))
            self._mngr.save(step, args=args, force=True)
            self._metrics[step] = metrics
            self._prune(step)
        except BaseException:
            self.wait_until_finished()
            raise
        if not self._asynchronous:
            self._lock.release()

    def _prune(self, newest: int) -> None:
        steps = sorted(set(self.all_steps()) | {newest})
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
            metrics = meta.get("metrics", {}) if isinstance(meta, dict) else {}
            self._metrics[step] = metrics if isinstance(metrics, dict) else {}
        return self._metrics[step]

    def delete(self, step: int) -> None:
        """Remove the checkpoint at ``step``."""
        self._mngr.delete(int(step))
        self._metrics.pop(int(step), None)

    def wait_until_finished(self) -> None:
        """Block until an asynchronous save has been written (and release the lock)."""
        try:
            self._mngr.wait_until_finished()
        finally:
            self._lock.release()

    def all_steps(self) -> list[int]:
        """The steps with a complete checkpoint, ascending (read from the directory)."""
        self._mngr.reload()
        steps = sorted(self._mngr.all_steps())
        for gone in set(self._metrics) - set(steps):
            self._metrics.pop(gone, None)
        return steps

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
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value == value:
                scored.append((value, step))
        if not scored:
            return None
        return (min(scored) if self.mode == "min" else max(scored))[1]

    def _damaged(self, message: str, step: int, steps: list[int], **kw: Any) -> CheckpointError:
        others = [s for s in steps if s != step]
        return CheckpointError(message.format(
            path=self.directory if message is not CORRUPTED else self.directory / str(step),
            step=step, others=f"steps {others}" if others else "none is left",
            suggestion=others[-1] if others else "", **kw,
        ))

    def restore(
        self,
        step: int | None = None,
        *,
        template: Any = None,
        opt_state_template: Any = None,
        extra_template: Any = None,
        include: tuple[str, ...] = ("model", "opt_state", "extra"),
        mesh: Any = None,
        sharding: Any = None,
        data_axis: str = "data",
    ) -> Checkpoint:
        """The :class:`Checkpoint` at ``step`` (default: the latest).

        ``template`` (a model), ``opt_state_template`` and ``extra_template`` are checked
        against the saved leaves by key path, shape and dtype, every mismatch reported at
        once; parts without a template are rebuilt from the saved type information, using
        only registered types (:func:`functree.train.register`). Parts left out of
        ``include`` come back as None (e.g. ``include=("model",)`` to continue a saved
        model with new optimizer options). Damage raises :class:`CheckpointError`.

        With ``mesh`` (and ``sharding``: None, ``"fsdp"`` or rules by key path, as for
        ``ft.shard``) every array is restored straight into its shards on that mesh,
        whatever device count wrote it: the templates' arrays placed by the rules (optimizer
        moments follow their parameters), the rest replicated.
        """
        steps = self.all_steps()
        chosen = steps[-1] if step is None and steps else step
        if chosen is None or chosen not in steps:
            what = "at all" if not steps else f"at step {step}"
            raise CheckpointError(
                NO_CHECKPOINT.format(what=what, path=self.directory, steps=steps, step=step or "")
            )
        try:
            templates = {"model": template, "opt_state": opt_state_template, "extra": extra_template}
            placement = None if mesh is None else _placement(templates, mesh, sharding, data_axis)
            arrays, meta = _read(lambda args: self._mngr.restore(chosen, args=args), placement)
        except Exception as e:  # orbax raises many types for damaged files
            error = f"{type(e).__name__}: {str(e)[:300]}"
            raise self._damaged(CORRUPTED, chosen, steps, error=error) from e
        problem = _verify_meta(meta, manager=True)
        if problem:
            raise self._damaged(BAD_METADATA, chosen, steps, why=problem)
        bad = _verify_arrays(meta, arrays)
        if bad:
            raise self._damaged(CHECKSUM_MISMATCH, chosen, steps, key=bad[0], why=bad[1])
        templates = {"model": template, "opt_state": opt_state_template, "extra": extra_template}
        parts = dict(zip(_PARTS, meta["spec"]["items"]))
        try:
            rebuilt = {
                p: _rebuild(p, parts[p], arrays, templates[p], chosen, meta["format"] != FORMAT)
                if p in include else None
                for p in _PARTS
            }
        except SpecError as e:
            raise SpecError(f"Checkpoint step {chosen} in {self.directory}:\n{e}") from None
        return Checkpoint(
            model=rebuilt["model"],
            opt_state=rebuilt["opt_state"],
            step=int(meta["step"]),
            metrics=meta["metrics"],
            config=meta["config"],
            extra=rebuilt["extra"],
        )

    def close(self) -> None:
        """Finish pending saves, release the writer lock and orbax's resources."""
        try:
            self._mngr.close()
        finally:
            self._lock.release()

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
    arrays = {k: np.asarray(v) if not isinstance(v, jax.Array) else v for k, v in arrays.items()}
    meta = _sealed({"format": FORMAT, "spec": spec, "checksums": _describe(arrays), "mesh": _mesh_of(arrays)})
    args = ocp.args.Composite(arrays=ocp.args.StandardSave(arrays), meta=ocp.args.JsonSave(meta))
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
        checkpointer.save(path, args=args, force=overwrite)


NOT_READABLE = """\
{path} is not a readable functree checkpoint ({why}).
Pass the directory written by ft.train.save(path, tree)."""


LOAD_NEEDS_TEMPLATE = """\
Restoring onto a mesh needs a template (the tree's structure, shapes and dtypes) to place \
each array by the sharding rules:

    wrong:  ft.train.load(path, mesh=mesh, sharding="fsdp")
    right:  ft.train.load(path, (model, opt_state), mesh=mesh, sharding="fsdp")"""


def load(path: str | os.PathLike[str], template: Any = None, *, mesh: Any = None, sharding: Any = None,
         data_axis: str = "data") -> Any:
    """Load a tree written by :func:`save`; with ``template``, check it leaf by leaf.

    Without a template the tree is rebuilt with its saved types (registered types and
    Module subclasses only, see :func:`functree.train.register`); with one, every leaf
    must match it in key path, shape and dtype. Every array's CRC-32 is checked. With
    ``mesh`` (and ``sharding``: None, "fsdp" or rules) the arrays are restored onto that
    mesh, placed by the rules, whatever device count wrote them.

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
    target = None
    if mesh is not None:  # restore each array straight into its shards on this mesh
        from functree.parallel import sharded_target

        if template is None:
            raise CheckpointError(LOAD_NEEDS_TEMPLATE)
        target, _ = encode(sharded_target(template, mesh, sharding, data_axis=data_axis))
    try:
        with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
            placement = None if target is None else lambda _: target
            arrays, meta = _read(lambda args: checkpointer.restore(path, args=args), placement)
    except Exception as e:
        why = f"{type(e).__name__}: {str(e)[:300]}"
        raise CheckpointError(NOT_READABLE.format(path=path, why=why)) from e
    problem = _verify_meta(meta, manager=False)
    if problem:
        raise CheckpointError(NOT_READABLE.format(path=path, why=f"damaged metadata: {problem}"))
    bad = _verify_arrays(meta, arrays)
    if bad:
        why = f"the array {bad[0]!r} {bad[1]}"
        raise CheckpointError(NOT_READABLE.format(path=path, why=why))
    try:
        if template is None:
            return decode(meta["spec"], arrays)
        return _rebuild_single(meta["spec"], arrays, template)
    except SpecError as e:
        raise SpecError(f"Checkpoint {path}:\n{e}") from None


def _rebuild_single(spec: dict[str, Any], arrays: dict[str, Any], template: Any) -> Any:
    flat = {s["key"]: _decode_leaf(s, arrays, s["key"]) for s in leaf_specs(spec)}
    tree, report = from_flat_dict(template, flat, strict=False)
    if not report.ok:
        raise CheckpointError(TEMPLATE_MISMATCH.format(part="tree", step="-", report=report, hint=""))
    return tree
