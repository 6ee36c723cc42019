"""Qwen's Qwen3-MoE (``model_type: "qwen3_moe"``: Qwen3-30B-A3B, Qwen3-235B-A22B) as a functree
model: Hugging Face's ``Qwen3MoeForCausalLM``.

Qwen3's blocks (RMSNorm, rotary grouped-query attention with an RMSNorm over each head's
queries and keys, ``head_dim`` from the config, ``attention_bias`` on every projection or
none, every layer's ``sliding_window`` where ``use_sliding_window``) whose MLP is a sparse
mixture of experts (:class:`ft.nn.SparseMoE`): the router ``mlp.gate`` gives each token's
softmax in float32, its ``num_experts_per_tok`` most likely of the ``num_experts`` experts
are renormalized to sum to 1 where ``norm_topk_prob`` (else kept as they are: Qwen3-30B-A3B
sets it), each expert a SwiGLU MLP of ``moe_intermediate_size``.

Every layer sparse: a config that makes some layer a dense MLP (``mlp_only_layers`` naming a
layer, ``decoder_sparse_step`` other than 1, ``num_experts`` 0) is refused naming the key
(:data:`DENSE_LAYERS`): the blocks are one Stack of identical members. Qwen3-MoE's released
checkpoints are every layer sparse.

Weights: transformers 5.25's fused layout (``mlp.experts.gate_up_proj`` ``[E, 2I, H]``,
``mlp.experts.down_proj`` ``[E, H, I]``, ``mlp.gate.weight``), which ``save_hf`` writes, and
the Hub's per-expert layout (``mlp.experts.{e}.gate_proj`` / ``up_proj`` / ``down_proj``
``.weight``), read as transformers' conversion mapping reads it (``"qwen2_moe"``'s:
``gate_up_proj[e] = [gate_proj_e ; up_proj_e]``; :func:`~functree.hf._mixtral.per_expert_names`).

The load-balancing loss, as Mixtral's (:class:`~functree.hf._mixtral.RoutedExperts`)::

    logits, routed = model(input_ids, attention_mask, router_logits=True)
    loss = lm_loss(logits) + model.router_aux_loss_coef * model.aux_loss(attention_mask=attention_mask,
                                                                           router_logits=routed)
"""

from __future__ import annotations

import json
from typing import Any

from functree._module import field
from functree.hf._llama import Qwen3ForCausalLM
from functree.hf._mixtral import QWEN_EXPERTS, RoutedExperts, moe_options, per_expert_names
from functree.hf._options import window

__all__ = ["Qwen3MoeForCausalLM", "DENSE_LAYERS"]

DENSE_LAYERS = """\
ft.nn.from_hf: the {model_type} config has {key}={value}, which makes layer(s) {layers} of \
{count} a dense MLP (Hugging Face's {mlp}: a layer is sparse where it is not in \
mlp_only_layers, num_experts > 0 and (layer + 1) % decoder_sparse_step == 0); this port's \
blocks are one stack of identical sparse layers, so a model mixing dense and sparse layers \
is not covered ({family}'s released checkpoints are every layer sparse).

    wrong:  "{key}": {value_json}
    right:  "{key}": {fix}     # every layer sparse: the checkpoint's own config ({example}'s)
"""

_FIXES = {"mlp_only_layers": "[]", "decoder_sparse_step": "1"}


def check_every_layer_sparse(config: Any, *, model_type: str = "qwen3_moe", mlp: str = "Qwen3MoeMLP",
                             family: str = "Qwen3-MoE", example: str = "Qwen3-30B-A3B", experts_fix: int = 128,
                             key: str = "num_experts") -> None:
    """Every layer a sparse MoE, as HF's ``Qwen3MoeDecoderLayer`` decides (else :data:`DENSE_LAYERS`,
    naming the family's model type, dense MLP class, checkpoints and their ``num_experts``:
    Qwen2-MoE's decoder layer decides alike)."""
    layers, experts = config.num_hidden_layers, getattr(config, key)
    only, step = list(getattr(config, "mlp_only_layers", None) or []), config.decoder_sparse_step
    if isinstance(step, bool) or not isinstance(step, int) or step == 0:  # (HF's: a ZeroDivisionError)
        dense = list(range(layers))
    else:
        dense = [i for i in range(layers) if i in only or not (experts > 0 and (i + 1) % step == 0)]
    if not dense:
        return
    key, value = ("num_experts", experts) if not isinstance(experts, int) or experts <= 0 else \
        ("mlp_only_layers", only) if any(i in only for i in dense) else ("decoder_sparse_step", step)
    fix = _FIXES.get(key, str(experts_fix))
    raise ValueError(DENSE_LAYERS.format(key=key, value=value, value_json=json.dumps(value), layers=dense,
                                         count=layers, fix=fix, model_type=model_type, mlp=mlp, family=family,
                                         example=example))


class Qwen3MoeForCausalLM(RoutedExperts, Qwen3ForCausalLM):
    """Hugging Face's ``Qwen3MoeForCausalLM`` (module docstring): Qwen3 whose blocks' ``mlp``
    is an :class:`ft.nn.SparseMoE` (``gate``: the router; ``experts``: ``gate_up_proj``
    ``[E, H, 2I]`` and ``down_proj`` ``[E, I, H]``; ``renormalize``: ``norm_topk_prob``).
    ``router_aux_loss_coef`` is the config's.

    Example:
      >>> import functree as ft, jax, numpy as np
      >>> config = {"model_type": "qwen3_moe", "vocab_size": 11, "hidden_size": 16, "num_hidden_layers": 2,
      ...           "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8, "num_experts": 4,
      ...           "num_experts_per_tok": 2, "moe_intermediate_size": 6, "norm_topk_prob": True}
      >>> model = ft.nn.from_hf(config, key=jax.random.key(0))
      >>> moe = model.model.layers.layers.mlp
      >>> moe.top_k, moe.renormalize, moe.experts.gate_up_proj.shape    # 2 layers, 4 experts of 6
      (2, True, (2, 4, 16, 12))
      >>> ids = np.zeros((1, 3), np.int32)
      >>> model(ids).shape, model.router_logits(ids).shape, model.aux_loss(ids).shape
      ((1, 3, 11), (2, 3, 4), ())
    """

    router_aux_loss_coef: float = field(static=True, default=0.001)
    model_type = "qwen3_moe"

    @classmethod
    def hf_options(cls, config: Any) -> dict[str, Any]:
        check_every_layer_sparse(config)
        # every layer slides where use_sliding_window (HF's Qwen3MoeConfig nulls the window otherwise)
        size = window(config, enabled=bool(getattr(config, "use_sliding_window", False)))
        return {"qk_norm": "head", "window": size,
                **moe_options(config, renormalize=bool(config.norm_topk_prob), size=config.moe_intermediate_size,
                              key="num_experts")}

    @classmethod
    def hf_names(cls, weights: dict[str, Any]) -> dict[str, Any]:
        """Llama's older names, and the Hub's per-expert layout as transformers reads it
        (:func:`~functree.hf._mixtral.per_expert_names` of ``mlp.experts.{e}.gate_proj`` ...)."""
        return per_expert_names(super().hf_names(weights), QWEN_EXPERTS)
