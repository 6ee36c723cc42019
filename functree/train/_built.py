"""The settings a training step's compiled programs are built from.

A :class:`~functree.train.TrainStep` reads its optimizer, loss function, metrics, compute
dtype, ``on_nan``, ``steps_per_call`` and ``placement`` (its mesh, data axis and sharding)
while its programs trace (an :class:`~functree.train.EvalStep` its loss function, metrics,
compute dtype and placement); a
:class:`~functree.train.Trainer` builds its step from its
optimizer, ``wrt=``, ``on_nan`` ... Assigned once those programs exist, a setting was
ignored, silently (``step.optimizer = sgd(0.0)``: the next call of the same shapes ran the
program built with the old optimizer). :class:`BuiltWith` refuses it, with each owner's
message and fix.

A name such an object does not have was worse: ``step.donate = False`` made an attribute
that nothing reads, and the step donated on. :class:`Settings` refuses it
(:data:`UNKNOWN_SETTING`), in a ``__setattr__`` that runs on assignment only: the loops'
per-call writes go to objects of their own (a step's :class:`~functree.train._step.Loop`).
"""

from __future__ import annotations

import difflib
import inspect
import re
from typing import Any, ClassVar

__all__ = ["BuiltWith", "Settings", "UNKNOWN_SETTING", "short_value"]

UNKNOWN_SETTING = """\
{cls} has no setting {name!r}{why}. Assigned, it would be a new attribute that nothing reads, \
and the {cls} would go on as before (silently). {settings}

    wrong:  {var}.{name} = {value}
    right:  {right}"""


def short_value(value: Any) -> str:
    """``repr(value)`` for an error's code lines; ``...`` for an array's (a path is kept whole)."""
    text = repr(value)
    return text if len(text) <= (200 if isinstance(value, str) else 40) and "\n" not in text else "..."


class BuiltWith:
    """A data descriptor for one setting of a class whose compiled programs read it: stored
    under ``_<name>``, set freely while the object is set up, refused once the owner's
    ``_built_error(name, value)`` returns an error (its programs exist). On these names
    alone, so the loop's own attribute writes (a step's ``_calls``, a Trainer's ``_job``)
    pay nothing; a setting never given reads as a missing attribute (the owner's
    ``__getattr__``, if it has one).

    Example:
      >>> class Step:
      ...     optimizer = BuiltWith()
      ...     def __init__(self, optimizer):
      ...         self.optimizer, self.ran = optimizer, False
      ...     def _built_error(self, name, value):
      ...         return AttributeError(f"{name} is built in") if self.__dict__.get("ran") else None
      >>> step = Step("adam")
      >>> step.ran = True
      >>> try:
      ...     step.optimizer = "sgd"
      ... except AttributeError as e:
      ...     print(e, step.optimizer)
      optimizer is built in adam
    """

    def __set_name__(self, owner: type, name: str) -> None:
        self.name, self.slot = name, "_" + name

    def __get__(self, obj: Any, owner: Any = None) -> Any:
        if obj is None:
            return self
        try:
            return obj.__dict__[self.slot]
        except KeyError:
            raise AttributeError(self.name) from None

    def __set__(self, obj: Any, value: Any) -> None:
        error = obj._built_error(self.name, value)
        if error is not None:
            raise error
        obj.__dict__[self.slot] = value


