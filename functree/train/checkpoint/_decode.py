"""A tree's JSON description read back (the inverse of :func:`._treespec.encode`), each
class it names looked up, never imported.

The spec is data: decoding looks every name up in the registry of
:mod:`functree.train.checkpoint._registry` (functree's types, optax states, registered classes and
functions, Module subclasses defined in this process) and never imports, calls or
constructs anything else. Objects are built with ``object.__new__`` and their fields set;
restored Modules go through the same static-field checks as constructed ones. Any
malformed spec raises :class:`SpecError` naming the key path and the problem; a class
edited since the save raises :class:`ClassEditedError`, a name several live classes share
:class:`AmbiguousClassError`.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from functree._compat import weakly_typed
from functree._module import Module, added_static, check_static, derive_added
from functree._paths import KeyPath
from functree._tree import child_name
from functree.hf._config import HFConfig
from functree.train.checkpoint._errors import MALFORMED, SpecError
from functree.train.checkpoint._function_code import same_function, shown, with_code
from functree.train.checkpoint._registry import (
    current_definitions,
    lookup_function,
    lookup_type,
    type_name,
)

__all__ = ["decode", "decode_leaf", "dict_entries", "EditedReader", "ClassEditedError", "AmbiguousClassError",
           "StaticNeedsTemplateError",
           "leaf_specs", "check_names", "namedtuple_names", "safe_dtype", "numpy_scalar", "flag_bits",
           "NUMPY_INT_KEYS"]

NO_TEMPLATE = """\
Cannot rebuild {what} at {path!r} without a template: {why}.
A checkpoint only names types and functions; it never imports or runs them. Either
register them before loading, or load with a template built the same way:

    ft.train.register(MyClass)                        # or register(my_function)
    ft.train.load(path, template=model)               # or manager.restore(template=model,
                                                      #     opt_state_template=opt_state)"""

OPAQUE_NO_TEMPLATE = """\
Cannot rebuild a node at {path!r} without a template: {name} is registered with JAX by \
functions of its own (jax.tree_util.register_pytree_node / register_pytree_with_keys), \
not a Module, dataclass, NamedTuple, dict, list or tuple. Its children were saved by key \
path, but only its own unflatten function can build it, and a checkpoint never runs one \
because a file names it. Load with a template built the same way, which gives the saved \
arrays its structure:

    wrong:  ft.train.load(path)
    right:  ft.train.load(path, template=tree)          # or manager.restore(template=model)"""

STORED_AS_TEXT = """\
Cannot rebuild a static value at {path!r} without a template: it was stored as its text \
{text}, since its class had no registered name when it was saved (or an older release \
stored it so: before 2026-11-29, a leafless Module, an Enum member or a NumPy scalar). \
Text is never run, so registering the class now cannot rebuild this checkpoint's value; \
a template built the same way gives it back, and a class registered before saving is \
stored as data:

    wrong:  ft.train.register(MyClass); ft.train.load(path)       # the value is text
    right:  ft.train.load(path, template=model)                   # or manager.restore(template=model)
       or:  ft.train.register(MyClass); ft.train.save(path, model)   # then it loads without one"""

MAIN_CLASS = """\
Cannot rebuild a node at {path!r} without a template: its class was saved as {name!r}, \
a class defined in `__main__` (a notebook, or a script run directly), and no class is \
registered under that name now. Register the class under the stored name: this works in \
the notebook and also once the class is imported from a module (whose name it then has):

    wrong:  ft.train.register({short})                         # registers it as "<module>.{short}"
    right:  ft.train.register({short}, name="{name}")
       or:  ft.train.load(path, template=model)           # a model built the same way"""

CLASS_EDITED = """\
The class `{name}` at {path!r} was edited since this checkpoint was saved: {what}{how}. The \
file is intact (every step saved before the edit reads the same way); it holds the class as \
it was. Either load with a template of the class as it is now, which takes the saved arrays \
by their names (this works where the arrays are the same ones: a static field added), or \
define the class again as it was saved, load, and build the new one from it:

    wrong:  ft.train.load(path)                   # {short} as edited: fields {now}
    right:  ft.train.load(path, template=model)   # model = {short}(...) built now
       or:  class {short}(...): ...               # its fields {saved} as saved; then ft.train.load(path)"""

