"""Qwen's Qwen2-MoE (``model_type: "qwen2_moe"``: Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B) as a functree
model: Hugging Face's ``Qwen2MoeForCausalLM``.

Qwen2's blocks (RMSNorm, rotary grouped-query attention, q/k/v biased where ``qkv_bias``
(the default) and ``o_proj`` never, the config's ``layer_types`` deciding each layer's
sliding window where ``use_sliding_window``: Qwen2MoeConfig's own default slides the even
layers below ``max_window_layers``, one window per layer where the types mix) whose MLP is a
sparse mixture of experts with a **shared expert** (:class:`SharedExpertMoE`)::

    y = SparseMoE(x) + sigmoid(x . shared_expert_gate) * shared_expert(x)

the routed part :class:`ft.nn.SparseMoE`'s (the router ``mlp.gate``'s softmax in float32,
each token's ``num_experts_per_tok`` most likely of ``num_experts`` SwiGLU experts of
``moe_intermediate_size``, renormalized where ``norm_topk_prob``: Qwen1.5-MoE's is false),
the shared expert a SwiGLU MLP of ``shared_expert_intermediate_size`` that every token
passes, gated per token by ``shared_expert_gate`` (``[hidden, 1]``, no bias).

Every layer sparse: a config that makes some layer a dense MLP (``mlp_only_layers`` naming a
layer, ``decoder_sparse_step`` other than 1, ``num_experts`` 0) is refused naming the key
(:data:`~functree.hf._qwen3_moe.DENSE_LAYERS`, Qwen3-MoE's check: HF's two decoder layers
decide alike). Qwen2-MoE's released checkpoints are every layer sparse.

Weights: transformers 5.25's fused layout (``mlp.experts.gate_up_proj`` ``[E, 2I, H]``,
``mlp.experts.down_proj`` ``[E, H, I]``), which ``save_hf`` writes, and the Hub's per-expert
layout (``mlp.experts.{e}.gate_proj`` / ``up_proj`` / ``down_proj`` ``.weight``) read as
transformers' ``"qwen2_moe"`` conversion reads it (:func:`~functree.hf._mixtral.per_expert_names`);
the shared expert's names are HF's (``mlp.shared_expert.gate_proj.weight``,
``mlp.shared_expert_gate.weight``) in both.

Task heads: HF's ``Qwen2MoeForSequenceClassification``, ``ForTokenClassification`` and
``ForQuestionAnswering`` (``functree.hf._heads``' ``HEADS`` row; the QA body is ``model``).

The load-balancing loss as Mixtral's (:class:`~functree.hf._mixtral.RoutedExperts`: the
routed experts' router logits; the shared expert has no router)::

    logits, routed = model(input_ids, attention_mask, router_logits=True)
    loss = lm_loss(logits) + model.router_aux_loss_coef * model.aux_loss(attention_mask=attention_mask,
                                                                           router_logits=routed)
"""

from __future__ import annotations

import importlib.metadata
import re
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from functree._activations import silu
from functree._module import field
from functree._random import one_key
from functree.hf._llama import LlamaMLP, Qwen2ForCausalLM
from functree.hf._mixtral import (
    QWEN_EXPERTS,
    RoutedExperts,
    moe_options,
    per_expert_names,
)
from functree.hf._options import window
from functree.hf._qwen3_moe import check_every_layer_sparse
from functree.nn._linear import Dense
from functree.nn._moe import SparseMoE

__all__ = ["Qwen2MoeForCausalLM", "SharedExpertMoE", "QWEN2_MOE_EXPERTS"]

QWEN2_MOE_EXPERTS = QWEN_EXPERTS._replace(family="Qwen2-MoE")


def _peft_converts_qwen2_moe() -> bool:
    """Whether the installed PEFT's ``"all-linear"`` converts a Qwen2-MoE (0.22 on; no PEFT:
    the newest's behaviour). Read from the package's metadata: PEFT is not imported."""
    try:
        version = importlib.metadata.version("peft")
    except importlib.metadata.PackageNotFoundError:
        return True
    numbers = [int(part) for part in re.findall(r"\d+", version)[:2]]
    return tuple(numbers) >= (0, 22)


