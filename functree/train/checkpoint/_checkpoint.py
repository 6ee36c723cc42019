"""Checkpoints: the model, the optimizer state (with its learning context) and the
configuration at a step, written through orbax and rebuilt with their original types.

A checkpoint is an orbax directory with two items: ``arrays`` (every leaf by its dotted
key path, ``model.layers.0.weight``) and ``meta`` (JSON: the tree's types by public name
(:mod:`._treespec`; read back by :mod:`._decode`, or against a template by
:mod:`._template`, the extra part entry by entry by :mod:`._extra`), the step, metrics,
configuration, CRC-32s of the arrays (:mod:`._arrays`) and one of the metadata itself).
One writer (:func:`save_args`) and one reader (:func:`_read`) serve :func:`save`/:func:`load`
and :class:`CheckpointManager`, whose directory policy (lock, retention) is
:mod:`._directory`. Orbax writes into a temporary directory renamed when complete, so a
killed save leaves the previous checkpoint loadable; :func:`save` with ``overwrite=True``
writes the new tree beside the old one and swaps them by renames (:func:`_swap`), so the
old or the new tree loads whenever it is killed. Every process of a job calls ``save``:
each writes its shards.
Arrays are read back where the reading process places them (:func:`._arrays.placement`),
never onto the writer's devices, which the metadata keeps as information (``written_on``).
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import shutil
import sys
import threading
import zlib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, NamedTuple, cast

import jax
import jax.numpy as jnp
import numpy as np

from functree._alias import check_stale
from functree.parallel import mesh_shape
from functree.train._direction import check_mode, resolve_mode
from functree.train.checkpoint import _directory as policy
from functree.train.checkpoint._arrays import (
    describe,
    placement,
    put,
    saved_arrays,
    verify,
    via_host,
    written_on,
)
from functree.train.checkpoint._decode import check_names
from functree.train.checkpoint._errors import CheckpointError, SpecError
from functree.train.checkpoint._extra import SKIP, placed_templates, read_extra
from functree.train.checkpoint._frozen import describe_frozen, restore_frozen
from functree.train.checkpoint._processes import agreed, gather
from functree.train.checkpoint._template import rebuild
from functree.train.checkpoint._treespec import encode

__all__ = ["Checkpoint", "CheckpointManager", "SKIP", "save", "load", "CheckpointError"]

FORMAT = "functree-checkpoint-2"
_FORMAT_NUMBER = re.compile(r"functree-checkpoint-(\d+)")
_PARTS = ("model", "opt_state", "extra")

DAMAGED = """\
The checkpoint at step {step} in {path} {problem}.
Nothing was loaded or changed on disk. Restore another step instead: {others}

    wrong:  manager.restore({step})
    right:  manager.restore({suggestion})"""

NOT_READABLE = """\
{path} is not a readable functree checkpoint ({problem}).
Pass the directory written by ft.train.save(path, tree)."""

DAMAGED_FILES = """\
{path} {problem}.
Its metadata was read and checked: ft.train.save wrote this checkpoint, and its array files \
were truncated, removed or overwritten since (a copy cut short, a full disk, an edited file). \
Nothing was loaded. Restore the directory from another copy, load another checkpoint, or save \
the tree again:

    wrong:  ft.train.load("{path}")
    right:  ft.train.load("path/to/a/copy")                        # restored from elsewhere
       or:  ft.train.save("{path}", tree, overwrite=True)   # the tree in memory, written again"""

INSIDE_A_TREE = """\
{path} is {what} inside the checkpoint {root}, not a checkpoint: ft.train.load reads the \
directory that ft.train.save wrote. Nothing was loaded.

    wrong:  ft.train.load("{path}")
    right:  ft.train.load("{root}")"""

A_FILE = """\
{path} is a file, not a checkpoint: ft.train.save writes a directory (its arrays/ and meta/ \
folders). Nothing was loaded. Pass that directory; a .safetensors or torch file is read into \
a model by ft.nn.load_torch_state_dict:

    wrong:  ft.train.load("{path}")
    right:  ft.train.load(path_given_to_ft_train_save)
       or:  ft.nn.load_torch_state_dict(model, "{path}")   # a .safetensors or torch file"""

MANAGER_DIRECTORY = """\
{path} is a CheckpointManager's directory (a Trainer's ModelCheckpoint writes one): it holds \
the checkpoints of steps {steps}, each a directory of its own. Restore one step:

    wrong:  ft.train.load("{path}")
    right:  ft.train.CheckpointManager("{path}").restore(template=model).model   # the latest
       or:  ft.train.load("{path}/{last}")     # step {last}'s model, opt_state and extra as saved"""

MANAGER_STEP = """
    ft.train.CheckpointManager("{directory}").restore({step}, template=template).model   \
# a CheckpointManager's step: its model, opt_state and extra"""

FORMAT_1 = """\
it was written by an older functree (format functree-checkpoint-1, without checksums); \
read it once through a migration that writes a checked copy:  \
ft.train.migrate("{path}", "{path}-v2")"""

NO_CHECKPOINT = """\
No checkpoint at step {step} in {path} (steps present: {steps}).

    wrong:  manager.restore({step})
    right:  manager.restore()          # the latest, or one of {steps}"""

NO_TREE = """\
No checkpoint at {path}: there is no such file or directory (ft.train.save writes a tree \
there; a CheckpointManager's directory holds one folder per step).

    wrong:  ft.train.load("{path}")
    right:  ft.train.load(path_given_to_ft_train_save)   # or ft.train.CheckpointManager(directory).restore()"""

NOTHING_SAVED = """\
No checkpoint at all in {path}: nothing has been saved there yet, so there is nothing to
restore (or the job saves into another directory). A job's first run starts fresh: restore
only when a checkpoint exists, as the restart recipe does.

    wrong:  manager.restore({step})               # or trainer.restore(manager): the same
    right:  if manager.latest_step() is not None:
                manager.restore()             # or trainer.restore(manager)"""


NEWER_FORMAT = """\
{path} was written by a newer functree{writer}: its format is {format!r}, and this functree \
({version}) reads {known!r}. The checkpoint is not damaged; nothing was loaded. Read it with \
a functree that knows its format:

    wrong:  {call}        # under functree {version}
    right:  pip install -U git+https://github.com/functree/functree    # then the same call"""


