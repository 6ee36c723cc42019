"""``ft.hf.with_head`` (functree/hf/_with_head.py) against transformers'
``AutoModelFor<Task>.from_pretrained(causal_lm_dir, num_labels=n)``, in float64.

A tiny causal LM (or BertModel) with random weights is saved by HF; functree loads it and adds
the head, HF loads the directory into the task class. The body's tensors must be the
checkpoint's (HF's, bit for bit), the head shaped and typed as HF's with zero biases and
HF's ``normal(0, initializer_range)`` (a 64x64 head: its std within 8% and its share
within one std that of a normal, not ft's own uniform init); with HF's head copied in, the
logits and the loss equal HF's: measured at most 7.0e-16 of the logits' scale for the
learned-position families (GPT-2, OPT, BERT) and 1.2e-7 for Llama (HF's float32 rotary
tables), the loss within 2.7e-16 and 1.1e-9; allowed 3e-14 and 3e-6 (as tests/test_hf_qa.py). save_hf of the result is read by HF with no missing or unexpected key.
"""

import json
import os
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import functree as ft
from functree.hf import _with_head

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

PAD = 1
SIZES = {
    "Llama": dict(vocab_size=24, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2, pad_token_id=PAD),
    "GPT2": dict(vocab_size=24, n_embd=16, n_layer=1, n_head=4, n_positions=16, pad_token_id=PAD, bos_token_id=0,
                 eos_token_id=0),
    "OPT": dict(vocab_size=24, hidden_size=16, ffn_dim=32, num_hidden_layers=1, num_attention_heads=4,
                word_embed_proj_dim=8, max_position_embeddings=16, pad_token_id=PAD),
    "Bert": dict(vocab_size=24, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=4,
                 max_position_embeddings=16, pad_token_id=PAD),
}
CLASSES = {"Llama": "LlamaForCausalLM", "GPT2": "GPT2LMHeadModel", "OPT": "OPTForCausalLM", "Bert": "BertModel"}


def causal_lm(family, **config):
    cls = getattr(transformers, CLASSES[family])
    return cls(cls.config_class(**{**SIZES[family], **config}))


# (family, head, num_labels): the head's module(s) in HF's names.
CASES = [("Llama", "ForSequenceClassification", 3, ("score",)),
         ("GPT2", "ForTokenClassification", 5, ("classifier",)),
         ("OPT", "ForSequenceClassification", 3, ("score",)),
         ("Bert", "ForSequenceClassification", 3, ("classifier",)),
         ("Bert", "ForMaskedLM", None, ("cls",)),
         ("Llama", "ForQuestionAnswering", None, ("qa_outputs",))]  # HF's body: transformer.* (not read by HF)
IDS = np.array([[5, 6, 7, 8, 9, 1, 1], [4, 3, 2, 8, 7, 6, 5]], np.int32)  # right padding, none
MASK = (IDS != PAD).astype(np.int32)


def hf_quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kwargs)


def saved(tmp_path, family, **config):
    torch.manual_seed(0)
    causal = causal_lm(family, **config).double()
    with torch.no_grad():
        for p in causal.parameters():
            p.add_(0.3 * torch.randn_like(p))
    path = tmp_path / "causal"
    hf_quiet(causal.save_pretrained, path)
    return causal, path


def hf_task(path, head, **kwargs):
    auto = getattr(transformers, "AutoModel" + head)
    return hf_quiet(auto.from_pretrained, path, dtype=torch.float64, output_loading_info=True, **kwargs)


def labels_of(head, n) -> dict[str, Any]:
    return {} if n is None else {"num_labels": n}


def hf_outputs(hf, head, labels):
    ids, mask = torch.from_numpy(IDS).long(), torch.from_numpy(MASK).long()
    if head == "ForQuestionAnswering":
        out = hf(ids, attention_mask=mask, start_positions=torch.tensor(labels[0]), end_positions=torch.tensor(labels[1]))
        return np.stack([out.start_logits.detach().numpy(), out.end_logits.detach().numpy()]), out.loss.item()
    out = hf(ids, attention_mask=mask, labels=torch.from_numpy(np.asarray(labels)).long())
    return out.logits.detach().numpy(), out.loss.item()


