"""A tree as named arrays plus a JSON description of its types, and back.

Checkpoints must rebuild a model and an optimizer state *without a template*: a
NamedTuple must come back as that NamedTuple, a Module as that Module with its static
configuration, a Python float as a float. Orbax alone restores dicts and lists. So a tree
is split into

* ``arrays``: ``{name: array}`` with dotted key-path names (``model.layers.0.weight``);
* ``spec``: JSON describing every node by kind and, for classes, by import path
  (``"functree.nn._linear:Dense"``). No pickle: loading imports classes by name only.

Static field values are stored as JSON when they are JSON values or tuples of them, as an
import path when they are importable functions or classes (``jax.nn.relu``), and otherwise
only as their ``repr`` (such a tree needs a template to be loaded).
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from functree._module import Module

__all__ = ["encode", "decode", "CheckpointError", "SpecError"]

NO_TEMPLATE = """\
Cannot rebuild {what} at {path!r} without a template: {why}.
Define classes at module level (importable), or load with a template built the same way:

    wrong:  ft.train.load(path)                   or  manager.restore()
    right:  ft.train.load(path, template=model)   or  manager.restore(template=model,
                                                          opt_state_template=opt_state)"""


class CheckpointError(ValueError):
    """A checkpoint directory or checkpoint that cannot be used as asked."""


class SpecError(CheckpointError):
    """A stored tree cannot be rebuilt from its description alone."""


def _import_path(obj: Any) -> str | None:
    """``module:qualname`` when importing it gives back ``obj`` itself."""
    module, qual = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if not module or not qual or "<" in qual:
        return None
    try:
        return f"{module}:{qual}" if _resolve(f"{module}:{qual}") is obj else None
    except (ImportError, AttributeError):
        return None


def _resolve(path: str) -> Any:
    module, qual = path.split(":")
    obj: Any = importlib.import_module(module)
    for part in qual.split("."):
        obj = getattr(obj, part)
    return obj


def _encode_static(value: Any) -> dict[str, Any]:
    if value is None or isinstance(value, (bool, int, float, str)):
        return {"json": value}
    if isinstance(value, tuple):
        return {"tuple": [_encode_static(v) for v in value]}
    if isinstance(value, np.dtype):
        return {"dtype": str(value)}
    path = _import_path(value)
    return {"import": path} if path else {"repr": repr(value)}


def _decode_static(code: dict[str, Any], path: str) -> Any:
    if "json" in code:
        return code["json"]
    if "tuple" in code:
        return tuple(_decode_static(c, path) for c in code["tuple"])
    if "dtype" in code:
        return np.dtype(code["dtype"])
    if "import" in code:
        return _resolve(code["import"])
    raise SpecError(
        NO_TEMPLATE.format(
            what="a static value", path=path, why=f"{code['repr']} has no import path"
        )
    )


def _join(prefix: str, part: Any) -> str:
    return f"{prefix}.{part}" if prefix else str(part)


def _is_namedtuple(x: Any) -> bool:
    return isinstance(x, tuple) and hasattr(type(x), "_fields")


class _Encoder:
    def __init__(self) -> None:
        self.arrays: dict[str, Any] = {}

    def leaf(self, x: Any, path: str) -> dict[str, Any]:
        name = path or "value"
        while name in self.arrays:
            name += "_"
        spec: dict[str, Any] = {"kind": "leaf", "key": name}
        if isinstance(x, (bool, int, float, complex)) and not isinstance(x, np.generic):
            spec["python"] = type(x).__name__
            x = np.asarray(x)
        elif isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            spec["prng"] = str(jax.random.key_impl(x))
            x = jax.random.key_data(x)
        elif isinstance(x, np.generic):
            spec["numpy_scalar"] = True
            x = np.asarray(x)
        self.arrays[name] = x
        return spec

    def node(self, x: Any, path: str) -> dict[str, Any]:
        if x is None:
            return {"kind": "none"}
        if isinstance(x, Module):
            return self.module(x, path)
        if _is_namedtuple(x):
            children = [self.node(v, _join(path, f)) for f, v in zip(type(x)._fields, x)]
            return {"kind": "namedtuple", "class": _import_path(type(x)) or repr(type(x)),
                    "items": children}
        if isinstance(x, (list, tuple)):
            kind = "list" if isinstance(x, list) else "tuple"
            return {"kind": kind, "items": [self.node(v, _join(path, i)) for i, v in enumerate(x)]}
        if isinstance(x, dict):
            keys = list(x)
            return {"kind": "dict", "keys": [[type(k).__name__, str(k)] for k in keys],
                    "items": [self.node(x[k], _join(path, k)) for k in keys]}
        children, treedef = jax.tree_util.tree_flatten(x, is_leaf=lambda y: y is not x)
        if treedef.num_nodes == 1 and treedef.num_leaves == 1:
            return self.leaf(x, path)
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            return self.dataclass(x, path)
        return {"kind": "opaque", "type": repr(type(x)),
                "items": [self.node(v, _join(path, i)) for i, v in enumerate(children)]}

    def dataclass(self, x: Any, path: str) -> dict[str, Any]:
        """A dataclass registered with ``jax.tree_util.register_dataclass``."""
        with_paths, _ = jax.tree_util.tree_flatten_with_path(x, is_leaf=lambda y: y is not x)
        data = [p[0].name for p, _ in with_paths if isinstance(p[0], jax.tree_util.GetAttrKey)]
        names = [f.name for f in dataclasses.fields(x)]
        return {
            "kind": "dataclass",
            "class": _import_path(type(x)) or repr(type(x)),
            "static": {n: _encode_static(getattr(x, n)) for n in names if n not in data},
            "fields": {n: self.node(getattr(x, n), _join(path, n)) for n in data},
        }

    def module(self, x: Module, path: str) -> dict[str, Any]:
        cls = type(x)
        static = {n: _encode_static(x.__dict__[n]) for n in cls.__ft_static__}
        fields = {
            n: self.node(x.__dict__[n], _join(path, n))
            for n in cls.__ft_fields__
            if n not in cls.__ft_static__
        }
        return {"kind": "module", "class": _import_path(cls) or repr(cls), "static": static,
                "fields": fields}


def encode(tree: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(arrays, spec)``: the tree's leaves by dotted name and a JSON description.

    Example:
      >>> import jax.numpy as jnp
      >>> from functree.train._treespec import encode, decode
      >>> arrays, spec = encode({"w": jnp.ones(2), "n": 3})
      >>> sorted(arrays)
      ['n', 'w']
      >>> decode(spec, arrays)
      {'w': Array([1., 1.], dtype=float32), 'n': 3}
    """
    encoder = _Encoder()
    spec = encoder.node(tree, "")
    return encoder.arrays, spec


