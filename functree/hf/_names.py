"""The torch module name of every ``Dense`` member of a model: Hugging Face's for a model of
:func:`ft.hf.from_hf`, :func:`ft.interop.torch_state_dict`'s for a model of ``ft.nn``
layers, which names a from_hf model held inside it (at any depth, in dict, list and tuple
fields too) in Hugging Face's names under its key path, as torch's ``state_dict()`` of the
torch model holding the HF model does (``bert.encoder.layer.0.attention.self.query``).
What PEFT's files (:mod:`._peft`) and ``ft.nn.lora``'s patterns name layers by.

The names come from the converters themselves: a copy of the model whose leaves are small
arrays holding a code per ``Dense`` member (no copy of the weights) goes through
:func:`ft.hf.to_hf_state_dict` (or ``torch_state_dict``), and the code found in each
tensor names its layer; computed once per tree definition and leaf shapes. ``ft.nn.lora``
reads Hugging Face's names through :data:`functree._naming.FOREIGN_NAMES`, where this
module registers :func:`hf_names` (``ft.nn`` sits below this package and cannot import it).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from types import MappingProxyType
from typing import Any, NamedTuple

import jax
import numpy as np

from functree import _naming
from functree._module import from_fields
from functree._naming import FOREIGN_NAMES, ForeignNames
from functree._tree import bounded_put, cached, dotted_name, is_none, join_names
from functree.hf._family import family_of
from functree.hf._load import to_hf_state_dict
from functree.interop._ports import holds_port
from functree.interop._torch import torch_state_dict
from functree.nn._linear import Dense
from functree.nn._lora import (
    LoraDense,
    dense_layers,
    member_layer_names,
)
from functree.nn._lora_experts import LoraExperts, base_experts, expert_weights
from functree.nn._moe import SparseMoE

__all__ = ["TorchNames", "torch_names", "hf_names", "classifier_of", "TASK_TYPES", "param_names",
           "all_param_names", "router_members", "router_modules", "saved_under",
           "param_listed"]


def unwrapped(model: Any) -> Any:
    """``model`` with each LoraDense replaced by a Dense of its weight and bias, each
    LoraExperts by the Experts of its base weights (no merge)."""
    def one(x: Any) -> Any:
        if isinstance(x, LoraDense):
            return from_fields(Dense, {"weight": x.weight, "bias": x.bias, "activation": x.activation})
        if isinstance(x, LoraExperts):
            return base_experts(x)
        return x

    return jax.tree.map(one, model, is_leaf=lambda x: isinstance(x, (LoraDense, LoraExperts)))


class _TorchName(NamedTuple):
    module: str  # the torch module holding the layer's weight ("model.layers.0.self_attn.q_proj")
    transposed: bool  # stored [out, in] (a Linear), else [in, out] (Hugging Face's Conv1D)
    shared_with: tuple[str, ...]  # other ft layer members in the same tensor (a fused projection)
    weight_param: bool  # the tensor is "<module>.weight"
    positions: np.ndarray  # where each of the member's outputs sits on the tensor's output axis
    size: int  # the tensor's output axis (the sum of its members' outputs when fused)


class TorchNames(NamedTuple):
    """What :func:`torch_names` finds: whether the names are Hugging Face's, each Dense
    member's torch tensor, every module name of the torch model that holds a parameter, and
    the output head's module (Hugging Face's ``get_output_embeddings()``; PEFT's
    ``"all-linear"`` leaves it out; a task model's classifier: :func:`classifier_of`)."""

    is_hf: bool
    members: dict[str, _TorchName]
    modules: frozenset[str]
    head: str | None


# PEFT's task_type of functree.hf._heads' task models, by their HF class suffix (PEFT has
# none for a masked LM): under these PEFT keeps the classifier whole (modules_to_save;
# QUESTION_ANS: its qa_outputs, PeftModelForQuestionAnswering's).
TASK_TYPES = {"ForSequenceClassification": "SEQ_CLS", "ForTokenClassification": "TOKEN_CLS",
              "ForQuestionAnswering": "QUESTION_ANS"}


def classifier_of(model: Any) -> str | None:
    """The torch module of a task model's classifier (``score``, ``classifier``,
    ``qa_outputs``: its ``head_roots``), for a sequence or token classifier or a question
    answerer of :mod:`functree.hf._heads` at the root; None for other models. PEFT's
    ``SEQ_CLS`` / ``TOKEN_CLS`` / ``QUESTION_ANS`` keep it whole in ``modules_to_save``, and
    its ``"all-linear"`` leaves it out under ``SEQ_CLS`` (and fails under the other two,
    adapting the head and then wrapping it)."""
    family = family_of(model)
    if family is None or getattr(family, "suffix", "") not in TASK_TYPES:
        return None
    roots = getattr(family, "head_roots", ())
    return str(roots[0]) if roots else None


