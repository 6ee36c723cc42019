"""Hugging Face's ``*ForQuestionAnswering`` (functree/hf/_heads.py's QuestionAnswering) against
transformers' own, in float64.

Each HF model is built from a tiny config with random weights (no download), moved by
N(0, 0.3) so every tensor matters, and converted to float64 (``.double()``). Its start and
end logits, HF's ``start_positions=`` / ``end_positions=`` loss and every parameter's
gradient of that loss must equal HF's. HF computes a rotary family's cos/sin in float32
whatever the model's dtype, so those families agree to float32 rounding: measured 2.6e-7 of
the logits' magnitude at most (Qwen3), 1.7e-8 of the loss (Qwen2), 2.3e-7 of the largest
gradient (Llama); the tolerance is 3e-6 of the magnitude (about 10x). GPT-2, OPT and BERT
learn their positions: 1.5e-15 measured, 3e-14 allowed.
"""

import json
import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import functree as ft
from functree.hf import _heads
from functree.hf._family import TASKS

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
loss_utils = pytest.importorskip("transformers.loss.loss_utils")

PAD = 1
SMALL = {"vocab_size": 24, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
         "num_attention_heads": 4, "num_key_value_heads": 2, "pad_token_id": PAD}
CONFIGS = {
    "Llama": lambda: transformers.LlamaConfig(**SMALL),
    "Qwen2": lambda: transformers.Qwen2Config(**SMALL),
    "Mistral": lambda: transformers.MistralConfig(**SMALL),
    "Ministral": lambda: transformers.MinistralConfig(**SMALL, head_dim=4),  # (HF's attention needs head_dim)
    "Qwen3": lambda: transformers.Qwen3Config(**SMALL, head_dim=4),
    # 4 experts, top-2; float64 needs HF's eager experts (its CPU default, grouped_mm, takes float32)
    "Mixtral": lambda: transformers.MixtralConfig(**SMALL, num_local_experts=4, experts_implementation="eager"),
    "Qwen3Moe": lambda: transformers.Qwen3MoeConfig(**SMALL, head_dim=4, num_experts=4, num_experts_per_tok=2,
                                                    moe_intermediate_size=8,
                                                    experts_implementation="eager"),
    # biased q/k/v, 4 experts of 8, top-2 kept, a shared expert gated per token (its QA body is "model", as Mistral's)
    "Qwen2Moe": lambda: transformers.Qwen2MoeConfig(**SMALL, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
                                                    shared_expert_intermediate_size=8, experts_implementation="eager"),
    "GPT2": lambda: transformers.GPT2Config(vocab_size=24, n_embd=16, n_layer=1, n_head=4, n_positions=16,
                                            pad_token_id=PAD, bos_token_id=0, eos_token_id=0),
    "GPTNeoX": lambda: transformers.GPTNeoXConfig(vocab_size=24, hidden_size=16, intermediate_size=32,
                                                  num_hidden_layers=1, num_attention_heads=4, pad_token_id=PAD,
                                                  rotary_pct=0.5),
    "OPT": lambda: transformers.OPTConfig(vocab_size=24, hidden_size=16, ffn_dim=32, num_hidden_layers=1,
                                          num_attention_heads=4, word_embed_proj_dim=8,
                                          max_position_embeddings=16, pad_token_id=PAD),
    "Bert": lambda: transformers.BertConfig(vocab_size=24, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                            num_attention_heads=4, max_position_embeddings=16, pad_token_id=PAD),
}
LEARNED = ("GPT2", "OPT", "Bert")  # no rotary embedding: float64 throughout in HF
# Row 0 right-padded, row 1 left-padded, row 2 unpadded.
IDS = np.array([[5, 6, 7, 8, 9, 1, 1], [1, 1, 3, 4, 5, 9, 2], [4, 3, 2, 8, 7, 6, 5]], np.int32)
MASK = (IDS != PAD).astype(np.int32)
# The loss's softmax runs over every token, padding too: rows without left padding, whose
# padding tokens see real ones (a left-padded decoder row's first tokens see none, and
# their logits are each implementation's own: HF's sdpa and eager differ).
LOSS_ROWS = [0, 2]
# Positions in range, one past the input (T: ignored) and one below it (clamped to 0).
STARTS, ENDS = np.array([2, 9]), np.array([4, -3])