def labels_for(head, n):
    if head == "ForQuestionAnswering":
        return np.array([2, 1]), np.array([4, 3])
    if head == "ForSequenceClassification":
        return np.array([2, 0])
    count = 24 if head == "ForMaskedLM" else n
    labels = np.arange(IDS.size).reshape(IDS.shape) % count
    return np.where(MASK == 1, labels, -100)


def ours_outputs(model, head, labels):
    out = model(IDS, MASK)
    logits = np.stack([out.start_logits, out.end_logits]) if head == "ForQuestionAnswering" else np.asarray(out)
    return logits, float(model.loss(out, labels))


def tolerance(family):
    return 3e-6 if family == "Llama" else 3e-14


@pytest.mark.parametrize(("family", "head", "n", "roots"), CASES, ids=[f"{c[0]}{c[1]}" for c in CASES])
def test_body_is_the_checkpoint_s_head_hf_s_and_logits_hf_s(tmp_path, family, head, n, roots):
    causal, path = saved(tmp_path, family)
    hf, info = hf_task(path, head, **labels_of(head, n))
    assert not info["mismatched_keys"]
    hf_quiet(hf.save_pretrained, tmp_path / "hf")  # (before a call with labels: HF records the problem_type it infers)
    with jax.enable_x64(True):
        lm = ft.nn.from_hf(path, dtype=jnp.float64)
        model = ft.hf.with_head(lm, head, key=jax.random.key(0), **labels_of(head, n))
        assert type(model).__name__ == type(hf).__name__
        # the body is the loaded model's arrays, not copies
        body_leaves = {id(x) for x in jax.tree.leaves(model.body)}
        assert body_leaves <= {id(x) for x in jax.tree.leaves(lm)}
        ours = ft.nn.to_hf_state_dict(model, numpy=True)
        theirs = {k: v.numpy() for k, v in hf.state_dict().items()}
        assert sorted(ours) == sorted(theirs)
        head_names = [k for k in theirs if k.split(".")[0] in roots]
        alias = family == "Llama" and head == "ForQuestionAnswering"
        hf_new = {k for k in info["missing_keys"] if not (alias and k.startswith("transformer."))}
        assert head_names and set(head_names) >= hf_new and (not alias or "transformer.embed_tokens.weight" in
                                                              info["missing_keys"])  # (HF's quirk: its body random)
        checkpoint = {k: v.numpy() for k, v in causal.state_dict().items()}
        for name, value in ours.items():
            if name in head_names and name not in ("cls.predictions.decoder.weight",):  # (BERT's: the tied embedding)
                assert value.shape == theirs[name].shape and value.dtype == theirs[name].dtype == np.float64, name
                if name.endswith("bias"):
                    assert not value.any() and not theirs[name].any(), name
                if name.endswith("LayerNorm.weight"):  # (BERT's masked LM head: HF's init, the identity)
                    assert (value == 1).all() and (theirs[name] == 1).all(), name
                continue
            # the checkpoint's body: HF's own name, or (Llama's QA) HF's transformer.* for model.*
            source = name.replace("transformer.", "model.", 1) if alias else name
            source = "bert.embeddings.word_embeddings.weight" if name == "cls.predictions.decoder.weight" else source
            source = source.removeprefix("bert.")
            np.testing.assert_array_equal(value, checkpoint[source], err_msg=name)
            if not alias:  # (HF leaves that body random)
                np.testing.assert_array_equal(value, theirs[name], err_msg=name)

        # HF's head copied in: the same logits and loss (HF given our body where it lacks it)
        hf.load_state_dict({**{k: torch.from_numpy(np.array(v)) for k, v in ours.items() if k not in head_names},
                            **{k: hf.state_dict()[k] for k in head_names}})
        hf.eval()
        copied = ft.nn.from_hf(model.hf_config.to_dict(), {k: v.numpy() for k, v in hf.state_dict().items()},
                               dtype=jnp.float64)
        labels = labels_for(head, n)
        expected, expected_loss = hf_outputs(hf, head, labels)
        logits, loss = ours_outputs(copied, head, labels)
        scale = float(np.abs(expected).max())  # (no left padding: every token's logits are HF's)
        np.testing.assert_allclose(logits, expected, rtol=0, atol=tolerance(family) * scale)
        np.testing.assert_allclose(loss, expected_loss, rtol=0, atol=tolerance(family) * abs(expected_loss))

        # save_hf: read back by HF with no missing or unexpected key, its config HF's
        out = tmp_path / "tuned"
        ft.nn.save_hf(model, out)
        back, info = hf_task(out, head)
        assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
        for name, value in back.state_dict().items():
            np.testing.assert_array_equal(value.numpy(), ours[name], err_msg=name)
        mine, hfs = (json.loads((p / "config.json").read_text()) for p in (out, tmp_path / "hf"))
        for field in ("architectures", "id2label", "label2id", "problem_type"):
            if field in hfs:  # (HF leaves out the default 2 labels; functree writes them)
                assert mine.get(field) == hfs[field], field
        assert not (out / "generation_config.json").exists()


