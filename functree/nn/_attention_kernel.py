"""Which attention kernel runs: the one place that decides.

``implementation="auto"`` (every :class:`ft.nn.MultiheadAttention`'s default, and
``ft.nn.from_hf(..., attention="auto")``'s) picks cuDNN's flash attention on NVIDIA GPUs
where it applies and XLA's attention everywhere else; ``"xla"`` and ``"cudnn"`` force one.
The choice is made while tracing (shapes and dtypes are static), so it costs nothing per step.

cuDNN's fused kernel (``jax.nn.dot_product_attention(implementation="cudnn")``) applies when
all of these hold; ``"auto"`` checks them and uses XLA where one fails, ``"cudnn"`` raises an
error naming the one that failed:

* the device is an NVIDIA GPU of compute capability 8.0 or newer (Ampere, Hopper, Blackwell);
* queries, keys and values are float16 or bfloat16 (cuDNN has no float32 flash attention: a
  float32 model gets it under bf16 compute, ``ft.nn.from_hf(..., dtype=jnp.bfloat16)``);
* the head size is a multiple of 8 and at most 128 (256 on Hopper and newer);
* with a mask, both sequence lengths are even (cuDNN's masked backward pass);
* there is more than one query: a one-token decoding step (``ft.nn.generate`` with a
  KV cache) stays on XLA, which fuses it into the step; a flash kernel has no query tile to
  fill there (``"cudnn"`` still runs it).

Attention dropout in training, query/key sizes that differ from the value size, float64 and
a logit soft-cap (``logit_softcap``, Gemma 2's: neither kernel caps its logits) run the
explicit ``softmax(q k^T) v`` in every mode (:mod:`functree.nn._attention`); asking
for ``"cudnn"`` there is an error too.
On TPU, XLA's attention is used: no TPU run here showed a faster kernel.

Example:
    >>> import jax.numpy as jnp
    >>> from functree.nn._attention_kernel import choose
    >>> q = jnp.zeros((2, 16, 4, 64), jnp.bfloat16)   # batch, tokens, heads, head size
    >>> choose("auto", q, q, q, None)                   # on a CPU
    'xla'
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["IMPLEMENTATIONS", "choose", "cudnn_obstacle"]

IMPLEMENTATIONS = ("auto", "xla", "cudnn")

BAD_IMPLEMENTATION = """\
MultiheadAttention: implementation={given!r} is not one of "auto", "xla", "cudnn" (or None, \
JAX's own default: XLA).

    wrong:  ft.nn.MultiheadAttention(..., implementation={given!r})
    right:  ft.nn.MultiheadAttention(..., implementation="auto")   # cuDNN where it applies
"""

CUDNN_DOES_NOT_APPLY = """\
MultiheadAttention: implementation="cudnn" was asked for, but cuDNN's flash attention does \
not apply here: {reason}.

    wrong:  ft.nn.MultiheadAttention(..., implementation="cudnn")   # on this input
    right:  ft.nn.MultiheadAttention(..., implementation="auto")    # cuDNN where it applies, XLA elsewhere
"""


@functools.cache
def _device() -> tuple[str, tuple[int, ...] | None]:
    """The default device's kind ("nvidia", "gpu", "tpu", "cpu") and CUDA capability."""
    device = jax.devices()[0]
    if device.platform != "gpu":
        return device.platform, None
    version = str(getattr(device.client, "platform_version", "")).lower()
    capability = getattr(device, "compute_capability", None)
    if "rocm" in version or capability is None:
        return "gpu", None
    return "nvidia", tuple(int(p) for p in str(capability).split(".")[:2])


def cudnn_obstacle(q: Any, k: Any, v: Any, mask: Any,
                   device: tuple[str, tuple[int, ...] | None] | None = None) -> str | None:
    """Why cuDNN's flash attention cannot run ``[batch, T, heads, size]`` q, k, v (None: it can)."""
    kind, capability = _device() if device is None else device
    if kind != "nvidia":
        return f"the device is {'a ' + kind.upper() if kind != 'gpu' else 'a non-NVIDIA GPU'}, not an NVIDIA GPU"
    if capability is None or capability < (8, 0):
        return f"the GPU's compute capability is {capability}, below 8.0 (Ampere)"
    if not all(a.dtype in (jnp.float16, jnp.bfloat16) for a in (q, k, v)):
        return (f"the inputs are {q.dtype}, not float16 or bfloat16 (compute in bf16: "
                "ft.nn.from_hf(..., dtype=jnp.bfloat16))")
    largest = 256 if capability >= (9, 0) else 128
    size = q.shape[-1]
    if size % 8 or size > largest or v.shape[-1] != size:
        return f"the head size is {size} (value {v.shape[-1]}); cuDNN needs equal sizes, a multiple of 8, at most {largest}"
    if mask is not None and (q.shape[-3] % 2 or k.shape[-3] % 2):
        return f"with a mask both lengths must be even; queries {q.shape[-3]}, keys {k.shape[-3]}"
    return None


def choose(requested: Any, q: Any, k: Any, v: Any, mask: Any,
           device: tuple[str, tuple[int, ...] | None] | None = None) -> Any:
    """The implementation ``jax.nn.dot_product_attention`` gets for these inputs.

    ``requested`` is the layer's ``implementation``: ``"auto"`` -> ``"cudnn"`` or
    ``"xla"``; ``"cudnn"`` -> ``"cudnn"`` or an error naming the constraint; ``"xla"`` and
    None pass through.
    """
    if requested == "auto":
        if q.shape[-3] == 1:
            return "xla"
        return "xla" if cudnn_obstacle(q, k, v, mask, device) else "cudnn"
    if requested == "cudnn":
        reason = cudnn_obstacle(q, k, v, mask, device)
        if reason:
            raise ValueError(CUDNN_DOES_NOT_APPLY.format(reason=reason))
    return requested


def check_implementation(given: Any) -> Any:
    """``given`` if it names an implementation (or is None), else a ValueError."""
    if given is not None and given not in IMPLEMENTATIONS:
        raise ValueError(BAD_IMPLEMENTATION.format(given=given))
    return given
