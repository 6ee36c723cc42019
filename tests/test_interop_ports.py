"""functree.interop._ports: a from_hf model inside a user's model, loaded and saved by
``ft.nn.load_torch_state_dict`` / ``torch_state_dict`` in the names torch's ``state_dict()``
of the equivalent torch model has (``bert.<Hugging Face's name>``, ``head.weight``).

The reference is that torch model (test_hf_names' ``TorchClassifier``: a tiny BertModel from
a config with random weights and a Linear head); outputs agree to float32 rounding (atol
2.5e-5 times their magnitude).
"""

import os

import jax
import jax.numpy as jnp
import pytest

import functree as ft

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")
from test_hf_names import (  # noqa: E402
    CLASSES,
    VOCAB,
    Classifier,
    D,
    Towers,
    _libraries,  # noqa: F401 (autouse: binds test_hf_names' torch/transformers/peft for its helpers here too)
    assert_close,
    bert_config,
    llama_config,
    outputs,
    randomized,
    tokens,
    torch_classifier,
    torch_outputs,
)


@pytest.fixture(scope="module")
def template():
    """A Classifier of other weights: BERT built from its config, a fresh head."""
    bert = ft.nn.from_hf(bert_config(), key=jax.random.key(0))
    return Classifier(bert, ft.nn.Dense(D, CLASSES, key=jax.random.key(1)))


def test_a_nested_port_loads_torch_state_dict_of_the_torch_model(template):
    reference = torch_classifier()
    loaded = ft.nn.load_torch_state_dict(template, reference.state_dict())
    assert_close(outputs(loaded, tokens()), torch_outputs(reference, tokens()))
    sd = ft.nn.torch_state_dict(loaded)
    assert set(sd) == set(reference.state_dict()) and "bert.encoder.layer.1.attention.self.query.weight" in sd
    other = randomized(torch_classifier(), seed=5)
    other.load_state_dict(sd, strict=True)
    assert_close(torch_outputs(other, tokens()), torch_outputs(reference, tokens()))


def test_a_torch_module_holding_the_port_is_read_as_its_state_dict(template):
    """The module given whole: its own layers' options are compared, the port's (BERT's
    LayerNorm eps=1e-12, its dropouts) are its config's, not ft.nn layers' (no error)."""
    reference = torch_classifier()
    loaded = ft.nn.load_torch_state_dict(template, reference)
    assert_close(outputs(loaded, tokens()), torch_outputs(reference, tokens()))


def test_renames_apply_to_a_ports_names_too(template):
    renamed = {k.replace("bert.", "encoder.", 1): v for k, v in torch_classifier().state_dict().items()}
    loaded = ft.nn.load_torch_state_dict(template, renamed, rename={"encoder": "bert"})
    assert_close(outputs(loaded, tokens()), torch_outputs(torch_classifier(), tokens()))
    assert set(ft.nn.torch_state_dict(loaded, rename={"encoder": "bert"}, numpy=True)) == set(renamed)


def test_a_port_in_a_sequential_is_named_as_torch_sequential(template):
    model = ft.nn.Sequential(template.bert, template.head)
    names = set(ft.nn.torch_state_dict(model, numpy=True))
    torch_names = set(torch.nn.Sequential(transformers.BertModel(bert_config()), torch.nn.Linear(D, CLASSES))
                      .state_dict())
    assert names == torch_names


def test_a_nested_ports_mismatch_and_tied_head_name_it(template):
    partial = {k: v for k, v in torch_classifier().state_dict().items() if k != "bert.pooler.dense.bias"}
    _, report = ft.nn.load_torch_state_dict(template, partial, strict=False)
    assert report.missing == ("bert.pooler.dense.bias",) and not report.unexpected
    with pytest.raises(ValueError, match=r"(?s)missing keys: +\['bert.pooler.dense.bias'\].*bert is a Hugging Face "
                                         r"BertModel port: its tensors are named .* under 'bert'"):
        ft.nn.load_torch_state_dict(template, partial)
    torch.manual_seed(0)
    llama = ft.nn.from_hf(transformers.LlamaForCausalLM(llama_config(tie_word_embeddings=True)))
    model = Towers(template.bert, llama, {}, ())
    weights = {f"decoder.{k}": v for k, v in ft.nn.torch_state_dict(llama).items()}
    weights.update((f"encoder.{k}", v) for k, v in ft.nn.torch_state_dict(template.bert).items())
    assert len(weights) == len(ft.nn.torch_state_dict(model, numpy=True))
    loaded = ft.nn.load_torch_state_dict(model, weights)
    assert all(bool(jnp.array_equal(a, b)) for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(model)))
    weights["decoder.lm_head.weight"] = torch.zeros(VOCAB, D)
    with pytest.raises(ValueError, match=r"the state dict's 'decoder.lm_head.weight' differs from "
                                         r"'decoder.model.embed_tokens.weight'"):
        ft.nn.load_torch_state_dict(model, weights)


def test_layouts_inside_a_port_are_refused(template):
    bert = template.bert
    with pytest.raises(ValueError, match=r"layouts= patterns .* match no ft.nn layer outside the model's Hugging "
                                         r"Face ports \(the model \(Hugging Face BertModel\)\)"):
        ft.nn.load_torch_state_dict(bert, ft.nn.torch_state_dict(bert), layouts=type(bert).hf_layouts)


def test_a_port_in_a_stack_is_refused(template):
    stacked = ft.nn.Stack.from_layers([template.bert, template.bert])
    with pytest.raises(ValueError, match=r"the ft.nn.Stack member '0' is a Hugging Face BertModel model; a port's"):
        ft.nn.torch_state_dict(stacked, numpy=True)