_TORCH_NAMES: dict[Any, TorchNames] = {}


def torch_names(model: Any, torch_too: bool = True) -> TorchNames:
    """The torch names of every Dense member of ``model``: Hugging Face's
    (``to_hf_state_dict``) for a from_hf model; ``torch_state_dict``'s for others, in which
    a from_hf model held at any depth has Hugging Face's names under its attribute
    (``bert.encoder.layer.0.attention.self.query``, as PEFT names the torch model holding
    ``self.bert = BertModel(...)``); none without ``torch_too`` for a model holding no
    from_hf model. Found by sending copies of the model whose leaves are small arrays
    through the converter: every leaf keeps its stack axes and its last axis (the sizes a
    converter splits heads and fused projections by) and has size 1 on the others. In the
    first copy a Dense weight ``[1, out]`` holds its member's code, in the second its output
    index; every other leaf is NaN (no code, whatever a conversion does to it). A Linear's
    weight comes back ``[out, 1]``, a Conv1D's ``[1, out]``: the codes name the member(s) of
    each tensor, the indices where each output went (a fused projection's rows, a permuted
    layout). Cached per tree definition and leaf shapes: the markers, and so the positions
    and sizes found, follow the shapes (a ``Dense(4, 2)`` and a ``Dense(4, 3)`` head share a
    tree definition)."""
    base = unwrapped(model)
    leaves, treedef = jax.tree.flatten(base, is_leaf=is_none)
    shapes = tuple(getattr(x, "shape", ()) for x in leaves)  # (np.shape: ~7 us a jax.Array)
    key, found = cached(_TORCH_NAMES, (treedef, shapes))
    if found is not None and (found.is_hf or torch_too):
        return found
    # No Hugging Face names: nothing to convert. A port inside a Stack (an ensemble of from_hf
    # models) has none either: its patterns name its key paths, and only a PEFT file, which
    # needs its family's names (torch_too), is refused (PORT_IN_STACK).
    if not torch_too and not holds_port(base, in_stacks=False):
        return TorchNames(False, {}, frozenset(), None)
    codes, names = _markers(base, by_member=True)
    converted = _converted(jax.tree.unflatten(treedef, codes), torch_too)
    if converted is None:
        return TorchNames(False, {}, frozenset(), None)
    is_hf, head, by_code = converted
    columns, _ = _markers(base, by_member=False)
    _, _, by_column = _converted(jax.tree.unflatten(treedef, columns), torch_too) or (None, None, {})
    out: dict[str, _TorchName] = {}
    code_of = {n: c for c, n in names.items()}
    for tensor_name, array in by_code.items():
        flat = np.asarray(array).reshape(-1)
        members = [names[int(c)] for c in np.unique(flat) if c >= 1 and int(c) in names]
        module, _, param = tensor_name.rpartition(".")
        transposed = np.ndim(array) != 2 or np.shape(array)[-1] == 1  # [out, 1]; [1, 1]: a Linear's
        index = np.asarray(by_column[tensor_name]).reshape(-1)
        for member in members:
            at = np.flatnonzero(flat == code_of[member])
            order = index[at].astype(np.int64) - 1  # the member's output each position holds
            if not np.array_equal(np.sort(order), np.arange(len(at))):
                raise AssertionError(f"{tensor_name} holds the outputs of {member} other than once each")
            positions = np.empty(len(at), np.int64)
            positions[order] = at  # output j of the member sits at positions[j]
            positions.setflags(write=False)
            out.setdefault(member, _TorchName(module, transposed, tuple(m for m in members if m != member),
                                              param == "weight", positions, flat.size))
    modules = frozenset(prefix for name in by_code for prefix in _prefixes(name))
    result = TorchNames(is_hf, out, modules, head)
    if key is not None:
        bounded_put(_TORCH_NAMES, key, result)
    return result


