"""Where a model lives, and the arrays made for it put there.

A model committed to one device (``jax.device_put(model, jax.devices()[2])``) or to a mesh
(``NamedSharding`` leaves) is trained there: the arrays a step, an optimizer or a trainer
makes for it (learning context, hyperparameters, PRNG key, the metric buffer, NaN records,
evaluation sums) must be on the same devices, or ``jax.jit`` refuses the call ("Received
incompatible devices for jitted computation"). :func:`placement_of` reads the model's
placement once (when a program, a state or a trainer is built), :func:`put` puts arrays
there, committed.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from functree._where import placement_of, put
  >>> model = {"w": jnp.ones(2)}          # uncommitted: on the default device
  >>> placement_of(model) is None
  True
  >>> state = put({"step": jnp.zeros((), jnp.int32)}, placement_of(model))
  >>> state["step"].committed             # committed where it is, as restored arrays are
  True
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.core import Tracer
from jax.sharding import (
    AxisType,
    Mesh,
    NamedSharding,
    PartitionSpec,
    Sharding,
    SingleDeviceSharding,
)

from functree._tree import dotted_name

__all__ = ["placement_of", "put", "placed_like", "committed_sharding", "default_device", "devices_error", "INCOMPATIBLE_DEVICES",
           "MESH_AXIS_TYPES", "LEAVES_ON_DEVICES", "several_devices", "shown_devices", "following"]


INCOMPATIBLE_DEVICES = """\
{call}: its arguments are committed to different devices: {first} is on {first_devices}, \
{other} on {other_devices}. A jitted call runs on one set of devices; JAX moves an \
uncommitted array there (NumPy, or made without a device) but never a committed one.
    wrong:  {wrong}    # another device than {first_name}'s
    right:  {fix}    # or pass NumPy arrays"""


LEAVES_ON_DEVICES = """\
{call}: {name}'s own arrays are committed to different devices: {first} is on {first_devices}, \
{other} on {other_devices}. A model computes on one set of devices, and JAX never moves a \
committed array (a leaf put apart, or set from an array that lives elsewhere); put the \
whole tree on one device (or mesh).
    wrong:  {name} = ft.set({name}, {other_path!r}, jax.device_put(value, jax.devices()[{other_id}]))
    right:  {name} = jax.device_put({name}, {fix})    # every leaf there, {first_name}'s first one's placement"""


MESH_AXIS_TYPES = """\
{call}: its arguments are on two meshes of the same devices that differ in their axis types: \
{auto} is on the mesh with Auto axes, {other} on the one with {types} axes, and JAX runs a call \
on one mesh. ft.shard (as every functree placement: Trainer(mesh=), train_step(mesh=), \
ft.train.load(mesh=)) puts arrays on the Auto-typed twin of the mesh it is given (jax.make_mesh \
makes Explicit axes); put {name} there too, or pass NumPy arrays (the call places them).
    wrong:  {name} = jax.device_put({name}, NamedSharding(mesh, {spec}))    # mesh's {types} axes
    right:  {name} = jax.device_put({name}, NamedSharding(ft.parallel.auto_mesh(mesh), {spec}))
       or:  {name} = ft.parallel.shard_batch({name}, mesh)    # a batch, split over the data axis"""


def devices_error(call: str, error: Exception, named: list[tuple[str, Any]]) -> ValueError | None:
    """:data:`INCOMPATIBLE_DEVICES` for JAX's "incompatible devices" ``error`` of a call
    given ``named`` arguments (``[(name, tree)]``): the first committed array, and the first
    one committed to other devices, by key path; :data:`MESH_AXIS_TYPES` for JAX's "Mesh for
    all inputs should be equal" where two arguments lie on one mesh's Auto and other-typed
    twins. None for another error."""
    if "Mesh for all inputs should be equal" in str(error):
        return _mesh_types_error(call, named)
    if "incompatible devices" not in str(error):
        return None
    first = None
    for name, tree in named:
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
            if not (isinstance(leaf, jax.Array) and not isinstance(leaf, Tracer) and leaf.committed):
                continue
            where = f"{name}{jax.tree_util.keystr(path)}"
            devices = leaf.sharding.device_set
            if first is None:
                first = (where, devices, name)
            elif devices != first[1]:
                if name == first[2]:  # one argument's own leaves apart (a model half moved)
                    return ValueError(several_devices_message(call, name, first[0], first[1], path, devices))
                target = next(iter(first[1])) if len(first[1]) == 1 else None
                fix = (f"{name} = jax.device_put({name}, jax.devices()[{target.id}])" if target is not None else
                       f"{name} = jax.device_put({name}, {first[0]}.sharding)")
                wrong = (f"{name} = jax.device_put({name}, jax.devices()[{next(iter(devices)).id}])" if len(devices) == 1
                         else f"{name} = jax.device_put({name}, another_sharding)")
                return ValueError(INCOMPATIBLE_DEVICES.format(
                    call=call, first=first[0], first_devices=shown_devices(first[1]), other=where, other_devices=shown_devices(devices),
                    fix=fix, wrong=wrong, first_name=first[2]))
    return None


