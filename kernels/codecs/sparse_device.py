"""The CUDA kernels of :mod:`.sparse` (one chunk or csr row per thread) and the device steps
around them: the exclusive scan of the per-chunk counts and the header written by a kernel."""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any

import numpy as np

from .. import _cuda
from .sparse_format import HEADER_NBYTES

cuda: Any = None  # numba.cuda, set by _cuda.bind on first CUDA use


# ----------------------------------------------------------------------------- CUDA
def _chunk_stop_py(t, size, n):
    """End of chunk (or csr row) ``t`` of ``size`` items among ``n``: ``min(t * size + size,
    n)``, without the ``min`` builtin (see :mod:`._cuda`'s notes)."""
    stop = t * size + size
    return stop if stop < n else n


_d_chunk_stop: Any = None  # its CUDA device version (_kernels: bind's device=)


def _k_counts(xb, counts, n, size, zero):
    for t in range(cuda.grid(1), counts.size, cuda.gridsize(1)):
        s = 0
        for i in range(t * size, _d_chunk_stop(t, size, n)):
            if xb[i] != zero:
                s += 1
        counts[t] = s


def _k_zvc_encode(xb, mask, vals, offsets, n, size, zero):
    for t in range(cuda.grid(1), offsets.size - 1, cuda.gridsize(1)):
        lo = t * size
        hi = _d_chunk_stop(t, size, n)
        pos = offsets[t]
        for j in range(lo // 8, (hi + 7) // 8):
            b = 0
            for k in range(8):
                i = 8 * j + k
                if i < hi and xb[i] != zero:
                    vals[pos] = xb[i]
                    pos += 1
                    b |= 1 << k
            mask[j] = b


def _k_mask_counts(mask, counts, size_bytes):
    for t in range(cuda.grid(1), counts.size, cuda.gridsize(1)):
        s = 0
        for j in range(t * size_bytes, _d_chunk_stop(t, size_bytes, mask.size)):
            s += cuda.popc(np.uint32(mask[j]))
        counts[t] = s


def _k_zvc_decode(mask, vals, offsets, out, n, size, zero):
    for t in range(cuda.grid(1), offsets.size - 1, cuda.gridsize(1)):
        pos = offsets[t]
        for i in range(t * size, _d_chunk_stop(t, size, n)):
            if (mask[i >> 3] >> (i & 7)) & 1:
                out[i] = vals[pos]
                pos += 1
            else:
                out[i] = zero


def _k_csr_encode(xb, rowptr, vals, cols, n, w, zero):
    for r in range(cuda.grid(1), rowptr.size - 1, cuda.gridsize(1)):
        pos = rowptr[r]
        for i in range(r * w, _d_chunk_stop(r, w, n)):
            if xb[i] != zero:
                vals[pos] = xb[i]
                cols[pos] = i - r * w
                pos += 1


def _k_csr_decode(vals, cols, rowptr, out, n, w, zero):
    for r in range(cuda.grid(1), rowptr.size - 1, cuda.gridsize(1)):
        lo = r * w
        for i in range(lo, _d_chunk_stop(r, w, n)):
            out[i] = zero
        for p in range(rowptr[r], rowptr[r + 1]):
            out[lo + int(cols[p])] = vals[p]


@functools.cache
def _kernels() -> SimpleNamespace:
    return _cuda.bind(globals(), ["_k_counts", "_k_zvc_encode", "_k_mask_counts",
                                  "_k_zvc_decode", "_k_csr_encode", "_k_csr_decode",
                                  "_k_put_words"], device={"_d_chunk_stop": "_chunk_stop_py"})


def _k_put_words(dst, w0, w1, w2, w3):
    """``dst[:4] = (w0, w1, w2, w3)`` (uint64 words: a header written without a host copy)."""
    if cuda.grid(1) == 0:
        dst[0] = w0
        dst[1] = w1
        dst[2] = w2
        dst[3] = w3


def _cuda_scan(like: Any, counts: Any, offsets: Any = None, stream: Any = None,
               total: int | None = None) -> tuple[Any, int]:
    """Exclusive scan of device ``counts`` into ``offsets`` (new int64 if None); the total,
    read back from the device (a host synchronisation) unless the caller knows it."""
    if offsets is None:
        offsets = _cuda.empty(like, counts.size + 1, np.int64)
    _cuda.exclusive_scan(counts, offsets, stream)
    if total is None:
        total = int(_cuda.to_host(offsets[counts.size:])[0])
    return offsets, total


def _put_header(b: Any, hdr: np.ndarray, stream: Any) -> None:
    """The 32 header bytes into the device buffer ``b`` by one kernel (no host copy)."""
    words = [np.uint64(w) for w in hdr.view(np.uint64)]
    _cuda.run(_kernels().k_put_words, 1, 1, b[:HEADER_NBYTES].view(np.uint64), *words,
              stream=stream)
