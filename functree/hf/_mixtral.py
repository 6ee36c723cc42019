"""Mistral AI's Mixtral (``model_type: "mixtral"``: Mixtral-8x7B, 8x22B) as a functree model:
Hugging Face's ``MixtralForCausalLM``.

Mistral's blocks (RMSNorm, rotary grouped-query attention without biases, the config's
``sliding_window``) whose MLP is a sparse mixture of experts (:class:`ft.nn.SparseMoE`):
the router ``mlp.gate`` (``[hidden, num_local_experts]``, no bias) gives each token's
softmax in float32, its ``num_experts_per_tok`` most likely experts are renormalized to sum
to 1, and the token is the weighted sum of those experts' SwiGLU MLPs (``mlp.experts``:
``gate_up_proj``, ``down_proj``, stacked over the experts).

Weights: transformers 5.25's fused layout (``mlp.experts.gate_up_proj`` ``[E, 2I, H]``,
``mlp.experts.down_proj`` ``[E, H, I]``, ``mlp.gate.weight``), which ``save_hf`` writes, and
every Hub checkpoint's per-expert layout (``block_sparse_moe.experts.{e}.w1`` / ``w3`` / ``w2``
``.weight``, ``block_sparse_moe.gate.weight``), read as transformers' conversion mapping
reads it: ``gate_up_proj[e] = [w1_e ; w3_e]``, ``down_proj[e] = w2_e``
(:func:`per_expert_names`). A missing expert or a tensor of another shape is refused naming it.

The load-balancing loss: HF adds ``router_aux_loss_coef * aux_loss`` to its loss when
``output_router_logits`` is set. :meth:`MixtralForCausalLM.router_logits` gives every layer's
router logits and :meth:`MixtralForCausalLM.aux_loss` HF's ``aux_loss`` (with the attention
mask); a training loss takes both from one pass (``router_logits=True``, HF's
``output_router_logits``) and adds it in one line::

    logits, routed = model(input_ids, attention_mask, router_logits=True)
    loss = lm_loss(logits) + model.router_aux_loss_coef * model.aux_loss(attention_mask=attention_mask,
                                                                           router_logits=routed)

Dropout (``from_hf(..., dropout=True)``): ``attention_dropout`` on the attention weights, as
HF's; a config with ``router_jitter_noise`` above 0 is refused there (:data:`JITTER_NOT_PORTED`).
"""

from __future__ import annotations

import functools
import json
import re
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

import jax
import numpy as np

from functree._module import field
from functree._traces import staged
from functree.hf._causal import check_mask_values
from functree.hf._family import _values
from functree.hf._llama import LlamaForCausalLM, MistralForCausalLM
from functree.hf._options import window
from functree.nn._moe import SparseMoE, load_balancing_loss
from functree.nn._remat import collecting
from functree.nn._state import collect_intermediates

__all__ = ["MixtralForCausalLM", "RoutedExperts", "ExpertNames", "MIXTRAL_EXPERTS", "QWEN_EXPERTS", "OLMOE_EXPERTS",
           "moe_options",
           "experts_per_token", "per_expert_names", "EXPERTS_PER_TOKEN", "MISSING_EXPERT", "EXPERT_SHAPE",
           "JITTER_NOT_PORTED", "ROUTER_LOGITS_CACHED", "ROUTER_LOGITS_NOT_ONE", "AUX_LOSS_INPUTS"]

EXPERTS_PER_TOKEN = """\
ft.nn.from_hf: the {model_type} config has num_experts_per_tok={top_k} and {key}={experts}; \
each token goes to num_experts_per_tok distinct experts of the {key}, so \
1 <= num_experts_per_tok <= {key} (Hugging Face's router fails here: torch.topk's \
"selected index k out of range").

    wrong:  "num_experts_per_tok": {top_k_json}, "{key}": {experts}
    right:  "num_experts_per_tok": {fix}, "{key}": {experts}     # the checkpoint's own (Mixtral's: 2 of 8; Qwen3-30B-A3B's: 8 of 128)
"""