def hf_model(family):
    torch.manual_seed(0)
    hf = getattr(transformers, family + "ForQuestionAnswering")(CONFIGS[family]()).double()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return hf.eval()


def tolerance(family):
    return 3e-14 if family in LEARNED else 3e-6


def assert_close(ours, theirs, family, scale=None):
    scale = float(np.abs(theirs).max()) if scale is None else scale
    np.testing.assert_allclose(np.asarray(ours), theirs, rtol=0, atol=tolerance(family) * scale)


@pytest.mark.parametrize("family", list(CONFIGS))
def test_logits_loss_and_gradient_are_hfs_in_float64(family):
    hf = hf_model(family)
    with jax.enable_x64(True):
        model = ft.nn.from_hf(hf, dtype=jnp.float64)
        assert TASKS[f"{family}ForQuestionAnswering"] is type(model)
        assert sorted(ft.nn.to_hf_state_dict(model, numpy=True)) == sorted(hf.state_dict())
        with torch.no_grad():
            expected = hf(torch.from_numpy(IDS).long(), attention_mask=torch.from_numpy(MASK).long())
        ids, mask = IDS[LOSS_ROWS], MASK[LOSS_ROWS]

        @jax.jit  # one program (op by op, each of the model's operations compiled apart)
        def run(m):
            loss, grads = jax.value_and_grad(lambda m: m.loss(m(ids, mask), (STARTS, ENDS)))(m)
            return m(IDS, MASK), loss, grads, m(ids, mask).start_logits

        out, loss, grads, start_logits = run(model)
        real = MASK.astype(bool)  # (a left-padded row's padding: see LOSS_ROWS)
        assert_close(np.asarray(out.start_logits)[real], expected.start_logits.numpy()[real], family)
        assert_close(np.asarray(out.end_logits)[real], expected.end_logits.numpy()[real], family)

        hf.zero_grad()
        theirs = hf(torch.from_numpy(ids).long(), attention_mask=torch.from_numpy(mask).long(),
                    start_positions=torch.from_numpy(STARTS), end_positions=torch.from_numpy(ENDS))
        theirs.loss.backward()
        assert_close(loss, theirs.loss.item(), family)
        assert_close(start_logits, theirs.start_logits.detach().numpy(), family)
        ours = ft.nn.to_hf_state_dict(grads, numpy=True)
        hf_grads = {n: p.grad.numpy() for n, p in hf.named_parameters() if p.grad is not None}
        assert set(hf_grads) <= set(ours) and "qa_outputs.weight" in hf_grads
        scale = max(float(np.abs(g).max()) for g in hf_grads.values())
        for name, g in hf_grads.items():
            assert_close(ours[name], g, family, scale)


def hf_loss(start, end, starts, ends, **kwargs):
    return float(loss_utils.ForQuestionAnsweringLoss(torch.from_numpy(start), torch.from_numpy(end),
                                                     torch.from_numpy(starts), torch.from_numpy(ends), **kwargs))


# The bert fixture's forward, one compiled program for the tests that read its logits (eager,
# each of its operations was compiled apart).
forward = jax.jit(lambda m, ids, mask: m(ids, mask))


@pytest.fixture(scope="module")
def bert():
    hf = hf_model("Bert")
    with jax.enable_x64(True):
        return hf, ft.nn.from_hf(hf, dtype=jnp.float64)


@pytest.mark.parametrize(("starts", "ends"), [
    ([0, 6], [6, 0]),                     # the first and the last token
    ([7, 3], [3, 100]),                   # T and past it: ignored (HF's clamp to T, its ignore_index)
    ([-1, 3], [-100, 2]),                 # negative: clamped to 0, counted at token 0 (not ignored)
    ([7, 8], [2, 5]),                     # every start ignored: HF's NaN start loss, a NaN loss
    ([[2], [5]], [[3], [6]]),             # [batch, 1]: squeezed
])
def test_the_loss_is_hfs_clamp_and_ignore_index_included(bert, starts, ends):
    """HF's ForQuestionAnsweringLoss (the generic classes') on random float64 logits, T = 7."""
    rng = np.random.default_rng(0)
    start, end = rng.normal(size=(2, 2, 7))
    starts, ends = np.array(starts), np.array(ends)
    with jax.enable_x64(True):
        ours = float(ft.hf.task_loss(bert[1], _heads.SpanLogits(start, end), (starts, ends)))
    expected = hf_loss(start, end, starts, ends)
    np.testing.assert_allclose(ours, expected, rtol=1e-14, equal_nan=True)
    if np.array_equal(starts, [7, 8]):
        assert np.isnan(ours)


