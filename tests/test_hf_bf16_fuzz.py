"""``ft.nn.from_hf(directory, dtype=bfloat16 / float16)`` against transformers' own model
loaded in that dtype, for the thirteen families, from drawn configs with random weights.

16-bit logits cannot be compared at float32's tolerance: each library rounds its own sums.
Both are measured against the float32 reference (HF's float32 model of the same file; the
float32 ports equal it to 1e-6, ``test_hf_config_fuzz``), over the real tokens of a batch with
a padded row, by two measures of ``d = x - HF32`` in units of ``1 + max|HF32|``: the root mean
square ``rms(x)`` (over every real logit: the steadier measure) and the largest ``err(x) =
max|d|`` (one token's). HF's own 16-bit errors are what the dtype costs in the reference
implementation; functree's must stay within :data:`RMS_MARGIN` times HF's root mean square
and :data:`MAX_MARGIN` times HF's largest (:func:`check`).

Also: the logits' dtype is the parameters' (HF's: no upcast); the parts HF keeps in float32
stay float32 in functree's program (norm statistics, the attention softmax, the rotary
angles); the 16-bit weights a directory holds round-trip through ``from_hf`` and
``ft.nn.save_hf`` bit for bit, readable by HF.
"""

from __future__ import annotations

import copy
import os
import sys
import tempfile
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _hypothesis import examples
from _jaxpr import equations
from hypothesis import HealthCheck, assume, currently_in_test_context, given, settings
from hypothesis import strategies as st

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from test_hf_config_fuzz import ENCODERS, STRATEGIES, _hf_model, _hf_outputs, _inputs, _port  # noqa: E402

import functree as ft  # noqa: E402

# Measured: over 269 draws (bfloat16 and float16, every family) err(FT16) / err(HF16) was at
# most 1.89 (GPT-2, bfloat16; the median 1.0: both errors are mostly the logits' own last
# rounding) and err(HF16) at least 2.3e-4 (Qwen3 and OLMo2, added later: 49 draws, at most
# 1.94). (Norm statistics summed in 16 bits moved the worst ratio only to 2.4 over 48 draws:
# the float32 parts are checked in the program itself, test_what_hf_keeps_in_float32_stays_float32.)
# The largest difference is one token's, and each library's error a handful of rounding events
# amplified: the ratio of the two is wide-tailed where the attention amplifies the rounding of
# q and k. A 1-layer float16 Granite of attention_multiplier 1 (one head of 32: logits sqrt(32)
# times Llama's) measured err(FT16) / err(HF16) 4.15 and rms 2.12 (the explore profile's draw,
# test_a_granite_draw_where_hf_rounds_luckier), though functree rounds less than HF (RMSNorm's
# output once, HF twice; the rotation in float32, HF's in 16 bits; the attention logits and
# weights in float32, HF's rounded to 16 bits): HF's three roundings put into functree give
# HF's logits (ratios 1.00 and 1.07 on that draw), and over 20 other seeds of that model the
# ratios' geometric means were 0.95 and 0.94 (functree the closer as often as not), worst 2.88
# and 2.13. GPT-2 (float16) measured 2.64 and 1.36. Over 96 fuzz draws (Granite, Llama, Qwen3,
# GPT-2; both dtypes), 32 of Granites with multipliers 1 and 122 seeds of two fixed Granites the
# ratios' geometric means were 0.77 to 1.12 per group; the rms ratio's tail is the narrower
# (notes/audit37/granite16/REPORT.md). Each margin is 1.3 times its measure's worst ratio.
RMS_MARGIN = 2.8
MAX_MARGIN = 5.4
DTYPES = {"bfloat16": (jnp.bfloat16, torch.bfloat16), "float16": (jnp.float16, torch.float16)}
SPREAD: list[tuple[str, str, float, float, float, float]] = []  # (family, dtype, err(HF16), err(FT16),
# rms(HF16), rms(FT16)) of each draw


def _hf_loaded(model_type, directory, dtype):
    cls = transformers.AutoModel if model_type in ENCODERS else transformers.AutoModelForCausalLM
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cls.from_pretrained(directory, dtype=dtype, attn_implementation="eager").eval()


