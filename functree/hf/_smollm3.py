"""Hugging Face's SmolLM3 (``model_type: "smollm3"``): Llama whose layers where the config's
``no_rope_layers`` entry is 0 ("NoPE" layers) leave their queries and keys unrotated.

``no_rope_layers`` holds one entry per layer (a longer list is read up to the layer count,
as HF's attention indexes it): a truthy entry rotates. Without it, HF's ``SmolLM3Config``
makes every ``no_rope_layer_interval``-th layer NoPE (4 by default: layers 3, 7, ...), and
with ``use_sliding_window`` and a ``sliding_window`` its ``layer_types`` make exactly those
layers slide; each layer's mask is its ``layer_types`` entry's (Qwen2's windows: one per
layer where they mix, each member's ``member_window``). The rope's default base is 2e6
(``SmolLM3Config.default_theta``); the head is tied by default.
"""

from __future__ import annotations

import json
from typing import Any

import jax.numpy as jnp

from functree.hf._causal import with_member_values
from functree.hf._llama import LlamaForCausalLM, LlamaModel
from functree.hf._options import window

__all__ = ["SmolLM3ForCausalLM", "NO_ROPE_LAYERS"]

NO_ROPE_LAYERS = """\
ft.nn.from_hf: the smollm3 config's no_rope_layers is {given} for num_hidden_layers={layers}; \
it holds one entry per layer (1: the layer rotates its queries and keys, 0: a NoPE layer), \
and Hugging Face's SmolLM3Attention reads entry i for layer i ({outcome}).

    wrong:  "no_rope_layers": {given_json}
    right:  "no_rope_layers": {example}     # or leave it out: every no_rope_layer_interval-th layer NoPE
"""


def rotating_layers(config: Any) -> tuple[bool, ...] | None:
    """Whether each layer rotates (``no_rope_layers``, or HF's default from
    ``no_rope_layer_interval``); None where every layer does (no leaf: Llama's program).
    A list of another kind or shorter than the layers raises :data:`NO_ROPE_LAYERS`."""
    layers = config.num_hidden_layers
    given = getattr(config, "no_rope_layers", None)
    interval = getattr(config, "no_rope_layer_interval", 4)
    if given is None and isinstance(interval, int) and not isinstance(interval, bool) and interval > 0:
        given = [int((i + 1) % interval != 0) for i in range(layers)]  # SmolLM3Config.__post_init__'s
    if not isinstance(given, (list, tuple)) or not all(isinstance(e, (int, bool)) for e in given) \
            or len(given) < layers:
        raise _no_rope_layers(given, layers, interval)
    flags = tuple(bool(entry) for entry in given[:layers])
    return None if all(flags) else flags


def _no_rope_layers(given: Any, layers: int, interval: Any) -> ValueError:
    """:data:`NO_ROPE_LAYERS` for ``given`` (a list HF fails on, or null with no usable interval)."""
    listed = isinstance(given, (list, tuple)) and all(isinstance(e, (int, bool)) for e in given)
    outcome = ("an IndexError at the layers past its end" if listed else
               "a ZeroDivisionError building the default" if given is None else "no model: its config refuses it")
    shown = given if given is not None else f"null with no_rope_layer_interval={interval!r}"
    return ValueError(NO_ROPE_LAYERS.format(given=shown, layers=layers, outcome=outcome,
                                            given_json=json.dumps(given, default=str),
                                            example=[int((i + 1) % 4 != 0) for i in range(layers)]))


def _with_rotating(model: LlamaModel, rotates: tuple[bool, ...]) -> LlamaModel:
    """``model`` with each attention's ``member_rotates`` (int32 per Stack member, 0: NoPE, as
    the other per-member leaves: ``member_window``, ``member_rope``)."""
    flags = jnp.asarray(rotates, jnp.int32)
    return model.replace(layers=with_member_values(model.layers, "self_attn", member_rotates=flags))


class SmolLM3ForCausalLM(LlamaForCausalLM):
    """Hugging Face's ``SmolLM3ForCausalLM``: Llama with NoPE layers (module docstring), each
    attention's ``member_rotates`` a ``no_derivative`` int32 per Stack member (0: NoPE) (absent where
    every layer rotates), and Qwen2's per-layer windows from ``layer_types``.

    Example:
      >>> import functree as ft, jax, numpy as np
      >>> config = {"model_type": "smollm3", "vocab_size": 11, "hidden_size": 8, "intermediate_size": 16,
      ...           "num_hidden_layers": 4, "num_attention_heads": 2, "num_key_value_heads": 1, "pad_token_id": 0}
      >>> model = ft.nn.from_hf(config, key=jax.random.key(0))
      >>> model.model.layers.layers.self_attn.member_rotates.tolist()   # every fourth layer NoPE
      [1, 1, 1, 0]
      >>> model(np.zeros((1, 3), np.int32)).shape
      (1, 3, 11)
    """

    model_type = "smollm3"

    def __init__(self, *args: Any, rotates: tuple[bool, ...] | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        if rotates is not None:
            self.model = _with_rotating(self.model, rotates)

    @classmethod
    def hf_options(cls, config: Any) -> dict[str, Any]:
        sizes = window(config, layer_types=True)
        windows = {"windows": sizes} if isinstance(sizes, tuple) else {"window": sizes}
        return {"rotates": rotating_layers(config), **windows}

    @classmethod
    def hf_values(cls, model: Any, config: Any) -> Any:
        """Llama's per-layer values (the windows) and each layer's ``member_rotates``."""
        model = super().hf_values(model, config)
        rotates = rotating_layers(config)
        return model if rotates is None else model.replace(model=_with_rotating(model.model, rotates))
