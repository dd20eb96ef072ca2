"""Embedding backward kernel against its NumPy reference (bit for bit)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from minidl.kernels.transformer.embedding import embedding_backward, embedding_backward_ref


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 20), st.integers(1, 9), st.integers(0, 60), st.integers(0, 10**6),
       st.sampled_from([np.float32, np.float64]))
def test_embedding_backward_matches_reference(v, e, m, seed, dtype):
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, v, m)
    dy = rng.standard_normal((m, e)).astype(dtype)
    a = np.full((v, e), np.nan, dtype)
    b = np.full((v, e), np.nan, dtype)
    embedding_backward(idx, dy, a)
    embedding_backward_ref(idx, dy, b)
    assert np.array_equal(a, b)