def test_bert_s_own_loss_is_the_same_on_out_of_range_positions(bert):
    """BERT (and GPT-2, OPT) write the loss out in their forward: the same clamp and ignore."""
    hf, model = bert
    starts, ends = np.array([7, -2, 3]), np.array([3, 12, 6])
    with torch.no_grad():
        expected = hf(torch.from_numpy(IDS).long(), attention_mask=torch.from_numpy(MASK).long(),
                      start_positions=torch.from_numpy(starts), end_positions=torch.from_numpy(ends))
    with jax.enable_x64(True):
        logits = forward(model, IDS, MASK)  # BERT's padding tokens see the real ones: every row compared
        assert_close(logits.start_logits, expected.start_logits.numpy(), "Bert")
        np.testing.assert_allclose(float(model.loss(logits, (starts, ends))), float(expected.loss), rtol=1e-13)
        jitted = jax.jit(lambda m, s, e: m.loss(m(IDS, MASK), (s, e)))(model, starts, ends)  # traced positions
        np.testing.assert_allclose(float(jitted), float(expected.loss), rtol=1e-13)


def test_num_items_in_batch_is_not_taken_and_hf_s_trainer_counts_none_for_a_qa_batch():
    """HF's generic QA loss divides by num_items_in_batch where given; its Trainer counts it
    from ``labels`` alone, which a QA batch has not, so the loss is the mean, task_loss's."""
    import inspect

    source = inspect.getsource(transformers.Trainer._get_num_items_in_batch)
    assert '"labels" in batch_samples[0]' in source
    assert "num_items_in_batch" not in inspect.signature(ft.hf.task_loss).parameters


@pytest.mark.parametrize("family", ["Llama", "Bert"])  # (Llama: HF's body under transformer.*)
def test_save_hf_is_read_by_from_pretrained_and_back(family, tmp_path):
    hf = hf_model(family).float()
    model = ft.nn.from_hf(hf)
    ft.nn.save_hf(model, tmp_path)
    name = f"{family}ForQuestionAnswering"
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == [name]
    back = transformers.AutoModelForQuestionAnswering.from_pretrained(tmp_path)
    assert type(back).__name__ == name
    assert sorted(back.state_dict()) == sorted(hf.state_dict())
    for k, v in hf.state_dict().items():
        np.testing.assert_array_equal(back.state_dict()[k].numpy(), v.numpy(), err_msg=k)
    again = ft.nn.from_hf(tmp_path)
    assert type(again) is type(model)
    for a, b in zip(forward(again, IDS, MASK), forward(model, IDS, MASK)):  # one program each (eager: one per operation)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_config_dict_naming_the_class_builds_it_initialized_as_hf_and_its_weights_load():
    config = {**SMALL, "model_type": "llama", "architectures": ["LlamaForQuestionAnswering"],
              "initializer_range": 0.5, "num_labels": 5}  # (the generic class ignores num_labels: 2 outputs)
    model = ft.nn.from_hf(config, key=jax.random.key(0))
    assert type(model).__name__ == "LlamaForQuestionAnswering" and model.qa_outputs.weight.shape == (16, 2)
    assert 0.3 < float(jnp.std(model.qa_outputs.weight)) < 0.7 and not np.any(model.qa_outputs.bias)
    weights = ft.nn.to_hf_state_dict(model, numpy=True)
    assert "transformer.layers.0.self_attn.q_proj.weight" in weights  # HF's base_model_prefix
    hf = transformers.LlamaForQuestionAnswering(transformers.LlamaConfig(**SMALL))
    hf.load_state_dict(ft.nn.to_hf_state_dict(model), strict=True)
    again = ft.nn.from_hf(config, weights)
    for a, b in zip(forward(again, IDS, MASK), forward(model, IDS, MASK)):  # one program each (eager: one per operation)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(TypeError, match=r"token_type_ids are BERT's segment ids; functree's decoder bodies take none"):
        model(IDS, MASK, np.zeros_like(IDS))


# ---- refusals


