"""A tree as named arrays plus a JSON description of its types, and back.

Checkpoints must rebuild a model and an optimizer state *without a template*: a
NamedTuple must come back as that NamedTuple, a Module as that Module with its static
configuration, a Python float as a float. Orbax alone restores dicts and lists. So a tree
is split into

* ``arrays``: ``{name: array}`` with dotted key-path names (``model.layers.0.weight``);
* ``spec``: JSON describing every node by kind and, for classes, by a public name
  (``"functree.nn.Dense"``).

The spec is data: :mod:`._decode` reads it back, looking every class and function up by
name, never importing one. This module writes it (:func:`encode`) and compares a saved
description with a template's (:func:`static_differences`, :func:`same_classes`).

A function at a leaf (Equinox's ``activation``, a ``jax.nn.relu`` in a list of layers)
is stored by its registered name, as a static function is, and looked up on restore.

Static field values are stored as JSON when they are JSON scalars or tuples of them, as a
registered name for functions and scalar types (``jax.nn.relu``), as a dtype name, a NumPy
scalar as its dtype and value (``np.float32(1e-3)``), an Enum member as its class's name
and the member's (a Flag combination, ``re.I | re.M``, as its class's name and its bits), a leafless Module (an activation with a slope) as its own description,
and otherwise only as their ``repr`` (such a tree needs a template to be loaded).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import itertools
import json
import math
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from functree._key_entries import _python_key
from functree._module import Module
from functree._naming import is_tied
from functree._paths import KeyPath
from functree._stacked import is_stacked
from functree._tree import child_name, dotted_name
from functree.hf._config import HFConfig
from functree.train.checkpoint._decode import (
    NUMPY_INT_KEYS,
    check_names,
    decode,
    flag_bits,
    leaf_specs,
    namedtuple_names,
    numpy_scalar,
    safe_dtype,
)
from functree.train.checkpoint._errors import (
    MALFORMED,
    CheckpointError,
    SpecError,
    UnsavableKeyError,
    text_literal,
)
from functree.train.checkpoint._function_code import same_function, shown, with_code
from functree.train.checkpoint._registry import (
    default_name,
    function_name,
    lookup_type,
    type_name,
)

# decode, check_names, CheckpointError and SpecError: imported from here by other modules.
__all__ = ["encode", "decode", "same_classes", "check_names", "static_differences", "layer_differences",
           "template_chooses",
           "CheckpointError", "SpecError", "UNENCODABLE_KEY"]

STATIC_DROPPED = """\
The checkpoint's {cls} at {path!r} was saved with the static field {field} = {saved}, and the \
template's {template} has no field {field}: restoring into it would drop the saved value \
silently, and the tree would compute something else than the saved one (a field removed from \
the class since the save). Give the class the field again, with the saved value, or restore \
with the class as it was saved:

    wrong:  ft.train.load(path, template=model)   # {template} without {field}
    right:  {field}: ... = ft.field(static=True, default={saved})   # in class {template}; then the same load
       or:  ft.train.load(path)                   # with {cls} defined as it was saved"""

UNSUPPORTED_KEY = """\
The dict at {path} has the key {key}, a {type}: a checkpoint stores a dict's keys as text \
and reads back str, int and bool keys (and NumPy integers) only, so this one could not be \
rebuilt. Nothing was written. Key the dict by text or integers (or hold the values in a list):

    wrong:  {{{key}: value}}
    right:  {{{key_text}: value}}{taken}"""


KEY_PATH_KEY = """\
The dict at {path} has the key {key!r}, a KeyPath: a checkpoint stores a dict's keys as text \
and reads back str, int and bool keys (and NumPy integers) only. A dict keyed by key paths is \
ft.nn.collect_state's layer state (or ft.recursively_all_key_paths'). Nothing was written. \
Save the state applied to its model, or keyed by the paths' text (KeyPath.parse reads it back):

    wrong:  ft.train.save(path, updates)
    right:  ft.train.save(path, ft.nn.apply_state(model, updates))
       or:  ft.train.save(path, {{str(k): v for k, v in updates.items()}})     # {{{key_text}: value}}"""


BIG_INT = """\
The leaf {key!r} is the Python int {value}, beyond 64 bits: a checkpoint holds a number as \
an array (a Python int as int64, or uint64 up to 2**64 - 1, read back as the int it was). \
Nothing was written. Split it into 64-bit parts, or keep it as text in a manager's config= (JSON):

    wrong:  ft.train.save(path, {{"seed": seed}})                                  # seed >= 2**64
    right:  ft.train.save(path, {{"seed": [seed >> 64, seed & (2**64 - 1)]}})       # back: (hi << 64) | lo"""