def _assume(condition):
    """A drawn config HF cannot run (or its float16 overflows) is skipped; a fixed one must run."""
    if currently_in_test_context():
        assume(condition)
    assert condition, "a fixed example that HF cannot run or that overflows measures nothing"


def check(model_type, values, seed, dtype_name):
    """functree's 16-bit logits are within RMS_MARGIN and MAX_MARGIN of HF's 16-bit errors against HF's float32."""
    jdtype, tdtype = DTYPES[dtype_name]
    with tempfile.TemporaryDirectory() as directory:
        try:
            config = transformers.AutoConfig.for_model(model_type, **copy.deepcopy(values))
            torch.manual_seed(seed)
            _hf_model(model_type, config).save_pretrained(directory)
            ids, mask = _inputs(seed, model_type)
            reference = _hf_outputs(_hf_loaded(model_type, directory, torch.float32), model_type, ids, mask)
            theirs = _hf_outputs(_hf_loaded(model_type, directory, tdtype), model_type, ids, mask)
        except Exception:  # HF cannot build or run this config (test_hf_config_fuzz's assume)
            _assume(False)
            raise
        real = mask.astype(bool)
        scale = 1 + float(np.abs(reference[real]).max())
        _assume(np.isfinite(reference[real]).all() and scale < 1e3)
        ported = _port(directory, values)
        if ported is None:  # refused naming a key: test_hf_config_fuzz's concern
            return
        narrow = ft.nn.from_hf(directory, dtype=jdtype)
    out = narrow(ids.astype(np.int32), mask.astype(np.int32))
    assert out.dtype == jdtype, f"{model_type}: logits {out.dtype}, parameters {dtype_name} (HF's: {dtype_name})"
    ours = np.asarray(out.astype(jnp.float32))
    theirs_off, ours_off = theirs[real] - reference[real], ours[real] - reference[real]
    hf_error, error = (float(np.abs(d).max()) / scale for d in (theirs_off, ours_off))
    _assume(np.isfinite(hf_error))  # HF's float16 overflowed: nothing to measure against
    hf_rms, rms = (float(np.sqrt(np.mean(np.square(d)))) / scale for d in (theirs_off, ours_off))
    SPREAD.append((model_type, dtype_name, hf_error, error, hf_rms, rms))
    assert rms <= RMS_MARGIN * hf_rms and error <= MAX_MARGIN * hf_error, (
        f"{model_type} {dtype_name}: functree's error of 1 + max|logits| against HF's float32 {rms:.3g} (rms), "
        f"{error:.3g} (largest); HF's own {hf_rms:.3g}, {hf_error:.3g}\n{values}")


# The margins hold where the attention logits are at most MEASURED_GAIN times Llama's (Granite's
# attention_multiplier 1 with a head of 32: 5.7, the draws above). The fuzz also draws Granites
# of attention_multiplier 12 (59 times Llama's for a head of 24: the softmax all but an argmax,
# which one rounding of q or k flips). Those in bfloat16 (an 8-bit mantissa) measured, over 13
# seeds of the explore profile's draw (GRANITE_AMPLIFIED), err(FT16) / err(HF16) geometric mean
# 1.20 and rms ratio 1.08 (functree the closer on 8 of 13), yet worst 9.87 and 5.06 (seed 398)
# and 3.65 and 2.18 (seed 5): one draw's ratio is a coin toss there, no measure of functree's
# rounding; in float16 the same model measured 0.90 and 0.87, worst 1.53 and 1.07 (10 seeds),
# and multiplier 1 in bfloat16 1.30 and 1.06, worst 3.05 and 1.42 (11 seeds): both kept.
MEASURED_GAIN = 6.0


def attention_gain(model_type, values):
    """A Granite's attention logits in units of Llama's: its attention_multiplier times
    sqrt(head_dim) (Llama scales by 1 / sqrt(head_dim)); 1 for the other families."""
    if model_type != "granite":
        return 1.0
    head_dim = values.get("head_dim") or values["hidden_size"] // values["num_attention_heads"]
    return abs(values.get("attention_multiplier", 1.0)) * head_dim ** 0.5


