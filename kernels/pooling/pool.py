"""2-D max and average pooling (NCHW): NumPy references and Numba CPU kernels.

Max pooling keeps, per output element, only the index ``i * kw + j`` of the winning element
inside its window (``uint8`` for windows up to 256 elements): backward scatters the output
gradient there and needs neither the input nor the output. Semantics follow PyTorch: padding
counts as ``-inf``, the first maximum wins, NaN propagates; average pooling divides by
``kh * kw`` (``count_include_pad=True``). CPU kernels split the ``N * C`` planes over threads;
max pooling also has Numba CUDA kernels (grid-stride loops, chosen for device arrays such as
CuPy's; backward gathers per input element, so it needs no atomics and is deterministic);
average pooling on device arrays is array operations (:mod:`.pool_device`). Max pooling on
half device arrays (float16 / bfloat16) runs on their bits (:mod:`.pool_half`): forward always,
backward when the windows do not overlap (:func:`maxpool_half_exact`; overlapping windows keep
the generic kernel, which sums in the arrays' dtype: hand it float32 arrays).
"""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any

import numpy as np
from numba import njit, prange

from .. import _cuda
from ..array_api import half_device
from ..codecs.bitpack import SAME_WIDTH_INT
from ..parallel import ensure_blas_policy, num_threads, split
from . import pool_half
from .pool_device import avgpool2d_backward_device, avgpool2d_forward_device
from .pool_half import (
    maxpool2d_backward_half,
    maxpool2d_forward_half,
    maxpool_half_exact,
)

cuda: Any = None  # numba.cuda, set by _cuda.bind on first CUDA use
_window_py = pool_half._window_py  # the window of an output, bound as a device function
_d_window: Any = None  # its device version (bind's device=)

Pair = tuple[int, int]


def pool_output_hw(hw: Pair, kernel: Pair, stride: Pair, padding: Pair) -> Pair:
    """Output height and width (floor mode)."""
    return tuple(  # type: ignore[return-value]
        (hw[a] + 2 * padding[a] - kernel[a]) // stride[a] + 1 for a in range(2)
    )


def argmax_dtype(kernel: Pair) -> np.dtype:
    """Smallest unsigned type holding a window index."""
    k = kernel[0] * kernel[1]
    return np.dtype(np.uint8 if k <= 256 else np.uint16 if k <= 65536 else np.uint32)


# ----------------------------------------------------------------------------- reference
def _windows(x: np.ndarray, kernel: Pair, stride: Pair, padding: Pair, fill: float):
    """``(N, C, Ho, Wo, kh*kw)`` view of the padded windows."""
    n, c, h, w = x.shape
    ho, wo = pool_output_hw((h, w), kernel, stride, padding)
    xp = np.pad(x, ((0, 0), (0, 0), (padding[0],) * 2, (padding[1],) * 2), constant_values=fill)
    v = np.lib.stride_tricks.sliding_window_view(xp, kernel, axis=(2, 3))
    return v[:, :, : (ho - 1) * stride[0] + 1: stride[0], : (wo - 1) * stride[1] + 1: stride[1]
             ].reshape(n, c, ho, wo, kernel[0] * kernel[1])


def maxpool2d_forward_ref(x: np.ndarray, kernel: Pair, stride: Pair, padding: Pair = (0, 0)
                          ) -> tuple[np.ndarray, np.ndarray]:
    """NumPy reference: ``(y, argmax)`` with ``argmax`` the window index of the first maximum
    (of the last NaN if any, as PyTorch's CPU kernel)."""
    win = _windows(x, kernel, stride, padding, -np.inf)
    nan = np.isnan(win)
    last_nan = win.shape[-1] - 1 - nan[..., ::-1].argmax(-1)
    idx = np.where(nan.any(-1), last_nan, win.argmax(-1))
    y = np.take_along_axis(win, idx[..., None], -1)[..., 0]
    return np.ascontiguousarray(y), idx.astype(argmax_dtype(kernel))


def maxpool2d_backward_ref(dy: np.ndarray, idx: np.ndarray, x_shape: tuple[int, ...],
                           kernel: Pair, stride: Pair, padding: Pair = (0, 0)) -> np.ndarray:
    """NumPy reference: gradient of :func:`maxpool2d_forward_ref` w.r.t. ``x``."""
    n, c, h, w = x_shape
    ho, wo = dy.shape[2:]
    dxp = np.zeros((n, c, h + 2 * padding[0], w + 2 * padding[1]), dy.dtype)
    i, j = np.divmod(idx.astype(np.int64), kernel[1])
    rows = np.arange(ho)[:, None] * stride[0] + i
    cols = np.arange(wo)[None, :] * stride[1] + j
    nn, cc = np.meshgrid(np.arange(n), np.arange(c), indexing="ij")
    np.add.at(dxp, (nn[..., None, None], cc[..., None, None], rows, cols), dy)
    return np.ascontiguousarray(dxp[:, :, padding[0]: padding[0] + h, padding[1]: padding[1] + w])


