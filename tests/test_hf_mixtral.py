"""Mixtral (``ft.hf``'s ``MixtralForCausalLM``) against transformers' own: tiny configs with
random weights (no download), 2 layers, hidden 32, 4 experts of intermediate 24 (top-2 but
where a case says), vocab 100, weights moved by N(0, 0.3) so that every tensor (each
expert's too) matters; Mistral's attention with grouped-query heads and a sliding window.

In float64 HF's router takes its softmax in float32 (``router_logits.float()``) and its
rotary and RMSNorm in float32 too; as HF computes, the logits agree to float32 rounding
(tolerance 1e-6 of their magnitude). With those widened to float64 in HF's model the port is
HF's to float64 rounding: the logits, the loss with the load-balancing term
(``output_router_logits``: ``loss + router_aux_loss_coef * aux_loss``) and every gradient
(tolerances 3e-14 of the largest; measured 5.2e-15 and 3.3e-15). float32 from every source, the
Hub's per-expert layout (``block_sparse_moe.experts.{e}.w1/w2/w3``) read as transformers
reads it, ``save_hf`` read by ``from_pretrained``, HF's greedy tokens through the KV cache,
task heads and PEFT's LoRA both ways: 2.5e-5 of the magnitude as the other families.
"""

import json
import os
import re
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import functree as ft
from functree.hf import _mixtral

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
safetensors_torch = pytest.importorskip("safetensors.torch")
from test_hf_granite import widened  # noqa: E402
from test_hf_load import assert_generates_as_hf, forward, hf_output  # noqa: E402
from test_hf_phi import _nonzero_b, assert_logits, batch  # noqa: E402  (its VOCAB and T: 100, 12)

VOCAB, T = 100, 12
SIZES = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 24, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 2,
         "max_position_embeddings": 32, "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}
AS_HF = 5e-6  # times max|HF|, float64 against HF's float32 router softmax, rotary (base 1e6) and norms: measured 7.4e-7
WIDENED = 3e-14  # times max|HF|, against HF widened to float64: measured 5.2e-15 (3 seeds x 3 cases)
GRADIENTS = 3e-14  # times the largest gradient (the loss: of itself): measured 3.3e-15 (loss 4.5e-16)
FLOAT32 = 2.5e-5  # times max|HF| (test_hf_load.py's): measured 1.4e-6
AUX = 1e-6  # relative: HF's aux loss sums its probabilities in float32: measured 1.6e-8 (value), 7.0e-9 (gradients)
CASES = {"default": {}, "top1_window": {"num_experts_per_tok": 1, "sliding_window": 5},
         "every_expert_tied": {"num_experts_per_tok": 4, "tie_word_embeddings": True, "num_key_value_heads": 4}}
# the attention projections (PEFT's own for mixtral) and the router: save_lora writes the router's
# adapter in target_parameters (mlp.gate.weight), as PEFT 0.21.2's own adapters on the router
# ("gate") or "all-linear" hold it (with the stacked experts), which load_lora reads
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate"]


def hf_model(seed=0, dtype=torch.float32, cls="MixtralForCausalLM", **changes):
    torch.manual_seed(seed)
    if dtype == torch.float64:  # HF's CPU default, grouped_mm, takes float32 and narrower only
        changes = {**changes, "experts_implementation": "eager"}
    hf = getattr(transformers, cls)(transformers.MixtralConfig(**{**SIZES, **changes})).to(dtype)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return hf.eval()


