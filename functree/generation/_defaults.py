"""A checkpoint's generation defaults: what Hugging Face's ``generate`` applies when its caller
passes nothing.

HF's ``model.generate(ids)`` takes each option from, in order: the caller's argument, the
model's ``generation_config`` (``generation_config.json`` alone, none of config.json's values
mixed in; only without that file, the generation values of ``config.json``), then HF's global
defaults (``GenerationConfig._get_default_generation_params``:
``do_sample=False``, ``temperature=1.0``, ``top_k=50``, ``top_p=1.0`` ...). A model ported by
``ft.nn.from_hf`` carries both files as ``model.hf_config`` (a mapping of config.json's values,
with generation_config.json's as ``model.hf_config.generation``); :func:`checkpoint_defaults`
reads the options ``ft.nn.generate`` supports from it, once per config object.
"""

from __future__ import annotations

import difflib
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from functree.generation._controls import (
    SAMPLING_DEFAULTS as SAMPLING_DEFAULTS,  # re-exported (_generate)
)
from functree.generation._controls import keywords

# The options of ``ft.nn.generate`` that HF's generation config sets, by HF's name (a logits
# control's keywords are its checkpoint names).
SUPPORTED = ("eos_token_id", "pad_token_id", "do_sample", *keywords(),
             "num_beams", "num_return_sequences", "length_penalty", "early_stopping")

# The sampling-only options (HF's warpers, temperature aside: it decides greedy or sampling).
WARPER_OPTIONS = tuple(k for k in keywords(warper=True) if k != "temperature")

# HF's global defaults of the sampling options (applied when neither the caller nor the file sets
# them) are SAMPLING_DEFAULTS, imported above from the records, which accept them with greedy decoding.

# The options of HF's generation config that change its tokens, with the value at which they
# do nothing (HF's GenerationConfig defaults).
HF_OPTIONS = {"min_length": 0, "typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0,
              "forced_bos_token_id": None, "forced_eos_token_id": None, "begin_suppress_tokens": None,
              "exponential_decay_length_penalty": None, "sequence_bias": None, "num_beam_groups": 1,
              "diversity_penalty": 0.0, "penalty_alpha": None, "encoder_repetition_penalty": 1.0,
              "encoder_no_repeat_ngram_size": 0,  # (HF applies both encoder_* to a decoder-only prompt)
              "guidance_scale": None, "stop_strings": None, "top_h": None,
              # HF's InfNanRemoveLogitsProcessor: a removed token's -inf becomes float32's lowest,
              # which exponential_decay_length_penalty raises to +inf (EOS before min_new_tokens)
              "remove_invalid_values": False,
              # HF runs these through remote code or a tokenizer (watermarking biases the logits;
              # constraints, force_words_ids and dola_layers pick another decoding method;
              # token_healing rewrites the prompt's last token): a checkpoint's value is named too
              "watermarking_config": None, "constraints": None, "force_words_ids": None, "dola_layers": None,
              "token_healing": False}

# Those ft.nn.generate does not have (named in a warning when a checkpoint sets them): derived,
# so that a control's record, once in CONTROLS, is never named here as unapplied.
UNSUPPORTED = {k: off for k, off in HF_OPTIONS.items() if k not in SUPPORTED}

UNAPPLIED = """\
generate: the model's generation config (hf_config.generation, from generation_config.json) sets \
{options}, which Hugging Face's generate applies and ft.nn.generate does not: its tokens may \
differ from HF's. Pass the options you want explicitly to silence this:

    right:  ft.nn.generate(model, input_ids, 32, eos_token_id=eos)      # what HF's defaults would not change"""

BAD_CHECKPOINT_VALUE = """\
generate: the model's hf_config (config.json / generation_config.json) gives {name}={value!r}, \
which is not a valid {name}: {reason}

    right:  ft.nn.generate(model, input_ids, 32, {name}=...)    # an explicit argument wins"""