def avgpool2d_forward_ref(x: np.ndarray, kernel: Pair, stride: Pair, padding: Pair = (0, 0)
                          ) -> np.ndarray:
    """NumPy reference of average pooling with ``count_include_pad=True``."""
    return np.ascontiguousarray(_windows(x, kernel, stride, padding, 0.0).mean(-1))


def avgpool2d_backward_ref(dy: np.ndarray, x_shape: tuple[int, ...], kernel: Pair,
                           stride: Pair, padding: Pair = (0, 0)) -> np.ndarray:
    """NumPy reference: gradient of :func:`avgpool2d_forward_ref` w.r.t. ``x``."""
    n, c, h, w = x_shape
    ho, wo = dy.shape[2:]
    dxp = np.zeros((n, c, h + 2 * padding[0], w + 2 * padding[1]), dy.dtype)
    g = dy / (kernel[0] * kernel[1])
    for i in range(kernel[0]):
        for j in range(kernel[1]):
            dxp[:, :, i: i + (ho - 1) * stride[0] + 1: stride[0],
                j: j + (wo - 1) * stride[1] + 1: stride[1]] += g
    return np.ascontiguousarray(dxp[:, :, padding[0]: padding[0] + h, padding[1]: padding[1] + w])


# ----------------------------------------------------------------------------- numba
@njit(nogil=True, cache=True, error_model="numpy")
def _maxpool_plane(x, y, idx, p, kh, kw, sh, sw, ph, pw):
    """Generic window loop of one plane (any kernel, stride, padding; NaN-aware)."""
    h, w = x.shape[1], x.shape[2]
    ho, wo = y.shape[1], y.shape[2]
    for oh in range(ho):
        h0 = oh * sh - ph
        i_lo, i_hi = max(0, -h0), min(kh, h - h0)
        for ow in range(wo):
            w0 = ow * sw - pw
            j_lo, j_hi = max(0, -w0), min(kw, w - w0)
            m = -np.inf
            k = i_lo * kw + j_lo
            for i in range(i_lo, i_hi):
                for j in range(j_lo, j_hi):
                    v = x[p, h0 + i, w0 + j]
                    if v > m or v != v:
                        m = v
                        k = i * kw + j
            y[p, oh, ow] = m
            idx[p, oh, ow] = k


@njit(nogil=True, cache=True, error_model="numpy")
def _maxpool_fwd(x, y, idx, p0, p1, kh, kw, sh, sw, ph, pw):
    """Planes ``p0:p1`` of ``x`` (P, H, W) into ``y`` and ``idx`` (P, Ho, Wo)."""
    ho, wo = y.shape[1], y.shape[2]
    fast = kh == 2 and kw == 2 and sh == 2 and sw == 2 and ph == 0 and pw == 0
    for p in range(p0, p1):
        if not fast:
            _maxpool_plane(x, y, idx, p, kh, kw, sh, sw, ph, pw)
            continue
        # 2x2/2: branch-free, vectorised; a NaN anywhere in the plane redoes it NaN-aware.
        bad = False
        for oh in range(ho):
            for ow in range(wo):
                m = x[p, 2 * oh, 2 * ow]
                bad |= m != m
                k = np.uint8(0)
                v = x[p, 2 * oh, 2 * ow + 1]
                bad |= v != v
                c = v > m
                m = v if c else m
                k = np.uint8(1) if c else k
                v = x[p, 2 * oh + 1, 2 * ow]
                bad |= v != v
                c = v > m
                m = v if c else m
                k = np.uint8(2) if c else k
                v = x[p, 2 * oh + 1, 2 * ow + 1]
                bad |= v != v
                c = v > m
                m = v if c else m
                k = np.uint8(3) if c else k
                y[p, oh, ow] = m
                idx[p, oh, ow] = k
        if bad:
            _maxpool_plane(x, y, idx, p, kh, kw, sh, sw, ph, pw)


