"""Hugging Face's task models (functree/hf/_heads.py) against transformers' own.

Each HF model is built from a tiny config with random weights (no download), its weights
moved by N(0, 0.3) so every tensor matters. Logits must equal HF's forward (no position_ids
given: HF's own defaults) on a batch with a right-padded and a left-padded row, to float32
rounding: atol 2e-5 times the logits' magnitude (the largest difference measured over every
covered task class is 1.0e-6 of it, Phi-3; times 20). Losses: HF's ``outputs.loss`` to 2e-5 of it
(1.1e-6 measured).
"""

import json
import os
import types
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import functree as ft
from functree.hf import _heads, _load
from functree.hf._config import HFConfig
from functree.hf._family import FAMILIES, TASKS
from functree.hf._files import read_config

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

PAD = 1
SMALL = {"vocab_size": 24, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
         "num_attention_heads": 4, "pad_token_id": PAD, "num_labels": 3}
# Row 0 right-padded, row 1 left-padded (pad id 1).
IDS = np.array([[5, 6, 7, 8, 9, 1, 1], [1, 1, 3, 4, 5, 9, 2]], np.int32)
MASK = (IDS != PAD).astype(np.int32)

CONFIGS = {
    "Llama": lambda **k: transformers.LlamaConfig(**{**SMALL, "num_key_value_heads": 2, **k}),
    "GPT2": lambda **k: transformers.GPT2Config(**{"vocab_size": 24, "n_embd": 16, "n_layer": 1, "n_head": 4,
                                                   "n_positions": 16, "pad_token_id": PAD, "num_labels": 3, **k}),
    "OPT": lambda **k: transformers.OPTConfig(**{"vocab_size": 24, "hidden_size": 16, "ffn_dim": 32,
                                                 "num_hidden_layers": 1, "num_attention_heads": 4,
                                                 "pad_token_id": PAD, "num_labels": 3, "max_position_embeddings": 16,
                                                 **k}),
    "Bert": lambda **k: transformers.BertConfig(**{**SMALL, "max_position_embeddings": 16, **k}),
    "Gemma3Text": lambda **k: transformers.Gemma3TextConfig(**{**SMALL, "num_key_value_heads": 2, "head_dim": 4,
                                                               "sliding_window": 4, **k}),
}
CLASSES = ["LlamaForSequenceClassification", "LlamaForTokenClassification", "GPT2ForSequenceClassification", "GPT2ForTokenClassification", "OPTForSequenceClassification",
           "BertForSequenceClassification", "BertForTokenClassification", "BertForMaskedLM",
           "Gemma3TextForSequenceClassification"]  # (named apart from its family's Gemma3ForCausalLM)


def hf_model(name, **config):
    torch.manual_seed(0)
    hf = getattr(transformers, name)(CONFIGS[name.split("For")[0]](**config))
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return hf.eval()


@pytest.fixture(scope="module")
def ported():
    """name -> (HF model, its port): built once for the file."""
    out = {}
    for name in CLASSES:
        hf = hf_model(name)
        out[name] = (hf, ft.nn.from_hf(hf))
    return out


def hf_call(hf, ids=IDS, mask=MASK, **kwargs):
    with torch.no_grad():
        return hf(torch.from_numpy(ids).long(), attention_mask=None if mask is None else torch.from_numpy(mask).long(),
                  **kwargs)


def close(ours, theirs, scale=None):
    scale = float(np.abs(theirs).max()) if scale is None else scale
    np.testing.assert_allclose(np.asarray(ours), theirs, rtol=0, atol=2e-5 * scale)


forward = jax.jit(lambda m, i, a: m(i, a))