CHECKPOINT_EOS_OUTSIDE = """\
generate: the model's hf_config (config.json / generation_config.json) gives eos_token_id \
{ids}, which lie outside its vocabulary ({vocab} tokens: 0 to {last}): no row can end on them, \
so they are dropped and rows end on {kept}, as Hugging Face's generate does (a GPT2Config's \
default eos 50256 on a smaller vocabulary). Pass the EOS you mean to silence this:

    right:  ft.nn.generate(model, input_ids, 32, eos_token_id=[])      # no EOS: every row runs to the end
    right:  ft.nn.generate(model, input_ids, 32, eos_token_id={example})      # an id of the vocabulary"""


class CheckpointEosWarning(UserWarning):
    """The checkpoint's default ``eos_token_id`` holds ids outside the model's vocabulary
    (dropped: HF's ``generate`` never emits them either)."""


def warn_eos_outside(outside: Sequence[int], kept: Sequence[int], vocab: int) -> None:
    """Warn :class:`CheckpointEosWarning` for the checkpoint's EOS ids ``outside`` the vocabulary."""
    ends = f"eos_token_id {list(kept)}" if kept else "no EOS (every row runs max_new_tokens)"
    warnings.warn(CHECKPOINT_EOS_OUTSIDE.format(ids=list(outside), vocab=vocab, last=vocab - 1, kept=ends,
                                                example=[vocab - 1]), CheckpointEosWarning, stacklevel=5)


# id(hf_config) -> (hf_config, defaults): the object is kept, so its id is not reused.
_CACHE: dict[int, tuple[Any, dict[str, Any]]] = {}


def checkpoint_defaults(model: Any) -> dict[str, Any] | None:
    """The generation options ``model.hf_config`` sets (HF's names; None for a model without
    ``hf_config``), read once per config object, as HF's ``from_pretrained`` reads them: from
    generation_config.json alone when the checkpoint has one (an HF model's
    ``generation_config`` for ``from_hf(hf_model)``), else from config.json (HF's
    ``GenerationConfig.from_model_config``); a None value is unset."""
    config = getattr(model, "hf_config", None)
    if not isinstance(config, Mapping):
        return None
    found = _CACHE.get(id(config))
    if found is not None and found[0] is config:
        return found[1]
    generation = getattr(config, "generation", None)
    generation = generation if isinstance(generation, Mapping) else {}
    # HF reads generation_config.json alone when there is one (a key it lacks is unset, never
    # config.json's: eos 38 in config.json does not end rows), an empty one too; config.json
    # only without one.
    source = generation if getattr(config, "has_generation", len(generation) > 0) else config
    defaults = {name: source[name] for name in SUPPORTED if source.get(name) is not None}
    _warn_unapplied(generation)
    if len(_CACHE) > 64:  # a long session of ported models: keep the table small
        _CACHE.clear()
    _CACHE[id(config)] = (config, defaults)
    return defaults


def _warn_unapplied(generation: Mapping[str, Any]) -> None:
    unapplied = {k: generation[k] for k, off in UNSUPPORTED.items()
                 if generation.get(k) is not None and generation.get(k) != off}
    if unapplied:
        options = ", ".join(f"{k}={v!r}" for k, v in unapplied.items())
        warnings.warn(UNAPPLIED.format(options=options), UserWarning, stacklevel=4)


def bad_value(name: str, value: Any, error: Exception) -> ValueError:
    """The error for a checkpoint's ``value`` of ``name`` that ``generate``'s check refused
    with ``error`` (whose first line says why)."""
    reason = str(error).split("\n")[0].removeprefix("generate: ")
    return ValueError(BAD_CHECKPOINT_VALUE.format(name=name, value=value, reason=reason))


