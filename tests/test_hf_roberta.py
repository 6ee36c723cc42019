"""RoBERTa and XLM-RoBERTa (functree/hf/_roberta.py, _roberta_heads.py) against transformers' own,
in float64.

Each HF model is built from a tiny config with random weights (no download), moved by
N(0, 0.3) so every tensor matters, and converted to float64 (``.double()``). Its outputs,
HF's ``labels=`` loss and every parameter's gradient must equal HF's, on a batch with a
right-padded, a left-padded and an unpadded row: RoBERTa counts positions from the ids
(``pad + cumsum(ids != pad)``), so every row's positions differ from BERT's ``0..T-1``
(with BERT's positions the outputs are 0.19 to 1.0 of their magnitude off). Measured: 1.9e-15
of the outputs' magnitude at most (XLM-RoBERTa's classifier), 2.9e-16 of the loss, 2.6e-15 of
the largest gradient; the tolerance is 3e-14 of the magnitude (tests/test_hf_qa.py's for the
learned-position families: about 10x).
"""

import copy
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import functree as ft
from functree.hf import _heads, _roberta
from functree.hf._family import FAMILIES, TASKS
from functree.hf._options import UNCOVERED_OPTION

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

PAD = 1
# Checkpoints' shape: type_vocab_size 1, the table pad + 1 rows longer than a row (here 12: 10 tokens).
SMALL = {"vocab_size": 24, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
         "num_attention_heads": 4, "max_position_embeddings": 12, "type_vocab_size": 1, "pad_token_id": PAD,
         "layer_norm_eps": 1e-5, "hidden_act": "gelu_new"}  # (gelu_new: the MLM head's own gelu is the exact one)
# Row 0 right-padded, row 1 left-padded, row 2 unpadded (<s> 0 ... </s> 2).
IDS = np.array([[0, 5, 6, 7, 8, 2, 1, 1], [1, 1, 0, 3, 4, 5, 9, 2], [0, 4, 3, 9, 8, 7, 6, 2]], np.int32)
MASK = (IDS != PAD).astype(np.int32)
REAL = MASK.astype(bool)
TOL = 3e-14
CLASSES = ["RobertaModel", "RobertaForSequenceClassification", "RobertaForTokenClassification", "RobertaForMaskedLM",
           "RobertaForQuestionAnswering", "XLMRobertaForSequenceClassification", "XLMRobertaForMaskedLM"]


def hf_model(name, **changes):
    torch.manual_seed(0)
    labels = {"num_labels": 2 if name.endswith("QuestionAnswering") else 3}
    config_class = transformers.XLMRobertaConfig if name.startswith("XLM") else transformers.RobertaConfig
    hf = getattr(transformers, name)(config_class(**{**SMALL, **labels, **changes})).double()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return hf.eval()


def hf_out(hf, ids=IDS, mask=MASK, **kwargs):
    """HF's output as one array (QA: start and end stacked), and the loss where labels are given."""
    out = hf(torch.from_numpy(ids).long(), attention_mask=torch.from_numpy(mask).long(), **kwargs)
    if "start_logits" in out:
        arrays = torch.stack([out.start_logits, out.end_logits], -1)
    else:
        arrays = out.logits if "logits" in out else out.last_hidden_state
    return arrays.detach().numpy(), out.get("loss")


def ours(model, ids=IDS, mask=MASK):
    out = model(ids, mask)
    return np.stack(out, -1) if isinstance(out, tuple) else np.asarray(out)


def close(a, b, scale=None):
    scale = float(np.abs(b).max()) if scale is None else scale
    np.testing.assert_allclose(np.asarray(a), b, rtol=0, atol=TOL * scale)


def real_tokens(a):
    return a[REAL] if a.ndim == 3 else a  # a token's output: the real tokens (padding's is each side's own)


@pytest.mark.parametrize("name", CLASSES)
def test_outputs_are_hfs_in_float64_with_left_and_right_padding(name):
    hf = hf_model(name)
    with jax.enable_x64(True):
        model = ft.nn.from_hf(hf, dtype=jnp.float64)
        assert type(model).__name__ == name
        assert sorted(ft.nn.to_hf_state_dict(model, numpy=True)) == sorted(hf.state_dict())
        with torch.no_grad():
            expected, _ = hf_out(hf)
        close(real_tokens(ours(model)), real_tokens(expected))


def test_positions_are_counted_from_the_ids_as_hf_counts_them():
    t = torch.from_numpy(IDS).long()
    expected = transformers.models.roberta.modeling_roberta.RobertaEmbeddings.create_position_ids_from_input_ids(t, PAD)
    np.testing.assert_array_equal(np.asarray(_roberta.roberta_positions(jnp.asarray(IDS), PAD)), expected.numpy())
    assert expected[1].tolist() == [1, 1, 2, 3, 4, 5, 6, 7]  # left padding shifts nothing


