"""functree.hf._names: the torch module name of every Dense member, for a from_hf model held
inside a user's own Module (at any depth, in dict / list / tuple fields too).

The reference is PEFT on the equivalent torch model: ``Classifier(nn.Module)`` holding
``self.bert = BertModel(config)`` and ``self.head = Linear``, a tiny BERT built from a config
with random weights (no download). PEFT names its modules ``bert.encoder.layer.0.attention.
self.query``; ``ft.nn.load_lora`` reads its adapter, ``ft.nn.save_lora`` writes one
``PeftModel.from_pretrained`` reads, and the logits agree to float32 rounding (atol 2.5e-5
times the outputs' magnitude, as in test_nn_lora).
"""

import functools
import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import functree as ft
from functree.hf import _names

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# torch, transformers and PEFT, bound by _libraries when the module's first test runs:
# imported at collection they cost ~10 CPU-s in every xdist worker (each collects every file).
torch: Any
transformers: Any
peft: Any


@pytest.fixture(scope="module", autouse=True)
def _libraries():
    """Import the references; a missing one skips every test of the module, as a
    module-level importorskip did."""
    global torch, transformers, peft
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")


pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")

VOCAB, D, CLASSES, T = 40, 16, 3, 6


def bert_config():
    return transformers.BertConfig(vocab_size=VOCAB, hidden_size=D, num_hidden_layers=2, num_attention_heads=4,
                                   intermediate_size=2 * D, max_position_embeddings=16)


def llama_config(**changes):
    return transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=D, intermediate_size=2 * D, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32, **changes)


@functools.cache
def torch_classifier_class():
    """The class of the user's torch model (defined once torch is imported)."""

    class TorchClassifier(torch.nn.Module):
        """The user's torch model: a BertModel and a Linear head on its first token."""

        def __init__(self):
            super().__init__()
            self.bert = transformers.BertModel(bert_config())
            self.head = torch.nn.Linear(D, CLASSES)

        def forward(self, input_ids):
            return self.head(self.bert(input_ids).last_hidden_state[:, 0])

    return TorchClassifier


class Classifier(ft.Module):
    """The same model in functree: ``bert`` is ``ft.nn.from_hf``'s."""

    bert: Any
    head: ft.nn.Dense

    def __init__(self, bert, head):
        self.bert, self.head = bert, head

    def __call__(self, input_ids):
        return self.head(self.bert(input_ids)[:, 0])


def randomized(module, seed=0):
    """``module`` with every parameter moved by N(0, 0.2) (outputs of order 1), in eval mode."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return module.eval()


def torch_classifier():
    torch.manual_seed(0)
    return randomized(torch_classifier_class()())  # the same weights each call (PEFT edits its model)


def tokens():
    return np.random.default_rng(0).integers(0, VOCAB, size=(2, T)).astype(np.int32)


def torch_outputs(model, ids):
    with torch.no_grad():
        return model(torch.from_numpy(ids).long()).numpy()


def assert_close(actual, expected, scale=2.5e-5):
    expected = np.asarray(expected, np.float32)
    np.testing.assert_allclose(np.asarray(actual, np.float32), expected, rtol=0,
                               atol=scale * float(np.abs(expected).max()))


outputs = jax.jit(lambda model, ids: model(ids))


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    """The functree Classifier as a user builds it: BERT from its save_pretrained directory."""
    reference = torch_classifier()
    directory = tmp_path_factory.mktemp("bert")
    reference.bert.save_pretrained(directory)
    head = ft.nn.Dense(D, CLASSES, key=jax.random.key(0)).replace(
        weight=jnp.asarray(reference.head.weight.detach().numpy().T),
        bias=jnp.asarray(reference.head.bias.detach().numpy()))
    return Classifier(ft.nn.from_hf(str(directory)), head)


def peft_adapter(directory, **options):
    """PEFT's adapter on the torch Classifier, its lora_B moved off zero, saved to ``directory``."""
    model = peft.get_peft_model(torch_classifier(), peft.LoraConfig(r=4, lora_alpha=8, **options))
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.add_(0.3 * torch.randn_like(p))
    model.save_pretrained(directory)
    return model.eval()


def test_the_classifier_equals_torch(classifier):
    assert_close(outputs(classifier, tokens()), torch_outputs(torch_classifier(), tokens()))


def test_nested_names_are_torch_names_under_the_attribute(classifier):
    modules = {m for m, _ in torch_classifier().named_modules() if m}
    names = _names.torch_names(classifier)
    assert names.is_hf and names.head is None  # PEFT's "all-linear" leaves out only a PreTrainedModel root's head
    found = {n.module for n in names.members.values()}
    assert found <= modules
    assert "bert.encoder.layer.1.attention.self.query" in found and "head" in found
    alone = _names.torch_names(classifier.bert)  # the root case: the same names, without the prefix
    assert {f"bert.{n.module}" for n in alone.members.values()} == found - {"head"}


def test_load_lora_reads_peft_adapter_of_the_torch_classifier(classifier, tmp_path):
    expected_model = peft_adapter(tmp_path, target_modules=["query", "value"])
    loaded = ft.nn.load_lora(classifier, tmp_path)
    ids = tokens()
    expected = torch_outputs(expected_model, ids)
    assert not np.allclose(expected, torch_outputs(torch_classifier(), ids), atol=1e-3)  # the adapter matters
    assert_close(outputs(loaded, ids), expected)


