"""PEFT's ``target_parameters``: LoRA on a sparse MoE's stacked expert weights, for :mod:`._peft`.

PEFT (0.17+) adapts an ``nn.Parameter`` with ``lora.ParamWrapper``: a 3-D weight
``[E, out, in]`` (transformers 5.25's ``experts.gate_up_proj [E, 2I, H]`` and
``experts.down_proj [E, H, I]``) gets ``lora_A [E r, in]`` and ``lora_B [out, r E]``, expert
``e`` the update ``scale · B_e A_e`` with ``A_e = lora_A.reshape(E, r, in)[e]`` and
``B_e = lora_B.reshape(out, r, E)[..., e]``; ``scale`` is ``lora_alpha / r`` (``use_rslora``:
``/ sqrt(r)``), ``r`` and ``lora_alpha`` from ``rank_pattern`` / ``alpha_pattern`` matched
against the parameter's full name (``model.layers.0.mlp.experts.gate_up_proj``). A parameter
is targeted when its full name is in ``target_parameters`` or ends with ``"." + entry``.
Here each is a :class:`~functree.nn._lora_experts.LoraParameter` (``functree/nn/_lora_experts.py``).

Several parameters of one module nest their wrappers in the order the module registers them
(``gate_up_proj``, then ``down_proj``): the last one's tensors are ``<module>.lora_A.weight``,
the one before it's ``<module>.base_layer.lora_A.weight``. A 2-D parameter that is a Dense
layer's weight (the router, ``mlp.gate.weight``) is a Linear's LoRA (``B A``, ``[out, in]``):
read and written as that layer's :class:`~functree.nn.LoraDense`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from typing import Any

import jax.numpy as jnp
import numpy as np

from functree._module import from_fields
from functree.hf._names import all_param_names, param_listed, param_names
from functree.hf._peft_members import adapter_dtype, member_arrays, written_alpha
from functree.nn._lora_experts import (
    EXPERT_FIELDS,
    ExpertWeight,
    LoraExperts,
    LoraParameter,
    expert_weights,
    from_peft_tensors,
    peft_tensors,
)
from functree.nn._precision import statistics_dtype

__all__ = ["targeted_params", "expert_tensors", "loaded_experts", "PARAMETER_NOT_PORTED",
           "PARAMETERS_SELECT_NOTHING", "PARAMETER_SHAPE", "PARAMETER_NOT_IN_FILE", "PARAMETER_OPTION",
           "EXPERTS_DROPOUT_SAVED", "TARGETED_TWICE", "check_params"]

PARAMETER_NOT_PORTED = """\
ft.nn.load_lora: adapter_config.json's target_parameters={targets!r} selects {params}, which \
{are} neither a sparse MoE's stacked expert weight (experts.gate_up_proj, experts.down_proj) \
nor a Dense layer's weight here. PEFT wraps any nn.Parameter (an embedding, a norm's scale); \
ft.nn.load_lora ports the expert weights and Linear weights only, and loading the rest would \
be a different model.
    right:  "target_parameters": ["experts.gate_up_proj", "experts.down_proj"]
       or:  model = ft.nn.from_hf(peft.PeftModel.from_pretrained(hf_model, directory).merge_and_unload())"""

PARAMETERS_SELECT_NOTHING = """\
ft.nn.load_lora: adapter_config.json's target_parameters={targets!r} selects no parameter of \
this model (PEFT refuses it: "target_parameters=... were set but no parameter was matched"). \
Its expert weights are named like {known} ...
    wrong:  ft.nn.load_lora(other_model, directory)
    right:  ft.nn.load_lora(ft.nn.from_hf(base_model_it_was_trained_on), directory)"""

PARAMETER_SHAPE = """\
ft.nn.load_lora: {name!r} has shape {given}; PEFT's adapter of the expert weight {param!r} \
({experts} experts, {inputs} inputs, {outputs} outputs) is lora_A [{experts} * r, {inputs}] \
and lora_B [{outputs}, r * {experts}] with r = {rank} ({source}): PEFT refuses it too (a size \
mismatch). The config and the file are from different saves, or the model is not the one \
the adapter was trained on.
    right:  ft.nn.load_lora(ft.nn.from_hf(base_model_it_was_trained_on), directory)"""

PARAMETER_NOT_IN_FILE = """\
ft.nn.load_lora: adapter_config.json's target_parameters selects {params}, but \
adapter_model.safetensors holds no lora_A / lora_B for {it} ({expected}; PEFT would leave \
them at their initialization: random or zero, silently). The file is incomplete or from \
another save.
    right:  peft_model.save_pretrained(directory)   # or ft.nn.save_lora(model, directory): both files again"""

