"""The model classes :func:`ft.hf.from_hf` builds out of ``ft.nn`` layers, one module per
architecture: GPT-2 (:mod:`._gpt2`), Llama and the families built like it, Qwen2,
Mistral, Ministral, Gemma, Phi-3, OLMo, Qwen3, OLMo2, Gemma 2 and Gemma 3 (:mod:`._llama`), Granite
(:mod:`._granite`), SmolLM3 (:mod:`._smollm3`), GPT-NeoX (:mod:`._neox`), Phi (:mod:`._phi`), Mixtral (:mod:`._mixtral`), Qwen3-MoE (:mod:`._qwen3_moe`), OLMoE (:mod:`._olmoe`), Qwen2-MoE (:mod:`._qwen2_moe`), OPT
(:mod:`._opt`), BERT (:mod:`._bert`), RoBERTa (:mod:`._roberta`) and DistilBERT (:mod:`._distilbert`); what they share is :mod:`._causal` (the
calls) and :mod:`._family` (a family as one class, and the table of families).

Importing this module defines every covered family (each class joins
:data:`~functree.hf._family.FAMILIES` as it is defined). It also gives the classes their
recorded name: checkpoints (``ft.train.save`` without a public name for them) and pickles
record a class as ``functree.nn._hf_models.<name>`` (:data:`RECORDED_HOME`), where the
classes were defined before ``functree.hf`` existed. That name is kept, so files written
before and after the move read both ways: each class of :data:`RECORDED` gets it as its
``__module__``, and ``functree/nn/_hf_models.py`` is the module a pickle imports under it
(a re-export of this one). A class added later keeps its own module's name (nothing older
records it).
"""

from __future__ import annotations

# The order the families are defined is FAMILIES' order (from_hf's "covered:" lists).
# isort: off
from functree.hf._gpt2 import GPT2Block, GPT2LMHeadModel, GPT2MLP, GPT2Model
from functree.hf._llama import (
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    GemmaForCausalLM,
    GemmaRMSNorm,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
    MinistralForCausalLM,
    MistralForCausalLM,
    Olmo2ForCausalLM,
    OlmoForCausalLM,
    Phi3ForCausalLM,
    Phi3MLP,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
)
from functree.hf._granite import GraniteDecoderLayer, GraniteForCausalLM
from functree.hf._smollm3 import SmolLM3ForCausalLM
from functree.hf._neox import GPTNeoXForCausalLM, GPTNeoXLayer, GPTNeoXMLP, GPTNeoXModel
from functree.hf._phi import PhiDecoderLayer, PhiForCausalLM, PhiMLP, PhiModel
from functree.hf._mixtral import MixtralForCausalLM
from functree.hf._qwen3_moe import Qwen3MoeForCausalLM
from functree.hf._olmoe import OlmoeForCausalLM
from functree.hf._qwen2_moe import Qwen2MoeForCausalLM
from functree.hf._opt import OPT_OFFSET, OPTDecoder, OPTDecoderLayer, OPTForCausalLM, OPTModel
from functree.hf._bert import BERT_RENAME, BertEmbeddings, BertEncoder, BertLayer, BertModel
from functree.hf._roberta import RobertaModel, XLMRobertaModel
from functree.hf._distilbert import DistilBertEmbeddings, DistilBertModel
from functree.hf._causal import check_token_ids
# isort: on

__all__ = ["GPT2LMHeadModel", "LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM", "MinistralForCausalLM",
           "GemmaForCausalLM", "Phi3ForCausalLM", "OlmoForCausalLM", "Qwen3ForCausalLM", "Olmo2ForCausalLM",
           "Gemma2ForCausalLM", "Gemma3ForCausalLM", "GraniteForCausalLM", "GraniteDecoderLayer", "SmolLM3ForCausalLM", "GPTNeoXForCausalLM", "PhiForCausalLM", "MixtralForCausalLM", "Qwen3MoeForCausalLM", "OlmoeForCausalLM", "Qwen2MoeForCausalLM", "OPTForCausalLM", "BertModel",
           "GPT2Model", "GPT2Block", "GPT2MLP", "LlamaModel", "LlamaDecoderLayer", "LlamaMLP", "Phi3MLP",
           "GemmaRMSNorm", "GPTNeoXModel", "GPTNeoXLayer", "GPTNeoXMLP", "PhiModel", "PhiDecoderLayer", "PhiMLP", "OPTModel", "OPTDecoder",
           "OPTDecoderLayer", "OPT_OFFSET", "BertEmbeddings", "BertLayer", "BertEncoder", "BERT_RENAME",
           "RobertaModel", "XLMRobertaModel", "DistilBertModel", "DistilBertEmbeddings", "check_token_ids", "RECORDED", "RECORDED_HOME"]

# The names checkpoints and pickles recorded before the split (module docstring): every class of a model's tree.
RECORDED = (GPT2LMHeadModel, GPT2Model, GPT2Block, GPT2MLP, LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM,
            GemmaForCausalLM, Phi3ForCausalLM, LlamaModel, LlamaDecoderLayer, LlamaMLP, Phi3MLP, GemmaRMSNorm,
            GPTNeoXForCausalLM, GPTNeoXModel, GPTNeoXLayer, GPTNeoXMLP, OPTForCausalLM, OPTModel, OPTDecoder,
            OPTDecoderLayer, BertModel, BertEmbeddings, BertEncoder, BertLayer)
RECORDED_HOME = "functree.nn._hf_models"
for _cls in RECORDED:
    _cls.__module__ = RECORDED_HOME
