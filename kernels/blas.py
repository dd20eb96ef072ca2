"""Matrix products with accumulation and strided operands, callable from Numba kernels.

``np.dot`` inside Numba can neither accumulate (``beta = 1``) nor write into a strided
sub-matrix, so every partial weight gradient needed a temporary and every band of an output
plane a copy. :func:`mm` calls BLAS ``sgemm`` / ``dgemm`` directly, through the same SciPy
BLAS that Numba's ``np.dot`` binds (``scipy.linalg.cython_blas``, single-threaded by
:func:`~minidl.kernels.parallel.ensure_blas_policy`), with row-major arrays of any row stride.

:func:`gemm` with ``parallel=True`` cuts a large product into bands of ``c`` (rows, or columns
when ``c`` is wide) and runs one single-threaded BLAS call per band in a Numba ``prange``: the
process's one thread pool (see :mod:`~minidl.kernels.parallel`). The bands are fixed by the
shapes alone (:func:`gemm_bands`), never by the thread count, and no band splits the sum over
``k``, so the bits do not depend on how many threads run.
"""

from __future__ import annotations

import ctypes
from typing import Any

import llvmlite.binding as ll
import numpy as np
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from ._cuda import is_device_array
from .array_api import round_into
from .device_gemm import gemm as device_gemm
from .device_gemm import gemm_ex, gemm_ex_ok, gemm_layout_ok
from .parallel import chunks, ensure_blas_policy


def _capsule_address(capsule: object) -> int:
    get_name = ctypes.pythonapi.PyCapsule_GetName
    get_name.restype, get_name.argtypes = ctypes.c_char_p, [ctypes.py_object]
    get_ptr = ctypes.pythonapi.PyCapsule_GetPointer
    get_ptr.restype, get_ptr.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    return get_ptr(capsule, get_name(capsule))


def _register(name: str) -> types.ExternalFunction:
    """The Fortran ``?gemm`` of SciPy's BLAS as an external symbol: compiled code refers to
    it by name (re-registered at every import), so callers stay cacheable (a ctypes function
    object would be baked in as an address and disable Numba's cache)."""
    from scipy.linalg import cython_blas

    symbol = f"minidl_blas_{name}"
    ll.add_symbol(symbol, _capsule_address(cython_blas.__pyx_capi__[name]))
    return types.ExternalFunction(symbol, types.void(*([types.voidptr] * 13)))


_sgemm = _register("sgemm")
_dgemm = _register("dgemm")


@intrinsic
def _ptr(typingctx, arr):
    """Data pointer of an array (view) as ``void*``."""
    if not isinstance(arr, types.Array):
        return None

    def codegen(context, builder, signature, args):
        ary = context.make_array(signature.args[0])(context, builder, args[0])
        return builder.bitcast(ary.data, cgutils.voidptr_t)

    return types.voidptr(arr), codegen