class Settings:
    """Refuses assigning a public name that a functree object's class neither defines nor
    annotates, and that the object does not hold (:data:`UNKNOWN_SETTING`: the close
    settings, or the call that takes it as an argument). Names starting with ``_`` (the
    object's own state) and objects of a user's subclass (its names are its own) are set as
    Python sets them. On assignment only: nothing on a call's path.

    A class sets ``_NAMED`` (what its docs call an instance: ``step``) and ``_ARGUMENTS``,
    ``(method, call)`` pairs of the calls whose keywords are no attribute (``("__init__",
    "step = ft.train.train_step(loss_fn, optimizer, {})")``).

    Example:
      >>> class Step(Settings):
      ...     _NAMED, _ARGUMENTS = "step", (("__init__", "step = Step({})"),)
      ...     on_nan: str
      ...     def __init__(self, on_nan="stop", donate=True):
      ...         self.on_nan, self._donate = on_nan, donate
      >>> Step.__module__ = "functree.example"  # (a user's subclass is not checked)
      >>> step = Step()
      >>> step.on_nan = "skip"
      >>> try:
      ...     step.donate = False
      ... except AttributeError as e:
      ...     print(str(e).splitlines()[-1])
          right:  step = Step(donate=False)
    """

    __slots__ = ()
    _NAMED: ClassVar[str] = "obj"
    _ARGUMENTS: ClassVar[tuple[tuple[str, str], ...]] = ()

    def __setattr__(self, name: str, value: Any) -> None:
        if name[0] != "_" and name not in self.__dict__ and _checked(type(self), name):
            raise unknown_setting(self, name, value)
        object.__setattr__(self, name, value)


def _checked(owner: type, name: str) -> bool:
    """Whether ``owner.<name> = ...`` is refused: a functree class that neither defines nor
    annotates ``name``."""
    if not owner.__module__.startswith("functree.") or hasattr(owner, name):
        return False
    return not any(name in vars(k).get("__annotations__", ()) for k in owner.__mro__)


def _settable(obj: Any, value: Any) -> list[str]:
    """The public names ``obj`` takes ``value`` as now: annotated or held ones, a
    :class:`BuiltWith` its owner does not refuse, a property with a setter."""
    names: dict[str, bool] = {}
    for k in type(obj).__mro__[::-1]:
        for n, v in vars(k).items():
            if isinstance(v, BuiltWith):
                names[n] = obj._built_error(n, value) is None
            elif isinstance(v, property):
                names[n] = v.fset is not None
        for n in vars(k).get("__annotations__", ()):
            names.setdefault(n, True)
    names.update(dict.fromkeys(obj.__dict__, True))
    return [n for n, ok in names.items() if ok and not n.startswith("_")]


def _passing(call: str, name: str, shown: str) -> str:
    """``call`` (``"f(loss_fn, optimizer, {})"``) passing ``shown`` as ``name``: in its place
    where the call names it, else as a keyword."""
    if re.search(rf"[(, ]{name}[,)]", call):
        return re.sub(rf"([(, ]){name}([,)])", lambda m: m[1] + shown + m[2], call, count=1).replace(", {})", ")")
    return call.format(f"{name}={shown}")


def unknown_setting(obj: Any, name: str, value: Any) -> AttributeError:
    """:data:`UNKNOWN_SETTING` for ``obj.<name> = value``: the call that takes ``name`` as
    an argument, else its closest settings (``difflib``)."""
    owner, shown = type(obj), short_value(value)
    settable = _settable(obj, value)
    fixes = {n: f"{owner._NAMED}.{n} = {shown}" for n in settable}
    takers: dict[str, str] = {}  # an argument's name -> the call that takes it
    for method, call in owner._ARGUMENTS:
        for p in inspect.signature(getattr(owner, method)).parameters.values():
            if p.name != "self" and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and p.name not in fixes:
                fixes[p.name], takers[p.name] = _passing(call, p.name, shown), call
    close = difflib.get_close_matches(name, fixes, n=3, cutoff=0.6)
    if name in takers:
        head = takers[name].split(" = ")[-1].split("(")[0]
        why, right = f": it is an argument of {head}(...)", fixes[name]
    elif close:
        why, right = f" (did you mean {' or '.join(map(repr, close))}?)", fixes[close[0]]
    else:
        why, right = "", f"help(ft.train.{owner.__name__})"
    listed = f"Settings it takes now: {', '.join(settable)}." if settable else "It takes no setting now."
    return AttributeError(UNKNOWN_SETTING.format(cls=owner.__name__, name=name, why=why, settings=listed,
                                                 var=owner._NAMED, value=shown, right=right))
