"""Tolerances per backend: a comparison on an accelerator allows the spread measured there.

The suite's tolerances are measured on CPUs (conftest.py: every XLA CPU instruction set). On
a GPU, functree's programs run other kernels (cuDNN, cuBLAS, other fusions) whose sums differ
from the CPU's and from torch's on the CPU by more; a test that compares with such a reference
widens its tolerance there, and only there, to ``MARGIN`` times the spread measured on that
backend.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from _tolerance import MARGIN

# Issue 44 (an H200, jax 0.11.2, torch 2.13 on its CPU): the largest difference seen between
# functree's generate on the GPU and Hugging Face's generate, in a token's log-probability
# (absolute: log-probabilities of a tiny random model, of order 1 to 10).
GPU_LOGPROB_SPREAD = 9.7e-3


def on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def logprob_atol(expected: Any, cpu_scale: float, tokens: int = 1) -> float:
    """``atol`` for log-probabilities compared with Hugging Face's: ``cpu_scale`` times the
    values' size, and on a GPU at least ``MARGIN`` times its measured spread per token summed
    over ``tokens`` (a sum of that many log-probabilities)."""
    atol = cpu_scale * float(np.abs(np.asarray(expected)).max())
    return max(atol, gpu_logprob_atol(tokens))


def gpu_logprob_atol(tokens: int = 1) -> float:
    """The GPU's allowance alone (0 on every other backend): ``tokens`` log-probabilities summed."""
    return MARGIN * GPU_LOGPROB_SPREAD * tokens if on_gpu() else 0.0
