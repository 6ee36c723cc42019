"""Hugging Face models: families built from ``ft.nn`` layers, loading, export and PEFT files.

* :func:`from_hf` builds a model of a covered family (``functree.hf._family.FAMILIES``,
  listed in docs/guides/huggingface.md's table, which the tests check against it) from a
  ``config.json`` and its weights (a directory, a dict or a ``transformers`` model), reading ``.safetensors`` files memory-mapped; transformers
  is imported only for a ``transformers`` object.
* :func:`to_hf_state_dict` and :func:`save_hf` give the weights back under Hugging Face's
  names (``save_hf`` writes a directory ``from_pretrained`` reads).
* :func:`load_lora` and :func:`save_lora` read and write PEFT's adapter files for the
  adapters of ``ft.nn.lora``.
* :func:`task_loss` is Hugging Face's ``labels=`` loss of a task model ``from_hf`` builds
  (``LlamaForSequenceClassification``, ``BertForMaskedLM``: :mod:`functree.hf._heads`).
* :func:`with_head` gives a loaded model's body a fresh task head, as transformers'
  ``AutoModelForSequenceClassification.from_pretrained(causal_lm, num_labels=3)``.

Each but :func:`task_loss` and :func:`with_head` is also ``ft.nn.<name>``, where it was
first documented. A family is one class
(``functree/hf/_family.py``; one module per architecture: ``_llama.py``, ``_gpt2.py``,
``_neox.py``, ``_opt.py``, ``_bert.py``); see docs/development/layout.md, "How to add".
"""

# the heads written for one family: their HEADS rows and TASKS classes
from functree.hf import _distilbert_heads, _roberta_heads  # noqa: F401
from functree.hf._heads import task_loss
from functree.hf._load import UnreadTensorsWarning, from_hf, to_hf_state_dict
from functree.hf._peft import load_lora, save_lora
from functree.hf._save import save_hf
from functree.hf._with_head import with_head

__all__ = ["from_hf", "to_hf_state_dict", "save_hf", "load_lora", "save_lora", "task_loss", "with_head",
           "UnreadTensorsWarning"]
