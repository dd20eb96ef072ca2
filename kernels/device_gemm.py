"""GEMM on device arrays straight into the output: ``np.matmul(a, b, out=c)``, which CuPy hands
to cuBLAS as it is when the operands are laid out for it (no copy, no temporary); and the
mixed-precision GEMM :func:`gemm_ex` (half operands, a float32 or half output, float32
compute: cuBLAS GemmEx), which CuPy's ``matmul`` cannot do into a float32 output without a
half temporary."""

from __future__ import annotations

from typing import Any

import numpy as np

from .array_api import HALF_DTYPES

__all__ = ["gemm", "gemm_ex", "gemm_ex_ok", "gemm_layout_ok"]

#: The operand dtypes of :func:`gemm_ex`.
HALF_OPERANDS = HALF_DTYPES


def gemm_layout_ok(a: Any, b: Any, out: Any) -> bool:
    """True for 2-D C- or F-contiguous operands of the output's dtype and a C-contiguous
    output: what :func:`gemm` takes."""
    return all(m.ndim == 2 and (m.flags.c_contiguous or m.flags.f_contiguous) for m in (a, b)) \
        and out.flags.c_contiguous and out.dtype == a.dtype == b.dtype


def gemm(a: Any, b: Any, out: Any) -> None:
    """``out = a @ b`` for 2-D operands CuPy gives cuBLAS as they are: C- or F-contiguous
    operands (a transpose is a flag), a C-contiguous output, one dtype (anything else and
    CuPy copies). A 1x1 product goes as a batch of one: CuPy's 2-D path turns it into an
    elementwise product and a (CUB) sum, both with temporaries."""
    if not gemm_layout_ok(a, b, out):
        raise AssertionError("device GEMM operands must be 2-D, C- or F-contiguous, of the "
                             "output's dtype, and the output C-contiguous")
    if out.shape == (1, 1):  # a (1, k) row and a (k, 1) column: C-contiguous either way
        np.matmul(a[None], b[None], out=out[None])
    else:
        np.matmul(a, b, out=out)


def gemm_ex_ok(a: Any, b: Any, out: Any) -> bool:
    """True for 2-D C-contiguous operands of one half dtype (float16 or bfloat16) and a
    C-contiguous 2-D output in float32 or that dtype: what :func:`gemm_ex` takes."""
    return (a.dtype == b.dtype and a.dtype.name in HALF_OPERANDS
            and out.dtype.name in ("float32", a.dtype.name)
            and all(m.ndim == 2 and m.flags.c_contiguous for m in (a, b, out)))


def gemm_ex(a: Any, b: Any, out: Any, trans_a: bool = False, trans_b: bool = False,
            beta: float = 0.0) -> None:
    """``out = op(a) @ op(b) + beta * out`` (``op(x) = x.T`` when asked) on device arrays of a
    half dtype, ``out`` float32 or the operands' dtype, computed in float32: products of the
    half values accumulated in float32 and rounded once into ``out`` (cuBLAS GemmEx with
    ``CUBLAS_COMPUTE_32F`` on CuPy's current stream; no temporary). Emulated device arrays
    (a strict test device) go through :func:`~.blas.gemm`, which computes the same with the
    host's float32 BLAS on their buffers."""
    if not gemm_ex_ok(a, b, out):
        raise AssertionError("gemm_ex takes 2-D C-contiguous operands of one half dtype and a "
                             "C-contiguous float32 or half output")
    m, k = (a.shape[1], a.shape[0]) if trans_a else a.shape
    n = b.shape[0] if trans_b else b.shape[1]
    if out.shape != (m, n) or (b.shape[1] if trans_b else b.shape[0]) != k:
        raise ValueError(f"gemm_ex shapes: op(a) {m}x{k}, op(b) {b.shape}, out {out.shape}")
    if hasattr(type(out), "__emulated_device_buffer__"):
        raise TypeError("gemm_ex runs cuBLAS: emulated device arrays go through blas.gemm")
    _cublas_gemm_ex(a, b, out, trans_a, trans_b, beta, m, n, k)


def _cublas_gemm_ex(a: Any, b: Any, out: Any, trans_a: bool, trans_b: bool, beta: float,
                    m: int, n: int, k: int) -> None:
    """:func:`gemm_ex` on CuPy arrays: row-major ``C = op(A) op(B)`` is column-major
    ``C^T = op(B)^T op(A)^T``, and a C-contiguous matrix read column-major is its transpose
    (leading dimension: its column count)."""
    import cupy
    from cupy._core._dtype import to_cuda_dtype
    from cupy_backends.cuda.libs import cublas

    if m == 0 or n == 0:
        return
    if k == 0:
        if beta == 0.0:
            out.fill(0)
        else:
            out *= beta
        return
    one, scale = np.ones(1, np.float32), np.full(1, beta, np.float32)
    op = {False: cublas.CUBLAS_OP_N, True: cublas.CUBLAS_OP_T}
    half, c_type = to_cuda_dtype(a.dtype, True), to_cuda_dtype(out.dtype, True)
    cublas.gemmEx(cupy.cuda.device.get_cublas_handle(), op[trans_b], op[trans_a], n, m, k,
                  one.ctypes.data, b.data.ptr, half, b.shape[1], a.data.ptr, half, a.shape[1],
                  scale.ctypes.data, out.data.ptr, c_type, n, cublas.CUBLAS_COMPUTE_32F,
                  cublas.CUBLAS_GEMM_DEFAULT_TENSOR_OP)