MISSING_EXPERT = """\
ft.nn.from_hf: the weights hold {family}'s per-expert tensors for layer {layer} \
({module}.experts.{{e}}.{gate}/{up}/{down}.weight) but not {missing!r}; there are {experts} \
experts, and every expert of every layer has {gate}, {up} and {down} (no expert is left out \
of a checkpoint: a shard or a name is missing).

    wrong:  a state dict without {missing!r}
    right:  every model-*.safetensors shard the index lists (or num_local_experts as the checkpoint's)
"""

EXPERT_SHAPE = """\
ft.nn.from_hf: {name!r} is {shape}, but every expert's {kind} is {want} (expert 0's {gate}.weight \
is {w1}: [intermediate size, hidden_size]; {gate} and {up} are [I, H], {down} is [H, I]); one \
expert of another size is no {family} (transformers' conversion fails to stack it).

    wrong:  {name!r}: {shape}
    right:  {name!r}: {want}     # the tensor of the checkpoint this expert is from
"""

JITTER_NOT_PORTED = """\
ft.nn.from_hf(..., dropout=True): the mixtral config has router_jitter_noise={jitter}; \
Hugging Face's MixtralSparseMoeBlock multiplies its input by noise uniform in \
[1 - {jitter}, 1 + {jitter}] in training, which this port does not draw (its training-mode \
numbers would not be HF's).

    wrong:  ft.nn.from_hf(path, dropout=True)        # router_jitter_noise={jitter}
    right:  config["router_jitter_noise"] = 0.0; ft.nn.from_hf(config, weights, dropout=True)
       or:  ft.nn.from_hf(path)                      # no dropout: HF's eval() numbers
"""

ROUTER_LOGITS_CACHED = """\
{cls}(..., router_logits=True) was given a cache; the router logits (HF's \
output_router_logits) are a training loss's, of one call over whole sequences.

    wrong:  model(ids, mask, cache=cache, router_logits=True)
    right:  logits, routed = model(ids, mask, router_logits=True)
"""

ROUTER_LOGITS_NOT_ONE = """\
{cls}(..., router_logits=True): the call recorded {count} router logits ({paths}) where \
the blocks' one stack of sparse MoE layers records one (ft.nn.record_intermediate); HF's \
load-balancing loss reads one per layer. A model that adds MoE layers of its own collects \
them itself:

    wrong:  logits, routed = model(ids, mask, router_logits=True)
    right:  logits, sown = ft.nn.collect_intermediates(lambda m: m(ids, mask), model)
"""

AUX_LOSS_INPUTS = """\
{cls}.aux_loss() was given neither the router logits nor the input ids to compute them from.

    wrong:  model.aux_loss(attention_mask=mask)
    right:  model.aux_loss(attention_mask=mask, router_logits=routed)   # logits, routed = model(ids, mask, router_logits=True)
       or:  model.aux_loss(ids, mask)                                   # a forward pass of its own
"""


class ExpertNames(NamedTuple):
    """A family's per-expert checkpoint names: ``{module}.experts.{e}.{gate|up|down}.weight``
    of each layer (``module``: the MoE's name in those files, read as ``mlp``)."""

    family: str
    module: str
    gate: str
    up: str
    down: str


MIXTRAL_EXPERTS = ExpertNames("Mixtral", "block_sparse_moe", "w1", "w3", "w2")
# Qwen2-MoE's layout (transformers' "qwen2_moe" conversion: Qwen3-MoE's and OLMoE's files)
QWEN_EXPERTS = ExpertNames("Qwen3-MoE", "mlp", "gate_proj", "up_proj", "down_proj")
OLMOE_EXPERTS = QWEN_EXPERTS._replace(family="OLMoE")


def _experts_mlp(layer: type[SparseMoE], num_experts: int, top_k: int, renormalize: bool, size: int | None,
                 options: dict[str, Any], d: int, hidden: int, activation: Any, use_bias: bool, *,
                 key: jax.Array, dtype: Any) -> SparseMoE:
    """A block's ``mlp``: the sparse MoE ``layer`` (LlamaDecoderLayer's MLP call, its bias
    unused: HF's has none), each expert's hidden size ``size`` (Qwen3-MoE's
    ``moe_intermediate_size``), else the config's ``intermediate_size``; ``options``: the
    layer's own keywords (Qwen2-MoE's ``shared`` expert width)."""
    return layer(d, hidden if size is None else size, num_experts=num_experts, top_k=top_k,
                 activation=activation, renormalize=renormalize, key=key, dtype=dtype, **options)