# name -> labels for HF's loss: (labels=...) or (start_positions, end_positions)
def _labels(name):
    rng = np.random.default_rng(1)
    if name.endswith("SequenceClassification"):
        return {"labels": np.array([2, 0, 1])}
    if name.endswith("QuestionAnswering"):
        return {"start_positions": np.array([2, 9, 3]), "end_positions": np.array([4, 5, -3])}
    labels = rng.integers(0, 24 if name.endswith("MaskedLM") else 3, IDS.shape)
    labels[~REAL] = -100  # padding and (MLM) the unmasked tokens are not scored
    labels[0, 1] = labels[2, 3] = -100
    return {"labels": labels}


@pytest.mark.parametrize("name", ["RobertaForSequenceClassification", "RobertaForTokenClassification",
                                  "RobertaForMaskedLM", "RobertaForQuestionAnswering"])
def test_the_loss_and_every_gradient_are_hfs_in_float64(name):
    """HF's ``outputs.loss`` (-100 ignored) and each parameter's gradient of it, padding rows
    included: the position and word tables' row pad_token_id pass no gradient in either."""
    hf = hf_model(name)
    given = _labels(name)
    hf.zero_grad()
    _, loss = hf_out(hf, **{k: torch.from_numpy(v) for k, v in given.items()})
    loss.backward()
    with jax.enable_x64(True):
        model = ft.nn.from_hf(hf, dtype=jnp.float64)
        labels = given["labels"] if "labels" in given else (given["start_positions"], given["end_positions"])
        # one program (op by op, each operation compiled apart)
        value, grads = jax.jit(jax.value_and_grad(lambda m: m.loss(m(IDS, MASK), labels)))(model)
        close(value, loss.item())
        theirs = {n: p.grad.numpy() for n, p in hf.named_parameters() if p.grad is not None}
        mine = ft.nn.to_hf_state_dict(grads, numpy=True)
        assert set(theirs) <= set(mine)
        scale = max(float(np.abs(g).max()) for g in theirs.values())
        for n, g in theirs.items():
            close(mine[n], g, scale)
        positions = mine["roberta.embeddings.position_embeddings.weight"]
        assert not positions[PAD].any() and positions[PAD + 1].any()


def test_the_masked_lm_head_untied_is_hfs():
    hf = hf_model("RobertaForMaskedLM", tie_word_embeddings=False)
    state = hf.state_dict()
    assert not torch.equal(state["lm_head.decoder.weight"], state["roberta.embeddings.word_embeddings.weight"])
    assert not torch.equal(state["lm_head.decoder.bias"], state["lm_head.bias"])  # HF unties both
    with jax.enable_x64(True):
        model = ft.nn.from_hf(hf, dtype=jnp.float64)
        assert model.lm_head.decoder is not None
        with torch.no_grad():
            expected, _ = hf_out(hf)
        close(real_tokens(ours(model)), real_tokens(expected))
        assert sorted(ft.nn.to_hf_state_dict(model, numpy=True)) == sorted(state)


@pytest.mark.parametrize(("name", "auto"), [("RobertaForMaskedLM", "AutoModelForMaskedLM"),
                                            ("RobertaForSequenceClassification", "AutoModelForSequenceClassification")])
