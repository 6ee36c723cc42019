"""LoRA on Hugging Face task models (functree/hf/_heads.py) round-trips with PEFT.

PEFT's ``task_type="SEQ_CLS"`` / ``"TOKEN_CLS"`` / ``"QUESTION_ANS"`` keep the classifier
(``score``, ``classifier``, ``qa_outputs``) whole in ``modules_to_save`` and never adapt it;
its ``"all-linear"`` leaves the head out under ``SEQ_CLS`` (and fails with a TypeError under
``TOKEN_CLS`` and ``QUESTION_ANS``, adapting the head and then wrapping it). So ``ft.nn.lora(task_model, "all-linear")`` leaves the head out,
``ft.hf.save_lora`` writes it whole as PEFT's ``save_pretrained`` does, and a head holding
adapters is refused by name. Each HF model is built from a tiny config with random weights
moved by N(0, 0.3); the adapters and the head are moved as if trained. Logits agree to 2e-5
times their magnitude (the largest difference measured over these tests is 6.6e-7 of it, both
ways: 30 times under the tolerance tests/test_hf_heads.py uses).
"""

import copy
import json
import os

import jax
import numpy as np
import pytest
import safetensors.numpy

import functree as ft
from functree.hf import _load, _names, _peft

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
# transformers' own deprecation, raised inside peft.PeftModel's constructor
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")

PAD = 1
SMALL = {"vocab_size": 24, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
         "num_attention_heads": 4, "pad_token_id": PAD, "num_labels": 3}
IDS = np.array([[5, 6, 7, 8, 9, 1, 1], [1, 1, 3, 4, 5, 9, 2]], np.int32)  # right and left padding
MASK = (IDS != PAD).astype(np.int32)
CONFIGS = {
    "Llama": lambda **k: transformers.LlamaConfig(**{**SMALL, "num_key_value_heads": 2, **k}),
    "Bert": lambda **k: transformers.BertConfig(**{**SMALL, "max_position_embeddings": 16, **k}),
}
# class -> (PEFT's task type, the classifier's HF module and its key path here)
CLASSES = {
    "LlamaForSequenceClassification": ("SEQ_CLS", "score", "score"),
    "LlamaForTokenClassification": ("TOKEN_CLS", "score", "classifier"),
    "BertForSequenceClassification": ("SEQ_CLS", "classifier", "classifier"),
    "BertForTokenClassification": ("TOKEN_CLS", "classifier", "classifier"),
    "LlamaForQuestionAnswering": ("QUESTION_ANS", "qa_outputs", "qa_outputs"),  # (its body: transformer.*)
    "BertForQuestionAnswering": ("QUESTION_ANS", "qa_outputs", "qa_outputs"),
}


def hf_model(name):
    torch.manual_seed(0)
    labels = {"num_labels": 2} if name.endswith("QuestionAnswering") else {}  # (BERT's QA head: 2 outputs)
    hf = getattr(transformers, name)(CONFIGS[name.split("For")[0]](**labels))
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return hf.eval()


@pytest.fixture(scope="module")
def ported():
    """name -> (HF model, its port), built once for the file."""
    return {name: (hf := hf_model(name), ft.nn.from_hf(hf)) for name in CLASSES}


forward = jax.jit(lambda m, i, a: m(i, a))


def ours(model):
    out = forward(model, IDS, MASK)
    out = np.stack(out, -1) if isinstance(out, tuple) else np.asarray(out)  # a QA model's (start, end)
    return out[MASK.astype(bool)] if out.ndim == 3 else out  # a token's logits: the real tokens


def theirs(peft_model):
    with torch.no_grad():
        given = peft_model(torch.from_numpy(IDS).long(), attention_mask=torch.from_numpy(MASK).long())
    out = np.stack([given.start_logits.numpy(), given.end_logits.numpy()], -1) if "start_logits" in given \
        else given.logits.numpy()
    return out[MASK.astype(bool)] if out.ndim == 3 else out


