"""Text generation with a model that follows the KV-cache protocol (``init_cache``,
``prefill``, ``decode_step``: every ``ft.hf`` causal family, or your own).

:func:`generate` runs greedy decoding, sampling (temperature, top-k, top-p, min-p, typical-p,
epsilon and eta cutoffs) and beam search as one compiled loop, with Hugging Face's controls
(repetition penalty, n-gram blocking, bad words, a minimum length, an exponential decay
length penalty, suppressed tokens) and its defaults read
from the checkpoint's ``generation_config.json``. A control is one record in ``functree/generation/_controls.py``
(:data:`CONTROLS`): its validation, its state, what it does to the scores and its update
after a token; the loops in ``_decode.py`` fold over the active ones. Also ``ft.nn.generate``.
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the names below, for type checkers, editors and the API reference
    from functree.generation._generate import generate

# Each public name -> its private module, imported on first use (PEP 562): the decoding
# loops and their controls stay unimported until ``generate`` is read.
_HOMES = {
    "generate": "functree.generation._generate",
}


def __getattr__(name: str):
    """The names of ``_HOMES``: imported from their module on this first read."""
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # found once: later reads are plain module attributes
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOMES})


__all__ = ["generate"]