def shown_devices(devices: Any) -> list[str]:
    """A device set as the messages show it: ``['cpu:0', 'cpu:1']``."""
    return sorted(str(x) for x in devices)


def several_devices_message(call: str, name: str, first: str, first_devices: Any, other_path: Any,
                            other_devices: Any) -> str:
    """:data:`LEAVES_ON_DEVICES` for ``name``'s leaf ``first`` on ``first_devices`` and its
    leaf at key path ``other_path`` on ``other_devices`` (device sets)."""
    target = next(iter(first_devices)) if len(first_devices) == 1 else None
    fix = f"jax.devices()[{target.id}]" if target is not None else f"{first}.sharding"
    return LEAVES_ON_DEVICES.format(
        call=call, name=name, first=first, first_devices=shown_devices(first_devices),
        other=f"{name}{jax.tree_util.keystr(other_path)}", other_devices=shown_devices(other_devices),
        other_path=dotted_name(other_path), other_id=min(d.id for d in other_devices), fix=fix, first_name=name)


def several_devices(tree: Any, call: str, name: str) -> ValueError | None:
    """:data:`LEAVES_ON_DEVICES` when ``tree``'s committed arrays lie on more than one set of
    devices (the first such leaf, by key path, and the first committed one), else None."""
    first = None
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        sharding = committed_sharding(leaf)
        if sharding is None:
            continue
        if first is None:
            first = (f"{name}{jax.tree_util.keystr(path)}", sharding.device_set)
        elif sharding.device_set != first[1]:
            return ValueError(several_devices_message(call, name, first[0], first[1], path, sharding.device_set))
    return None


def _mesh_types_error(call: str, named: list[tuple[str, Any]]) -> ValueError | None:
    """:data:`MESH_AXIS_TYPES` naming an array on a mesh of Auto axes and one on the same
    devices and axis names with other axis types (the first of each, by key path)."""
    auto = other = None
    for name, tree in named:
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
            sharding = committed_sharding(leaf)
            if not isinstance(sharding, NamedSharding):
                continue
            where = (f"{name}{jax.tree_util.keystr(path)}", name, sharding)
            if all(t == AxisType.Auto for t in sharding.mesh.axis_types):
                auto = auto or where
            else:
                other = other or where
    if auto is None or other is None:
        return None
    mine, theirs = auto[2].mesh, other[2].mesh
    if mine.axis_names != theirs.axis_names or np.asarray(mine.devices).tolist() != np.asarray(theirs.devices).tolist():
        return None  # two meshes apart: JAX's own message
    types = "/".join(sorted({str(t).rsplit(".", 1)[-1] for t in theirs.axis_types}))
    return ValueError(MESH_AXIS_TYPES.format(call=call, auto=auto[0], other=other[0], types=types, name=other[1],
                                             spec=other[2].spec))


def default_device() -> Any:
    """The device uncommitted arrays are made on (``jax.default_device`` if set)."""
    device = getattr(jax.config, "jax_default_device", None)
    if device is None or isinstance(device, str):
        return jax.local_devices(backend=device)[0]
    return device