UNENCODABLE_KEY = """\
The dict at {path} has the key {key!r}, text that is no Unicode (a lone surrogate, {char!r}: \
bytes decoded with errors="surrogateescape", or half of a UTF-16 pair): a checkpoint names \
each array by its key path in UTF-8 files, which cannot hold it. Nothing was written. \
Decode the key's bytes as what they are, or key the dict by its text without them:

    wrong:  {{{key!r}: value}}
    right:  {{{fixed!r}: value}}    # key.encode("utf-8", "replace").decode(){taken}"""

TAKEN = """
    (not {text}: another key of this dict is that text, or is offered it, and the two would be one; \
any text of its own)"""


def _encode_static(value: Any) -> dict[str, Any]:
    code = _data_code(value)
    if code is not None:
        return code
    if value is None or isinstance(value, (bool, int, float, str)):
        return {"json": value}
    if isinstance(value, KeyPath):  # (a tuple: stored as its text, parsed back, never a plain tuple)
        return {"key_path": str(value)}
    if isinstance(value, tuple):
        return {"tuple": [_encode_static(v) for v in value]}
    if isinstance(value, np.dtype):
        return {"dtype": str(value)}
    if isinstance(value, HFConfig):  # a from_hf model's config.json: JSON data, rebuilt as data
        return {"hf_config": [value.to_dict(), value.generation.to_dict()]}
    if _is_static_record(value):  # a registered frozen dataclass (ft.nn.RopeScaling): its fields, as data
        fields = {f.name: _encode_static(getattr(value, f.name)) for f in dataclasses.fields(value) if f.init}
        return {"record": [type_name(type(value)), fields]}
    if isinstance(value, type) and issubclass(value, np.generic):
        return {"scalar_type": np.dtype(value).name}
    name = function_name(value)
    if name is None and callable(value) and hasattr(value, "__qualname__"):
        # loadable once the loading process registers it; a lambda's or a local function's
        # name with its code's digest (functree/train/checkpoint/_function_code.py)
        name = with_code(value, default_name(value))
    return {"function": name} if name else {"repr": repr(value)}


def _data_code(value: Any) -> dict[str, Any] | None:
    """An Enum member, a NumPy scalar or a leafless Module (check_static refuses others) as
    data, or None. Enum members and NumPy scalars come before JSON scalars: an IntEnum
    member is an int and an np.float64 a float, which would load back as a plain number."""
    if isinstance(value, enum.Enum):
        return _enum_code(value)
    if isinstance(value, np.generic):
        return _numpy_code(value)
    if isinstance(value, Module):
        return _module_code(value)
    return None


def _numpy_code(value: np.generic) -> dict[str, Any] | None:
    """A numeric NumPy scalar as ``{"numpy": [dtype, JSON value]}``, or None where the JSON
    value would not give back the same bits (``np.longdouble``) or the dtype is not numeric."""
    try:
        dtype = safe_dtype(value.dtype.name, "")
        kind = dtype.kind
        plain = ([float(np.real(value)), float(np.imag(value))] if kind == "c" else bool(value) if kind == "b"
                 else int(value) if kind in "iu" else float(value))
        back = numpy_scalar(dtype.name, plain, "")
    except (SpecError, TypeError, ValueError, OverflowError):
        return None
    same = back.dtype == value.dtype and np.asarray(back).tobytes() == np.asarray(value).tobytes()
    return {"numpy": [dtype.name, plain]} if same else None


def _enum_code(value: enum.Enum) -> dict[str, Any] | None:
    """An Enum member as its class's name and its own; a combination of Flag members
    (``re.IGNORECASE | re.MULTILINE``), which has no name of its own to look up, as its
    class's name and its integer value (rebuilt by ``cls(value)``); None for another value
    without a member name (a Flag of non-integer values)."""
    cls = type(value)
    name = value.name
    if isinstance(name, str) and cls.__members__.get(name) is value:
        return {"enum": [type_name(cls), name]}
    bits = value.value
    if isinstance(value, enum.Flag) and type(bits) is int and flag_bits(cls, bits) and cls(bits) == value:
        return {"flag": [type_name(cls), bits]}
    return None


def _module_code(value: Module) -> dict[str, Any] | None:
    """A leafless Module (an activation with a slope) as its own description: its class by
    name and its fields, as any Module's node is stored, with no array (None if one is
    needed, as for a leaf holding an unregistered function)."""
    encoder = _Encoder()
    spec = encoder.module(value, "")
    return None if encoder.arrays else {"module": spec}


