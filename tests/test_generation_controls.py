"""The logits controls' records (functree/generation/_controls.py) against Hugging Face's own
processors and warpers, and the rule that a record is the one place a control is written.

``typical_p``, ``epsilon_cutoff``, ``eta_cutoff`` (HF's warpers) and
``exponential_decay_length_penalty`` (HF's processor) are compared record by record on random
logits, and through ``ft.nn.generate`` on a Llama built by HF from a tiny random config (no
download): the decay's greedy and beam tokens equal HF's ``generate``'s on a left-padded batch;
a sampled token's score is HF's ``log_softmax`` of the warped logits, teacher-forced. Then the
extensibility rules: every record's keyword is a parameter of ``generate`` (checked at import,
naming the record), a checkpoint option (never warned about as unapplied), refused with greedy
decoding and beams if it is a warper, and a row of the guide's table of controls.
"""

import inspect
import os
import pathlib
import re
import warnings
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import functree as ft
from functree.generation import _controls, _defaults, _generate

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from _backends import logprob_atol  # noqa: E402
from transformers.generation.logits_process import (  # noqa: E402
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    ExponentialDecayLengthPenalty,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

EOS, PAD = 10, 0
GUIDE = pathlib.Path(__file__).resolve().parents[1] / "docs" / "guides" / "generation.md"


# A value of every warper's keyword that turns it on (a new warper adds its own here: checked).
ACTIVE: dict[str, Any] = {"top_k": 3, "top_p": 0.5, "min_p": 0.1, "typical_p": 0.5, "epsilon_cutoff": 0.01,
                          "eta_cutoff": 0.01}


def hf_warpers(temperature, **options):
    """HF's warpers for ``options``, in the order of its ``_get_logits_processor``."""
    made = [TemperatureLogitsWarper(temperature)]
    kinds = {"top_k": TopKLogitsWarper, "top_p": TopPLogitsWarper, "min_p": MinPLogitsWarper,
             "typical_p": TypicalLogitsWarper, "epsilon_cutoff": EpsilonLogitsWarper, "eta_cutoff": EtaLogitsWarper}
    return made + [kinds[name](options[name]) for name in kinds if options.get(name) is not None]


def through(processors, ids, scores):
    for p in processors:
        scores = p(ids, scores)
    return scores


def tiny_llama(sharpness=1.0):
    """A tiny Llama (EOS 10, pad 0) from a random config, its lm_head times ``sharpness``."""
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      pad_token_id=PAD, eos_token_id=EOS, bos_token_id=1)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        hf.lm_head.weight.mul_(sharpness)
    return hf, ft.nn.from_hf(hf)


@pytest.fixture(scope="module")
def llama():
    return tiny_llama()


@pytest.fixture(scope="module")
def sharp():
    """Sharper logits (lm_head * 8): the warpers remove tokens."""
    return tiny_llama(8.0)


def left_padded():
    ids = np.array([[0, 0, 3, 4, 5, 6], [7, 8, 9, 11, 12, 13]], np.int32)
    mask = (np.arange(6)[None] >= np.array([[2], [0]])).astype(np.int32)
    return ids, mask


# ---- the records against HF's processors ------------------------------------------------------------

WARPED = [  # temperature, options (HF's order applies them: temperature, top_k, top_p, min_p, typical, eps, eta)
    (1.0, {"typical_p": 0.5}), (0.7, {"typical_p": 0.2}), (1.3, {"top_k": 20, "typical_p": 0.9}),
    (1.0, {"epsilon_cutoff": 0.02}), (0.8, {"top_k": 30, "epsilon_cutoff": 0.05}),
    (1.0, {"eta_cutoff": 0.02}), (1.2, {"top_p": 0.9, "eta_cutoff": 0.1}),
    # every warper at once: filtered() dropped the 5th before (its states were [None] * 4)
    (1.0, {"top_k": 40, "top_p": 0.999, "min_p": 0.001, "typical_p": 0.95, "epsilon_cutoff": 0.002,
           "eta_cutoff": 0.002}),
]