@njit(nogil=True, cache=True, error_model="numpy")
def _maxpool_bwd(dy, idx, dx, p0, p1, kh, kw, sh, sw, ph, pw):
    """Planes ``p0:p1``: ``dx`` (P, H, W) = ``dy`` (P, Ho, Wo) scattered to the argmax
    (windows that tile the plane go to :func:`_maxpool_bwd_tiled`)."""
    ho, wo = dy.shape[1], dy.shape[2]
    for p in range(p0, p1):
        dx[p] = 0
        for oh in range(ho):
            for ow in range(wo):
                k = np.intp(idx[p, oh, ow])
                i = k // kw
                dx[p, oh * sh - ph + i, ow * sw - pw + k - i * kw] += dy[p, oh, ow]


@njit(nogil=True, cache=True, error_model="numpy")
def _maxpool_bwd_tiled(dy, idx, dx, p0, p1):
    """2x2 / stride 2 windows that tile the plane, on the floats' bits (``dy``, ``dx``:
    same-width integer views): each element of ``dx`` is written once, ``dy``'s bits where
    the window's argmax is, else 0 (+0.0), by masks instead of branches on the random argmax
    (5x faster than selects). Planes and rows are taken as slices, so every index starts at 0."""
    ho, wo = dy.shape[1], dy.shape[2]
    bits = dx.dtype.type
    for p in range(p1 - p0):
        dy_p, idx_p, dx_p = dy[p0 + p], idx[p0 + p], dx[p0 + p]
        for oh in range(ho):
            g_row, k_row = dy_p[oh], idx_p[oh]
            top, bottom = dx_p[2 * oh], dx_p[2 * oh + 1]
            for ow in range(wo):
                g = g_row[ow]
                k = k_row[ow]
                top[2 * ow] = g & -bits(k == 0)
                top[2 * ow + 1] = g & -bits(k == 1)
                bottom[2 * ow] = g & -bits(k == 2)
                bottom[2 * ow + 1] = g & -bits(k == 3)


@njit(nogil=True, cache=True, error_model="numpy")
def _avgpool_fwd(x, y, p0, p1, kh, kw, sh, sw, ph, pw):
    h, w = x.shape[1], x.shape[2]
    ho, wo = y.shape[1], y.shape[2]
    inv = 1.0 / (kh * kw)
    for p in range(p0, p1):
        for oh in range(ho):
            h0 = oh * sh - ph
            i_lo, i_hi = max(0, -h0), min(kh, h - h0)
            for ow in range(wo):
                w0 = ow * sw - pw
                j_lo, j_hi = max(0, -w0), min(kw, w - w0)
                s = 0.0
                for i in range(i_lo, i_hi):
                    for j in range(j_lo, j_hi):
                        s += x[p, h0 + i, w0 + j]
                y[p, oh, ow] = s * inv


@njit(nogil=True, cache=True, error_model="numpy")
def _avgpool_bwd(dy, dx, p0, p1, kh, kw, sh, sw, ph, pw):
    h, w = dx.shape[1], dx.shape[2]
    ho, wo = dy.shape[1], dy.shape[2]
    inv = 1.0 / (kh * kw)
    for p in range(p0, p1):
        dx[p] = 0
        for oh in range(ho):
            h0 = oh * sh - ph
            i_lo, i_hi = max(0, -h0), min(kh, h - h0)
            for ow in range(wo):
                w0 = ow * sw - pw
                j_lo, j_hi = max(0, -w0), min(kw, w - w0)
                g = dy[p, oh, ow] * inv
                for i in range(i_lo, i_hi):
                    for j in range(j_lo, j_hi):
                        dx[p, h0 + i, w0 + j] += g


# ----------------------------------------------------------------------------- parallel
# One prange iteration per thread, each a serial kernel on a contiguous range of planes.
@njit(nogil=True, cache=True, parallel=True, error_model="numpy")
def _maxpool_fwd_par(x, y, idx, bounds, kh, kw, sh, sw, ph, pw):
    for t in prange(bounds.size - 1):
        _maxpool_fwd(x, y, idx, bounds[t], bounds[t + 1], kh, kw, sh, sw, ph, pw)


@njit(nogil=True, cache=True, parallel=True, error_model="numpy")
def _maxpool_bwd_par(dy, idx, dx, bounds, kh, kw, sh, sw, ph, pw):
    for t in prange(bounds.size - 1):
        _maxpool_bwd(dy, idx, dx, bounds[t], bounds[t + 1], kh, kw, sh, sw, ph, pw)


@njit(nogil=True, cache=True, parallel=True, error_model="numpy")
def _maxpool_bwd_tiled_par(dy, idx, dx, bounds):
    for t in prange(bounds.size - 1):
        _maxpool_bwd_tiled(dy, idx, dx, bounds[t], bounds[t + 1])