AMBIGUOUS = "{count} different Module classes named {name!r} are defined in this process"

AMBIGUOUS_ENUM = "{count} different Enum classes named {name!r} are defined in this process"

_PRNG_IMPLS = ("threefry2x32", "rbg", "unsafe_rbg")

_PYTHON_SCALARS = {"bool": bool, "int": int, "float": float, "complex": complex}

# The dtype kinds the writer stores each Python scalar as (np.asarray: bool, int64, float64, complex128).
_PYTHON_KINDS = {"bool": "b", "int": "iu", "float": "f", "complex": "c"}

_DICT_KEYS = {"int": int, "str": str}

_BOOL_KEYS = {"True": True, "False": False}

NUMPY_INT_KEYS = frozenset(np.dtype(t).name for t in (np.int8, np.int16, np.int32, np.int64,
                                                       np.uint8, np.uint16, np.uint32, np.uint64))


class AmbiguousClassError(SpecError):
    """A stored class name that several live classes share, none of them bound at that name
    (a class made by a function called twice): only a template says which is meant."""


class ClassEditedError(SpecError):
    """A stored Module, dataclass or NamedTuple whose class was edited since the save (its
    fields are not the class's now): the file is intact, a template of the class as it is
    now reads it (:data:`CLASS_EDITED`)."""


class StaticNeedsTemplateError(SpecError):
    """A stored static value that only a template gives back: a function or type not
    registered (a function defined in a script), a value stored as its text (a
    ``functools.partial``, a lambda). The file is intact; a template holding the value
    reads it (:data:`NO_TEMPLATE`, :data:`STORED_AS_TEXT`)."""


# Reads a saved Module another way where it does not decode by name (its class, or one
# inside it, edited since the save or shared by several live classes, or a static value in
# it that needs a template: StaticNeedsTemplateError): ``reader(spec,
# arrays, path)`` returns ``(True, value)``, or ``(False, None)`` for the error to stand (a
# checkpoint reads a Module of its model's class in ``extra`` with the model as its
# template, as the model is, where it fits: _extra._like_model).
EditedReader = Callable[[dict[str, Any], dict[str, Any], str], tuple[bool, Any]]


def safe_dtype(name: Any, path: str) -> np.dtype:
    if not isinstance(name, str):
        raise SpecError(MALFORMED.format(path=path, why=f"dtype {name!r} is not a string"))
    try:
        dtype = np.dtype(jnp.dtype(name))
    except TypeError:
        raise SpecError(MALFORMED.format(path=path, why=f"unknown dtype {name!r}")) from None
    if dtype.hasobject or dtype.fields is not None or dtype.kind not in "biufcV":
        raise SpecError(MALFORMED.format(path=path, why=f"dtype {name!r} is not a numeric dtype"))
    return dtype