PARAMETER_OPTION = """\
ft.nn.load_lora: the adapter sets target_parameters={targets!r} and {option}={value!r}; PEFT's \
lora.ParamWrapper refuses {option} (ValueError "lora.ParamWrapper does not work with \
{option}"): {why}. The file was not written by PEFT's save of a working model.
    wrong:  "{option}": {given}
    right:  "{option}": {right}"""

EXPERTS_DROPOUT_SAVED = """\
ft.nn.save_lora: the model holds adapters PEFT writes as target_parameters (a sparse MoE's \
expert weights or router: {param}) and LoraDense adapters with dropout={dropout} ({layer}). \
PEFT's config has one lora_dropout for the whole adapter, and its lora.ParamWrapper (the \
adapter on a parameter) refuses any lora_dropout != 0: \
PeftModel.from_pretrained would fail on the file. Drop the dropout before saving (it acts in \
training only; the adapters' numbers are the same):
    wrong:  ft.nn.save_lora(model, directory)
    right:  ft.nn.save_lora(jax.tree.map(lambda x: x.replace(dropout=0.0) if isinstance(x, ft.nn.LoraDense) else x,
                                         model, is_leaf=lambda x: isinstance(x, ft.nn.LoraDense)), directory)"""

TARGETED_TWICE = """\
ft.nn.load_lora: adapter_config.json targets {module!r} twice: by target_modules and its \
weight by target_parameters ({param!r}). PEFT refuses it ("Trying to wrap an `nn.Parameter` \
of layer ... which is not a valid target"): one adapter per layer.
    right:  "target_parameters": {right!r}"""


# ---- names --------------------------------------------------------------------------------------

def check_params(config: dict[str, Any], model: Any, dense: set[str], modules: set[str]) -> set[str]:
    """The Dense modules (``dense``: their torch names) whose ``.weight`` the config's
    ``target_parameters`` selects (a Linear's LoRA, :class:`~functree.nn.LoraDense`), after
    refusing what is not ported: a parameter of another kind (:data:`PARAMETER_NOT_PORTED`),
    a selection of nothing (:data:`PARAMETERS_SELECT_NOTHING`), ``lora_dropout`` or
    ``fan_in_fan_out`` (PEFT's ParamWrapper refuses both: :data:`PARAMETER_OPTION`), a layer
    targeted by ``target_modules`` too (:data:`TARGETED_TWICE`; ``modules``: those)."""
    targets = config.get("target_parameters") or []
    for option, why, right in (("lora_dropout", "x cannot be factored out of lora_B(lora_A(dropout(x))) when the "
                                "adapter is added to the weight", "0.0"),
                               ("fan_in_fan_out", "it reads the weight as stored; a Conv1D's transposed layout is "
                                "not one", "false")):
        value = config.get(option)
        if value:
            raise ValueError(PARAMETER_OPTION.format(targets=targets, option=option, value=value, why=why,
                                                     given=json.dumps(value), right=right))
    experts = set(param_names(model).values())
    selected = targeted_params(config, all_param_names(model))
    if not selected:
        raise ValueError(PARAMETERS_SELECT_NOTHING.format(targets=targets, known=sorted(experts)[:2]))
    by_param = {name.rpartition(".")[0] for name in selected if name.endswith(".weight")
                and name.rpartition(".")[0] in dense}
    other = [name for name in selected if name not in experts and name.rpartition(".")[0] not in by_param]
    if other:
        raise ValueError(PARAMETER_NOT_PORTED.format(targets=targets, params=other[:4],
                                                     are="is" if len(other) == 1 else "are"))
    twice = sorted(by_param & modules)
    if twice:
        right = [t for t in targets if not (f"{twice[0]}.weight" == t or f"{twice[0]}.weight".endswith(f".{t}"))]
        raise ValueError(TARGETED_TWICE.format(module=twice[0], param=f"{twice[0]}.weight", right=right))
    return by_param