def widened_moe(hf):
    """``hf`` widened (:func:`test_hf_granite.widened`: rotary, RMSNorm) with each router's
    softmax in the weights' dtype (HF's casts it to float32), and its rotary frequencies
    ``theta ** (-2i / d)`` rounded once to float32 (the port's: HF's float32 power differs by
    an ulp at Mixtral's base 1e6, 2.4e-7 of the logits, where 1e4 rounds alike)."""
    rotary = hf.model.rotary_emb
    size = 2 * rotary.inv_freq.shape[0]
    theta = hf.config.rope_parameters["rope_theta"]
    exact = 1.0 / theta ** (np.arange(0, size, 2, dtype=np.float64) / size)
    rotary.inv_freq = torch.from_numpy(exact.astype(np.float32))
    widened(hf)
    for module in hf.modules():
        if type(module).__name__.endswith("TopKRouter"):  # Mixtral's, Qwen3-MoE's (norm_topk_prob)
            def route(h, m=module):
                logits = torch.nn.functional.linear(h.reshape(-1, m.hidden_dim), m.weight)
                top, index = torch.topk(torch.softmax(logits, dim=-1), m.top_k, dim=-1)
                return logits, top / top.sum(dim=-1, keepdim=True) if getattr(m, "norm_topk_prob", True) else top, index
            module.forward = route
    return hf


@pytest.mark.parametrize("case", CASES)
def test_float64_logits_are_hfs_with_and_without_a_mask(case):
    """As HF computes (float32 router softmax, rotary, norms), and against HF widened: top-2,
    top-1 with a sliding window, every expert (top_k = num_experts) with a tied head."""
    assert_float64_logits_are_hfs(hf_model(1, torch.float64, **CASES[case]), CASES[case], AS_HF, WIDENED)


def assert_float64_logits_are_hfs(hf, changes, as_hf, wide):
    """The float64 port of the float64 MoE model ``hf`` (built with ``changes``): its top-k and
    window, its logits with and without a mask as HF computes them (``as_hf``) and against
    HF widened (``wide``); returns the port (Qwen3-MoE's test calls it too)."""
    with jax.enable_x64(True):
        model = ft.nn.from_hf(hf, dtype=jnp.float64)
        moe = model.model.layers.layers.mlp
        assert isinstance(moe, ft.nn.SparseMoE) and moe.top_k == changes.get("num_experts_per_tok", 2)
        assert model.model.layers.layers.self_attn.window == changes.get("sliding_window")
        for masked in (True, False):
            assert_logits(model, hf, as_hf, masked)
        widened_moe(hf)
        for masked in (True, False):
            assert_logits(model, hf, wide, masked)
    return model


@pytest.mark.parametrize("with_aux", [False, True])
def test_float64_loss_with_the_aux_loss_and_gradients_are_hfs(with_aux):
    """HF's loss with labels on the left-padded batch (the padding's labels -100, and the
    first real token's, predicted at a padding position), with ``output_router_logits=True``
    plus ``router_aux_loss_coef`` times the load-balancing loss of the real tokens; ours is the
    same sum written in one line (``model.aux_loss``); the value, HF's ``aux_loss``, its
    ``router_logits`` (``model.router_logits``, at the real tokens) and every
    parameter's gradient. HF's loss takes its logits in float32 (``logits.float()``): the
    reference is its CE in float64, HF's own loss equal to it at 1e-6; HF sums the aux loss's
    probabilities in float32 (``routing_weights.float()``): with it, 1e-6 (AUX); without,
    float64 rounding."""
    assert_loss_and_gradients_are_hfs(widened_moe(hf_model(2, torch.float64, router_aux_loss_coef=0.25)), with_aux)