def fraction_within_one_std(x, std):
    return float(np.mean(np.abs(x) < std))


@pytest.mark.parametrize(("family", "head", "module", "config"), [
    ("Llama", "ForTokenClassification", "score", {"initializer_range": 0.37}),
    ("OPT", "ForSequenceClassification", "score", {"init_std": 0.37}),
    ("Bert", "ForMaskedLM", "cls.predictions.transform.dense", {"initializer_range": 0.37}),
    ("Bert", "ForSequenceClassification", "bert.pooler.dense", {"initializer_range": 0.37}),  # saved without one
])
def test_the_new_head_is_drawn_as_hf_draws_it(tmp_path, family, head, module, config):
    """A 64x64 head: HF's and functree's draws both normal(0, 0.37): std within 8%, 68% of
    the draws within one std (a uniform init of that std: 58%), mean ~0, biases zero."""
    sizes = {"Llama": {"hidden_size": 64, "intermediate_size": 8, "num_attention_heads": 4},
             "OPT": {"hidden_size": 64, "ffn_dim": 8, "word_embed_proj_dim": 64},
             "Bert": {"hidden_size": 64, "intermediate_size": 8, "num_attention_heads": 4}}[family]
    torch.manual_seed(0)
    built = causal_lm(family, **sizes, **config)
    if module.endswith("pooler.dense"):
        built = transformers.BertModel(built.config, add_pooling_layer=False)
    hf_quiet(built.double().save_pretrained, tmp_path)
    n = None if head == "ForMaskedLM" else 64
    hf, info = hf_task(tmp_path, head, **labels_of(head, n))
    assert module + ".weight" in info["missing_keys"]
    with jax.enable_x64(True):
        model = ft.hf.with_head(ft.nn.from_hf(tmp_path, dtype=jnp.float64), head, key=jax.random.key(3),
                                **labels_of(head, n))
        ours = ft.nn.to_hf_state_dict(model, numpy=True)
    for weights in (ours, {k: v.numpy() for k, v in hf.state_dict().items()}):
        w = weights[module + ".weight"]
        assert w.shape[0] == 64 and w.dtype == np.float64
        assert abs(float(w.std()) / 0.37 - 1) < 0.08, float(w.std())
        assert abs(fraction_within_one_std(w, 0.37) - 0.6827) < 0.04
        assert abs(float(w.mean())) < 4 * 0.37 / 64
        if module + ".bias" in weights:
            assert not weights[module + ".bias"].any()


def test_a_training_step_moves_the_head_and_the_body(tmp_path):
    _, path = saved(tmp_path, "Llama")
    model = ft.hf.with_head(ft.nn.from_hf(path), "ForSequenceClassification", num_labels=3, key=jax.random.key(0))
    opt = ft.optim.Optimizer(ft.optim.adamw(1e-2))
    step = ft.train.train_step(lambda m, b: m.loss(m(b[0], b[1]), b[2]), opt)
    tuned, _, metrics = step(model, opt.init(model), (IDS, MASK, np.array([2, 0])))
    assert np.isfinite(float(metrics["loss"]))
    assert not np.array_equal(tuned.score.weight, model.score.weight)
    assert not np.array_equal(tuned.body.model.embed_tokens.embeddings, model.body.model.embed_tokens.embeddings)
    assert not np.array_equal(tuned.body.model.layers.layers.mlp.up_proj.weight, model.body.model.layers.layers.mlp.up_proj.weight)