def _decode_static(code: Any, path: str) -> Any:
    if not isinstance(code, dict) or len(code) != 1:
        raise SpecError(MALFORMED.format(path=path, why=f"static value {code!r} is not encoded"))
    (tag, value), = code.items()
    if tag == "json":
        if value is not None and not isinstance(value, (bool, int, float, str)):
            why = f"static value {value!r} is not a JSON scalar"
            raise SpecError(MALFORMED.format(path=path, why=why))
        return value
    if tag == "tuple" and isinstance(value, list):
        return tuple(_decode_static(c, path) for c in value)
    if tag == "key_path" and isinstance(value, str):
        try:
            return KeyPath.parse(value)
        except (ValueError, TypeError) as e:
            raise SpecError(MALFORMED.format(path=path, why=f"key path {value[:200]!r}: {e}")) from None
    if tag == "dtype":
        return safe_dtype(value, path)
    if tag == "hf_config" and isinstance(value, list) and len(value) == 2 and all(isinstance(v, dict) for v in value):
        try:
            return HFConfig(value[0], value[1] or None)
        except TypeError as e:
            raise SpecError(MALFORMED.format(path=path, why=str(e).splitlines()[0])) from None
    if tag == "record" and isinstance(value, list) and len(value) == 2 and isinstance(value[1], dict):
        return _static_record(value[0], value[1], path)
    if tag == "scalar_type":
        return safe_dtype(value, path).type
    if tag == "numpy" and isinstance(value, list) and len(value) == 2:
        return numpy_scalar(value[0], value[1], path)
    if tag == "enum" and isinstance(value, list) and len(value) == 2 and all(isinstance(v, str) for v in value):
        return _enum_member(value[0], value[1], path)
    if tag == "flag" and isinstance(value, list) and len(value) == 2 and isinstance(value[0], str):
        return _flag_combination(value[0], value[1], path)
    if tag == "module" and isinstance(value, dict) and value.get("kind") == "module":
        return _decode(value, {}, path)  # no arrays: a leaf in it is damage
    if tag == "function" and isinstance(value, str):
        base = value.partition("@")[0]  # a lambda's or local function's code digest (_function_code.py)
        fn = lookup_function(value) or lookup_function(base)
        if fn is None:
            why = f"the function {shown(value)!r} is not registered"
            raise StaticNeedsTemplateError(NO_TEMPLATE.format(what="a static value", path=path, why=why))
        if not same_function(value, with_code(fn, base)):
            why = f"the function registered as {base!r} has other code than the saved one ({shown(value)})"
            raise StaticNeedsTemplateError(NO_TEMPLATE.format(what="a static value", path=path, why=why))
        return fn
    if tag == "repr":
        raise StaticNeedsTemplateError(STORED_AS_TEXT.format(path=path, text=str(value)[:200]))
    raise SpecError(MALFORMED.format(path=path, why=f"unknown static encoding {tag!r}"))


def numpy_scalar(name: Any, plain: Any, path: str) -> Any:
    """The NumPy scalar of dtype ``name`` and JSON value ``plain`` (a stored static value)."""
    dtype = safe_dtype(name, path)
    kind = "f" if dtype.kind == "V" else dtype.kind  # bfloat16 and the float8 types
    value = _plain_number(plain, kind, dtype)
    if value is None:
        raise SpecError(MALFORMED.format(path=path, why=f"{dtype.name} scalar stored as {str(plain)[:100]}"))
    try:
        with np.errstate(over="raise"):  # a float beyond the dtype's range: not what was saved
            return dtype.type(value)
    except FloatingPointError:
        raise SpecError(MALFORMED.format(path=path, why=f"{dtype.name} scalar stored as {str(plain)[:100]}")) from None


def _plain_number(plain: Any, kind: str, dtype: np.dtype) -> bool | int | float | complex | None:
    """The Python number a stored NumPy scalar of ``kind`` gives, or None where the JSON
    value is not one of its kind (or, for an integer, not in the dtype's range)."""
    def number(v: Any) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool)
    if kind == "b" and isinstance(plain, bool):
        return plain
    if kind in "iu" and number(plain) and isinstance(plain, int):
        return plain if int(np.iinfo(dtype).min) <= plain <= int(np.iinfo(dtype).max) else None
    if kind == "f" and number(plain):
        return plain
    if kind == "c" and isinstance(plain, list) and len(plain) == 2 and all(number(v) for v in plain):
        return complex(plain[0], plain[1])
    return None


def flag_bits(cls: type[enum.Enum], bits: int) -> bool:
    """Whether ``bits`` are a combination of ``cls``'s members' bits: a Flag with the
    ``KEEP`` boundary (an IntFlag, ``re.RegexFlag``) keeps bits outside them silently."""
    values = [m.value for m in cls.__members__.values()]
    if not all(type(v) is int for v in values):
        return False
    every = 0
    for v in values:
        every |= v
    return bits >= 0 and not bits & ~every


def _enum_classes(name: str) -> list[type]:
    """The Enum classes a stored name may mean: a registered one, else those defined in this
    process (never imported: a file names them, it does not load them)."""
    registered = [c for c in lookup_type(name) if issubclass(c, enum.Enum)]
    if registered:
        return registered
    found, stack, seen = [], list(enum.Enum.__subclasses__()), set()
    while stack:
        cls = stack.pop()
        if id(cls) not in seen:
            seen.add(id(cls))
            found += [cls] if type_name(cls) == name else []
            stack.extend(cls.__subclasses__())
    return current_definitions(found)  # a re-run notebook cell's class: the one bound now


