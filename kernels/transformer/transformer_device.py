"""Numba CUDA kernels of attention on device arrays: a strided batched GEMM and the row kernels.

:func:`bgemm` computes ``c[i, j] (=, +=) op(a[i, j]) @ op(b[i, j])`` on (B, H, rows, cols)
stacks of any strides — the heads of a fused ``qkv`` / ``attn`` tensor as the views
:mod:`.attention` makes of them — writing straight into ``c``: one launch, no copy, no
temporary. (CuPy's batched ``matmul`` would copy every operand that is not C-contiguous, which
a head view never is, and its output unless C-contiguous; its 2-D ``matmul`` copies a matrix
with strided rows too.) Each block computes a ``TILE x TILE`` tile of one matrix through
shared memory, summing over ``k`` in order, chunk by chunk, in the operands' dtype: one thread
owns each output element, so results do not depend on the launch shape. ``mode`` skips the
work a causal square product does not need: tiles wholly above the diagonal (``SKIP_UPPER``,
left unwritten), or the ``k`` chunks past the tile's last row (``K_LE_ROW``: ``op(a)`` lower
triangular) or before its first (``K_GE_ROW``: upper triangular); ``accumulate`` adds into
``c`` (``ADD``) or rescales its rows first (``RESCALE_ADD``: ``c = c * alpha[row] + ...``,
the running output of the blockwise form). It is a plain shared-memory tiling (no register
blocking, no tensor cores), well below cuBLAS's throughput on long sequences: the price of
reading the heads where they are (:func:`~.blas.batched_gemm` hands contiguous stacks to
CuPy's ``matmul``).

The row kernels are the device side of :mod:`.attention_rows` (same arguments, same float64
row statistics): softmax rows and the running softmax of one key tile run one block per row
(float64 block reductions in a fixed tree order), the others one thread per element; the
dropout hash is :mod:`.dropout`'s. :func:`online_finish` ends a row block of the blockwise
forward (``o /= l``, ``lse = log(l) + m``) in one launch.

Kernels follow :mod:`._cuda`'s rules: grid-stride loops over rows / tiles / elements, and
thread loops that let one emulated thread cover a block's work.
"""

from __future__ import annotations

import functools
import math
from types import SimpleNamespace
from typing import Any

import numpy as np

from .. import _cuda
from ..pointwise.dropout import _mix

cuda: Any = None  # numba.cuda, set by _cuda.bind on first CUDA use

#: Output tile side of :func:`bgemm` (a block of TILE * TILE threads owns one tile).
TILE = 16
#: Most threads of a row-reduction block; most blocks of a launch.
BLOCK = _cuda.BLOCK
MAX_BLOCKS = _cuda.MAX_BLOCKS
#: :func:`bgemm` modes (which part of a square causal product is computed).
FULL, SKIP_UPPER, K_LE_ROW, K_GE_ROW = 0, 1, 2, 3
#: :func:`bgemm` accumulation: overwrite ``c``, add into it, or rescale its rows and add.
WRITE, ADD, RESCALE_ADD = 0, 1, 2


# ---------------------------------------------------------------- device functions
def _block_max_py(part):
    """Maximum of ``part[:blockDim.x]`` (float64), as :func:`._cuda.block_sum_py` sums."""
    tid = cuda.threadIdx.x
    width = cuda.blockDim.x
    cuda.syncthreads()
    while width > 1:
        half = (width + 1) // 2
        if tid < width - half:
            other = part[tid + half]
            part[tid] = other if other > part[tid] else part[tid]
        cuda.syncthreads()
        width = half
    top = part[0]
    cuda.syncthreads()
    return top


_block_sum_py = _cuda.block_sum_py  # the block reduction, compiled as a device function
_mix_py = _mix.py_func  # the dropout hash, compiled as a device function
_d_block_sum: Any = None  # device versions (bind's device=)
_d_block_max: Any = None
_d_mix: Any = None


