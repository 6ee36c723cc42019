"""tests/_backends.py: tolerances widened on a GPU alone (the GPU branch by a faked backend)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from _backends import GPU_LOGPROB_SPREAD, gpu_logprob_atol, logprob_atol
from _tolerance import MARGIN

SCORES = np.array([[-0.5, -2.0], [-8.0, 0.0]])


@pytest.mark.parametrize("backend", ["cpu", "tpu"])
def test_only_a_gpu_widens_the_tolerance(monkeypatch, backend):
    monkeypatch.setattr(jax, "default_backend", lambda: backend)
    assert logprob_atol(SCORES, 2e-5) == 2e-5 * 8.0
    assert gpu_logprob_atol(tokens=24) == 0.0


def test_a_gpu_allows_its_measured_spread_with_the_margin(monkeypatch):
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert logprob_atol(SCORES, 2e-5) == MARGIN * GPU_LOGPROB_SPREAD
    assert logprob_atol(SCORES * 1e5, 2e-5) == 2e-5 * 8e5  # the larger of the two
    np.testing.assert_allclose(gpu_logprob_atol(tokens=24), 24 * MARGIN * GPU_LOGPROB_SPREAD, rtol=0, atol=1e-12)