@pytest.mark.parametrize(("temperature", "options"), WARPED)
def test_new_warpers_equal_hf_logits_warpers(temperature, options):
    rng = np.random.default_rng(0)
    no_ids = torch.zeros((8, 1), dtype=torch.long)  # the warpers do not read the ids
    removed = 0
    for scale in (1.0, 3.0, 8.0):
        logits = (rng.normal(size=(8, 100)) * scale).astype(np.float32)
        logits[:2, :5] = -np.inf  # tokens an earlier control removed
        expected = through(hf_warpers(temperature, **options), no_ids, torch.from_numpy(logits.copy())).numpy()
        before = np.isfinite(through(hf_warpers(temperature, **{k: v for k, v in options.items() if k in
                                                                ("top_k", "top_p", "min_p")}),
                                     no_ids, torch.from_numpy(logits.copy())).numpy()).sum()
        removed += before - np.isfinite(expected).sum()
        ours = np.asarray(_controls.filtered(jnp.asarray(logits), temperature, **options))
        np.testing.assert_array_equal(np.isfinite(ours), np.isfinite(expected))
        kept = np.isfinite(expected)
        np.testing.assert_allclose(ours[kept], expected[kept], rtol=0, atol=1e-6 * np.abs(expected[kept]).max())
    assert removed > 0  # the new warpers removed tokens the others kept


def test_exponential_decay_record_equals_hf_processor():
    rng = np.random.default_rng(1)
    prompt, eos = 5, [3, 7, 3]  # an EOS id listed twice is raised once
    logits = (rng.normal(size=(4, 12)) * 4).astype(np.float32)
    logits[1, 7] = -np.inf  # a removed EOS stays removed
    logits[2, 3] = 0.0
    # one program for every record and step (the records' fields and t are its arguments)
    apply = jax.jit(lambda record, x, t: record.apply(x, None, _controls.Now(None, t, None)))  # pyright: ignore
    for start, factor in [(0, 1.5), (2, 1.1), (3, 0.8), (0, 3.0)]:
        hf = ExponentialDecayLengthPenalty((start, factor), eos, prompt)
        record = _controls.ExponentialDecayLengthPenalty.build(_controls.Options(
            {"exponential_decay_length_penalty": (start, factor)}, 8, tuple(eos), True))
        assert record is not None
        for t in range(8):  # new token t: HF's input_ids hold the prompt and t new tokens
            expected = hf(torch.zeros((4, prompt + t), dtype=torch.long), torch.from_numpy(logits.copy())).numpy()
            ours = np.asarray(apply(record, jax.device_put(logits), jnp.int32(t)))  # (device_put: no `stage` program)
            np.testing.assert_array_equal(np.isfinite(ours), np.isfinite(expected))
            kept = np.isfinite(expected)
            np.testing.assert_allclose(ours[kept], expected[kept], rtol=0, atol=2e-6 * np.abs(expected[kept]).max())


# ---- through generate ---------------------------------------------------------------------------------

@pytest.mark.parametrize("beams", [1, 3])
def test_exponential_decay_greedy_and_beams_equal_hf_generate(llama, beams):
    hf, model = llama
    ids, mask = left_padded()
    new = 8  # (bucket 8: its greedy program is also the two tests' below, which give scores for it)

    def hf_run(**kw):
        with torch.no_grad():
            return hf.generate(torch.from_numpy(ids).long(), attention_mask=torch.from_numpy(mask).long(),
                               max_new_tokens=new, do_sample=False, num_beams=beams, eos_token_id=EOS,
                               pad_token_id=PAD, output_scores=True, return_dict_in_generate=True, **kw)

    changed = False
    plain = hf_run().sequences.numpy()  # without the penalty: one run for the three decays
    for decay in [(1, 1.6), (3, 2.5), (0, 1.2)]:
        out = hf_run(exponential_decay_length_penalty=decay)
        seq = out.sequences.numpy()
        if beams == 1:
            expected_scores = hf.compute_transition_scores(out.sequences, out.scores, normalize_logits=True).numpy()
        else:
            expected_scores = hf.compute_transition_scores(out.sequences, out.scores, out.beam_indices).numpy()
        changed |= seq.shape != plain.shape or bool((seq != plain).any())
        tokens, scores = ft.nn.generate(model, ids, new, attention_mask=mask, num_beams=beams, eos_token_id=EOS,
                                        pad_token_id=PAD, exponential_decay_length_penalty=decay, return_scores=True)
        tokens, scores = np.asarray(tokens), np.asarray(scores)
        width = seq.shape[1]
        np.testing.assert_array_equal(tokens[:, :width], seq)
        # (HF's beam search fills with `pad_token_id or eos`: the EOS where the pad id is 0, as ours)
        assert (tokens[:, width:] == (PAD if beams == 1 or PAD else EOS)).all()
        n = expected_scores.shape[1]
        generated = seq[:, ids.shape[1]:]
        ended = np.cumsum(np.pad(generated[:, :-1] == EOS, ((0, 0), (1, 0))), axis=1) > 0  # after the row's EOS
        expected_scores = np.where(ended | ~np.isfinite(expected_scores), 0.0, expected_scores)
        np.testing.assert_allclose(np.where(ended, 0.0, scores[:, :n]), expected_scores, rtol=0,
                                   atol=logprob_atol(expected_scores, 2e-6))
        assert (generated == EOS).any()  # the penalty ends rows
    assert changed  # the option changes HF's tokens: equal tokens are not the plain loop's


