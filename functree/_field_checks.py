"""Checks of a Module's field declarations and field values that JAX would otherwise
reject late, or that would be ignored silently.

* ``ft.field`` takes its own keywords and the user's metadata (``decay=False``); the
  options of ``dataclasses.field`` and ``eqx.field`` that functree does not implement
  (``converter=``, ``init=``, ``repr=`` ...) are refused by name instead of being stored as
  metadata nobody reads.
* A field hidden by a property (or another data descriptor) of the same name, in its class
  or in a base or subclass: ``model.name`` would run the property and never read the
  value the model holds, trains and saves; it is refused at class definition. So is a field
  named like a method of ``ft.Module`` itself (``replace``): it would hide the method that
  ``ft.set`` and the user call.
* A dict field whose keys cannot be sorted together (``{0: ..., "aux": ...}``): JAX sorts a
  dict's keys to flatten it, so every later use of the model would fail inside JAX,
  naming no field; it is refused at construction.
"""

from __future__ import annotations

import collections
import dataclasses
import inspect
from typing import Any

__all__ = ["FIELD_OPTION", "KW_ONLY_MARKER", "MIXED_DICT_KEYS", "HIDDEN_FIELD", "MODULE_METHOD_FIELD",
           "INIT_VAR", "refuse_field_options", "refuse_kw_only_marker", "refuse_init_vars", "refuse_hidden_fields",
           "check_dict_keys"]

FIELD_OPTION = """\
ft.field does not take {name}= (an option of dataclasses.field / eqx.field): functree \
would ignore it silently. {why}

    wrong:  {wrong}
    right:  {right}
"""

# keyword -> (why, wrong, right): the options of dataclasses.field and eqx.field that a
# Module's field cannot have (every field is an __init__ argument and a tree child or
# static value, shown in the repr; modules compare by identity).
_OPTIONS = {
    "converter": (
        "Convert the value in __post_init__ (it runs after every construction, as a dataclass's).",
        "w: jax.Array = ft.field(converter=jnp.asarray)",
        "def __post_init__(self): self.w = jnp.asarray(self.w)",
    ),
    "init": (
        "Every field is an __init__ argument (JAX rebuilds a module from all its fields); "
        "set a derived field in __post_init__ or in your own __init__.",
        "n: int = ft.field(static=True, init=False, default=3)",
        "n: int = ft.field(static=True, default=3)      # and def __post_init__(self): self.n = ...",
    ),
    "repr": (
        "Every field is shown in the module's repr.",
        "secret: str = ft.field(static=True, repr=False)",
        "secret: str = ft.field(static=True)",
    ),
    "hash": (
        "Modules compare and hash by identity; a static field's value is hashed as part of the tree definition.",
        "n: int = ft.field(static=True, hash=False)",
        "n: int = ft.field(static=True)",
    ),
    "compare": (
        "Modules compare by identity; a static field's value is compared as part of the tree definition.",
        "n: int = ft.field(static=True, compare=False)",
        "n: int = ft.field(static=True)",
    ),
    "kw_only": (
        "Fields are taken positionally or by name; pass it by name (a field without a default after "
        "one with a default is keyword-only already).",
        "n: int = ft.field(static=True, kw_only=True, default=1)",
        "n: int = ft.field(static=True, default=1)      # Cls(w, n=2)",
    ),
    "metadata": (
        "ft.field's other keywords are the metadata.",
        'w: jax.Array = ft.field(metadata={"decay": False})',
        "w: jax.Array = ft.field(decay=False)",
    ),
}


def refuse_field_options(metadata: dict[str, Any]) -> None:
    """Raise :data:`FIELD_OPTION` for the first keyword of ``metadata`` that is an option
    of ``dataclasses.field`` or ``eqx.field`` (not metadata).

    Example:
      >>> refuse_field_options({"decay": False})
      >>> try:
      ...     refuse_field_options({"repr": False})
      ... except TypeError as e:
      ...     print(str(e).splitlines()[0][:33])
      ft.field does not take repr= (an
    """
    for name in metadata:
        if name in _OPTIONS:
            why, wrong, right = _OPTIONS[name]
            raise TypeError(FIELD_OPTION.format(name=name, why=why, wrong=wrong, right=right))


KW_ONLY_MARKER = """\
{cls}.{name}: dataclasses.KW_ONLY is not supported by ft.Module (the fields after it would \
still be taken positionally, silently). Pass those fields by name, or write __init__:

    wrong:  {name}: dataclasses.KW_ONLY
    right:  (leave the marker out)     # Cls(w, n=2): any field may be passed by name
"""


def refuse_kw_only_marker(cls: type, annotations: dict[str, Any]) -> None:
    """Raise :data:`KW_ONLY_MARKER` where a class body annotates ``dataclasses.KW_ONLY``
    (by object or as a string: ``from __future__ import annotations``).

    Example:
      >>> import dataclasses
      >>> refuse_kw_only_marker(object, {"w": "jax.Array"})
      >>> try:
      ...     refuse_kw_only_marker(object, {"_": dataclasses.KW_ONLY})
      ... except TypeError as e:
      ...     print(str(e).splitlines()[0][:40])
      object._: dataclasses.KW_ONLY is not sup
    """
    for name, ann in annotations.items():
        if ann is dataclasses.KW_ONLY or (isinstance(ann, str) and ann in ("KW_ONLY", "dataclasses.KW_ONLY")):
            raise TypeError(KW_ONLY_MARKER.format(cls=cls.__name__, name=name))