def test_a_bert_head_of_other_than_two_labels_is_refused_as_hf_fails_on_it():
    config = transformers.BertConfig(vocab_size=24, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                     num_attention_heads=4, max_position_embeddings=16, num_labels=3)
    hf = transformers.BertForQuestionAnswering(config)
    with pytest.raises(ValueError, match="too many values to unpack"):
        hf(torch.from_numpy(IDS).long())
    with pytest.raises(ValueError, match=r"(?s)BertForQuestionAnswering's qa_outputs has num_labels outputs.*"
                                         r"the config gives 3.*right:  \"num_labels\": 2"):
        ft.nn.from_hf(hf)


def test_labels_and_logits_that_are_no_span_pair_are_refused(bert):
    _, model = bert
    with jax.enable_x64(True):
        _refusals(model, forward(model, IDS, MASK), np.array([1, 2, 3]))


def _refusals(model, logits, starts):
    with pytest.raises(ValueError, match=r"(?s)labels are a pair: the start's and the end's; got i64\[3\].*"
                                         r"right:  model.loss\(logits, \(start_positions, end_positions\)\)"):
        model.loss(logits, starts)
    with pytest.raises(ValueError, match=r"logits are a pair: the start's and the end's; got f64\[3,7\]"):
        model.loss(logits.start_logits, (starts, starts))
    with pytest.raises(ValueError, match=r"start positions are integer token indices \[batch\]"):
        model.loss(logits, (starts.astype(np.float64), starts))
    with pytest.raises(ValueError, match=r"end positions are integer token indices \[batch\]"):
        model.loss(logits, (starts, np.stack([starts, starts], -1)))


def test_a_causal_lm_checkpoint_is_refused_naming_the_body_s_name_and_the_fix_loads_its_body(tmp_path):
    """Llama's QA body is HF's transformer.*: a LlamaForCausalLM checkpoint (model.*) is not
    read into it by transformers' from_pretrained (the body stays random, HF warns; checked
    here), so from_hf refuses it; the message's fix builds the checkpoint's body with a
    fresh qa_outputs (was: "num_hidden_layers": 0, the layer count blamed)."""
    torch.manual_seed(0)
    causal = transformers.LlamaForCausalLM(CONFIGS["Llama"]())
    causal.save_pretrained(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = transformers.LlamaForQuestionAnswering.from_pretrained(tmp_path)
    assert not torch.equal(hf.transformer.embed_tokens.weight, causal.model.embed_tokens.weight)
    config = {**causal.config.to_dict(), "architectures": ["LlamaForQuestionAnswering"]}
    weights = causal.state_dict()
    with pytest.raises(ValueError, match=r"(?s)LlamaForQuestionAnswering keeps its body as transformer\.\*.*"
                                         r"the weights name it model\.\* \(a LlamaForCausalLM's") as info:
        ft.nn.from_hf(config, weights)
    scope = {"ft": ft, "jax": jax, "config": config, "weights": weights}
    exec("\n".join(line.strip() for line in str(info.value).split("right:  ")[1].splitlines()), scope)  # the fix
    model = scope["model"]
    np.testing.assert_array_equal(np.asarray(model.body.model.embed_tokens.embeddings),
                                  causal.model.embed_tokens.weight.detach().numpy())
    assert type(model).__name__ == "LlamaForQuestionAnswering"


def test_its_weights_under_a_config_naming_no_class_are_refused_naming_it():
    hf = hf_model("Llama").float()
    assert hf.config.architectures is None
    with pytest.raises(ValueError, match=r"(?s)task head's tensors \(\['qa_outputs.bias', 'qa_outputs.weight'\]\)"
                                         r".*\(LlamaForQuestionAnswering\)"):
        ft.nn.from_hf(hf.config, hf.state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fixed = ft.nn.from_hf({**hf.config.to_dict(), "architectures": ["LlamaForQuestionAnswering"]}, hf.state_dict())
    assert type(fixed).__name__ == "LlamaForQuestionAnswering"


def test_families_without_a_qa_class_in_transformers_have_none():
    for family, model_type in [("Gemma", "gemma"), ("Phi3", "phi3"), ("Olmo", "olmo"), ("Olmo2", "olmo2"),
                               ("Gemma2", "gemma2"), ("Phi", "phi")]:
        assert not hasattr(transformers, f"{family}ForQuestionAnswering")
        assert "ForQuestionAnswering" not in _heads.HEADS[model_type]
    for name in TASKS:
        if name.endswith("ForQuestionAnswering"):
            assert hasattr(transformers, name), name