def _dict_key(key: Any, path: str, keys: list[Any]) -> list[str]:
    """A dict key as ``[type, text]``; :class:`CheckpointError` for a key the reader could
    not rebuild exactly (a tuple, float, Enum member, object), its fix a text no other of
    the dict's ``keys`` has (:func:`_own_text`)."""
    where = repr(path) if path else "the root"
    if type(key) is str and not key.isascii():
        bad = next((c for c in key if 0xD800 <= ord(c) <= 0xDFFF), None)
        if bad is not None:  # orbax's writer crashed in a thread: "Unable to cast Python instance of type str"
            fixed, taken = _own_text(key, keys)
            raise UnsavableKeyError(UNENCODABLE_KEY.format(path=where, key=key, char=bad, fixed=fixed,
                                                           taken=taken),
                             f"The dict at {where} has the key {key!r}, text that is no Unicode", key, fixed)
    if type(key) in (str, int, bool):
        return [type(key).__name__, str(key)]
    if isinstance(key, np.integer) and np.dtype(type(key)).name in NUMPY_INT_KEYS:
        return [np.dtype(type(key)).name, str(int(key))]
    shown = _shown_key(key)
    why = f"The dict at {where} has the key {shown}, a {type(key).__name__}"
    if isinstance(key, KeyPath):  # (its entries joined by "_" read ".layers_[0]_.running_mean")
        raise UnsavableKeyError(KEY_PATH_KEY.format(path=where, key=key, key_text=text_literal(str(key))), why, key,
                                str(key))
    text, taken = _own_text(key, keys)
    raise UnsavableKeyError(UNSUPPORTED_KEY.format(path=where, key=shown, type=type(key).__name__,
                                                   key_text=text_literal(text), taken=taken), why, key, text, shown)


def _shown_key(key: Any) -> str:
    """``key`` as the message names it: an ``np.str_``'s or ``np.bytes_``'s repr drops its
    trailing NULs (``np.str_('a')`` for the key ``'a\\x00'``), so its characters are shown."""
    if isinstance(key, (np.str_, np.bytes_)):
        return f"np.{type(key).__name__}({_python_key(key)!r})"
    return repr(key)


def _key_text(key: Any) -> str:
    """The text a fix offers for an unsavable ``key``: an ``np.str_``'s characters, its
    trailing NULs kept (``str()`` drops them, and ``'a'`` may be another key of its dict), an
    ``np.bytes_``'s as a ``bytes`` key's (its repr, NULs kept), a key path's text, a lone
    surrogate replaced (``?``), a tuple's entries joined by ``_``, anything else's ``str()``;
    the last two cut at 40 characters."""
    if isinstance(key, str):
        text = str.__str__(key)
        return text.encode("utf-8", "replace").decode() if any(0xD800 <= ord(c) <= 0xDFFF for c in text) else text
    if isinstance(key, np.bytes_):
        return str(_python_key(key))
    if isinstance(key, KeyPath):
        return str(key)
    return ("_".join(map(str, key)) if isinstance(key, tuple) else str(key))[:40]


def _own_text(key: Any, keys: list[Any]) -> tuple[str, str]:
    """:func:`_key_text` of ``key``, and the note (:data:`TAKEN`) where that text is another
    of ``keys``' (a str key, or the text another unsavable key is offered): then that text
    with the first ``_2``, ``_3``, ... no key has, never a rename onto another key (the two
    would be one, silently). Run on the error's path only."""
    text = _key_text(key)
    others = {k if type(k) is str else _key_text(k) for k in keys if k is not key and type(k) not in (int, bool)
              and not isinstance(k, np.integer)}
    if text not in others:
        return text, ""
    n = 2
    while f"{text}_{n}" in others:
        n += 1
    return f"{text}_{n}", TAKEN.format(text=text_literal(text))


def _is_static_record(value: Any) -> bool:
    """A frozen dataclass instance (not a Module) whose class a checkpoint can name and find
    again: registered (``ft.train.register``, or functree's own in ``FUNCTREE_TYPES``)."""
    cls = type(value)
    if not dataclasses.is_dataclass(value) or isinstance(value, type) or issubclass(cls, Module):
        return False
    return cls.__dataclass_params__.frozen and cls in lookup_type(type_name(cls))  # pyright: ignore[reportAttributeAccessIssue]


def _is_namedtuple(x: Any) -> bool:
    return isinstance(x, tuple) and hasattr(type(x), "_fields")