# ---------------------------------------------------------------- batched GEMM
def _k_bgemm(a, b, c, ta, tb, mode, accumulate, alpha):
    """``c[i, j] (=, +=) op(a[i, j]) @ op(b[i, j])`` tile by tile (module docstring)."""
    sa = cuda.shared.array((TILE, TILE), c.dtype)
    sb = cuda.shared.array((TILE, TILE), c.dtype)
    sc = cuda.shared.array((TILE, TILE), c.dtype)
    heads, m, n = c.shape[1], c.shape[2], c.shape[3]
    kdim = a.shape[2] if ta else a.shape[3]
    tm = (m + TILE - 1) // TILE
    tn = (n + TILE - 1) // TILE
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    for t in range(cuda.blockIdx.x, c.shape[0] * heads * tm * tn, cuda.gridDim.x):
        mat = t // (tm * tn)
        rest = t - mat * tm * tn
        bi = mat // heads
        hi = mat - bi * heads
        i0 = (rest // tn) * TILE
        j0 = (rest - (rest // tn) * tn) * TILE
        if mode == SKIP_UPPER and j0 > i0 + TILE - 1:
            continue  # (the whole block takes the same branch)
        k_lo = i0 if mode == K_GE_ROW else 0
        k_hi = kdim
        if mode == K_LE_ROW and i0 + TILE < kdim:
            k_hi = i0 + TILE
        for e in range(tid, TILE * TILE, nt):
            sc[e // TILE, e % TILE] = 0
        for k0 in range(k_lo, k_hi, TILE):
            cuda.syncthreads()
            for e in range(tid, TILE * TILE, nt):
                r = e // TILE
                q = e - r * TILE
                ii = i0 + r
                kk = k0 + q
                if ii < m and kk < k_hi:
                    sa[r, q] = a[bi, hi, kk, ii] if ta else a[bi, hi, ii, kk]
                else:
                    sa[r, q] = 0  # padding
                kk = k0 + r
                jj = j0 + q
                if jj < n and kk < k_hi:
                    sb[r, q] = b[bi, hi, jj, kk] if tb else b[bi, hi, kk, jj]
                else:
                    sb[r, q] = 0
            cuda.syncthreads()
            for e in range(tid, TILE * TILE, nt):
                r = e // TILE
                q = e - r * TILE
                acc = sc[r, q]
                for kk in range(TILE):
                    acc += sa[r, kk] * sb[kk, q]
                sc[r, q] = acc
        for e in range(tid, TILE * TILE, nt):
            r = e // TILE
            q = e - r * TILE
            ii = i0 + r
            jj = j0 + q
            if ii < m and jj < n:
                if accumulate == WRITE:
                    c[bi, hi, ii, jj] = sc[r, q]
                elif accumulate == ADD:
                    c[bi, hi, ii, jj] += sc[r, q]
                else:
                    c[bi, hi, ii, jj] = c[bi, hi, ii, jj] * alpha[bi, hi, ii] + sc[r, q]
        cuda.syncthreads()


# ---------------------------------------------------------------- row kernels
def _k_softmax_rows(s, scale, causal):
    """Rows of (N, T, T) ``s`` -> ``softmax(s * scale)`` (causal: keys after the query 0)."""
    part = cuda.shared.array(BLOCK, np.float64)
    rows, cols = s.shape[1], s.shape[2]
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    for k in range(cuda.blockIdx.x, s.shape[0] * rows, cuda.gridDim.x):
        n = k // rows
        r = k - n * rows
        v = (r + 1 if r + 1 < cols else cols) if causal else cols
        mx = -math.inf
        for c in range(tid, v, nt):
            t = s[n, r, c] * scale
            mx = t if t > mx else mx
        part[tid] = mx
        mx = _d_block_max(part)
        tot = 0.0
        for c in range(tid, v, nt):
            s[n, r, c] = math.exp(s[n, r, c] * scale - mx)
            tot += s[n, r, c]  # the stored value, as the host kernel sums
        part[tid] = tot
        inv = 1.0 / _d_block_sum(part)
        for c in range(tid, v, nt):
            s[n, r, c] = s[n, r, c] * inv
        for c in range(v + tid, cols, nt):
            s[n, r, c] = 0


def _k_online_rows(s, m, l, alpha, scale, causal, r0, c0, first):
    """One key tile of the running softmax (:func:`.attention_rows.online_rows`)."""
    part = cuda.shared.array(BLOCK, np.float64)
    rows, cols = s.shape[1], s.shape[2]
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    for k in range(cuda.blockIdx.x, s.shape[0] * rows, cuda.gridDim.x):
        n = k // rows
        r = k - n * rows
        v = cols
        if causal and r0 + r - c0 + 1 < cols:
            v = r0 + r - c0 + 1 if r0 + r - c0 + 1 > 0 else 0
        old = -math.inf if first else float(m[n, r])
        mx = old
        for c in range(tid, v, nt):
            t = s[n, r, c] * scale
            mx = t if t > mx else mx
        part[tid] = mx
        mx = _d_block_max(part)
        tot = 0.0
        for c in range(tid, v, nt):
            s[n, r, c] = math.exp(s[n, r, c] * scale - mx)
            tot += s[n, r, c]
        for c in range(v + tid, cols, nt):
            s[n, r, c] = 0
        part[tid] = tot
        tot = _d_block_sum(part)
        if tid == 0:
            alpha[n, r] = 0.0 if first else math.exp(old - mx)
            m[n, r] = mx
            l[n, r] = tot if first else l[n, r] * alpha[n, r] + tot


def _k_probs_rows(s, lse, scale, causal, r0, c0):
    """``s -> exp(s * scale - lse)`` on a tile, masked (one thread per element)."""
    rows, cols = s.shape[1], s.shape[2]
    for e in range(cuda.grid(1), s.size, cuda.gridsize(1)):
        n = e // (rows * cols)
        rc = e - n * rows * cols
        r = rc // cols
        c = rc - r * cols
        if causal and c0 + c > r0 + r:
            s[n, r, c] = 0
        else:
            s[n, r, c] = math.exp(s[n, r, c] * scale - float(lse[n, r0 + r]))


def _k_dropout_rows(p, out, seq, r0, c0, k0, k1, thresh, dscale):
    """``out = p * keep * dscale`` on a tile, ``keep`` hashed from the flat (N, seq, seq)
    index (``out`` may be ``p``)."""
    rows, cols = p.shape[1], p.shape[2]
    for e in range(cuda.grid(1), p.size, cuda.gridsize(1)):
        n = e // (rows * cols)
        rc = e - n * rows * cols
        r = rc // cols
        c = rc - r * cols
        h = _d_mix(_d_mix(np.uint64((n * seq + r0 + r) * seq + c0 + c) ^ k0) ^ k1)
        if h >= thresh:
            out[n, r, c] = p[n, r, c] * dscale
        else:
            out[n, r, c] = 0


def _k_dscores_rows(dp, p, pd, delta, scale, r0, c0, causal):
    """``dp = (pd * dp - p * delta) * scale``; causal: masked entries 0 (dp unread)."""
    rows, cols = dp.shape[1], dp.shape[2]
    for e in range(cuda.grid(1), dp.size, cuda.gridsize(1)):
        n = e // (rows * cols)
        rc = e - n * rows * cols
        r = rc // cols
        c = rc - r * cols
        if causal and c0 + c > r0 + r:
            dp[n, r, c] = 0
        else:
            dp[n, r, c] = (pd[n, r, c] * dp[n, r, c] - p[n, r, c] * delta[n, r0 + r]) * scale


def _k_rowdot(a, b, out, heads):
    """``out[n*heads + h, t]`` = dot of head h of rows t of ``a``, ``b`` (B, T, D)."""
    seq, dim = a.shape[1], a.shape[2]
    hd = dim // heads
    for e in range(cuda.grid(1), a.shape[0] * heads * seq, cuda.gridsize(1)):
        nh = e // seq
        t = e - nh * seq
        bt = nh // heads
        h = nh - bt * heads
        acc = 0.0
        for j in range(h * hd, (h + 1) * hd):
            acc += a[bt, t, j] * b[bt, t, j]
        out[nh, t] = acc


def _k_online_finish(o, l, m, lse, r0):
    """End of a row block: ``o /= l`` (B, H, R, hd) and ``lse[n, r0 + r] = log(l) + m``."""
    heads, rows, hd = o.shape[1], o.shape[2], o.shape[3]
    for e in range(cuda.grid(1), o.size, cuda.gridsize(1)):
        bh = e // (rows * hd)
        rj = e - bh * rows * hd
        r = rj // hd
        j = rj - r * hd
        b = bh // heads
        h = bh - b * heads
        o[b, h, r, j] = o[b, h, r, j] / l[b, h, r]
        if j == 0:
            lse[bh, r0 + r] = math.log(l[b, h, r]) + m[b, h, r]


@functools.cache
def _kernels() -> SimpleNamespace:
    return _cuda.bind(globals(), ["_k_bgemm", "_k_softmax_rows", "_k_online_rows",
                                  "_k_probs_rows", "_k_dropout_rows", "_k_dscores_rows",
                                  "_k_rowdot", "_k_online_finish"],
                      device={"_d_block_sum": "_block_sum_py", "_d_block_max": "_block_max_py",
                              "_d_mix": "_mix_py"})


# ---------------------------------------------------------------- entry points
def device_ok(*arrays: Any) -> bool:
    """Whether these (non-``None``) arrays take the kernels here: device arrays of one float
    dtype (any strides)."""
    arrays = tuple(a for a in arrays if a is not None)
    return all(_cuda.is_device_array(a) and a.dtype == arrays[0].dtype for a in arrays) \
        and arrays[0].dtype in (np.float32, np.float64)


def bgemm(a: Any, b: Any, c: Any, trans_a: bool = False, trans_b: bool = False,
          mode: int = FULL, accumulate: int = WRITE, alpha: Any = None) -> None:
    """``c[i, j] = op(a[i, j]) @ op(b[i, j])`` on (B, H, rows, cols) device stacks of any
    strides (``op(x) = x.T`` when asked); ``mode`` / ``accumulate`` / ``alpha`` (B, H, rows)
    as in the module docstring. One launch."""
    m = a.shape[3] if trans_a else a.shape[2]
    k = a.shape[2] if trans_a else a.shape[3]
    n = b.shape[2] if trans_b else b.shape[3]
    if c.shape != (*a.shape[:2], m, n) or (b.shape[3] if trans_b else b.shape[2]) != k:
        raise ValueError(f"bgemm shapes: a {a.shape}, b {b.shape}, c {c.shape} (trans_a="
                         f"{trans_a}, trans_b={trans_b})")
    if c.size == 0:
        return
    if (mode == SKIP_UPPER and m != n) or (mode in (K_LE_ROW, K_GE_ROW) and m != k):
        what = "c" if mode == SKIP_UPPER else "op(a)"
        raise ValueError(f"bgemm mode {mode} needs a square {what}, got c {m}x{n}, "
                         f"op(a) {m}x{k}")
    if accumulate == RESCALE_ADD and (alpha is None or alpha.shape != c.shape[:3]):
        raise ValueError("bgemm RESCALE_ADD needs alpha of shape (B, H, rows)")
    if alpha is None:
        alpha = c[:, :, :, 0]  # (unread: a placeholder of the right rank)
    tiles = c.shape[0] * c.shape[1] * -(-m // TILE) * -(-n // TILE)
    threads = 32 if _cuda.simulator() else TILE * TILE
    _cuda.run(_kernels().k_bgemm, _cuda.item_blocks(tiles), threads, a, b, c, bool(trans_a),
              bool(trans_b), int(mode), int(accumulate), alpha)


def softmax_rows(s: Any, scale: float, causal: bool) -> None:
    """:func:`.attention_rows.softmax_rows` on a device (N, T, T) array: one launch."""
    _cuda.launch_blocks(_kernels().k_softmax_rows, s.shape[0] * s.shape[1], s.shape[2], s,
                        float(scale), bool(causal))


def online_rows(s: Any, m: Any, l: Any, alpha: Any, scale: float, causal: bool, r0: int,
                c0: int, first: bool) -> None:
    """:func:`.attention_rows.online_rows` on device arrays: one launch."""
    _cuda.launch_blocks(_kernels().k_online_rows, s.shape[0] * s.shape[1], s.shape[2], s, m,
                        l, alpha, float(scale), bool(causal), int(r0), int(c0), bool(first))


def probs_rows(s: Any, lse: Any, scale: float, causal: bool, r0: int, c0: int) -> None:
    """:func:`.attention_rows.probs_rows` on device arrays: one launch."""
    _cuda.launch(_kernels().k_probs_rows, s.size, s, lse, float(scale), bool(causal), int(r0),
                 int(c0))


def dropout_rows(p: Any, out: Any, seq: int, r0: int, c0: int, k0: int, k1: int, thresh: int,
                 dscale: float) -> None:
    """:func:`.attention_rows.dropout_rows` on device arrays (keys and threshold already
    derived): one launch."""
    _cuda.launch(_kernels().k_dropout_rows, p.size, p, out, int(seq), int(r0), int(c0),
                 np.uint64(k0), np.uint64(k1), np.uint64(thresh), p.dtype.type(dscale))


def dscores_rows(dp: Any, p: Any, pd: Any, delta: Any, scale: float, r0: int, c0: int = 0,
                 causal: bool = False) -> None:
    """:func:`.attention_rows.dscores_rows` on device arrays: one launch; ``causal`` writes
    the masked entries (key after query) as 0 without reading ``dp``."""
    _cuda.launch(_kernels().k_dscores_rows, dp.size, dp, p, pd, delta, dp.dtype.type(scale),
                 int(r0), int(c0), bool(causal))


def rowdot(a: Any, b: Any, out: Any, heads: int) -> None:
    """:func:`.attention_rows.rowdot` on device arrays: one launch."""
    _cuda.launch(_kernels().k_rowdot, a.shape[0] * heads * a.shape[1], a, b, out, int(heads))


def online_finish(o: Any, l: Any, m: Any, lse: Any, r0: int) -> None:
    """End a row block of the blockwise forward: ``o /= l`` on the (B, H, R, hd) output rows
    and ``lse[:, r0:r0 + R] = log(l) + m`` ((B, H, R) running sum and max; ``lse`` (B*H, T)).
    One launch."""
    _cuda.launch(_kernels().k_online_finish, o.size, o, l, m, lse, int(r0))