def close(a, b):
    np.testing.assert_allclose(a, b, rtol=0, atol=2e-5 * float(np.abs(b).max()))


def trained(model, field, seed=1):
    """``model`` with every adapter's lora_b and the head's weight moved, as training moves them."""
    keys = iter(jax.random.split(jax.random.key(seed), 64))

    def move(x):
        if isinstance(x, ft.nn.LoraDense):
            return x.replace(lora_b=0.3 * jax.random.normal(next(keys), x.lora_b.shape, x.lora_b.dtype))
        return x

    model = jax.tree.map(move, model, is_leaf=lambda x: isinstance(x, ft.nn.LoraDense))
    head = getattr(model, field)
    return model.replace(**{field: head.replace(weight=head.weight + 0.5)})


def saved(directory):
    with open(os.path.join(directory, "adapter_config.json")) as f:
        config = json.load(f)
    return config, sorted(safetensors.numpy.load_file(os.path.join(directory, "adapter_model.safetensors")))


def peft_modules(hf, task_type, targets):
    """The modules PEFT adapts and the ones it keeps whole, for a LoraConfig."""
    model = peft.get_peft_model(copy.deepcopy(hf), peft.LoraConfig(task_type=task_type, target_modules=targets, r=4))
    adapted = {n.removeprefix("base_model.model.") for n, m in model.named_modules()
               if isinstance(m, peft.tuners.lora.LoraLayer)}
    whole = {n.removeprefix("base_model.model.") for n, m in model.named_modules()
             if type(m).__name__ == "ModulesToSaveWrapper"}
    return model, adapted, whole


@pytest.mark.parametrize("name", CLASSES)
def test_all_linear_selects_what_peft_selects_and_round_trips(ported, name, tmp_path):
    hf, base = ported[name]
    task_type, head, field = CLASSES[name]
    adapted = trained(ft.nn.lora(base, "all-linear", rank=4, key=jax.random.key(0)), field)
    assert not isinstance(getattr(adapted, field), ft.nn.LoraDense)
    ft.hf.save_lora(adapted, tmp_path)
    config, keys = saved(tmp_path)
    assert config["task_type"] == task_type and config["modules_to_save"] == [head]
    # PEFT's "all-linear": the head left out under SEQ_CLS; TOKEN_CLS and QUESTION_ANS fail in PEFT 0.21
    # (it adapts the head, then cannot wrap it), so there: the modules PEFT's plain "all-linear" adapts but the head.
    if task_type == "SEQ_CLS":
        _, expected, _ = peft_modules(hf, task_type, "all-linear")
    else:
        _, every, _ = peft_modules(hf, None, "all-linear")
        expected = every - {head}
    assert set(config["target_modules"]) == expected
    # The files PEFT itself writes for that adapter: the same tensor names (the head whole).
    own, adapted_by_peft, whole = peft_modules(hf, task_type, sorted(expected))
    assert adapted_by_peft == expected and whole == {head}
    own.save_pretrained(str(tmp_path / "peft"))
    assert keys == saved(tmp_path / "peft")[1]
    assert f"base_model.model.{head}.weight" in keys
    # ours -> PEFT: PEFT's logits are ours (the trained head among them).
    peft_model = peft.PeftModel.from_pretrained(copy.deepcopy(hf), str(tmp_path)).eval()
    expected_logits = ours(adapted)
    close(theirs(peft_model), expected_logits)
    # -> ours again: load_lora reads the head back.
    loaded = ft.nn.load_lora(base, tmp_path)
    close(ours(loaded), expected_logits)
    np.testing.assert_array_equal(np.asarray(getattr(loaded, field).weight), np.asarray(getattr(adapted, field).weight))