def assert_loss_and_gradients_are_hfs(hf, with_aux):
    """The loss test's check (test_float64_loss_with_the_aux_loss_and_gradients_are_hfs) of a
    widened float64 MoE model ``hf`` whose ``router_aux_loss_coef`` is 0.25 (Qwen3-MoE's too)."""
    ids, mask = batch()
    labels = np.where(mask.astype(bool), ids, -100)
    labels[1, 3] = -100  # (predicted from a padding position's logits: HF's and the port's differ there)
    out = hf(torch.from_numpy(ids).long(), attention_mask=torch.from_numpy(mask).long(),
             labels=torch.from_numpy(labels).long(), output_router_logits=with_aux)
    # HF's loss_function takes logits.float(): its own CE, float64 here (the same tokens)
    theirs = torch.nn.functional.cross_entropy(out.logits[:, :-1].reshape(-1, VOCAB),
                                               torch.from_numpy(labels[:, 1:]).long().reshape(-1), ignore_index=-100)
    if with_aux:
        theirs = theirs + 0.25 * out.aux_loss
    np.testing.assert_allclose(theirs.item(), out.loss.item(), rtol=AUX)
    theirs.backward()
    hf_grads = {name: p.grad.numpy() for name, p in hf.named_parameters()}

    def loss(m):
        logits = m(ids, mask)[:, :-1]
        target = labels[:, 1:]
        picked = jnp.take_along_axis(jax.nn.log_softmax(logits), np.maximum(target, 0)[..., None], -1)[..., 0]
        real = target >= 0
        lm = -jnp.sum(jnp.where(real, picked, 0.0)) / float(real.sum())
        return lm + m.router_aux_loss_coef * m.aux_loss(ids, mask) if with_aux else lm

    def one_pass(m):  # the aux loss of the same forward's router logits (router_logits=True)
        logits, routed = m(ids, mask, router_logits=True)
        target = labels[:, 1:]
        picked = jnp.take_along_axis(jax.nn.log_softmax(logits[:, :-1]), np.maximum(target, 0)[..., None], -1)[..., 0]
        real = target >= 0
        lm = -jnp.sum(jnp.where(real, picked, 0.0)) / float(real.sum())
        return lm + m.router_aux_loss_coef * m.aux_loss(attention_mask=mask, router_logits=routed)

    with jax.enable_x64(True):
        model = ft.nn.from_hf(hf, dtype=jnp.float64)
        assert model.router_aux_loss_coef == 0.25
        # one compiled program (both losses' gradients where with_aux): op by op (each operation
        # compiled apart) it was most of the test's time
        both = jax.jit(lambda m: (ft.value_with_gradient(loss)(m),
                                  ft.value_with_gradient(one_pass)(m) if with_aux else None))
        (value, grads), one = both(model)
        ours = ft.nn.to_hf_state_dict(grads, numpy=True)
        if with_aux:
            same, same_grads = one
            np.testing.assert_allclose(float(same), float(value), rtol=1e-14)
            for a, b in zip(jax.tree.leaves(same_grads), jax.tree.leaves(grads)):
                np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-14 * scale_of(grads))
            # one forward: the blocks' scan traced once (model.aux_loss(ids, mask) is a second)
            assert str(jax.make_jaxpr(one_pass)(model)).count("scan[") == 1
            np.testing.assert_allclose(float(model.aux_loss(ids, mask)), out.aux_loss.item(), rtol=AUX)
            routed = np.asarray(model.router_logits(ids, mask))  # HF's router_logits, stacked: the real rows
            theirs_routed = np.stack([r.detach().numpy() for r in out.router_logits])
            rows = mask.reshape(-1).astype(bool)
            np.testing.assert_allclose(routed[:, rows], theirs_routed[:, rows], rtol=0,
                                       atol=WIDENED * float(np.abs(theirs_routed).max()))
    tolerance = AUX if with_aux else GRADIENTS
    np.testing.assert_allclose(float(value), theirs.item(), rtol=tolerance)
    scale = max(float(np.abs(g).max()) for g in hf_grads.values())
    assert "model.layers.1.mlp.gate.weight" in hf_grads and "model.layers.0.mlp.experts.down_proj" in hf_grads
    for name, expected in hf_grads.items():
        assert np.abs(expected).max() > 0, name
        np.testing.assert_allclose(ours[name], expected, rtol=0, atol=tolerance * scale, err_msg=name)


def scale_of(tree):
    return max(float(np.abs(np.asarray(g)).max()) for g in jax.tree.leaves(tree))


def test_aux_loss_without_ids_or_router_logits_is_refused_naming_both():
    """``model.aux_loss(attention_mask=mask)`` (the router logits forgotten) failed inside the
    forward with "'<' not supported between instances of 'NoneType' and 'int'"."""
    model = ft.nn.from_hf({**SIZES, "model_type": "mixtral", "num_hidden_layers": 1}, key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"MixtralForCausalLM.aux_loss\(\) was given neither") as error:
        model.aux_loss(attention_mask=np.ones((1, 3), np.int32))
    assert "router_logits=routed)" in str(error.value) and "model.aux_loss(ids, mask)" in str(error.value)