class SharedExpertMoE(SparseMoE):
    """Qwen2-MoE's sparse MoE block (HF's ``Qwen2MoeSparseMoeBlock``): the routed experts of
    :class:`ft.nn.SparseMoE` (its ``gate`` and ``experts``, its router logits recorded as
    ever) plus ``shared_expert`` (a SwiGLU MLP every token passes) gated per token by
    ``sigmoid(shared_expert_gate(x))`` (a Dense ``[d, 1]`` without bias).

    Example:
      >>> import functree as ft, jax
      >>> from functree.hf._qwen2_moe import SharedExpertMoE
      >>> moe = SharedExpertMoE(16, 8, 24, num_experts=4, top_k=2, key=jax.random.key(0))
      >>> moe.experts.gate_up_proj.shape, moe.shared_expert.up_proj.weight.shape, moe.shared_expert_gate.weight.shape
      ((4, 16, 16), (16, 24), (16, 1))
      >>> moe(jax.numpy.ones((2, 3, 16))).shape
      (2, 3, 16)
    """

    shared_expert: LlamaMLP
    shared_expert_gate: Dense

    def __init__(self, d: int, hidden: int, shared: int, *, num_experts: int, top_k: int = 2,
                 activation: Any = silu, renormalize: bool = False, key: jax.Array, dtype: Any = jnp.float32):
        k1, k2, k3 = jax.random.split(one_key(key), 3)
        super().__init__(d, hidden, num_experts=num_experts, top_k=top_k, activation=activation,
                         renormalize=renormalize, key=k1, dtype=dtype)
        self.shared_expert = LlamaMLP(d, shared, activation, False, key=k2, dtype=dtype)
        self.shared_expert_gate = Dense(d, 1, use_bias=False, key=k3, dtype=dtype)

    def __call__(self, x: jax.Array, *, key: jax.Array | None = None, return_logits: bool = False) -> Any:
        routed = super().__call__(x, key=key, return_logits=return_logits)
        y, logits = routed if return_logits else (routed, None)
        shared = jax.nn.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return (y + shared, logits) if return_logits else y + shared


class Qwen2MoeForCausalLM(RoutedExperts, Qwen2ForCausalLM):
    """Hugging Face's ``Qwen2MoeForCausalLM`` (module docstring): Qwen2 whose blocks' ``mlp``
    is a :class:`SharedExpertMoE` (``gate``: the router; ``experts``: ``gate_up_proj``
    ``[E, H, 2I]`` and ``down_proj`` ``[E, I, H]``; ``shared_expert`` and
    ``shared_expert_gate``; ``renormalize``: ``norm_topk_prob``). ``router_aux_loss_coef`` is
    the config's.

    Example:
      >>> import functree as ft, jax, numpy as np
      >>> config = {"model_type": "qwen2_moe", "vocab_size": 11, "hidden_size": 16, "num_hidden_layers": 2,
      ...           "num_attention_heads": 2, "num_key_value_heads": 1, "num_experts": 4, "num_experts_per_tok": 2,
      ...           "moe_intermediate_size": 6, "shared_expert_intermediate_size": 12}
      >>> model = ft.nn.from_hf(config, key=jax.random.key(0))
      >>> moe = model.model.layers.layers.mlp
      >>> moe.top_k, moe.renormalize, moe.experts.gate_up_proj.shape, moe.shared_expert.up_proj.weight.shape
      (2, False, (2, 4, 16, 12), (2, 16, 12))
      >>> ids = np.zeros((1, 3), np.int32)
      >>> model(ids).shape, model.router_logits(ids).shape, model.aux_loss(ids).shape
      ((1, 3, 11), (2, 3, 4), ())
    """

    router_aux_loss_coef: float = field(static=True, default=0.001)
    model_type = "qwen2_moe"
    # PEFT 0.21 converts no "qwen2_moe" config (its table maps other model types to Qwen2-MoE's
    # names, not this one): its "all-linear" adapts the Linears alone (the attention, the shared
    # expert and its gate), not the router or the stacked experts. PEFT 0.22 converts it as
    # Mixtral's (the router's weight, both stacked expert weights): "all-linear" is what the
    # installed PEFT adapts (the newest's where none is installed), so files agree with it.
    hf_all_linear: ClassVar[dict[str, int]] = (
        RoutedExperts.hf_all_linear if _peft_converts_qwen2_moe() else {})

    @classmethod
    def hf_options(cls, config: Any) -> dict[str, Any]:
        check_every_layer_sparse(config, model_type="qwen2_moe", mlp="Qwen2MoeMLP", family="Qwen2-MoE",
                                 example="Qwen1.5-MoE-A2.7B", experts_fix=60)
        # HF's Qwen2MoeConfig sets sliding_window 0 unless use_sliding_window: no window read then
        sizes = window(config, layer_types=True, enabled=bool(getattr(config, "use_sliding_window", False)))
        windows = {"windows": sizes} if isinstance(sizes, tuple) else {"window": sizes}
        return {"attention_bias": bool(getattr(config, "qkv_bias", True)), "output_bias": False, **windows,
                **moe_options(config, renormalize=bool(config.norm_topk_prob), size=config.moe_intermediate_size,
                              key="num_experts", layer=SharedExpertMoE, shared=config.shared_expert_intermediate_size)}

    @classmethod
    def hf_names(cls, weights: dict[str, Any]) -> dict[str, Any]:
        """Llama's older names, and the Hub's per-expert layout as transformers reads it
        (:func:`~functree.hf._mixtral.per_expert_names` of ``mlp.experts.{e}.gate_proj`` ...)."""
        return per_expert_names(super().hf_names(weights), QWEN2_MOE_EXPERTS)
