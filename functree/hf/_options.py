"""Reading a Hugging Face config into a model class's arguments: the pieces every family's
:meth:`~functree.hf._family.HFModel.from_config` shares (activations, rope, sliding
windows, options functree does not cover)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from functree import _activations as act
from functree.nn._rotary import ROPE_TYPES, RopeScaling

__all__ = ["activation", "causal", "layer_type_ropes", "require", "rope", "window"]

UNCOVERED_OPTION = """\
ft.nn.from_hf: the {model_type} config sets {option}={value!r}; functree's {model_type} covers \
{covered}. Loading it anyway would give a different model.

    right:  a config with {option}={covered_value}
"""

UNKNOWN_ROPE_TYPE = """\
ft.nn.from_hf: rope_type {kind!r} (config.rope_parameters) is not covered; covered: {known}.

    right:  config.rope_parameters = {{"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, ...}}
"""

PARTIAL_ROTARY_CRASHES = """\
ft.nn.from_hf: the {model_type} config sets partial_rotary_factor={partial} with rope_type \
{kind!r}. Hugging Face's {hf_class} applies partial_rotary_factor only to that rope type's \
frequencies, not to the rotation ({rotated} frequencies against a head of {head_dim}: its \
forward fails with a size mismatch), so no model computes this config.

    right:  config.rope_parameters = {{..., "rope_type": {kind!r}}}        # no partial_rotary_factor: the whole head
       or:  rope_type "default" (Hugging Face's {hf_class} then rotates the whole head, whatever the factor)
"""

ROPE_KEY_MISSING = """\
ft.nn.from_hf: config.{source}[{key!r}] is missing; rope_type {kind!r} needs {needs} \
(Hugging Face refuses this config too: "Missing required keys in `rope_parameters`"). \
A made-up value would load a model other than the one trained.

    wrong:  config.{source} = {given}
    right:  config.{source}[{key!r}] = ...   # the value the model was trained with, e.g. {example}
"""

ROPE_FACTOR_UNDER_1 = """\
ft.nn.from_hf: config.{source}["factor"] is {factor!r} with rope_type {kind!r}; functree's \
{kind} rope takes factor >= 1 (a factor under 1 shrinks the context: Hugging Face only warns \
"factor field must be a float or int >= 1").

    wrong:  config.{source} = {given}
    right:  config.{source}["factor"] = 1.0 or more   # the factor the model was trained with
"""

ODD_ROTARY = """\
ft.nn.from_hf: the {model_type} config's partial_rotary_factor {partial} (GPT-NeoX's rotary_pct) \
rotates int({head} * {partial}) = {rotated} features of each head of {head}, an odd count. \
Hugging Face's {hf_class} then draws {pairs} frequencies over {rotated} and rotates the first \
{even} features with them, a rotation functree's RopeScaling (features in pairs) does not \
compute, so the model is not built.

    wrong:  "partial_rotary_factor": {partial}
    right:  a factor whose head_size * factor is even, e.g. "partial_rotary_factor": {fix}
"""

LONGROPE_FACTORS = """\
ft.nn.from_hf: config.{source}'s short_factor and long_factor hold {short} and {long} factors; \
rope_type 'longrope' takes one per pair of rotated features: {pairs} for the {rotated} rotated \
features of a head of {head} (Hugging Face's config checks them against hidden_size / \
num_attention_heads alone, then broadcasts its factors over the head_dim it rotates).

    wrong:  config.{source}["short_factor"] = {short_list}
    right:  config.{source}["short_factor"] = [...]   # {pairs} factors, as for long_factor: the checkpoint's own
"""

UNKNOWN_ACTIVATION = """\
ft.nn.from_hf: the {model_type} config sets {key}={given!r}, an activation functree does not \
port (Hugging Face's ACT2FN name); covered: {known}. A model built with another activation \
would compute other logits, so none was built.

    wrong:  "{key}": {given_json}
    right:  "{key}": "gelu"        # only if the checkpoint was trained with that activation
       or:  port this model by hand from ft.nn layers (docs/guides/huggingface.md), its activation yours
"""

BIDIRECTIONAL = """\
ft.nn.from_hf: the {model_type} config sets is_causal={given!r}: Hugging Face's masks \
(transformers.masking_utils) then let every token attend to the tokens after it too, and \
functree's {hf_class} is a causal language model (each token sees itself and the tokens \
before it). Loading it would give other logits, so it is not built.

    wrong:  "is_causal": {given_json}
    right:  "is_causal": true     # or no is_causal key: the causal model the checkpoint is
"""

NO_LAYER_ROPE = """\
ft.nn.from_hf: the {model_type} config's rope_parameters hold no rope for layer type {kind!r} \
(given: {given}); each layer type of layer_types rotates with its own entry (Hugging Face's \
{hf_class} builds no frequencies for it and fails), and a rope made up here would load \
another model.

    wrong:  "rope_parameters": {given}
    right:  "rope_parameters": {{"sliding_attention": {{"rope_type": "default", "rope_theta": 10000.0}}, \
"full_attention": {{"rope_type": "default", "rope_theta": 1000000.0}}}}     # the checkpoint's own
"""

# gelu_fast (GPT-NeoX-20B) is gelu_new's tanh formula written another way (5.8e-7 apart on [-8, 8]);
# gelu_accurate and gelu_python_tanh are that formula too, gelu_python the exact (erf) GELU.
_ACTIVATIONS = {"gelu_new": act.gelu, "gelu_pytorch_tanh": act.gelu, "gelu_fast": act.gelu, "gelu_accurate": act.gelu,
                "gelu_python_tanh": act.gelu, "gelu": act.gelu_exact, "gelu_python": act.gelu_exact, "gelu_10": act.gelu_10,
                "quick_gelu": act.quick_gelu, "relu": act.relu, "relu2": act.relu2, "relu6": act.relu6,
                "leaky_relu": act.leaky_relu, "silu": act.silu, "swish": act.silu, "mish": act.mish, "tanh": act.tanh,
                "sigmoid": act.sigmoid, "linear": act.identity}


def activation(config: Any, name: str) -> Any:
    """The ft.nn activation the config's ``name`` attribute names (HF's ``ACT2FN`` key;
    another name is :data:`UNKNOWN_ACTIVATION`, naming the key)."""
    given = getattr(config, name)
    if not isinstance(given, str) or given not in _ACTIVATIONS:
        raise ValueError(UNKNOWN_ACTIVATION.format(model_type=config.model_type, key=name, given=given,
                                                   given_json=json.dumps(given, default=str),
                                                   known=", ".join(_ACTIVATIONS)))
    return _ACTIVATIONS[given]


def causal(config: Any, hf_class: str) -> None:
    """Raise :data:`BIDIRECTIONAL` where the config's ``is_causal`` is false (HF's masks then
    attend both ways: ``masking_utils.create_causal_mask``'s "power feature")."""
    given = getattr(config, "is_causal", True)
    if given is not None and not given:
        raise ValueError(BIDIRECTIONAL.format(model_type=config.model_type, given=given, hf_class=hf_class,
                                              given_json=json.dumps(given, default=str)))