def _replicated(sharding: Sharding) -> Sharding:
    """A sharding that holds a whole array on every device of ``sharding``."""
    if isinstance(sharding, NamedSharding):
        return NamedSharding(sharding.mesh, PartitionSpec(), memory_kind=sharding.memory_kind)
    devices = sharding._device_assignment  # (the mesh order of a GSPMD or positional sharding)
    if len(devices) == 1:
        return SingleDeviceSharding(devices[0], memory_kind=sharding.memory_kind)
    return NamedSharding(Mesh(np.array(devices), ("devices",)), PartitionSpec())


def placement_of(tree: Any) -> Sharding | None:
    """Where new arrays for ``tree`` go: its first committed array's devices, replicated
    (a ``SingleDeviceSharding`` for one device, ``NamedSharding(mesh, P())`` for a mesh);
    None when no leaf is committed or they are on the default device alone (new arrays
    are made there anyway, uncommitted: nothing to move), or under a trace (``jax.vmap``
    of ``opt.init``: its arrays are placed with the traced ones)."""
    sharding = _first_committed(tree)
    if sharding is None or sharding.device_set == {default_device()}:
        return None
    return _replicated(sharding)


def _first_committed(tree: Any) -> Sharding | None:
    """The sharding of ``tree``'s first committed, concrete array; None where there is none."""
    return next((s for s in map(committed_sharding, jax.tree.leaves(tree)) if s is not None), None)


def put(tree: Any, where: Sharding | None) -> Any:
    """``tree`` with each array committed on ``where``'s devices: an array already
    committed there stays as it is (sharded by its rules), another one (uncommitted, or on
    other devices) is put there whole. ``where`` None: each array committed where it is
    (the same buffers; ``jax.jit`` then compiles one program for these arrays and restored
    ones, which come back committed)."""
    if where is None:
        return jax.tree.map(lambda x: jax.device_put(x, x.sharding) if _uncommitted(x) else x, tree)
    devices = where.device_set
    return jax.tree.map(lambda x: jax.device_put(x, where) if isinstance(x, jax.Array) and (
        not x.committed or x.sharding.device_set != devices) else x, tree)


def committed_sharding(x: Any) -> Sharding | None:
    """The sharding of ``x`` when it is a committed, concrete array (where arrays made for
    it go: ``jnp.zeros(..., device=)``, ``jax.device_put``); None for any other leaf."""
    return x.sharding if isinstance(x, jax.Array) and not isinstance(x, Tracer) and x.committed else None


def placed_like(new: Any, old: Any) -> Any:
    """``new`` (arrays made for ``old``: LoRA adapters, loaded weights) put where ``old``
    lives (:func:`placement_of`): a layer of a model on device 3 gets its new arrays on
    device 3, not on the default device (JAX makes arrays there, and moves them at every
    jitted call until a step's outputs come back committed: one more compile and a copy).
    ``new`` as it is where ``old`` needs no move (uncommitted, the default device, traced).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from functree._where import placed_like
      >>> old = {"w": jnp.ones(2)}
      >>> placed_like({"a": jnp.zeros(2)}, old)["a"].committed     # old is uncommitted
      False
    """
    where = placement_of(old)
    return new if where is None else put(new, where)


def following(tree: Any, values: Any) -> Any:
    """``values`` (a call's inputs beside ``tree``: token ids, a mask, a key) with each
    concrete array committed to other devices than ``tree``'s first committed array put on
    ``tree``'s devices (replicated), as NumPy inputs go there: ids made on device 0 for a model
    on device 2 (JAX refuses the call: "incompatible devices"). ``values`` as they are where
    ``tree`` is uncommitted or traced.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from functree._where import following
      >>> model = {"w": jax.device_put(jnp.ones(2), jax.devices()[0])}
      >>> following(model, (jnp.arange(3),))[0].committed     # uncommitted: it goes where the call runs
      False
    """
    target = _first_committed(tree)
    if target is None:
        return values
    devices, where = target.device_set, None

    def moved(x: Any) -> Any:
        nonlocal where
        sharding = committed_sharding(x)
        if sharding is None or sharding.device_set == devices:
            return x
        where = where or _replicated(target)
        return jax.device_put(x, where)
    return jax.tree.map(moved, values)


def _uncommitted(x: Any) -> bool:
    return isinstance(x, jax.Array) and not x.committed
