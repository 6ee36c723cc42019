"""The Hugging Face config a :func:`ft.nn.from_hf` model carries: ``model.hf_config``.

:class:`HFConfig` is an immutable, hashable mapping of ``config.json``'s values (what
``config.to_dict()`` holds: JSON values, lists as tuples, objects as nested HFConfigs),
with ``generation_config.json``'s values as ``hf_config.generation`` (empty when the source
had none). It is a static field of the model (part of its tree definition: hashed once,
compared by content), so a jitted function sees it as configuration, and :func:`ft.nn.save_hf`
writes it back as ``config.json``. The file's provenance (``transformers_version``,
``_name_or_path``: :data:`PROVENANCE`) is not kept: the same model read from another path or
written by another transformers version has the same tree definition. Generation reads eos and pad ids from it::

    eos = model.hf_config.generation.get("eos_token_id", model.hf_config.get("eos_token_id"))
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from typing import Any

from functree.hf._files import read_generation, read_legacy_generation

__all__ = ["HFConfig", "hf_config_of"]

NOT_JSON = """\
ft.nn.from_hf: the config's {key!r} is {given!r} ({kind}), not a JSON value; config.json \
holds only JSON values (strings, numbers, booleans, null, lists, objects).

    right:  a config whose to_dict() is JSON (as save_pretrained writes it)
"""

TOO_DEEP = """\
ft.nn.from_hf: the config's {key!r} holds lists or objects nested deeper than Python's \
recursion limit (config.json / generation_config.json is damaged: no Hugging Face config \
nests so deep).

    wrong:  {{"{key}": [[[[[[...]]]]]]}}   (hundreds of levels)
    right:  the file as save_pretrained writes it (values nested a few levels at most)
"""


# Where the file came from, not what the model is: transformers drops _name_or_path when it
# saves and writes its own version. Kept, two copies of one model written by other versions
# (or read from other paths) had other tree definitions: a jitted step compiled again.
PROVENANCE = frozenset({"transformers_version", "_name_or_path"})


def _frozen(value: Any, key: str) -> Any:
    """A JSON value made immutable: objects as HFConfig, lists as tuples."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    try:
        if isinstance(value, Mapping):
            return HFConfig(value)
        if isinstance(value, (list, tuple)):
            return tuple([_frozen(v, key) for v in value])
    except RecursionError:  # a file's nesting is data: named, not a crash deep in the freeze
        raise ValueError(TOO_DEEP.format(key=key)) from None
    raise TypeError(NOT_JSON.format(key=key, given=value, kind=type(value).__name__))


def _thawed(value: Any) -> Any:
    if isinstance(value, HFConfig):
        return value.to_dict()
    if isinstance(value, tuple):
        return [_thawed(v) for v in value]
    return value


class HFConfig(Mapping[str, Any]):
    """An immutable, hashable ``config.json`` (``hf_config["vocab_size"]``, ``.get``, ``in``),
    and its ``generation`` config (an HFConfig, empty when there was none).

    Example:
      >>> from functree.hf._config import HFConfig
      >>> c = HFConfig({"model_type": "gpt2", "eos_token_id": 0, "architectures": ["GPT2LMHeadModel"]},
      ...              generation={"eos_token_id": 50256})
      >>> c["architectures"], c.generation["eos_token_id"], hash(c) == hash(HFConfig(c.to_dict(), c.generation))
      (('GPT2LMHeadModel',), 50256, True)
      >>> c.to_dict()["architectures"]
      ['GPT2LMHeadModel']
    """

    __slots__ = ("_generation", "_hash", "_values")

    def __init__(self, values: Mapping[str, Any], generation: Mapping[str, Any] | None = None):
        frozen = {str(k): _frozen(v, str(k)) for k, v in values.items() if k not in PROVENANCE}
        object.__setattr__(self, "_values", frozen)
        # None: the source had no generation config; an empty one (a file of `{}`, or of
        # provenance keys only) is kept: Hugging Face reads it alone, never config.json's ids.
        gen = None if generation is None else (generation if isinstance(generation, HFConfig) else HFConfig(generation))
        object.__setattr__(self, "_generation", gen)
        # hashed once: it is part of the model's tree definition, hashed on every jitted call
        object.__setattr__(self, "_hash", hash((tuple(sorted(frozen.items(), key=lambda kv: kv[0])), gen)))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"HFConfig is immutable; build a new one: HFConfig({{**config.to_dict(), {name!r}: ...}})")

    @property
    def generation(self) -> HFConfig:
        """``generation_config.json``'s values (an empty HFConfig when the source had none)."""
        return _EMPTY if self._generation is None else self._generation

    @property
    def has_generation(self) -> bool:
        """Whether the source had a generation config (``generation_config.json``, an HF
        model's ``generation_config``), even an empty one."""
        return self._generation is not None

    def __getitem__(self, key: str) -> Any:
        return self._values[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if not isinstance(other, HFConfig):
            return NotImplemented
        return self._hash == other._hash and self._values == other._values and self.has_generation == \
            other.has_generation and self.generation._values == other.generation._values

    def __repr__(self) -> str:  # short: it shows in the model's repr
        kind = self._values.get("model_type")
        gen = f", generation: {len(self.generation)} keys" if len(self.generation) else ""
        return f"HFConfig({kind!r}, {len(self)} keys{gen})" if kind else f"HFConfig({len(self)} keys{gen})"

    def __reduce__(self) -> Any:
        return (HFConfig, (self.to_dict(), None if self._generation is None else self._generation.to_dict()))

    def to_dict(self) -> dict[str, Any]:
        """The values as plain JSON data (``json.dump`` writes them as config.json)."""
        return {k: _thawed(v) for k, v in self._values.items()}


_EMPTY = HFConfig({})



# Pickles record HFConfig under the module it was defined in before functree.hf existed;
# functree/nn/_hf_config.py is that name (as functree.hf._models.RECORDED_HOME for the models).
HFConfig.__module__ = "functree.nn._hf_config"

def _json_config(config: Any) -> dict[str, Any]:
    """An HF config object's values as JSON data (its ``to_json_string``: dtypes as names)."""
    if hasattr(config, "to_json_string"):
        return json.loads(config.to_json_string(use_diff=False))
    if hasattr(config, "to_dict"):
        return dict(config.to_dict())
    return {k: v for k, v in vars(config).items() if not k.startswith("_")}


def hf_config_of(config: Any, source: Any) -> HFConfig:
    """The HFConfig of ``config`` (the HF config object from_hf read), with the generation
    config of ``source``: an HF model's ``generation_config``, a directory's
    ``generation_config.json``; none otherwise."""
    generation = None
    given = getattr(source, "generation_config", None)
    if isinstance(source, (str, os.PathLike)) and os.path.isdir(source):
        generation = read_generation(source)  # a damaged file is an error naming it
        if generation is None:  # an older config.json's options, which HF's from_pretrained applies
            generation = read_legacy_generation(source)
    elif given is not None and hasattr(source, "state_dict"):
        generation = _json_config(given)
    values = _json_config(config)
    if type(config).__name__ == "MistralConfig":
        # HF's MistralForCausalLM ignores layer_types (every layer slides), but AutoConfig reads
        # a mistral file that keeps them as Ministral (each layer its type's mask): another model.
        values.pop("layer_types", None)
    return HFConfig(values, generation)