def same_pass(actual, expected):
    """Two programs' results of one pass (logits with and without ``router_logits=True``):
    jax 0.12's XLA fuses the two programs differently, 6e-8 apart at values up to 0.5 (jax 0.10:
    bit for bit); 1e-6 of the largest value is 8x that, and a thousandth of the distance to
    another pass (a dropout-free one: 1e-3 apart, asserted below)."""
    expected = np.asarray(expected)
    np.testing.assert_allclose(np.asarray(actual), expected, rtol=0, atol=1e-6 * float(np.abs(expected).max()))


def test_router_logits_with_a_cache_are_refused():
    model = ft.nn.from_hf(transformers.MixtralConfig(**SIZES), key=jax.random.key(0))
    ids, mask = batch()
    with pytest.raises(ValueError, match=r"router_logits=True\) was given a cache") as error:
        model(ids, mask, cache=model.init_cache(ids.shape[0], 16), router_logits=True)
    assert "logits, routed = model(ids, mask, router_logits=True)" in str(error.value)
    logits, routed = model(ids, mask, router_logits=True)
    same_pass(logits, model(ids, mask))
    same_pass(routed, model.router_logits(ids, mask))


def per_expert(state, names=_mixtral.MIXTRAL_EXPERTS):
    """A transformers 5.25 state dict in the Hub's per-expert layout (Mixtral-8x7B's files:
    ``block_sparse_moe.gate.weight``, ``block_sparse_moe.experts.{e}.w1/w3`` (gate_up_proj's
    halves) and ``w2`` (down_proj); Qwen3-MoE's ``mlp.experts.{e}.gate_proj/up_proj/down_proj``
    with ``names``), as the checkpoints transformers' conversion reads."""
    out, module = {}, f".{names.module}."
    for name, tensor in state.items():
        if ".mlp.experts.gate_up_proj" in name:
            prefix = name.replace(".mlp.experts.gate_up_proj", f"{module}experts")
            gate, up = tensor.chunk(2, dim=1)
            for e in range(tensor.shape[0]):
                out[f"{prefix}.{e}.{names.gate}.weight"] = gate[e].clone()
                out[f"{prefix}.{e}.{names.up}.weight"] = up[e].clone()
        elif ".mlp.experts.down_proj" in name:
            prefix = name.replace(".mlp.experts.down_proj", f"{module}experts")
            for e in range(tensor.shape[0]):
                out[f"{prefix}.{e}.{names.down}.weight"] = tensor[e].clone()
        else:
            out[name.replace(".mlp.gate.", f"{module}gate.")] = tensor.clone()
    return out


def test_loads_from_every_source_exports_and_generates_as_hf(tmp_path):
    """float32: from the HF object, its config and state dict, its config.json's keys alone
    (the DEFAULTS row: rope theta 1e6, eps 1e-5), its save_pretrained directory and a
    directory in the Hub's per-expert layout written by hand (transformers reads it to the same
    model: equal logits); the strict export; HF's greedy tokens through the KV cache;
    ``save_hf`` (the fused layout) read by ``from_pretrained``, equal."""
    assert_loads_from_every_source(hf_model(3, sliding_window=6), tmp_path, ("model_type", *SIZES, "sliding_window"))


