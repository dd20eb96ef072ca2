"""Matrix products too thin for BLAS: a few output rows.

OpenBLAS runs ``(6 x 25) @ (25 x 784)`` (LeNet-5's first convolution, one image) at about a
third of the rate of a plain Numba loop that adds four scaled rows of the right operand into
each output row at a time (measured on AMD EPYC, single thread: 20.0 against 6.3 us; 10
output rows 7.9 against 4.2 us; from 16 rows on the two are even, and BLAS wins from 32).
:func:`thin_mm` is that loop, with the signature of :func:`~minidl.kernels.blas.mm` for the
two orientations the im2col convolution needs on thin products; :func:`is_thin` says when it
pays. Each output element is summed in a fixed order (inner index ascending), so results do
not depend on threads; they differ from BLAS's in float rounding only.
"""

from __future__ import annotations

import numpy as np
from numba import njit

#: A product with at most this many output rows goes to :func:`thin_mm` ...
THIN_MAX = 12
#: ... while its right operand (read once per output row) stays in the L2 cache (elements).
#: A short inner dimension alone does not pay: (25 x 6) @ (6 x 784) measured 11.0 us here
#: against BLAS's 9.8, (32 x 9) @ (9 x 784) even.
THIN_MAX_RIGHT = 1 << 16


@njit(nogil=True, cache=True, inline="always", error_model="numpy")
def is_thin(m: int, n: int, k: int) -> bool:
    """Whether an ``m x n`` product over an inner dimension of ``k`` runs faster in
    :func:`thin_mm` than in BLAS."""
    return m <= THIN_MAX and k * n <= THIN_MAX_RIGHT


@njit(nogil=True, cache=True, error_model="numpy")
def thin_mm(a, b, c, ta, alpha, beta, m, n, k):
    """``c[:m, :n] = alpha * op(a) @ b[:k, :n] + beta * c[:m, :n]`` with ``op(a)`` ``a`` or,
    with ``ta``, ``a.T``; ``b`` C-contiguous, ``c`` any 2-D view (a block of an output plane).
    Each output row is built in a contiguous scratch row (so that the loops vectorise
    whatever ``c``'s strides), adding rows of ``b`` four at a time, then stored."""
    al = c.dtype.type(alpha)
    be = c.dtype.type(beta)
    acc = np.empty(n, c.dtype)
    k4 = k - k % 4
    for o in range(m):
        row = c[o]
        if beta == 0:
            acc[:] = 0
        else:
            for p in range(n):
                acc[p] = row[p] * be
        for q in range(0, k4, 4):
            if ta:
                w0, w1, w2, w3 = a[q, o], a[q + 1, o], a[q + 2, o], a[q + 3, o]
            else:
                w0, w1, w2, w3 = a[o, q], a[o, q + 1], a[o, q + 2], a[o, q + 3]
            w0, w1, w2, w3 = w0 * al, w1 * al, w2 * al, w3 * al
            b0, b1, b2, b3 = b[q], b[q + 1], b[q + 2], b[q + 3]
            for p in range(n):
                acc[p] = (((acc[p] + w0 * b0[p]) + w1 * b1[p]) + w2 * b2[p]) + w3 * b3[p]
        for q in range(k4, k):
            wv = (a[q, o] if ta else a[o, q]) * al
            bq = b[q]
            for p in range(n):
                acc[p] += wv * bq[p]
        for p in range(n):
            row[p] = acc[p]

