"""Ports: subtrees whose torch names are another library's, inside a model of ``ft.nn`` layers.

A model of :func:`ft.nn.from_hf` is a port: its torch names are Hugging Face's
(``bert.encoder.layer.0.attention.self.query.weight``), read and written by its family's
converter, not by the layer rules of :mod:`functree.interop._torch`. A user's model may hold
one at its root or anywhere below (``Classifier(bert=ft.nn.from_hf(...), head=Dense)``, as
torch's ``Classifier(nn.Module)`` holds ``self.bert = BertModel(config)``), and torch's
``state_dict()`` of such a model names the port's tensors under its attribute:
``bert.<Hugging Face's name>``. ``load_torch_state_dict`` and ``torch_state_dict`` hand each
port its share of the state dict (the names under its prefix, the prefix dropped) and take
back its tensors (the prefix put on).

``interop`` sits below the packages that convert models and cannot import them, so they
register here instead: :data:`PORTS` holds readers of a node (``functree.hf`` adds its own as
it is imported), each returning the node's :class:`Port` or None.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import numpy as np

from functree._stacked import is_stacked
from functree._state_dict import FlatDictReport
from functree._tree import dotted_name, join_names

__all__ = ["Port", "PORTS", "port_of", "Found", "holds_port", "check_placement", "unused_layouts", "load_ports", "replaced",
           "merged", "prefixed", "hint", "renamed_report"]

PORT_IN_STACK = """\
ft.nn: the ft.nn.Stack member {name!r} is a {kind} model; a port's names are its family's and \
are read whole, not a Stack member's slice. Hold the ports in a list (torch's ModuleList) instead:

    wrong:  ft.nn.Stack.from_layers([ft.nn.from_hf(a), ft.nn.from_hf(b)])
    right:  [ft.nn.from_hf(a), ft.nn.from_hf(b)]      # a field holding a list: named "<field>.0", "<field>.1"