def test_exponential_decay_start_past_int32_never_applies(llama):
    # before: OverflowError from np.int32 (keyword and generation_config.json); HF generates unpenalized
    hf, model = llama
    ids, mask = left_padded()
    plain = np.asarray(ft.nn.generate(model, ids, 6, attention_mask=mask, eos_token_id=EOS, pad_token_id=PAD))
    with torch.no_grad():
        expected = hf.generate(torch.from_numpy(ids).long(), attention_mask=torch.from_numpy(mask).long(),
                               max_new_tokens=6, do_sample=False, eos_token_id=EOS, pad_token_id=PAD,
                               exponential_decay_length_penalty=(2**40, 1.5)).numpy()
    np.testing.assert_array_equal(plain[:, :expected.shape[1]], expected)
    for start in (2**31 - 1, 2**31, 2**40):  # (with scores: the program of the test above, 6 new tokens in bucket 8)
        tokens, _ = ft.nn.generate(model, ids, 6, attention_mask=mask, eos_token_id=EOS, pad_token_id=PAD,
                                   exponential_decay_length_penalty=(start, 1.5), return_scores=True)
        np.testing.assert_array_equal(np.asarray(tokens), plain)
        hf_config = _HFConfigWith({}, {"exponential_decay_length_penalty": [start, 1.5], "eos_token_id": EOS,
                                       "pad_token_id": PAD})
        np.testing.assert_array_equal(
            np.asarray(ft.nn.generate(_WithConfig(model, hf_config), ids, 6, attention_mask=mask)), plain)


SAMPLED = [(0.9, {"typical_p": 0.5}), (1.3, {"epsilon_cutoff": 0.03}), (0.8, {"eta_cutoff": 0.05}),
           (1.0, {"top_p": 0.95, "min_p": 0.02, "typical_p": 0.9, "epsilon_cutoff": 0.01, "eta_cutoff": 0.01})]


@pytest.mark.parametrize(("temperature", "options"), SAMPLED)
def test_sampled_scores_are_hf_warped_log_probabilities(sharp, temperature, options):
    """Sampling with the new warpers: every token lies in HF's kept set (HF's warpers with its
    default top_k=50 on the teacher-forced logits), its score is HF's log_softmax there."""
    hf, model = sharp
    ids, mask = left_padded()
    new = 6
    warpers = hf_warpers(temperature, top_k=50, **options)
    removed = 0
    for seed in range(3):
        tokens, scores = ft.nn.generate(model, ids, new, attention_mask=mask, temperature=temperature,
                                        top_k=50, key=jax.random.key(seed), return_scores=True, eos_token_id=[],
                                        **options)
        tokens, scores = np.array(tokens), np.asarray(scores)  # a writable copy for torch
        with torch.no_grad():
            logits = hf(torch.from_numpy(tokens).long(), attention_mask=torch.from_numpy(
                np.pad(mask, ((0, 0), (0, new)), constant_values=1)).long()).logits.float()
        for t in range(new):
            at = ids.shape[1] + t
            warped = through(warpers, torch.from_numpy(tokens[:, :at]).long(), logits[:, at - 1].clone())
            removed += int((~torch.isfinite(warped)).sum()) - int((~torch.isfinite(logits[:, at - 1])).sum())
            expected = torch.log_softmax(warped, -1).numpy()[np.arange(len(tokens)), tokens[:, at]]
            # (a rare CI failure here was jit's cache running another control's loop: tests/test_tree.py)
            assert np.isfinite(expected).all(), "a sampled token outside HF's kept set"
            np.testing.assert_allclose(scores[:, t], expected, rtol=0, atol=logprob_atol(expected, 2e-6))
    assert removed > 0