def assert_loads_from_every_source(hf, tmp_path, keys, names=_mixtral.MIXTRAL_EXPERTS):
    """The source test's checks (test_loads_from_every_source_exports_and_generates_as_hf)
    of a float32 MoE model ``hf`` of 4 experts: its config.json's ``keys`` alone, the
    per-expert layout ``names`` written by hand (Qwen3-MoE's too)."""
    hf.save_pretrained(tmp_path / "hf")
    config_json = {k: v for k, v in json.loads((tmp_path / "hf" / "config.json").read_text()).items()
                   if k in keys}
    old = tmp_path / "per_expert"
    old.mkdir()
    (old / "config.json").write_text((tmp_path / "hf" / "config.json").read_text())
    safetensors_torch.save_file(per_expert(hf.state_dict(), names), old / "model.safetensors")
    theirs_old = transformers.AutoModelForCausalLM.from_pretrained(old).eval()
    assert_logits(ft.nn.from_hf(hf), theirs_old, FLOAT32)  # transformers reads the old layout as this model
    sources = ((hf,), (hf.config, hf.state_dict()), (config_json, hf.state_dict()), (tmp_path / "hf",), (old,),
               (hf.config, per_expert(hf.state_dict(), names)))
    for given in sources:
        model = ft.nn.from_hf(*given)
        assert type(model).__name__ == type(hf).__name__
        assert_logits(model, hf, FLOAT32)
    hf.load_state_dict(ft.nn.to_hf_state_dict(model), strict=True)
    assert_generates_as_hf(model, hf, length=T, new=6)
    ft.nn.save_hf(model, tmp_path / "ours")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours")
    experts = getattr(back.config, "num_local_experts", None) or back.config.num_experts  # (Qwen2MoeConfig: no alias)
    assert type(back).__name__ == type(hf).__name__ and experts == 4
    theirs = hf.state_dict()
    assert set(back.state_dict()) == set(theirs)
    for name, tensor in back.state_dict().items():
        np.testing.assert_array_equal(tensor.numpy(), theirs[name].numpy(), err_msg=name)


@pytest.mark.parametrize("cls", ["MixtralForSequenceClassification", "MixtralForTokenClassification",
                                 "MixtralForQuestionAnswering"])
def test_task_heads_are_hfs(cls):
    """HEADS' row (transformers 5.25 has all three for mixtral); the export is strict."""
    assert_task_head_is_hfs(hf_model(4, cls=cls, num_labels=3), cls)


def assert_task_head_is_hfs(hf, cls):
    """A task model's outputs at the real tokens (a sequence classifier's per row) are HF's
    ``hf``'s (float32); the export is strict (Qwen3-MoE's heads too)."""
    model = ft.nn.from_hf(hf)
    assert type(model).__name__ == cls
    ids, mask = batch()
    kwargs = {"attention_mask": torch.from_numpy(mask).long()}
    with torch.no_grad():
        out = hf(torch.from_numpy(ids).long(), **kwargs)
    ours = model(ids, mask)
    if cls.endswith("QuestionAnswering"):
        pairs = [(np.asarray(ours[0]), out.start_logits.numpy()), (np.asarray(ours[1]), out.end_logits.numpy())]
    else:
        pairs = [(np.asarray(ours), out.logits.numpy())]
    real = mask.astype(bool)
    for mine, expected in pairs:
        if not cls.endswith("SequenceClassification"):
            mine, expected = mine[real], expected[real]
        np.testing.assert_allclose(mine, expected, rtol=0, atol=FLOAT32 * float(np.abs(expected).max()))
    hf.load_state_dict(ft.nn.to_hf_state_dict(model), strict=True)


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")  # PEFT's, on transformers 5
def test_lora_saved_is_read_by_peft_and_peft_s_is_read_back(tmp_path):
    """``ft.nn.lora`` on the attention projections and the router ``mlp.gate`` with nonzero B,
    ``save_lora`` (the router in ``target_parameters``), PEFT's ``PeftModel.from_pretrained``:
    PEFT's logits. PEFT's own adapter on the attention read by ``load_lora``: PEFT's logits
    again. PEFT's adapters on the
    router or ``"all-linear"`` (``target_parameters``: the router's weight, the stacked
    experts, gate_up_proj at twice the rank; tests/test_hf_peft_moe.py in float64) are read
    with PEFT's logits."""
    written = assert_lora_both_ways(hf_model, tmp_path, LORA_TARGETS, LORA_TARGETS[:4])
    assert {name.rpartition(".")[2] for name in written} == set(LORA_TARGETS[:4]) and len(written) == 8
    parameters = json.loads((tmp_path / "ours" / "adapter_config.json").read_text())["target_parameters"]
    assert parameters == [f"model.layers.{i}.mlp.gate.weight" for i in (0, 1)]  # the router: its weight
    ids, mask = batch()
    real = mask.astype(bool)
    for targets in (["gate"], "all-linear"):
        with warnings.catch_warnings():  # PEFT's own about its rank_pattern for the experts
            warnings.simplefilter("ignore")
            every = peft.get_peft_model(hf_model(6), peft.LoraConfig(r=2, lora_alpha=4, target_modules=targets))
            with torch.no_grad():
                for name, p in every.named_parameters():
                    if "lora_B" in name:
                        p.normal_(0, 0.3)
            every.save_pretrained(tmp_path / "every")
            expected = hf_output(every.eval(), ids, mask, positions=False)
        loaded = ft.nn.load_lora(ft.nn.from_hf(hf_model(6)), tmp_path / "every")
        np.testing.assert_allclose(np.asarray(forward(loaded, ids, mask))[real], expected[real], rtol=0,
                                   atol=FLOAT32 * float(np.abs(expected[real]).max()))


