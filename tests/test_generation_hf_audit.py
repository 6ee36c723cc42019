"""``ft.nn.generate`` against Hugging Face's ``generate``: the discrepancies an audit of the
generation controls found (each test failed before its fix), on a tiny random-weight Llama built
from a config (no download). Tokens are compared exactly."""

import os
import warnings

import numpy as np
import pytest

import functree as ft

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

VOCAB, EOS, PAD = 48, 2, 0


@pytest.fixture(scope="module")
def llama():
    """HF's tiny Llama (EOS 2, pad 0, lm_head * 4: sharp logits) and its port."""
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      pad_token_id=PAD, eos_token_id=EOS, bos_token_id=1)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        hf.lm_head.weight.mul_(4.0)
    return hf, ft.nn.from_hf(hf)


def hf_new_tokens(hf, ids, mask, new, **options):
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = hf.generate(torch.from_numpy(ids), attention_mask=torch.from_numpy(mask), max_new_tokens=new,
                          do_sample=False, **options)
    return out.numpy()[:, ids.shape[1]:]


def new_tokens(model, ids, mask, new, **options):
    out = ft.nn.generate(model, ids.astype(np.int32), new, attention_mask=mask.astype(np.int32), **options)
    return np.asarray(out)[:, ids.shape[1]:]


# ---- n-grams, bad words and sequence biases see the left padding's ids (HF's input_ids) ----------

PADDED = np.array([[0, 0, 0, 5], [7, 8, 9, 11]])  # row 0: one real token after three pads (id 0)
PADDED_MASK = np.array([[0, 0, 0, 1], [1, 1, 1, 1]])
# greedy's first token of row 0 is 7 (HF and ours, no option): each case bans or biases it
# through a prefix that reaches into the padding, or (n-grams) bans the pad id after a
# generated pad id (HF's n-gram (0, 0) of the padding)
PADDING_CASES = [
    dict(bad_words_ids=[[0, 5, 7]]),
    dict(sequence_bias={(0, 0, 5, 7): -20.0}),
    dict(sequence_bias={(0,): 30.0}, no_repeat_ngram_size=2),
]


@pytest.mark.parametrize("beams", [1, 2])
@pytest.mark.parametrize("options", PADDING_CASES, ids=["bad_words", "sequence_bias", "ngram"])
def test_padding_ids_count_in_ngrams_bad_words_and_sequence_bias_as_in_hf(llama, options, beams):
    """HF matches no_repeat_ngram_size's n-grams, bad_words_ids' and sequence_bias's prefixes
    against its input_ids, the left padding's pad ids included; ft.nn.generate matched the
    real tokens only, and a padded batch got other tokens than HF's, silently (row 0 here:
    7 41 7 41 where HF gives 18 21 18 21)."""
    hf, model = llama
    plain = hf_new_tokens(hf, PADDED, PADDED_MASK, 4, eos_token_id=[])
    assert plain[0, 0] == 7
    # (HF's beam search needs an EOS id: eos_token_id=[] crashes it)
    extra = {"eos_token_id": []} if beams == 1 else {"num_beams": beams, "eos_token_id": EOS}
    expected = hf_new_tokens(hf, PADDED, PADDED_MASK, 4, **options, **extra)
    if beams == 1:  # the padding's ids matter here
        unpadded = hf_new_tokens(hf, PADDED[:1, 3:], PADDED_MASK[:1, 3:], 4, **options, **extra)
        assert not np.array_equal(expected[0], unpadded[0])
    ours = new_tokens(model, PADDED, PADDED_MASK, 4, **options, **extra)
    np.testing.assert_array_equal(ours[:, :expected.shape[1]], expected)
    assert (ours[:, expected.shape[1]:] == PAD).all()  # (HF stops once every row ended; we fill)


# ---- a checkpoint's remove_invalid_values is named, not silently ignored ----------------------------

def test_a_checkpoints_remove_invalid_values_is_named_not_ignored(llama):
    """HF's remove_invalid_values=True (InfNanRemoveLogitsProcessor) turns a removed token's
    -inf into float32's lowest, which exponential_decay_length_penalty then raises to +inf:
    HF ends the row at its third token despite min_new_tokens=5. A generation config that set
    it was decoded without it and without a word; it is named in the warning now, and refused
    as a keyword (it was "unexpected keyword" with no reason)."""
    hf, _ = llama
    ids, mask = np.array([[7, 8, 9, 11]]), np.ones((1, 4), np.int64)
    options = dict(eos_token_id=EOS, min_new_tokens=5, exponential_decay_length_penalty=(0, 2.0))
    plain = hf_new_tokens(hf, ids, mask, 6, **options)
    removed = hf_new_tokens(hf, ids, mask, 6, remove_invalid_values=True, **options)
    assert removed.shape[1] == 3 and removed[0, -1] == EOS and plain.shape[1] == 6  # HF's tokens change
    saved = hf.generation_config
    hf.generation_config = transformers.GenerationConfig(eos_token_id=EOS, pad_token_id=PAD,
                                                         remove_invalid_values=True)
    try:
        ported = ft.nn.from_hf(hf)
    finally:
        hf.generation_config = saved
    with pytest.warns(UserWarning, match=r"sets remove_invalid_values=True, which Hugging Face's generate applies"):
        ft.nn.generate(ported, ids.astype(np.int32), 2)
    with pytest.raises(TypeError, match=r"'remove_invalid_values' \(Hugging Face's generate applies it; "
                                        r"ft.nn.generate does not have it\)"):
        ft.nn.generate(ported, ids.astype(np.int32), 2, remove_invalid_values=True)


# ---- beam search pads with HF's `pad_token_id or eos_token_id[0]` ---------------------------------

@pytest.mark.parametrize("pad", [0, 5, None])
def test_beam_search_fills_finished_beams_as_hf(llama, pad):
    """HF's beam search fills a finished sequence with ``pad_token_id or eos_token_id[0]``: pad
    id 0 (given, or the checkpoint's when unset) is falsy there and the EOS id fills. ft.nn.generate
    filled with 0: the returned beams' tokens after their end were 0 where HF's are the EOS."""
    hf, model = llama
    ids = np.array([[7, 8, 9, 11], [0, 3, 4, 5]])
    mask = np.array([[1, 1, 1, 1], [0, 1, 1, 1]])
    options = dict(eos_token_id=41, num_beams=2, num_return_sequences=2)
    if pad is not None:
        options["pad_token_id"] = pad
    expected = hf_new_tokens(hf, ids, mask, 6, **options)
    assert expected.shape[1] == 6 and (expected[2:, -2:] == (pad or 41)).all()  # rows 2, 3 end early
    np.testing.assert_array_equal(new_tokens(model, ids, mask, 6, **options), expected)
    greedy = {k: v for k, v in options.items() if k not in ("num_beams", "num_return_sequences")}
    ours_greedy = new_tokens(model, ids, mask, 6, **greedy)  # greedy fills with the pad id, 0 too (HF's)
    np.testing.assert_array_equal(ours_greedy[:, :hf_new_tokens(hf, ids, mask, 6, **greedy).shape[1]],
                                  hf_new_tokens(hf, ids, mask, 6, **greedy))