@njit(nogil=True, cache=True, parallel=True, error_model="numpy")
def _avgpool_fwd_par(x, y, bounds, kh, kw, sh, sw, ph, pw):
    for t in prange(bounds.size - 1):
        _avgpool_fwd(x, y, bounds[t], bounds[t + 1], kh, kw, sh, sw, ph, pw)


@njit(nogil=True, cache=True, parallel=True, error_model="numpy")
def _avgpool_bwd_par(dy, dx, bounds, kh, kw, sh, sw, ph, pw):
    for t in prange(bounds.size - 1):
        _avgpool_bwd(dy, dx, bounds[t], bounds[t + 1], kh, kw, sh, sw, ph, pw)


# ----------------------------------------------------------------------------- drivers
def _planes(a: np.ndarray) -> np.ndarray:
    a = a if a.flags.c_contiguous else np.ascontiguousarray(a)
    return a.reshape(-1, a.shape[2], a.shape[3])


#: Input elements below which a call runs on the calling thread alone.
SERIAL_ELEMS = 1 << 16


def _run(serial, par, arrays: tuple, nplanes: int, work: int, geom: tuple,
         threads: int | None) -> None:
    bounds = split(nplanes, threads or num_threads(), work, SERIAL_ELEMS, threads is not None)
    if bounds is None:
        serial(*arrays, 0, nplanes, *geom)
    else:
        par(*arrays, bounds, *geom)


def _run_pool(serial, par, inputs: tuple, outputs: tuple, nplanes: int, work: int,
              geom: tuple, threads: int | None) -> None:
    """Run a host kernel over contiguous planes; an output that is not C-contiguous is
    written through a contiguous temporary and copied back."""
    ensure_blas_policy()
    temps = [_writable(o) for o in outputs]
    _run(serial, par, (*map(_planes, inputs), *map(_planes, temps)), nplanes, work, geom,
         threads)
    for o, t in zip(outputs, temps):
        if t is not o:
            o[...] = t


def _writable(out: np.ndarray) -> np.ndarray:
    return out if out.flags.c_contiguous else np.empty(out.shape, out.dtype)


# ----------------------------------------------------------------------------- CUDA
def _k_maxpool_fwd(x, y, idx, npl, h, w, ho, wo, kh, kw, sh, sw, ph, pw, lowest):
    """One output element per grid-stride step (same NaN / tie rules as the CPU kernel)."""
    for e in range(cuda.grid(1), npl * ho * wo, cuda.gridsize(1)):
        base, i0, i1, j0, j1 = _d_window(e, h, w, ho, wo, kh, kw, sh, sw, ph, pw)
        m = lowest
        k = i0 * kw + j0
        for i in range(i0, i1):
            for j in range(j0, j1):
                v = x[base + i * w + j]
                if v > m or v != v:
                    m = v
                    k = i * kw + j
        y[e] = m
        idx[e] = k