def test_a_checkpoint_with_the_new_controls_applies_them_without_a_warning(llama):
    """generation_config.json's typical_p, epsilon/eta cutoffs and decay: applied as the
    explicit options are, and no "does not apply" warning (UNSUPPORTED listed them)."""
    hf, model = llama
    ids, mask = left_padded()
    saved = hf.generation_config
    options = dict(temperature=0.9, typical_p=0.7, epsilon_cutoff=0.01, eta_cutoff=0.02,
                   exponential_decay_length_penalty=(2, 1.5))
    try:
        hf.generation_config = transformers.GenerationConfig(do_sample=True, eos_token_id=EOS, pad_token_id=PAD,
                                                             **options)
        ours = ft.nn.from_hf(hf)
    finally:
        hf.generation_config = saved
    key = jax.random.key(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        defaults = ft.nn.generate(ours, ids, 8, attention_mask=mask, key=key)
        greedy = ft.nn.generate(ours, ids, 8, attention_mask=mask, temperature=0.0)  # the warpers do not apply
    explicit = ft.nn.generate(model, ids, 8, attention_mask=mask, key=key, top_k=50, eos_token_id=EOS,
                              pad_token_id=PAD, **options)
    np.testing.assert_array_equal(defaults, explicit)
    explicit_greedy, _ = ft.nn.generate(model, ids, 8, attention_mask=mask, eos_token_id=EOS, pad_token_id=PAD,
                                        exponential_decay_length_penalty=(2, 1.5), return_scores=True)  # (scores:
    np.testing.assert_array_equal(greedy, explicit_greedy)  # test_exponential_decay_greedy_and_beams_...'s program)
    assert (np.asarray(defaults) != np.asarray(ft.nn.generate(model, ids, 8, attention_mask=mask, key=key, top_k=50,
                                                              eos_token_id=EOS, pad_token_id=PAD,
                                                              temperature=0.9))).any()
    hf_config = _HFConfigWith({}, {"exponential_decay_length_penalty": [2, -1.0], "eos_token_id": EOS})
    with pytest.raises(ValueError, match=r"hf_config \(config.json / generation_config.json\) gives "
                                         r"exponential_decay_length_penalty=\[2, -1.0\]"):
        ft.nn.generate(_WithConfig(model, hf_config), ids, 4, attention_mask=mask)


class _HFConfigWith(dict):
    """A config mapping with its generation config (model.hf_config's interface), hashable."""

    def __init__(self, config, generation):
        super().__init__(config)
        self.generation = dict(generation)

    def __hash__(self):
        return id(self)


class _WithConfig(ft.Module):
    model: Any
    hf_config: Any = ft.field(static=True)

    def init_cache(self, batch_size, max_length, dtype=None):
        return self.model.init_cache(batch_size, max_length, dtype)

    def __call__(self, input_ids, **kwargs):
        return self.model(input_ids, **kwargs)


# ---- bad input ------------------------------------------------------------------------------------

def test_every_warper_is_refused_with_greedy_decoding_and_beams(llama):
    _, model = llama
    ids, _ = left_padded()
    assert set(ACTIVE) == set(_defaults.WARPER_OPTIONS), "give ACTIVE a value of the new warper's keyword"
    for name, value in ACTIVE.items():
        for beams in (1, 2):
            with pytest.raises(ValueError, match=rf"{name}= filters the tokens that sampling draws from, but "
                                                 rf"temperature=0.0 is greedy"):
                ft.nn.generate(model, ids, 4, num_beams=beams, **{name: value})
    with pytest.raises(ValueError, match=r"beam search \(num_beams=2\)(.|\n)*does not sample \(temperature=0.7, "
                                         r"top_k=50, top_p=1.0, typical_p=0.5, eta_cutoff=0.01\)"):  # HF's defaults too
        ft.nn.generate(model, ids, 4, num_beams=2, temperature=0.7, typical_p=0.5, eta_cutoff=0.01,
                       key=jax.random.key(0))
    off = ft.nn.generate(model, ids, 4, typical_p=1.0, epsilon_cutoff=0.0, eta_cutoff=0.0, top_k=0)  # off: allowed
    np.testing.assert_array_equal(off, ft.nn.generate(model, ids, 4))


@pytest.mark.parametrize("beams", [1, 2])
def test_hf_default_top_k_with_greedy_decoding_and_beams_is_taken_as_hf_takes_it(llama, beams):
    """``top_k=50`` (HF's default) without a key was refused as a sampling option; HF's greedy
    and beam generate ignore it: the tokens equal HF's with it and ours without it. Any other
    top_k is still refused, saying which values are taken."""
    hf, model = llama
    ids, mask = left_padded()
    common = dict(attention_mask=mask, eos_token_id=EOS, pad_token_id=PAD, num_beams=beams)
    tokens = np.asarray(ft.nn.generate(model, ids, 6, top_k=50, top_p=1.0, **common))
    with torch.no_grad():
        expected = hf.generate(torch.from_numpy(ids).long(), attention_mask=torch.from_numpy(mask).long(),
                               max_new_tokens=6, do_sample=False, num_beams=beams, eos_token_id=EOS,
                               pad_token_id=PAD, top_k=50, top_p=1.0).numpy()
    np.testing.assert_array_equal(tokens[:, :expected.shape[1]], expected)
    assert (tokens[:, expected.shape[1]:] == PAD).all()
    np.testing.assert_array_equal(tokens, np.asarray(ft.nn.generate(model, ids, 6, **common)))
    for value in (49, 51):
        with pytest.raises(ValueError, match=rf"top_k= filters the tokens(.|\n)*Only Hugging Face's defaults "
                                             rf"\(top_k=50, top_p=1.0\)(.|\n)*top_k={value}, key=key"):
            ft.nn.generate(model, ids, 6, top_k=value, **common)


def test_bad_values_of_the_new_controls(llama):
    _, model = llama
    ids, _ = left_padded()
    key = jax.random.key(0)
    sample = dict(temperature=1.0, key=key)
    for value in (0.0, 1.5, -0.2, "0.5", True):
        with pytest.raises(ValueError, match=r"typical_p must be a number in \(0, 1\](.|\n)*typical_p=0.9"):
            ft.nn.generate(model, ids, 4, typical_p=value, **sample)
    for name in ("epsilon_cutoff", "eta_cutoff"):
        for value in (-0.1, 1.0, "0.01", float("nan")):
            with pytest.raises(ValueError, match=rf"{name} must be a number in \[0, 1\)(.|\n)*{name}="):
                ft.nn.generate(model, ids, 4, **{name: value}, **sample)
    bad_pairs: list[Any] = [(1,), (1.5, 2.0), (-1, 1.1), (1, 0.0), (1, float("inf")), "ab", (1, "2")]
    for value in bad_pairs:
        with pytest.raises(ValueError, match=r"exponential_decay_length_penalty must be a pair \(start, factor\)"):
            ft.nn.generate(model, ids, 4, eos_token_id=EOS, exponential_decay_length_penalty=value)
    with pytest.raises(ValueError, match=r"exponential_decay_length_penalty=\(2, 1.5\) raises the EOS ids' scores "
                                         r"after 2 new tokens, but no eos_token_id is given"):
        ft.nn.generate(model, ids, 4, eos_token_id=[], exponential_decay_length_penalty=(2, 1.5))


# ---- a control is one record ------------------------------------------------------------------------

@_controls.record()
@dataclass(frozen=True)
class Fancy(_controls.Control):
    """A record whose keyword generate does not have."""

    keywords = ("fancy_p",)

    @classmethod
    def build(cls, o):
        return None


def test_every_records_keyword_is_generates_and_a_missing_one_names_the_record():
    _generate.check_keywords(ft.nn.generate, _controls.CONTROLS)  # what the import ran
    with pytest.raises(TypeError, match=r"Fancy \(test_generation_controls\) reads generate's keyword 'fancy_p', "
                                        r"which generate's signature lacks(.|\n)*fancy_p: <type> \| None = None"):
        _generate.check_keywords(ft.nn.generate, (*_controls.CONTROLS, Fancy))

    def positional(fancy_p=None):
        """``fancy_p``: documented."""

    def undocumented(*, fancy_p=None):
        """Not named here."""

    with pytest.raises(TypeError, match=r"Fancy (.|\n)*signature lacks \(a keyword-only parameter, default None\)"):
        _generate.check_keywords(positional, (Fancy,))
    with pytest.raises(TypeError, match=r"which generate's docstring does not name \(as ``fancy_p``\)"):
        _generate.check_keywords(undocumented, (Fancy,))
    undocumented.__doc__ = None  # python -OO: no docstrings to check
    _generate.check_keywords(undocumented, (Fancy,))
    parameters = inspect.signature(ft.nn.generate).parameters
    assert all(parameters[k].default is None for k in _controls.keywords())


def test_a_records_keyword_is_a_checkpoint_option_never_warned_about():
    assert set(_controls.keywords()) <= set(_defaults.SUPPORTED)
    assert not set(_defaults.UNSUPPORTED) & set(_defaults.SUPPORTED)
    assert {"typical_p", "epsilon_cutoff", "eta_cutoff", "exponential_decay_length_penalty"} <= set(
        _defaults.HF_OPTIONS) - set(_defaults.UNSUPPORTED)
    assert "encoder_repetition_penalty" in _defaults.UNSUPPORTED  # what HF applies and generate does not: still named


def test_filtered_applies_every_warper_it_is_given():
    # the shape and top_k of test_new_warpers_equal_hf_logits_warpers' last case: its eager programs
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(8, 100)).astype(np.float32) * 3)
    four = _controls.filtered(logits, 1.0, top_k=40, top_p=0.999, min_p=0.001)
    five = _controls.filtered(logits, 1.0, top_k=40, top_p=0.999, min_p=0.001, typical_p=0.3)
    assert int(jnp.isfinite(five).sum()) < int(jnp.isfinite(four).sum())  # the 5th warper was dropped before
    with pytest.raises(TypeError, match=r"filtered: \['typicl_p'\] are not warpers' keywords"):
        _controls.filtered(logits, 1.0, typicl_p=0.3)


