"""Max-pool argmax indices packed into the fewest bits the window needs; max-pool backward
straight from the packed indices.

Index convention (the one ``kernels/pooling/pool.py`` uses for ``MaxPool2d``'s ``argmax`` stash):
the
window of output ``(n, c, oh, ow)`` starts at input row ``oh * sh - ph`` and column
``ow * sw - pw`` (padding counts as window positions), and its index is the row-major position
``di * kw + dj`` of the maximum inside the window, ``0 <= index < kh * kw``. The element it
names is ``(n, c, oh * sh - ph + di, ow * sw - pw + dj)``.

Bits per index: ``index_bits(kh * kw)`` = 1 for windows of at most 2 elements, 2 for at most 4
(2x2), 4 for at most 16 (3x3, 4x4), 8 for at most 256. Layout: index ``i`` of the flattened
``(N, C, Ho, Wo)`` array takes bits ``[(i * b) % 8, (i * b) % 8 + b)`` of byte
``(i * b) // 8``, least significant first (so ``b = 1`` is :mod:`bitpack`'s bit order);
``packed_index_nbytes(n, b) = ceil(n * b / 8)`` bytes, unused high bits of the last byte are 0.

``impl`` and ``stream`` as in :mod:`bitpack`. The backward is bit-identical across the three
implementations: every ``dx`` element sums its contributions from 0 in row-major output order
(scatter on the CPU, a gather per input element on CUDA, so no atomics).
"""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any

import numpy as np
from numba import njit, prange

from .. import _cuda
from ..array_api import half_device
from ..codecs.bitpack import _check_size, _into, _run, _shape
from .pool_half import maxpool_backward_packed_half, maxpool_half_exact

cuda: Any = None  # numba.cuda, set by _cuda.bind on first CUDA use
_CHUNK = 1 << 15  # packed bytes per parallel task
Pair = tuple[int, int]


def index_bits(window: int) -> int:
    """Bits per window index for a window of ``window`` (= kh * kw) elements: 1, 2, 4 or 8."""
    if window < 1 or window > 256:
        raise ValueError(f"window of {window} elements: packed indices support 1..256")
    return 1 if window <= 2 else 2 if window <= 4 else 4 if window <= 16 else 8


def packed_index_nbytes(n: int, bits: int) -> int:
    """Bytes of ``n`` packed indices of ``bits`` bits: ``ceil(n * bits / 8)``."""
    _check_bits(bits)
    return (int(n) * bits + 7) // 8


def _check_bits(bits: int) -> None:
    if bits not in (1, 2, 4, 8):
        raise ValueError(f"bits must be 1, 2, 4 or 8, got {bits}")


def _pair(v: int | tuple[int, int]) -> Pair:
    return (int(v), int(v)) if np.isscalar(v) else (int(v[0]), int(v[1]))


# ----------------------------------------------------------------------------- Numba CPU
# Serial bodies and parallel drivers as in bitpack (small inputs run the body directly).
@njit(cache=True, error_model="numpy")
def _pack_body(idx, out, bits):
    per = 8 // bits
    m = (1 << bits) - 1
    nfull = idx.size // per
    for j in range(nfull):
        b = 0
        for k in range(per):
            b |= (np.intp(idx[per * j + k]) & m) << (k * bits)
        out[j] = b
    if nfull < out.size:
        b = 0
        for k in range(idx.size - per * nfull):
            b |= (np.intp(idx[per * nfull + k]) & m) << (k * bits)
        out[nfull] = b


