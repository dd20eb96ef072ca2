"""kernels.device_gemm.gemm_ex: the mixed-precision GEMM on device arrays (half operands, a
float32 or half output, float32 compute), reached through kernels.blas.gemm. On emulated device
arrays it is the host's float32 BLAS on the half values, bit for bit (what the CPU's mixed
precision computes); on a GPU (``-m gpu``) cuBLAS GemmEx, within float32 summation order."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from minidl.kernels.blas import gemm
from minidl.kernels.device_gemm import gemm_ex, gemm_ex_ok

from .emulated_arrays import D, H, same

HALVES = [np.float16, ml_dtypes.bfloat16]


def _operands(half, trans_a, trans_b, m=13, n=7, k=29):
    rng = np.random.default_rng(0)
    a = rng.standard_normal((k, m) if trans_a else (m, k)).astype(half)
    b = rng.standard_normal((n, k) if trans_b else (k, n)).astype(half)
    return a, b, rng.standard_normal((m, n)).astype(np.float32)


@pytest.mark.parametrize("beta", [0.0, 1.0])
@pytest.mark.parametrize("trans", [(False, False), (False, True), (True, False)])
@pytest.mark.parametrize("half", HALVES)
def test_emulated_gemm_ex_is_the_float32_product_of_the_half_values(half, trans, beta):
    a, b, c0 = _operands(half, *trans)
    want = c0.copy()
    gemm(a.astype(np.float32), b.astype(np.float32), want, *trans, beta=beta, parallel=True)
    c = D(c0)
    gemm(D(a), D(b), c, *trans, beta=beta)  # (blas.gemm hands half operands to gemm_ex)
    same(H(c), want)
    c16 = D(np.zeros(want.shape, half))
    gemm(D(a), D(b), c16, *trans)  # a half output: the float32 product rounded once
    if beta == 0.0:
        same(H(c16), want.astype(half))


def test_gemm_ex_takes_half_c_contiguous_operands_only():
    a, b, c = _operands(np.float16, False, False)
    assert gemm_ex_ok(D(a), D(b), D(c))
    assert not gemm_ex_ok(D(a.astype(np.float32)), D(b), D(c))
    assert not gemm_ex_ok(D(a), D(b.astype(ml_dtypes.bfloat16)), D(c))
    assert not gemm_ex_ok(D(a).transpose(), D(b), D(c))
    with pytest.raises(AssertionError, match="half dtype"):
        gemm_ex(D(a.astype(np.float32)), D(b), D(c))
    with pytest.raises(TypeError, match="blas.gemm"):
        gemm_ex(D(a), D(b), D(c))


@pytest.mark.gpu
@pytest.mark.parametrize("trans", [(False, False), (False, True), (True, False)])
@pytest.mark.parametrize("half", HALVES)
def test_cublas_gemm_ex_matches_the_float64_product(half, trans):
    import cupy

    a, b, c0 = _operands(half, *trans, m=130, n=70, k=290)
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    want = c0 + (a64.T if trans[0] else a64) @ (b64.T if trans[1] else b64)
    c = cupy.asarray(c0)
    gemm(cupy.asarray(a), cupy.asarray(b), c, *trans, beta=1.0)
    np.testing.assert_allclose(c.get(), want, rtol=1e-5, atol=1e-4)
    c16 = cupy.zeros(c0.shape, half)
    gemm_ex(cupy.asarray(a), cupy.asarray(b), c16, *trans)
    np.testing.assert_allclose(c16.get().astype(np.float64), want - c0,
                               rtol=2.0 ** -7, atol=1e-2)