def _enum_member(name: str, member: str, path: str) -> Any:
    cls = _one_class(_enum_classes(name), name, path, "a static value", AMBIGUOUS_ENUM,
                     f"the Enum {name[:200]} is not registered or defined in this process")
    value = cls.__members__.get(member)
    if value is None:
        why = f"the Enum {cls.__name__} has no member {member[:100]!r}"
        raise SpecError(MALFORMED.format(path=path, why=why))
    return value


def _flag_combination(name: str, bits: Any, path: str) -> Any:
    """The Flag combination ``cls(bits)`` of a stored class name and integer value: the class
    resolved as an Enum member's is, the bits checked against its members' (never a value
    the class does not define)."""
    cls = _one_class(_enum_classes(name), name, path, "a static value", AMBIGUOUS_ENUM,
                     f"the Enum {name[:200]} is not registered or defined in this process")
    if not issubclass(cls, enum.Flag):
        raise SpecError(MALFORMED.format(path=path, why=f"the Enum {cls.__name__} is not a Flag"))
    if not cls.__members__:  # enum.Flag itself: no combination to rebuild (cls(0) raises TypeError)
        raise SpecError(MALFORMED.format(path=path, why=f"the Flag {cls.__name__} has no members"))
    if type(bits) is not int or not flag_bits(cls, bits):
        members = " | ".join(f"{k}={m.value!r}" for k, m in cls.__members__.items())[:200]
        why = (f"{repr(bits)[:50]} is not an int" if type(bits) is not int else
               f"{bits} is not a combination of the {cls.__name__} flags ({members})")
        raise SpecError(MALFORMED.format(path=path, why=why))
    return cls(bits)


def _dict_key_value(ktype: Any, text: Any, path: str) -> Any:
    """The key :func:`_dict_key` stored as ``[ktype, text]``."""
    if isinstance(text, str) and ktype in _DICT_KEYS:
        return _DICT_KEYS[ktype](text)
    if isinstance(text, str) and ktype == "bool" and text in _BOOL_KEYS:
        return _BOOL_KEYS[text]
    if isinstance(text, str) and ktype in NUMPY_INT_KEYS:
        return np.dtype(ktype).type(int(text))  # out of range: OverflowError, reported as damage
    raise SpecError(MALFORMED.format(path=path, why=f"dict key {[ktype, text]!r}"))


def _static_record(name: Any, fields: dict[str, Any], path: str) -> Any:
    """A stored static record: its registered class (never imported) built from its fields by
    name, each a JSON scalar or a tuple of numbers; anything else is refused, never called.
    The class's own checks (``__post_init__``) run on the values."""
    found = [c for c in lookup_type(name) if dataclasses.is_dataclass(c)] if isinstance(name, str) else []
    if not found:
        why = f"{str(name)[:200]} is not a registered type"
        raise StaticNeedsTemplateError(NO_TEMPLATE.format(what="a static value", path=path, why=why))
    cls = found[0]
    known = {f.name for f in dataclasses.fields(cls) if f.init}
    if not set(fields) <= known:
        raise SpecError(MALFORMED.format(path=path, why=f"{cls.__name__} has no field {sorted(set(fields) - known)}"))
    values = {field: _decode_static(code, path) for field, code in fields.items()}
    for field, value in values.items():
        plain = value is None or isinstance(value, (bool, int, float, str))
        if not plain and not (isinstance(value, tuple) and all(isinstance(v, (int, float)) for v in value)):
            why = f"{cls.__name__}.{field} is {value!r}, not a number or a name"
            raise SpecError(MALFORMED.format(path=path, why=why))
    try:
        return cls(**values)
    except (TypeError, ValueError) as e:
        raise SpecError(MALFORMED.format(path=path, why=str(e).splitlines()[0])) from None


