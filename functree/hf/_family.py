"""A Hugging Face family is one class: :class:`HFModel` and the table built from its subclasses.

Each model class :func:`ft.nn.from_hf` builds declares, as class variables, what its family
is: the ``model_type`` it covers (a class declaring one joins :data:`FAMILIES`), the HF class
it equals (``hf_class``, by default its own name), how it is built from a config
(:meth:`HFModel.from_config`), its tied head's weight names (``hf_head``), the embedding HF
builds with ``padding_idx`` (``hf_padded``), the layers HF initializes scaled by
``1 / sqrt(2 * n_layer)`` (``hf_residual``), the older checkpoint names HF's loader reads
(:meth:`HFModel.hf_names`) and the layouts and renames of its weights (``hf_layouts``,
``hf_rename``). A family built like another is a subclass that overrides its difference
(``Qwen2ForCausalLM(LlamaForCausalLM)``), as transformers' modular files write them::

    class Qwen2ForCausalLM(LlamaForCausalLM):
        model_type = "qwen2"

        @classmethod
        def hf_options(cls, config):
            return {"attention_bias": True, "output_bias": False}

:data:`FAMILIES` (model type -> its class) and :data:`COVERED` (model type -> HF class
name) are the registered classes themselves, so every reader (``from_hf``,
``to_hf_state_dict``, ``save_hf``, LoRA's names) sees a new family at once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any, ClassVar

import numpy as np

from functree._module import Module
from functree._state_dict import to_numpy

__all__ = ["FAMILIES", "COVERED", "TASKS", "HFModel", "family_of", "renamed"]

FAMILY_TAKEN = """\
{new}: model_type {model_type!r} is already covered by {old}; a model type is one family \
(from_hf would not know which class to build).

    wrong:  class {short}({base}):  model_type = {model_type!r}
    right:  class {short}({base}):  model_type = "my_{model_type}"     # a model type of its own
       or:  del FAMILIES[{model_type!r}]                                # replace the family on purpose
"""


RENAME_COLLIDES = """\
ft.nn.from_hf: the weights hold both {old!r} and {new!r}{values}: {family} reads {old!r} \
(an older file's name) as {new!r}, so the two are one tensor. transformers keeps one of the \
two without a word (the older name's, for GPT-NeoX's embed_out and BERT's LayerNorm.gamma); \
which one is the model's is not in the file, so neither was read.

    wrong:  {{..., {old!r}: ..., {new!r}: ...}}
    right:  weights.pop({new!r})   # or weights.pop({old!r}): the state dict keeps the one meant