INIT_VAR = """\
{cls}.{name}: dataclasses.InitVar is not supported by ft.Module: an argument of __init__ \
alone is no field, and JAX rebuilds a module from its fields without calling __init__ (the \
generated __init__ would refuse it, and __post_init__ would be called without it). Take it \
in your own __init__:

    wrong:  {name}: dataclasses.InitVar[float] = 1.0      # and def __post_init__(self, {name}): ...
    right:  def __init__(self, w, {name}=1.0):
                self.w = w * {name}
"""


def refuse_init_vars(cls: type, annotations: dict[str, Any]) -> None:
    """Raise :data:`INIT_VAR` where a class body annotates a ``dataclasses.InitVar`` (by object
    or as a string: ``from __future__ import annotations``).

    Example:
      >>> import dataclasses
      >>> refuse_init_vars(object, {"w": "jax.Array"})
      >>> try:
      ...     refuse_init_vars(object, {"scale": dataclasses.InitVar[float]})
      ... except TypeError as e:
      ...     print(str(e).splitlines()[0][:44])
      object.scale: dataclasses.InitVar is not sup
    """
    for name, ann in annotations.items():
        if isinstance(ann, dataclasses.InitVar) or ann is dataclasses.InitVar or (
                isinstance(ann, str) and ann.startswith(("InitVar", "dataclasses.InitVar"))):
            raise TypeError(INIT_VAR.format(cls=cls.__name__, name=name))


HIDDEN_FIELD = """\
{cls}.{name} is a field, and {owner}.{name} is a {kind} of the same name: reading \
model.{name} runs the {kind}, never the value the model holds, trains and saves. Keep one \
of them, or give them two names:

    wrong:  {name}: int = ft.field(static=True)   and   @property def {name}(self): ...
    right:  {name}: int = ft.field(static=True)   and   @property def {name}_derived(self): ...
"""


MODULE_METHOD_FIELD = """\
{cls}.{name} is a field named like ft.Module's own method {name}(): the field's value would \
hide the method on every instance, so model.{name}(...) and functree's own calls of it \
(ft.set, which builds the new model with model.replace(...); a notebook's display) would \
call that value instead. Rename the field:

    wrong:  {name}: jax.Array
    right:  {name}_: jax.Array
"""


def refuse_hidden_fields(cls: type, names: tuple[str, ...], methods: frozenset[str] = frozenset()) -> None:
    """Raise :data:`HIDDEN_FIELD` where a field name of ``cls`` resolves, on the class, to a
    data descriptor (a property, in ``cls`` or a base): Python reads the descriptor before
    the instance's dict, so the field's value would be unreadable by name, silently.
    Raise :data:`MODULE_METHOD_FIELD` for a field named in ``methods`` (``ft.Module``'s own,
    which functree calls on any model).

    Example:
      >>> class Base:
      ...     @property
      ...     def n(self):
      ...         return 2
      >>> refuse_hidden_fields(Base, ("w",))
      >>> try:
      ...     refuse_hidden_fields(Base, ("n",))
      ... except TypeError as e:
      ...     print(str(e).splitlines()[0][:48])
      Base.n is a field, and Base.n is a property of t
    """
    for name in names:
        if name in methods:
            raise TypeError(MODULE_METHOD_FIELD.format(cls=cls.__name__, name=name))
        attr = inspect.getattr_static(cls, name, None)
        kind = type(attr)
        if hasattr(kind, "__set__") or hasattr(kind, "__delete__"):
            owner = next((k for k in cls.__mro__ if name in vars(k)), cls)
            what = "property" if isinstance(attr, property) else f"{kind.__name__} descriptor"
            raise TypeError(HIDDEN_FIELD.format(cls=cls.__name__, name=name, owner=owner.__name__, kind=what))


MIXED_DICT_KEYS = """\
{cls}.{field} is a dict whose keys cannot be sorted together ({types}): JAX sorts a dict's \
keys to flatten it, so every use of the model (jit, grad, an optimizer) would fail inside \
JAX. Use keys of one type:

    wrong:  {field}={{0: ..., "aux": ...}}
    right:  {field}={{"0": ..., "aux": ...}}
"""

_SORTED_DICTS = (dict, collections.defaultdict)  # JAX sorts these; an OrderedDict keeps its order


def check_dict_keys(cls: type, name: str, value: Any) -> None:
    """Refuse a dict field value (:data:`MIXED_DICT_KEYS`) whose keys JAX cannot sort.

    Example:
      >>> check_dict_keys(dict, "heads", {"a": 1, "b": 2})
      >>> try:
      ...     check_dict_keys(dict, "heads", {0: 1, "aux": 2})
      ... except TypeError as e:
      ...     print(str(e).splitlines()[0][:60])
      dict.heads is a dict whose keys cannot be sorted together (i
    """
    if type(value) not in _SORTED_DICTS or len(value) < 2:
        return
    try:
        sorted(value)
    except TypeError:
        types = ", ".join(sorted({type(k).__name__ for k in value}))
        raise TypeError(MIXED_DICT_KEYS.format(cls=cls.__name__, field=name, types=types)) from None