def assert_lora_both_ways(make, tmp_path, targets, peft_targets):
    """``ft.nn.lora`` on ``targets`` of ``make(5)``'s port with nonzero B, ``save_lora``, PEFT's
    ``PeftModel.from_pretrained``: PEFT's logits (the adapter matters); PEFT's own adapter on
    ``peft_targets`` of ``make(6)`` read by ``load_lora``: PEFT's logits again. Returns the
    ``target_modules`` save_lora wrote (Qwen3-MoE's test calls it too)."""
    patterns = [f"*.{t}" for t in targets]
    model = _nonzero_b(ft.nn.lora(ft.nn.from_hf(make(5)), patterns, rank=2, alpha=4, key=jax.random.key(1)))
    ft.nn.save_lora(model, tmp_path / "ours")
    written = json.loads((tmp_path / "ours" / "adapter_config.json").read_text())["target_modules"]
    ids, mask = batch()
    real = mask.astype(bool)
    peft_model = peft.PeftModel.from_pretrained(make(5), str(tmp_path / "ours")).eval()
    expected = hf_output(peft_model, ids, mask, positions=False)
    atol = FLOAT32 * float(np.abs(expected[real]).max())
    assert np.abs(hf_output(make(5), ids, mask, positions=False)[real] - expected[real]).max() > 100 * atol
    np.testing.assert_allclose(np.asarray(forward(model, ids, mask))[real], expected[real], rtol=0, atol=atol)

    theirs = peft.get_peft_model(make(6), peft.LoraConfig(r=2, lora_alpha=4, target_modules=peft_targets))
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)
    theirs.save_pretrained(tmp_path / "peft")
    loaded = ft.nn.load_lora(ft.nn.from_hf(make(6)), tmp_path / "peft")
    expected = hf_output(theirs.eval(), ids, mask, positions=False)
    np.testing.assert_allclose(np.asarray(forward(loaded, ids, mask))[real], expected[real], rtol=0,
                               atol=FLOAT32 * float(np.abs(expected[real]).max()))
    return written



def test_experts_per_token_past_the_experts_is_refused_naming_the_key():
    """``num_experts_per_tok`` above ``num_local_experts``: HF's router fails (torch.topk);
    the port is refused naming the key and a config that works."""
    config = transformers.MixtralConfig(**{**SIZES, "num_experts_per_tok": 5})
    with pytest.raises(RuntimeError, match="out of range"):
        transformers.MixtralForCausalLM(config)(torch.zeros((1, 3), dtype=torch.long))
    with pytest.raises(ValueError, match="num_experts_per_tok=5") as error:
        ft.nn.from_hf(config, key=jax.random.key(0))
    assert '"num_experts_per_tok": 2' in str(error.value) and "wrong:" in str(error.value)