def _k_maxpool_bwd(dy, idx, dx, npl, h, w, ho, wo, kh, kw, sh, sw, ph, pw, zero):
    """Gather: each ``dx`` element sums, in row-major order, the outputs whose argmax it is."""
    for t in range(cuda.grid(1), npl * h * w, cuda.gridsize(1)):
        p = t // (h * w)
        r = t - p * h * w
        hp = r // w + ph
        wp = r - (r // w) * w + pw
        oh0 = (hp - kh + sh) // sh if hp >= kh else 0
        oh1 = hp // sh if hp // sh < ho else ho - 1
        ow0 = (wp - kw + sw) // sw if wp >= kw else 0
        ow1 = wp // sw if wp // sw < wo else wo - 1
        acc = zero
        for oh in range(oh0, oh1 + 1):
            for ow in range(ow0, ow1 + 1):
                e = (p * ho + oh) * wo + ow
                if idx[e] == (hp - oh * sh) * kw + (wp - ow * sw):
                    acc += dy[e]
        dx[t] = acc


@functools.cache
def _kernels() -> SimpleNamespace:
    return _cuda.bind(globals(), ["_k_maxpool_fwd", "_k_maxpool_bwd"],
                      device={"_d_window": "_window_py"})


def _flat(a: Any, what: str) -> Any:
    if not a.flags["C_CONTIGUOUS"]:
        raise ValueError(f"{what} must be C-contiguous on the device")
    return a.reshape(-1)


def _geom(x_shape, y_shape, kernel, stride, padding) -> tuple:
    n, c, h, w = x_shape
    return (n * c, h, w, y_shape[2], y_shape[3], *kernel, *stride, *padding)


# ----------------------------------------------------------------------------- public API
def maxpool2d_forward(x: np.ndarray, y: np.ndarray, idx: np.ndarray, kernel: Pair,
                      stride: Pair, padding: Pair = (0, 0), threads: int | None = None,
                      stream: Any = None) -> None:
    """Write the max pooling of ``x`` into ``y`` and the argmax window index into ``idx``
    (NumPy arrays: Numba CPU kernels; device arrays: CUDA on ``stream``, half ones on their
    bits, :mod:`.pool_half`)."""
    if _cuda.choose("auto", x, y, idx) == "cuda":
        if half_device(x, y):
            maxpool2d_forward_half(x, y, idx, kernel, stride, padding, stream=stream)
            return
        low = np.array(-np.inf, dtype=y.dtype)[()]
        _cuda.launch(_kernels().k_maxpool_fwd, y.size, _flat(x, "x"), _flat(y, "y"),
                     _flat(idx, "idx"), *_geom(x.shape, y.shape, kernel, stride, padding), low,
                     stream=stream)
        return
    _run_pool(_maxpool_fwd, _maxpool_fwd_par, (x,), (y, idx), x.shape[0] * x.shape[1], x.size,
              (*kernel, *stride, *padding), threads)


def maxpool2d_backward(dy: np.ndarray, idx: np.ndarray, dx: np.ndarray, kernel: Pair,
                       stride: Pair, padding: Pair = (0, 0), threads: int | None = None,
                       stream: Any = None) -> None:
    """Overwrite ``dx`` with ``dy`` scattered to the argmax of each window (device arrays:
    CUDA on ``stream``; half ones on their bits when :func:`maxpool_half_exact`)."""
    if _cuda.choose("auto", dy, idx, dx) == "cuda":
        if half_device(dy, dx) and maxpool_half_exact(kernel, stride):
            maxpool2d_backward_half(dy, idx, dx, kernel, stride, padding, stream=stream)
            return
        zero = np.zeros((), dtype=dx.dtype)[()]
        _cuda.launch(_kernels().k_maxpool_bwd, dx.size, _flat(dy, "dy"), _flat(idx, "idx"),
                     _flat(dx, "dx"), *_geom(dx.shape, dy.shape, kernel, stride, padding), zero,
                     stream=stream)
        return
    nplanes = dx.shape[0] * dx.shape[1]
    bits = SAME_WIDTH_INT.get(dx.dtype.itemsize)
    if (tuple(kernel) == (2, 2) and tuple(stride) == (2, 2) and tuple(padding) == (0, 0)
            and dx.shape[2:] == (2 * dy.shape[2], 2 * dy.shape[3]) and bits is not None):
        # windows tile the plane: every element written once, on the floats' bits
        out = _writable(dx)
        g = np.ascontiguousarray(dy, dtype=dx.dtype)
        _run_pool(_maxpool_bwd_tiled, _maxpool_bwd_tiled_par, (g.view(bits), idx),
                  (out.view(bits),), nplanes, dx.size, (), threads)
        if out is not dx:
            dx[...] = out
        return
    _run_pool(_maxpool_bwd, _maxpool_bwd_par, (dy, idx), (dx,), nplanes, dx.size,
              (*kernel, *stride, *padding), threads)


def avgpool2d_forward(x: np.ndarray, y: np.ndarray, kernel: Pair, stride: Pair,
                      padding: Pair = (0, 0), threads: int | None = None) -> None:
    """Write the average pooling of ``x`` (padding counted) into ``y`` (device arrays: array
    operations, :func:`~.pool_device.avgpool2d_forward_device`)."""
    if _cuda.choose("auto", x, y) == "cuda":
        avgpool2d_forward_device(x, y, kernel, stride, padding)
        return
    _run_pool(_avgpool_fwd, _avgpool_fwd_par, (x,), (y,), x.shape[0] * x.shape[1], x.size,
              (*kernel, *stride, *padding), threads)


def avgpool2d_backward(dy: np.ndarray, dx: np.ndarray, kernel: Pair, stride: Pair,
                       padding: Pair = (0, 0), threads: int | None = None) -> None:
    """Overwrite ``dx`` with the gradient of average pooling (device arrays:
    :func:`~.pool_device.avgpool2d_backward_device`)."""
    if _cuda.choose("auto", dy, dx) == "cuda":
        avgpool2d_backward_device(dy, dx, kernel, stride, padding)
        return
    _run_pool(_avgpool_bwd, _avgpool_bwd_par, (dy,), (dx,), dx.shape[0] * dx.shape[1], dx.size,
              (*kernel, *stride, *padding), threads)
