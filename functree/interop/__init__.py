"""Weights in other frameworks' names and files: torch state dicts and ``.safetensors``.

:func:`load_torch_state_dict` fills a model of ``ft.nn`` layers from a torch ``state_dict``
(or a ``.safetensors`` file, a sharded checkpoint's index, or a directory of either;
a torch pickle such as ``pytorch_model.bin`` is refused: pass ``torch.load(path,
weights_only=True)``), converting each layer's
layout (a ``Linear``'s ``[out, in]`` weight, a ``Conv2d``'s ``OIHW`` kernel, fused gates);
:func:`torch_state_dict` gives the weights back under torch's names. ``.safetensors`` files
are read memory-mapped and validated by every rule the safetensors library applies
(``functree/interop/_safetensors.py``); host copies into the target layout are
``_host.py``'s. Also ``ft.nn.<name>``, where they were first documented.
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the names below, for type checkers, editors and the API reference
    from functree.interop._torch import load_torch_state_dict, torch_state_dict

# Each public name -> its private module, imported on first use (PEP 562): the torch
# layouts stay unimported until a name is read (``functree.hf`` reads ``.safetensors`` files
# through ``functree.interop._safetensors`` alone).
_HOMES = {
    "load_torch_state_dict": "functree.interop._torch",
    "torch_state_dict": "functree.interop._torch",
}


def __getattr__(name: str):
    """The names of ``_HOMES``: imported from their module on this first read."""
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # found once: later reads are plain module attributes
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOMES})


__all__ = ["load_torch_state_dict", "torch_state_dict"]