class _Encoder:
    def __init__(self) -> None:
        self.arrays: dict[str, Any] = {}
        self.functions: set[str] = set()  # the keys of function leaves (no array of their own)

    def leaf(self, x: Any, path: str) -> dict[str, Any]:
        function = function_name(x) if callable(x) and not isinstance(x, (jax.Array, np.ndarray)) else None
        name = path or "value"
        while name in self.arrays or name in self.functions:
            name += "_"
        if function is not None:  # a known function at a leaf (Equinox's activations): its name, no array
            self.functions.add(name)
            return {"kind": "function", "name": function, "key": name}
        spec: dict[str, Any] = {"kind": "leaf", "key": name}
        if isinstance(x, (bool, int, float, complex)) and not isinstance(x, np.generic):
            spec["python"] = type(x).__name__
            if isinstance(x, int) and not -(2**63) <= x < 2**64:  # NumPy would hold it as an object
                raise CheckpointError(BIG_INT.format(key=name, value=x))
            x = np.asarray(x)
        elif isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            spec["prng"] = str(jax.random.key_impl(x))
            x = jax.random.key_data(x)
        elif isinstance(x, np.generic):
            spec["numpy_scalar"] = True
            x = np.asarray(x)
        elif isinstance(x, jax.Array) and x.weak_type:  # jnp.asarray(0.5): promotes as a Python number does
            spec["weak"] = True
        self.arrays[name] = x
        return spec

    def node(self, x: Any, path: str) -> dict[str, Any]:
        if x is None:
            return {"kind": "none"}
        if isinstance(x, Module):
            return self.module(x, path)
        if _is_namedtuple(x):
            children = [self.node(v, child_name(path, f)) for f, v in zip(type(x)._fields, x)]
            return {"kind": "namedtuple", "class": type_name(type(x)), "names": list(type(x)._fields),
                    "items": children}
        if isinstance(x, (list, tuple)):
            kind = "list" if isinstance(x, list) else "tuple"
            return {"kind": kind, "items": [self.node(v, child_name(path, i)) for i, v in enumerate(x)]}
        if isinstance(x, dict):
            keys = list(x)
            return {"kind": "dict", "keys": [_dict_key(k, path, keys) for k in keys],
                    "items": [self.node(x[k], child_name(path, k)) for k in keys]}
        children, treedef = jax.tree_util.tree_flatten(x, is_leaf=lambda y: y is not x)
        if treedef.num_nodes == 1 and treedef.num_leaves == 1:
            return self.leaf(x, path)
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            return self.dataclass(x, path)
        return self.opaque(x, path)

    def opaque(self, x: Any, path: str) -> dict[str, Any]:
        """A pytree node of an unregistered type (Flax NNX's ``State``): its children named
        by their JAX key paths (``kernel.value``), the names a template gives them on
        restore. (Files written before named them by position: ``0.0``.)"""
        with_paths = jax.tree_util.tree_flatten_with_path(x, is_leaf=lambda y: y is not x)[0]
        names = [dotted_name(p) for p, _ in with_paths]
        return {"kind": "opaque", "type": repr(type(x)), "names": names,
                "items": [self.node(v, child_name(path, n)) for n, (_, v) in zip(names, with_paths)]}

    def dataclass(self, x: Any, path: str) -> dict[str, Any]:
        """A dataclass registered with ``jax.tree_util.register_dataclass``."""
        with_paths, _ = jax.tree_util.tree_flatten_with_path(x, is_leaf=lambda y: y is not x)
        data = [p[0].name for p, _ in with_paths if isinstance(p[0], jax.tree_util.GetAttrKey)]
        names = [f.name for f in dataclasses.fields(x)]
        return {
            "kind": "dataclass",
            "class": type_name(type(x)),
            "static": {n: _encode_static(getattr(x, n)) for n in names if n not in data},
            "fields": {n: self.node(getattr(x, n), child_name(path, n)) for n in data},
        }

    def module(self, x: Module, path: str) -> dict[str, Any]:
        cls = type(x)
        static = {n: _encode_static(x.__dict__[n]) for n in cls.__ft_static__}
        fields = {
            n: self.node(x.__dict__[n], child_name(path, n))
            for n in cls.__ft_fields__
            if n not in cls.__ft_static__
        }
        return {"kind": "module", "class": type_name(cls), "static": static, "fields": fields}


