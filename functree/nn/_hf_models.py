"""The model classes :func:`ft.nn.from_hf` builds out of ``ft.nn`` layers, one module per
architecture: GPT-2 (:mod:`._hf_gpt2`), Llama and the families built like it, Qwen2,
Mistral, Gemma and Phi-3 (:mod:`._hf_llama`), GPT-NeoX (:mod:`._hf_neox`), OPT
(:mod:`._hf_opt`) and BERT (:mod:`._hf_bert`); what they share is :mod:`._hf_causal` (the
calls) and :mod:`._hf_family` (a family as one class, and the table of families).

Importing this module defines every covered family (each class joins
:data:`~functree.nn._hf_family.FAMILIES` as it is defined). It is also the classes' recorded
home: checkpoints (``ft.train.save`` without a public name for them) and pickles record a
class as ``functree.nn._hf_models.<name>``, as they did before the classes had modules of
their own, so those classes get this module as their ``__module__`` (:data:`RECORDED`) and
the files they live in can move without changing a saved name. A class added later keeps its
own module's name (nothing older records it).
"""

from __future__ import annotations

# The order the families are defined is FAMILIES' order (from_hf's "covered:" lists).
# isort: off
from functree.nn._hf_gpt2 import GPT2Block, GPT2LMHeadModel, GPT2MLP, GPT2Model
from functree.nn._hf_llama import (
    GemmaForCausalLM,
    GemmaRMSNorm,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
    MistralForCausalLM,
    Phi3ForCausalLM,
    Phi3MLP,
    Qwen2ForCausalLM,
)
from functree.nn._hf_neox import GPTNeoXForCausalLM, GPTNeoXLayer, GPTNeoXMLP, GPTNeoXModel
from functree.nn._hf_opt import OPT_OFFSET, OPTDecoder, OPTDecoderLayer, OPTForCausalLM, OPTModel
from functree.nn._hf_bert import BERT_RENAME, BertEmbeddings, BertEncoder, BertLayer, BertModel
from functree.nn._hf_causal import check_token_ids
# isort: on

__all__ = ["GPT2LMHeadModel", "LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM", "GemmaForCausalLM",
           "Phi3ForCausalLM", "GPTNeoXForCausalLM", "OPTForCausalLM", "BertModel",
           "GPT2Model", "GPT2Block", "GPT2MLP", "LlamaModel", "LlamaDecoderLayer", "LlamaMLP", "Phi3MLP",
           "GemmaRMSNorm", "GPTNeoXModel", "GPTNeoXLayer", "GPTNeoXMLP", "OPTModel", "OPTDecoder",
           "OPTDecoderLayer", "OPT_OFFSET", "BertEmbeddings", "BertLayer", "BertEncoder", "BERT_RENAME",
           "check_token_ids"]

# The names checkpoints and pickles recorded before the split (module docstring): every class of a model's tree.
RECORDED = (GPT2LMHeadModel, GPT2Model, GPT2Block, GPT2MLP, LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM,
            GemmaForCausalLM, Phi3ForCausalLM, LlamaModel, LlamaDecoderLayer, LlamaMLP, Phi3MLP, GemmaRMSNorm,
            GPTNeoXForCausalLM, GPTNeoXModel, GPTNeoXLayer, GPTNeoXMLP, OPTForCausalLM, OPTModel, OPTDecoder,
            OPTDecoderLayer, BertModel, BertEmbeddings, BertEncoder, BertLayer)
for _cls in RECORDED:
    _cls.__module__ = __name__