"""

PORT_LAYOUTS = """\
ft.nn: layouts= patterns {patterns} match no ft.nn layer outside the model's Hugging Face \
ports ({ports}). A port's tensors are named and laid out as its Hugging Face model's \
state_dict() has them, read by its family's converter as ft.nn.from_hf reads them: layouts= \
does not apply inside it.

    wrong:  ft.nn.load_torch_state_dict(model, hf_model.state_dict(), layouts=...)
    right:  ft.nn.load_torch_state_dict(model, hf_model.state_dict())"""

PORT_HINT = """
{where} is a {kind} port: its tensors are named as its Hugging Face model's state_dict() \
names them{under} (read as ft.nn.from_hf reads them: a tied head's copy of the embedding \
taken when equal to it), not by the key paths of its ft.nn layers."""


class Port(NamedTuple):
    """A node whose torch names are its own: ``kind`` names it in errors (``"Hugging Face
    LlamaForCausalLM"``); ``state_dict(node)`` gives its tensors as NumPy arrays in its own
    names; ``load(node, tensors, prefix)`` gives ``(node with them, report)`` in those names
    (``prefix``: where the node sits, for its own errors)."""

    kind: str
    state_dict: Callable[[Any], dict[str, np.ndarray]]
    load: Callable[[Any, dict[str, Any], str], tuple[Any, FlatDictReport]]


# The readers of ports, tried in order (functree.hf registers Hugging Face's as it is imported).
PORTS: list[Callable[[Any], Port | None]] = []


def port_of(node: Any) -> Port | None:
    """The first registered reader's port for ``node``, or None."""
    for read in PORTS:
        found = read(node)
        if found is not None:
            return found
    return None


class Found(NamedTuple):
    """A port the torch plan met: its ft name (a key path), its torch name prefix ("" at the
    root), the node as the plan saw it (host arrays or placeholders) and its port."""

    ft: str
    torch: str
    node: Any
    port: Port


def holds_port(tree: Any, in_stacks: bool = True) -> bool:
    """Whether ``tree`` is or holds a port; with ``in_stacks=False``, one outside every
    ``ft.nn.Stack`` (a Stack's member has no names of its family: :data:`PORT_IN_STACK`).

    Example:
      >>> holds_port({"w": 1.0})
      False
    """
    is_port = lambda x: port_of(x) is not None  # noqa: E731
    stop = is_port if in_stacks else (lambda x: is_stacked(x) or is_port(x))
    return any(not is_stacked(x) and is_port(x) for x in jax.tree.leaves(tree, is_leaf=stop))


def check_placement(name: str, index: tuple[int, ...], port: Port) -> None:
    """A port inside a Stack is refused (:data:`PORT_IN_STACK`)."""
    if index:
        raise ValueError(PORT_IN_STACK.format(name=name, kind=port.kind))


def unused_layouts(patterns: list[str], found: list[Found]) -> ValueError | None:
    """:data:`PORT_LAYOUTS` where ``layouts=`` patterns matched nothing and the model holds ports."""
    if not found:
        return None
    ports = ", ".join(f"{f.torch or 'the model'} ({f.port.kind})" for f in found)
    return ValueError(PORT_LAYOUTS.format(patterns=patterns, ports=ports))


def prefixed(prefix: str, names: Mapping[str, Any]) -> dict[str, Any]:
    """``names`` with ``prefix.`` put in front of each (none at the root)."""
    return {join_names(prefix, name): value for name, value in names.items()}


def load_ports(model: Any, found: list[Found], given: Mapping[str, Any]
               ) -> tuple[dict[str, Any], FlatDictReport, set[str]]:
    """Each port of ``model`` loaded from its share of ``given`` (the names under its torch
    prefix, the prefix dropped): ``({ft name: loaded node}, their report in full torch
    names, the names of given they took)``."""
    nodes = {dotted_name(path): node for path, node in
             jax.tree_util.tree_flatten_with_path(model, is_leaf=lambda x: port_of(x) is not None)[0]}
    loaded: dict[str, Any] = {}
    reports: list[FlatDictReport] = []
    taken: set[str] = set()
    for f in found:
        start = f"{f.torch}." if f.torch else ""
        share = {name[len(start):]: value for name, value in given.items() if name.startswith(start)}
        taken.update(start + name for name in share)
        loaded[f.ft], report = f.port.load(nodes[f.ft], share, f.torch)
        reports.append(_report_under(f.torch, report))
    return loaded, merged(*reports), taken


def _report_under(prefix: str, report: FlatDictReport) -> FlatDictReport:
    """A port's report with its names put under its torch prefix."""
    return renamed_report(report, lambda n: join_names(prefix, n))


def renamed_report(report: FlatDictReport, name: Callable[[str], str]) -> FlatDictReport:
    """``report`` with each name ``n`` as ``name(n)``."""
    return FlatDictReport(tuple(map(name, report.missing)), tuple(map(name, report.unexpected)),
                          tuple((name(n), want, got) for n, want, got in report.mismatched), report.hints,
                          tuple((kind, tuple(map(name, names))) for kind, names in report.hinted))


def merged(*reports: FlatDictReport) -> FlatDictReport:
    """One report of several (each list concatenated, hints once)."""
    return FlatDictReport(tuple(n for r in reports for n in r.missing), tuple(n for r in reports for n in r.unexpected),
                          tuple(m for r in reports for m in r.mismatched),
                          tuple(dict.fromkeys(h for r in reports for h in r.hints)),
                          tuple(h for r in reports for h in r.hinted))


def replaced(tree: Any, loaded: Mapping[str, Any]) -> Any:
    """``tree`` with the nodes at the ft names of ``loaded`` replaced by them."""
    if not loaded:
        return tree
    return jax.tree_util.tree_map_with_path(lambda path, x: loaded.get(dotted_name(path), x), tree,
                                            is_leaf=lambda x: port_of(x) is not None)


def hint(found: list[Found]) -> str:
    """What the mismatch error says about the model's ports (:data:`PORT_HINT`)."""
    return "".join(PORT_HINT.format(where=f.torch or "The model", kind=f.port.kind,
                                    under=f" under {f.torch!r}" if f.torch else "") for f in found)