@njit(nogil=True, cache=True, error_model="numpy")
def mm(a, b, c, ta, tb, alpha, beta, m, n, k, work):
    """``c[:m, :n] = alpha * op(a) @ op(b) + beta * c[:m, :n]`` on row-major 2-D arrays whose
    rows may be strided (views of larger arrays); ``op(x)`` is ``x.T`` when ``ta`` / ``tb``.

    ``a``, ``b``, ``c`` share one float dtype (float32 or float64); ``work`` is a scratch
    ``int32`` array of 8 (Fortran BLAS takes every argument by address).
    """
    # Row-major C is column-major C^T = op(b)^T op(a)^T: call gemm(op_b, op_a, n, m, k, ...).
    work[0] = n
    work[1] = m
    work[2] = k
    work[3] = max(b.strides[0] // b.itemsize, b.shape[1], 1)
    work[4] = max(a.strides[0] // a.itemsize, a.shape[1], 1)
    work[5] = max(c.strides[0] // c.itemsize, c.shape[1], 1)
    work[6] = ord("N")
    work[7] = ord("T")
    scal = np.empty(2, c.dtype)
    scal[0] = alpha
    scal[1] = beta
    chars = work[6:].view(np.uint8)  # 'N', 0, 0, 0, 'T', ... (little-endian int32)
    opb = _ptr(chars[4:]) if tb else _ptr(chars)
    opa = _ptr(chars[4:]) if ta else _ptr(chars)
    args = (opb, opa, _ptr(work), _ptr(work[1:]), _ptr(work[2:]), _ptr(scal), _ptr(b),
            _ptr(work[3:]), _ptr(a), _ptr(work[4:]), _ptr(scal[1:]), _ptr(c), _ptr(work[5:]))
    if c.itemsize == 4:
        _sgemm(*args)
    else:
        _dgemm(*args)


#: Work (multiply-adds, ``m * n * k``) of one band of :func:`gemm` (below ~4 M multiply-adds,
#: ~0.1 ms on one core, a band's packing and launch stop paying), and the most bands: two, one
#: per core of the machines this runs on; more bands repack the shared operand more often
#: (gpt-char's step: 2294 / 2339 / 2434 / 2528 ms with 2 / 4 / 8 / 16 bands on 2 cores).
BAND_WORK = 1 << 22
MAX_BANDS = 2


def gemm_bands(m: int, n: int, k: int) -> tuple[bool, int]:
    """How :func:`gemm` cuts an ``m x n`` product over ``k``: ``(along_rows, bands)`` —
    bands of ``c``'s rows (when ``m >= n``) or columns, a function of the shapes only."""
    bands = max(1, min(MAX_BANDS, (m * n * k) // BAND_WORK, max(m, n) // 16))
    return m >= n, bands


@njit(nogil=True, cache=True, parallel=True, error_model="numpy")
def _mm_bands(a, b, c, ta, tb, beta, m, n, k, along_rows, bounds, work):
    """:func:`mm` of ``c``'s bands ``[bounds[i], bounds[i + 1])`` (rows or columns), one per
    ``prange`` iteration."""
    for i in prange(bounds.size - 1):
        lo, hi = bounds[i], bounds[i + 1]
        if along_rows:
            ai = a[:, lo:hi] if ta else a[lo:hi]
            mm(ai, b, c[lo:hi], ta, tb, 1.0, beta, hi - lo, n, k, work[i])
        else:
            bi = b[lo:hi] if tb else b[:, lo:hi]
            mm(a, bi, c[:, lo:hi], ta, tb, 1.0, beta, m, hi - lo, k, work[i])


@njit(nogil=True, cache=True, parallel=True, error_model="numpy")
def _mm_batched(a, b, c, ta, tb, m, n, k, work):
    """:func:`mm` of every matrix ``c[i, j]`` of a (B, H, m, n) stack, one per ``prange``
    iteration (each product whole: the bits never depend on the thread count)."""
    heads = c.shape[1]
    for t in prange(c.shape[0] * heads):
        i, j = t // heads, t % heads
        mm(a[i, j], b[i, j], c[i, j], ta, tb, 1.0, 0.0, m, n, k, work[t])


def batched_gemm(a: np.ndarray, b: np.ndarray, c: np.ndarray, trans_a: bool = False,
                 trans_b: bool = False) -> None:
    """``c[i, j] = op(a[i, j]) @ op(b[i, j])`` on stacks of shape (B, H, rows, cols) whose
    rows may be strided (heads sliced out of a wider array): one BLAS call per matrix, the
    matrices shared out over the kernels' threads. Device arrays go straight into ``c``:
    through CuPy's ``matmul`` (cuBLAS, batched) when ``op(a)``, ``op(b)`` and ``c`` are
    C-contiguous stacks of one float dtype (it copies any other operand, and writes any other
    output through a temporary), else one launch of the strided Numba CUDA GEMM
    (:func:`~.transformer_device.bgemm`). Other host layouts go through ``matmul``."""
    if is_device_array(c):
        from .transformer import transformer_device as td

        op_a = a.swapaxes(-1, -2) if trans_a else a
        op_b = b.swapaxes(-1, -2) if trans_b else b
        if (all(x.ndim == 4 and x.flags.c_contiguous for x in (op_a, op_b, c))
                and a.dtype == b.dtype == c.dtype and c.dtype in (np.float32, np.float64)):
            np.matmul(op_a, op_b, out=c)
        else:
            td.bgemm(a, b, c, trans_a, trans_b)
        return
    m = a.shape[3] if trans_a else a.shape[2]
    k = a.shape[2] if trans_a else a.shape[3]
    n = b.shape[2] if trans_b else b.shape[3]
    host = all(type(x) is np.ndarray and x.ndim == 4 for x in (a, b, c))
    if (host and a.dtype == b.dtype == c.dtype and c.dtype in (np.float32, np.float64)
            and c.shape[2:] == (m, n) and m and n and k
            and all(x.strides[3] == x.itemsize and min(x.strides) >= 0 for x in (a, b, c))):
        ensure_blas_policy()
        _mm_batched(a, b, c, trans_a, trans_b, m, n, k,
                    np.empty((c.shape[0] * c.shape[1], 8), np.int32))
        return
    c[...] = (a.swapaxes(-1, -2) if trans_a else a) @ (b.swapaxes(-1, -2) if trans_b else b)


def _device_gemm_ok(a: Any, b: Any, c: Any) -> bool:
    """Device operands CuPy hands to cuBLAS as they are (:func:`device_gemm`'s rules)."""
    return is_device_array(c) and gemm_layout_ok(a, b, c)


def _rows_ok(x: np.ndarray) -> bool:
    return x.ndim == 2 and (x.shape[1] <= 1 or x.strides[1] == x.itemsize) \
        and x.strides[0] >= 0


def gemm(a: np.ndarray, b: np.ndarray, c: np.ndarray, trans_a: bool = False,
         trans_b: bool = False, beta: float = 0.0, parallel: bool = False) -> None:
    """``c = op(a) @ op(b) + beta * c`` in place on 2-D arrays (``op(x) = x.T`` when asked),
    with no temporary: ``beta = 1`` accumulates a product into ``c`` (a micro-batch's weight
    gradient into the gradient). BLAS through :func:`mm` for float32 / float64 operands with
    unit-stride rows; device arrays straight into ``c`` by cuBLAS when ``beta = 0`` and the
    operands are C- or F-contiguous, or (any ``beta``) C-contiguous half operands into a
    float32 or half ``c`` (:func:`~.device_gemm.gemm_ex`, float32 compute); other layouts
    through the arrays' own ``matmul`` (with a temporary). ``parallel``: in bands on the
    kernels' thread pool (see the module docstring; call it from the main thread only, never
    from worker threads).
    """
    m, k = (a.shape[1], a.shape[0]) if trans_a else a.shape
    n = b.shape[0] if trans_b else b.shape[1]
    if c.shape != (m, n) or (b.shape[1] if trans_b else b.shape[0]) != k:
        raise ValueError(f"gemm shapes: op(a) {m}x{k}, op(b) {b.shape}, c {c.shape}")
    same = a.dtype == b.dtype == c.dtype and c.dtype in (np.float32, np.float64)
    host = all(type(x) is np.ndarray for x in (a, b, c))
    if host and same and m and n and k and all(_rows_ok(x) for x in (a, b, c)):
        ensure_blas_policy()
        along_rows, bands = gemm_bands(m, n, k) if parallel else (True, 1)
        if bands == 1:
            mm(a, b, c, trans_a, trans_b, 1.0, beta, m, n, k, np.empty(8, np.int32))
            return
        bounds = np.array([0] + [hi for _, hi in chunks(m if along_rows else n, bands)],
                          np.int64)
        _mm_bands(a, b, c, trans_a, trans_b, beta, m, n, k, along_rows, bounds,
                  np.empty((bands, 8), np.int32))
        return
    if is_device_array(c) and gemm_ex_ok(a, b, c):  # half operands: cuBLAS GemmEx
        run = emulated_gemm_ex if hasattr(type(c), "__emulated_device_buffer__") else gemm_ex
        run(a, b, c, trans_a, trans_b, beta)
        return
    op_a, op_b = (a.T if trans_a else a), (b.T if trans_b else b)
    if beta == 0.0 and same and m and n and k and _device_gemm_ok(op_a, op_b, c):
        device_gemm(op_a, op_b, c)  # cuBLAS straight into c: no temporary, one launch
        return
    prod = op_a @ op_b
    if beta == 0.0:
        np.copyto(c, prod, casting="same_kind")
    else:
        if beta != 1.0:
            c *= beta
        c += prod


def emulated_gemm_ex(a: Any, b: Any, out: Any, trans_a: bool, trans_b: bool,
                     beta: float) -> None:
    """:func:`~.device_gemm.gemm_ex` on emulated device arrays (a strict test device): one
    launch on their host buffers, the float32 BLAS call a CPU makes on float32 copies of the
    half operands, rounded once into a half output (there ``beta * out`` is added to the
    finished product, as GemmEx's epilogue does)."""
    hook = getattr(out, "__emulated_launch__", None)
    if hook is not None:  # (a device counting its launches)
        hook("gemm_ex")
    ha, hb, hc = (x.__emulated_device_buffer__() for x in (a, b, out))
    c32 = hc if hc.dtype == np.float32 else np.empty(hc.shape, np.float32)
    if c32 is not hc and beta != 0.0:  # GemmEx's epilogue: the product, then + beta * c
        gemm(ha.astype(np.float32), hb.astype(np.float32), c32, trans_a, trans_b, 0.0,
             parallel=True)
        c32 += np.float32(beta) * hc.astype(np.float32)
    else:
        gemm(ha.astype(np.float32), hb.astype(np.float32), c32, trans_a, trans_b, beta,
             parallel=True)
    if c32 is not hc:
        round_into(hc, c32)
