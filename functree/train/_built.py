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
"""

from __future__ import annotations

from typing import Any

__all__ = ["BuiltWith"]


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