@pytest.mark.parametrize("options", [{"typical_p": 0.5}, {"eta_cutoff": 0.05}, {"epsilon_cutoff": 0.01},
                                     {"min_p": 0.05}, {"top_p": 0.9}])
def test_warpers_compute_no_nan_after_removed_tokens(options):
    """Every op of a warper after top_k removed tokens (``-inf``) is NaN-free, taken branch or
    not: the entropy's ``where(p > 0, log p * p, 0)`` computed ``-inf * 0`` before (a CI CPU
    then saw eta's cutoff at ``e`` itself: a first-step score of -0.745 for HF's -2.19).
    ``jax_debug_nans`` checks each op eagerly. The values: HF's warpers."""
    logits = np.random.default_rng(1).normal(size=(3, 40)).astype(np.float32) * 3
    with jax.disable_jit(), jax.debug_nans(True):
        ours = np.asarray(_controls.filtered(jnp.asarray(logits), 0.8, top_k=25, **options))
    expected = through(hf_warpers(0.8, top_k=25, **options), None, torch.from_numpy(logits)).numpy()
    np.testing.assert_array_equal(np.isfinite(ours), np.isfinite(expected))
    kept = np.isfinite(expected)
    np.testing.assert_allclose(ours[kept], expected[kept], rtol=0, atol=1e-6 * np.abs(expected[kept]).max())
    _, _, entropy = _controls._distribution(jax.device_put(expected))  # (device_put: no `stage` program)
    p = torch.softmax(torch.from_numpy(expected), -1)
    hf_entropy = torch.distributions.Categorical(probs=p).entropy().numpy()
    np.testing.assert_allclose(np.asarray(entropy)[:, 0], hf_entropy, rtol=0, atol=1e-5 * hf_entropy.max())