def test_a_task_model_gets_another_head_and_bert_s_pooler_follows_the_class(tmp_path):
    _, path = saved(tmp_path, "Bert")
    bert = ft.nn.from_hf(path)
    clf = ft.hf.with_head(bert, "ForSequenceClassification", id2label={0: "no", 1: "yes"}, key=jax.random.key(0))
    assert clf.body.pooler is bert.pooler and clf.hf_config["label2id"]["yes"] == 1
    tokens = ft.hf.with_head(clf, "BertForTokenClassification", num_labels=4, key=jax.random.key(1))
    assert tokens.body.pooler is None and tokens.body.encoder is bert.encoder
    assert tokens.classifier.weight.shape == (16, 4) and tokens.hf_config["architectures"] == ("BertForTokenClassification",)
    relabeled = ft.hf.with_head(clf, "ForSequenceClassification", num_labels=5, problem_type="multi_label_classification",
                                key=jax.random.key(2))
    assert relabeled.classifier.weight.shape == (16, 5) and relabeled.hf_config["problem_type"] == "multi_label_classification"
    assert len(relabeled.hf_config["id2label"]) == 5 and "no" not in relabeled.hf_config["label2id"]


def test_dropout_and_pad_token_id_follow_from_pretrained(tmp_path):
    _, path = saved(tmp_path, "GPT2")
    dropped = ft.nn.from_hf(path, dropout=True, key=jax.random.key(0))
    tokens = ft.hf.with_head(dropped, "ForTokenClassification", num_labels=2, key=jax.random.key(1))
    assert tokens.dropout == 0.1  # GPT-2's classifier_dropout default, as HF's
    plain = ft.hf.with_head(ft.nn.from_hf(path), "ForTokenClassification", key=jax.random.key(1))
    assert plain.dropout == 0.0 and plain.classifier.weight.shape == (16, 2)  # HF's default 2 labels
    counted = ft.hf.with_head(ft.nn.from_hf({**plain.hf_config.to_dict(), "id2label": None, "label2id": None,
                                             "num_labels": 4, "architectures": None}, key=jax.random.key(0)),
                              "ForTokenClassification", key=jax.random.key(1))
    assert counted.classifier.weight.shape == (16, 4) and "num_labels" not in counted.hf_config  # a dict config's count
    padded = ft.hf.with_head(ft.nn.from_hf(path), "ForSequenceClassification", pad_token_id=3, key=jax.random.key(1))
    assert padded.hf_config["pad_token_id"] == 3


def test_refusals_name_the_fix(tmp_path):
    _, path = saved(tmp_path, "OPT")
    lm = ft.nn.from_hf(path)
    key = jax.random.key(0)
    with pytest.raises(ValueError, match=r"(?s)OPTForCausalLM has no 'ForTokenClassification' head.*"
                                         r"'opt' has ForQuestionAnswering, ForSequenceClassification"):
        ft.hf.with_head(lm, "ForTokenClassification", key=key)
    with pytest.raises(ValueError, match=r"has no 'BertForSequenceClassification' head"):
        ft.hf.with_head(lm, "BertForSequenceClassification", key=key)
    with pytest.raises(ValueError, match=r"(?s)needs a PRNG key.*right:  ft.hf.with_head\(model, "
                                         r"'ForSequenceClassification', num_labels=3, key=jax.random.key\(0\)\)"):
        ft.hf.with_head(lm, "ForSequenceClassification", num_labels=3)
    with pytest.raises(TypeError, match=r"(?s)got LlamaForCausalLM\..*wrong:  ft.hf.with_head\(hf_model.*"
                                        r"right:  ft.hf.with_head\(ft.nn.from_hf\(hf_model\)"):
        ft.hf.with_head(transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2)),
            "ForSequenceClassification", key=key)
    with pytest.raises(TypeError, match=r"got Dense"):
        ft.hf.with_head(ft.nn.Dense(2, 2, key=key), "ForSequenceClassification", key=key)
    with pytest.raises(ValueError, match=r"the BertModel given carries no hf_config"):
        ft.hf.with_head(ft.nn.from_hf(causal_lm("Bert")).replace(hf_config=None), "ForMaskedLM", key=key)
    with pytest.raises(ValueError, match=r"num_labels=4 beside an id2label of 3"):
        ft.hf.with_head(lm, "ForSequenceClassification", num_labels=4, id2label={0: "a", 1: "b", 2: "c"}, key=key)
    with pytest.raises(ValueError, match=r"label2id alone does not say the labels' order"):
        ft.hf.with_head(lm, "ForSequenceClassification", label2id={"a": 0, "b": 1}, key=key)
    bad: Any
    for bad in (0, True, 2.0):
        with pytest.raises(ValueError, match=r"num_labels is the head's number of outputs, a positive int"):
            ft.hf.with_head(lm, "ForSequenceClassification", num_labels=bad, key=key)
    # a count computed with NumPy is a count; a list of names is no id2label (HF's config fails on .items)
    assert dict(ft.hf.with_head(lm, "ForSequenceClassification", num_labels=np.int64(3), key=key).hf_config["id2label"]) == {
        "0": "LABEL_0", "1": "LABEL_1", "2": "LABEL_2"}
    with pytest.raises(TypeError, match=r"(?s)got a list \['O', 'B', 'I'\].*"
                                        r"right:  .*id2label=dict\(enumerate\(\['O', 'B', 'I'\]\)\)"):
        ft.hf.with_head(lm, "ForSequenceClassification", id2label=["O", "B", "I"], key=key)
    with pytest.raises(ValueError, match=r"OPTForQuestionAnswering's head has two outputs \(start, end\)"):
        ft.hf.with_head(lm, "ForQuestionAnswering", num_labels=3, key=key)
    assert ft.hf.with_head(lm, "ForQuestionAnswering", num_labels=2, key=key).qa_outputs.weight.shape == (8, 2)
    with pytest.raises(ValueError, match=r"(?s)label2id has 3.*"):
        ft.hf.with_head(lm, "ForSequenceClassification", id2label={0: "a", 1: "b"}, label2id={"a": 0, "b": 1, "c": 2},
                        key=key)
    with pytest.raises(ValueError, match=r"problem_type is one of"):
        ft.hf.with_head(lm, "ForSequenceClassification", problem_type="ranking", key=key)
    with pytest.raises(ValueError, match=r"pad_token_id is 99, outside its vocabulary"):
        ft.hf.with_head(lm, "ForSequenceClassification", pad_token_id=99, key=key)
    bert = ft.nn.from_hf(causal_lm("Bert"))
    with pytest.raises(ValueError, match=r"BertForMaskedLM's head has one logit per vocabulary entry"):
        ft.hf.with_head(bert, "ForMaskedLM", num_labels=3, key=key)
    assert _with_head.NOT_A_BODY and _with_head.NO_SUCH_HEAD  # (each constant raised above)