def decode_leaf(spec: dict[str, Any], arrays: dict[str, Any], path: str = "") -> Any:
    if spec.get("kind") == "function":  # looked up among functree's and registered functions, nothing imported
        return _decode_static({"function": spec.get("name")}, path)
    key = spec.get("key")
    if not isinstance(key, str) or key not in arrays:
        raise SpecError(MALFORMED.format(path=path, why=f"no stored array named {key!r}"))
    x = arrays[key]
    if "python" in spec:  # (a list or an object there was a bare "unhashable type")
        cast = _PYTHON_SCALARS.get(spec["python"]) if isinstance(spec["python"], str) else None
        if cast is None or np.ndim(x) != 0:
            why = f"a Python {spec['python']!r} scalar stored as shape {np.shape(x)}"
            raise SpecError(MALFORMED.format(path=path, why=why))
        kind = np.asarray(x).dtype.kind
        if kind not in _PYTHON_KINDS[spec["python"]]:  # a tag never converts: 0.75 tagged "int" is damage, not 0
            why = f"a Python {spec['python']!r} scalar stored as dtype {np.asarray(x).dtype}"
            raise SpecError(MALFORMED.format(path=path, why=why))
        return cast(np.asarray(x))
    if "prng" in spec:
        if spec["prng"] not in _PRNG_IMPLS:
            raise SpecError(MALFORMED.format(path=path, why=f"unknown PRNG {spec['prng']!r}"))
        return jax.random.wrap_key_data(jnp.asarray(x), impl=spec["prng"])
    if spec.get("numpy_scalar"):
        return np.asarray(x)[()]
    if spec.get("weak") is True and isinstance(x, jax.Array):
        return weakly_typed(x)  # (jnp.asarray(0.5): read back strong, bfloat16_x * scale became float32)
    return x




def _one_class(found: list[Any], name: str, path: str, what: str, ambiguous: str, missing: str) -> Any:
    """The one class a checkpoint's ``name`` resolves to (``found``: registered or defined in
    this process), or the error naming why not: several, a ``__main__`` class not defined
    now, or none."""
    if len(found) > 1:
        why = ambiguous.format(count=len(found), name=name[:200])
        raise AmbiguousClassError(NO_TEMPLATE.format(what=what, path=path, why=why))
    if not found and name.startswith("__main__."):
        raise SpecError(MAIN_CLASS.format(path=path, name=name[:200], short=name[:200].rsplit(".", 1)[1]))
    if not found:
        raise SpecError(NO_TEMPLATE.format(what=what, path=path, why=missing))
    return found[0]


def _class(spec: dict[str, Any], path: str, kind: str) -> Any:
    name = spec.get("class")
    if not isinstance(name, str):
        raise SpecError(MALFORMED.format(path=path, why=f"class name {name!r} is not a string"))
    cls = _one_class(lookup_type(name), name, path, "a node", AMBIGUOUS, f"{name[:200]} is not a registered type")
    fits = {
        "module": issubclass(cls, Module),
        "namedtuple": issubclass(cls, tuple) and hasattr(cls, "_fields"),
        "dataclass": dataclasses.is_dataclass(cls) and not issubclass(cls, Module),
    }[kind]
    if not fits:
        why = f"{name} is stored as a {kind} but is a {cls.__name__} class"
        raise SpecError(MALFORMED.format(path=path, why=why))
    return cls


def _check_names(cls: type, given: list[str], expected: list[str], path: str, filled: tuple[str, ...] = ()) -> None:
    """A class's fields ``expected``, the checkpoint's ``given`` (with ``filled``: fields the
    class gained since, at their defaults): a name given twice is damage, other differences
    are an edit of the class since the save."""
    if len(set(given)) != len(given):
        why = f"{cls.__name__} has fields {sorted(expected)}, the checkpoint gives {sorted(given)}"
        raise SpecError(MALFORMED.format(path=path, why=why))
    if sorted(given) != sorted(expected):
        saved = sorted(set(given) - set(filled))
        what = f"{cls.__name__} has fields {sorted(expected)} now, the checkpoint's had {saved}"
        raise _edited(cls, path, what, sorted(expected), saved, _how(added=set(expected) - set(given),
                                                                      removed=set(given) - set(expected)))


def _how(**changes: set[str]) -> str:
    """`` (added: ['c']; removed: ['scale'])``: the non-empty name sets, or nothing."""
    parts = [f"{k.replace('_', ' ')}: {sorted(v)}" for k, v in changes.items() if v]
    return f" ({'; '.join(parts)})" if parts else ""


