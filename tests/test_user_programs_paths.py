"""The forty-sixth session's paths audit: a torch recipe's parameter groups, freezing and
decay masks ported to key-path patterns, on tied parameters.

A tie (``ft.nn.Shared``) is one tensor with several names. A glob that selects it by a tie
target's name only (``"head.*"``: ``head.weight``, not the embedding's own
``embed.embeddings``) had put it where the glob goes, silently: torch's recipes disagree
there (``model.head.parameters()`` holds the tie; a filter over ``named_parameters()``,
which names it once by its first module, does not), so the embedding trained at the head's
rate, or was trained where a name filter freezes it. Such a glob is now refused, naming
both names and the exact-name fix; each fix is run here against torch (float64).

A ``from_hf`` LM whose head is tied to its embedding has no ``lm_head`` parameter: the
pattern ``"lm_head"`` (torch's ``model.lm_head``) had selected the head's empty slot, so its
group trained nothing and ``freeze("lm_head")`` froze nothing, silently; ``"lm_head.*"`` was
refused with the fix ``"*.lm_head"``, the same empty slot. Both now name the embedding.

A layer object used twice is two leaves holding one array, trained as two copies (Swift's
value semantics, seed 000's ``[layer, layer]``; ``AliasWarning`` says so where a step
donates): a pattern may treat them apart (``notebooks/03_key_paths``), so no refusal here.

A pattern naming a static field (LoRA's ``alpha``) was refused as a typo, its fix another
parameter (``"*.lora_a"``); ``Optimizer(wrt=)`` naming a ``no_derivative`` field (BatchNorm's
``running_mean``) fixed it with "a name above (no parameter's name is close)". Both now say
what the field is.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _errors import raises_named

import functree as ft
from functree._naming import STATIC_FIELD, TIE_SPLIT, TIED_HEAD
from functree.optim._groups import AMBIGUOUS
from functree.optim._subset import SELECTS_NON_PARAMETERS

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB, D = 6, 3
TOKENS = np.array([0, 2, 3, 5, 2])
STEPS = 3
# float64 on both sides, the same Adam: measured |Δ| <= 3e-16 on values of order 1 after 3 steps
ATOL = 1e-12


class LM(ft.Module):
    embed: ft.nn.Embedding
    head: ft.nn.Dense

    def __call__(self, tokens):
        return self.head(self.embed(tokens))


def tied_lm():
    """A float64 LM whose head's weight is its embedding's transpose (torch's tied LM)."""
    model = LM(ft.nn.Embedding(VOCAB, D, key=jax.random.key(1), dtype=jnp.float64),  # pyright: ignore[reportCallIssue]
               ft.nn.Dense(D, VOCAB, key=jax.random.key(2), dtype=jnp.float64))
    return ft.nn.Shared(model, {"head.weight": ("embed.embeddings", jnp.transpose)})


def loss(model, tokens):
    return jnp.mean(jnp.tanh(model(tokens)) ** 2)


def torch_run(lm, groups):
    """Adam in torch (float64) on the tied LM: ``groups(embed, head)`` gives the param
    groups (``embed.weight`` is ``head.weight``); the embedding and the head's bias after
    :data:`STEPS` steps."""
    embed = torch.nn.Embedding(VOCAB, D).double()
    head = torch.nn.Linear(D, VOCAB).double()
    with torch.no_grad():
        embed.weight.copy_(torch.from_numpy(np.array(lm.model.embed.embeddings)))
        head.bias.copy_(torch.from_numpy(np.array(lm.model.head.bias)))
    head.weight = embed.weight  # the tie: one Parameter
    opt = torch.optim.Adam(groups(embed, head))
    tokens = torch.from_numpy(TOKENS)
    for _ in range(STEPS):
        opt.zero_grad()
        torch.mean(torch.tanh(head(embed(tokens))) ** 2).backward()
        opt.step()
    return embed.weight.detach().numpy(), head.bias.detach().numpy()


def ft_run(lm, opt):
    step = jax.jit(lambda m, s: opt.minimize(loss, m, s, jnp.asarray(TOKENS))[:2])
    state = opt.init(lm)
    for _ in range(STEPS):
        lm, state = step(lm, state)
    return np.asarray(lm.model.embed.embeddings), np.asarray(lm.model.head.bias)


def assert_runs_alike(got, expected):
    for g, e in zip(got, expected):
        np.testing.assert_allclose(g, e, rtol=0, atol=ATOL * max(1.0, float(np.max(np.abs(e)))))


def test_a_group_glob_naming_a_tie_by_its_head_name_is_refused_and_its_fixes_run_as_torch():
    """``groups({"head.*": adam(0.1)}, default=adam(0.01))`` had trained the tied embedding at
    the head's rate; torch's name-filter recipe trains it at the default's. Refused; the
    right line (the tie in the head's group, by its own name) is torch's module recipe."""
    with jax.enable_x64(True):
        lm = tied_lm()
        fast, slow = ft.optim.adam(0.1), ft.optim.adam(0.01)
        raises_named(lambda: ft.optim.Optimizer(ft.optim.groups({"head.*": fast}, default=slow)).init(lm),
                     ValueError, TIE_SPLIT,
                     "right:  ft.optim.groups({'head.bias': tx, 'embed.embeddings': tx}, default=...)")
        raises_named(lambda: ft.optim.groups({"embed.*": fast, "head.*": slow}).init(ft.parameters(lm)), ValueError,
                     AMBIGUOUS, "right:  ft.optim.groups({'embed.*': ..., 'head.bias': ...}, ...)")  # both globs: which
        in_group = ft_run(lm, ft.optim.Optimizer(ft.optim.groups({"head.bias": fast, "embed.embeddings": fast},
                                                                 default=slow)))
        by_module = torch_run(lm, lambda embed, head: [{"params": list(head.parameters()), "lr": 0.1}])
        assert_runs_alike(in_group, by_module)


def test_a_wrt_glob_naming_a_tie_by_its_head_name_is_refused_in_every_driver():
    """``wrt="head.*"`` had trained the tied embedding (torch's name filter freezes it):
    refused alike by ``Optimizer`` and the Trainer (``train_step`` takes the Optimizer's);
    the fix trains it as torch does, the other freezes it, and ``wrt="embed.*"`` (its own
    name: both torch recipes train it) is no error."""
    with jax.enable_x64(True):
        lm = tied_lm()
        fix = "right:  ft.optim.Optimizer(tx, wrt=('head.*', 'embed.embeddings'))"
        raises_named(lambda: ft.optim.Optimizer(ft.optim.adam(0.1), wrt="head.*").init(lm), ValueError, TIE_SPLIT,
                     fix)
        raises_named(lambda: ft.train.Trainer(lm, ft.optim.adam(0.1), loss, wrt="head.*").fit(
            [jnp.asarray(TOKENS)], epochs=1, progress=False), ValueError, TIE_SPLIT, fix)
        trained = ft_run(lm, ft.optim.Optimizer(ft.optim.adam(0.1), wrt=("head.*", "embed.embeddings")))
        assert_runs_alike(trained, torch_run(lm, lambda embed, head: [{"params": [embed.weight, head.bias],
                                                                       "lr": 0.1}]))
        ft.optim.Optimizer(ft.optim.adam(0.1), wrt="embed.*").init(lm)  # its own name: no error
        state = ft.optim.Optimizer(ft.optim.adam(0.1), wrt="head.bias").init(lm)  # the other fix: the tie frozen
        assert not [k for k in ft.to_flat_dict(state.inner) if "embed" in k]  # no moments: never updated


def test_freeze_and_a_decay_exclusion_naming_a_tie_by_its_head_name_are_refused():
    """``freeze("head.*")`` had frozen the tied embedding and ``exclude=("head.*",)`` left it
    undecayed, where torch's name filter (HF Trainer's no-decay list) decays ``embed.weight``."""
    with jax.enable_x64(True):
        params = ft.parameters(tied_lm())
        raises_named(lambda: ft.optim.freeze("head.*").init(params), ValueError, TIE_SPLIT,
                     "right:  ft.optim.freeze('head.*', 'embed.embeddings')")
        raises_named(lambda: ft.optim.adamw(0.1, exclude=("*.bias", "head.*")).init(params), ValueError, TIE_SPLIT,
                     "'embed.embeddings')")
        ft.optim.freeze("embed.*").init(params)  # its own name: no error
        ft.optim.adamw(0.1).init(params)  # the default exclusions select no tie


@pytest.fixture(scope="module")
def tied_llama():
    config = transformers.LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16,
                                      tie_word_embeddings=True)
    return ft.nn.from_hf(config, key=jax.random.key(0))