def test_a_missing_or_misshapen_expert_is_refused_naming_its_key():
    """The per-expert layout: expert 1's w3 missing in layer 0 (MISSING_EXPERT), expert 2's
    w2 of another shape (EXPERT_SHAPE), each naming the tensor; the last expert missing gives
    E - 1 experts, the loader's shape error naming the fused tensor."""
    hf = hf_model(7)
    old = per_expert(hf.state_dict())
    missing = {k: v for k, v in old.items() if k != "model.layers.0.block_sparse_moe.experts.1.w3.weight"}
    with pytest.raises(ValueError, match=r"model\.layers\.0\.block_sparse_moe\.experts\.1\.w3\.weight") as error:
        ft.nn.from_hf(hf.config, missing)
    assert str(error.value).startswith(_mixtral.MISSING_EXPERT.split("{")[0])
    bad = {**old, "model.layers.1.block_sparse_moe.experts.2.w2.weight": torch.zeros(32, 20)}
    with pytest.raises(ValueError, match=r"experts\.2\.w2\.weight' is \[32, 20\]") as error:
        ft.nn.from_hf(hf.config, bad)
    assert "[32, 24]" in str(error.value)
    last = {k: v for k, v in old.items() if ".experts.3." not in k or "layers.1" in k}
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.experts\.gate_up_proj"):
        ft.nn.from_hf(hf.config, last)


def test_router_jitter_with_dropout_is_refused():
    """``router_jitter_noise`` > 0 with ``dropout=True``: HF jitters the MoE input in
    training, the port does not: refused naming the key (without dropout=True: eval()'s numbers)."""
    config = transformers.MixtralConfig(**{**SIZES, "router_jitter_noise": 0.1})
    with pytest.raises(ValueError, match=r"router_jitter_noise=0\.1") as error:
        ft.nn.from_hf(config, key=jax.random.key(0), dropout=True)
    assert str(error.value).startswith(_mixtral.JITTER_NOT_PORTED.split("{")[0])
    assert ft.nn.from_hf(config, key=jax.random.key(0)).model.layers.layers.mlp.jitter == 0.0


def test_router_logits_of_a_dropping_port_are_the_dropping_pass():
    """A port with HF's dropout in training mode: ``router_logits=True`` returns the logits
    of the very call that dropped (the same as without it, same key) and that pass's router
    logits (not a dropout-free pass's); the dropout key it advances reaches the training
    step's ``collect_state`` around it, as a plain call's does."""
    config = transformers.MixtralConfig(**{**SIZES, "attention_dropout": 0.5})
    model = ft.nn.training(ft.nn.from_hf(config, key=jax.random.key(0), dropout=True))
    ids, mask = batch()
    key = jax.random.key(1)
    logits, routed = model(ids, mask, router_logits=True, key=key)
    same_pass(logits, model(ids, mask, key=key))
    still = ft.nn.inference(model).router_logits(ids, mask)
    assert routed.shape == still.shape
    assert float(jnp.max(jnp.abs(routed - still))) > 1e-3 * float(jnp.max(jnp.abs(still)))  # attention dropped
    same_pass(model.router_logits(ids, mask, key=key), routed)

    (one, routed2), state = ft.nn.collect_state(lambda m: m(ids, mask, router_logits=True), model)
    plain, plain_state = ft.nn.collect_state(lambda m: m(ids, mask), model)
    assert sorted(map(str, state)) == sorted(map(str, plain_state)) and state
    same_pass(one, plain)
    for path in state:
        np.testing.assert_array_equal(np.asarray(state[path]), np.asarray(plain_state[path]))  # keys: exact
    again, _ = ft.nn.collect_state(lambda m: m.router_logits(ids, mask), model)  # the stored key's masks again
    same_pass(routed2, again)