def experts_per_token(config: Any, key: str = "num_local_experts") -> tuple[int, int]:
    """``(experts, num_experts_per_tok)``, the experts' count read as the config's ``key``
    (Mixtral's ``num_local_experts``, Qwen2-MoE's ``num_experts``), the second in ``[1, first]``
    (else :data:`EXPERTS_PER_TOKEN`, naming that key)."""
    experts, top_k = getattr(config, key), config.num_experts_per_tok
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= experts:
        raise ValueError(EXPERTS_PER_TOKEN.format(model_type=config.model_type, key=key, top_k=top_k,
                                                  experts=experts, top_k_json=json.dumps(top_k),
                                                  fix=min(2, experts)))
    return experts, top_k


def moe_options(config: Any, *, renormalize: bool = True, size: int | None = None,
                key: str = "num_local_experts", layer: type[SparseMoE] = SparseMoE,
                **options: Any) -> dict[str, Any]:
    """The MoE families' keyword arguments: ``mlp`` (``layer``, :class:`ft.nn.SparseMoE` or a
    subclass given its own ``options``, of the config's experts, top-k, ``renormalize``: HF's
    ``norm_topk_prob``, each expert of ``size``) and ``router_aux_loss_coef``."""
    experts, top_k = experts_per_token(config, key)
    coef = getattr(config, "router_aux_loss_coef", 0.001)
    return {"mlp": functools.partial(_experts_mlp, layer, experts, top_k, bool(renormalize), size, options),
            "router_aux_loss_coef": 0.001 if coef is None else float(coef)}


def per_expert_names(weights: dict[str, Any], names: ExpertNames = MIXTRAL_EXPERTS) -> dict[str, Any]:
    """Hub checkpoints' per-expert names as transformers 5.25 reads them (its conversion
    mapping; ``names``: Mixtral's ``block_sparse_moe.experts.{e}.w1/w3/w2``, Qwen3-MoE's
    ``mlp.experts.{e}.gate_proj/up_proj/down_proj``): the MoE's module is ``mlp.``; each layer's
    gate and up ``.weight`` (``[I, H]``) stacked over ``e`` and concatenated into
    ``experts.gate_up_proj`` ``[E, 2I, H]``, its down ``.weight`` (``[H, I]``) stacked into
    ``experts.down_proj``. Every expert ``0..E-1`` (E: one more than the highest index) must
    have all three (:data:`MISSING_EXPERT`), each of expert 0's shapes (:data:`EXPERT_SHAPE`);
    the fused tensors' sizes are then the config's (the loader's shape check: a last expert
    missing shows there, ``E - 1`` experts). Names of the fused layout pass as they are."""
    gate, up, down = names.gate, names.up, names.down
    pattern = re.compile(rf"(.*\.layers\.(\d+))\.(?:{names.module}|mlp)\.experts\.(\d+)\.({gate}|{up}|{down})\.weight")
    old = re.compile(rf"(.*\.layers\.\d+)\.{names.module}\.(.*)") if names.module != "mlp" else None
    layers: dict[str, dict[tuple[int, str], Any]] = {}
    out: dict[str, Any] = {}
    for name, value in weights.items():
        m = pattern.fullmatch(name)
        if m is not None:
            layers.setdefault(m.group(1), {})[int(m.group(3)), m.group(4)] = (name, value)
            continue
        moved = old.fullmatch(name) if old is not None else None
        out[f"{moved.group(1)}.mlp.{moved.group(2)}" if moved else name] = value
    for prefix, tensors in layers.items():
        count = 1 + max(e for e, _ in tensors)
        arrays: dict[str, list[np.ndarray]] = {gate: [], up: [], down: []}
        first: tuple[int, ...] | None = None
        for e in range(count):
            for w in (gate, up, down):
                if (e, w) not in tensors:
                    raise ValueError(MISSING_EXPERT.format(
                        layer=prefix.rsplit(".", 1)[-1], experts=count, **names._asdict(),
                        missing=f"{prefix}.{names.module}.experts.{e}.{w}.weight"))
                name, value = tensors[e, w]
                a = _values(value)
                first = a.shape if first is None else first  # expert 0's gate: [I, H]
                want = first[::-1] if w == down else first
                if a.shape != want or len(want) != 2:
                    raise ValueError(EXPERT_SHAPE.format(name=name, shape=list(a.shape), kind=f"{w}.weight",
                                                         want=list(want) if len(want) == 2 else "[I, H]",
                                                         w1=list(first), **names._asdict()))
                arrays[w].append(a)
        out[f"{prefix}.mlp.experts.gate_up_proj"] = np.concatenate([np.stack(arrays[gate]), np.stack(arrays[up])],
                                                                   axis=1)
        out[f"{prefix}.mlp.experts.down_proj"] = np.stack(arrays[down])
    return out