def encode(tree: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(arrays, spec)``: the tree's leaves by dotted name and a JSON description.

    Example:
      >>> import jax.numpy as jnp
      >>> from functree.train.checkpoint._treespec import encode, decode
      >>> arrays, spec = encode({"w": jnp.ones(2), "n": 3})
      >>> sorted(arrays)
      ['n', 'w']
      >>> decode(spec, arrays)
      {'w': Array([1., 1.], dtype=float32), 'n': 3}
    """
    encoder = _Encoder()
    spec = encoder.node(tree, "")
    return encoder.arrays, spec

# Static fields a template's value decides on restore: how a model runs or trains (its mode,
# kernel, memory strategy, training noise), not what its trained weights compute. A class
# names its own in ``__ft_template_static__`` (``ft.nn.Dropout``'s ``rate``).
TEMPLATE_CHOOSES = ("training",)


def template_chooses(cls: type) -> frozenset[str]:
    """The static fields of ``cls`` whose template value a restore keeps."""
    return frozenset(TEMPLATE_CHOOSES) | frozenset(getattr(cls, "__ft_template_static__", ()))


def static_differences(spec: Any, template: Any, path: str = "", *, texts: bool = False) -> list[tuple[str, str, str]]:
    """``(key path, saved, template's)`` of every static field whose saved value differs from
    the template's at the same place (fields the template chooses are not compared, nor
    values stored only as a ``repr`` unless ``texts``: then their texts are, memory
    addresses aside, as :func:`_same_text`; a ``functools.partial``'s text always is, as
    :func:`_same_partial`: ``partial(leaky_relu, negative_slope=0.3)`` under a template's
    ``0.01`` computes another function, and a file stores no other form of it). Children are matched by name whatever the template's class
    (a class renamed since the save, a dict of the saved layers); a saved static field that
    a Module or dataclass template has no field for raises :class:`SpecError`
    (``STATIC_DROPPED``).

    A template gives a checkpoint's arrays their structure; a static field (an activation, a
    head count, a scale) changes what the model computes, so a saved value the template
    does not share would be replaced (or dropped) silently.
    """
    if not isinstance(spec, dict):
        return []
    kind, out = spec.get("kind"), []
    same_class = kind == "module" and spec.get("class") == type_name(type(template))
    if not same_class and is_tied(template):  # a tie reads an untied tree by its resolved model's names
        return static_differences(spec, template.model, path, texts=texts)
    if not same_class and is_stacked(template) and kind in ("list", "tuple"):  # a Stack's members saved one by one
        return [d for n, c in _named_children(spec, path)
                for d in static_differences(c, template.layers, child_name(path, n), texts=texts)]
    if kind in ("module", "dataclass"):
        out += _static_fields_differ(spec, template, path, texts)
    elif kind == "function" and callable(template):  # a function at a leaf: the template's is kept
        mine = _encode_static(template)
        if not ("function" in mine and same_function(spec.get("name"), mine["function"])) and "repr" not in mine:
            out.append((path, str(spec.get("name")), _shown(mine)))
    for name, child in _named_children(spec, path):
        found, value = _template_child(template, name)
        if found:
            out += static_differences(child, value, child_name(path, name), texts=texts)
    return out


def layer_differences(spec: Any, template: Any, path: str = "") -> list[tuple[str, str, str]]:
    """``(key path, saved, template's)`` of every layer without arrays that the template adds,
    drops or replaces (a layer is a Module or a function at a leaf): a ``Lambda(relu)`` or a
    ``Flatten`` appended to a Sequential, a ``Dropout`` dropped, a ``GlobalMaxPool1D`` where
    the template has a ``GlobalAvgPool1D``. The arrays' key paths, shapes and dtypes cannot
    tell (a layer with arrays added or dropped changes them), and each of these computes
    another function. A leafless Module of another class counts where the saved class is
    defined in this process and neither class derives from the other; a layer with arrays
    may be of a class renamed since the save (its fields and static values are compared:
    :func:`static_differences`). A Stack's members saved one by one and an untied tree read
    into an ``ft.nn.Shared`` are compared member by member and through the tie."""
    if not isinstance(spec, dict):
        return []
    kind = spec.get("kind")
    if kind == "none" or template is None:
        saved, mine = _layers_in_spec(spec), _layers_in(template)
        return [(path or "(the root)", _layer_shown(spec), _template_shown(template))] if saved or mine else []
    same_class = kind == "module" and spec.get("class") == type_name(type(template))
    if not same_class and is_tied(template):  # a tie reads an untied tree by its resolved model's names
        return layer_differences(spec, template.model, path)
    if not same_class and is_stacked(template):  # a Stack reads its members saved one by one
        members = _named_children(spec, path) if kind in ("list", "tuple") else []
        return [d for n, c in members for d in layer_differences(c, template.layers, child_name(path, n))]
    if not same_class and kind == "module" and any(is_stacked(c) or is_tied(c) for c in _saved_classes(spec)):
        return []  # a saved Stack or tie read by other names: its arrays' key paths told
    out = []
    if (kind == "module" and not same_class and isinstance(template, Module)
            and not any(s.get("kind") == "leaf" for _, s in leaf_specs(spec))
            and _other_class(spec, type(template))):  # a leafless layer is its class (a renamed one's arrays tell)
        out.append((path or "(the root)", _layer_shown(spec), _template_shown(template)))
    if kind not in ("module", "dataclass", "list", "tuple", "namedtuple", "dict"):
        return out
    names = set()
    for name, child in _named_children(spec, path):
        names.add(name)
        found, value = _template_child(template, name)
        if found:
            out += layer_differences(child, value, child_name(path, name))
        elif _layers_in_spec(child) and not (isinstance(template, dict) and kind in ("module", "dataclass")):
            out.append((child_name(path, name), _layer_shown(child), "none"))  # (a dict template reads arrays)
    for name, value in _template_children(template):
        if name not in names and _layers_in(value):
            out.append((child_name(path, name), "none", _template_shown(value)))
    return out


def _saved_classes(spec: dict[str, Any]) -> list[type]:
    """The classes defined here that a stored Module's class name may mean."""
    name = spec.get("class")
    return [c for c in lookup_type(name) if isinstance(c, type)] if isinstance(name, str) else []


def _other_class(spec: dict[str, Any], mine: type) -> bool:
    """Whether a stored Module's class is defined here and unrelated to ``mine``."""
    found = _saved_classes(spec)
    return bool(found) and not any(issubclass(mine, c) or issubclass(c, mine) for c in found)


def _layers_in_spec(spec: Any) -> bool:
    """Whether a stored node is or holds a Module or a function."""
    if not isinstance(spec, dict):
        return False
    if spec.get("kind") in ("module", "function"):
        return True
    return any(_layers_in_spec(child) for _, child in _named_children(spec, ""))


def _layers_in(tree: Any) -> bool:
    """Whether a template's subtree is or holds a Module or a function (not an array)."""
    nodes = jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, Module))
    return any(isinstance(x, Module) or (callable(x) and not isinstance(x, (jax.Array, np.ndarray))) for x in nodes)