@pytest.mark.parametrize("make", [
    lambda m, p: ft.optim.groups({p: ft.optim.sgd(1.0)}, default=ft.optim.sgd(0.1)).init(ft.parameters(m)),
    lambda m, p: ft.optim.freeze(p).init(ft.parameters(m)),
    lambda m, p: ft.optim.Optimizer(ft.optim.sgd(0.1), wrt=p).init(m),
], ids=["groups", "freeze", "wrt"])
@pytest.mark.parametrize("pattern, right", [("lm_head", "'model.embed_tokens.embeddings'"),
                                            ("lm_head.*", "'model.embed_tokens.*'")])
def test_a_pattern_naming_a_tied_from_hf_head_names_the_embedding(tied_llama, make, pattern, right):
    """torch's ``model.lm_head`` of a tied LM is the embedding; here the head has no
    parameter. ``groups({"lm_head": ...})`` had trained nothing in its group and
    ``freeze("lm_head")`` had frozen nothing, silently."""
    raises_named(lambda: make(tied_llama, pattern), ValueError, TIED_HEAD, f"right:  {right}")
    fixed = ft.select(tied_llama, right.strip("'"))
    assert [k for k, v in ft.to_flat_dict(fixed).items() if np.any(v)] == ["model.embed_tokens.embeddings"]


