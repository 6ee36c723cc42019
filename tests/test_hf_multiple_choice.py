"""Hugging Face's ``*ForMultipleChoice`` (functree/hf/_heads.py's PooledMultipleChoice) for
BERT, RoBERTa and XLM-RoBERTa, against transformers' own, in float64.

Each HF model is built from a tiny config with random weights (no download), moved by
N(0, 0.3) so every tensor matters, and converted to float64. Its logits ``[batch,
num_choices]`` over padded choices with segment ids, HF's ``labels=`` loss and every
parameter's gradient of it must equal HF's (learned positions, no rotary: float64
throughout; measured 2.0e-15 of the magnitude at most, RoBERTa's gradient; 3e-14 allowed); the files go both
ways (``save_pretrained`` -> ``from_hf``, ``save_hf`` -> ``AutoModelForMultipleChoice``),
``with_head`` starts one from a body, PEFT reads its LoRA adapters with the trained
classifier, and inputs of the wrong layout are refused by name.
"""

import json
import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import functree as ft
from functree.hf._family import TASKS

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

SMALL = {"vocab_size": 24, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
         "num_attention_heads": 4, "max_position_embeddings": 20}
CONFIGS = {
    "Bert": lambda **c: transformers.BertConfig(**SMALL, pad_token_id=0, **c),
    "Roberta": lambda **c: transformers.RobertaConfig(**SMALL, pad_token_id=1, **c),
    "XLMRoberta": lambda **c: transformers.XLMRobertaConfig(**SMALL, pad_token_id=1, **c),
}
PAD = {"Bert": 0, "Roberta": 1, "XLMRoberta": 1}
LABELS = np.array([2, 0])


def hf_model(family, dtype=torch.float64, **changes):
    torch.manual_seed(0)
    hf = getattr(transformers, family + "ForMultipleChoice")(CONFIGS[family](**changes)).to(dtype)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return hf.eval()


