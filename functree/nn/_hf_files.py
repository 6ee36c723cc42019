"""What ``ft.nn.from_hf`` reads from files: a ``save_pretrained`` directory's ``config.json``
and its weights (``.safetensors`` files, read by :mod:`functree.nn._safetensors`)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from functree.nn._safetensors import load_checkpoint

BAD_CONFIG = """\
ft.nn.from_hf: the first argument is a Hugging Face model (torch) or config, a dict with \
"model_type" (a config.json), or a directory saved by save_pretrained; got {given}.

    right:  ft.nn.from_hf(hf_model)
       or:  ft.nn.from_hf("path/to/saved_model")                  # config.json + *.safetensors
       or:  ft.nn.from_hf(hf_model.config, "model.safetensors")
"""

NO_CONFIG_JSON = """\
ft.nn.from_hf({path!r}): the directory has no config.json (found: {found}). A directory \
from save_pretrained holds config.json and the weights.

    right:  ft.nn.from_hf(config, {path!r})     # the config given, the weights read from the directory
"""

BAD_CONFIG_JSON = """\
ft.nn.from_hf: {path!r} is not a config.json this reads ({why}). A save_pretrained \
directory's config.json is one JSON object {{"model_type": ..., "hidden_size": ..., ...}}; \
this one is damaged or was altered.

    right:  hf_config.save_pretrained(directory)     # writes config.json again
       or:  ft.nn.from_hf(hf_config, weights)         # the config given, not read from the file
"""

BAD_WEIGHTS = """\
ft.nn.from_hf: weights are a state dict {{name: tensor or array}}, the path of a .safetensors \
file or of a sharded checkpoint's index (model.safetensors.index.json), or a directory holding \
them; got {given}.

    right:  ft.nn.from_hf(config, "path/to/model.safetensors")
       or:  ft.nn.from_hf(config, "path/to/saved_model")
       or:  ft.nn.from_hf(config, hf_model.state_dict())
"""


def _config(source: Any) -> Any:
    """The HF config of ``from_hf``'s first argument: a config object as given, a
    ``config.json`` dict, or a ``save_pretrained`` directory's ``config.json``."""
    if isinstance(source, Mapping):
        if "model_type" not in source:
            raise ValueError(BAD_CONFIG.format(given=f"a dict without 'model_type' (keys {sorted(source)[:6]})"))
        import transformers

        options = {k: v for k, v in source.items() if k != "model_type"}
        return transformers.AutoConfig.for_model(source["model_type"], **options)
    if isinstance(source, (str, os.PathLike)) and os.path.isdir(source):
        return _config(_read_json(source))
    if not hasattr(source, "model_type"):
        raise ValueError(BAD_CONFIG.format(given=type(source).__name__ if not isinstance(source, (str, os.PathLike))
                                           else f"{os.fspath(source)!r}, not a directory"))
    return source


def _read_json(directory: Any) -> dict[str, Any]:
    """A directory's ``config.json`` as a dict with a ``model_type``, else an error naming the file."""
    path = os.path.join(os.fspath(directory), "config.json")
    if not os.path.isfile(path):
        raise ValueError(NO_CONFIG_JSON.format(path=os.fspath(directory), found=sorted(os.listdir(directory))[:8]))
    try:
        with open(path, encoding="utf-8") as f:
            values = json.load(f)
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise ValueError(BAD_CONFIG_JSON.format(path=path, why=f"not JSON: {e}")) from None
    if not isinstance(values, dict):
        raise ValueError(BAD_CONFIG_JSON.format(path=path, why=f"a JSON {type(values).__name__}, not an object"))
    if not isinstance(values.get("model_type"), str):
        raise ValueError(BAD_CONFIG_JSON.format(path=path, why=f"model_type is {values.get('model_type')!r}, "
                                                                 "not a model type's name"))
    return values


def _weights(weights: Any) -> Mapping[str, Any]:
    """``from_hf``'s weights: a state dict as given, or the tensors of a checkpoint's files."""
    if isinstance(weights, (str, os.PathLike)):
        return load_checkpoint(weights, "ft.nn.from_hf")
    if not isinstance(weights, Mapping):
        raise ValueError(BAD_WEIGHTS.format(given=type(weights).__name__))
    return weights
