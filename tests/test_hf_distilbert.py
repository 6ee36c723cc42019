"""DistilBERT (functree/hf/_distilbert.py, _distilbert_heads.py) against transformers' own.

Each HF model is built from a tiny config with random weights (no download), moved by
N(0, 0.3) so every tensor matters, and converted to float64 (``.double()``). Its outputs,
HF's ``labels=`` loss and every parameter's gradient must equal HF's, on a batch with a
right-padded, a left-padded and an unpadded row (HF's attention mask is a padding mask;
positions are ``0..T-1`` whatever the mask). Measured: 1.5e-15 of the outputs' magnitude at
most (the masked LM; 4.0e-15 on another draw), 3.8e-16 of the loss, 2.3e-15 of the largest
gradient (multiple choice); the tolerance is 3e-14 of the magnitude (tests/test_hf_roberta.py's:
about 10x). float32 against HF's float32 (every source, files both ways, PEFT): 2e-5 of the
magnitude (tests/test_hf_heads.py's; measured 7.2e-7); HF's train() on the same masks: 2.5e-5
(tests/test_hf_dropout.py's; measured 3.2e-7).
"""

import copy
import json
import os
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import functree as ft
from functree.hf import _distilbert, _heads
from functree.hf._family import FAMILIES, TASKS
from functree.hf._heads import TIED_COPY_DIFFERS

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from test_hf_dropout import same_masks  # noqa: E402, F401  (same_masks: a fixture)
from test_hf_roberta import hf_out, peft_seq_cls  # noqa: E402  (HF's output and loss; PEFT's own adapter)

PAD = 0
SMALL = {"vocab_size": 24, "dim": 16, "n_heads": 4, "n_layers": 2, "hidden_dim": 32, "max_position_embeddings": 10,
         "pad_token_id": PAD}
# Row 0 right-padded, row 1 left-padded, row 2 unpadded ([CLS] 1 ... [SEP] 2).
IDS = np.array([[1, 5, 6, 7, 8, 2, 0, 0], [0, 0, 1, 3, 4, 5, 9, 2], [1, 4, 3, 9, 8, 7, 6, 2]], np.int32)
MASK = (IDS != PAD).astype(np.int32)
REAL = MASK.astype(bool)
CHOICES = np.stack([IDS, IDS[[1, 2, 0]]], axis=1)  # [3 rows, 2 choices, T]
CHOICE_MASK = (CHOICES != PAD).astype(np.int32)
TOL = 3e-14
CLASSES = ["DistilBertModel", "DistilBertForSequenceClassification", "DistilBertForTokenClassification",
           "DistilBertForMaskedLM", "DistilBertForQuestionAnswering", "DistilBertForMultipleChoice"]


def hf_model(name, **changes):
    torch.manual_seed(0)
    labels = {"num_labels": 2 if name.endswith("QuestionAnswering") else 3}
    hf = getattr(transformers, name)(transformers.DistilBertConfig(**{**SMALL, **labels, **changes})).double()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return hf.eval()


def inputs(name):
    return (CHOICES, CHOICE_MASK) if name.endswith("MultipleChoice") else (IDS, MASK)


def ours(model, ids, mask):
    out = model(ids, mask)
    return np.stack(out, -1) if isinstance(out, tuple) else np.asarray(out)


def at_tokens(a):
    """A token's output at the real tokens (padding's is each side's own); others as they are."""
    return a[REAL] if a.ndim == 3 and a.shape[:2] == IDS.shape else a


def close(a, b, scale=None, tol=TOL):
    a, b = at_tokens(np.asarray(a)), at_tokens(np.asarray(b))
    scale = float(np.abs(b).max()) if scale is None else scale
    np.testing.assert_allclose(a, b, rtol=0, atol=tol * scale)


@pytest.mark.parametrize(("name", "changes"), [(n, {}) for n in CLASSES] + [
    ("DistilBertForMaskedLM", {"activation": "relu"}),  # (the blocks' and the head's activation)
    ("DistilBertForMaskedLM", {"tie_word_embeddings": False})])
def test_outputs_are_hfs_in_float64_with_left_and_right_padding(name, changes):
    hf = hf_model(name, **changes)
    with jax.enable_x64(True):
        model = ft.nn.from_hf(hf, dtype=jnp.float64)
        assert type(model).__name__ == name
        assert sorted(ft.nn.to_hf_state_dict(model, numpy=True)) == sorted(hf.state_dict())
        with torch.no_grad():
            expected, _ = hf_out(hf, *inputs(name))
        close(ours(model, *inputs(name)), expected)