def _edited(cls: type, path: str, what: str, now: list[str], saved: list[str], how: str) -> ClassEditedError:
    return ClassEditedError(CLASS_EDITED.format(name=type_name(cls), path=path, what=what, how=how, short=cls.__name__,
                                         now=now, saved=saved))


def _items(spec: dict[str, Any], key: str, kind: type) -> Any:
    value = spec.get(key)
    if not isinstance(value, kind):
        raise TypeError(f"{key!r} must be a {kind.__name__}, got {type(value).__name__}")
    return value


# A type's opt-in: ``{field: function}``, each function taking the leaf as an older release
# saved it and giving it in today's layout (the learning context's counters, four words
# before samples_seen took two). Read with a template or without.
UPGRADE_ON_RESTORE = "__ft_upgrade_on_restore__"


def _decode_module(spec: dict[str, Any], arrays: dict[str, Any], path: str, edited: EditedReader | None) -> Any:
    cls = _class(spec, path, "module")
    static, fields = _items(spec, "static", dict), _items(spec, "fields", dict)
    values = added_static(cls, {**static, **fields})  # a field the class gained since, at its default
    _check_names(cls, [*static, *values, *fields], list(cls.__ft_fields__), path, tuple(values))
    if sorted([*static, *(n for n in values if n in cls.__ft_static__)]) != sorted(cls.__ft_static__):
        now, saved = sorted(cls.__ft_static__), sorted(static)
        what = f"{cls.__name__}'s static fields are {now} now, the checkpoint's were {saved}"
        how = _how(now_static=set(now) - set(saved) - set(values), no_longer_static=set(saved) - set(now))
        raise _edited(cls, path, what, list(cls.__ft_fields__), sorted([*static, *fields]), how)
    for n, c in static.items():
        values[n] = _decode_static(c, child_name(path, n))
        try:
            check_static(cls, n, values[n])
        except TypeError as e:
            raise SpecError(MALFORMED.format(path=child_name(path, n), why=str(e))) from None
    upgrade = getattr(cls, UPGRADE_ON_RESTORE, {})
    for n, s in fields.items():
        values[n] = _decode(s, arrays, child_name(path, n), edited)
        values[n] = upgrade[n](values[n]) if n in upgrade else values[n]
    out = object.__new__(cls)
    out.__dict__.update({n: values[n] for n in cls.__ft_fields__})
    derive_added(out, [n for n in cls.__ft_static__ if n not in static])
    return out


def _decode_dataclass(spec: dict[str, Any], arrays: dict[str, Any], path: str, edited: EditedReader | None) -> Any:
    cls = _class(spec, path, "dataclass")
    static, fields = _items(spec, "static", dict), _items(spec, "fields", dict)
    _check_names(cls, [*static, *fields], [f.name for f in dataclasses.fields(cls)], path)
    out = object.__new__(cls)
    for n, c in static.items():
        object.__setattr__(out, n, _decode_static(c, child_name(path, n)))
    upgrade = getattr(cls, UPGRADE_ON_RESTORE, {})
    for n, s in fields.items():
        value = _decode(s, arrays, child_name(path, n), edited)
        object.__setattr__(out, n, upgrade[n](value) if n in upgrade else value)
    return out


def namedtuple_names(spec: dict[str, Any], path: str) -> list[str | None]:
    """The field name of each of a stored NamedTuple's items: stored (``names``) since
    2026-11-29; in files written before, read from the stored keys of the leaves under each
    item (``stats.mean`` under ``stats``), None for an item without one (a None)."""
    items, stored = _items(spec, "items", list), spec.get("names")
    if isinstance(stored, list) and len(stored) == len(items) and all(isinstance(n, str) for n in stored):
        return list(stored)
    prefix = path + "." if path else ""
    names: list[str | None] = []
    for i, child in enumerate(items):
        keys = [s["key"] for _, s in leaf_specs(child, child_name(path, i))]
        names.append(next((k[len(prefix):].split(".")[0] for k in keys if k.startswith(prefix)), None))
    return names


def _unsuffixed(name: str, fields: list[str]) -> str:
    """A name read from a stored key, without the ``_`` the writer appends to a key each time
    it is already taken (a dict key ``"a.b"`` beside a field ``a.b``: ``a_``; two such
    keys: ``a__``) where that gives a field's name."""
    bare = name
    while bare not in fields and bare.endswith("_"):
        bare = bare[:-1]
    return bare if bare in fields else name