def _with_pooler_beside(tmp_path, family):
    """A masked LM's directory whose file holds the body's pooler too (bert-base-uncased's
    file is BertForPreTraining's, config naming BertForMaskedLM; roberta-base's masked LM
    file holds roberta.pooler): the pooler's tensors and the directory."""
    import safetensors.torch

    config = getattr(transformers, f"{family}Config")(**{**SIZES["Bert"], "max_position_embeddings": 20})
    torch.manual_seed(0)
    with_pooler = getattr(transformers, f"{family}Model")(config)  # add_pooling_layer=True
    masked = getattr(transformers, f"{family}ForMaskedLM")(config)
    masked.save_pretrained(tmp_path)
    prefix = "bert." if family == "Bert" else "roberta."
    tensors = safetensors.torch.load_file(tmp_path / "model.safetensors")
    pooler = {f"{prefix}pooler.dense.{n}": p.detach().clone() for n, p in with_pooler.pooler.dense.named_parameters()}
    safetensors.torch.save_file({**tensors, **pooler}, tmp_path / "model.safetensors", metadata={"format": "pt"})
    return pooler


@pytest.mark.parametrize(("family", "head"), [("Bert", "ForSequenceClassification"), ("Roberta", "ForMultipleChoice")])
def test_a_directory_s_pooler_is_read_where_its_class_leaves_it_unread(tmp_path, family, head):
    """with_head(directory, ...) is HF's AutoModelFor<head>.from_pretrained(directory): the
    pooler the masked LM's file holds is the classifier's, bit for bit (it was drawn: a tiny
    BERT's pooler 0.095 off HF's, on the canonical fine-tuning start); the loaded masked LM
    given instead has none to keep, and its head draws one."""
    pooler = _with_pooler_beside(tmp_path, family)
    labels = {"num_labels": 3} if head == "ForSequenceClassification" else {}
    with pytest.warns(ft.hf.UnreadTensorsWarning):  # from_hf's read of the masked LM's class
        model = ft.hf.with_head(tmp_path, head, key=jax.random.key(0), **labels)
    assert type(model).__name__ == f"{family}{head}"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = getattr(transformers, f"AutoModel{head}").from_pretrained(tmp_path, **labels)
    prefix = "bert." if family == "Bert" else "roberta."
    theirs = {k: v.numpy() for k, v in hf.state_dict().items() if not k.startswith("classifier.")}
    ours = {k: v for k, v in ft.nn.to_hf_state_dict(model, numpy=True).items() if not k.startswith("classifier.")}
    assert sorted(ours) == sorted(theirs)
    for name, value in theirs.items():  # the body, its pooler too: the file's
        np.testing.assert_array_equal(ours[name], value, err_msg=name)
    np.testing.assert_array_equal(ours[f"{prefix}pooler.dense.weight"], pooler[f"{prefix}pooler.dense.weight"].numpy())
    with pytest.warns(ft.hf.UnreadTensorsWarning, match=r"(?s)pooler is a classifier's input.*"
                                                        r"right:  ft.hf.with_head\(directory, "):  # the way here
        masked = ft.nn.from_hf(tmp_path)
    drawn = ft.hf.with_head(masked, head, key=jax.random.key(0), **labels)
    assert not np.array_equal(np.asarray(drawn.body.pooler.weight), np.asarray(model.body.pooler.weight))