def require(config: Any, option: str, covered: Any, default: Any) -> None:
    """Raise :data:`UNCOVERED_OPTION` unless the config's ``option`` (``default`` when absent) is ``covered``."""
    value = getattr(config, option, default)
    if value != covered:
        raise ValueError(UNCOVERED_OPTION.format(model_type=config.model_type, option=option, value=value,
                                                 covered=f"{option}={covered!r}", covered_value=repr(covered)))


# What Hugging Face's ``_validate_<type>_rope_parameters`` refuses a config without (keys its
# ``standardize_rope_params`` fills first -- rope_theta, original_max_position_embeddings -- left out),
# with the value a well-known checkpoint has, for the message.
_ROPE_REQUIRED = {"linear": {"factor": 2.0}, "dynamic": {"factor": 2.0}, "yarn": {"factor": 4.0},
                  "llama3": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}}


def _check_rope_keys(params: dict[str, Any], kind: str, source: str) -> None:
    """Raise :data:`ROPE_KEY_MISSING` / :data:`ROPE_FACTOR_UNDER_1` where HF refuses the keys or
    functree's RopeScaling the factor, naming the config's own key rather than RopeScaling's."""
    required = _ROPE_REQUIRED.get(kind, {})
    for key, example in required.items():
        if params.get(key) is None:
            raise ValueError(ROPE_KEY_MISSING.format(source=source, key=key, kind=kind, needs=", ".join(required),
                                                     given=params, example=example))
    factor = params.get("factor")
    if "factor" in required and isinstance(factor, (int, float)) and factor < 1:
        raise ValueError(ROPE_FACTOR_UNDER_1.format(source=source, factor=factor, kind=kind, given=params))