def _markers(base: Any, by_member: bool) -> tuple[list[Any], dict[int, str]]:
    """The leaves of a marked copy of ``base`` (see :func:`torch_names`) and the members' codes."""
    weights = {layer.weight: layer for layer in dense_layers(base)}
    names: dict[int, str] = {}
    markers: list[Any] = []
    leaves = jax.tree.leaves(base, is_leaf=is_none)
    for i, (leaf, info) in enumerate(zip(leaves, _naming.leaf_infos(base))):
        if leaf is None:
            markers.append(None)
            continue
        shape, k = tuple(np.shape(leaf)), len(info.sizes)
        if i in weights:
            first = len(names) + 1
            members = member_layer_names(weights[i])
            names.update((first + j, name) for j, name in enumerate(members))
            if by_member:
                codes = np.arange(first, first + len(members), dtype=np.float64).reshape((*info.sizes, 1, 1))
                markers.append(np.broadcast_to(codes, (*info.sizes, 1, shape[-1])))
            else:
                markers.append(np.broadcast_to(np.arange(1.0, shape[-1] + 1), (*info.sizes, 1, shape[-1])))
        else:
            kept = shape[:k] + (1,) * (len(shape) - k - 1) + shape[-1:] if len(shape) > k else shape
            markers.append(np.full(kept, np.nan))
    return markers, names


def _converted(marked: Any, torch_too: bool) -> tuple[bool, str | None, dict[str, Any]] | None:
    """``(is_hf, head module, state dict)`` of a marked copy: Hugging Face's names for a from_hf
    model; for a model holding from_hf models (``Classifier(bert=ft.nn.from_hf(...), head=...)``)
    ``torch_state_dict``'s, which names each under its attribute in Hugging Face's names
    (``bert.encoder.layer.0.attention.self.query``), as torch's ``state_dict()`` of the
    torch model holding the HF model does; else torch's names of the ft.nn layers (None
    without ``torch_too``). Only a from_hf model at the root has a head PEFT's
    ``"all-linear"`` leaves out (PEFT reads ``get_output_embeddings()`` of a
    ``PreTrainedModel`` root alone)."""
    family = family_of(marked)
    if family is not None:
        head = family.hf_head[0].rpartition(".")[0] if family.hf_head is not None else \
            getattr(marked, "hf_output_head", lambda: None)()  # (an untied BERT masked LM's decoder)
        return True, head, to_hf_state_dict(marked, numpy=True)
    nested = holds_port(marked)
    if nested or torch_too:
        return nested, None, torch_state_dict(marked, numpy=True)
    return None


def _prefixes(tensor_name: str) -> list[str]:
    """The modules holding a tensor: ``a.b.weight`` -> ``a``, ``a.b``."""
    parts = tensor_name.split(".")[:-1]
    return [".".join(parts[: i + 1]) for i in range(len(parts))]


# ---- a sparse MoE's parts: the stacked expert weights' names and the routers ----------------

_PARAM_NAMES: dict[Any, tuple[dict[tuple[str, int], str], frozenset[str]]] = {}


def param_names(model: Any) -> dict[tuple[str, int], str]:
    """``{(Experts node's name + "." + field, member index): its Hugging Face parameter name}``
    (``model.layers.0.mlp.experts.gate_up_proj``), found as :func:`._names.torch_names` finds
    Dense layers': a copy of the model whose expert weights hold a code per member (every
    other leaf NaN) through ``to_hf_state_dict``. Cached per tree definition and leaf shapes."""
    return _param_table(model)[0]


def all_param_names(model: Any) -> frozenset[str]:
    """Every parameter name of the model's torch (Hugging Face) state dict."""
    return _param_table(model)[1]


def _param_table(model: Any) -> tuple[dict[tuple[str, int], str], frozenset[str]]:
    base = unwrapped(model)
    leaves, treedef = jax.tree.flatten(base, is_leaf=is_none)
    shapes = tuple(getattr(x, "shape", ()) for x in leaves)
    key, found = cached(_PARAM_NAMES, (treedef, shapes))
    if found is not None:
        return found
    weights = {w.leaf: w for w in expert_weights(base)}
    codes: dict[int, tuple[str, int]] = {}
    markers: list[Any] = []
    for i, (leaf, info) in enumerate(zip(leaves, _naming.leaf_infos(base))):
        if leaf is None:
            markers.append(None)
            continue
        shape, k = tuple(np.shape(leaf)), len(info.sizes)
        kept = shape[:k] + (1,) * (len(shape) - k - 1) + shape[-1:] if len(shape) > k else shape
        if i in weights:
            count = max(1, math.prod(info.sizes))
            first = len(codes) + 1
            codes.update((first + m, (f"{weights[i].name}.{weights[i].field}", m)) for m in range(count))
            values = np.arange(first, first + count, dtype=np.float64).reshape((*info.sizes,) + (1,) * (len(shape) - k))
            markers.append(np.broadcast_to(values, kept))
        else:
            markers.append(np.full(kept, np.nan))
    converted = _converted(jax.tree.unflatten(treedef, markers), True)
    out: dict[tuple[str, int], str] = {}
    state = converted[2] if converted is not None else {}
    for name, array in state.items():
        flat = np.asarray(array, np.float64).reshape(-1)
        for c in np.unique(flat[np.isfinite(flat)]):
            if int(c) in codes and np.all(flat == c):
                out[codes[int(c)]] = name
    table = (out, frozenset(state))
    if key is not None:
        bounded_put(_PARAM_NAMES, key, table)
    return table


