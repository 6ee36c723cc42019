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

from functree.interop._torch import load_torch_state_dict, torch_state_dict

__all__ = ["load_torch_state_dict", "torch_state_dict"]