def test_router_logits_read_from_one_stack_or_refused():
    """The router logits are the one stack's record (``.model.layers.layers.mlp.router_logits``);
    a model whose call records none or two is refused naming what it recorded and the
    collection to write instead (ROUTER_LOGITS_NOT_ONE)."""
    model = ft.nn.from_hf(transformers.MixtralConfig(**SIZES), key=jax.random.key(0))
    ids, mask = batch()
    _, sown = ft.nn.collect_intermediates(lambda m: m(ids, mask), model)
    assert list(map(str, sown)) == [".model.layers.layers.mlp.router_logits"]
    two = {**sown, ft.KeyPath.parse(".extra.router_logits"): sown[next(iter(sown))]}
    for recorded, count in (({}, "0 router logits (none)"), (two, "2 router logits (.model.layers")):
        with pytest.raises(ValueError, match=re.escape(count)) as error:
            model._router_logits_of(recorded)
        assert "ft.nn.collect_intermediates(lambda m: m(ids, mask), model)" in str(error.value)


def test_an_eager_router_logits_call_compiles_once():
    """At top level, ``router_logits=True`` runs one compiled call per signature (the scan
    that collects the records is not traced anew at every call, ~0.4 s each on a CPU): a
    second call with new values compiles nothing, and the values equal the jitted call's."""
    model = ft.nn.from_hf(transformers.MixtralConfig(**SIZES), key=jax.random.key(0))
    ids, mask = batch()
    routed_call: Any = _mixtral._routed_call  # (a jax.jit function: its compile cache)
    routed_call.clear_cache()
    first = model(ids, mask, router_logits=True)
    second = model((ids + 1) % VOCAB, mask, router_logits=True)
    assert routed_call._cache_size() == 1
    staged = jax.jit(lambda m, i: m(i, mask, router_logits=True))(model, ids)
    for a, b in zip(first, staged):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert not np.array_equal(np.asarray(first[1]), np.asarray(second[1]))


def test_a_mask_value_other_than_0_and_1_is_refused_by_every_call_or_gives_nan_rows_traced():
    """A mask of 2 (or -1) was read as 1 by the forward (HF reads it as True too) and the eager
    ``router_logits=True`` call ran it compiled, where a check of the mask's values cannot read
    them. Now every eager call refuses it naming the entry (MASK_NOT_ZERO_ONE); traced, the
    row holding it gives NaN logits and router logits, the other row's tokens unchanged (the
    experts route each token on its own: no NaN reaches another row)."""
    model = ft.nn.from_hf(transformers.MixtralConfig(**SIZES), key=jax.random.key(0))
    ids, mask = batch()
    bad = mask.copy()
    bad[1, -1] = 2
    for call in (lambda: model(ids, bad), lambda: model(ids, bad, router_logits=True),
                 lambda: model.aux_loss(ids, bad)):
        with pytest.raises(ValueError, match=rf"attention_mask\[1, {T - 1}\] is 2; a mask holds 1 \(or True\)"):
            call()
    run = jax.jit(lambda m, am: m(ids, am, router_logits=True))
    logits, routed = run(model, mask)
    nan_logits, nan_routed = run(model, bad)
    assert np.isnan(nan_logits[1]).all() and np.isnan(nan_routed[:, T:]).all()
    np.testing.assert_array_equal(nan_logits[0], logits[0])
    np.testing.assert_array_equal(nan_routed[:, :T], routed[:, :T])


def test_an_eager_router_logits_call_checks_the_ids_as_a_plain_call_does():
    """An id outside the vocabulary: the plain eager call refuses it naming the id
    (OUT_OF_VOCABULARY); the eager ``router_logits=True`` call ran it compiled, where the
    ids are traced, and gave NaN logits, router logits and aux loss instead. Now checked
    before the compiled call, by ``model.aux_loss(ids)`` too."""
    model = ft.nn.from_hf(transformers.MixtralConfig(**SIZES), key=jax.random.key(0))
    ids, mask = batch()
    ids = ids.copy()
    ids[1, 4] = VOCAB + 3
    for call in (lambda: model(ids, mask), lambda: model(ids, mask, router_logits=True),
                 lambda: model.aux_loss(ids, mask)):
        with pytest.raises(ValueError, match=rf"token id {VOCAB + 3} at input_ids\[1, 4\] is outside the vocabulary"):
            call()