def test_a_pattern_naming_a_tied_head_with_a_bias_names_the_embedding_too():
    """Phi's tied head keeps a bias of its own: ``groups({"lm_head.*": ...})`` had put the
    bias in the group and the tied embedding (torch's ``lm_head.weight``) in the default."""
    config = transformers.PhiConfig(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                                    num_attention_heads=2, max_position_embeddings=16, tie_word_embeddings=True)
    params = ft.parameters(ft.nn.from_hf(config, key=jax.random.key(0)))
    raises_named(lambda: ft.optim.groups({"lm_head.*": ft.optim.sgd(1.0)}, default=ft.optim.sgd(0.1)).init(params),
                 ValueError, TIED_HEAD, "right:  ('lm_head.*', 'model.embed_tokens.*')")


@pytest.fixture(scope="module")
def adapted():
    return {"q": ft.nn.lora(ft.nn.Dense(2, 2, key=jax.random.key(0)), "*", rank=1, key=jax.random.key(1))}


@pytest.mark.parametrize("make", [
    lambda m, p: ft.optim.groups({p: ft.optim.sgd(1.0)}, default=ft.optim.sgd(0.1)).init(ft.parameters(m)),
    lambda m, p: ft.optim.freeze(p).init(ft.parameters(m)),
    lambda m, p: ft.optim.Optimizer(ft.optim.sgd(0.1), wrt=p).init(m),
    lambda m, p: ft.gradient(lambda x: 0.0, wrt=p)(m),
    lambda m, p: ft.optim.adamw(0.1, exclude=(p,)).init(ft.parameters(m)),
    lambda m, p: ft.select(m, p),
], ids=["groups", "freeze", "wrt", "gradient", "exclude", "select"])
def test_a_pattern_naming_a_static_field_says_it_is_one(adapted, make):
    """``"*.alpha"`` (LoRA's scale numerator, ``ft.field(static=True)``): had been "closest
    name '*.lora_a'", a fix that trains another parameter."""
    raises_named(lambda: make(adapted, "*.alpha"), ValueError, STATIC_FIELD, "right:  'q.*'")


def test_wrt_naming_a_no_derivative_field_says_it_is_one():
    model = ft.nn.Sequential([ft.nn.Dense(2, 2, key=jax.random.key(0)), ft.nn.BatchNorm(2)])
    raises_named(lambda: ft.optim.Optimizer(ft.optim.sgd(0.1), wrt="*.running_*").init(model), ValueError,
                 SELECTS_NON_PARAMETERS, 'right:  ft.optim.Optimizer(tx, wrt="layers.1.scale")')