UNKNOWN_DTYPE = """\
{path} holds the zero-size array {key!r} of dtype {dtype!r}, a type this installation does not \
know (ml_dtypes {ml_dtypes}, jax {jax}; the checkpoint was written under jax {writer}). The \
checkpoint is not damaged; nothing was loaded. Read it where ml_dtypes and jax know {dtype}, \
as the writer's did:

    wrong:  {call}        # under ml_dtypes {ml_dtypes}, jax {jax}
    right:  pip install -U ml_dtypes jax jaxlib    # then the same call"""


OLD_OPTIMIZER_LAYOUT = """

This checkpoint was written before functree's one-context optimizer state (format \
functree-checkpoint-1). Restore the old state without a template and convert it:

    old = manager.restore(step, opt_state_template=None).opt_state
    opt_state = ft.optim.upgrade_state(old, optimizer, model)"""

BAD_MAX_TO_KEEP = """\
max_to_keep must be a positive int (how many recent checkpoints to keep) or None (keep
all), got {value!r}.

    wrong:  CheckpointManager(path, max_to_keep={value!r})
    right:  CheckpointManager(path, max_to_keep=3)       # or max_to_keep=None: keep all"""

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


LOAD_NEEDS_TEMPLATE = """\
Restoring onto a mesh needs a template (the tree's structure, shapes and dtypes) to place \
each array by the sharding rules:

    wrong:  ft.train.load(path, mesh=mesh, sharding="fsdp")
    right:  ft.train.load(path, model, mesh=mesh, sharding="fsdp")   # the tree as it was saved
                                    # (ft.train.save(path, model): model; a tuple saved: the tuple)"""


UNSAVABLE = """\
The leaf {key!r} is {given}: a checkpoint holds arrays and numbers, not text or objects.
Nothing was written (and no process of a job wrote anything).

    wrong:  ft.train.save(path, {{"model": model, "note": "warm start"}})
    right:  ft.train.save(path, {{"model": model, "rounds": 3}})   # text: in the manager's config= (JSON)"""


FUNCTION_LEAF = """\
The leaf {key!r} is the function {given}, which no checkpoint can name: a function at a \
leaf (an Equinox model's activation or pooling operation) is stored by its registered name \
(jax.nn's, functree's and elementwise jax.numpy functions are known), and a checkpoint \
never imports or builds what a file names. Nothing was written. Register the function \
(the process that loads registers it under the same name), or save the arrays alone:

    wrong:  ft.train.save(path, model)
    right:  ft.train.register({short}, name="{name}")   # before saving and before loading
            ft.train.save(path, model)
       or:  ft.train.save(path, eqx.filter(model, eqx.is_array))      # Equinox: the arrays alone
            model = eqx.combine(ft.train.load(path, eqx.filter(model, eqx.is_array)), model)"""


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


# --- the writer and the reader --------------------------------------------------------------