INFERRED_RIGHT_PADDED = """\
generate: row {row} of input_ids ends in pad_token_id {pad}. Without attention_mask=, the mask \
is inferred from the pad id, as Hugging Face's generate does for this checkpoint, and new tokens \
must follow a real token: pad on the left, or pass the mask.

    wrong:  ft.nn.generate(model, [[5, 6, {pad}, {pad}]], 8)                  # right-padded
    right:  ft.nn.generate(model, [[{pad}, {pad}, 5, 6]], 8)                  # left-padded
    right:  ft.nn.generate(model, ids, 8, attention_mask=ids_mask)"""


def inferred_mask(ids: Any, pad: Any, eos: Any) -> Any:
    """Hugging Face's attention mask for a prompt given without one: ``ids != pad`` where the
    prompt holds the pad id and the pad id is no EOS id, else None (all tokens real). Concrete
    ids only (a traced prompt keeps all its tokens)."""
    if not isinstance(pad, (int, np.integer)) or isinstance(pad, bool):
        return None
    eos_ids = (eos,) if isinstance(eos, (int, np.integer)) else tuple(eos or ())
    if pad in eos_ids:
        return None
    try:
        values = np.asarray(ids)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None
    if not (values == pad).any():
        return None
    mask = (values != pad).astype(np.int32)
    if not mask[:, -1].all():
        raise ValueError(INFERRED_RIGHT_PADDED.format(row=int(np.argmin(mask[:, -1])), pad=pad))
    return mask


# Hugging Face's generate() keywords that functree spells otherwise: the call to write here.
_CALL = "ft.nn.generate(model, input_ids, max_new_tokens, {})"
HF_SPELLINGS = {
    # (a key alone samples only where the checkpoint sets do_sample=True: greedy elsewhere)
    "do_sample": (_CALL.format("temperature=1.0, key=jax.random.key(0)"), "temperature > 0 samples; 0.0 is greedy"),
    "output_scores": (_CALL.format("return_scores=True"), "returns (tokens, scores)"),
    "return_dict_in_generate": (_CALL.format("return_scores=True"), "returns (tokens, scores), not a dict"),
    "output_logits": (_CALL.format("return_scores=True"), "the chosen tokens' log-probabilities"),
    "max_length": ("ft.nn.generate(model, input_ids, max_length - input_ids.shape[1])", "new tokens, not the total"),
    "generation_config": (_CALL.format("top_k=..., top_p=..."), "the checkpoint's generation config applies already"),
    "use_cache": ("ft.nn.generate(model, input_ids, max_new_tokens)", "generate always runs with its KV cache"),
}

UNKNOWN_OPTION = """\
ft.nn.generate() got an unexpected keyword argument {name!r}{why}.

    wrong:  ft.nn.generate(model, input_ids, max_new_tokens, {name}=...)
    right:  {right}"""


def unknown_option(options: dict[str, Any], known: Sequence[str]) -> TypeError:
    """The error for ``generate``'s first keyword it does not have: Hugging Face's spelling
    (:data:`HF_SPELLINGS`), an HF option it does not apply, or a typo's closest name."""
    name = next(iter(options))
    if name in HF_SPELLINGS:
        call, note = HF_SPELLINGS[name]
        if name == "do_sample" and not options[name]:  # do_sample=False: greedy, the default
            call, note = _CALL.format("temperature=0.0"), "greedy (the default, unless the checkpoint sets do_sample=True)"
        return TypeError(UNKNOWN_OPTION.format(name=name, why=" (Hugging Face's name)", right=f"{call}   # {note}"))
    if name in UNSUPPORTED:
        return TypeError(UNKNOWN_OPTION.format(
            name=name, why=" (Hugging Face's generate applies it; ft.nn.generate does not have it)",
            right=_CALL.format("...") + "   # without it"))
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    if close:
        return TypeError(UNKNOWN_OPTION.format(name=name, why=f" (did you mean {close[0]!r}?)",
                                               right=_CALL.format(f"{close[0]}=...")))
    return TypeError(UNKNOWN_OPTION.format(name=name, why="", right=_CALL.format("...") + "   # help(ft.nn.generate)"))