# filtered as one program a shape and top_p (op by op, eagerly: 69 programs compiled here)
_top_p = jax.jit(_controls.filtered, static_argnames=("temperature", "top_p"))


def test_top_p_keeps_hf_tokens_at_ties():
    """top_p with tied logits keeps exactly HF's tokens (the smallest set, ties in HF's sort
    order): a score threshold kept every token tied with the cut (3 of [0.5, 0.25, 0.25] at
    0.75 for HF's 2; on bf16 logits of 32000 tokens 15 extra tokens a row at top_p=0.9)."""
    # the three rows as one batch (the rule is per row, HF's too): one shape of eager programs,
    # not two; the first row's 4th token is one an earlier control removed (-inf: probability 0)
    with np.errstate(divide="ignore"):
        rows = np.log(np.array([[0.5, 0.25, 0.25, 0.0], [0.25] * 4, [0.1, 0.3, 0.3, 0.3]])).astype(np.float32)
    for top_p in (0.3, 0.5, 0.6, 0.75, 0.9):
        ours = np.asarray(_top_p(jax.device_put(rows), 1.0, top_p=top_p))  # (device_put: no `stage` program)
        expected = TopPLogitsWarper(top_p)(None, torch.from_numpy(rows)).numpy()
        np.testing.assert_array_equal(np.isfinite(ours), np.isfinite(expected), err_msg=f"top_p {top_p}")
    # 4 rows (each a row of its own: the rule is per row; 64, then 16 before) keep XLA's sort
    # of 32000-token rows, most of the test's time, short; row 2 has tokens tied with the cut
    # at every top_p below (2, 7 and 11 of them), as the last assertion checks
    coarse = np.asarray(jax.random.normal(jax.random.key(3), (4, 32000)).astype(jnp.bfloat16).astype(jnp.float32)) * 4
    for top_p in (0.5, 0.9, 0.95):
        ours = np.asarray(_top_p(jax.device_put(coarse), 1.0, top_p=top_p))
        expected = TopPLogitsWarper(top_p)(None, torch.from_numpy(coarse)).numpy()
        # torch.sort is not stable on a long row: which of the tied tokens at the cut HF keeps
        # is its sort's; how many, and so the kept mass, is the rule's
        np.testing.assert_array_equal(np.isfinite(ours).sum(-1), np.isfinite(expected).sum(-1))
        kept = np.where(np.isfinite(ours), coarse, -np.inf)
        hf_kept = np.where(np.isfinite(expected), coarse, -np.inf)
        np.testing.assert_array_equal(np.sort(kept, -1), np.sort(hf_kept, -1))
        cut = np.where(np.isfinite(expected), coarse, np.inf).min(-1, keepdims=True)  # the least kept logit
        assert ((coarse >= cut) & np.isinf(hf_kept)).any()  # ties at the cut: a threshold keeps more