@settings(max_examples=examples(4), deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data(), model_type=st.sampled_from(sorted(STRATEGIES)), seed=st.integers(0, 2**16),
       dtype=st.sampled_from(sorted(DTYPES)))
def test_16_bit_logits_within_hf_own_16_bit_error(data, model_type, seed, dtype):
    values = data.draw(STRATEGIES[model_type](), label=model_type)
    assume(dtype != "bfloat16" or attention_gain(model_type, values) <= MEASURED_GAIN)  # (MEASURED_GAIN)
    check(model_type, values, seed, dtype)


# The explore profile's draw (seed 184, float16) on which HF's extra roundings cancel: err(FT16)
# 4.15 times err(HF16), rms(FT16) 2.12 times rms(HF16) (see RMS_MARGIN).
GRANITE_ONES = {"vocab_size": 48, "hidden_size": 32, "intermediate_size": 8, "num_hidden_layers": 1,
                "num_attention_heads": 1, "num_key_value_heads": 1, "hidden_act": "quick_gelu", "rms_norm_eps": 1e-05,
                "max_position_embeddings": 4, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
                "pad_token_id": None, "embedding_multiplier": 1.0, "residual_multiplier": 1.0,
                "attention_multiplier": 1.0, "logits_scaling": 1.0}


# The explore profile's draw (seed 398, bfloat16) of err(FT16) 9.87 and rms(FT16) 5.06 times HF's
# own: its attention 59 times Llama's, past MEASURED_GAIN.
GRANITE_AMPLIFIED = {**GRANITE_ONES, "hidden_size": 24, "intermediate_size": 20, "rms_norm_eps": 1e-06,
                     "attention_multiplier": 12.0}


def test_the_bfloat16_fuzz_compares_within_the_measured_attention_gain():
    assert attention_gain("granite", GRANITE_ONES) <= MEASURED_GAIN < attention_gain("granite", GRANITE_AMPLIFIED)


def test_a_granite_draw_where_hf_rounds_luckier():
    """A Granite whose attention (multiplier 1, one head of 32: logits sqrt(32) times Llama's)
    amplifies the rounding of q and k: functree's largest difference from HF's float32 is 4.15
    times HF's own, past the 2.5 the bound on it alone allowed, though functree rounds less than
    HF (RMS_MARGIN's comment)."""
    check("granite", GRANITE_ONES, 184, "float16")


@pytest.fixture(scope="module", autouse=True)
def _spread():
    """The measured errors, printed when the module ends (the tolerance's measure)."""
    yield
    if SPREAD:
        ratios = [e / h for _, _, h, e, _, _ in SPREAD if h > 0]
        rms_ratios = [r / h for _, _, _, _, h, r in SPREAD if h > 0]
        print(f"\nbf16 fuzz: {len(SPREAD)} draws, err(FT16)/err(HF16) max {max(ratios, default=0):.3g}, "
              f"rms(FT16)/rms(HF16) max {max(rms_ratios, default=0):.3g}, "
              f"largest err(HF16) {max(s[2] for s in SPREAD):.3g}", file=sys.__stderr__)


# ---- fixed models: the weights' bits and the float32 parts ---------------------------------------

BERT = {"hidden_size": 32, "num_attention_heads": 4, "num_hidden_layers": 2, "intermediate_size": 64,
        "max_position_embeddings": 16}
DISTILBERT = {"dim": 32, "n_heads": 4, "n_layers": 2, "hidden_dim": 64, "max_position_embeddings": 16}


def _config(model_type):
    from test_generation_cached_fuzz import CONFIGS, VOCAB
    sizes = BERT if model_type in ("bert", "roberta", "xlm-roberta") else DISTILBERT if model_type == "distilbert" \
        else CONFIGS[model_type]
    return transformers.AutoConfig.for_model(model_type, vocab_size=VOCAB, pad_token_id=0, **sizes)


def _bits(x):
    """The bit patterns of a 16-bit array (NumPy's or torch's)."""
    if isinstance(x, torch.Tensor):
        return x.view(torch.int16).numpy()
    return np.asarray(x).view(np.int16)