# name -> (HF's keyword labels, config changes)
LOSSES = {
    "single_label": ("DistilBertForSequenceClassification", {"labels": np.array([2, 0, 1])}, {}),
    "regression": ("DistilBertForSequenceClassification", {"labels": np.array([0.5, -1.0, 2.0])}, {"num_labels": 1}),
    "multi_label": ("DistilBertForSequenceClassification",
                    {"labels": np.array([[1.0, 0, 1], [0, 0, 1], [1, 1, 0]])}, {}),
    "token": ("DistilBertForTokenClassification", None, {}),
    "masked_lm": ("DistilBertForMaskedLM", None, {}),
    "qa": ("DistilBertForQuestionAnswering", {"start_positions": np.array([2, 9, 3]),
                                              "end_positions": np.array([4, 5, -3])}, {}),
    "multiple_choice": ("DistilBertForMultipleChoice", {"labels": np.array([1, 0, 1])}, {}),
}


def _token_labels(vocab):
    labels = np.random.default_rng(1).integers(0, vocab, IDS.shape)
    labels[~REAL] = -100  # padding and (MLM) the unmasked tokens are not scored
    labels[0, 1] = labels[2, 3] = -100
    return {"labels": labels}


@pytest.mark.parametrize("case", LOSSES)
def test_the_loss_and_every_gradient_are_hfs_in_float64(case):
    """HF's ``outputs.loss`` and each parameter's gradient of it: the word table's row
    pad_token_id passes none in either (a tied projector's logits still train it)."""
    name, given, changes = LOSSES[case]
    hf = hf_model(name, **changes)
    if given is None:
        given = _token_labels(24 if name.endswith("MaskedLM") else 3)
    hf.zero_grad()
    _, loss = hf_out(hf, *inputs(name), **{k: torch.from_numpy(v) for k, v in given.items()})
    loss.backward()
    with jax.enable_x64(True):
        model = ft.nn.from_hf(hf, dtype=jnp.float64)
        labels = given["labels"] if "labels" in given else (given["start_positions"], given["end_positions"])
        # one program (op by op, each operation compiled apart)
        value, grads = jax.jit(jax.value_and_grad(lambda m: m.loss(m(*inputs(name)), labels)))(model)
        close(value, loss.item())
        theirs = {n: p.grad.numpy() for n, p in hf.named_parameters() if p.grad is not None}
        mine = ft.nn.to_hf_state_dict(grads, numpy=True)
        assert set(theirs) <= set(mine) and len(theirs) >= 20
        scale = max(float(np.abs(g).max()) for g in theirs.values())
        for n, g in theirs.items():
            close(mine[n], g, scale)
        if case == "single_label":
            assert not mine["distilbert.embeddings.word_embeddings.weight"][PAD].any()


def test_the_bodys_gradients_are_hfs_in_float64():
    hf = hf_model("DistilBertModel")
    readout = np.random.default_rng(2).normal(size=(*IDS.shape, 16)) * REAL[..., None]
    hf.zero_grad()
    (hf(torch.from_numpy(IDS).long(), attention_mask=torch.from_numpy(MASK).long()).last_hidden_state
     * torch.from_numpy(readout)).sum().backward()
    with jax.enable_x64(True):
        model = ft.nn.from_hf(hf, dtype=jnp.float64)
        # one program (op by op, each operation compiled apart)
        grads = jax.jit(jax.grad(lambda m: jnp.sum(m(IDS, MASK) * readout)))(model)
        mine = ft.nn.to_hf_state_dict(grads, numpy=True)
        theirs = {n: p.grad.numpy() for n, p in hf.named_parameters()}
        assert set(theirs) == set(mine)
        scale = max(float(np.abs(g).max()) for g in theirs.values())
        for n, g in theirs.items():
            close(mine[n], g, scale)


def _float32(name, **changes):
    hf = hf_model(name, **changes).float()
    with torch.no_grad():
        expected, _ = hf_out(hf, *inputs(name))
    return hf, expected


@pytest.mark.parametrize("name", ["DistilBertForMaskedLM", "DistilBertForSequenceClassification"])
def test_float32_from_every_source_is_hfs(name, tmp_path):
    """The transformers object, its config and state dict, config.json as a dict with the
    weights as NumPy, and a save_pretrained directory (read without transformers)."""
    hf, expected = _float32(name)
    state = hf.state_dict()
    config = json.loads(hf.config.to_json_string())
    hf.save_pretrained(tmp_path)
    sources = [(hf,), (hf.config, state), ({**config, "architectures": [name]}, {k: v.numpy() for k, v in state.items()}),
               (tmp_path,)]
    for source in sources:
        model = ft.nn.from_hf(*source)
        assert type(model).__name__ == name
        close(ours(model, *inputs(name)), expected, tol=2e-5)