@pytest.mark.parametrize(("family", "saved", "head"), [("DistilBert", "ForMaskedLM", "ForMaskedLM"),
                                                        ("Bert", "ForSequenceClassification", "ForTokenClassification"),
                                                        ("Llama", "ForSequenceClassification", "ForSequenceClassification")])
def test_a_directory_s_head_tensors_are_read_as_hf_reads_them(tmp_path, family, saved, head):
    """with_head(directory, head) reads the head tensors the file holds under the head's own
    names, as HF's AutoModelFor<head>.from_pretrained(directory): a masked LM's own head
    (it was drawn: DistilBERT's logits 0.97 of their scale off HF's), a sequence classifier's
    ``classifier`` under the token classifier of the same name and shape; every tensor HF's
    class holds equals it, bit for bit."""
    sizes = {"DistilBert": dict(vocab_size=24, dim=16, n_heads=4, n_layers=1, hidden_dim=32,
                                max_position_embeddings=16, pad_token_id=PAD)}.get(family) or SIZES[family]
    torch.manual_seed(0)
    hf = getattr(transformers, family + saved)(getattr(transformers, family + "Config")(**sizes))
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.3 * torch.randn_like(p))
    hf.save_pretrained(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (from_hf of a classifier's file under another head; HF's load report)
        model = ft.hf.with_head(tmp_path, head, key=jax.random.key(0))
        theirs = getattr(transformers, f"AutoModel{head}").from_pretrained(tmp_path)
    ours = ft.nn.to_hf_state_dict(model, numpy=True)
    file = set(safetensors_names(tmp_path))
    read = [n for n in theirs.state_dict() if n in file]
    assert any(n.split(".")[0] in type(model).head_roots for n in read)
    for name in read:
        np.testing.assert_array_equal(ours[name], theirs.state_dict()[name].numpy(), err_msg=name)


def safetensors_names(path):
    import safetensors

    with safetensors.safe_open(os.path.join(path, "model.safetensors"), "np") as f:
        return list(f.keys())


def test_a_directory_s_head_tensor_of_another_size_is_refused_as_hf_refuses_it(tmp_path):
    """A classifier's file under other labels (or BERT's multiple choice, whose classifier is
    [1, H]): HF's from_pretrained refuses the size mismatch; a fresh head was drawn silently."""
    torch.manual_seed(0)
    transformers.BertForSequenceClassification(transformers.BertConfig(**SIZES["Bert"])).save_pretrained(tmp_path)
    with pytest.raises(RuntimeError, match="ignore_mismatched_sizes"):
        transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path, num_labels=3)
    for head, labels in [("ForSequenceClassification", {"num_labels": 3}), ("ForMultipleChoice", {})]:
        with pytest.raises(ValueError, match=r"(?s)holds 'classifier.weight' \[2, 16\].*which is \[[13], 16\].*"
                                             r"right:  ft.hf.with_head\(ft.nn.from_hf\(directory\), "):
            ft.hf.with_head(tmp_path, head, key=jax.random.key(0), **labels)
    drawn = ft.hf.with_head(ft.nn.from_hf(tmp_path), "ForSequenceClassification", num_labels=3, key=jax.random.key(0))
    assert drawn.classifier.weight.shape == (16, 3)
    assert _with_head.HEAD_SIZE