def rope(config: Any, head_dim: int | None = None, hf_class: str = "") -> RopeScaling:
    """Hugging Face's ``rope_parameters`` (``rope_scaling`` and ``rope_theta`` before v5) as a RopeScaling.

    ``hf_class`` names the family in the error. ``head_dim``: the family rotates the whole head whatever ``partial_rotary_factor`` says
    (Llama, Qwen2, Mistral, Gemma: HF's ``apply_rotary_pos_emb`` has no pass-through part,
    and their default rope ignores the factor), so a factor under 1 is dropped for the default
    rope and refused for the others (HF's forward fails there); None where HF rotates the
    first ``partial_rotary_factor`` of each head (GPT-NeoX, Phi-3)."""
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    source = "rope_scaling" if "type" in params else "rope_parameters"  # "type": an old-style config's key
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise ValueError(UNKNOWN_ROPE_TYPE.format(kind=kind, known=", ".join(ROPE_TYPES)))
    _check_rope_keys(params, kind, source)
    partial = float(params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None) or 1.0))
    if head_dim is not None and int(head_dim * partial) != head_dim:
        if kind != "default":
            raise ValueError(PARTIAL_ROTARY_CRASHES.format(
                model_type=config.model_type, partial=partial, kind=kind, hf_class=hf_class,
                rotated=int(head_dim * partial) // 2, head_dim=head_dim))
        partial = 1.0  # as HF's default rope: the factor is not read
    if head_dim is None:  # the partial families (GPT-NeoX, Phi-3): pairs of features only
        _check_rotated_pairs(config, partial, hf_class)
    base = float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
    original = params.get("original_max_position_embeddings")
    if kind == "dynamic":  # HF's dynamic NTK scales past max_position_embeddings
        original = config.max_position_embeddings
    factor = params.get("factor")
    if kind == "longrope":
        _check_longrope_factors(config, params, head_dim, partial, source)
    if kind == "longrope":  # Phi-3: the factor from the two lengths when not given
        original = original or getattr(config, "original_max_position_embeddings", None)
        params = {**params, "short_factor": tuple(map(float, params.get("short_factor") or ())),
                  "long_factor": tuple(map(float, params.get("long_factor") or ()))}
    if kind == "longrope" and factor is None and original:  # HF requires yarn's factor
        factor = config.max_position_embeddings / original
    options = {k: params[k] for k in ("low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow",
                                      "attention_factor", "mscale", "mscale_all_dim", "truncate", "short_factor",
                                      "long_factor")
               if params.get(k) is not None and not (k.startswith("beta_") and not params[k])}  # HF: `or 32`
    return RopeScaling(kind, base=base, factor=1.0 if factor is None else float(factor),
                       original_max_positions=None if original is None else int(original), partial=partial, **options)


class _OneLayerType:
    """``config`` with one layer type's rope dict as its ``rope_parameters`` (what :func:`rope` reads)."""

    def __init__(self, config: Any, params: Mapping[str, Any]):
        self._config, self.rope_parameters = config, dict(params)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._config, name)


def layer_type_ropes(config: Any, head_dim: int, hf_class: str) -> tuple[Any, tuple[int, ...] | None]:
    """The rotary embeddings of a config whose ``rope_parameters`` are nested by layer type
    (Gemma 3's ``{"sliding_attention": {...}, "full_attention": {...}}``, each read as
    :func:`rope` reads a flat one): ``(rope, None)`` where every layer's is the same, else
    ``(ropes, index)``, the distinct ropes in order of first use and each layer's index into
    them (the attention's tuple ``rotary`` and each member's ``member_rope``). A layer type
    without its entry is :data:`NO_LAYER_ROPE`."""
    nested = getattr(config, "rope_parameters", None)
    built: dict[str, RopeScaling] = {}
    for kind in config.layer_types:
        if kind in built:
            continue
        params = nested.get(kind) if isinstance(nested, Mapping) else None
        if not isinstance(params, Mapping):
            raise ValueError(NO_LAYER_ROPE.format(model_type=config.model_type, kind=kind, hf_class=hf_class,
                                                  given=json.dumps(_plain(nested), default=str)))
        built[kind] = rope(_OneLayerType(config, params), head_dim, hf_class)
    distinct = list(dict.fromkeys(built.values()))
    if len(distinct) == 1:
        return distinct[0], None
    return tuple(distinct), tuple(distinct.index(built[kind]) for kind in config.layer_types)


def _plain(value: Any) -> Any:
    """A config's nested mappings (HFConfig, a transformers dict) as plain dicts, for a message."""
    return {k: _plain(v) for k, v in value.items()} if isinstance(value, Mapping) else value


def _head_size(config: Any) -> int | None:
    """The head size Hugging Face's rotary reads: ``head_dim``, else ``hidden_size // heads``."""
    heads, hidden = getattr(config, "num_attention_heads", None), getattr(config, "hidden_size", None)
    return getattr(config, "head_dim", None) or (hidden // heads if heads and hidden else None)


def _check_longrope_factors(config: Any, params: dict[str, Any], head_dim: int | None, partial: float,
                            source: str) -> None:
    """Raise :data:`LONGROPE_FACTORS` unless each factor list holds one factor per rotated pair."""
    head = head_dim or _head_size(config)
    if not head:
        return
    rotated = int(head * partial)
    short, long = (list(params.get(k) or ()) for k in ("short_factor", "long_factor"))
    if len(short) != rotated // 2 or len(long) != rotated // 2:
        raise ValueError(LONGROPE_FACTORS.format(source=source, short=len(short), long=len(long), pairs=rotated // 2,
                                                 rotated=rotated, head=head, short_list=short))


def _check_rotated_pairs(config: Any, partial: float, hf_class: str) -> None:
    """Raise :data:`ODD_ROTARY` where ``int(head_size * partial)`` is odd (HF's rotary then
    rotates one feature more than it draws frequencies for: ``arange(0, n, 2) / n``)."""
    head = _head_size(config)
    if not head:
        return
    rotated = int(head * partial)
    if rotated % 2:
        raise ValueError(ODD_ROTARY.format(model_type=config.model_type, partial=partial, head=head, rotated=rotated,
                                           hf_class=hf_class or config.model_type, pairs=(rotated + 1) // 2,
                                           even=rotated + 1, fix=(rotated - 1 if rotated > 1 else 2) / head))


SLIDING_WITHOUT_WINDOW = """\
ft.nn.from_hf: the {model_type} config's layer_types make layer {layer} "sliding_attention", \
but its sliding window is null{why}: a sliding layer without a window size, which \
Hugging Face's {model_type} fails on ("'NoneType' object cannot be interpreted as an integer"); \
read as full attention it would be another model, so none was built.

    wrong:  {wrong}
    right:  {right}
"""


SLIDING_WINDOW_NOT_POSITIVE = """\
ft.nn.from_hf: the {model_type} config has sliding_window={size} and {where} slides: a window \
of {size} tokens, which Hugging Face's sliding mask fails on ("The size of tensor a ... must \
match"); read as full attention (0 in functree's per-layer windows) it would be another \
model, so none was built.

    wrong:  "sliding_window": {size}
    right:  "sliding_window": 4096     # the window the checkpoint was trained with
       or:  {off}     # every layer full attention
"""


def _check_window_positive(config: Any, size: int, layer: int | None) -> None:
    """:data:`SLIDING_WINDOW_NOT_POSITIVE` where a sliding layer's window ``size`` is under 1
    (``layer``: the first sliding one of ``layer_types``; None: every layer slides)."""
    if size >= 1:
        return
    where = "every layer" if layer is None else f'layer {layer} ("sliding_attention" in layer_types)'
    off = '"use_sliding_window": false' if getattr(config, "use_sliding_window", None) is not None else \
        '"sliding_window": null'
    raise ValueError(SLIDING_WINDOW_NOT_POSITIVE.format(model_type=config.model_type, size=size, where=where, off=off))


def sliding_without_window(model_type: str, layer: int, dropped: Any = None) -> ValueError:
    """:data:`SLIDING_WITHOUT_WINDOW` for ``layer``; ``dropped``: the window ``use_sliding_window``
    false made null (Qwen2's and Qwen3's configs), or None."""
    why = (f" (use_sliding_window is false, which makes Hugging Face's sliding_window {dropped} null)"
           if dropped is not None else "")
    wrong = '"use_sliding_window": false, "layer_types": [..., "sliding_attention", ...]' if dropped is not None else \
        '"sliding_window": null, "layer_types": [..., "sliding_attention", ...]'
    right = '"use_sliding_window": true       # the window on the sliding layers' if dropped is not None else \
        '"sliding_window": 4096             # the window the checkpoint was trained with'
    return ValueError(SLIDING_WITHOUT_WINDOW.format(model_type=model_type, layer=layer, why=why, wrong=wrong,
                                                    right=right))


def window(config: Any, layer_types: bool = False, enabled: bool = True) -> int | tuple[int, ...] | None:
    """The sliding window of every layer (None: full attention): ``sliding_window``
    (Mistral, Phi-3); with ``layer_types=True`` (Qwen2) where the config's ``layer_types``
    make every layer ``sliding_attention``; where they mix sliding and full layers, one
    window per layer (0: full attention), as HF's Qwen2 gives each layer its type's mask.
    ``enabled=False`` (Qwen3's ``use_sliding_window`` false): the window is null. A
    ``sliding_attention`` layer with a null window is refused (:data:`SLIDING_WITHOUT_WINDOW`:
    Hugging Face's model fails on it; read as full attention it would be another model), and
    with a window under 1 (:data:`SLIDING_WINDOW_NOT_POSITIVE`: HF's mask fails; 0 read as
    full attention in the per-layer windows)."""
    given = getattr(config, "sliding_window", None)
    size = given if enabled else None
    types = getattr(config, "layer_types", None)
    if types is not None and layer_types:
        kinds = set(types)
        if "sliding_attention" in kinds and size is None:  # (a transformers config object: config.json's are checked read)
            raise sliding_without_window(config.model_type, list(types).index("sliding_attention"),
                                         None if enabled else given)
        if size is not None and "sliding_attention" in kinds:  # (0 would read as full attention in the per-layer windows)
            _check_window_positive(config, int(size), list(types).index("sliding_attention"))
        if len(kinds) > 1 and size is not None:
            return tuple(int(size) if t == "sliding_attention" else 0 for t in types)
        return None if size is None or kinds != {"sliding_attention"} else int(size)
    if size is not None:
        _check_window_positive(config, int(size), None)
    return None if size is None else int(size)