def targeted_params(config: dict[str, Any], names: Iterable[str]) -> list[str]:
    """The parameter names PEFT's ``target_parameters`` selects among ``names``
    (:func:`~functree.hf._names.param_listed`)."""
    entries = config.get("target_parameters") or []
    return sorted(n for n in names if param_listed(n, entries))


def nested(module: str, fields: list[str], field: str) -> str:
    """The module name PEFT saves ``field``'s tensors under when ``fields`` (in registration
    order) of ``module`` are adapted: the last one's wrapper is outermost."""
    return module + ".base_layer" * (len(fields) - 1 - fields.index(field))


def _by_module(model: Any, adapted: list[ExpertWeight]) -> dict[str, list[tuple[ExpertWeight, int]]]:
    """``{HF parameter name: [(expert weight, member index)]}`` of the adapted weights."""
    names = param_names(model)
    out: dict[str, list[tuple[ExpertWeight, int]]] = {}
    for w in adapted:
        for m in range(max(1, math.prod(w.info.sizes))):
            out.setdefault(names[f"{w.name}.{w.field}", m], []).append((w, m))
    return out


# ---- writing ------------------------------------------------------------------------------------

def expert_tensors(model: Any) -> tuple[dict[str, np.ndarray], dict[str, int], dict[str, float]]:
    """``(tensors, {param: rank}, {param: alpha})`` of the model's expert-weight adapters, in
    PEFT's names and layouts (module docstring), each member at its own rank (zero padding
    trimmed) and scale."""
    weights = [w for w in expert_weights(model) if isinstance(getattr(w.node, w.field), LoraParameter)]
    tensors: dict[str, np.ndarray] = {}
    ranks: dict[str, int] = {}
    alphas: dict[str, float] = {}
    for param, members in _by_module(model, weights).items():
        (w, m), = members
        p: LoraParameter = getattr(w.node, w.field)
        sizes = w.info.sizes
        a, b = member_arrays(p.lora_a, sizes)[m], member_arrays(p.lora_b, sizes)[m]
        scale = float(p.alpha / p.rank) if p.member_scale is None else \
            float(np.asarray(p.member_scale, np.float64).reshape(-1)[m])
        used = np.flatnonzero(np.any(a != 0, axis=(0, 1)) | np.any(b != 0, axis=(0, 2)))
        r = int(used[-1]) + 1 if used.size else a.shape[-1]
        lora_a, lora_b = peft_tensors(a[..., :r], b[:, :r])
        module, _, field = param.rpartition(".")
        fields = [f for f in EXPERT_FIELDS if isinstance(getattr(w.node, f), LoraParameter)]
        at = nested(module, fields, field)
        tensors[f"base_model.model.{at}.lora_A.weight"], tensors[f"base_model.model.{at}.lora_B.weight"] = lora_a, lora_b
        ranks[param], alphas[param] = r, written_alpha(scale, r, lora_a.dtype)
    return tensors, ranks, alphas


# ---- reading ------------------------------------------------------------------------------------

