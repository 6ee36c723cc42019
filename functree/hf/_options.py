"""Reading a Hugging Face config into a model class's arguments: the pieces every family's
:meth:`~functree.hf._family.HFModel.from_config` shares (activations, rope, sliding
windows, options functree does not cover)."""

from __future__ import annotations

from typing import Any

from functree import _activations as act
from functree.nn._rotary import ROPE_TYPES, RopeScaling

__all__ = ["activation", "require", "rope", "window"]

UNCOVERED_OPTION = """\
ft.nn.from_hf: the {model_type} config sets {option}={value!r}; functree's {model_type} covers \
{covered}. Loading it anyway would give a different model.

    right:  a config with {option}={covered_value}
"""

MIXED_WINDOWS = """\
ft.nn.from_hf: the {model_type} config mixes sliding-window and full-attention layers \
(layer_types {types}); functree's {model_type} takes one kind for every layer (its blocks are \
one ft.nn.Stack).

    right:  a config with use_sliding_window=False, or sliding windows on every layer
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

UNKNOWN_ACTIVATION = """\
ft.nn.from_hf: the {model_type} config's activation {given!r} is not covered; covered: {known}."""


# gelu_fast (GPT-NeoX-20B) is gelu_new's tanh formula written another way (5.8e-7 apart on [-8, 8]).
_ACTIVATIONS = {"gelu_new": act.gelu, "gelu_pytorch_tanh": act.gelu, "gelu_fast": act.gelu, "gelu": act.gelu_exact, "relu": act.relu,
                "silu": act.silu, "swish": act.silu, "tanh": act.tanh}


def activation(config: Any, name: str) -> Any:
    """The ft.nn activation the config's ``name`` attribute names (HF's ``ACT2FN`` key)."""
    given = getattr(config, name)
    if given not in _ACTIVATIONS:
        raise ValueError(UNKNOWN_ACTIVATION.format(model_type=config.model_type, given=given,
                                                   known=", ".join(_ACTIVATIONS)))
    return _ACTIVATIONS[given]


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
    base = float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
    original = params.get("original_max_position_embeddings")
    if kind == "dynamic":  # HF's dynamic NTK scales past max_position_embeddings
        original = config.max_position_embeddings
    factor = params.get("factor")
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


def window(config: Any, layer_types: bool = False) -> int | None:
    """The sliding window of every layer (None: full attention): ``sliding_window``
    (Mistral, Phi-3); with ``layer_types=True`` (Qwen2) only where the config's
    ``layer_types`` make every layer ``sliding_attention``."""
    size = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types is not None and layer_types:
        kinds = set(types)
        if len(kinds) > 1:
            raise ValueError(MIXED_WINDOWS.format(model_type=config.model_type, types=list(types)))
        return size if kinds == {"sliding_attention"} else None
    return None if size is None else int(size)