def _decode_leaf(spec: dict[str, Any], arrays: dict[str, Any]) -> Any:
    x = arrays[spec["key"]]
    if "python" in spec:
        return {"bool": bool, "int": int, "float": float, "complex": complex}[spec["python"]](
            np.asarray(x)
        )
    if "prng" in spec:
        return jax.random.wrap_key_data(jnp.asarray(x), impl=spec["prng"])
    if spec.get("numpy_scalar"):
        return np.asarray(x)[()]
    return x


def _class(spec: dict[str, Any], path: str) -> Any:
    if ":" not in spec["class"]:
        why = f"{spec['class']} cannot be imported by name"
        raise SpecError(NO_TEMPLATE.format(what="a node", path=path, why=why))
    try:
        return _resolve(spec["class"])
    except (ImportError, AttributeError) as e:
        why = f"importing {spec['class']} failed ({e})"
        raise SpecError(NO_TEMPLATE.format(what="a node", path=path, why=why)) from None


def decode(spec: dict[str, Any], arrays: dict[str, Any], path: str = "") -> Any:
    """Rebuild the tree described by ``spec`` from ``arrays`` (inverse of :func:`encode`)."""
    kind = spec["kind"]
    if kind == "none":
        return None
    if kind == "leaf":
        return _decode_leaf(spec, arrays)
    if kind in ("list", "tuple"):
        items = [decode(s, arrays, _join(path, i)) for i, s in enumerate(spec["items"])]
        return items if kind == "list" else tuple(items)
    if kind == "dict":
        casts = {"int": int, "str": str}
        out = {}
        for (ktype, k), s in zip(spec["keys"], spec["items"]):
            out[casts.get(ktype, str)(k)] = decode(s, arrays, _join(path, k))
        return out
    if kind == "namedtuple":
        cls = _class(spec, path)
        return cls(*[decode(s, arrays, _join(path, f)) for f, s in zip(cls._fields, spec["items"])])
    if kind == "module":
        cls = _class(spec, path)
        values = {n: _decode_static(c, _join(path, n)) for n, c in spec["static"].items()}
        for n, s in spec["fields"].items():
            values[n] = decode(s, arrays, _join(path, n))
        out = object.__new__(cls)
        out.__dict__.update({n: values[n] for n in cls.__ft_fields__})
        return out
    if kind == "dataclass":
        cls = _class(spec, path)
        out = object.__new__(cls)
        for n, c in spec["static"].items():
            object.__setattr__(out, n, _decode_static(c, _join(path, n)))
        for n, s in spec["fields"].items():
            object.__setattr__(out, n, decode(s, arrays, _join(path, n)))
        return out
    why = f"{spec['type']} is not a Module, dataclass, NamedTuple, dict, list or tuple"
    raise SpecError(NO_TEMPLATE.format(what="a node", path=path, why=why))