@pytest.mark.parametrize("dtype_name", sorted(DTYPES))
def test_16_bit_weights_round_trip_bit_exact(dtype_name, tmp_path):
    """A float32 file read with ``from_hf(dtype=...)`` rounds each weight as torch's
    ``from_pretrained(dtype=...)`` does (to nearest, ties to even: the same bits); a 16-bit
    file is read bit for bit, and ``ft.nn.save_hf`` writes those bits back in that dtype
    (config.json's ``dtype`` too), which HF reads back unchanged. Five families of distinct
    layouts: GPT-2's transposed Conv1D and fused c_attn, Phi-3's fused qkv_proj and
    gate_up_proj, OPT, BERT, Llama's grouped-query attention."""
    import json

    jdtype, tdtype = DTYPES[dtype_name]
    for model_type in ("gpt2", "phi3", "opt", "bert", "llama"):
        wide, narrow, saved = (tmp_path / model_type / name for name in ("wide", "narrow", "saved"))
        torch.manual_seed(0)
        hf = _hf_model(model_type, _config(model_type))
        hf.save_pretrained(wide)
        hf.to(tdtype).save_pretrained(narrow)
        expected = {k: _bits(v) for k, v in _hf_loaded(model_type, wide, tdtype).state_dict().items()}
        for source in (wide, narrow):
            ported = ft.nn.from_hf(source, dtype=jdtype)
            got = ft.nn.to_hf_state_dict(ported, numpy=True)
            assert set(got) <= set(expected), (model_type, sorted(set(got) - set(expected)))
            for name, value in got.items():
                assert value.dtype == jdtype, (model_type, name, value.dtype)
                np.testing.assert_array_equal(_bits(value), expected[name], err_msg=f"{model_type} {name} from {source.name}")
        ft.nn.save_hf(ported, saved)
        assert json.loads((saved / "config.json").read_text())["dtype"] == dtype_name
        again = _hf_loaded(model_type, saved, tdtype).state_dict()
        for name, value in again.items():
            assert value.dtype == tdtype, (model_type, name)
            np.testing.assert_array_equal(_bits(value), expected[name], err_msg=f"{model_type} {name} saved")


FLOAT32_PARTS = ("exp", "log", "rsqrt", "sqrt", "sin", "cos", "reduce_sum", "reduce_max")


@pytest.mark.parametrize("model_type", sorted(STRATEGIES))
def test_what_hf_keeps_in_float32_stays_float32(model_type):
    """The bfloat16 port's program (its jaxpr, of its shapes: nothing computed): every exponential, log,
    square root, sine, cosine and floating sum or max (the softmax, the norms' statistics,
    the rotary angles) is float32, as HF's modules upcast them (its RMSNorm's variance, its
    eager softmax's ``dtype=torch.float32``, its rotary ``inv_freq``), and the attention
    logits accumulate in float32; the logits (BERT: the hidden states) are bfloat16, as HF's."""
    model = jax.eval_shape(lambda: ft.nn.from_hf(_config(model_type), key=jax.random.key(0), dtype=jnp.bfloat16))
    ids = np.ones((2, 5), np.int32)
    program = jax.make_jaxpr(lambda m, i, k: m(i, k))(model, ids, np.ones((2, 5), np.int32))
    assert [a.dtype for a in program.out_avals] == [jnp.bfloat16]
    seen, wide_dots = set(), 0
    for eqn in equations(program.jaxpr):
        name = eqn.primitive.name
        dtypes = {v.aval.dtype for v in eqn.invars if hasattr(v.aval, "dtype")}
        if name in FLOAT32_PARTS and any(jnp.issubdtype(d, jnp.floating) for d in dtypes):
            assert dtypes == {jnp.dtype(jnp.float32)}, f"{model_type}: {name} on {dtypes}\n{eqn}"
            seen.add(name)
        wide_dots += name == "dot_general" and eqn.outvars[0].aval.dtype == jnp.float32
    assert {"exp", "reduce_max", "reduce_sum"} <= seen  # the softmax and a norm, at least
    assert wide_dots >= 1  # the attention logits
