"""Allen AI's OLMoE (``model_type: "olmoe"``: OLMoE-1B-7B) as a functree model: Hugging Face's
``OlmoeForCausalLM``.

Llama's pre-norm blocks (RMSNorm) whose attention normalizes the whole query and key
projections (``q_norm`` of size ``hidden_size``, ``k_norm`` of ``hidden_size / heads *
num_key_value_heads``: OLMo 2's, before the split into heads), then clamps q, k and v to
``[-clip_qkv, clip_qkv]`` where the config sets it (after the norms, as HF's
``OlmoeAttention``), and whose MLP is a sparse mixture of experts (:class:`ft.nn.SparseMoE`):
each token's ``num_experts_per_tok`` of ``num_experts`` SwiGLU experts of
``intermediate_size``, renormalized where ``norm_topk_prob`` (OLMoE-1B-7B's: false, the
softmax's own weights). HF's OLMoE has no sliding window (its mask is causal alone) and no
task heads.

Weights: transformers 5.25's fused layout and the Hub's per-expert one
(``mlp.experts.{e}.gate_proj`` / ``up_proj`` / ``down_proj`` ``.weight``, transformers'
``"qwen2_moe"`` conversion; :func:`~functree.hf._mixtral.per_expert_names`). The
load-balancing loss as Mixtral's (:class:`~functree.hf._mixtral.RoutedExperts`): ``model(ids,
mask, router_logits=True)``, ``model.aux_loss(attention_mask=mask, router_logits=routed)``,
``router_aux_loss_coef`` (0.01 by default).
"""

from __future__ import annotations

from typing import Any

from functree._module import field
from functree.hf._llama import LlamaForCausalLM
from functree.hf._mixtral import OLMOE_EXPERTS, RoutedExperts, moe_options, per_expert_names

__all__ = ["OlmoeForCausalLM", "OLMOE_HEAD_DIM"]

OLMOE_HEAD_DIM = """\
ft.nn.from_hf: the olmoe config has head_dim={head_dim}, but Hugging Face's OlmoeAttention \
normalizes the queries over hidden_size={hidden} features (q_norm) and the keys over \
hidden_size / num_attention_heads * num_key_value_heads, so its projections are \
num_attention_heads * head_dim = {width} wide only with head_dim = hidden_size / \
num_attention_heads = {fix} (HF's model fails on another).

    wrong:  "head_dim": {head_dim}
    right:  "head_dim": {fix}     # or no head_dim: OLMoE's own config has none
"""


class OlmoeForCausalLM(RoutedExperts, LlamaForCausalLM):
    """Hugging Face's ``OlmoeForCausalLM`` (module docstring): Llama with OLMo 2's q/k norms
    over the whole projections, OLMo's ``clip_qkv`` and an :class:`ft.nn.SparseMoE` MLP
    (``renormalize``: ``norm_topk_prob``); ``router_aux_loss_coef`` is the config's.

    Example:
      >>> import functree as ft, jax, numpy as np
      >>> config = {"model_type": "olmoe", "vocab_size": 11, "hidden_size": 16, "intermediate_size": 8,
      ...           "num_hidden_layers": 2, "num_attention_heads": 2, "num_experts": 4, "num_experts_per_tok": 2}
      >>> model = ft.nn.from_hf(config, key=jax.random.key(0))
      >>> moe = model.model.layers.layers.mlp
      >>> moe.top_k, moe.renormalize, moe.experts.gate_up_proj.shape    # 2 layers, 4 experts of 8
      (2, False, (2, 4, 16, 16))
      >>> ids = np.zeros((1, 3), np.int32)
      >>> model(ids).shape, model.aux_loss(ids).shape
      ((1, 3, 11), ())
    """

    router_aux_loss_coef: float = field(static=True, default=0.01)
    model_type = "olmoe"
    hf_biases = ("attention_bias",)

    @classmethod
    def hf_options(cls, config: Any) -> dict[str, Any]:
        hidden, heads = config.hidden_size, config.num_attention_heads
        head_dim = getattr(config, "head_dim", None)
        if head_dim and head_dim * heads != hidden:
            raise ValueError(OLMOE_HEAD_DIM.format(head_dim=head_dim, hidden=hidden, width=head_dim * heads,
                                                   fix=hidden // heads))
        clip = getattr(config, "clip_qkv", None)
        return {"qk_norm": "projection", **({} if clip is None else {"clip": float(clip)}),
                **moe_options(config, renormalize=bool(config.norm_topk_prob), key="num_experts")}

    @classmethod
    def hf_names(cls, weights: dict[str, Any]) -> dict[str, Any]:
        """Llama's older names, and the Hub's per-expert layout as transformers reads it
        (:func:`~functree.hf._mixtral.per_expert_names` of ``mlp.experts.{e}.gate_proj`` ...)."""
        return per_expert_names(super().hf_names(weights), OLMOE_EXPERTS)