def test_the_guides_table_lists_every_control():
    rows = [line for line in GUIDE.read_text().splitlines() if line.startswith("| `")]
    for control in _controls.CONTROLS:
        row = next((r for r in rows if f"`{control.__name__}`" in r), None)
        assert row is not None, f"docs/guides/generation.md: the table of controls has no row for {control.__name__}"
        assert all(f"`{k}" in row for k in control.keywords), (control.__name__, row)
    order = [re.search(r"`(\w+)`", r).group(1) for r in rows if re.search(r"`(\w+)`", r)]  # pyright: ignore
    named = [n for n in order if n in {c.__name__ for c in _controls.CONTROLS}]
    assert named == [c.__name__ for c in _controls.CONTROLS]  # in CONTROLS' order


# ---- the audit against transformers 5's generate (each test failed before its fix) ---------------

GAPPED = np.array([[5, 6, 7, 8, 9, 11], [12, 13, 14, 15, 16, 17]], np.int32)
GAPPED_MASK = np.array([[1, 0, 0, 0, 0, 1], [0, 1, 0, 0, 1, 1]], np.int32)  # zeros after a real token


@pytest.fixture(scope="module")
def sharp4():
    """lm_head * 4 (built once: both beam cases read it, neither changes it)."""
    return tiny_llama(4.0)


@pytest.mark.parametrize("beams", [1, 2])
def test_repetition_penalty_counts_masked_tokens_after_the_first_real_one_as_hf(sharp4, beams):
    """HF's repetition penalty skips each row's tokens before its first real one (the left
    padding: ``attention_mask``'s first 1) and counts every later token, masked or not.
    ft.nn.generate counted only the real (mask 1) ones: with a 0 after a real token (a mask
    HF and ft.nn.generate accept, or one inferred from a pad id inside the prompt) its tokens
    differed, silently (row 0 at 0.01: 40 40 11 40 where HF gives 8 6 8 6)."""
    hf, model = sharp4
    for penalty in (0.01, 100.0):
        extra = {} if beams == 1 else {"num_beams": beams}
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = hf.generate(torch.from_numpy(GAPPED.astype(np.int64)), attention_mask=torch.from_numpy(
                GAPPED_MASK.astype(np.int64)), max_new_tokens=4, do_sample=False, repetition_penalty=penalty,
                eos_token_id=EOS, **extra)
        expected = out.numpy()[:, GAPPED.shape[1]:]
        ours = np.asarray(ft.nn.generate(model, GAPPED, 4, attention_mask=GAPPED_MASK, repetition_penalty=penalty,
                                         eos_token_id=EOS, **extra))[:, GAPPED.shape[1]:]
        np.testing.assert_array_equal(ours[:, :expected.shape[1]], expected, err_msg=f"penalty {penalty}")


