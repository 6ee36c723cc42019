"""Constructor arguments that optax takes unchecked and reads as another optimizer or schedule.

``optax.exponential_decay(transition_steps=0)`` never decays, ``optax.linear_schedule`` of no
transition steps stays at ``init_value``, ``optax.contrib.reduce_on_plateau(patience=0)``
reduces at every step: each is a plausible run with another learning rate, never an error.
functree's constructors check such an argument where it is given (:func:`check_argument`),
one message for all of them (:data:`ARGUMENT_OUT_OF_RANGE`); a hyperparameter that may be a
schedule is checked by its name instead (``optim/_hyper.py`` ``RULES``).
"""

from __future__ import annotations

from typing import Any

__all__ = ["ARGUMENT_OUT_OF_RANGE", "check_argument"]

ARGUMENT_OUT_OF_RANGE = """\
ft.optim.{where}: {arg}={given!r}; it must be {rule}: {why}.

    wrong:  ft.optim.{where}({call}{arg}={given!r})
    right:  ft.optim.{where}({call}{arg}={right})"""


def check_argument(where: str, arg: str, given: Any, ok: bool, rule: str, why: str, right: str,
                   call: str = "") -> None:
    """:data:`ARGUMENT_OUT_OF_RANGE` unless ``ok``; ``call`` is the arguments written before
    ``arg`` in the message's code (``"0.1, "``).

    Example:
      >>> from functree.optim._arguments import check_argument
      >>> check_argument("linear_warmup", "warmup_steps", -1, -1 >= 0, ">= 0", "0 is no warmup", "0", "0.1, ")
      Traceback (most recent call last):
      ...
      ValueError: ft.optim.linear_warmup: warmup_steps=-1; it must be >= 0: 0 is no warmup.
      ...
    """
    if not ok:
        raise ValueError(ARGUMENT_OUT_OF_RANGE.format(where=where, arg=arg, given=given, rule=rule, why=why,
                                                      right=right, call=call))