@pytest.mark.parametrize("name", CLASSES)
def test_peft_task_adapter_loads_with_its_head(ported, name, tmp_path):
    """PEFT -> ours: PEFT's SEQ_CLS / TOKEN_CLS adapter (the head trained whole) gives PEFT's
    logits, and saved again PEFT loads it to the same."""
    hf, base = ported[name]
    task_type, head, _ = CLASSES[name]
    torch.manual_seed(2)
    targets = ["query", "value"] if name.startswith("Bert") else ["q_proj", "v_proj", "down_proj"]
    peft_model = peft.get_peft_model(copy.deepcopy(hf), peft.LoraConfig(task_type=task_type, target_modules=targets,
                                                                        r=4, lora_alpha=8, init_lora_weights=False))
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if f"{head}.modules_to_save" in n:
                p.add_(0.5)
    peft_model.eval().save_pretrained(str(tmp_path))
    expected = theirs(peft_model)
    loaded = ft.nn.load_lora(base, tmp_path)
    close(ours(loaded), expected)
    ft.hf.save_lora(loaded, tmp_path / "again")
    again = peft.PeftModel.from_pretrained(copy.deepcopy(hf), str(tmp_path / "again")).eval()
    close(theirs(again), expected)


def test_head_holding_adapters_is_refused_and_the_fixes_load_in_peft(ported, tmp_path):
    hf, base = ported["LlamaForSequenceClassification"]
    adapted = trained(ft.nn.lora(base, ["*_proj", "score"], rank=4, key=jax.random.key(0)), "score")  # the head too
    assert isinstance(adapted.score, ft.nn.LoraDense)
    with pytest.raises(ValueError, match=r"classifier 'score' of this LlamaForSequenceClassification holds LoRA") as e:
        ft.hf.save_lora(adapted, tmp_path)
    assert "model.replace(score=ft.nn.merge_lora(model.score))" in str(e.value)
    assert not os.path.exists(tmp_path / "adapter_config.json")
    expected = ours(adapted)
    # The first fix: the head merged, written whole (PEFT's SEQ_CLS), the same logits.
    ft.hf.save_lora(adapted.replace(score=ft.nn.merge_lora(adapted.score)), tmp_path / "merged")
    close(theirs(peft.PeftModel.from_pretrained(copy.deepcopy(hf), str(tmp_path / "merged")).eval()), expected)
    # The last: task_type=None, PEFT's plain LoRA on the head (its weight the base model's: untrained here).
    untrained_head = adapted.replace(score=adapted.score.replace(weight=base.score.weight))
    ft.hf.save_lora(untrained_head, tmp_path / "plain", task_type=None)
    assert saved(tmp_path / "plain")[0]["modules_to_save"] is None
    plain = peft.PeftModel.from_pretrained(copy.deepcopy(hf), str(tmp_path / "plain")).eval()
    close(theirs(plain), ours(untrained_head))


def test_a_roberta_classifier_holding_adapters_is_refused_naming_task_type_none(tmp_path):
    """RoBERTa's classifier is a module of two Dense layers (classifier.dense, out_proj): with
    adapters on them save_lora said only 'modules_to_save names classifier.dense, which holds
    adapters', with no word of the task_type=None route; now the head's own message, whose
    first fix (the head merged, written whole) gives PEFT the same logits."""
    torch.manual_seed(0)
    config = transformers.RobertaConfig(**{**SMALL, "max_position_embeddings": 16})
    hf = transformers.RobertaForSequenceClassification(config).eval()
    adapted = jax.tree.map(  # queries, values and the classifier's two layers adapted; lora_b moved off zero
        lambda x: x.replace(lora_b=0.3 * jax.random.normal(jax.random.key(x.lora_b.size), x.lora_b.shape))
        if isinstance(x, ft.nn.LoraDense) else x,
        ft.nn.lora(ft.nn.from_hf(hf), ["*.query", "*.value", "classifier.*"], rank=2, key=jax.random.key(0)),
        is_leaf=lambda x: isinstance(x, ft.nn.LoraDense))
    assert isinstance(adapted.classifier.dense, ft.nn.LoraDense)
    with pytest.raises(ValueError, match=r"(?s)classifier 'classifier' of this RobertaForSequenceClassification holds "
                                         r"LoRA.*'base_model.model.classifier.dense.weight'.*task_type=None") as e:
        ft.hf.save_lora(adapted, tmp_path)
    assert "model.replace(classifier=ft.nn.merge_lora(model.classifier))" in str(e.value)
    ft.hf.save_lora(adapted.replace(classifier=ft.nn.merge_lora(adapted.classifier)), tmp_path / "merged")
    close(theirs(peft.PeftModel.from_pretrained(copy.deepcopy(hf), str(tmp_path / "merged")).eval()), ours(adapted))