def inputs(family):
    """``[2, 3, 7]`` ids (row 1's choices right-padded after 5 tokens), mask, segment ids
    (BERT's second segment from token 4; RoBERTa's one segment: zeros)."""
    ids = np.random.default_rng(0).integers(3, 24, (2, 3, 7)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[1, :, 5:] = 0
    ids[1, :, 5:] = PAD[family]
    types = np.zeros_like(ids)
    if family == "Bert":
        types[..., 4:] = 1
    return ids, mask, types


def hf_call(hf, ids, mask, types, **kwargs):
    as_torch = [torch.from_numpy(x).long() for x in (ids, mask, types)]
    return hf(as_torch[0], attention_mask=as_torch[1], token_type_ids=as_torch[2], **kwargs)


def assert_close(ours, theirs, scale=None):
    scale = float(np.abs(theirs).max()) if scale is None else scale
    np.testing.assert_allclose(np.asarray(ours), theirs, rtol=0, atol=3e-14 * scale)


@pytest.mark.parametrize("family", list(CONFIGS))
def test_logits_loss_and_gradient_are_hfs_in_float64(family):
    hf = hf_model(family)
    ids, mask, types = inputs(family)
    hf.zero_grad()
    expected = hf_call(hf, ids, mask, types, labels=torch.from_numpy(LABELS))
    expected.loss.backward()
    with jax.enable_x64(True):
        model = ft.nn.from_hf(hf, dtype=jnp.float64)
        assert TASKS[f"{family}ForMultipleChoice"] is type(model)
        assert sorted(ft.nn.to_hf_state_dict(model, numpy=True)) == sorted(hf.state_dict())
        # one program (op by op, each operation compiled apart)
        logits, (loss, grads) = jax.jit(lambda m: (m(ids, mask, types), jax.value_and_grad(
            lambda m: m.loss(m(ids, mask, types), LABELS))(m)))(model)
        assert logits.shape == (2, 3)
        assert_close(logits, expected.logits.detach().numpy())
        assert_close(loss, expected.loss.item())
        assert_close(ft.hf.task_loss(model, logits, LABELS), expected.loss.item())
    ours = ft.nn.to_hf_state_dict(grads, numpy=True)
    hf_grads = {n: p.grad.numpy() for n, p in hf.named_parameters() if p.grad is not None}
    assert set(hf_grads) <= set(ours) and "classifier.weight" in hf_grads
    scale = max(float(np.abs(g).max()) for g in hf_grads.values())
    for name, g in hf_grads.items():
        assert_close(ours[name], g, scale)


@pytest.mark.parametrize("family", list(CONFIGS))
def test_files_both_ways(family, tmp_path):
    """HF's directory read by from_hf (its config names the class), and save_hf's read by
    ``AutoModelForMultipleChoice`` with no key missing or left over."""
    hf = hf_model(family, torch.float32)
    ids, mask, types = inputs(family)
    with torch.no_grad():
        expected = hf_call(hf, ids, mask, types).logits.numpy()
    hf.save_pretrained(tmp_path / "hf")
    model = ft.nn.from_hf(tmp_path / "hf")
    assert type(model).__name__ == f"{family}ForMultipleChoice"
    np.testing.assert_allclose(np.asarray(model(ids, mask, types)), expected, rtol=0,
                               atol=2.5e-5 * float(np.abs(expected).max()))
    ft.nn.save_hf(model, tmp_path / "ours")
    assert json.loads((tmp_path / "ours" / "config.json").read_text())["architectures"] == [
        f"{family}ForMultipleChoice"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        back, info = transformers.AutoModelForMultipleChoice.from_pretrained(tmp_path / "ours",
                                                                             output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    written = back.state_dict()
    for name, value in hf.state_dict().items():  # every weight bit for bit
        np.testing.assert_array_equal(written[name].numpy(), value.numpy(), err_msg=name)


def test_the_head_dropout_rates_are_each_class_own():
    """BERT's reads ``classifier_dropout`` (else ``hidden_dropout_prob``); RoBERTa's reads
    ``hidden_dropout_prob`` alone, as HF's classes do. In training mode the head drops:
    two keys give two scores."""
    rates = {}
    for family in ("Bert", "Roberta"):
        hf = hf_model(family, torch.float32, classifier_dropout=0.3, hidden_dropout_prob=0.2)
        rates[family] = ft.nn.from_hf(hf, dropout=True, key=jax.random.key(0)).dropout
    assert rates == {"Bert": 0.3, "Roberta": 0.2}
    model = ft.nn.training(ft.nn.from_hf(hf_model("Bert", torch.float32, classifier_dropout=0.5,
                                                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
                                         dropout=True, key=jax.random.key(0)))
    ids, mask, types = inputs("Bert")
    first, second = (np.asarray(model(ids, mask, types, key=jax.random.key(k))) for k in (1, 2))
    assert not np.allclose(first, second)
    evaluated = ft.nn.inference(model)
    np.testing.assert_array_equal(np.asarray(evaluated(ids, mask, types, key=jax.random.key(1))),
                                  np.asarray(evaluated(ids, mask, types, key=jax.random.key(2))))


def test_with_head_starts_one_from_a_body():
    body = ft.nn.from_hf(transformers.BertModel(CONFIGS["Bert"]()))
    model = ft.hf.with_head(body, "ForMultipleChoice", key=jax.random.key(1))
    assert type(model).__name__ == "BertForMultipleChoice" and model.classifier.weight.shape == (16, 1)
    assert model.body.encoder is body.encoder  # the body's arrays themselves
    ids, mask, types = inputs("Bert")
    assert model(ids, mask, types).shape == (2, 3)


def test_wrong_layouts_are_refused_by_name():
    model = ft.nn.from_hf(hf_model("Bert", torch.float32))
    ids, mask, types = inputs("Bert")
    with pytest.raises(ValueError, match=r"(?s)input_ids is \[batch, num_choices, T\].*got i32\[2,7\].*"
                                         r"right:  model\(jnp.stack"):
        model(ids[:, 0])
    with pytest.raises(ValueError, match=r"attention_mask is input_ids' shape \[2, 3, 7\].*got i32\[2,7\]"):
        model(ids, mask[:, 0])
    with pytest.raises(ValueError, match=r"token_type_ids is input_ids' shape"):
        model(ids, mask, types[:, :, :5])
    logits = model(ids, mask, types)
    with pytest.raises(ValueError, match=r"(?s)the right choice's index per row, int \[2\].*"
                                         r"right:  model.loss\(logits, answers\)"):
        model.loss(logits, jax.nn.one_hot(LABELS, 3))
    with pytest.raises(ValueError, match=r"label 3 at labels\[0\] is not a class of logits f32\[2,3\] \(classes 0 to 2\)"):
        model.loss(logits, np.array([3, 0]))
    np.testing.assert_allclose(float(model.loss(logits, np.array([2, -100]))),  # -100: ignored, as torch
                               float(jax.nn.logsumexp(logits[0]) - logits[0, 2]), rtol=1e-6)


def test_lora_adapters_and_the_trained_classifier_load_in_peft(tmp_path):
    """LoRA on the attention's query and value, the new classifier trained whole beside them
    (wrt=), save_lora: PEFT has no multiple-choice task type, so the classifier is written in
    modules_to_save (its users list it), and PEFT's model scores as the trained one."""
    peft = pytest.importorskip("peft")
    hf = hf_model("Roberta", torch.float32)
    hf.save_pretrained(tmp_path / "base")
    ids, mask, types = inputs("Roberta")
    adapted = ft.nn.lora(ft.nn.from_hf(tmp_path / "base"), ["*.query", "*.value"], rank=2, alpha=4,
                         key=jax.random.key(3))
    opt = ft.optim.Optimizer(ft.optim.adam(3e-2), wrt=["*.lora_*", "classifier.*"])
    state = opt.init(adapted)
    loss_fn = lambda m: m.loss(m(ids, mask, types), LABELS)  # noqa: E731
    first = float(jax.jit(loss_fn)(adapted))
    # one compiled step (op by op, each of the model's operations compiled apart)
    step = ft.jit(lambda m, s: opt.minimize(loss_fn, m, s))
    for _ in range(10):
        adapted, state, loss = step(adapted, state)
    assert float(loss) < first
    ft.nn.save_lora(adapted, tmp_path / "adapter")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["modules_to_save"] == ["classifier"] and config["task_type"] is None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        base = transformers.AutoModelForMultipleChoice.from_pretrained(tmp_path / "base")
        theirs = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
    with torch.no_grad():
        expected = hf_call(theirs, ids, mask, types).logits.numpy()
    np.testing.assert_allclose(np.asarray(adapted(ids, mask, types)), expected, rtol=0,
                               atol=2.5e-5 * float(np.abs(expected).max()))
    again = ft.nn.load_lora(ft.nn.from_hf(tmp_path / "base"), tmp_path / "adapter")
    np.testing.assert_allclose(np.asarray(again(ids, mask, types)), expected, rtol=0,
                               atol=2.5e-5 * float(np.abs(expected).max()))