@pytest.mark.parametrize("name", CLASSES)
def test_logits_are_hfs_with_left_and_right_padding(ported, name):
    hf, model = ported[name]
    assert type(model).__name__ == name and type(model) is TASKS[name]
    expected = hf_call(hf).logits.numpy()
    ours = np.asarray(forward(model, IDS, MASK))
    assert ours.shape == expected.shape
    if ours.ndim == 3:  # a token's logits: the real tokens (HF's padded ones attend to nothing)
        real = MASK.astype(bool)
        close(ours[real], expected[real])
    else:
        close(ours, expected)


@pytest.mark.parametrize("name", CLASSES)
def test_the_state_dict_is_hfs_and_loads_strictly(ported, name):
    hf, model = ported[name]
    ours = ft.nn.to_hf_state_dict(model)
    assert sorted(ours) == sorted(hf.state_dict())
    fresh = getattr(transformers, name)(hf.config)
    fresh.load_state_dict(ours, strict=True)
    for k, v in hf.state_dict().items():
        np.testing.assert_array_equal(fresh.state_dict()[k].numpy(), v.numpy(), err_msg=k)


def test_the_class_token_is_the_rightmost_non_pad_token_as_hf_finds_it():
    """HF's argmax(arange(T) * (ids != pad)): a row of pads takes token 0, a row without pads its last."""
    ids = np.array([[1, 1, 1, 1], [4, 1, 1, 1], [1, 1, 5, 6], [4, 5, 6, 7], [4, 1, 5, 1]], np.int32)
    model = types.SimpleNamespace(hf_config={"pad_token_id": PAD})  # what last_tokens reads
    t = torch.from_numpy(ids).long()
    expected = ((torch.arange(4) * (t != PAD).int()).argmax(-1)).numpy()
    np.testing.assert_array_equal(np.asarray(_heads.last_tokens(model, jnp.asarray(ids))), expected)
    np.testing.assert_array_equal(expected, [0, 0, 3, 3, 2])


def test_without_a_pad_token_one_row_is_its_last_token_and_a_batch_is_refused_as_hf_refuses_it():
    hf = hf_model("LlamaForSequenceClassification", pad_token_id=None)
    model = ft.nn.from_hf(hf)
    close(model(IDS[1:]), hf_call(hf, IDS[1:], None).logits.numpy())
    with pytest.raises(ValueError, match="Cannot handle batch sizes > 1"):
        hf_call(hf, IDS, None)
    with pytest.raises(ValueError, match=r"(?s)LlamaForSequenceClassification: the config has no pad_token_id.*"
                                         r"a batch of 2 rows.*right:  model = ft.nn.from_hf"):
        model(IDS)


def test_each_problem_types_loss_is_hfs(ported):
    """Sequence classification: HF's loss for each problem_type, the inferred one from the
    labels' dtype (integer: single label, float: multi label), -100 ignored."""
    hf, model = ported["LlamaForSequenceClassification"]
    logits = model(IDS, MASK)
    cases = [(None, np.array([2, 0])), (None, np.array([2, -100])),
             (None, np.array([[1.0, 0.0, 1.0], [0.0, 1.0, 0.0]], np.float32)),
             ("regression", np.array([[0.5, -1.0, 2.0], [1.5, 0.0, 0.25]], np.float32)),
             ("single_label_classification", np.array([1, 2])),
             ("multi_label_classification", np.array([[0.0, 1.0, 1.0], [1.0, 1.0, 0.0]], np.float32))]
    for problem, labels in cases:
        hf.config.problem_type = problem  # (HF records the type it inferred: set it each time)
        expected = float(hf_call(hf, labels=torch.from_numpy(labels)).loss)
        tuned = model.replace(hf_config=HFConfig({**model.hf_config, "problem_type": problem}))
        np.testing.assert_allclose(float(tuned.loss(logits, labels)), expected, rtol=2e-5, err_msg=str(problem))
        np.testing.assert_allclose(float(ft.hf.task_loss(tuned, logits, labels)), expected, rtol=2e-5)
    hf.config.problem_type = None