def test_a_task_adapter_without_its_head_is_refused(ported, tmp_path):
    """A SEQ_CLS file without the classifier (ft.hf.save_lora's before this fix): PEFT fails on
    it, and load_lora names it rather than pairing the adapters with the model's own head."""
    hf, base = ported["BertForSequenceClassification"]
    adapted = trained(ft.nn.lora(base, "all-linear", rank=4, key=jax.random.key(0)), "classifier")
    ft.hf.save_lora(adapted, tmp_path, task_type=None)  # the adapters alone
    path = tmp_path / "adapter_config.json"
    config = json.loads(path.read_text())
    assert config["modules_to_save"] is None
    path.write_text(json.dumps({**config, "task_type": "SEQ_CLS"}))
    with pytest.raises(KeyError, match=r"base_model\.model\.classifier\.weight"):
        peft.PeftModel.from_pretrained(copy.deepcopy(hf), str(tmp_path))
    with pytest.raises(ValueError, match=r"task_type='SEQ_CLS'.*classifier 'classifier' of a BertForSequenceClassification"):
        ft.nn.load_lora(base, tmp_path)
    assert _peft.HEAD_NOT_SAVED.startswith("ft.nn.load_lora:")
    path.write_text(json.dumps({**config, "task_type": None}))  # its fix: the adapters alone, on the model's head
    close(ours(ft.nn.load_lora(base, tmp_path)), ours(adapted.replace(classifier=base.classifier)))


def test_a_task_adapter_loaded_into_the_causal_lm_is_refused_naming_with_head(ported, tmp_path):
    """A SEQ_CLS adapter (its score saved whole) loaded into the family's causal LM was refused as
    "not a PEFT LoRA adapter directory: an unexpected tensor ...score.weight" (PEFT loads it without
    a word, the trained head dropped); now the head is named with the fix (ft.hf.with_head's task
    model, which loads it: the adapter's score; checked apart, 1.4 s here)."""
    hf, base = ported["LlamaForSequenceClassification"]
    theirs_model = peft.get_peft_model(copy.deepcopy(hf), peft.LoraConfig(task_type="SEQ_CLS", target_modules=["q_proj"],
                                                                          r=2))
    theirs_model.save_pretrained(str(tmp_path))
    causal = base.body.replace(lm_head=base.score.replace(weight=np.zeros((16, 24), np.float32)),
                               hf_config=base.hf_config)  # the body as its causal LM
    with pytest.raises(ValueError, match=r"holds 'score' whole .*task_type='SEQ_CLS'\), which this LlamaForCausalLM "
                                         r"has not") as error:
        ft.nn.load_lora(causal, tmp_path)
    assert "ft.hf.with_head(ft.nn.from_hf(base_directory), 'ForSequenceClassification'" in str(error.value)