def router_members(model: Any) -> frozenset[str]:
    """The member names of the model's sparse-MoE routers: the ``gate`` Dense of each
    :class:`~functree.nn.SparseMoE` (a Stack's members each), adapted or not."""
    pairs, _ = jax.tree_util.tree_flatten_with_path(model, is_leaf=lambda x: x is None or isinstance(x, SparseMoE))
    gates = {join_names(dotted_name(path), "gate") for path, node in pairs if isinstance(node, SparseMoE)}
    return frozenset(m for layer in dense_layers(model) if layer.name in gates for m in member_layer_names(layer))


def router_modules(model: Any, names: TorchNames) -> frozenset[str]:
    """The Hugging Face modules of the model's sparse-MoE routers (none where the names are
    not Hugging Face's). transformers 5 holds a router's weight in a module of its own
    (``MixtralTopKRouter``, ``Qwen2MoeTopKRouter``...), no ``torch.nn.Linear``: PEFT adapts it
    by its weight alone (``target_parameters=["...mlp.gate.weight"]``, its
    ``lora.ParamWrapper``), refuses it in ``target_modules`` unless its MoE conversion
    rewrites it (Mixtral's names), and its ``"all-linear"`` leaves it out there."""
    if not names.is_hf:
        return frozenset()
    return frozenset(names.members[m].module for m in router_members(model) if m in names.members)


def hf_names(model: Any) -> ForeignNames | None:
    """Hugging Face's module name of each Dense member of a model of ``from_hf`` (and the
    head ``"all-linear"`` leaves out: its output head, or a task model's classifier, which
    PEFT's ``SEQ_CLS`` / ``TOKEN_CLS`` keep whole), or of a model holding from_hf models
    (theirs under their attributes, its other Dense layers by their torch names; no head),
    for ``ft.nn.lora``'s patterns; None for other models. What PEFT 0.21's ``"all-linear"``
    does with a sparse MoE's router and experts (``left_out``, ``parameters``): it adapts
    ``torch.nn.Linear`` modules, which transformers 5's routers and stacked experts are not,
    and for a from_hf model at the root of a family with ``hf_all_linear`` (its MoE
    conversion: Mixtral's names and those built like them) adds the parameters listed
    there; a model holding from_hf models has no config PEFT converts by."""
    names = torch_names(model, torch_too=False)
    if not names.is_hf:
        return None
    extra = getattr(family_of(model), "hf_all_linear", {})
    routers = router_modules(model, names)
    classifier = classifier_of(model)  # what save_lora writes whole under the task type, no adapter
    left_out = frozenset(member for member, found in names.members.items()
                         if (found.module in routers and not param_listed(f"{found.module}.weight", extra))
                         or (classifier is not None and saved_under(found.module, classifier)))
    parameters = {ft_name: multiple for (ft_name, _), name in param_names(model).items()
                  for entry, multiple in extra.items() if param_listed(name, (entry,))} if extra else {}
    return ForeignNames({member: found.module for member, found in names.members.items()},
                        names.head or classifier, left_out, MappingProxyType(parameters))


def saved_under(module: str, entry: str) -> bool:
    """Whether PEFT's ``modules_to_save`` entry ``entry`` keeps ``module`` whole: the module's
    name, or an enclosing module's, ends with it (``_set_trainable`` wraps the first module
    matched, its layers with it: RoBERTa's ``classifier`` holds ``classifier.dense`` and
    ``classifier.out_proj``; DistilBERT's ``pre_classifier`` ends with ``classifier``)."""
    parts = module.split(".")
    return any(".".join(parts[:k]).endswith(entry) for k in range(1, len(parts) + 1))


def param_listed(name: str, entries: Iterable[str]) -> bool:
    """Whether a parameter ``name`` is one of ``entries`` or ends with one after a dot (PEFT's
    ``target_parameters`` matching, ``_inject_parameters``)."""
    return any(name == e or name.endswith(f".{e}") for e in entries)


FOREIGN_NAMES.append(hf_names)