def test_one_label_is_regression_squeezed_as_hf():
    hf = hf_model("GPT2ForSequenceClassification", num_labels=1)
    model = ft.nn.from_hf(hf)
    labels = np.array([0.5, -2.0], np.float32)
    expected = hf_call(hf, labels=torch.from_numpy(labels))
    close(model(IDS, MASK), expected.logits.numpy())
    np.testing.assert_allclose(float(model.loss(model(IDS, MASK), labels)), float(expected.loss), rtol=2e-5)


@pytest.mark.parametrize("name", ["GPT2ForTokenClassification", "BertForTokenClassification", "BertForMaskedLM"])
def test_token_losses_are_hfs_minus_100_ignored(ported, name):
    hf, model = ported[name]
    vocab = 3 if "Token" in name else 24
    labels = np.random.default_rng(1).integers(0, vocab, IDS.shape)
    labels[~MASK.astype(bool)] = -100
    labels[0, 1] = -100
    expected = float(hf_call(hf, labels=torch.from_numpy(labels)).loss)
    np.testing.assert_allclose(float(ft.hf.task_loss(model, model(IDS, MASK), labels)), expected, rtol=2e-5)


def test_the_loss_differentiates_and_trains_under_jit(ported):
    _, model = ported["BertForSequenceClassification"]
    labels = np.array([2, 0])
    loss, grad = jax.jit(jax.value_and_grad(lambda m: m.loss(m(IDS, MASK), labels)))(model)
    assert np.isfinite(float(loss))
    assert float(jnp.abs(grad.classifier.weight).max()) > 0 and float(jnp.abs(grad.body.pooler.weight).max()) > 0


def test_save_hf_is_read_by_from_pretrained_as_the_same_tensors_and_back(ported, tmp_path):
    for name, auto in [("LlamaForSequenceClassification", "AutoModelForSequenceClassification"),
                       ("BertForMaskedLM", "AutoModelForMaskedLM")]:
        hf, model = ported[name]
        directory = tmp_path / name
        ft.nn.save_hf(model, directory)
        written = json.loads((directory / "config.json").read_text())
        assert written["architectures"] == [name]
        back = getattr(transformers, auto).from_pretrained(directory)
        assert type(back).__name__ == name
        for k, v in hf.state_dict().items():
            np.testing.assert_array_equal(back.state_dict()[k].numpy(), v.numpy(), err_msg=k)
        again = ft.nn.from_hf(directory)  # config.json's architectures name the head
        assert type(again) is type(model)
        close(forward(again, IDS, MASK), np.asarray(forward(model, IDS, MASK)))