@pytest.mark.parametrize(("name", "auto", "changes"), [
    ("DistilBertModel", "AutoModel", {}),
    ("DistilBertForMaskedLM", "AutoModelForMaskedLM", {}),
    ("DistilBertForMaskedLM", "AutoModelForMaskedLM", {"tie_word_embeddings": False, "sinusoidal_pos_embds": True}),
    ("DistilBertForQuestionAnswering", "AutoModelForQuestionAnswering", {}),
    ("DistilBertForMultipleChoice", "AutoModelForMultipleChoice", {})])
def test_save_hf_is_read_by_from_pretrained_and_back(name, auto, changes, tmp_path):
    hf = hf_model(name, **changes).float()
    model = ft.nn.from_hf(hf)
    ft.nn.save_hf(model, tmp_path)
    back, info = getattr(transformers, auto).from_pretrained(tmp_path, output_loading_info=True)
    assert type(back).__name__ == name and not any(info.values()), info  # no missing, unexpected or mismatched key
    for k, v in hf.state_dict().items():
        np.testing.assert_array_equal(back.state_dict()[k].numpy(), v.numpy(), err_msg=k)
    with torch.no_grad():
        expected, _ = hf_out(back.eval(), *inputs(name))
    close(ours(ft.nn.from_hf(tmp_path), *inputs(name)), expected, tol=2e-5)