"""


# model type -> its class, filled by HFModel subclasses that declare a model_type (in the order defined).
FAMILIES: dict[str, type[HFModel]] = {}
# HF class name -> a family's task model (LlamaForSequenceClassification): the classes
# functree.hf._heads makes from its heads and these families (one class per pair, none written out).
TASKS: dict[str, type[HFModel]] = {}


class _Covered(Mapping[str, str]):
    """model type -> HF class name, read from :data:`FAMILIES` (a family added or removed shows at once)."""

    def __getitem__(self, model_type: str) -> str:
        return FAMILIES[model_type].hf_class

    def __iter__(self) -> Iterator[str]:
        return iter(FAMILIES)

    def __len__(self) -> int:
        return len(FAMILIES)

    def __repr__(self) -> str:
        return repr(dict(self))


COVERED: Mapping[str, str] = _Covered()


def family_of(model: Any) -> type[HFModel] | None:
    """The family whose class ``model`` is (exactly: a subclass is a family of its own), or
    the task class of :data:`TASKS` it is, or None."""
    family = FAMILIES.get(getattr(type(model), "model_type", None) or "")
    if family is not None and type(model) is family:
        return family
    task = TASKS.get(getattr(type(model), "hf_class", None) or "")
    return task if task is not None and type(model) is task else None


class HFModel(Module):
    """A Hugging Face model class as a functree model; a subclass with a ``model_type`` is a
    family of :data:`FAMILIES` (module docstring). It declares no field: each model class
    declares its own (HF's module names, then ``hf_config``), so the pytree is the HF tree.

    Example:
      >>> from functree.hf._family import COVERED, FAMILIES
      >>> qwen2 = FAMILIES["qwen2"]                      # the family is the class
      >>> qwen2.__name__, qwen2.__mro__[1].__name__, qwen2.model_type, COVERED["qwen2"]
      ('Qwen2ForCausalLM', 'LlamaForCausalLM', 'qwen2', 'Qwen2ForCausalLM')
      >>> qwen2.hf_head                                  # inherited from LlamaForCausalLM
      ('lm_head.weight', 'model.embed_tokens.weight')
    """

    model_type: ClassVar[str | None] = None  # the config's model_type this class covers (None: a base)
    hf_class: ClassVar[str] = ""  # the HF class it equals; "" = the class's own name
    hf_head: ClassVar[tuple[str, str] | None] = None  # a tied head's (head, embedding) weight names
    hf_ties: ClassVar[tuple[tuple[str, str], ...]] = ()  # other tied (copy, tensor) names: state_dict() holds both
    hf_padded: ClassVar[str | None] = None  # the embedding HF builds with padding_idx (its row zeroed at init)
    hf_padded_also: ClassVar[tuple[str, ...]] = ()  # other tables built with padding_idx = pad_token_id (RoBERTa's positions)
    hf_residual: ClassVar[tuple[str, ...]] = ()  # the layers HF initializes at std / sqrt(2 * n_layer)
    hf_layouts: ClassVar[dict[str, Any]] = {}  # ft.nn.load_torch_state_dict's layouts=
    hf_rename: ClassVar[dict[str, str]] = {}  # ft.nn.load_torch_state_dict's rename=
    # Name prefixes of the tensors this family's checkpoints hold for heads a loaded class may lack
    # (bert-base-uncased's NSP head and pooler in a masked LM's file): left unread with
    # UnreadTensorsWarning, as transformers' loader leaves them (functree.hf._load).
    hf_unread: ClassVar[tuple[str, ...]] = ()
    # What PEFT's "all-linear" adapts beyond the HF class's torch Linear modules: PEFT 0.21's MoE
    # conversion for transformers 5, by model type (Mixtral's names: its router, experts.w1/w3/w2 were
    # Linears in transformers 4). Parameter name ends -> the multiple of r and lora_alpha PEFT
    # gives them (2 for gate_up_proj, which fuses w1 and w3).
    hf_all_linear: ClassVar[dict[str, int]] = {}
    __ft_template_static__: ClassVar[tuple[str, ...]] = ("hf_config",)  # a restore's template decides them (how it is saved and generates by default)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "hf_class" not in cls.__dict__:
            cls.hf_class = cls.__name__
        if cls.__dict__.get("model_type") is not None:
            _register(cls)

    @classmethod
    def from_config(cls, config: Any, names: set[str], dtype: Any, key: Any, attention: str) -> Any:
        """This family's model for an HF ``config`` (``names``: the checkpoint's weight
        names, for parts a file may lack, as BERT's pooler), parameters in ``dtype``."""
        raise NotImplementedError(f"{cls.__name__}.from_config")

    @classmethod
    def hf_values(cls, model: Any, config: Any) -> Any:
        """``model`` with the values ``config`` decides that are no weights (a layer's own
        attention options, one per Stack member: GPT-2's logit scales, Qwen2's windows),
        set again after weights were loaded into a template built without values (from_hf)."""
        return model

    @classmethod
    def hf_initial(cls, model: Any, config: Any) -> Any:
        """``model`` (drawn as HF's ``_init_weights`` draws: ``_load._hf_initialized``) with the
        values that init sets past its draws (DistilBERT's sinusoidal position table), for
        ``from_hf(config, key=)``; loaded weights never pass here."""
        return model

    @classmethod
    def hf_names(cls, weights: dict[str, Any]) -> dict[str, Any]:
        """Checkpoint names as this class's HF counterpart's ``state_dict`` has them (older files)."""
        return weights

    @classmethod
    def hf_dropout(cls, config: Any) -> dict[str, float] | None:
        """Hugging Face's dropout rates of this family read from ``config``, by position
        (``embedding``, ``attention``, ``attention_output``, ``mlp_output``:
        :mod:`functree.hf._dropout`), for ``from_hf(..., dropout=True)``; None: not ported."""
        return None


def renamed(weights: dict[str, Any], rename: Callable[[str], str], family: str) -> dict[str, Any]:
    """``weights`` with each name ``k`` as ``rename(k)`` (older files' names as the class's
    ``state_dict`` has them), refusing a rename onto a name the weights already hold with
    other values (:data:`RENAME_COLLIDES`); an equal copy is the same tensor, kept once."""
    out: dict[str, Any] = {}
    for key, value in weights.items():
        new = rename(key)
        if new != key and new in weights:
            _same_or_refuse(key, value, new, weights[new], family)
            continue  # the copy under the new name is read
        out[new] = value
    return out


def _same_or_refuse(old: str, value: Any, new: str, other: Any, family: str) -> None:
    a, b = _values(value), _values(other)
    if a.shape == b.shape and a.dtype == b.dtype and np.array_equal(a, b):
        return
    values = " (other values)" if a.shape == b.shape else f" (shapes {list(a.shape)} and {list(b.shape)})"
    raise ValueError(RENAME_COLLIDES.format(old=old, new=new, values=values, family=family))


def _values(x: Any) -> np.ndarray:
    converted = to_numpy(x)  # a torch tensor (bfloat16 too) as NumPy
    return np.asarray(x) if converted is None else converted


def _register(cls: type[HFModel]) -> None:
    model_type = cls.model_type
    assert model_type is not None
    old = FAMILIES.get(model_type)
    if old is not None and old.__qualname__ != cls.__qualname__:
        base = cls.__mro__[1].__name__
        raise TypeError(FAMILY_TAKEN.format(new=cls.__name__, model_type=model_type, old=old.__name__,
                                            short=cls.__name__, base=base))
    FAMILIES[model_type] = cls