@pytest.mark.parametrize("key", [None, jax.random.key(0)], ids=["no key", "key"])
def test_a_checkpoint_sampling_at_temperature_zero_is_refused_as_hf_refuses_it(llama, key):
    """generation_config.json's do_sample=True with temperature=0.0: HF's generate raises (its
    TemperatureLogitsWarper takes only a temperature > 0); ft.nn.generate decoded greedily
    (with a key) or asked for a key, silently another decoding than the checkpoint's. An
    explicit temperature still wins."""
    _, model = llama
    ids, mask = left_padded()
    hf_config = _HFConfigWith({}, {"do_sample": True, "temperature": 0.0, "eos_token_id": EOS})
    with pytest.raises(ValueError, match=r"sets do_sample=True with temperature=0.0") as error:
        ft.nn.generate(_WithConfig(model, hf_config), ids, 4, attention_mask=mask, key=key)
    assert "right:  ft.nn.generate(model, input_ids, 32, temperature=0.0)" in str(error.value)
    greedy = ft.nn.generate(model, ids, 4, attention_mask=mask, eos_token_id=EOS)
    np.testing.assert_array_equal(ft.nn.generate(_WithConfig(model, hf_config), ids, 4, attention_mask=mask,
                                                 temperature=0.0), greedy)


@pytest.mark.parametrize("key", [None, jax.random.key(0)], ids=["no key", "key"])
def test_a_checkpoint_sampling_beams_is_named_as_beam_sampling(llama, key):
    """generation_config.json's do_sample=True with num_beams=2 is HF's beam-search sampling,
    which ft.nn.generate does not do: it was refused as the checkpoint's "temperature=1.0,
    which is not a valid temperature" (a value the file never held: HF's global default),
    or asked for a key that then met that error. Both options are named with the two
    decodings to choose from; the beam search it names equals HF's."""
    hf, model = llama
    ids, mask = left_padded()
    hf_config = _HFConfigWith({}, {"do_sample": True, "num_beams": 2, "eos_token_id": EOS})
    with pytest.raises(ValueError) as error:
        ft.nn.generate(_WithConfig(model, hf_config), ids, 4, attention_mask=mask, key=key)
    assert str(error.value) == _generate.CHECKPOINT_BEAM_SAMPLES.format(beams=2, whose="the checkpoint's",
                                                                        call="" if key is None else ", key=key")
    with pytest.raises(ValueError, match=r"with num_beams=3 \(given to generate\)"):
        ft.nn.generate(_WithConfig(model, hf_config), ids, 4, attention_mask=mask, num_beams=3, key=key)
    beams = ft.nn.generate(_WithConfig(model, hf_config), ids, 4, attention_mask=mask, num_beams=2, temperature=0.0)
    with torch.no_grad():
        expected = hf.generate(torch.from_numpy(ids).long(), attention_mask=torch.from_numpy(mask).long(),
                               max_new_tokens=4, do_sample=False, num_beams=2, eos_token_id=EOS)
    np.testing.assert_array_equal(np.asarray(beams)[:, :expected.shape[1]], expected.numpy())
    sampled = ft.nn.generate(_WithConfig(model, hf_config), ids, 4, attention_mask=mask, num_beams=1,
                             key=jax.random.key(0))
    assert np.asarray(sampled).shape == (ids.shape[0], ids.shape[1] + 4)


def test_top_p_zero_keeps_the_most_likely_token_as_hf(llama):
    """top_p=0.0 is HF's too (TopPLogitsWarper takes [0, 1]): only the most likely token is
    kept, so sampling at top_p=0 gives HF's greedy tokens; it was refused as outside (0, 1]."""
    # [8, 100]: test_new_warpers_equal_hf_logits_warpers' shape, whose last case ran top_p's eager programs
    x = np.array(jax.random.normal(jax.random.key(5), (8, 100)) * 3, np.float32)
    ours = np.asarray(_controls.filtered(jnp.asarray(x), 1.0, top_p=0.0))
    expected = TopPLogitsWarper(0.0)(None, torch.from_numpy(x)).numpy()
    np.testing.assert_array_equal(np.isfinite(ours), np.isfinite(expected))
    assert (np.isfinite(ours).sum(-1) == 1).all()
    hf, model = llama
    ids, mask = left_padded()
    greedy = hf.generate(torch.from_numpy(ids).long(), attention_mask=torch.from_numpy(mask).long(),
                         max_new_tokens=5, do_sample=False, pad_token_id=PAD, eos_token_id=EOS).numpy()
    sampled = ft.nn.generate(model, ids, 5, attention_mask=mask, temperature=1.0, top_p=0.0, key=jax.random.key(1),
                             eos_token_id=EOS, pad_token_id=PAD)
    np.testing.assert_array_equal(np.asarray(sampled), greedy)