def loaded_experts(model: Any, config: dict[str, Any], pairs: dict[str, dict[str, np.ndarray]],
                   pattern_value: Any) -> tuple[dict[Any, Any], set[str]]:
    """``({Experts key path: LoraExperts}, {module names of pairs used})``: the targeted
    expert weights with PEFT's tensors (``pairs``: ``{module: {"lora_A", "lora_B"}}``), each
    Stack member its own ``A``, ``B`` and scale (ranks padded with zeros to the largest,
    ``member_scale`` where the scales differ; a member not targeted: zeros)."""
    names = param_names(model)
    targeted = set(targeted_params(config, names.values()))
    weights = expert_weights(model)
    chosen = [w for w in weights if any(names.get((f"{w.name}.{w.field}", m)) in targeted
                                        for m in range(max(1, math.prod(w.info.sizes))))]
    found: dict[str, list[tuple[ExpertWeight, int]]] = _by_module(model, chosen)
    used: set[str] = set()
    missing: list[str] = []
    loaded: dict[tuple[str, str], dict[int, tuple[np.ndarray, np.ndarray, float]]] = {}
    for param in sorted(targeted):
        (w, m), = found[param]
        module, _, field = param.rpartition(".")
        fields = [f for f in EXPERT_FIELDS
                  if any(n == f"{module}.{f}" for n in targeted)]
        at = nested(module, fields, field)
        pair = pairs.get(at)
        if pair is None:
            missing.append(f"{at}.lora_A.weight")
            continue
        used.add(at)
        weight = getattr(w.node, w.field)
        experts, n_in, n_out = weight.shape[-3:]
        r, rank_key = pattern_value(config.get("rank_pattern") or {}, param, config.get("r", 8))
        alpha, _ = pattern_value(config.get("alpha_pattern") or {}, param, config.get("lora_alpha", 8))
        a, b = pair["lora_A"], pair["lora_B"]
        if a.shape != (experts * r, n_in) or b.shape != (n_out, r * experts):
            source = f"rank_pattern[{rank_key!r}]" if rank_key is not None else "the config's r"
            wrong = "lora_A" if a.shape != (experts * r, n_in) else "lora_B"
            raise ValueError(PARAMETER_SHAPE.format(name=f"base_model.model.{at}.{wrong}.weight",
                                                    given=(a.shape, b.shape), param=param, experts=experts,
                                                    inputs=n_in, outputs=n_out, rank=r, source=source))
        scale = float(alpha) / (math.sqrt(r) if config.get("use_rslora") else r)
        loaded.setdefault((w.info.name, w.field), {})[m] = (*from_peft_tensors(a, b, experts), scale)
    if missing:
        raise ValueError(PARAMETER_NOT_IN_FILE.format(params=sorted(targeted)[:4], it="it" if len(missing) == 1
                                                      else "them", expected=missing[:4]))
    wrapped: dict[Any, dict[str, LoraParameter]] = {}
    for w in chosen:
        given = loaded[w.info.name, w.field]
        weight = getattr(w.node, w.field)
        count = max(1, math.prod(w.info.sizes))
        rank = max(a.shape[-1] for a, _, _ in given.values())
        dtype = adapter_dtype([x.dtype for a, b, _ in given.values() for x in (a, b)])
        experts, n_in, n_out = weight.shape[-3:]
        a_all = np.zeros((count, experts, n_in, rank), dtype)
        b_all = np.zeros((count, experts, rank, n_out), dtype)
        first = next(iter(given.values()))[2]
        scales = np.full(count, first, np.float64)
        for m, (a, b, s) in given.items():
            a_all[m, ..., : a.shape[-1]], b_all[m, :, : b.shape[1]] = a, b
            scales[m] = s
        uniform = bool(np.all(scales == scales[0]))
        sizes = w.info.sizes
        wide = statistics_dtype(weight.dtype)
        wrapped.setdefault(w.path, {})[w.field] = from_fields(LoraParameter, {
            "weight": weight, "lora_a": jnp.asarray(a_all.reshape((*sizes, experts, n_in, rank))),
            "lora_b": jnp.asarray(b_all.reshape((*sizes, experts, rank, n_out))),
            "member_scale": None if uniform else jnp.asarray(scales.reshape(sizes), wide),
            "alpha": float(scales[0]) * rank})
    nodes = {w.path: w.node for w in weights}
    out = {path: from_fields(LoraExperts, {**{f: getattr(nodes[path], f) for f in EXPERT_FIELDS}, **fields,
                                           "activation": nodes[path].activation})
           for path, fields in wrapped.items()}
    return out, used
