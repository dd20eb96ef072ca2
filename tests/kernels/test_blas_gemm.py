"""kernels.blas.gemm: the BLAS product with accumulation, serial and in parallel bands."""

from __future__ import annotations

import numpy as np
import pytest

from minidl.kernels.blas import BAND_WORK, batched_gemm, gemm, gemm_bands


@pytest.mark.parametrize("trans_a", [False, True])
@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize("beta", [0.0, 1.0])
@pytest.mark.parametrize("mnk", [(700, 96, 128), (48, 1800, 160)])  # row bands, column bands
def test_parallel_bands_match_the_product(trans_a, trans_b, beta, mnk):
    m, n, k = mnk
    assert gemm_bands(m, n, k)[1] > 1 and gemm_bands(m, n, k)[0] == (m >= n)
    rng = np.random.default_rng(0)
    a = rng.standard_normal((k, m) if trans_a else (m, k))
    b = rng.standard_normal((n, k) if trans_b else (k, n))
    c0 = rng.standard_normal((m, n))
    want = beta * c0 + (a.T if trans_a else a) @ (b.T if trans_b else b)
    out = {}
    for parallel in (False, True):
        c = c0.copy()
        gemm(a, b, c, trans_a=trans_a, trans_b=trans_b, beta=beta, parallel=parallel)
        np.testing.assert_allclose(c, want, rtol=1e-12, atol=1e-12)
        out[parallel] = c
    again = c0.copy()
    gemm(a, b, again, trans_a=trans_a, trans_b=trans_b, beta=beta, parallel=True)
    assert np.array_equal(again, out[True])


def test_bands_follow_the_shapes_only():
    assert gemm_bands(8, 8, 8) == (True, 1)  # small: one call
    assert gemm_bands(4096, 1152, 384) == (True, 2)
    assert gemm_bands(384, 4096, 1152) == (False, 2)
    m = n = 64
    k = 2 * BAND_WORK // (m * n)
    assert gemm_bands(m, n, k) == (True, 2)


def test_strided_row_views_in_bands():
    rng = np.random.default_rng(1)
    big = rng.standard_normal((1200, 300)).astype(np.float32)
    a, b = big[:, :100], rng.standard_normal((100, 120)).astype(np.float32)
    c = np.zeros((1200, 200), np.float32)[:, 40:160]
    assert gemm_bands(1200, 120, 100)[1] > 1
    gemm(a, b, c, parallel=True)
    np.testing.assert_allclose(c, a.astype(np.float64) @ b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("trans_a", [False, True])
@pytest.mark.parametrize("trans_b", [False, True])
def test_batched_products_of_strided_heads(trans_a, trans_b):
    rng = np.random.default_rng(2)
    qkv = rng.standard_normal((3, 10, 3 * 12))  # (B, T, 3D), 4 heads of 3
    q, k, v = qkv.reshape(3, 10, 3, 4, 3).transpose(2, 0, 3, 1, 4)  # (B, H, T, hd) views
    a = k if trans_a else q  # op(a): (3 x 10) or (10 x 3)
    inner = 10 if trans_a else 3
    b = (rng.standard_normal((3, 4, 5, inner)) if trans_a else k) if trans_b else \
        (v if trans_a else rng.standard_normal((3, 4, inner, 7)))
    want = (a.swapaxes(-1, -2) if trans_a else a) @ (b.swapaxes(-1, -2) if trans_b else b)
    c = np.full(want.shape, np.nan)
    batched_gemm(a, b, c, trans_a=trans_a, trans_b=trans_b)
    np.testing.assert_allclose(c, want, rtol=1e-12, atol=1e-12)