_Base = LlamaForCausalLM if TYPE_CHECKING else object


class RoutedExperts(_Base):
    """What the MoE causal LMs (Mixtral, Qwen3-MoE, OLMoE) share over their Llama-like base (a mixin
    before it): the ``router_aux_loss_coef`` keyword (the class declares the static field),
    ``model(ids, mask, router_logits=True)``, :meth:`router_logits` and :meth:`aux_loss`."""

    router_aux_loss_coef: float
    # PEFT 0.21's "all-linear" here (HFModel.hf_all_linear): the attention's Linears, the router's
    # weight and both stacked expert weights, gate_up_proj at twice the rank and alpha
    hf_all_linear: ClassVar[dict[str, int]] = {"mlp.gate.weight": 1, "mlp.experts.gate_up_proj": 2,
                                               "mlp.experts.down_proj": 1}

    def __init__(self, *args: Any, router_aux_loss_coef: float = 0.001, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.router_aux_loss_coef = float(router_aux_loss_coef)

    def __call__(self, input_ids: Any, attention_mask: Any = None, *, positions: Any = None, cache: Any = None,
                 key: jax.Array | None = None, router_logits: bool = False) -> Any:
        """The causal LM's call (:class:`~functree.hf._causal.CausalLM`); ``router_logits=True``
        (no cache) returns ``(logits, router_logits)`` of one pass, HF's
        ``output_router_logits``: a training loss adds the load-balancing loss without a
        second forward (:meth:`aux_loss` of them). The router logits are the blocks' own
        (``ft.nn.collect_intermediates``): with HF's dropout in training mode, those of the
        pass that dropped."""
        if not router_logits:
            return super().__call__(input_ids, attention_mask, positions=positions, cache=cache, key=key)
        if cache is not None:
            raise ValueError(ROUTER_LOGITS_CACHED.format(cls=type(self).__name__))
        if not staged() and not collecting():  # eager: compiled once per signature, not a scan traced at each call
            self._check_call(input_ids, None)  # the checks of concrete values the plain call makes (traced in the jit:
            self.check_token_ids(input_ids)    # an id outside the vocabulary would give NaN rows, not its error)
            check_mask_values(self, attention_mask)  # (a mask of 2 or -1: NaN rows, not its error)
            return _routed_call(self, input_ids, attention_mask, positions, key)
        logits, sown = collect_intermediates(
            lambda m: m(input_ids, attention_mask, positions=positions, key=key), self)
        return logits, self._router_logits_of(sown)

    def router_logits(self, input_ids: Any, attention_mask: Any = None, *, positions: Any = None,
                      key: jax.Array | None = None) -> jax.Array:
        """Every layer's router logits ``[num_hidden_layers, batch * T, num_local_experts]``
        (rows batch major), in the weights' dtype: HF's ``router_logits`` output stacked."""
        return self(input_ids, attention_mask, positions=positions, key=key, router_logits=True)[1]

    def aux_loss(self, input_ids: Any = None, attention_mask: Any = None, *, positions: Any = None,
                 router_logits: Any = None, key: jax.Array | None = None) -> jax.Array:
        """HF's ``aux_loss`` (``load_balancing_loss_func`` of the router logits, padding
        excluded by ``attention_mask``): :func:`ft.nn.load_balancing_loss` of
        ``router_logits`` (those of ``model(ids, mask, router_logits=True)``: no second
        pass), else of a call of its own on ``input_ids``.

        Example (a training loss, one forward pass)::

            logits, routed = model(ids, mask, router_logits=True)
            loss = lm_loss(logits) + model.router_aux_loss_coef * model.aux_loss(attention_mask=mask,
                                                                                   router_logits=routed)
        """
        if router_logits is None:
            if input_ids is None:  # (else a TypeError from deep inside the forward)
                raise ValueError(AUX_LOSS_INPUTS.format(cls=type(self).__name__))
            router_logits = self.router_logits(input_ids, attention_mask, positions=positions, key=key)
        return load_balancing_loss(router_logits, self.sparse_moe().top_k, attention_mask)

    def sparse_moe(self) -> SparseMoE:
        """The (stacked) sparse MoE layer whose router the load-balancing loss reads: each
        block's ``mlp``. A family whose blocks hold it deeper overrides this."""
        return self.model.layers.layers.mlp  # type: ignore[return-value]

    def _router_logits_of(self, sown: dict[Any, Any]) -> jax.Array:
        """The router logits among a call's recorded intermediates: the one stack's."""
        found = [path for path in sown if tuple(path)[-1].key == "router_logits"]
        if len(found) != 1:
            raise ValueError(ROUTER_LOGITS_NOT_ONE.format(cls=type(self).__name__, count=len(found),
                                                          paths=", ".join(map(str, found)) or "none"))
        return sown[found[0]]


@jax.jit
def _routed_call(model: RoutedExperts, input_ids: Any, attention_mask: Any, positions: Any,
                 key: Any) -> tuple[jax.Array, jax.Array]:
    return model(input_ids, attention_mask, positions=positions, key=key, router_logits=True)


class MixtralForCausalLM(RoutedExperts, MistralForCausalLM):
    """Hugging Face's ``MixtralForCausalLM`` (module docstring): Mistral whose blocks' ``mlp``
    is an :class:`ft.nn.SparseMoE` (``gate``: the router; ``experts``: ``gate_up_proj``
    ``[E, H, 2I]`` and ``down_proj`` ``[E, I, H]``, torch's ``[E, 2I, H]`` / ``[E, H, I]``
    transposed as a Dense's weight is). ``router_aux_loss_coef`` is the config's.

    Example:
      >>> import functree as ft, jax, numpy as np
      >>> config = {"model_type": "mixtral", "vocab_size": 11, "hidden_size": 16, "intermediate_size": 8,
      ...           "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
      ...           "num_local_experts": 4, "num_experts_per_tok": 2}
      >>> model = ft.nn.from_hf(config, key=jax.random.key(0))
      >>> moe = model.model.layers.layers.mlp
      >>> type(moe).__name__, moe.top_k, moe.experts.gate_up_proj.shape    # 2 layers, 4 experts
      ('SparseMoE', 2, (2, 4, 16, 16))
      >>> ids = np.zeros((1, 3), np.int32)
      >>> model(ids).shape, model.router_logits(ids).shape, model.aux_loss(ids).shape
      ((1, 3, 11), (2, 3, 4), ())
    """

    router_aux_loss_coef: float = field(static=True, default=0.001)
    model_type = "mixtral"
    hf_biases = ()

    @classmethod
    def hf_options(cls, config: Any) -> dict[str, Any]:
        return {"window": window(config), **moe_options(config)}

    @classmethod
    def hf_dropout(cls, config: Any) -> dict[str, float] | None:
        """``attention_dropout`` on the attention weights (HF's only dropout here); a
        ``router_jitter_noise`` above 0 is refused (:data:`JITTER_NOT_PORTED`)."""
        rates = super().hf_dropout(config)
        jitter = getattr(config, "router_jitter_noise", 0.0) or 0.0
        if jitter > 0:
            raise ValueError(JITTER_NOT_PORTED.format(jitter=jitter))
        return rates

    @classmethod
    def hf_names(cls, weights: dict[str, Any]) -> dict[str, Any]:
        """Llama's older names (:meth:`LlamaForCausalLM.hf_names`), and the Hub's per-expert
        layout as transformers reads it (:func:`per_expert_names`)."""
        return per_expert_names(super().hf_names(weights), MIXTRAL_EXPERTS)