def _template_children(template: Any) -> list[tuple[str, Any]]:
    """``(name, child)`` of a template's node, named as :func:`_named_children` names a
    stored node's (a Module's and a dataclass's data fields, positions, dict keys as text)."""
    if isinstance(template, Module):
        cls = type(template)
        return [(n, template.__dict__.get(n)) for n in cls.__ft_fields__ if n not in cls.__ft_static__]
    if _is_namedtuple(template):
        return list(zip(type(template)._fields, template))
    if isinstance(template, (list, tuple)):
        return [(str(i), v) for i, v in enumerate(template)]
    if isinstance(template, dict):
        return [(str(k), v) for k, v in template.items()]
    if dataclasses.is_dataclass(template) and not isinstance(template, type):
        with_paths = jax.tree_util.tree_flatten_with_path(template, is_leaf=lambda y: y is not template)[0]
        return [(p[0].name, v) for p, v in with_paths if isinstance(p[0], jax.tree_util.GetAttrKey)]
    return []


def _layer_shown(spec: dict[str, Any]) -> str:
    """A stored node as the user wrote it: ``Lambda(fn=relu)``, ``relu``, ``None``."""
    kind = spec.get("kind")
    if kind == "module":
        return _shown({"module": spec})
    if kind == "function":
        return _shown({"function": spec.get("name")})
    if kind == "none":
        return "None"
    return f"a {kind} of layers"


def _template_shown(value: Any) -> str:
    """A template's node as the user wrote it (a Module's statics, without its arrays)."""
    if value is None:
        return "None"
    if isinstance(value, Module):
        return _shown({"module": _Encoder().module(value, "")})
    if not isinstance(value, (list, tuple, dict)) and callable(value):
        return _shown(_encode_static(value))
    return f"a {type(value).__name__} of layers"


def _static_fields_differ(spec: dict[str, Any], template: Any, path: str,
                          texts: bool) -> list[tuple[str, str, str]]:
    """The differences of a saved Module's (dataclass's) static fields from the template's."""
    static, out = spec.get("static"), []
    chooses = template_chooses(type(template)) | _saved_chooses(spec.get("class"))
    for name, code in (static.items() if isinstance(static, dict) else ()):
        if not isinstance(code, dict) or len(code) != 1:  # as the reader without a template refuses it
            why = f"static value {code!r} is not encoded"  # ("repr" in 1 was a bare TypeError)
            raise SpecError(MALFORMED.format(path=child_name(path, name), why=why[:300]))
        if name in chooses:
            continue
        found, value = _template_child(template, name)
        if not found and _has_fields(template):
            raise SpecError(STATIC_DROPPED.format(cls=str(spec.get("class"))[:200], path=path, field=name,
                                                  saved=_shown(code), template=type(template).__name__))
        if not found:  # a dict or list template reads the arrays alone
            continue
        mine = _encode_static(value)
        if _is_partial(code, value):  # stored as text, yet decides what the model computes: always compared
            differ = not _same_partial(code, value)
        elif "repr" in code or "repr" in mine:
            differ = texts and not _same_text(code, mine)
        elif "module" in code and "module" in mine:  # a leafless Module may hold a partial's text, addresses and all
            differ = not _same_text(code, mine)
        elif "function" in code and "function" in mine:  # a lambda's code compared too, where it can be
            differ = not same_function(code["function"], mine["function"])
        else:
            differ = not same_code(code, mine) and not _stored_before(code, mine, value)
        if differ:
            out.append((child_name(path, name), _shown(code), _shown(mine)))
    return out