def test_a_config_dict_naming_the_head_builds_it_initialized_as_hf(tmp_path):
    """from_hf(config.json dict, key=): score/classifier normal(0, initializer_range), biases
    zero; id2label's string keys give num_labels as HF reads them."""
    config = {**SMALL, "model_type": "bert", "architectures": ["BertForSequenceClassification"],
              "max_position_embeddings": 16, "initializer_range": 0.5,
              "id2label": {"0": "a", "1": "b", "2": "c", "3": "d"}, "label2id": {"a": 0, "b": 1, "c": 2, "d": 3}}
    del config["num_labels"]
    model = ft.nn.from_hf(config, key=jax.random.key(0))
    assert type(model).__name__ == "BertForSequenceClassification" and model.classifier.weight.shape == (16, 4)
    assert 0.4 < float(jnp.std(model.classifier.weight)) < 0.6 and not np.any(model.classifier.bias)
    assert transformers.BertConfig(**{k: v for k, v in config.items() if k != "model_type"}).num_labels == 4
    hf_object = transformers.LlamaConfig(**{**SMALL, "num_key_value_heads": 2,
                                            "architectures": ["LlamaForTokenClassification"]})
    token = ft.nn.from_hf(hf_object, key=jax.random.key(1))
    assert type(token).__name__ == "LlamaForTokenClassification" and token.classifier.bias is not None
    assert _load._task_of(read_config({**config, "architectures": ["BertModel"]}), None,
                          FAMILIES["bert"]).__name__ == "BertModel"  # the family's own class named: the family


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")  # PEFT's
def test_a_peft_seq_cls_adapter_loads_with_its_head_and_saves_back(ported, tmp_path):
    peft = pytest.importorskip("peft")
    hf = hf_model("LlamaForSequenceClassification")
    _, base = ported["LlamaForSequenceClassification"]
    adapted = peft.get_peft_model(hf, peft.LoraConfig(task_type="SEQ_CLS", r=2, lora_alpha=4,
                                                       target_modules=["q_proj", "v_proj"]))
    torch.manual_seed(1)
    with torch.no_grad():
        for n, p in adapted.named_parameters():
            if "lora_B" in n or "modules_to_save" in n:
                p.normal_(0, 0.3)
    adapted.save_pretrained(tmp_path / "peft")
    expected = hf_call(adapted.eval()).logits.numpy()
    model = ft.nn.load_lora(base, tmp_path / "peft")
    close(model(IDS, MASK), expected)
    assert not np.array_equal(np.asarray(model.score.weight), np.asarray(base.score.weight))  # the trained head
    ft.nn.save_lora(model, tmp_path / "ours")
    written = json.loads((tmp_path / "ours" / "adapter_config.json").read_text())
    assert written["task_type"] == "SEQ_CLS" and written["modules_to_save"] == ["score"]
    again = peft.PeftModel.from_pretrained(hf_model("LlamaForSequenceClassification"), tmp_path / "ours")
    close(hf_call(again.eval()).logits.numpy(), expected)


def test_dropout_true_drops_before_the_classifier_in_training_only():
    config = {**SMALL, "model_type": "bert", "architectures": ["BertForTokenClassification"],
              "max_position_embeddings": 16, "classifier_dropout": 0.5}
    model = ft.nn.from_hf(config, key=jax.random.key(0), dropout=True)
    assert model.dropout == 0.5
    assert ft.nn.from_hf(config, key=jax.random.key(0)).dropout == 0.0
    plain = model(IDS, MASK)
    np.testing.assert_array_equal(np.asarray(ft.nn.inference(model)(IDS, MASK)), np.asarray(plain))
    training = ft.nn.training(model)
    a, b = training(IDS, MASK, key=jax.random.key(1)), training(IDS, MASK, key=jax.random.key(1))
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # the key decides the masks
    assert not np.allclose(np.asarray(a), np.asarray(plain))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the masks' keys recorded as state, uncollected here
        assert training(IDS, MASK).shape == plain.shape  # without a key: the blocks' own keys