def test_older_files_names_are_read_as_hf_reads_them():
    """A task file's body under ``distilbert.`` read as DistilBertModel (with the masked LM's
    head beside it: refused naming the class the weights are), an older file's ``position_ids`` buffer and
    LayerNorm ``gamma`` / ``beta``; the tied projector's copy in a state dict (equal: read;
    other values: refused naming both; absent, as save_pretrained writes it: the embedding)."""
    hf = hf_model("DistilBertForMaskedLM").float()
    state = {k: v.numpy() for k, v in hf.state_dict().items()}
    expected = ft.nn.from_hf(hf)
    config = {**json.loads(hf.config.to_json_string()), "architectures": ["DistilBertForMaskedLM"]}
    older = {k.replace("embeddings.LayerNorm.weight", "embeddings.LayerNorm.gamma"): v for k, v in state.items()}
    older["distilbert.embeddings.position_ids"] = np.arange(10)[None]
    for weights in (older, {k: v for k, v in state.items() if k != "vocab_projector.weight"}):
        for a, b in zip(jax.tree.leaves(ft.nn.from_hf(config, weights)), jax.tree.leaves(expected)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    differs = {**state, "vocab_projector.weight": state["vocab_projector.weight"] + 1}
    with pytest.raises(ValueError, match=r"the weights' 'vocab_projector.weight' differs from "
                                         r"'distilbert.embeddings.word_embeddings.weight' \(by up to 1\)"):
        ft.nn.from_hf(config, differs)
    assert TIED_COPY_DIFFERS.startswith("ft.nn.from_hf:")
    body_config = {**config, "architectures": ["DistilBertModel"]}
    with pytest.raises(ValueError, match=r"(?s)the weights hold a task head's tensors.*'vocab_layer_norm.bias'"
                                         r".*\"architectures\": \['DistilBertForMaskedLM'\]"):
        ft.nn.from_hf(body_config, state)  # (HF's DistilBertModel.from_pretrained leaves the head unread)
    body = ft.nn.from_hf(body_config, {k: v for k, v in older.items() if k.startswith("distilbert.")})
    for a, b in zip(jax.tree.leaves(body), jax.tree.leaves(expected.body)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    hf_body = transformers.DistilBertModel(hf.config)
    hf_body.load_state_dict({k.removeprefix("distilbert."): torch.from_numpy(v) for k, v in state.items()
                             if k.startswith("distilbert.")})
    with torch.no_grad():
        theirs, _ = hf_out(hf_body.eval(), IDS, MASK)
    close(ours(body, IDS, MASK), theirs, tol=2e-5)


def test_a_wrong_shaped_tensor_is_refused_naming_its_key():
    hf = hf_model("DistilBertForSequenceClassification").float()
    state = {k: v.numpy() for k, v in hf.state_dict().items()}
    config = {**json.loads(hf.config.to_json_string()), "architectures": ["DistilBertForSequenceClassification"]}
    name = "distilbert.transformer.layer.1.ffn.lin1.weight"
    with pytest.raises(ValueError, match=rf"{name}: expected shape \(32, 16\) \(for Stack member "
                                         rf"body\.encoder\.layer\.1\.intermediate\.weight\), given shape \(33, 16\)"):
        ft.nn.from_hf(config, {**state, name: np.zeros((33, 16), np.float32)})
    with pytest.raises(ValueError, match=r"pre_classifier\.weight: expected shape \(16, 16\).*given shape \(16, 15\)"):
        ft.nn.from_hf(config, {**state, "pre_classifier.weight": np.zeros((16, 15), np.float32)})


@pytest.mark.parametrize("sinusoidal", [False, True])
def test_from_config_initializes_as_hf(sinusoidal):
    """HF's ``_init_weights``: normal(0, initializer_range) matrices, the pad row zero, zero
    biases, unit norms; with ``sinusoidal_pos_embds`` the position table is HF's sinusoids
    to the bit (a trainable table all the same: HF saves it)."""
    config = transformers.DistilBertConfig(**SMALL, sinusoidal_pos_embds=sinusoidal, num_labels=3)
    torch.manual_seed(0)
    expected = {k: v.numpy() for k, v in transformers.DistilBertForMaskedLM(config).state_dict().items()}
    config.architectures = ["DistilBertForMaskedLM"]
    mine = ft.nn.to_hf_state_dict(ft.nn.from_hf(config, key=jax.random.key(0)), numpy=True)
    assert set(mine) == set(expected)
    positions = "distilbert.embeddings.position_embeddings.weight"
    if sinusoidal:
        np.testing.assert_array_equal(mine[positions], expected[positions])
        np.testing.assert_array_equal(mine[positions], _distilbert.sinusoids(10, 16))
    words = "distilbert.embeddings.word_embeddings.weight"
    assert np.flatnonzero(np.all(mine[words] == 0, axis=-1)).tolist() == [PAD]
    for name, theirs in expected.items():
        if np.all(theirs == theirs.flat[0]):  # zeros and ones (biases, norms)
            np.testing.assert_array_equal(mine[name], theirs, err_msg=name)
        elif name != positions or not sinusoidal:  # each drawn std HF's, within 5 sigma of the ratio
            assert abs(mine[name].std() / theirs.std() - 1) < 5 / np.sqrt(theirs.size), name


def test_inputs_hf_ignores_or_refuses_are_refused():
    """token_type_ids (HF's forward takes and ignores them: DistilBERT has no segment table),
    head_mask (HF 5.25 takes it in **kwargs and ignores it; functree's call has no such
    argument), more tokens than positions (HF: index out of range), and generate (an encoder)."""
    hf = hf_model("DistilBertForSequenceClassification").float()
    model = ft.nn.from_hf(hf)
    with torch.no_grad():  # HF: the same logits with or without them
        a, _ = hf_out(hf, IDS, MASK, token_type_ids=torch.ones(IDS.shape, dtype=torch.long))
        b, _ = hf_out(hf, IDS, MASK)
    np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match=r"DistilBertModel: DistilBERT has no segment embedding"):
        model(IDS, MASK, np.ones_like(IDS))
    assert _distilbert.NO_TOKEN_TYPES.startswith("{model}: DistilBERT")
    with pytest.raises(TypeError, match="head_mask"):
        model(IDS, MASK, head_mask=np.ones((2, 4)))  # pyright: ignore[reportCallIssue]  # refused
    long = np.ones((1, 11), np.int32)
    with pytest.raises((IndexError, RuntimeError)):
        hf(torch.from_numpy(long).long())
    with pytest.raises(ValueError, match=r"11 positions, but the learned position embedding has 10 "
                                         r"\(max_position_embeddings = 10\)"):
        model(long)
    for generator in (model, model.body):
        with pytest.raises(TypeError, match=r"generate: a Distil.* does not generate text: it is an encoder"):
            ft.nn.generate(generator, IDS, 2)


@pytest.mark.parametrize(("changes", "message"), [
    ({"dim": 18}, r"the distilbert config's 'dim' \(18\) is not a multiple of its 'n_heads' \(4\)"),
    ({"activation": "gelux"}, r"distilbert config.*activation.*gelux"),
    ({"n_layers": 0}, r"the distilbert config's 'n_layers' is 0"),
    ({"num_labels": 3, "architectures": ["DistilBertForQuestionAnswering"]},
     r"DistilBertForQuestionAnswering's qa_outputs has num_labels outputs")])
def test_a_config_hf_refuses_is_refused_naming_the_key(changes, message):
    config = {"model_type": "distilbert", **SMALL, **changes}
    with pytest.raises(ValueError, match=message):
        ft.nn.from_hf(config, key=jax.random.key(0))


def test_config_json_defaults_are_distilbert_configs():
    """A config.json giving no field: DistilBertConfig's defaults, under its own names."""
    model = jax.eval_shape(lambda: ft.nn.from_hf({"model_type": "distilbert",
                                                  "architectures": ["DistilBertForMaskedLM"]}, key=jax.random.key(0)))
    assert model.body.embeddings.word_embeddings.embeddings.shape == (30522, 768)
    assert model.body.embeddings.position_embeddings.embeddings.shape == (512, 768)
    assert model.body.encoder.layer.layers.intermediate.weight.shape == (6, 768, 3072)
    assert model.body.embeddings.LayerNorm.epsilon == 1e-12


@pytest.mark.parametrize(("name", "rate"), [("DistilBertForSequenceClassification", 0.35),
                                            ("DistilBertForMultipleChoice", 0.35),
                                            ("DistilBertForTokenClassification", 0.15),
                                            ("DistilBertForQuestionAnswering", 0.25)])
def test_dropout_true_reads_each_heads_rate_as_hf(name, rate):
    """HF's heads' rates: seq_classif_dropout (sequence, multiple choice), dropout (tokens),
    qa_dropout (QA); inference with dropout=True is HF's eval(); training drops, the same
    masks for the same key."""
    hf = hf_model(name, dropout=0.15, attention_dropout=0.05, seq_classif_dropout=0.35, qa_dropout=0.25).float()
    model = ft.nn.from_hf(hf, dropout=True, key=jax.random.key(0))
    assert model.dropout == rate
    with torch.no_grad():
        expected, _ = hf_out(hf, *inputs(name))
    close(ours(model, *inputs(name)), expected, tol=2e-5)
    training = ft.nn.training(model)
    train = [ours_key(training, name, k) for k in (1, 1, 2)]
    np.testing.assert_array_equal(train[0], train[1])
    assert not np.allclose(train[0], train[2], atol=1e-3)


def ours_key(model, name, key):
    out = model(*inputs(name), key=jax.random.key(key))
    return np.stack(out, -1) if isinstance(out, tuple) else np.asarray(out)


@pytest.mark.parametrize("name", ["DistilBertForSequenceClassification", "DistilBertForQuestionAnswering"])
def test_the_heads_dropout_is_hfs_train_on_the_same_masks(name, same_masks):  # noqa: F811  (the fixture)
    """The body's rates (dropout after the embeddings and lin2, attention_dropout on the
    weights, none after out_lin) and the head's (seq_classif_dropout after the relu,
    qa_dropout before qa_outputs), each where HF's train() applies it."""
    hf = hf_model(name, dropout=0.15, attention_dropout=0.05, seq_classif_dropout=0.35, qa_dropout=0.25).float()
    hf.config._attn_implementation = "eager"  # (torch's dropout: the one the fixture replaces)
    model = ft.nn.training(ft.nn.from_hf(hf, dropout=True, key=jax.random.key(0)))
    hf.train()
    with torch.no_grad():
        expected, _ = hf_out(hf, IDS, MASK)
    head = 0.35 if name.endswith("Classification") else 0.25
    assert {p: same_masks.count(p) for p in set(same_masks)} == {0.15: 3, 0.05: 2, head: 1}
    close(ours_key(model, name, 1), expected, tol=2.5e-5)


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")  # transformers', in PEFT
def test_a_peft_seq_cls_adapter_on_q_lin_and_v_lin_round_trips(tmp_path):
    """ft.nn.lora on DistilBERT's names (q_lin, v_lin, and lin1 by its HF name) + save_lora
    (SEQ_CLS: classifier whole) read by PEFT: the same logits; PEFT's own adapter read by
    load_lora: PEFT's logits."""
    peft = pytest.importorskip("peft")
    hf = hf_model("DistilBertForSequenceClassification").float()
    base = ft.nn.from_hf(hf)
    adapted = ft.nn.lora(base, ["*.q_lin", "*.v_lin", "*.ffn.lin1"], rank=4, key=jax.random.key(0))

    @jax.jit  # one program (eager, each draw and sum compiled apart)
    def moved(adapted):
        keys = iter(jax.random.split(jax.random.key(1), 8))
        adapted = jax.tree.map(lambda x: x.replace(lora_b=0.3 * jax.random.normal(next(keys), x.lora_b.shape))
                               if isinstance(x, ft.nn.LoraDense) else x, adapted,
                               is_leaf=lambda x: isinstance(x, ft.nn.LoraDense))
        return adapted.replace(classifier=adapted.classifier.replace(weight=adapted.classifier.weight + 0.5))

    adapted = moved(adapted)
    ft.hf.save_lora(adapted, tmp_path)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["task_type"] == "SEQ_CLS" and config["modules_to_save"] == ["classifier"]
    assert {n.rsplit(".", 1)[-1] for n in config["target_modules"]} == {"q_lin", "v_lin", "lin1"}
    peft_model = peft.PeftModel.from_pretrained(copy.deepcopy(hf), str(tmp_path)).eval()
    with torch.no_grad():
        expected, _ = hf_out(peft_model, IDS, MASK)
    close(ours(adapted, IDS, MASK), expected, tol=2e-5)
    close(ours(ft.nn.load_lora(base, tmp_path), IDS, MASK), expected, tol=2e-5)
    own = peft_seq_cls(peft, hf, ["q_lin", "v_lin", "out_lin"], tmp_path / "peft")  # PEFT's own adapter
    with torch.no_grad():
        expected, _ = hf_out(own, IDS, MASK)
    close(ours(ft.nn.load_lora(base, tmp_path / "peft"), IDS, MASK), expected, tol=2e-5)


def test_with_head_gives_a_distilbert_model_hfs_classifier(tmp_path):
    """ft.hf.with_head(DistilBertModel, ...): the body's own arrays, a fresh pre_classifier and
    classifier (HF's initialization); saved, transformers reads it with no key missing."""
    body = ft.nn.from_hf(hf_model("DistilBertModel").float())
    clf = cast(Any, ft.hf.with_head(body, "ForSequenceClassification", num_labels=3, key=jax.random.key(0)))
    assert clf.body.encoder is body.encoder and type(clf).__name__ == "DistilBertForSequenceClassification"
    assert clf.pre_classifier.weight.shape == (16, 16) and float(np.abs(np.asarray(clf.classifier.bias)).max()) == 0.0
    ft.nn.save_hf(clf, tmp_path)
    back, info = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path, output_loading_info=True)
    assert type(back).__name__ == "DistilBertForSequenceClassification" and not any(info.values()), info
    with torch.no_grad():
        expected, _ = hf_out(back.eval(), IDS, MASK)
    close(ours(clf, IDS, MASK), expected, tol=2e-5)
    assert type(clf) is TASKS["DistilBertForSequenceClassification"]