def test_save_hf_is_read_by_from_pretrained_and_from_hf_reads_it_without_transformers(name, auto, tmp_path):
    hf = hf_model(name)
    model = ft.nn.from_hf(hf)
    ft.nn.save_hf(model, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == [name]
    back, info = getattr(transformers, auto).from_pretrained(tmp_path, output_loading_info=True)
    assert type(back).__name__ == name
    assert not any(info.values()), info  # no missing, unexpected or mismatched key
    for k, v in hf.state_dict().items():
        np.testing.assert_array_equal(back.state_dict()[k].numpy(), v.float().numpy(), err_msg=k)
    expected, _ = hf_out(back.eval())
    close32 = lambda a: np.testing.assert_allclose(real_tokens(a), real_tokens(expected), rtol=0,  # noqa: E731
                                                   atol=2e-5 * float(np.abs(expected).max()))  # float32 both
    close32(ours(ft.nn.from_hf(tmp_path)))
    if name != "RobertaForMaskedLM":
        return
    # The directory read in a fresh process: neither transformers nor torch imported.
    script = ("import sys, numpy as np, functree as ft\n"
              "m = ft.nn.from_hf(sys.argv[1])\n"
              "np.save(sys.argv[2], np.asarray(m(np.load(sys.argv[3]), np.load(sys.argv[3]) != 1)))\n"
              "print(type(m).__name__, 'transformers' in sys.modules, 'torch' in sys.modules)\n")
    np.save(tmp_path / "ids.npy", IDS)
    run = subprocess.run([sys.executable, "-c", script, str(tmp_path), str(tmp_path / "out.npy"),
                          str(tmp_path / "ids.npy")], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == [name, "False", "False"]
    close32(np.load(tmp_path / "out.npy"))


def test_with_head_gives_a_roberta_model_hfs_sequence_classifier(tmp_path):
    """ft.hf.with_head(RobertaModel, "ForSequenceClassification"): the body's own arrays (its
    pooler dropped, as HF's add_pooling_layer=False), a fresh classifier.dense / out_proj;
    saved, transformers reads it (no key missing) and gives its logits."""
    hf = hf_model("RobertaModel")
    body = ft.nn.from_hf(hf)
    assert body.pooler is not None
    clf = ft.hf.with_head(body, "ForSequenceClassification", num_labels=3, key=jax.random.key(0))
    assert TASKS["RobertaForSequenceClassification"] is type(clf) and clf.body.pooler is None
    assert clf.body.encoder is body.encoder and clf.classifier.out_proj.weight.shape == (16, 3)
    assert float(jnp.abs(clf.classifier.out_proj.bias).max()) == 0.0  # HF's init: biases zero
    ft.nn.save_hf(clf, tmp_path)
    back, info = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path, output_loading_info=True)
    assert type(back).__name__ == "RobertaForSequenceClassification" and not any(info.values()), info
    expected, _ = hf_out(back.eval())
    np.testing.assert_allclose(ours(clf), expected, rtol=0, atol=2e-5 * float(np.abs(expected).max()))
    mlm = ft.hf.with_head(body, "ForMaskedLM", key=jax.random.key(1))
    assert type(mlm) is TASKS["RobertaForMaskedLM"]
    with pytest.raises(ValueError, match=r"RobertaForMaskedLM's head has one logit per vocabulary entry"):
        ft.hf.with_head(body, "ForMaskedLM", num_labels=3, key=jax.random.key(1))


def peft_seq_cls(peft, hf, targets, directory):
    """PEFT's own SEQ_CLS adapter on ``targets`` of ``hf`` (a float32 copy), its classifier
    trained whole (moved by 0.5), saved in ``directory``; the PEFT model, in eval mode."""
    torch.manual_seed(2)
    own = peft.get_peft_model(copy.deepcopy(hf).float(), peft.LoraConfig(
        task_type="SEQ_CLS", target_modules=targets, r=4, init_lora_weights=False))
    with torch.no_grad():
        for n, p in own.named_parameters():
            if "classifier.modules_to_save" in n:
                p.add_(0.5)
    own.eval().save_pretrained(str(directory))
    return own


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")  # transformers', in PEFT
def test_a_peft_seq_cls_adapter_round_trips_with_the_classifier_whole(tmp_path):
    """ft.nn.lora + save_lora (task_type SEQ_CLS: classifier.dense and classifier.out_proj
    written whole, as PEFT's modules_to_save wraps the classifier) read by PEFT: the same
    logits; PEFT's own adapter read back by load_lora: PEFT's logits."""
    peft = pytest.importorskip("peft")
    hf = hf_model("RobertaForSequenceClassification")
    base = ft.nn.from_hf(hf)
    adapted = ft.nn.lora(base, ["*.query", "*.value"], rank=4, key=jax.random.key(0))
    keys = iter(jax.random.split(jax.random.key(1), 8))
    adapted = jax.tree.map(lambda x: x.replace(lora_b=0.3 * jax.random.normal(next(keys), x.lora_b.shape))
                           if isinstance(x, ft.nn.LoraDense) else x, adapted,
                           is_leaf=lambda x: isinstance(x, ft.nn.LoraDense))
    head = adapted.classifier
    adapted = adapted.replace(classifier=head.replace(out_proj=head.out_proj.replace(weight=head.out_proj.weight + 0.5)))
    ft.hf.save_lora(adapted, tmp_path)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["task_type"] == "SEQ_CLS" and config["modules_to_save"] == ["classifier"]
    peft_model = peft.PeftModel.from_pretrained(copy.deepcopy(hf).float(), str(tmp_path)).eval()
    with torch.no_grad():
        expected, _ = hf_out(peft_model)
    np.testing.assert_allclose(ours(adapted), expected, rtol=0, atol=2e-5 * float(np.abs(expected).max()))
    loaded = ft.nn.load_lora(base, tmp_path)
    np.testing.assert_allclose(ours(loaded), expected, rtol=0, atol=2e-5 * float(np.abs(expected).max()))
    own = peft_seq_cls(peft, hf, ["query", "value"], tmp_path / "peft")
    with torch.no_grad():
        expected, _ = hf_out(own)
    np.testing.assert_allclose(ours(ft.nn.load_lora(base, tmp_path / "peft")), expected, rtol=0,
                               atol=2e-5 * float(np.abs(expected).max()))


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")  # transformers', in PEFT
def test_all_linear_leaves_the_whole_classifier_to_modules_to_save_as_peft_does(tmp_path):
    """PEFT's SEQ_CLS "all-linear" on RoBERTa wraps the whole classifier (dense and out_proj)
    in modules_to_save, adapting neither; ft.nn.lora adapted classifier.dense (only a module
    named the head itself was left out), so save_lora refused the model it had just made.
    Now the two Dense layers stay whole: save_lora writes them and PEFT reads the same logits."""
    peft = pytest.importorskip("peft")
    hf = hf_model("RobertaForSequenceClassification")
    adapted = ft.nn.lora(ft.nn.from_hf(hf), "all-linear", rank=4, key=jax.random.key(0))
    assert not isinstance(adapted.classifier.dense, ft.nn.LoraDense)
    assert not isinstance(adapted.classifier.out_proj, ft.nn.LoraDense)
    keys = iter(jax.random.split(jax.random.key(1), 16))
    adapted = jax.tree.map(lambda x: x.replace(lora_b=0.3 * jax.random.normal(next(keys), x.lora_b.shape))
                           if isinstance(x, ft.nn.LoraDense) else x, adapted,
                           is_leaf=lambda x: isinstance(x, ft.nn.LoraDense))
    ft.hf.save_lora(adapted, tmp_path)
    assert json.loads((tmp_path / "adapter_config.json").read_text())["modules_to_save"] == ["classifier"]
    peft_model = peft.PeftModel.from_pretrained(copy.deepcopy(hf).float(), str(tmp_path)).eval()
    with torch.no_grad():
        expected, _ = hf_out(peft_model)
    np.testing.assert_allclose(ours(adapted), expected, rtol=0, atol=2e-5 * float(np.abs(expected).max()))


@pytest.mark.parametrize(("option", "value"), [("position_embedding_type", "relative_key"), ("is_decoder", True),
                                               ("add_cross_attention", True)])
def test_a_config_functree_cannot_reproduce_is_refused_naming_the_option(option, value):
    config = {"model_type": "roberta", "architectures": ["RobertaForMaskedLM"], **SMALL, option: value}
    with pytest.raises(ValueError, match=rf"the roberta config sets {option}={value!r}; functree's roberta covers"):
        ft.nn.from_hf(config, key=jax.random.key(0))
    assert UNCOVERED_OPTION.startswith("ft.nn.from_hf:")


@pytest.mark.parametrize("pad", [None, 12, -1])
def test_a_pad_id_that_cannot_start_the_positions_is_refused(pad):
    config = {"model_type": "xlm-roberta", **SMALL, "pad_token_id": pad}
    with pytest.raises(ValueError, match=rf"the xlm-roberta config's pad_token_id is {pad}; RoBERTa counts"):
        ft.nn.from_hf(config, key=jax.random.key(0))
    assert _roberta.NO_PAD_TOKEN.startswith("ft.nn.from_hf:")


def test_a_row_whose_positions_pass_the_table_is_refused_as_hf_refuses_it():
    """12 rows, pad id 1: at most 10 tokens that are not the pad a row (positions 2 to 11);
    padding takes none, so a longer left-padded row fits."""
    hf = hf_model("RobertaModel")
    model = ft.nn.from_hf(hf)
    long = np.full((2, 13), 5, np.int32)
    long[0, :3] = PAD  # 10 real tokens: fits
    long[1, :2] = PAD  # 11: past the table
    with pytest.raises(RuntimeError, match="index 12 is out of bounds"):
        hf(torch.from_numpy(long[1:]).long())
    model(long[:1])
    with pytest.raises(ValueError, match=r"RobertaModel: row 1 has 11 tokens that are not pad_token_id \(1\); "
                                         r"RoBERTa gives them positions 1 \+ 1 to 1 \+ 11 = 12, but the learned position "
                                         r"embedding has 12 rows.*at most 10"):
        model(long)
    traced = jax.jit(lambda ids: model(ids))(long)  # traced ids cannot be checked: the rows past the table are NaN
    assert np.isnan(np.asarray(traced[1])).all() and np.isfinite(np.asarray(traced[0])).all()


def test_the_families_and_their_heads_are_registered():
    assert FAMILIES["roberta"].__name__ == "RobertaModel" and FAMILIES["xlm-roberta"].__name__ == "XLMRobertaModel"
    for prefix in ("Roberta", "XLMRoberta"):
        for suffix in _heads.HEADS["roberta"]:
            assert getattr(_heads, prefix + suffix) is TASKS[prefix + suffix]


def test_dropout_true_reads_hfs_classifier_rate_and_is_hfs_eval_in_inference():
    """from_hf(..., dropout=True): HF's classifier_dropout (else hidden_dropout_prob) on the
    classifier; inference: HF's eval(); training with a key: its masks, the same for the same key."""
    hf = hf_model("RobertaForSequenceClassification", classifier_dropout=0.25)
    model = ft.nn.from_hf(hf, dropout=True, key=jax.random.key(0))
    assert model.dropout == 0.25
    with torch.no_grad():
        expected, _ = hf_out(hf)
    np.testing.assert_allclose(ours(model), expected, rtol=0, atol=2e-5 * float(np.abs(expected).max()))
    training = ft.nn.training(model)
    train = [np.asarray(training(IDS, MASK, key=jax.random.key(k))) for k in (1, 1, 2)]
    np.testing.assert_array_equal(train[0], train[1])
    assert np.isfinite(train[0]).all() and not np.allclose(train[0], train[2], atol=1e-3)
    assert not np.allclose(train[0], expected, atol=1e-3)
    rates = ft.nn.from_hf(hf_model("RobertaForSequenceClassification"), dropout=True, key=jax.random.key(0))
    assert rates.dropout == 0.1  # hidden_dropout_prob where classifier_dropout is null


def test_a_masked_lm_file_holding_the_bodys_pooler_is_read_leaving_the_pooler_as_hf_does(tmp_path):
    """roberta-base's and xlm-roberta-base's RobertaForMaskedLM files hold roberta.pooler.*,
    which HF's class (built without a pooler) leaves unread (its load report); from_hf
    leaves the two unread too, warning with their names (UnreadTensorsWarning), and the
    model is the one the file without them gives."""
    hf = hf_model("RobertaForMaskedLM")
    pooler = {"roberta." + k: v for k, v in hf_model("RobertaModel").state_dict().items() if k.startswith("pooler.")}
    weights = {**hf.state_dict(), **pooler}
    config = {**hf.config.to_dict(), "architectures": ["RobertaForMaskedLM"]}  # (as its config.json names it)
    with pytest.warns(ft.hf.UnreadTensorsWarning, match=r"2 tensor.*\['roberta.pooler.dense.bias', "
                                                        r"'roberta.pooler.dense.weight'\]"):
        model = ft.nn.from_hf(config, weights)
    without = ft.nn.from_hf(config, {k: v for k, v in weights.items() if k not in pooler})
    assert type(model).__name__ == "RobertaForMaskedLM"
    for a, b in zip(jax.tree.leaves(model), jax.tree.leaves(without)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_from_config_zeroes_the_pad_rows_hf_zeroes():
    """from_hf(config, key=): HF's initialization (tests/test_hf_load.py's for the other
    families); RoBERTa's position table is built with padding_idx too, its row pad_token_id
    zero as HF's (was drawn)."""
    config = transformers.RobertaConfig(**{**SMALL, "num_labels": 3})
    torch.manual_seed(0)
    expected = {k: v.numpy() for k, v in transformers.RobertaForSequenceClassification(config).state_dict().items()}
    config.architectures = ["RobertaForSequenceClassification"]
    mine = ft.nn.to_hf_state_dict(ft.nn.from_hf(config, key=jax.random.key(0)), numpy=True)
    assert set(mine) == set(expected)
    for name in ("roberta.embeddings.word_embeddings.weight", "roberta.embeddings.position_embeddings.weight"):
        zero = np.flatnonzero(np.all(mine[name] == 0, axis=-1)).tolist()
        assert zero == np.flatnonzero(np.all(expected[name] == 0, axis=-1)).tolist() == [PAD], name
    for name, theirs in expected.items():  # the zeros and ones (biases, norms) equal; each drawn std HF's
        if np.all(theirs == theirs.flat[0]):
            np.testing.assert_array_equal(mine[name], theirs, err_msg=name)
        else:  # within 5 sigma of the two estimates' ratio (sigma ~ 1 / sqrt(n))
            assert abs(mine[name].std() / theirs.std() - 1) < 5 / np.sqrt(theirs.size), name