def test_the_heads_dropout_drops_when_the_body_drops_nothing():
    """A Llama's default attention_dropout is 0, so its port's body draws no mask; HF's
    LlamaForTokenClassification in train() still drops the classifier's input at 0.1. With
    an identity classifier the training logits are the hidden states times m / 0.9, m a
    Bernoulli(0.9) mask: about a tenth of them zero (was none: the head's dropout ran only
    where the body dropped too), the masks fresh each step without a key (the first
    member's key advanced as layer state), fixed by a key given."""
    config = {**SMALL, "model_type": "llama", "architectures": ["LlamaForTokenClassification"],
              "num_labels": SMALL["hidden_size"], "num_key_value_heads": 2}
    model = ft.nn.from_hf(config, key=jax.random.key(0), dropout=True)
    assert model.dropout == 0.1 and model.body.model.layers.layers.self_attn.rates == (0.0, 0.0, 0.0)
    size = SMALL["hidden_size"]
    model = model.replace(classifier=model.classifier.replace(weight=jnp.eye(size), bias=jnp.zeros(size)))
    hidden = np.asarray(ft.nn.inference(model)(IDS, MASK))
    training = ft.nn.training(model)
    ratios = []
    for _ in range(2):  # two steps, each drawing from the key the previous one recorded
        dropped, updates = ft.nn.collect_state(lambda m: m(IDS, MASK), training)
        training = ft.nn.apply_state(training, updates)
        ratio = np.asarray(dropped) / hidden
        np.testing.assert_allclose(ratio[ratio > 0.5], 1 / 0.9, rtol=1e-5)
        ratios.append(ratio)
    zeros = [float((r < 0.5).mean()) for r in ratios]
    assert all(0.04 < z < 0.2 for z in zeros), zeros  # 224 elements at 0.1: 0.04-0.2 is 2.7 sigma either side
    assert not np.array_equal(ratios[0] < 0.5, ratios[1] < 0.5)  # fresh masks each step
    keyed = [np.asarray(training(IDS, MASK, key=jax.random.key(3))) for _ in range(2)]
    np.testing.assert_array_equal(keyed[0], keyed[1])
    layers = training.body.model.layers
    attention = layers.layers.self_attn.replace(dropout_key=None)
    body = training.body.replace(model=training.body.model.replace(
        layers=layers.replace(layers=layers.layers.replace(self_attn=attention))))
    keyless = training.replace(body=body)
    with pytest.raises(ValueError, match=r"without a key for its dropout"):  # NO_DROPOUT_KEY, not a silent no-drop
        keyless(IDS, MASK)



@pytest.mark.parametrize(("body", "task"), [("LlamaForCausalLM", "LlamaForSequenceClassification"),
                                            ("BertForPreTraining", "BertForTokenClassification"),
                                            ("BertForMaskedLM", "BertForSequenceClassification")])
def test_a_pretrained_bodys_weights_under_a_task_class_name_with_head_as_the_fix(body, task):
    """A causal LM's or bert-base-uncased's (BertForPreTraining's) weights under a config
    naming a task class: every tensor but the head is there. HF's from_pretrained draws the
    head at random, warning; from_hf said the config was not the weights' own and that
    dropping the left-over tensors would do (it would not: the head is still missing). It
    now names the missing head and with_head; the fix, run as printed, gives the task model
    with the checkpoint's body. A masked LM's file has no pooler either (a classifier's
    from_pretrained draws it too): its left-over head was shown under the body's prefix
    (``bert.cls.predictions.bias``), its fix a filter of names the file does not hold."""
    hf = hf_model(body)
    config = {**hf.config.to_dict(), "architectures": [task], "num_labels": 3}
    weights = hf.state_dict()
    with pytest.raises(ValueError, match=r"(?s)hold the body of the \w+ its config builds but not its head: "
                                         r"missing \['(score|classifier|bert\.pooler)\..*ft\.hf\.with_head") as info:
        ft.nn.from_hf(config, weights)
    assert "bert.cls." not in str(info.value)
    scope = {"ft": ft, "jax": jax, "config": config, "weights": weights}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ft.hf.UnreadTensorsWarning)  # bert-base-uncased's NSP head, unread
        exec("\n".join(line.split("   #")[0].strip() for line in str(info.value).split("right:  ")[1].splitlines()),
             scope)
    model = scope["model"]
    assert type(model).__name__ == task
    embedding = model.body.model.embed_tokens.embeddings if body.startswith("Llama") else \
        model.body.embeddings.word_embeddings.embeddings
    name = "model.embed_tokens.weight" if body.startswith("Llama") else "bert.embeddings.word_embeddings.weight"
    np.testing.assert_array_equal(np.asarray(embedding), weights[name].detach().numpy())


# ---- refusals


def bert_config(**changes):
    config = {**SMALL, "model_type": "bert", "architectures": ["BertForSequenceClassification"],
              "max_position_embeddings": 16}
    config.update(changes)
    return {k: v for k, v in config.items() if v is not None}