def test_save_lora_of_a_pattern_loads_in_peft(classifier, tmp_path):
    adapted = ft.nn.lora(classifier, ["bert.*.query", "bert.*.value"], rank=2, alpha=4, key=jax.random.key(1))
    b = [n for n in ft.to_flat_dict(adapted) if n.endswith("lora_b")]
    assert len(b) == 2  # query and value, stacked over BERT's layers
    for i, name in enumerate(b):
        value = ft.get(adapted, name)
        adapted = ft.set(adapted, name, 0.3 * jax.random.normal(jax.random.key(10 + i), value.shape))
    ft.nn.save_lora(adapted, tmp_path)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["target_modules"] == sorted(f"bert.encoder.layer.{i}.attention.self.{m}"
                                              for i in range(2) for m in ("query", "value"))
    peft_model = peft.PeftModel.from_pretrained(torch_classifier(), str(tmp_path)).eval()
    assert_close(outputs(adapted, tokens()), torch_outputs(peft_model, tokens()))
    back = ft.nn.load_lora(classifier, tmp_path)
    assert bool(jnp.all(outputs(back, tokens()) == outputs(adapted, tokens())))


class Towers(ft.Module):
    """Several from_hf models in one model: fields, a dict field and a tuple field."""

    encoder: Any
    decoder: Any
    by_name: dict
    pair: tuple

    def __init__(self, encoder, decoder, by_name, pair):
        self.encoder, self.decoder, self.by_name, self.pair = encoder, decoder, by_name, pair


def test_each_from_hf_model_is_named_under_its_own_prefix(classifier, tmp_path):
    bert = classifier.bert
    torch.manual_seed(2)
    llama = ft.nn.from_hf(randomized(transformers.LlamaForCausalLM(llama_config())))
    model = Towers(bert, llama, {"extra": llama}, (bert, classifier))
    names = _names.torch_names(model)
    found = {m: n.module for m, n in names.members.items()}
    alone = {name: {n.module for n in _names.torch_names(port).members.values()} for name, port in
             (("bert", bert), ("llama", llama))}
    for prefix, port in (("encoder", "bert"), ("decoder", "llama"), ("by_name.extra", "llama"), ("pair.0", "bert"),
                         ("pair.1.bert", "bert")):
        under = {m for m in found.values() if m.startswith(prefix + ".")}
        assert under == {f"{prefix}.{m}" for m in alone[port]}, prefix
    assert names.head is None and "pair.1.head" in found.values()
    assert "decoder.lm_head" in found.values() and "decoder.model.layers.1.self_attn.q_proj" in found.values()
    adapted = ft.nn.lora(model, ["decoder.*.q_proj", "pair.1.bert.*.query"], rank=2, key=jax.random.key(3))
    for name, value in ft.to_flat_dict(adapted).items():
        if name.endswith("lora_b"):  # as if trained
            adapted = ft.set(adapted, name, jnp.full_like(value, 0.5))
    ft.nn.save_lora(adapted, tmp_path)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["target_modules"] == sorted([f"decoder.model.layers.{i}.self_attn.q_proj" for i in range(2)]
                                              + [f"pair.1.bert.encoder.layer.{i}.attention.self.query" for i in range(2)])
    back = ft.nn.load_lora(model, tmp_path)
    assert jax.tree.structure(back) == jax.tree.structure(adapted)
    assert all(bool(jnp.all(a == b)) for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(adapted)))


GPT2 = {"model_type": "gpt2", "vocab_size": 11, "n_positions": 8, "n_embd": 8, "n_layer": 2, "n_head": 2}


def _adapted(model):
    return sorted(n.rpartition(".")[0] for n in ft.to_flat_dict(model) if n.endswith(".lora_a"))


@pytest.mark.parametrize("pattern", ["layers.transformer.h.layers.attn.query_projection", "*.query_projection",
                                     "all-linear"])
def test_lora_on_a_stack_of_ports_reads_functree_names_and_only_a_peft_file_is_refused(pattern, tmp_path):
    """An ensemble of from_hf models (a Stack of ports) has no Hugging Face names: ft.nn.lora
    reads its key paths, as at facec75 (this session refused it with PORT_IN_STACK). Its
    "all-linear" adapts each member's Dense layers as the member's own "all-linear" does."""
    ens = ft.nn.Stack(lambda k: ft.nn.from_hf(GPT2, key=k), 2, key=jax.random.key(0))
    adapted = ft.nn.lora(ens, pattern, rank=2, key=jax.random.key(1))
    member = ft.nn.from_hf(GPT2, key=jax.random.key(2))
    one = ft.nn.lora(member, "*.query_projection" if pattern != "all-linear" else pattern, rank=2, key=jax.random.key(1))
    assert _adapted(adapted) == ["layers." + n for n in _adapted(one)]
    assert _adapted(adapted)  # (some were adapted)
    ids = jnp.asarray([[1, 2, 3]])
    for i in range(2):  # B starts at zero: each member's logits are its base model's
        np.testing.assert_allclose(adapted[i](ids), ens[i](ids), rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="Stack member '0' is a Hugging Face GPT2LMHeadModel"):
        ft.nn.save_lora(adapted, tmp_path)
