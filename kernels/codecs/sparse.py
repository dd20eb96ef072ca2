"""Sparse encodings of (mostly zero) ReLU outputs into one byte buffer, and decoding back.

Two formats, after Gist's SSDC and cDMA's zero-value compression: ``"csr"`` (the flattened array
cut into rows of ``row_width`` elements; values, narrow column indices, row pointers) and
``"zvc"`` (a 1-bit non-zero mask plus the non-zero values). ``"dense"`` is the raw bytes.

"Zero" means all bits zero (+0.0): -0.0 and NaN count as non-zero and values are copied as raw
bit patterns, so decoding is bit-exact for any input. Any dtype of itemsize 1, 2, 4 or 8 works
(float32 and float64 in practice).

Planner workflow: ``nnz = count_nonzero(x)``; ``e = choose_encoding(x.size, nnz, itemsize)``
(never larger than dense); allocate ``e.nbytes`` bytes; ``encode(x, buf, e.fmt, e.row_width)``
returns that same count; later ``decode(buf, out)``. ``encoded_nbytes`` sizes a block ahead.

The byte layout is described in :mod:`minidl.kernels.codecs.sparse_format`.

``impl`` and ``stream`` as in :mod:`bitpack`. The Numba CPU kernels run two passes over the
input (per-chunk counts, then the writes); CUDA kernels (:mod:`.sparse_device`) give one
chunk or row per thread.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit, prange

from .. import _cuda
from .bitpack import _prefetch
from .sparse_device import _cuda_scan, _kernels, _put_header
from .sparse_format import (
    FORMATS,
    HEADER_DTYPE,
    HEADER_NBYTES,
    Encoding,
    Header,
    _bits,
    _csr_arrays,
    _encode_numpy,
    _header_bytes,
    _layout,
    choose_encoding,
    encoded_nbytes,
    read_header,
)

# the byte format lives in sparse_format (its public names stay importable from here), the
# CUDA kernels in sparse_device
__all__ = ["FORMATS", "HEADER_DTYPE", "HEADER_NBYTES", "Encoding", "Header", "choose_encoding",
           "count_nonzero", "decode", "encode", "encoded_nbytes", "read_header"]


_C = 1 << 16  # elements per CPU task (multiple of 8)
_CC = 256  # elements per CUDA thread (zvc; multiple of 8)
_AHEAD = 1024  # prefetch distance in elements of the compaction loops


# ----------------------------------------------------------------------------- Numba CPU
@njit(cache=True)
def _count_body(v, zero):
    s = 0
    for i in range(v.size):
        s += np.intp(v[i] != zero)
    return s


@njit(cache=True, parallel=True)
def _count_nb(xb, zero):
    n = xb.size
    total = 0
    for t in prange((n + _C - 1) // _C):
        total += _count_body(xb[t * _C: min(n, t * _C + _C)], zero)
    return total


@njit(cache=True)
def _counts_body(xb, counts, size, zero):
    """``counts[r]`` = non-zeros of ``xb[r * size:(r + 1) * size]`` (chunks or csr rows)."""
    for r in range(counts.size):
        counts[r] = _count_body(xb[r * size: min(xb.size, r * size + size)], zero)


@njit(cache=True, parallel=True)
def _counts_nb(xb, counts, size, zero):
    per = max(1, _C // size)
    for t in prange((counts.size + per - 1) // per):
        r0 = t * per
        r1 = min(counts.size, r0 + per)
        _counts_body(xb[r0 * size: min(xb.size, r1 * size)], counts[r0:r1], size, zero)


@njit(cache=True)
def _last_nonzero(xs, zero):
    """Index of the last non-zero of ``xs`` (-1 if none)."""
    i = xs.size - 1
    while i >= 0 and xs[i] == zero:
        i -= 1
    return i


@njit(cache=True)
def _zvc_body(xs, mask, vals, zero):
    """One chunk, one pass: mask bytes and compaction. ``vals`` is exactly the chunk's non-zeros.
    Groups of 8 up to the last non-zero are branch-free: each value is written at ``pos`` and a
    zero is overwritten by the next non-zero, which exists, so nothing lands past ``vals``."""
    m = xs.size
    last = _last_nonzero(xs, zero)
    pos = np.uint64(0)
    for j in range(m // 8):
        if j & 1 == 0:
            _prefetch(xs, 8 * j + _AHEAD)
        b = 0
        if 8 * j + 7 <= last:
            for k in range(8):
                v = xs[8 * j + k]
                nz = v != zero
                vals[pos] = v
                pos += np.uint64(nz)
                b |= np.intp(nz) << k
        else:
            for k in range(8):
                v = xs[8 * j + k]
                if v != zero:
                    vals[pos] = v
                    pos += np.uint64(1)
                    b |= 1 << k
        mask[j] = b
    if m % 8:
        b = 0
        for i in range(m - m % 8, m):
            v = xs[i]
            if v != zero:
                vals[pos] = v
                pos += np.uint64(1)
                b |= 1 << (i % 8)
        mask[m // 8] = b


@njit(cache=True, parallel=True)
def _zvc_encode_nb(xb, mask, vals, offsets, zero):
    n = xb.size
    for t in prange(offsets.size - 1):
        lo = t * _C
        hi = min(n, lo + _C)
        _zvc_body(xb[lo:hi], mask[lo // 8: (hi + 7) // 8], vals[offsets[t]: offsets[t + 1]],
                  zero)


@njit(cache=True)
def _popcount8(b):
    b = b - ((b >> 1) & 0x55)
    b = (b & 0x33) + ((b >> 2) & 0x33)
    return (b + (b >> 4)) & 0x0F


@njit(cache=True, parallel=True)
def _mask_counts_nb(mask, counts):
    nb = mask.size
    per = _C // 8
    for t in prange(counts.size):
        s = 0
        for j in range(t * per, min(nb, t * per + per)):
            s += _popcount8(np.intp(mask[j]))
        counts[t] = s


@njit(cache=True)
def _zvc_dec_body(mask, vals, out, zero):
    """One chunk. Branch-free up to the last set bit (``vals[pos] * bit``; never reads past
    ``vals``), then zeros."""
    m = out.size
    j = mask.size - 1
    while j >= 0 and mask[j] == 0:
        j -= 1
    last = -1
    if j >= 0:
        k = 7
        while (mask[j] >> k) & 1 == 0:
            k -= 1
        last = 8 * j + k
    pos = np.uint64(0)
    for jj in range(max(0, j)):
        b = np.uint64(mask[jj])
        for k in range(8):
            bit = (b >> np.uint64(k)) & np.uint64(1)
            out[8 * jj + k] = vals[pos] * bit
            pos += bit
    for i in range(8 * max(0, j), last + 1):
        bit = np.uint64((mask[i >> 3] >> (i & 7)) & 1)
        out[i] = vals[pos] * bit
        pos += bit
    for i in range(last + 1, m):
        out[i] = zero


@njit(cache=True, parallel=True)
def _zvc_decode_nb(mask, vals, offsets, out, zero):
    n = out.size
    for t in prange(offsets.size - 1):
        lo = t * _C
        hi = min(n, lo + _C)
        _zvc_dec_body(mask[lo // 8: (hi + 7) // 8], vals[offsets[t]: offsets[t + 1]],
                      out[lo:hi], zero)


@njit(cache=True)
def _csr_encode_rows(xb, w, rowptr, vals, cols, r0, r1, zero):
    """Rows ``r0:r1``: branch-free compaction (as in ``_zvc_body``) up to their last non-zero;
    the position carries over from row to row."""
    end = r0 * w + _last_nonzero(xb[r0 * w: min(xb.size, r1 * w)], zero) + 1
    pos = np.uint64(rowptr[r0])
    for r in range(r0, r1):
        lo = r * w
        hi = min(lo + w, end)
        i = lo
        while i + 16 <= hi:  # whole cache lines: fixed trip count, one prefetch each
            _prefetch(xb, i + _AHEAD)
            for k in range(16):
                v = xb[i + k]
                vals[pos] = v
                cols[pos] = i + k - lo
                pos += np.uint64(v != zero)
            i += 16
        for j in range(i, hi):
            v = xb[j]
            vals[pos] = v
            cols[pos] = j - lo
            pos += np.uint64(v != zero)


@njit(cache=True, parallel=True)
def _csr_encode_nb(xb, w, rowptr, vals, cols, r0, r1, zero):
    per = max(1, _C // w)
    for t in prange((r1 - r0 + per - 1) // per):
        a = r0 + t * per
        _csr_encode_rows(xb, w, rowptr, vals, cols, a, min(r1, a + per), zero)


@njit(cache=True)
def _csr_decode_rows(vals, cols, rowptr, out, w, r0, r1, zero):
    for r in range(r0, r1):
        lo = r * w
        for c in range(min(w, out.size - lo)):
            out[lo + c] = zero
        for p in range(rowptr[r], rowptr[r + 1]):
            out[lo + np.intp(cols[p])] = vals[p]


@njit(cache=True, parallel=True)
def _csr_decode_nb(vals, cols, rowptr, out, w, r0, r1, zero):
    per = max(1, _C // w)
    for t in prange((r1 - r0 + per - 1) // per):
        a = r0 + t * per
        _csr_decode_rows(vals, cols, rowptr, out, w, a, min(r1, a + per), zero)


# ----------------------------------------------------------------------------- public API
def count_nonzero(x: Any, *, impl: str = "auto", stream: Any = None) -> int:
    """Number of elements whose bits are not all zero (-0.0 and NaN count; +0.0 does not)."""
    impl = _cuda.choose(impl, x)
    xb = _bits(x if _cuda.is_device_array(x) else np.ascontiguousarray(x))
    zero = xb.dtype.type(0)
    if impl == "numpy":
        return int(np.count_nonzero(xb))
    if impl == "numba":
        return int((_count_body if xb.size <= _C else _count_nb)(xb, zero))
    k = _kernels()
    counts = _cuda.empty(x, (xb.size + _CC - 1) // _CC, np.int64)
    _cuda.launch(k.k_counts, counts.size, xb, counts, xb.size, _CC, zero, stream=stream)
    return _cuda_scan(x, counts, stream=stream)[1]


def encode(x: Any, buf: Any, fmt: str = "zvc", row_width: int = 256, *, impl: str = "auto",
           stream: Any = None, nnz: int | None = None) -> int:
    """Encode ``x`` (flattened, C order) into the bytes of ``buf``; return the bytes used.

    ``buf``: any C-contiguous host or device buffer of at least
    ``encoded_nbytes(x.size, count_nonzero(x), fmt, x.dtype.itemsize, row_width)`` bytes
    (``ValueError`` before anything is written if it is smaller). ``row_width`` is for csr.
    ``nnz``: ``count_nonzero(x)`` when the caller has it (on a device, the encoder then never
    reads the count back: no host synchronisation).
    """
    impl = _cuda.choose(impl, x, buf)
    dev = impl == "cuda"
    xb = _bits(x if dev else np.ascontiguousarray(x))
    n, isz, zero = xb.size, xb.dtype.itemsize, xb.dtype.type(0)
    if fmt == "dense":
        b = _cuda.byte_view(buf, n * isz, "buf")
        if dev:
            _cuda.copy(b, xb.view(np.uint8))
        else:
            b[:] = xb.view(np.uint8)
        return n * isz
    _layout(n, 0, fmt, isz, row_width)  # validates fmt and row_width
    if impl == "numpy":
        return _encode_numpy(xb, buf, fmt, row_width)
    size = _C if fmt == "zvc" and not dev else _CC if fmt == "zvc" else row_width
    nch = (n + size - 1) // size
    if dev:
        k = _kernels()
        counts = _cuda.empty(x, nch, np.int64)
        _cuda.launch(k.k_counts, nch, xb, counts, n, size, zero, stream=stream)
        offsets, nnz = _cuda_scan(x, counts, stream=stream, total=nnz)
    else:
        counts = np.empty(nch, np.int64)
        (_counts_body if n <= _C else _counts_nb)(xb, counts, size, zero)
        offsets = np.zeros(nch + 1, np.int64)
        np.cumsum(counts, out=offsets[1:])
        nnz = int(offsets[-1])
    lay = _layout(n, nnz, fmt, isz, row_width)
    b = _cuda.byte_view(buf, lay.total, "buf")
    hdr = _header_bytes(fmt, n, nnz, isz, row_width, lay)
    vals = b[lay.vals: lay.vals + nnz * isz].view(xb.dtype)
    if fmt == "zvc":
        mask = b[lay.meta: lay.meta + (n + 7) // 8]
        if dev:
            _put_header(b, hdr, stream)
            _cuda.launch(k.k_zvc_encode, nch, xb, mask, vals, offsets, n, size, zero,
                         stream=stream)
        else:
            b[:HEADER_NBYTES] = hdr
            if nch == 1:
                _zvc_body(xb, mask, vals, zero)
            elif nch:
                _zvc_encode_nb(xb, mask, vals, offsets, zero)
        return lay.total
    ptr, cols = _csr_arrays(b, lay)
    if dev:
        _put_header(b, hdr, stream)
        _cuda.exclusive_scan(counts, ptr, stream)
        _cuda.launch(k.k_csr_encode, lay.rows, xb, ptr, vals, cols, n, row_width, zero,
                     stream=stream)
    else:
        b[:HEADER_NBYTES] = hdr
        ptr[:] = offsets
        if nch:
            (_csr_encode_rows if n <= _C else _csr_encode_nb)(xb, row_width, offsets, vals, cols,
                                                               0, nch, zero)
    return lay.total


def decode(buf: Any, out: Any, fmt: str | None = None, *, impl: str = "auto",
           stream: Any = None, header: Header | None = None) -> Any:
    """Decode ``buf`` into ``out`` (C-contiguous, ``n`` elements of the encoded itemsize);
    the format comes from the header, or ``fmt="dense"`` for raw bytes. Returns ``out``.
    ``header``: the buffer's header when the caller has it (:func:`header_for`; on a device
    the buffer's own is then not read back: no host synchronisation)."""
    impl = _cuda.choose(impl, buf, out)
    dev = impl == "cuda"
    if not out.flags["C_CONTIGUOUS"]:
        raise ValueError("out must be C-contiguous")
    ob = _bits(out)
    zero = ob.dtype.type(0)
    if fmt == "dense":
        src = _cuda.byte_view(buf, out.nbytes, "buf")
        if dev:
            _cuda.copy(ob.view(np.uint8), src)
        else:
            ob.view(np.uint8)[:] = src
        return out
    h = read_header(buf) if header is None else header
    if fmt not in (None, h.fmt):
        raise ValueError(f"buffer holds {h.fmt}, fmt={fmt!r} given")
    if h.n != ob.size or h.itemsize != ob.dtype.itemsize:
        raise ValueError(f"buffer holds {h.n} items of {h.itemsize} bytes; out has {ob.size} "
                         f"of {ob.dtype.itemsize}")
    lay = _layout(h.n, h.nnz, h.fmt, h.itemsize, h.row_width or 256)
    b = _cuda.byte_view(buf, lay.total, "buf")
    vals = b[lay.vals: lay.vals + h.nnz * h.itemsize].view(ob.dtype)
    n = h.n
    if h.fmt == "zvc":
        mask = b[lay.meta: lay.total]
        if impl == "numpy":
            nzm = np.unpackbits(mask, count=n, bitorder="little").view(bool)
            ob[:] = 0
            ob[nzm] = vals
        elif dev:
            k = _kernels()
            nch = (n + _CC - 1) // _CC
            counts = _cuda.empty(out, nch, np.int64)
            offsets = _cuda.empty(out, nch + 1, np.int64)
            _cuda.launch(k.k_mask_counts, nch, mask, counts, _CC // 8, stream=stream)
            _cuda.exclusive_scan(counts, offsets, stream)
            _cuda.launch(k.k_zvc_decode, nch, mask, vals, offsets, ob, n, _CC, zero,
                         stream=stream)
        elif 0 < n <= _C:
            _zvc_dec_body(mask, vals, ob, zero)
        elif n:
            counts = np.empty((n + _C - 1) // _C, np.int64)
            _mask_counts_nb(mask, counts)
            offsets = np.zeros(counts.size + 1, np.int64)
            np.cumsum(counts, out=offsets[1:])
            _zvc_decode_nb(mask, vals, offsets, ob, zero)
        return out
    w = h.row_width
    ptr, cols = _csr_arrays(b, lay)
    if impl == "numpy":
        rows = np.repeat(np.arange(lay.rows), np.diff(ptr.astype(np.int64)))
        ob[:] = 0
        ob[rows * w + cols] = vals
    elif dev:
        _cuda.launch(_kernels().k_csr_decode, lay.rows, vals, cols, ptr, ob, n, w, zero,
                     stream=stream)
    elif n:
        (_csr_decode_rows if n <= _C else _csr_decode_nb)(vals, cols, ptr.astype(np.int64), ob,
                                                          w, 0, lay.rows, zero)
    return out