def _json_value(x: Any) -> Any:
    """Metrics and configuration as JSON: arrays become numbers or lists."""
    if isinstance(x, Mapping):
        return {str(k): _json_value(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_value(v) for v in x]
    if isinstance(x, (jax.Array, np.ndarray, np.generic)):
        return np.asarray(x).tolist()
    return x


def metadata_digest(meta: dict[str, Any]) -> int:
    body = {k: v for k, v in meta.items() if k != "digest"}
    return zlib.crc32(json.dumps(body, sort_keys=True, allow_nan=True).encode())


UNWRITABLE_DTYPE = """\
The leaf {key!r} is {given}: orbax's files (tensorstore) have no {dtype} type, so no \
checkpoint can hold it as it is. Nothing was written. Save it widened, and narrow it back \
after loading (exact: every {dtype} value is a {wide}):

    wrong:  ft.train.save(path, {{"{name}": {name}}})                      # {dtype}
    right:  ft.train.save(path, {{"{name}": {name}.astype(jnp.{wide})}})    # loaded["{name}"].astype(jnp.{dtype})"""


@functools.cache
def writable_dtype(dtype: np.dtype) -> bool:
    """Whether orbax's files can hold ``dtype``: tensorstore, which writes them, has a type
    of its name. Asked of the installed tensorstore, not listed here: JAX and ml_dtypes add
    narrow types (uint4, float8_e4m3, jax 0.12's float6) before tensorstore has them, and
    tensorstore failed deep in orbax's writer on each, leaving its temporary directory.

    >>> writable_dtype(np.dtype(jnp.bfloat16)), writable_dtype(np.dtype(jnp.uint4))
    (True, False)
    """
    import tensorstore  # orbax's own dependency, imported by then

    try:
        tensorstore.dtype(dtype.name)
    except (ValueError, TypeError):
        return False
    return True


def _widened(dtype: np.dtype) -> tuple[str, str]:
    """The type that holds every value of a narrow ``dtype`` exactly, and a leaf name for
    the message's example."""
    if jnp.issubdtype(dtype, jnp.unsignedinteger):  # (ml_dtypes' narrow types are of NumPy kind "V")
        return "uint8", "codes"
    if jnp.issubdtype(dtype, jnp.integer):
        return "int8", "codes"
    return "float32", "weights"


def _unsavable(arrays: dict[str, Any]) -> tuple[str, str] | None:
    """``(key, what it is)`` of the first leaf no checkpoint can hold (text, objects, a
    dtype orbax cannot write); a function's ``what`` starts with ``function``, an
    unwritable dtype's with ``dtype``."""
    for key, x in arrays.items():
        if callable(x) and not isinstance(x, (jax.Array, np.ndarray, np.generic, type)):
            return key, f"function {getattr(x, '__module__', '?')}.{getattr(x, '__qualname__', repr(x)[:60])}"
        dtype = getattr(x, "dtype", None)
        if not isinstance(dtype, np.dtype):
            dtype = np.asarray(x).dtype
        if dtype.hasobject or dtype.fields is not None or dtype.kind not in "biufcV" or dtype.type is np.void:
            return key, f"{type(x).__name__} {repr(x)[:60]}"
        shape = tuple(getattr(x, "shape", ()))
        if math.prod(shape) and not writable_dtype(dtype):  # (an empty one is stored as its shape)
            return key, f"dtype {dtype.name} {dtype.name}{list(shape)}"
    return None


def _unsavable_message(key: str, given: str) -> str:
    if given.startswith("dtype "):
        dtype, array = given.removeprefix("dtype ").split(" ", 1)
        wide, name = _widened(jnp.dtype(dtype))
        return UNWRITABLE_DTYPE.format(key=key, given=f"a {array} array", dtype=dtype, wide=wide, name=name)
    if not given.startswith("function "):
        return UNSAVABLE.format(key=key, given=given)
    name = given.removeprefix("function ")
    if "<" in name:  # a lambda or a local function: the user names it
        short, name = "my_function", "mymodule.my_function"
    else:
        short = name
    return FUNCTION_LEAF.format(key=key, given=given.removeprefix("function "), short=short, name=name)


def _writable(arrays: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The arrays as orbax writes them, and the keys of the jax arrays written as NumPy
    arrays (restored onto a device, as written: ``process_local`` in the metadata).

    A jax array this process holds whole (every array of a one-process job) is written as
    NumPy: orbax's jax-array path (replica slices, a sharding record, per-process array
    metadata merged and validated) costs about twice the CPU of its NumPy path, and no
    reader consults the writer's sharding (:func:`._arrays.placement`). In a job of several
    processes these are each process's own arrays (orbax refuses them as jax arrays),
    written from process 0. Arrays spread over processes stay jax arrays: each process
    writes its shards."""
    out, local = {}, []
    for key, x in arrays.items():
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            out[key] = x
        else:
            out[key] = np.asarray(x)
            if isinstance(x, jax.Array):
                local.append(key)
    return out, local


NOTHING = "functree.nothing"  # the one stored array of a tree that holds none (orbax refuses an empty item)
# The metadata's keys of the zero-size arrays saved as NumPy (no field: every one a jax array,
# as functree read them all before it was written; a reader that knows no such field too).
EMPTY_ON_HOST = "empty_on_host"


def _split_empty(arrays: dict[str, Any]) -> tuple[dict[str, Any], dict[str, list[Any]]]:
    """``(the arrays orbax writes, {key: [shape, dtype]} of the zero-size ones)``: orbax
    refuses an array of size 0 and an item with no array, and a zero-size array is its
    shape and dtype alone, kept in the (checksummed) metadata."""
    kept: dict[str, Any] = {}
    empty: dict[str, list[Any]] = {}
    for key, x in arrays.items():
        if np.size(x) == 0:
            empty[key] = [[int(n) for n in np.shape(x)], str(np.dtype(getattr(x, "dtype", None) or np.asarray(x).dtype))]
        else:
            kept[key] = x
    if not kept:
        kept[NOTHING] = np.zeros((), np.int8)
    return kept, empty


def _with_empty(arrays: dict[str, Any], meta: dict[str, Any], target: Any, path: Path, manager: bool
                ) -> dict[str, Any]:
    """The restored arrays with the zero-size ones of the metadata, placed by ``target`` as
    a stored array would be (the template's sharding or device, ``sharding=``, a mesh's
    rules; one saved as NumPy, and a 64-bit one without ``jax_enable_x64``, on the host, as
    NumPy), and without the placeholder. (``jnp.zeros`` put them all on the default device
    and gave float32 for float64; a NumPy one came back as a jax array.)"""
    arrays.pop(NOTHING, None)
    empty, on_host = meta.get("empty", {}), meta.get(EMPTY_ON_HOST, [])
    if not isinstance(empty, dict):
        raise _Damage("has damaged metadata: its zero-size arrays are not a mapping")
    if not (isinstance(on_host, list) and all(isinstance(k, str) and k in empty for k in on_host)):
        raise _Damage(f"has damaged metadata: its zero-size NumPy arrays are {on_host!r}")
    described = {}
    for key, entry in empty.items():
        shape = entry[0] if isinstance(entry, list) and len(entry) == 2 else None
        if not (isinstance(shape, list) and all(isinstance(n, int) and n >= 0 for n in shape)
                and 0 in shape and isinstance(entry[1], str)) or key in arrays:
            raise _Damage(f"has damaged metadata: the zero-size array {key!r} is described as {entry!r}")
        try:
            described[key] = (tuple(shape), jnp.dtype(entry[1]), key in on_host)  # (saved as NumPy: on the host)
        except (TypeError, ValueError):  # a type of a newer ml_dtypes or JAX than this one
            raise _unknown_dtype(key, entry[1], meta, path, manager) from None
    wanted = target(described, meta) if described else {}
    placed = {k: x for k, x in wanted.items() if isinstance(x, jax.ShapeDtypeStruct)}
    arrays.update({k: x for k, x in wanted.items() if k not in placed})  # NumPy zeros, on the host
    return put({**arrays, **{k: np.zeros(x.shape, x.dtype) for k, x in placed.items()}},
               {k: x.sharding for k, x in placed.items()})


def save_args(arrays: dict[str, Any], spec: Any, **fields: Any) -> Any:
    """Orbax's save arguments: the arrays and the sealed metadata (collective: every
    process of a job calls it, each describing the shards it writes). A leaf no checkpoint
    can hold is refused first, on every process at once, before anything is written."""
    import orbax.checkpoint as ocp  # on first use: import functree stays light
    found = next((f for f in gather(_unsavable(arrays)) if f), None)
    if found:
        raise CheckpointError(_unsavable_message(*found))
    given, (arrays, empty) = arrays, _split_empty(arrays)
    if empty:  # (with the NumPy ones, which come back as NumPy as a stored NumPy array does)
        on_host = [k for k in empty if not isinstance(given[k], jax.Array)]
        fields = {**fields, "empty": empty, **({EMPTY_ON_HOST: on_host} if on_host else {})}
    mesh, writer = mesh_shape(arrays), written_on(arrays)  # of the arrays as given: information
    arrays, local = _writable(arrays)
    meta = json.loads(json.dumps({"format": FORMAT, **fields, "spec": spec, "checksums": describe(arrays),
                                  "mesh": mesh, "written_on": writer,
                                  **({"process_local": local} if local else {})}, allow_nan=True))
    meta["digest"] = metadata_digest(meta)
    return ocp.args.Composite(arrays=ocp.args.StandardSave(arrays), meta=ocp.args.JsonSave(meta))


def _metadata_problem(meta: Any, path: Path, manager: bool) -> str | None:
    if isinstance(meta, dict) and meta.get("format") == "functree-checkpoint-1":
        return FORMAT_1.format(path=path)
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        return f"no {FORMAT} metadata"
    if meta.get("digest") != metadata_digest(meta):
        return "its CRC-32 does not match its contents (it was changed after it was written)"
    if not isinstance(meta.get("spec"), dict):
        return "the type description is missing"
    if manager:
        if not isinstance(meta.get("step"), int) or isinstance(meta.get("step"), bool):
            return f"the step is {meta.get('step')!r}"
        if path.name.isdigit() and int(path.name) != meta["step"]:  # a step folder copied or renamed
            return (f"it holds step {meta['step']}, but its folder is named {path.name} (copied or renamed: "
                    f"restore step {meta['step']} from a folder of that name)")
        for key in ("metrics", "config"):
            if not isinstance(meta.get(key), dict):
                return f"{key!r} is {type(meta.get(key)).__name__}, not a dict"
        items = meta["spec"].get("items")
        if meta["spec"].get("kind") != "dict" or not isinstance(items, list) or len(items) != len(_PARTS):
            return "the type description does not hold model, opt_state and extra"
    return None


def _check_not_newer(meta: Any, path: Path, manager: bool) -> None:
    """:data:`NEWER_FORMAT` where a later functree wrote the metadata (``functree-checkpoint-3``):
    not damage, which the readers' messages would call it (and offer another step)."""
    found = _FORMAT_NUMBER.fullmatch(str(meta.get("format"))) if isinstance(meta, dict) else None
    if found is None or int(found[1]) <= int(FORMAT.rsplit("-", 1)[1]):
        return
    from functree import __version__  # (functree imports this module)
    about = meta.get("written_on")
    writer = about.get("functree") if isinstance(about, dict) else None
    raise CheckpointError(NEWER_FORMAT.format(
        path=path, writer=f" ({writer})" if isinstance(writer, str) else "", format=meta["format"],
        version=__version__, known=FORMAT, call=_reader_call(path, manager)))