def test_from_hf_of_a_peft_task_model_names_its_class(ported):
    hf, _ = ported["LlamaForSequenceClassification"]
    peft_model = peft.get_peft_model(copy.deepcopy(hf), peft.LoraConfig(task_type="SEQ_CLS", target_modules=["q_proj"],
                                                                        r=4))
    for given in (peft_model, peft_model.base_model, peft_model.base_model.model):
        with pytest.raises(ValueError, match=r"not a plain LlamaForSequenceClassification's weights"):
            ft.nn.from_hf(given)
    assert "{hf_class}" in _load.PEFT_LAYERS


def test_classifier_names(ported):
    for name, (_, model) in ported.items():
        assert _names.classifier_of(model) == CLASSES[name][1]
    causal = ft.nn.from_hf(transformers.LlamaForCausalLM(CONFIGS["Llama"]()))  # an untied lm_head
    assert _names.classifier_of(causal) is None
    assert type(ft.nn.lora(causal, "all-linear", rank=2, key=jax.random.key(0)).lm_head) is ft.nn.Dense


def test_all_linear_in_a_config_without_task_type_adapts_the_head(ported, tmp_path):
    """PEFT's plain LoraConfig(target_modules="all-linear") adapts the classifier too (no task
    type: nothing kept whole); load_lora reads such a config (written as the string) alike."""
    hf, base = ported["BertForTokenClassification"]
    torch.manual_seed(3)
    peft_model = peft.get_peft_model(copy.deepcopy(hf), peft.LoraConfig(target_modules="all-linear", r=4,
                                                                        init_lora_weights=False)).eval()
    peft_model.save_pretrained(str(tmp_path))
    path = tmp_path / "adapter_config.json"
    config = json.loads(path.read_text())
    assert "classifier" in config["target_modules"] and config["task_type"] is None
    path.write_text(json.dumps({**config, "target_modules": "all-linear"}))
    loaded = ft.nn.load_lora(base, tmp_path)
    assert isinstance(loaded.classifier, ft.nn.LoraDense)
    close(ours(loaded), theirs(peft_model))


def test_all_linear_on_distilbert_s_classifier_leaves_out_what_peft_keeps_whole(tmp_path):
    """DistilBERT's sequence head is ``pre_classifier`` and ``classifier``, and PEFT's
    ``modules_to_save`` entry ``"classifier"`` keeps both whole (matched as a name's end).
    ``"all-linear"`` leaves both out (before, it adapted ``pre_classifier``, and ``save_lora``
    then refused the model: "modules_to_save names 'pre_classifier', which holds adapters");
    ``save_lora`` writes both whole, and PEFT's logits from the file are ours."""
    torch.manual_seed(0)
    hf = transformers.DistilBertForSequenceClassification(transformers.DistilBertConfig(
        vocab_size=24, dim=16, hidden_dim=32, n_layers=1, n_heads=4, max_position_embeddings=16, pad_token_id=PAD,
        num_labels=3))
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.3 * torch.randn_like(p))
    hf.eval()
    adapted = trained(ft.nn.lora(ft.nn.from_hf(hf), "all-linear", rank=4, key=jax.random.key(0)), "classifier")
    assert not isinstance(adapted.pre_classifier, ft.nn.LoraDense) and not isinstance(adapted.classifier, ft.nn.LoraDense)
    adapted = adapted.replace(pre_classifier=adapted.pre_classifier.replace(weight=adapted.pre_classifier.weight - 0.3))
    ft.hf.save_lora(adapted, tmp_path)
    config, keys = saved(tmp_path)
    assert config["task_type"] == "SEQ_CLS" and config["modules_to_save"] == ["classifier"]
    assert {"base_model.model.pre_classifier.weight", "base_model.model.classifier.weight"} <= set(keys)
    _, every, _ = peft_modules(hf, None, "all-linear")  # (PEFT's own under SEQ_CLS fails: it adapts pre_classifier)
    assert set(config["target_modules"]) == every - {"pre_classifier", "classifier"}
    peft_model = peft.PeftModel.from_pretrained(copy.deepcopy(hf), str(tmp_path)).eval()
    close(theirs(peft_model), ours(adapted))