@pytest.mark.parametrize(("changes", "message"), [
    ({"id2label": {"0": "a", "1": "b"}}, r"id2label has 2 entries but its num_labels is 3; Hugging Face's config warns "
                                         r"and takes num_labels, naming its labels LABEL_0 \.\. LABEL_2"),
    ({"num_labels": None, "id2label": {"0": "a", "1": "b"}, "label2id": {"a": 0}},
     r"id2label has 2 entries but its label2id has 1; Hugging Face's config keeps id2label's labels"),
    ({"num_labels": None, "id2label": {"zero": "a"}}, r"id2label keys are label ids"),
    ({"problem_type": "ranking"}, r"problem_type is one of regression, single_label_classification, "
                                  r"multi_label_classification .*got 'ranking'"),
    ({"num_labels": 1, "problem_type": "single_label_classification"}, r"with num_labels 1 \(HF refuses it"),
])
def test_a_config_hf_refuses_or_reads_otherwise_is_refused_by_name(changes, message):
    with pytest.raises(ValueError, match=message):
        ft.nn.from_hf(bert_config(**changes), key=jax.random.key(0))


def test_an_untied_masked_lm_is_hfs_its_decoder_its_own_in_float64(tmp_path):
    """tie_word_embeddings=false (was refused): transformers 5.24 unties the decoder's weight
    and its bias (cls.predictions.bias stays, unread); logits, the labels= loss and every
    gradient HF's in float64 (measured 2.9e-15, 4.4e-16, 8.3e-16; tolerance 1e-13 of the
    scale), save_hf read back by from_pretrained as the same tensors, HF's initialization,
    and "all-linear" leaves the decoder out as PEFT's does (its get_output_embeddings())."""
    config = CONFIGS["Bert"](tie_word_embeddings=False)
    torch.manual_seed(0)
    hf = transformers.BertForMaskedLM(config).double()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.3 * torch.randn_like(p))
    hf.eval()
    assert hf.cls.predictions.decoder.bias is not hf.cls.predictions.bias
    labels = np.where(MASK == 1, (IDS * 3) % 24, -100)
    expected = hf(torch.from_numpy(IDS).long(), attention_mask=torch.from_numpy(MASK).long(),
                  labels=torch.from_numpy(labels).long())
    expected.loss.backward()
    with jax.enable_x64(True):
        model = ft.nn.from_hf(hf, dtype=jnp.float64)
        assert type(model.cls.predictions.decoder) is ft.nn.Dense
        logits = expected.logits.detach().numpy()
        forward = jax.jit(lambda m: m(IDS, MASK))  # one program (op by op, each operation compiled apart)
        np.testing.assert_allclose(np.asarray(forward(model)), logits, rtol=0, atol=1e-13 * np.abs(logits).max())
        loss, grads = jax.jit(jax.value_and_grad(lambda m: m.loss(m(IDS, MASK), labels)))(model)
        np.testing.assert_allclose(float(loss), expected.loss.item(), rtol=1e-13)
        ours = ft.nn.to_hf_state_dict(grads, numpy=True)
        theirs = {n: p.grad.numpy() for n, p in hf.named_parameters() if p.grad is not None}
        assert "cls.predictions.decoder.weight" in theirs and "cls.predictions.bias" not in theirs  # (unread)
        scale = max(float(np.abs(g).max()) for g in theirs.values())
        for name, g in theirs.items():
            np.testing.assert_allclose(ours[name], g, rtol=0, atol=1e-13 * scale, err_msg=name)
        assert sorted(ft.nn.to_hf_state_dict(model, numpy=True)) == sorted(hf.state_dict())
        ft.nn.save_hf(model, tmp_path / "untied")
        back = transformers.AutoModelForMaskedLM.from_pretrained(tmp_path / "untied", dtype=torch.float64)
        for k, v in hf.state_dict().items():
            np.testing.assert_array_equal(back.state_dict()[k].numpy(), v.numpy(), err_msg=k)
        np.testing.assert_array_equal(np.asarray(forward(ft.nn.from_hf(tmp_path / "untied", dtype=jnp.float64))),
                                      np.asarray(forward(model)))
    fresh = ft.nn.from_hf({**bert_config(architectures=["BertForMaskedLM"]), "tie_word_embeddings": False,
                           "initializer_range": 0.5}, key=jax.random.key(0))
    decoder = fresh.cls.predictions.decoder
    assert decoder is not None and 0.4 < float(jnp.std(decoder.weight)) < 0.6 and not np.any(decoder.bias)
    adapted = ft.nn.lora(fresh, "all-linear", rank=2, key=jax.random.key(1))
    assert type(adapted.cls.predictions.decoder) is ft.nn.Dense  # PEFT's all-linear leaves it out too
    assert type(adapted.cls.predictions.transform.dense) is ft.nn.LoraDense


