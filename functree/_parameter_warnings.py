"""The messages of :class:`functree.NonDifferentiableFieldWarning`: a parameter field whose
annotation or value can never carry a derivative (a ``bool``, ``int``, ``str`` or function;
an int where the annotation says float; a list of Python floats), each with the
declaration that says what the field is. :mod:`functree._module` warns with them, at class
definition and at construction.
"""

from __future__ import annotations

from typing import Any

__all__ = ["non_differentiable_field", "floats_only_container", "annotation_warned", "INT_FOR_FLOAT",
           "FLOATS_IN_CONTAINER", "NON_DIFFERENTIABLE_FIELD", "NUMBER_AS_STATE", "ONLY_CONFIGURATION"]

NON_DIFFERENTIABLE_FIELD = """\
{cls}.{field} is a parameter field but its {what} is not differentiable ({type}). \
It will be carried, not trained. {say}

    {field}: {type} = ft.field(static=True)          # configuration (Swift's `let`)
{state}"""

# A no_derivative field is a leaf that jit, gradients and train steps carry: an array. A
# number becomes one (state such as a step count); a str or a function cannot.
NUMBER_AS_STATE = """\
    {field}: jax.Array = ft.field(no_derivative=True)   # state (Swift's `@noDerivative var`): \
an array, {field}=jnp.asarray(...)
"""

ONLY_CONFIGURATION = """\
It is configuration: a {type} is not an array, so it cannot be a leaf that jit, gradients \
and train steps carry (no_derivative):"""

INT_FOR_FLOAT = """\
{cls}.{field} is annotated float but holds the int {value!r}: an int is not differentiable, so it \
will be carried, not trained (Swift's `var {field}: Float = {value}` is a Float). Write a float:

    {field}: float = {value}.0
"""

FLOATS_IN_CONTAINER = """\
{cls}.{field} is a parameter field whose {kind} holds Python numbers ({preview}): a Python \
number inside a container is static data, so they will be carried, not trained (only a \
field that is itself a Python float is a parameter). Make them arrays, or say they are \
configuration:

    wrong:  {field}=[0.5, 0.5]
    right:  {field}=[jnp.float32(0.5), jnp.float32(0.5)]      # trained (or one array: jnp.array([0.5, 0.5]))
    right:  {field}: tuple = ft.field(static=True)         # configuration, hashed: {field}=(0.5, 0.5)
"""


def non_differentiable_field(cls: str, field: str, what: str, type_name: str) -> str:
    """NON_DIFFERENTIABLE_FIELD with the options that work for a ``type_name``: static for
    any, no_derivative (as an array) for a number only."""
    number = type_name in ("bool", "int")
    return NON_DIFFERENTIABLE_FIELD.format(
        cls=cls, field=field, what=what, type=type_name,
        say="Say which it is:" if number else ONLY_CONFIGURATION.format(type=type_name),
        state=NUMBER_AS_STATE.format(field=field) if number else "")


def floats_only_container(value: Any) -> bool:
    """A plain list, tuple or dict (not a Module, not a named tuple) whose leaves are all
    Python numbers, one at least a float: meant as parameters (Swift's ``[Float]``), it
    would be static data."""
    numbers = _plain_numbers(value, depth=2)
    return bool(numbers) and any(isinstance(x, float) for x in numbers)


def _plain_numbers(value: Any, depth: int) -> list[Any] | None:
    """The Python numbers of a plain list, tuple or dict of them (nested ``depth`` deep at
    most), or None when it holds anything else. Read element by element, never flattened
    (a container may hold its module: a cycle)."""
    if type(value) not in (list, tuple, dict) or depth == 0:
        return None
    out: list[Any] = []
    for x in value.values() if type(value) is dict else value:
        if isinstance(x, (int, float)) and not isinstance(x, bool):
            out.append(x)
            continue
        inner = _plain_numbers(x, depth - 1)
        if inner is None:
            return None
        out += inner
    return out


def annotation_warned(cls: type, name: str) -> bool:
    ann = cls.__dataclass_fields__[name].type  # type: ignore[attr-defined]
    return ann in ("bool", "int", "str", bool, int, str) or "Callable" in str(ann)
