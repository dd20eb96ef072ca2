"""Numba kernels of kernels/pointwise/elementwise.py and kernels/normalization/batchnorm.py against
their NumPy
references, for both float dtypes, including the in-place (out is the first operand) case."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minidl.kernels.normalization import batchnorm as bnk
from minidl.kernels.pointwise import elementwise as ek

DTYPES = [np.float32, np.float64]
TOL = {np.float32: 1e-6, np.float64: 1e-14}


@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=15, deadline=None)
@given(shape=st.lists(st.integers(1, 6), min_size=1, max_size=3).map(tuple),
       slope=st.floats(-2, 2), seed=st.integers(0, 2**31))
def test_elementwise_numba_matches_reference(dtype, shape, slope, seed):
    rng = np.random.default_rng(seed)
    x, dy = (rng.standard_normal(shape).astype(dtype) for _ in range(2))
    y = np.tanh(x)
    s = dtype(slope)
    cases = [
        (ek._leaky_relu_fwd_nb, ek.leaky_relu_forward_ref, (x, s)),
        (ek._leaky_relu_bwd_nb, ek.leaky_relu_backward_ref, (dy, x, s)),
        (ek._sigmoid_bwd_nb, ek.sigmoid_backward_ref, (dy, y, dtype(1))),
        (ek._tanh_bwd_nb, ek.tanh_backward_ref, (dy, y, dtype(1))),
    ]
    for nb, ref, args in cases:
        want = np.empty_like(x)
        ref_args = args[:-1] if ref in (ek.sigmoid_backward_ref, ek.tanh_backward_ref) else args
        ref(*ref_args, want)
        got = np.empty_like(x)
        nb(*(a.reshape(-1) if isinstance(a, np.ndarray) else a for a in args), got.reshape(-1))
        np.testing.assert_allclose(got, want, rtol=TOL[dtype], atol=TOL[dtype])
        alias = np.array(args[0], copy=True)  # out is the first operand
        nb(alias.reshape(-1), *(a.reshape(-1) if isinstance(a, np.ndarray) else a
                                for a in args[1:]), alias.reshape(-1))
        np.testing.assert_array_equal(alias, got)


@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=15, deadline=None)
@given(shape=st.tuples(st.integers(1, 4), st.integers(1, 4), st.integers(1, 9)),
       seed=st.integers(0, 2**31))
def test_batchnorm_numba_matches_reference(dtype, shape, seed):
    rng = np.random.default_rng(seed)
    c = shape[1]
    x = (rng.standard_normal(shape) * 2 + 3).astype(dtype)
    dy = rng.standard_normal(shape).astype(dtype)
    mean, scale, shift, coef = (rng.standard_normal(c).astype(dtype) for _ in range(4))
    tol = TOL[dtype] * 10

    m1, v1, m2, v2 = (np.empty(c) for _ in range(4))
    bnk._stats_nb(x, m1, v1)
    bnk.stats_ref(x, m2, v2)
    np.testing.assert_allclose(m1, m2, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(v1, v2, rtol=1e-10, atol=1e-12)

    y1, y2 = np.empty_like(x), np.empty_like(x)
    bnk._apply_nb(x, mean, scale, shift, y1)
    bnk.apply_ref(x, mean, scale, shift, y2)
    np.testing.assert_allclose(y1, y2, rtol=tol, atol=tol)

    a1, b1, a2, b2 = (np.empty(c) for _ in range(4))
    bnk._reduce_nb(dy, x, mean, a1, b1)
    bnk.reduce_ref(dy, x, mean, a2, b2)
    np.testing.assert_allclose(a1, a2, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(b1, b2, rtol=1e-5, atol=1e-5)

    d1, d2 = np.empty_like(x), np.empty_like(x)
    bnk._backward_apply_nb(dy, x, mean, scale, shift, coef, d1)
    bnk.backward_apply_ref(dy, x, mean, scale, shift, coef, d2)
    np.testing.assert_allclose(d1, d2, rtol=tol, atol=tol)
    alias = dy.copy()
    bnk._backward_apply_nb(alias, x, mean, scale, shift, coef, alias)
    np.testing.assert_array_equal(alias, d1)


def test_dispatch_uses_reference_for_non_contiguous():
    x = np.random.default_rng(0).standard_normal((4, 3, 10))[:, :, ::2]
    m1, v1, m2, v2 = (np.empty(3) for _ in range(4))
    bnk.stats(x, m1, v1)
    bnk.stats(np.ascontiguousarray(x), m2, v2)
    np.testing.assert_allclose(m1, m2, rtol=1e-12)
    np.testing.assert_allclose(v1, v2, rtol=1e-12)