def test_hf_refuses_a_single_label_head_of_one_label_too():
    with pytest.raises(ValueError, match="requires `num_labels > 1`"):
        transformers.BertConfig(num_labels=1, problem_type="single_label_classification")


def test_a_masked_lm_state_dict_whose_tied_copy_differs_is_refused(ported):
    hf, _ = ported["BertForMaskedLM"]
    weights = {k: v.clone() for k, v in hf.state_dict().items()}
    weights["cls.predictions.decoder.bias"] += 1.0
    config = {**hf.config.to_dict(), "architectures": ["BertForMaskedLM"]}  # (an HF object's config names none)
    with pytest.raises(ValueError, match=r"(?s)'cls.predictions.decoder.bias' differs from 'cls.predictions.bias' "
                                         r"\(by up to 1\).*right:  del weights"):
        ft.nn.from_hf(config, weights)
    del weights["cls.predictions.decoder.bias"]  # the fix
    ft.nn.from_hf(config, weights)


def test_labels_that_do_not_fit_the_problem_are_refused(ported):
    _, model = ported["LlamaForSequenceClassification"]
    logits = model(IDS, MASK)
    single = model.replace(hf_config=HFConfig({**model.hf_config, "problem_type": "single_label_classification"}))
    with pytest.raises(ValueError, match=r"single_label_classification are integer class ids \[batch\]"):
        single.loss(logits, np.eye(3, dtype=np.float32)[[1, 2]])
    with pytest.raises(ValueError, match=r"label 3 at labels\[0\] is not a class of logits f32\[2,3\]"):
        single.loss(logits, np.array([3, 0]))
    regression = model.replace(hf_config=HFConfig({**model.hf_config, "problem_type": "regression"}))
    with pytest.raises(ValueError, match=r"regression are floating targets \(HF's MSELoss regresses integer ones"):
        regression.loss(logits, np.array([[1, 0, 0], [0, 1, 0]]))
    with pytest.raises(ValueError, match="multi_label_classification are floating 0/1 targets"):
        model.replace(hf_config=HFConfig({**model.hf_config, "problem_type": "multi_label_classification"})).loss(
            logits, np.array([1, 2]))
    _, token = ported["BertForTokenClassification"]
    with pytest.raises(ValueError, match=r"token classification are integer ids \[2, 7\]"):
        token.loss(token(IDS, MASK), np.zeros((2, 6), np.int32))
    with pytest.raises(TypeError, match=r"ft.hf.task_loss takes a task model.*got GPT2LMHeadModel"):
        ft.hf.task_loss(ft.nn.from_hf({"model_type": "gpt2", "vocab_size": 11, "n_positions": 8, "n_embd": 8,
                                       "n_layer": 1, "n_head": 2}, key=jax.random.key(0)), logits, np.array([1, 2]))
    _, decoder = ported["LlamaForTokenClassification"]
    with pytest.raises(TypeError, match="token_type_ids are BERT's segment ids"):
        decoder(IDS, MASK, np.zeros_like(IDS))