def test_the_family_and_its_heads_are_registered():
    assert FAMILIES["distilbert"].__name__ == "DistilBertModel"
    assert set(_heads.HEADS["distilbert"]) == {n.removeprefix("DistilBert") for n in CLASSES[1:]}
    for name in CLASSES[1:]:
        assert getattr(_heads, name) is TASKS[name] and hasattr(transformers, name)


def test_a_masked_lm_file_under_a_classifier_names_the_fix_that_loads_it():
    """distilbert-base-uncased's file is DistilBertForMaskedLM's: under a config naming the
    sequence classifier its head is missing and the masked LM's left over. The refusal
    (HEAD_NOT_IN_WEIGHTS) names the file's class, and its fix runs: the checkpoint's body, a
    fresh head (it named DistilBertModel, whose load then refused the masked LM's head)."""
    hf = hf_model("DistilBertForMaskedLM").float()
    weights = {k: v.numpy() for k, v in hf.state_dict().items()}
    config = {**json.loads(hf.config.to_json_string()), "architectures": ["DistilBertForSequenceClassification"]}
    with pytest.raises(ValueError, match=r"\(a DistilBertForMaskedLM's checkpoint: \['vocab_layer_norm.bias', "
                                         r"'vocab_layer_norm.weight'\] left over\)") as info:
        ft.nn.from_hf(config, weights)
    fix = str(info.value).split("right:  ")[1]
    space = {"ft": ft, "jax": jax, "config": config, "weights": weights}
    exec(fix, space)
    model = space["model"]
    assert type(model).__name__ == "DistilBertForSequenceClassification" and model.classifier.weight.shape == (16, 3)
    for a, b in zip(jax.tree.leaves(model.body), jax.tree.leaves(ft.nn.from_hf(hf).body)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