def _reader_call(path: Path, manager: bool) -> str:
    """The call that read ``path``, for a message's ``wrong:`` line."""
    return f"manager.restore({path.name})" if manager else f'ft.train.load("{path}")'


def _unknown_dtype(key: str, name: str, meta: dict[str, Any], path: Path, manager: bool) -> CheckpointError:
    """:data:`UNKNOWN_DTYPE`: a zero-size array's dtype name (its writer's ``str(dtype)``, under
    the metadata's checksum) that this ml_dtypes and JAX do not know: a newer writer's, not damage."""
    import ml_dtypes  # (JAX's own dependency)
    about = meta.get("written_on")
    writer = about.get("jax") if isinstance(about, dict) else None
    return CheckpointError(UNKNOWN_DTYPE.format(
        path=path, key=key, dtype=name, ml_dtypes=ml_dtypes.__version__, jax=jax.__version__,
        writer=writer if isinstance(writer, str) else "a version not recorded", call=_reader_call(path, manager)))


def _read(restore: Callable[[Any], Any], path: Path, target: Any, manager: bool = False,
          ) -> tuple[dict[str, Any], dict[str, Any]]:
    """The verified arrays and metadata of the checkpoint at ``path``: the metadata first,
    checked, then the arrays alone, placed by ``target(stored arrays, meta)`` (never by the
    writer's devices: see :func:`._arrays.placement`). ``restore(args)`` is orbax's.
    Damage raises ``_Damage(problem)``."""
    import orbax.checkpoint as ocp  # on first use: import functree stays light
    try:
        meta = restore(ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    except Exception as e:  # orbax raises many types for damaged files
        raise _Damage(_unreadable(e)) from e
    _check_not_newer(meta, path, manager)
    problem = _metadata_problem(meta, path, manager)
    if problem:
        raise _Damage(f"has damaged metadata: {problem}")
    try:
        wanted, moves = via_host(target(saved_arrays(path / "arrays"), meta))
        arrays = dict(restore(ocp.args.Composite(arrays=ocp.args.StandardRestore(wanted)))["arrays"])
    except CheckpointError:  # a placement that cannot hold an array: not damage
        raise
    except Exception as e:
        raise _Damage(_unreadable(e), files=True) from e
    bad = verify(meta.get("checksums"), arrays)  # before anything goes to a device
    if bad:
        raise _Damage(f"is corrupted: the array {bad[0]!r} {bad[1]}", files=True)
    return _with_empty(put(arrays, moves), meta, target, path, manager), meta


def _step_directories(path: Path) -> list[int]:
    """The steps a CheckpointManager wrote under ``path`` (none where ``path`` is a checkpoint)."""
    return [] if (path / "meta").exists() else policy.step_names(path, written=True)


# The stored arrays an orbax error names: TensorStore's key of a chunk ("model.w/0.0": the
# array "model.w") in its first line, or the relative kvstore path of the array it read
# (``'path': 'model.w/'``) in the TensorStore spec it dumps.
_CHUNK_KEY = re.compile(r'Error reading "([^"/]+)/[^"/]*"')
_SPEC_PATH = re.compile(r"'path': '([^'/][^']*)/'")
_DUMP = " See full TensorStore details"  # where orbax's first line turns into a dump of the spec
_LONGEST = 400  # characters of the underlying error's first line kept


def _unreadable(e: BaseException) -> str:
    """What could not be read (the arrays by name, where the errors name them) and the
    underlying error: the innermost of the chain (TensorStore's own, under orbax's), its
    first line without orbax's dump of the TensorStore spec."""
    chain: list[BaseException] = [e]
    while len(chain) < 16 and (chain[-1].__cause__ or chain[-1].__context__) is not None:
        chain.append(cast(BaseException, chain[-1].__cause__ or chain[-1].__context__))
    texts = [str(c) for c in chain]
    names = list(dict.fromkeys(n for t in texts for n in _CHUNK_KEY.findall(t)))
    names = names or list(dict.fromkeys(n for t in texts for n in _SPEC_PATH.findall(t)))
    cause = chain[-1]
    line = (str(cause).splitlines() or [""])[0].split(_DUMP)[0]
    line = line if len(line) <= _LONGEST else line[:_LONGEST] + " ..."
    error = f"{type(cause).__name__}: {line}"
    if names:
        arrays = ", ".join(map(repr, names[:8])) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
        return f"is damaged or incomplete: the stored array{'s' if len(names) > 1 else ''} {arrays} could not be read ({error})"
    return f"is corrupted or incomplete and cannot be read ({error})"


class _Damage(Exception):
    """A checkpoint that cannot be read: ``files`` where its metadata was read and its array
    files were not (damaged after ft.train.save wrote them)."""

    def __init__(self, problem: str, files: bool = False):
        super().__init__(problem)
        self.files = files


def _siblings(path: Path) -> tuple[Path, Path]:
    """``(new, old)``: where an overwrite writes the new tree, and where the old one waits
    while the new one is renamed into place."""
    return path.with_name(f"{path.name}.functree-new"), path.with_name(f"{path.name}.functree-old")


# orbax's temporary directory of a save to ``<name>`` is ``<name>.orbax-checkpoint-tmp...``
# (orbax.checkpoint's TMP_DIR_SUFFIX): with the new tree's own name, the only names
# _settle removes beside ``path`` (a user's ``model.functree-new.backup`` stays).
_ORBAX_TMP = ".orbax-checkpoint-tmp"


def _target(path: str | os.PathLike[str]) -> Path:
    """Where a tree at ``path`` lives: ``path``, or the target of a symlink ``path`` (a save
    writes through the link, as ``open(link, "w")`` does: the link stays and points at the
    new tree; swapping the link itself aside left a symlink ``.functree-old`` that
    ``shutil.rmtree`` refuses, and every later save failed on it)."""
    path = policy.local_path(path)
    return path.resolve() if path.is_symlink() else path


def _remove(entry: Path) -> None:
    """Delete ``entry``: a real directory and what it holds, else the file or link itself
    (``shutil.rmtree`` refuses both: an overwritten plain file crashed after the swap)."""
    if entry.is_dir() and not entry.is_symlink():
        shutil.rmtree(entry)
    else:
        entry.unlink()


def _settle(path: Path) -> bool:
    """Undo or finish what an overwrite killed mid-swap left (the primary process, before a
    save), and whether ``path`` holds a tree. The old tree waiting beside a missing ``path``
    goes back (that save never returned); one beside a ``path`` is the old tree of a swap
    that had finished. A new tree never swapped in, whole or not, is removed."""
    new, old = _siblings(path)
    if old.exists() or old.is_symlink():
        if path.exists() or path.is_symlink():
            _remove(old)
        else:
            os.rename(old, path)
    if path.parent.is_dir():
        for entry in path.parent.iterdir():  # the new tree, and orbax's temporary directories of it
            if entry.name == new.name or entry.name.startswith(new.name + _ORBAX_TMP):
                _remove(entry)
    return path.exists() or path.is_symlink()


def _swap(path: Path, new: Path, old: Path) -> None:
    """Put the whole tree at ``new`` at ``path``. Killed after any step, ``path`` or ``old``
    holds a whole tree (which :func:`load` reads) and :func:`_settle` tidies the rest."""
    os.rename(path, old)
    os.rename(new, path)
    _remove(old)


def save(path: str | os.PathLike[str], tree: Any, *, overwrite: bool = False) -> None:
    """Save one tree (a model, an optimizer state, anything) to ``path``, atomically.

    Every process of a multi-process job calls it (each writes its shards). A save killed
    at any moment leaves the previous tree at ``path`` or the new one, never neither:
    orbax writes into a temporary directory renamed to ``path`` when complete, and with
    ``overwrite=True`` the new tree is first written whole to ``<path>.functree-new``, then
    swapped in by two renames (the old tree to ``<path>.functree-old``, the new one to
    ``path``) and the old one deleted. Killed between the renames, ``path`` is missing and
    :func:`load` reads ``<path>.functree-old``; the next ``save`` to ``path`` puts it back
    (the interrupted save never returned) and removes a ``.functree-new`` left over.
    A symlink ``path`` is written through: its target gets the new tree and the link stays;
    a plain file at ``path`` is replaced by the tree (``overwrite=True`` only).

    Example:
      >>> import functree as ft, jax.numpy as jnp, tempfile
      >>> path = tempfile.mkdtemp() + "/model"
      >>> ft.train.save(path, {"w": jnp.ones(2), "steps": 3})
      >>> ft.train.load(path)
      {'w': Array([1., 1.], dtype=float32), 'steps': 3}
    """
    import orbax.checkpoint as ocp  # on first use: import functree stays light
    check_stale([("tree", tree)], "ft.train.save(path, tree)")  # donated by a step: nothing written
    path = _target(path)
    policy.check_writable(path, "ft.train.save")
    exists = agreed(lambda: _settle(path))
    if exists and not overwrite:
        raise CheckpointError(PATH_EXISTS.format(path=path))
    args = save_args(*encode(tree))
    new, old = _siblings(path)
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
        checkpointer.save(new if exists else path, args=args)  # never force=True: it deletes first
    if exists:
        agreed(lambda: _swap(path, new, old))


def load(path: str | os.PathLike[str], template: Any = None, *, mesh: Any = None, sharding: Any = None,
         data_axis: str = "data") -> Any:
    """Load a tree written by :func:`save`; with ``template``, check it leaf by leaf.

    Without a template the tree is rebuilt with its saved types (registered types and
    Module subclasses only, see :func:`functree.train.register`); with one, every leaf
    must match it in key path, shape and dtype, its static values must be the saved ones,
    and so must its layers without arrays: a template that adds, drops or replaces one (a
    ``Lambda(relu)`` appended to a ``Sequential``) is refused, naming the key path
    (``LAYERS_DIFFER``). Every array's CRC-32 is checked. Arrays
    are placed by this process, never by the devices that wrote them: with ``mesh`` (and
    ``sharding``: None, "fsdp" or rules) onto that mesh, placed by the rules, each device
    reading its own shards; else with ``sharding`` (a device or a ``Sharding``: torch's
    ``map_location``) there; else where the template's arrays are; else on the default
    device. Where ``path`` is missing but an overwrite killed mid-swap left the old tree
    at ``<path>.functree-old`` (see :func:`save`), that tree is read.

    Example:
      >>> import functree as ft, jax, jax.numpy as jnp, tempfile
      >>> model = ft.nn.Dense(2, 1, key=jax.random.key(0))
      >>> with tempfile.TemporaryDirectory() as d:
      ...     ft.train.save(d + "/model", model)
      ...     restored, checked = ft.train.load(d + "/model"), ft.train.load(d + "/model", model)
      >>> restored, bool(jnp.all(checked.weight == model.weight))
      (Dense(weight=f32[2,1], bias=f32[1], activation=identity), True)
    """
    import orbax.checkpoint as ocp  # on first use: import functree stays light
    path = _target(policy.read_path(path, "ft.train.load"))  # "~/run" only ./~/run holds: LITERAL_TILDE
    if mesh is not None and template is None:
        raise CheckpointError(LOAD_NEEDS_TEMPLATE)
    target = placement({"": template}, mesh, sharding, data_axis)
    old = _siblings(path)[1]
    where = old if not path.exists() and old.is_dir() else path  # an overwrite killed mid-swap
    if not where.exists():  # (orbax's reader calls it damaged: nothing is there)
        raise CheckpointError(NO_TREE.format(path=path))
    _check_a_tree(where)
    try:
        with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
            arrays, meta = _read(lambda args: checkpointer.restore(where, args=args), where, target)
        step = meta.get("step")
        hint = "" if step is None else MANAGER_STEP.format(directory=path.parent, step=step)
        tree = rebuild(meta["spec"], arrays, template, hint=hint)
        check_names(meta["spec"], arrays)
        return tree
    except _Damage as e:
        steps = _step_directories(path)
        if steps:  # not damage: the parent of a manager's steps
            raise CheckpointError(MANAGER_DIRECTORY.format(path=path, steps=steps, last=steps[-1])) from None
        raise CheckpointError((DAMAGED_FILES if e.files else NOT_READABLE).format(path=path, problem=e)) from e.__cause__
    except SpecError as e:
        raise SpecError(f"Checkpoint {path}:\n{e}") from None



# --- the manager ------------------------------------------------------------------------------

# Orbax numbers each save with a process-wide operation id (``OperationIdGenerator``: a class
# attribute, incremented at the start of a save and read back later in the same call to name
# the signals its background thread waits for). Two asynchronous managers saving at once from
# two threads interleave them: one save then waits for another's signals and hangs for orbax's
# timeout (300 s) before a TimeoutError. One asynchronous save's start at a time in the
# process: the writes themselves still run in the background, side by side. (Synchronous
# saves from two threads do not interleave there, and one may take long: no lock.)
_ORBAX_SAVE = threading.Lock()

# An asynchronous save the script never waited for was lost when the script ended: Python
# stops the thread pools orbax's background writes run on (concurrent.futures' own exit hook)
# before ``atexit`` functions run, and the step stayed a temporary directory. Managers with a
# save under way are finished from threading's exit hooks instead, which run before those
# pools stop (last registered, first run: ours is registered after orbax imported the pools).
# From Python 3.12 no thread starts once the main thread has ended, and orbax's write starts
# threads: a write still under way then cannot finish (waiting for it would hang), and is
# reported as lost instead.
_UNDER_WAY: set[CheckpointManager] = set()  # strong references: a manager dropped at once still writes
UNFINISHED_AT_EXIT = """\
CheckpointManager({path!r}): the asynchronous save under way when the script ended failed: \
{error}
Its step was not written. Wait for a save where the script can handle the error:
    wrong: manager.save(step, model)                                   # the script ends here
    right: manager.save(step, model); manager.wait_until_finished()    # or: with CheckpointManager(...) as manager:
"""

LOST_AT_EXIT = """\
CheckpointManager({path!r}): an asynchronous save was still being written when the script \
ended, and this Python (3.12 or later) starts no thread after the main thread ends, which \
orbax's write needs: its step was not written. Wait for the save before the script ends:
    wrong: manager.save(step, model)                                   # the script ends here
    right: manager.save(step, model); manager.wait_until_finished()    # or: with CheckpointManager(...) as manager:
"""


def _check_a_tree(path: Path) -> None:
    """A file or folder inside a checkpoint (``model/meta/metadata``), or any other file, is
    named as such: orbax's reader calls either "corrupted or incomplete"."""
    if (path / "meta").is_dir():
        return
    root = next((p for p in path.parents if (p / "meta").is_dir() and (p / "arrays").is_dir()), None)
    if root is not None:
        what = "a file" if path.is_file() else "a folder"
        raise CheckpointError(INSIDE_A_TREE.format(path=path, what=what, root=root))
    if path.is_file():
        raise CheckpointError(A_FILE.format(path=path))


def _threads_start() -> bool:
    """Whether a thread can still start (not after the main thread has ended, from 3.12)."""
    try:
        thread = threading.Thread(target=lambda: None)
        thread.start()
    except RuntimeError:
        return False
    thread.join()
    return True


def _finish_under_way() -> None:
    """At the end of the script: wait for every asynchronous save still being written (or, where
    no thread starts any more, name the ones that cannot finish)."""
    starts = _threads_start()
    for manager in list(_UNDER_WAY):
        if not starts:  # never wait here: orbax's finishing threads cannot start, and a wait may hang
            _UNDER_WAY.discard(manager)
            if not (manager.directory / str(manager._writing)).exists():  # renamed from its tmp name when done
                print(LOST_AT_EXIT.format(path=str(manager.directory)), file=sys.stderr)
            continue
        try:
            manager.wait_until_finished()
        except BaseException as e:  # nothing left to raise to: say which step was lost
            print(UNFINISHED_AT_EXIT.format(path=str(manager.directory), error=e), file=sys.stderr)


@functools.cache  # once per process, at the first asynchronous save (orbax's pools imported by then)
def _hook_exit() -> None:
    # threading's exit hooks: the order concurrent.futures itself relies on.
    threading._register_atexit(_finish_under_way)  # pyright: ignore[reportAttributeAccessIssue]


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
    positive int, or None to keep all). ``mode`` left out is read from the name: a loss
    (``"loss"``, ``"val_loss"``, ``"*_loss"``) falls, ``ft.train``'s metrics
    (``"val_accuracy"``, ``"f1"``, ...) rise, and any other name is refused
    (``UNKNOWN_DIRECTION``: say ``mode="min"`` or ``"max"``), never ranked the wrong way. One job writes a directory at a time: every
    process of a multi-process job calls ``save``; its primary process holds the lock.
    A failed save leaves nothing behind: the same manager saves the next step.

    With ``asynchronous=True``, ``save`` returns once orbax holds the arrays and writes them in
    the background; the next ``save``, ``wait_until_finished()``, ``close()`` (or the end of a
    ``with`` block) and the end of the script wait for the write. A write that fails at the
    end of the script is reported on stderr: wait where the script can handle the error. From
    Python 3.12 no thread starts after the main thread ends, and orbax's write needs some: a
    write still under way when the script ends is then named on stderr as lost.

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

    SKIP: ClassVar[Any] = SKIP  # restore(extra_template={entry: CheckpointManager.SKIP}): the entry unread

    def __init__(self, directory: str | os.PathLike[str], max_to_keep: int | None = 3,
                 best_metric: str | None = None, mode: str | None = None, *, asynchronous: bool = False):
        import orbax.checkpoint as ocp  # on first use: import functree stays light
        check_mode("CheckpointManager", "best_metric", best_metric, mode)
        mode = "min" if best_metric is None and mode in (None, "auto") else resolve_mode(
            "CheckpointManager", "best_metric", str(best_metric), mode)
        if max_to_keep is not None and (isinstance(max_to_keep, (bool, np.bool_)) or not isinstance(
                max_to_keep, (int, np.integer)) or max_to_keep < 1):
            raise ValueError(BAD_MAX_TO_KEEP.format(value=max_to_keep))
        # "~/run" that only ./~/run holds: LITERAL_TILDE, not an empty ~/run made and "no checkpoint"
        self.directory = policy.read_path(directory, "ft.train.CheckpointManager")
        policy.check_directory(self.directory)
        self.best_metric, self.mode, self.max_to_keep = best_metric, mode, max_to_keep
        self._metrics: dict[int, dict[str, Any]] = {}
        self._lock = policy.WriterLock(self.directory)
        self._asynchronous = asynchronous
        self._writing: int | None = None  # the asynchronous save's step, until it is waited for
        # Retention (last k plus the best) is applied here, from the metrics stored in
        # each checkpoint and the steps on disk, so it holds across managers. Orbax's
        # temporary-directory cleanup is off: it would delete another writer's in-flight
        # save; leftovers are removed under the writer lock instead.
        options = ocp.CheckpointManagerOptions(enable_async_checkpointing=asynchronous, create=True,
                                               cleanup_tmp_directories=False, save_root_metadata=False)
        self._mngr = ocp.CheckpointManager(self.directory, options=options)

    def save(self, step: int, model: Any, opt_state: Any = None, *, metrics: Mapping[str, Any] | None = None,
             config: Mapping[str, Any] | None = None, extra: Any = None, frozen: Sequence[str] = ()) -> None:
        """Write a checkpoint of ``model``, ``opt_state`` and ``extra`` (any tree) at ``step``.

        ``metrics`` (numbers) rank checkpoints for ``best_metric``; ``config`` is any JSON:
        optimizer and trainer options, data position, notes. ``frozen``: names of model
        arrays no step changes (``model.layers.0.weight``; a LoRA job's base, see
        :mod:`._frozen`), stored as fingerprints only: restoring them needs ``template=``.
        Every process of a job calls it.
        """
        step = int(step)
        check_stale([("model", model), ("opt_state", opt_state), ("extra", extra)],
                    "CheckpointManager.save(step, model, opt_state)")  # donated by a step: nothing written
        metrics = cast("dict[str, Any]", _json_value(dict(metrics or {})))
        if self.best_metric is not None and self.best_metric not in metrics:
            raise CheckpointError(MISSING_METRIC.format(step=step, metric=self.best_metric, given=sorted(metrics)))
        arrays, spec = encode({"model": model, "opt_state": opt_state, "extra": extra})
        base = {"frozen": describe_frozen(arrays, frozen, model)} if frozen else {}
        args = save_args(arrays, spec, step=step, metrics=metrics, config=_json_value(dict(config or {})), **base)
        try:
            agreed(lambda: self._begin(step))
            if self._asynchronous:  # its start under the lock, after this manager's previous writes
                self._mngr.wait_until_finished()
                with _ORBAX_SAVE:
                    _hook_exit()
                    self._mngr.save(step, args=args, force=True)
                    self._writing = step
                    _UNDER_WAY.add(self)
            else:  # (its writes may take long; two in threads did not mix orbax's ids)
                self._mngr.save(step, args=args, force=True)
            self._metrics[step] = metrics
            self._prune(step)
        except BaseException:
            self._end(failed=True)
            raise
        if not self._asynchronous:
            self._end()

    def _begin(self, step: int) -> None:
        """The primary process's part: the lock, the leftovers, no second save of a step."""
        if self._lock.acquire():
            policy.remove_leftovers(self.directory)
        if (self.directory / str(step)).exists():
            raise CheckpointError(STEP_EXISTS.format(path=self.directory, step=step))

    def _end(self, failed: bool = False) -> None:
        """After a save: a failed one's partial step removed (under the lock), the lock released.

        A save that succeeded returns on every process once the primary one has released the
        lock (``agreed``), so no process sees the directory still locked by its own job.
        """
        try:
            self._mngr.wait_until_finished()
        except BaseException:
            failed = True
            raise
        finally:
            _UNDER_WAY.discard(self)
            if failed:  # no collective here: the other processes may not have failed
                if self._lock.token is not None:
                    policy.remove_leftovers(self.directory)
                self._lock.release()
            else:
                agreed(self._lock.release)

    def _prune(self, newest: int) -> None:
        steps = sorted(set(self.all_steps()) | {newest})
        for step in agreed(lambda: policy.to_delete(steps, self.max_to_keep, self.best_step(steps))):
            self.delete(step)

    def _step_metrics(self, step: int) -> dict[str, Any]:
        if step not in self._metrics:  # the JSON file alone: no orbax call, no collective
            try:
                meta = json.loads((self.directory / str(step) / "meta" / "metadata").read_text())
            except (OSError, ValueError):  # an unreadable checkpoint never ranks as the best
                meta = {}
            metrics = meta.get("metrics") if isinstance(meta, dict) else None
            self._metrics[step] = metrics if isinstance(metrics, dict) else {}
        return self._metrics[step]

    def delete(self, step: int) -> None:
        """Remove the checkpoint at ``step`` (every process of a job calls it). A step folder
        that is a symbolic link (a checkpoint kept elsewhere, linked in) loses the link
        alone: what it points to is left as it is."""
        link = self.directory / str(int(step))
        if agreed(link.is_symlink, "delete"):  # orbax's rmtree refuses a link (OSError): the entry goes, as with `rm`
            agreed(link.unlink, "delete")
            self._mngr.reload()
        else:
            self._mngr.delete(int(step))
        self._metrics.pop(int(step), None)

    def wait_until_finished(self) -> None:
        """Block until an asynchronous save has been written (and release the lock)."""
        self._end()

    def all_steps(self) -> list[int]:
        """The steps with a complete checkpoint, ascending (read from the directory)."""
        if policy.step_names(self.directory) != sorted(self._mngr.all_steps()):
            self._mngr.reload()  # another writer changed the directory: orbax reads every step's metadata
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
        metric = self.best_metric
        return policy.best(((self._step_metrics(s).get(metric), s) for s in (
            self.all_steps() if steps is None else steps)), self.mode)

    def restore(self, step: int | None = None, *, template: Any = None, opt_state_template: Any = None,
                extra_template: Any = None, include: tuple[str, ...] = _PARTS, mesh: Any = None,
                sharding: Any = None, data_axis: str = "data") -> Checkpoint:
        """The :class:`Checkpoint` at ``step`` (default: the latest).

        ``template`` (a model), ``opt_state_template`` and ``extra_template`` are checked
        against the saved leaves by key path, shape and dtype, every mismatch reported at
        once, then against the saved static values and layers without arrays (as
        :func:`load`); parts without a template are rebuilt from the saved type information, using
        only registered types (:func:`functree.train.register`). Parts left out of
        ``include`` come back as None (e.g. ``include=("model",)`` to continue a saved
        model with new optimizer options). Damage raises :class:`CheckpointError`.

        ``extra_template`` may name some entries of a saved dict ``extra`` alone
        (``{entry: template}``): each named entry is checked against its template, its
        mismatches reported under ``extra.<entry>``; an entry it does not name (or names
        with None) is rebuilt as saved; one named ``CheckpointManager.SKIP`` is left out of
        the returned ``extra`` unread (no type it names is looked up; its arrays' CRC-32s
        are checked with the others). Naming an entry the checkpoint lacks with a template
        is an error. Any other ``extra_template`` (or a dict when the saved ``extra`` is
        not one) is the template of the whole ``extra``. In what ``extra`` reads as saved,
        a Module of ``template``'s class that does not decode by name (its class edited
        since the save, or several live classes of that name) is read with ``template``
        where it fits (same classes, key paths, shapes, dtypes, static values), as the
        model is: an edited class reads the same way in both.

        Example:
          >>> import functree as ft, jax, jax.numpy as jnp, tempfile
          >>> model = ft.nn.Dense(2, 1, key=jax.random.key(0))
          >>> extra = {"ema": model, "rounds": 3, "notes": {"seen": jnp.ones(4)}}
          >>> with tempfile.TemporaryDirectory() as d, ft.train.CheckpointManager(d + "/run") as mngr:
          ...     mngr.save(1, model, extra=extra)
          ...     ckpt = mngr.restore(extra_template={"ema": model, "notes": ft.train.CheckpointManager.SKIP})
          ...     wrong = {"ema": ft.nn.Dense(3, 1, key=jax.random.key(0))}
          ...     try:
          ...         mngr.restore(extra_template=wrong)
          ...     except ft.train.CheckpointError as e:
          ...         print(str(e).splitlines()[0])
          The checkpoint's extra.ema at step 1 does not fit the template:
          >>> sorted(ckpt.extra), ckpt.extra["rounds"], ckpt.extra["ema"]
          (['ema', 'rounds'], 3, Dense(weight=f32[2,1], bias=f32[1], activation=identity))

        With ``mesh`` (and ``sharding``: None, ``"fsdp"`` or rules by key path, as for
        ``ft.shard``) every array is restored straight into its shards on that mesh,
        whatever device count or process count wrote it: the templates' arrays placed by
        the rules (optimizer moments follow their parameters), the rest on the host.
        Without a mesh, ``sharding`` (a device or a ``Sharding``) places every array; else
        each goes where its template's array is, the rest on the templates' one device or
        the default device: never where the writer had it.
        """
        templates: dict[str, Any] = dict(zip(_PARTS, (template, opt_state_template, extra_template)))
        target = placement(placed_templates(templates), mesh, sharding, data_axis)
        steps = self.all_steps()
        if not steps:
            raise CheckpointError(NOTHING_SAVED.format(path=self.directory, step="" if step is None else step))
        chosen = steps[-1] if step is None else step
        if chosen not in steps:
            raise CheckpointError(NO_CHECKPOINT.format(path=self.directory, steps=steps, step=step))
        try:
            arrays, meta = _read(lambda args: self._mngr.restore(chosen, args=args),
                                 self.directory / str(chosen), target, manager=True)
            if "frozen" in meta:  # a job that trained a subset: its base from the template
                restore_frozen(arrays, meta["frozen"], template, chosen)
            hint = OLD_OPTIMIZER_LAYOUT if meta.get("migrated_from") else ""
            model, opt_state, extra = meta["spec"]["items"]
            parts = {"model": rebuild(model, arrays, template, "model", chosen) if "model" in include else None,
                     "opt_state": rebuild(opt_state, arrays, opt_state_template, "opt_state", chosen, hint)
                     if "opt_state" in include else None,
                     "extra": read_extra(extra, arrays, extra_template, template, chosen)
                     if "extra" in include else None}
            check_names(meta["spec"], arrays)
        except _Damage as e:
            others = [s for s in steps if s != chosen]
            raise CheckpointError(DAMAGED.format(
                step=chosen, path=self.directory, problem=e, others=f"steps {others}" if others else "none is left",
                suggestion=others[-1] if others else "")) from e.__cause__
        except SpecError as e:
            raise SpecError(f"Checkpoint step {chosen} in {self.directory}:\n{e}") from None
        return Checkpoint(step=int(meta["step"]), metrics=meta["metrics"], config=meta["config"], **parts)

    def close(self) -> None:
        """Finish pending saves, release the writer lock and orbax's resources."""
        try:
            self._mngr.close()
        finally:
            _UNDER_WAY.discard(self)
            self._lock.release()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"CheckpointManager({str(self.directory)!r}, steps={self.all_steps()})"