def test_a_label_outside_the_classes_is_refused_and_nan_under_jit_never_another_class(ported):
    """torch raises IndexError for a label outside [0, num_labels) other than -100; a gather
    read -1 as the last class: under jax.jit the loss of labels [-1, 0] was that of [2, 0]."""
    _, model = ported["LlamaForSequenceClassification"]
    logits = model(IDS, MASK)
    for labels in ([-1, 0], [3, 0]):
        with pytest.raises(ValueError, match=rf"(?s)label {labels[0]} at labels\[0\] is not a class.*"
                                             rf"right:  model.loss\(logits, jnp.where\(labels == {labels[0]}, -100"):
            model.loss(logits, np.array(labels))
        assert np.isnan(float(jax.jit(model.loss)(logits, np.array(labels))))
    _, token = ported["LlamaForTokenClassification"]
    token_logits = token(IDS, MASK)
    labels = np.where(MASK == 1, 0, -100)
    labels[1, 4] = -1
    with pytest.raises(ValueError, match=r"label -1 at labels\[1, 4\] is not a class"):
        token.loss(token_logits, labels)
    assert np.isnan(float(jax.jit(token.loss)(token_logits, labels)))
    labels[1, 4] = -100  # the message's fix: ignored
    assert np.isfinite(float(jax.jit(token.loss)(token_logits, labels)))


def test_a_directory_of_an_uncovered_head_is_still_refused_naming_its_body(tmp_path):
    hf = transformers.BertForNextSentencePrediction(CONFIGS["Bert"]())  # (QA, multiple choice: covered)
    hf.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"BertForNextSentencePrediction is not covered"):
        ft.nn.from_hf(tmp_path)


def test_a_task_models_weights_under_a_config_naming_no_task_are_refused_naming_the_class(ported):
    """An HF config object made in Python has no architectures: its task model's weights
    built the family's class, whose refusal told the user to drop the head's tensors."""
    hf, model = ported["LlamaForSequenceClassification"]
    assert hf.config.architectures is None
    # The class the weights load into whole: the token classifier's score has a bias, so it is not named.
    with pytest.raises(ValueError, match=r"(?s)task head's tensors \(\['score.weight'\]\).*LlamaForCausalLM.*"
                                         r"\(LlamaForSequenceClassification\); an HF config"):
        ft.nn.from_hf(hf.config, hf.state_dict())
    fixed = ft.nn.from_hf({**hf.config.to_dict(), "architectures": ["LlamaForSequenceClassification"]},
                          hf.state_dict())  # the message's fix
    close(fixed(IDS, MASK), np.asarray(model(IDS, MASK)))


def test_a_task_model_inside_a_model_of_yours_writes_and_reads_hfs_names_under_its_attribute(ported):
    """torch_state_dict / load_torch_state_dict of a model holding a task model: HF's names
    (the masked LM's tied decoder copies too) under its attribute, as torch's state_dict();
    ft.nn.lora's patterns read HF's names."""
    _, mlm = ported["BertForMaskedLM"]

    class Holder(ft.Module):
        mlm: object
        extra: object

        def __init__(self, mlm, extra):
            self.mlm, self.extra = mlm, extra

    held = Holder(mlm, ft.nn.Dense(2, 2, key=jax.random.key(1)))
    weights = ft.nn.torch_state_dict(held, numpy=True)
    assert {"mlm.cls.predictions.decoder.weight", "mlm.bert.embeddings.word_embeddings.weight",
            "extra.weight"} <= set(weights)
    loaded = ft.nn.load_torch_state_dict(Holder(mlm.replace(cls=jax.tree.map(jnp.zeros_like, mlm.cls)),
                                                ft.nn.Dense(2, 2, key=jax.random.key(2))), weights)
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(held)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    adapted = ft.nn.lora(mlm, "*.query", rank=2, key=jax.random.key(3))
    assert type(adapted.body.encoder.layer.layers.attention.query_projection).__name__ == "LoraDense"