def same_code(saved: Any, mine: Any) -> bool:
    """Whether a stored static value (read from JSON) is the template's (encoded): one JSON
    type at every level and one value, floats by sign too. ``==`` took ``1`` for ``True``
    and for ``1.0`` and ``0.0`` for ``-0.0`` (the template's value replaced the saved one,
    and ``int_array * 1.0`` is a float array), and a saved NaN for no NaN (every template
    refused)."""
    try:
        mine = json.loads(json.dumps(mine, allow_nan=True))  # as stored: a tuple is a list
    except (TypeError, ValueError):
        return saved == mine
    return _same_json(saved, mine)


def _same_json(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same_json(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(map(_same_json, a, b))
    if isinstance(a, float):  # x == x fails for a NaN alone (JSON keeps no NaN's sign or payload)
        return (a != a and b != b) or (a == b and math.copysign(1.0, a) == math.copysign(1.0, b))
    return a == b


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")  # a repr's memory address: another in every process


def _same_text(code: Any, mine: Any) -> bool:
    """Whether two stored static values are the same text, memory addresses aside:
    ``functools.partial(<function leaky at 0x7f..>, negative_slope=0.3)`` is the same in
    every process, with ``negative_slope=0.1`` another value (two lambdas read the same)."""
    return _ADDRESS.sub(" at 0x", repr(code)) == _ADDRESS.sub(" at 0x", repr(mine))


_PARTIAL_TEXT = "functools.partial("  # how a functools.partial's repr begins
_MOST_ORDERS = 6  # keywords whose orders are tried (6! = 720 texts); more are compared in the given order


def _is_partial(code: Any, value: Any) -> bool:
    """Whether the saved value (a ``functools.partial``'s text) or the template's is a
    ``functools.partial``: an activation with its arguments (``negative_slope=0.3``), which
    a file stores only as its text and a template restores, so the texts are compared."""
    saved = code.get("repr") if isinstance(code, dict) else None
    return isinstance(value, functools.partial) or (isinstance(saved, str) and saved.startswith(_PARTIAL_TEXT))


def _same_partial(code: Any, value: Any) -> bool:
    """Whether the saved text ``code`` is the template's ``functools.partial`` ``value``:
    the same function (its repr names it, ``<function leaky_relu>``, memory addresses aside,
    so one rebuilt in a new process matches), the same positional arguments and the same
    keyword arguments in any order (``partial(f, a=1, b=2)`` is ``partial(f, b=2, a=1)``).
    A saved registered function or other value is never a partial's."""
    if not (isinstance(value, functools.partial) and isinstance(code, dict) and isinstance(code.get("repr"), str)):
        return False
    keywords = list(value.keywords.items())
    if type(value) is not functools.partial or len(keywords) > _MOST_ORDERS:
        return _same_text(code, {"repr": repr(value)})
    texts = (repr(functools.partial(value.func, *value.args, **dict(order)))
             for order in itertools.permutations(keywords))
    return any(_same_text(code, {"repr": text}) for text in texts)


def _saved_chooses(name: Any) -> frozenset[str]:
    """The static fields the saved class (looked up, never imported) lets a template choose."""
    found = lookup_type(name) if isinstance(name, str) else []
    return frozenset().union(*(template_chooses(c) for c in found if isinstance(c, type)))


def same_classes(spec: Any, template: Any) -> bool:
    """Whether every node ``spec`` stores is of the kind and class of ``template``'s node at
    the same key path, with the same children (static values aside: compared by
    :func:`static_differences`). A template reads a saved tree by key paths, shapes and
    dtypes alone: a saved ``MaxPool2D`` under a template's ``AvgPool2D`` (no leaves, no
    statics) would be read as the template's class."""
    placeholders = jax.tree.map(lambda _: np.zeros((), np.float32), template)  # the structure, no copies
    return _same_nodes(spec, encode(placeholders)[1])


def _same_nodes(saved: Any, mine: Any) -> bool:
    if not (isinstance(saved, dict) and isinstance(mine, dict)):
        return False
    if saved.get("kind") != mine.get("kind") or saved.get("class") != mine.get("class"):
        return False
    a, b = dict(_named_children(saved, "")), dict(_named_children(mine, ""))
    return a.keys() == b.keys() and all(_same_nodes(child, b[name]) for name, child in a.items())


def _named_children(spec: dict[str, Any], path: str) -> list[tuple[str, Any]]:
    """``(name, child spec)`` of a stored node's children: fields, dict keys, NamedTuple
    fields (by their saved names), positions."""
    kind, items = spec.get("kind"), spec.get("items")
    items = items if isinstance(items, list) else []
    if kind in ("module", "dataclass") and isinstance(spec.get("fields"), dict):
        return list(spec["fields"].items())
    if kind == "namedtuple":
        try:
            names = namedtuple_names(spec, path)
        except (SpecError, TypeError, KeyError):
            names = []
        if len(names) == len(items) and all(isinstance(n, str) for n in names):
            return list(zip(names, items))  # pyright: ignore[reportReturnType]
    if kind in ("list", "tuple", "namedtuple"):
        return [(str(i), c) for i, c in enumerate(items)]
    if kind == "dict" and isinstance(spec.get("keys"), list):
        keys = [k[1] if isinstance(k, list) and len(k) == 2 else None for k in spec["keys"]]
        return [(k, c) for k, c in zip(keys, items) if isinstance(k, str)]
    return []


def _has_fields(x: Any) -> bool:
    """A Module or dataclass: a template whose class names its static fields."""
    return isinstance(x, Module) or (dataclasses.is_dataclass(x) and not isinstance(x, type))


def _template_child(template: Any, name: str) -> tuple[bool, Any]:
    """``(found, value)``: the template's child called ``name`` (a field, a dict key as text,
    a NamedTuple field, a position), as the template's leaves are named by key path."""
    if isinstance(template, Module):
        fields = type(template).__ft_fields__
        return (name in fields, template.__dict__.get(name))
    if _is_namedtuple(template):
        found = name in type(template)._fields
        return (found, getattr(template, name) if found else None)
    if dataclasses.is_dataclass(template) and not isinstance(template, type):
        found = name in {f.name for f in dataclasses.fields(template)}
        return (found, getattr(template, name) if found else None)
    if isinstance(template, (list, tuple)):
        found = name.isdigit() and int(name) < len(template)
        return (found, template[int(name)] if found else None)
    if isinstance(template, dict):
        by_name = {str(k): v for k, v in template.items()}
        return (name in by_name, by_name.get(name))
    return (False, None)


def _stored_before(code: Any, mine: dict[str, Any], value: Any) -> bool:
    """Whether ``code``, a file's JSON number, is how files written before NumPy scalars and
    Enum members had codes of their own stored ``value`` (an ``np.float64``, an ``IntEnum``
    member): the same value, not a difference."""
    return isinstance(code, dict) and "json" in code and ("numpy" in mine or "enum" in mine or "flag" in mine) \
        and code["json"] == value


def _shown(code: Any) -> str:
    """A stored static value as the user wrote it (``relu``, ``4``, ``(1, 2)``)."""
    if not isinstance(code, dict) or len(code) != 1:
        return repr(code)
    (tag, value), = code.items()
    if tag == "tuple" and isinstance(value, list):
        return "(" + ", ".join(_shown(v) for v in value) + ("," if len(value) == 1 else "") + ")"
    if tag == "record" and isinstance(value, list) and len(value) == 2 and isinstance(value[1], dict):
        return f"{str(value[0]).rsplit('.', 1)[-1]}(" + ", ".join(f"{k}={_shown(v)}" for k, v in value[1].items()) + ")"
    if tag == "hf_config":
        return "HFConfig(...)"
    if tag == "numpy" and isinstance(value, list) and len(value) == 2:
        return f"np.{value[0]}({value[1]!r})"
    if tag == "enum" and isinstance(value, list) and len(value) == 2:
        return f"{str(value[0]).rsplit('.', 1)[-1]}.{value[1]}"
    if tag == "flag" and isinstance(value, list) and len(value) == 2:
        return f"{str(value[0]).rsplit('.', 1)[-1]}({value[1]!r})"
    if tag == "module" and isinstance(value, dict) and isinstance(value.get("static"), dict):
        fields = ", ".join(f"{k}={_shown(v)}" for k, v in value["static"].items())
        return f"{str(value.get('class')).rsplit('.', 1)[-1]}({fields})"
    if tag == "repr":  # a text only a template gives back: without its memory addresses (another per process)
        return _ADDRESS.sub("", str(value))
    if tag == "function" and isinstance(value, str):
        return shown(value)
    return repr(value) if tag == "json" else str(value)