def _decode_namedtuple(spec: dict[str, Any], arrays: dict[str, Any], path: str, edited: EditedReader | None) -> Any:
    """A NamedTuple, each item put in the field it was saved from: a class edited since the
    save (fields reordered) still gets its values by name, and one whose field names
    differ (renamed, added, removed) is refused, never filled by position."""
    cls = _class(spec, path, "namedtuple")
    specs, fields = _items(spec, "items", list), list(cls._fields)
    names = namedtuple_names(spec, path)
    unused = iter([f for f in fields if f not in names])
    names = [next(unused, None) if n is None else n for n in names]  # an item without a leaf: the unnamed fields in order
    if any(n is None for n in names):  # more items than fields: nothing to name them by
        what = f"{cls.__name__} has {len(fields)} fields {fields} now, the checkpoint's had {len(specs)}"
        raise _edited(cls, path, what, fields, [str(n) for n in names], "")
    names = [_unsuffixed(str(n), fields) for n in names]
    _check_names(cls, names, fields, path)
    by_name = dict(zip(names, specs))
    return tuple.__new__(cls, [_decode(by_name[f], arrays, child_name(path, f), edited) for f in fields])


def _decode_node(spec: Any, arrays: dict[str, Any], path: str, edited: EditedReader | None) -> Any:
    if not isinstance(spec, dict):
        raise SpecError(MALFORMED.format(path=path, why=f"a node is {type(spec).__name__}"))
    kind = spec.get("kind")
    if kind == "none":
        return None
    if kind == "leaf":
        return decode_leaf(spec, arrays, path)
    if kind in ("list", "tuple"):
        items = [_decode(s, arrays, child_name(path, i), edited) for i, s in enumerate(_items(spec, "items", list))]
        return items if kind == "list" else tuple(items)
    if kind == "dict":
        return {key: _decode(s, arrays, at, edited) for key, at, s in _dict_entries(spec, path)}
    if kind == "namedtuple":
        return _decode_namedtuple(spec, arrays, path, edited)
    if kind == "function":
        return decode_leaf(spec, arrays, path)
    if kind == "module":
        try:
            return _decode_module(spec, arrays, path, edited)
        except (ClassEditedError, AmbiguousClassError, StaticNeedsTemplateError):  # it does not decode alone
            found, value = edited(spec, arrays, path) if edited is not None else (False, None)
            if not found:
                raise
            return value
    if kind == "dataclass":
        return _decode_dataclass(spec, arrays, path, edited)
    if kind == "opaque":
        raise SpecError(OPAQUE_NO_TEMPLATE.format(path=path, name=str(spec.get("type"))[:200]))
    raise SpecError(MALFORMED.format(path=path, why=f"unknown node kind {str(kind)[:100]!r}"))


def _dict_entries(spec: dict[str, Any], path: str) -> list[tuple[Any, str, Any]]:
    """``(key, key path, child spec)`` of each entry of a stored dict, in the saved order."""
    keys, specs = _items(spec, "keys", list), _items(spec, "items", list)
    if len(keys) != len(specs):
        raise SpecError(MALFORMED.format(path=path, why=f"{len(keys)} keys for {len(specs)} items"))
    out, seen = [], set()
    for (ktype, k), s in zip(keys, specs):
        key = _dict_key_value(ktype, k, path)
        if key in seen:  # a file functree wrote never repeats a key: one entry would be dropped
            raise SpecError(MALFORMED.format(path=path, why=f"the key {key!r} appears twice"))
        seen.add(key)
        out.append((key, child_name(path, k), s))
    return out


def dict_entries(spec: dict[str, Any], path: str = "") -> list[tuple[Any, str, Any]]:
    """``(key, key path, child spec)`` of each entry of a stored dict (``spec`` of kind
    ``"dict"``), in the saved order: a reader of some entries alone. Damage (keys and items
    not paired, a key twice or of no stored type) raises :class:`SpecError` naming ``path``.

    Example:
      >>> import jax.numpy as jnp
      >>> from functree.train.checkpoint._treespec import encode
      >>> arrays, spec = encode({"w": jnp.ones(2), "n": 3})
      >>> [(key, at) for key, at, _ in dict_entries(spec, "extra")]
      [('w', 'extra.w'), ('n', 'extra.n')]
    """
    return _recast(lambda: _dict_entries(spec, path), path)

