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

from functree.generation._generate import generate

__all__ = ["generate"]
