"""kernels.small_gemm: the thin product against float64, on strided views, and its rule."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minidl.kernels.small_gemm import THIN_MAX, THIN_MAX_RIGHT, is_thin, thin_mm


@settings(max_examples=40, deadline=None)
@given(m=st.integers(1, 20), n=st.integers(1, 70), k=st.integers(1, 30), ta=st.booleans(),
       beta=st.sampled_from([0.0, 1.0, 0.5]), dtype=st.sampled_from([np.float32, np.float64]))
def test_matches_float64_on_a_strided_block(m, n, k, ta, beta, dtype):
    rng = np.random.default_rng(m * 1000 + n * 10 + k)
    a = rng.standard_normal((k, m) if ta else (m, k)).astype(dtype)
    b = rng.standard_normal((k, n)).astype(dtype)
    plane = rng.standard_normal((m + 3, n + 5)).astype(dtype)
    c = plane[1:1 + m, 2:2 + n]  # a block of a larger plane: strided rows
    before = plane.copy()
    want = (a.T if ta else a).astype(np.float64) @ b + beta * c.astype(np.float64)
    thin_mm(a, b, c, ta, 1.0, beta, m, n, k)
    tol = 1e-5 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(c, want, rtol=tol, atol=tol * k)
    outside = np.ones(plane.shape, bool)
    outside[1:1 + m, 2:2 + n] = False
    assert np.array_equal(plane[outside], before[outside])  # nothing written outside c


def test_bits_repeat_and_nan_propagates():
    rng = np.random.default_rng(3)
    a = rng.standard_normal((6, 25)).astype(np.float32)
    b = rng.standard_normal((25, 784)).astype(np.float32)
    c1, c2 = np.empty((6, 784), np.float32), np.empty((6, 784), np.float32)
    thin_mm(a, b, c1, False, 1.0, 0.0, 6, 784, 25)
    thin_mm(a, b, c2, False, 1.0, 0.0, 6, 784, 25)
    assert np.array_equal(c1, c2)
    b[3, 10] = np.nan
    thin_mm(a, b, c1, False, 1.0, 0.0, 6, 784, 25)
    assert np.isnan(c1[:, 10]).all() and not np.isnan(np.delete(c1, 10, axis=1)).any()


@pytest.mark.parametrize("m,n,k,thin", [
    (6, 784, 25, True),  # LeNet-5 conv1 forward: few filters, small right operand
    (10, 128, 64, True),
    (32, 784, 9, False),  # a short inner dimension alone: BLAS as fast
    (25, 784, 6, False),  # LeNet-5 conv1's input gradient: BLAS slightly faster
    (16, 300, 150, False),  # from 16 rows BLAS is as fast
    (THIN_MAX, THIN_MAX_RIGHT // 100 + 1, 100, False),  # right operand past the L2 budget
])
def test_thin_rule(m, n, k, thin):
    assert is_thin(m, n, k) == thin