# The Python errors a damaged description raises in a reader (a key missing, a list where a
# dict was): each is raised as the SpecError naming the key path.
_DAMAGE = (KeyError, TypeError, ValueError, AttributeError, IndexError, OverflowError, RecursionError)


def _recast(read: Callable[[], Any], path: str) -> Any:
    """``read()``, a damaged description's Python error (:data:`_DAMAGE`) raised as the
    :class:`SpecError` naming ``path``."""
    try:
        return read()
    except SpecError:
        raise
    except _DAMAGE as e:
        raise SpecError(MALFORMED.format(path=path, why=f"{type(e).__name__}: {str(e)[:200]}")) from None


def _decode(spec: Any, arrays: dict[str, Any], path: str, edited: EditedReader | None = None) -> Any:
    try:  # not _recast: one frame a node (a deep tree)
        return _decode_node(spec, arrays, path, edited)
    except SpecError:
        raise
    except _DAMAGE as e:
        raise SpecError(MALFORMED.format(path=path, why=f"{type(e).__name__}: {str(e)[:200]}")) from None


def decode(spec: dict[str, Any], arrays: dict[str, Any], path: str = "", *,
           edited: EditedReader | None = None) -> Any:
    """Rebuild the tree described by ``spec`` from ``arrays`` (inverse of :func:`encode`).

    Only registered types and functions are used (see :func:`functree.train.register`);
    anything else, and any damage to ``spec``, raises :class:`SpecError`. ``edited``
    (:data:`EditedReader`) may read a Module another way (with a template) where its class,
    or one inside it, was edited since the save (:class:`ClassEditedError`) or a static value
    in it needs a template (:class:`StaticNeedsTemplateError`).
    """
    return _decode(spec, arrays, path, edited)


def leaf_specs(spec: Any, path: str = "") -> list[tuple[str, dict[str, Any]]]:
    """``(key path, node)`` of every ``leaf`` node of ``spec``, a function at a leaf
    included (its ``key`` names no stored array; :class:`SpecError` on a malformed one)."""
    out, stack = [], [(path, spec)]
    while stack:
        at, s = stack.pop()
        if not isinstance(s, dict):
            raise SpecError(MALFORMED.format(path=at, why=f"a node is {type(s).__name__}"))
        if s.get("kind") in ("leaf", "function"):
            if not isinstance(s.get("key"), str):
                raise SpecError(MALFORMED.format(path=at, why=f"leaf key {s.get('key')!r}"))
            out.append((at, s))
        items, fields, keys = s.get("items", []), s.get("fields", {}), s.get("keys")
        if not isinstance(items, list) or not isinstance(fields, dict):
            raise SpecError(MALFORMED.format(path=at, why="items or fields of the wrong type"))
        names = [k[-1] if isinstance(k, list) and k else i for i, k in enumerate(keys)] \
            if isinstance(keys, list) and len(keys) == len(items) else range(len(items))
        stored = s.get("names")  # an opaque node's children, by key path
        if isinstance(stored, list) and len(stored) == len(items) and all(isinstance(n, str) for n in stored):
            names = stored
        stack.extend((child_name(at, n), c) for n, c in [*zip(names, items), *fields.items()])
    return out


def check_names(spec: Any, arrays: dict[str, Any]) -> None:
    """Every stored array named by exactly one leaf of ``spec``, else :class:`SpecError`:
    an array named at two leaves would load as one buffer at both."""
    named: dict[str, str] = {}
    for path, leaf in reversed(leaf_specs(spec)):
        if leaf["key"] in named:
            why = f"it names the stored array {leaf['key']!r}, which {named[leaf['key']]!r} names too"
            raise SpecError(MALFORMED.format(path=path, why=why))
        named[leaf["key"]] = path
    unnamed = sorted(set(arrays) - set(named))
    if unnamed:
        why = f"the stored arrays {unnamed[:5]} are named by no leaf"
        raise SpecError(MALFORMED.format(path=unnamed[0], why=why))