@njit(cache=True, parallel=True, error_model="numpy")
def _pack_nb(idx, out, bits):
    per = 8 // bits
    for t in prange((out.size + _CHUNK - 1) // _CHUNK):
        lo = t * _CHUNK
        hi = min(out.size, lo + _CHUNK)
        _pack_body(idx[per * lo: min(idx.size, per * hi)], out[lo:hi], bits)


@njit(cache=True, error_model="numpy")
def _unpack_body(packed, out, bits):
    m = (1 << bits) - 1
    for i in range(out.size):
        s = i * bits
        out[i] = (packed[s >> 3] >> (s & 7)) & m


@njit(cache=True, parallel=True, error_model="numpy")
def _unpack_nb(packed, out, bits):
    step = 8 * _CHUNK  # elements per task: a whole number of bytes for any bits
    for t in prange((out.size + step - 1) // step):
        lo = t * step
        _unpack_body(packed[lo * bits // 8:], out[lo: min(out.size, lo + step)], bits)


@njit(cache=True, error_model="numpy")
def _maxpool_bwd_planes(dy, packed, dx, p0, p1, bits, kh, kw, sh, sw, ph, pw):
    """Planes ``p0:p1`` of ``dy`` (P, Ho, Wo) and ``dx`` (P, H, W): zero ``dx``, then add
    each ``dy`` at its argmax, outputs in row-major order."""
    ho, wo = dy.shape[1], dy.shape[2]
    h, w = dx.shape[1], dx.shape[2]
    m = (1 << bits) - 1
    tiled = (kh == 2 and kw == 2 and sh == 2 and sw == 2 and ph == 0 and pw == 0
             and h == 2 * ho and w == 2 * wo)
    z = dx.dtype.type(0)
    for p in range(p0, p1):
        if tiled:  # windows tile the plane: each element written once, no zeroing pass
            for oh in range(ho):
                for ow in range(wo):
                    s = ((p * ho + oh) * wo + ow) * bits
                    k = (packed[s >> 3] >> (s & 7)) & m
                    g = dy[p, oh, ow]
                    dx[p, 2 * oh, 2 * ow] = g if k == 0 else z
                    dx[p, 2 * oh, 2 * ow + 1] = g if k == 1 else z
                    dx[p, 2 * oh + 1, 2 * ow] = g if k == 2 else z
                    dx[p, 2 * oh + 1, 2 * ow + 1] = g if k == 3 else z
            continue
        dx[p] = 0
        for oh in range(ho):
            for ow in range(wo):
                s = ((p * ho + oh) * wo + ow) * bits
                k = (packed[s >> 3] >> (s & 7)) & m
                di = k // kw
                r = oh * sh - ph + di
                c = ow * sw - pw + k - di * kw
                if 0 <= r < h and 0 <= c < w:
                    dx[p, r, c] += dy[p, oh, ow]


@njit(cache=True, parallel=True, error_model="numpy")
def _maxpool_bwd_nb(dy, packed, dx, p0, p1, bits, kh, kw, sh, sw, ph, pw):
    for p in prange(p0, p1):
        _maxpool_bwd_planes(dy, packed, dx, p, p + 1, bits, kh, kw, sh, sw, ph, pw)


# ----------------------------------------------------------------------------- CUDA
def _k_pack(idx, out, n, bits):
    per = 8 // bits
    m = (1 << bits) - 1
    for j in range(cuda.grid(1), out.size, cuda.gridsize(1)):
        b = 0
        for k in range(per):
            i = per * j + k
            if i < n:
                b |= (int(idx[i]) & m) << (k * bits)
        out[j] = b


def _k_unpack(packed, out, n, bits):
    m = (1 << bits) - 1
    for i in range(cuda.grid(1), n, cuda.gridsize(1)):
        s = i * bits
        out[i] = (packed[s >> 3] >> (s & 7)) & m


def _k_maxpool_bwd(dy, packed, dx, npl, h, w, ho, wo, bits, kh, kw, sh, sw, ph, pw, zero):
    """Gather: each ``dx`` element sums, in row-major order, the outputs whose argmax it is."""
    m = (1 << bits) - 1
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
                s = e * bits
                k = (packed[s >> 3] >> (s & 7)) & m
                if k == (hp - oh * sh) * kw + (wp - ow * sw):
                    acc += dy[e]
        dx[t] = acc


@functools.cache
def _kernels() -> SimpleNamespace:
    return _cuda.bind(globals(), ["_k_pack", "_k_unpack", "_k_maxpool_bwd"])


# ----------------------------------------------------------------------------- public API
def pack_indices(idx: Any, bits: int, out: Any = None, *, impl: str = "auto",
                 stream: Any = None) -> Any:
    """Pack window indices (any integer dtype, values in ``[0, 2**bits)``; only the low ``bits``
    bits are kept) into ``packed_index_nbytes(idx.size, bits)`` bytes; returns them."""
    impl = _cuda.choose(impl, idx, out)
    n = idx.size
    nb = packed_index_nbytes(n, bits)
    if impl == "cuda":
        o = _cuda.empty(idx, nb, np.uint8) if out is None else _cuda.byte_view(out, nb)
        _cuda.launch(_kernels().k_pack, nb, _cuda.flat(idx, "idx"), o, n, bits, stream=stream)
        return o
    o = np.empty(nb, np.uint8) if out is None else _cuda.byte_view(out, nb)
    flat = np.ravel(idx)
    if impl == "numpy":
        per = 8 // bits
        v = np.zeros(nb * per, np.uint8)
        v[:n] = flat.astype(np.intp) & ((1 << bits) - 1)
        shifts = (np.arange(per, dtype=np.uint8) * bits).astype(np.uint8)
        o[:] = np.bitwise_or.reduce(v.reshape(nb, per) << shifts, axis=1)
    else:
        _run(_pack_nb, _pack_body, n, flat, o, bits)
    return o


def unpack_indices(packed: Any, bits: int, shape: int | tuple[int, ...], out: Any = None,
                   dtype: Any = np.uint8, *, impl: str = "auto", stream: Any = None) -> Any:
    """Unpack indices made by :func:`pack_indices`: into ``out`` (``prod(shape)`` elements, any
    layout) and return it, or into a new array of ``shape`` and ``dtype``."""
    impl = _cuda.choose(impl, packed, out)
    shape = _shape(shape)
    n = int(np.prod(shape))
    pk = _cuda.byte_view(packed, packed_index_nbytes(n, bits), "packed")
    if impl == "cuda":
        o = _cuda.empty(packed, n, dtype) if out is None else _cuda.flat(out)
        _cuda.launch(_kernels().k_unpack, n, pk, o, n, bits, stream=stream)
        return o.reshape(shape)
    o = np.empty(shape, dtype) if out is None else _check_size(out, n)
    if impl == "numpy":
        per = 8 // bits
        shifts = (np.arange(per, dtype=np.uint8) * bits).astype(np.uint8)
        v = (pk[:, None] >> shifts) & np.uint8((1 << bits) - 1)
        o[...] = v.reshape(-1)[:n].reshape(o.shape)
    elif n:
        _into(o, lambda f: _run(_unpack_nb, _unpack_body, n, pk, f, bits))
    return o


def maxpool_backward_packed(dy: Any, packed: Any, x_shape: tuple[int, int, int, int],
                            kernel: int | Pair, stride: int | Pair | None = None,
                            padding: int | Pair = 0, out: Any = None, *, impl: str = "auto",
                            stream: Any = None) -> Any:
    """Max-pool backward from packed argmax indices (``index_bits(kh * kw)`` bits each).

    ``dy`` is ``(N, C, Ho, Wo)``; ``out`` (default: new) is ``dx`` of ``x_shape``
    ``(N, C, H, W)``, overwritten: zeroed, then each ``dy`` element added at its window's
    argmax (overlapping windows accumulate; targets outside the input are dropped).
    ``stride`` defaults to ``kernel``. Returns ``dx``. Half device arrays (float16 /
    bfloat16) with non-overlapping windows (:func:`~.pool_half.maxpool_half_exact`) run on
    their bits, exactly the float32 kernel's result rounded to half (:mod:`.pool_half`).
    """
    impl = _cuda.choose(impl, dy, packed, out)
    kh, kw = _pair(kernel)
    sh, sw = _pair(kernel if stride is None else stride)
    ph, pw = _pair(padding)
    bits = index_bits(kh * kw)
    n, c, h, w = (int(s) for s in x_shape)
    if len(dy.shape) != 4 or tuple(dy.shape[:2]) != (n, c):
        raise ValueError(f"dy shape {tuple(dy.shape)} does not match x_shape {tuple(x_shape)}")
    ho, wo = int(dy.shape[2]), int(dy.shape[3])
    pk = _cuda.byte_view(packed, packed_index_nbytes(dy.size, bits), "packed")
    if impl == "cuda":
        o = _cuda.empty(dy, n * c * h * w, dy.dtype) if out is None else _cuda.flat(out)
        if half_device(dy, o) and maxpool_half_exact((kh, kw), (sh, sw)):
            maxpool_backward_packed_half(dy, pk, o, (n, c, h, w), bits, (kh, kw), (sh, sw),
                                         (ph, pw), stream=stream)
            return o.reshape((n, c, h, w))
        _cuda.launch(_kernels().k_maxpool_bwd, o.size, _cuda.flat(dy, "dy"), pk, o, n * c, h, w,
                     ho, wo, bits, kh, kw, sh, sw, ph, pw, o.dtype.type(0), stream=stream)
        return o.reshape((n, c, h, w))
    o = np.empty((n, c, h, w), dy.dtype) if out is None else out
    if o.shape != (n, c, h, w):
        raise ValueError(f"out shape {o.shape} != x_shape {(n, c, h, w)}")
    if impl == "numpy":
        idx = unpack_indices(pk, bits, dy.shape, dtype=np.int64, impl="numpy")
        dxp = np.zeros((n, c, h + 2 * ph, w + 2 * pw), o.dtype)
        di, dj = np.divmod(idx, kw)
        rows = np.arange(ho)[:, None] * sh + di
        cols = np.arange(wo)[None, :] * sw + dj
        keep = (rows < h + 2 * ph) & (cols < w + 2 * pw)
        nn, cc = np.meshgrid(np.arange(n), np.arange(c), indexing="ij")
        nn, cc = (np.broadcast_to(a[..., None, None], idx.shape) for a in (nn, cc))
        np.add.at(dxp, (nn[keep], cc[keep], rows[keep], cols[keep]), np.asarray(dy)[keep])
        o[...] = dxp[:, :, ph: ph + h, pw: pw + w]
    elif o.size:
        dy3 = np.ascontiguousarray(dy).reshape(n * c, ho, wo)
        _into(o, lambda f: _run(_maxpool_bwd_nb, _maxpool_bwd_planes, o.size, dy3, pk,
                                f.reshape(n * c, h, w), 0, n * c, bits, kh, kw, sh, sw, ph, pw))
    return o
