"""Scaled dot-product self-attention on a fused q|k|v tensor, in two memory forms.

``qkv`` is (B, T, 3D) as a fused projection writes it (q, k, v one after the other, each D =
H heads x hd wide, as nanoGPT's ``c_attn`` and ``nn.MultiheadAttention``'s ``in_proj``); the
output ``attn`` is (B, T, D), heads side by side. Per head, ``P = softmax(q k^T / sqrt(hd))``
(causal: keys after the query masked), ``P~ = P * keep / (1 - p)`` with dropout, ``O = P~ v``.
Heads are never copied out: every product is one :func:`~minidl.kernels.blas.batched_gemm` over
(B, H) on strided views of ``qkv`` / ``attn`` (BLAS reads and writes them in place; the
matrices shared out over the threads, each product whole).

Forms (the ``attn`` per-op option of the plan, :func:`parse_form`):

* ``keep``: forward stores ``P`` (B, H, T, T) for backward (quadratic in T).
* ``blockwise:<n>``: forward runs over n x n tiles of (query, key) with a running row maximum
  and sum (FlashAttention), stores only the row log-sum-exp (B, H, T), and backward recomputes
  each tile's ``P`` from it. Stash linear in T; the workspaces hold a few tiles. Causal tiles
  wholly above the diagonal are skipped.

Backward uses ``dS = P~ * dP~ - P * delta`` (times the scale), ``delta = rowsum(dO * O)``, which
holds with dropout since ``P~ = P * keep * s``. Dropout masks are a counter-based hash of (seed,
flat index in (B, H, T, T)) (:mod:`.dropout`'s mix), so both forms draw the same mask, and a
recomputed or replayed step the same one. Everything runs in a fixed order (tiles in order,
rows split over threads but each row by one thread): bit-identical run to run and whatever
the thread count; the two forms agree to float rounding.

The row kernels are in :mod:`.attention_rows` (Numba for NumPy arrays, the CUDA kernels of
:mod:`.transformer_device` for device arrays, references otherwise).

Device arrays (CuPy's, Numba's, emulated) take the same steps with
:func:`~.transformer_device.bgemm` for every product: one launch each, straight from and into
the head views (CuPy's ``matmul`` would copy them), no temporary. The causal ``keep`` form
needs no row blocks there: each product is one launch that skips the tiles above the diagonal
(scores, dP) or the ``k`` chunks past it (P V, dS K, P^T dO, dS^T Q); dS is written 0 where
masked. The blockwise form adds each tile's products into the running output (rescaled by
``alpha``) and into ``dqkv`` inside the GEMM (no tile buffers) and ends a row block with one
kernel. Launches per call: ``keep`` 3 forward (4 with dropout) and 6 backward (7); blockwise
per tile 3 (4) forward plus 1 per row block, and 7 (8) backward plus 2 (the row dot products,
the fill of ``dqkv``). Device results agree with the host's to float rounding (sums in other
orders) and are the same run to run.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .._cuda import is_device_array
from ..blas import batched_gemm
from ..parallel import ensure_blas_policy
from ..workspace import Layout
from . import transformer_device as td
from .attention_rows import (
    dropout_rows,
    dscores_rows,
    online_rows,
    probs_rows,
    rowdot,
    softmax_rows,
)

KEEP = "keep"
BLOCKWISE = "blockwise"


def parse_form(option) -> int | None:
    """The block size of an ``attn`` option: ``None`` for ``"keep"`` (or no option), n for
    ``"blockwise:<n>"`` (n >= 1); ``ValueError`` naming the value otherwise."""
    if option is None or option == KEEP:
        return None
    if isinstance(option, str) and option.startswith(BLOCKWISE + ":"):
        n = option.split(":", 1)[1]
        if n.isdigit() and int(n) >= 1:
            return int(n)
    raise ValueError(f"attention form {option!r}: valid forms are 'keep' and "
                     f"'blockwise:<block>' with a positive block size")


def stash_shapes(batch: int, seq: int, dim: int, heads: int, block: int | None
                 ) -> dict[str, tuple[int, ...]]:
    """What forward keeps for backward (in the float dtype): ``qkv`` and ``attn`` (both
    forms), and ``probs`` (B, H, T, T) (``keep``) or ``lse`` (B, H, T) (blockwise)."""
    out = {"qkv": (batch, seq, 3 * dim), "attn": (batch, seq, dim)}
    if block is None:
        out["probs"] = (batch, heads, seq, seq)
    else:
        out["lse"] = (batch, heads, seq)
    return out


def _tile(block: int, seq: int) -> int:
    return min(block, seq)


def forward_layout(batch: int, seq: int, dim: int, heads: int, block: int | None,
                   dropout: bool) -> Layout:
    """Buffers of :func:`attention_forward`'s workspace."""
    bh, hd = (batch, heads), dim // heads
    if block is None:
        return Layout.of(dropped=(*bh, seq, seq)) if dropout else Layout.of()
    n = _tile(block, seq)
    return Layout.of(scores=(*bh, n, n), o_tile=(*bh, n, hd), m=(*bh, n), l=(*bh, n),
                     alpha=(*bh, n))


def backward_layout(batch: int, seq: int, dim: int, heads: int, block: int | None,
                    dropout: bool) -> Layout:
    """Buffers of :func:`attention_backward`'s workspace (with the layer's ``dattn`` and
    ``dqkv`` first: the gradients of ``attn`` and ``qkv``)."""
    bh, hd = (batch, heads), dim // heads
    common = {"dattn": (batch, seq, dim), "dqkv": (batch, seq, 3 * dim), "delta": (*bh, seq)}
    if block is None:
        extra = {"dprobs": (*bh, seq, seq)}
        if dropout:
            extra["dropped"] = (*bh, seq, seq)
        return Layout.of(**common, **extra)
    n = _tile(block, seq)
    extra = {"scores": (*bh, n, n), "dscores": (*bh, n, n), "tmp": (*bh, n, hd)}
    if dropout:
        extra["dropped"] = (*bh, n, n)
    return Layout.of(**common, **extra)




# ---------------------------------------------------------------- forward and backward
def _heads(a, heads: int, parts: int = 1):
    """(B, T, parts*D) as (parts, B, H, T, hd) strided views (no copy)."""
    b, t, w = a.shape
    hd = w // parts // heads
    return a.reshape(b, t, parts, heads, hd).transpose(2, 0, 3, 1, 4)


def _prefix(buf, shape: tuple[int, ...]):
    """The leading elements of a contiguous buffer as a contiguous array of ``shape``."""
    return buf.reshape(-1)[:math.prod(shape)].reshape(shape)


def _rows3(a):
    """(B, H, R, C) contiguous as (B*H, R, C); (B, H, T) as (B*H, T)."""
    return a.reshape(-1, *a.shape[2:])


#: Causal ``keep`` form: query rows in blocks of this many, each multiplied with the keys up
#: to its last row only (products over the masked keys skipped: at T = 256, 62.5 % of the
#: full score and output products).
CAUSAL_ROWS = 64


def _row_spans(seq: int, causal: bool) -> list[tuple[int, int]]:
    """``(r0, r1)`` query-row blocks of the ``keep`` form: the whole sequence, or causal blocks
    of :data:`CAUSAL_ROWS` (rows ``r0:r1`` see keys ``0:r1``)."""
    if not causal:
        return [(0, seq)]
    return [(r0, min(seq, r0 + CAUSAL_ROWS)) for r0 in range(0, seq, CAUSAL_ROWS)]


def _tiles(seq: int, block: int, causal: bool):
    """(r0, rows, c0, cols, first) of every tile in order: row blocks, then their key blocks
    (causal: none wholly above the diagonal)."""
    for r0 in range(0, seq, block):
        rows = min(block, seq - r0)
        end = min(seq, r0 + rows) if causal else seq
        for c0 in range(0, end, block):
            yield r0, rows, c0, min(block, seq - c0), c0 == 0


def attention_forward(qkv, attn, saved, heads: int, causal: bool, p_drop: float, seed: int,
                      ws: Any, block: int | None, batch0: int = 0) -> None:
    """``attn`` (B, T, D) from ``qkv`` (B, T, 3D). ``saved``: the ``probs`` (B, H, T, T)
    (``block=None``, keep) or the ``lse`` (B, H, T) (blockwise) stash, written; ``ws``: the
    buffers of :func:`forward_layout` (``None`` if it has none). ``p_drop`` > 0 drops
    probabilities with masks from ``seed`` (the caller passes 0 outside training); ``batch0``:
    the index of ``qkv``'s first sample in the batch the masks are drawn for (a chunk of it)."""
    drow = batch0 * heads * qkv.shape[1]  # (mask rows before the chunk's)
    if is_device_array(qkv):
        return _forward_device(qkv, attn, saved, heads, causal, p_drop, seed, ws, block, drow)
    ensure_blas_policy()
    q, k, v = _heads(qkv, heads, 3)
    o = _heads(attn, heads)[0]
    seq = qkv.shape[1]
    scale = 1.0 / math.sqrt(q.shape[-1])
    if block is None:
        probs = saved
        spans = _row_spans(seq, causal)
        for r0, r1 in spans:  # causal: scores right of r1 are never computed (softmax zeros)
            batched_gemm(q[:, :, r0:r1], k[:, :, :r1], probs[:, :, r0:r1, :r1], trans_b=True)
        softmax_rows(_rows3(probs), scale, causal)
        src = probs
        if p_drop > 0:
            src = ws.dropped
            dropout_rows(_rows3(probs), _rows3(src), p_drop, seed, seq, drow, 0)
        for r0, r1 in spans:
            batched_gemm(src[:, :, r0:r1, :r1], v[:, :, :r1], o[:, :, r0:r1])
        return
    lse = _rows3(saved)
    bh = qkv.shape[0], heads
    for r0, rows, c0, cols, first in _tiles(seq, min(block, seq), causal):
        if first:
            m, l, alpha = (_prefix(b, (*bh, rows)) for b in (ws.m, ws.l, ws.alpha))
            qi, oi = q[:, :, r0:r0 + rows], o[:, :, r0:r0 + rows]
        s = _prefix(ws.scores, (*bh, rows, cols))
        batched_gemm(qi, k[:, :, c0:c0 + cols], s, trans_b=True)
        online_rows(_rows3(s), _rows3(m), _rows3(l), _rows3(alpha), scale, causal, r0, c0,
                    first)
        if p_drop > 0:
            dropout_rows(_rows3(s), _rows3(s), p_drop, seed, seq, drow + r0, c0)
        vj = v[:, :, c0:c0 + cols]
        if first:
            batched_gemm(s, vj, oi)
        else:
            oi *= alpha[..., None]
            tile = _prefix(ws.o_tile, (*bh, rows, oi.shape[-1]))
            batched_gemm(s, vj, tile)
            oi += tile
        if c0 + cols >= (min(seq, r0 + rows) if causal else seq):  # the row block's last
            oi /= l[..., None]
            out = lse[:, r0:r0 + rows]
            np.log(_rows3(l), out=out)
            out += _rows3(m)


def attention_backward(dattn, qkv, attn, saved, dqkv, heads: int, causal: bool,
                       p_drop: float, seed: int, ws: Any, block: int | None,
                       batch0: int = 0) -> None:
    """``dqkv`` (B, T, 3D) overwritten with the gradient of ``qkv`` from ``dattn`` (B, T, D),
    the forward's ``qkv``, ``attn`` and ``saved`` (``probs`` or ``lse``) stash and the same
    ``p_drop`` / ``seed`` (and ``batch0``); ``ws``: the buffers of :func:`backward_layout`."""
    drow = batch0 * heads * qkv.shape[1]
    if is_device_array(qkv):
        return _backward_device(dattn, qkv, attn, saved, dqkv, heads, causal, p_drop, seed, ws,
                                block, drow)
    ensure_blas_policy()
    q, k, v = _heads(qkv, heads, 3)
    dq, dk, dv = _heads(dqkv, heads, 3)
    do = _heads(dattn, heads)[0]
    seq = qkv.shape[1]
    scale = 1.0 / math.sqrt(q.shape[-1])
    delta = _rows3(ws.delta)
    rowdot(dattn, attn, delta, heads)
    if block is None:
        probs = saved
        pd = probs
        if p_drop > 0:
            pd = ws.dropped
            dropout_rows(_rows3(probs), _rows3(pd), p_drop, seed, seq, drow, 0)
        spans = _row_spans(seq, causal)
        dp = ws.dprobs
        for r0, r1 in spans:  # causal: dP right of r1 is not computed, and never read
            batched_gemm(pd[:, :, r0:, r0:r1], do[:, :, r0:], dv[:, :, r0:r1], trans_a=True)
            batched_gemm(do[:, :, r0:r1], v[:, :, :r1], dp[:, :, r0:r1, :r1], trans_b=True)
        dscores_rows(_rows3(dp), _rows3(probs), _rows3(pd), delta, scale, 0)
        for r0, r1 in spans:  # keys r0:r1 are seen by queries from r0 on
            batched_gemm(dp[:, :, r0:r1, :r1], k[:, :, :r1], dq[:, :, r0:r1])
            batched_gemm(dp[:, :, r0:, r0:r1], q[:, :, r0:], dk[:, :, r0:r1], trans_a=True)
        return
    lse = _rows3(saved)
    dqkv.fill(0)
    bh, hd = (qkv.shape[0], heads), q.shape[-1]
    for r0, rows, c0, cols, _ in _tiles(seq, min(block, seq), causal):
        ri, cj = slice(r0, r0 + rows), slice(c0, c0 + cols)
        p = _prefix(ws.scores, (*bh, rows, cols))
        batched_gemm(q[:, :, ri], k[:, :, cj], p, trans_b=True)
        probs_rows(_rows3(p), lse, scale, causal, r0, c0)
        pd = p
        if p_drop > 0:
            pd = _prefix(ws.dropped, p.shape)
            dropout_rows(_rows3(p), _rows3(pd), p_drop, seed, seq, drow + r0, c0)
        t_cols = _prefix(ws.tmp, (*bh, cols, hd))
        batched_gemm(pd, do[:, :, ri], t_cols, trans_a=True)
        dv[:, :, cj] += t_cols
        ds = _prefix(ws.dscores, p.shape)
        batched_gemm(do[:, :, ri], v[:, :, cj], ds, trans_b=True)
        dscores_rows(_rows3(ds), _rows3(p), _rows3(pd), delta, scale, r0)
        t_rows = _prefix(ws.tmp, (*bh, rows, hd))
        batched_gemm(ds, k[:, :, cj], t_rows)
        dq[:, :, ri] += t_rows
        batched_gemm(ds, q[:, :, ri], t_cols, trans_a=True)
        dk[:, :, cj] += t_cols


# ---------------------------------------------------------------- device arrays
def _forward_device(qkv, attn, saved, heads, causal, p_drop, seed, ws, block,
                    drow=0) -> None:
    """:func:`attention_forward` on device arrays (module docstring)."""
    q, k, v = _heads(qkv, heads, 3)
    o = _heads(attn, heads)[0]
    seq = qkv.shape[1]
    scale = 1.0 / math.sqrt(q.shape[-1])
    if block is None:
        probs = saved
        td.bgemm(q, k, probs, trans_b=True, mode=td.SKIP_UPPER if causal else td.FULL)
        softmax_rows(_rows3(probs), scale, causal)
        src = probs
        if p_drop > 0:
            src = ws.dropped
            dropout_rows(_rows3(probs), _rows3(src), p_drop, seed, seq, drow, 0)
        td.bgemm(src, v, o, mode=td.K_LE_ROW if causal else td.FULL)
        return
    lse = _rows3(saved)
    bh = qkv.shape[0], heads
    for r0, rows, c0, cols, first in _tiles(seq, min(block, seq), causal):
        if first:
            m, l, alpha = (_prefix(b, (*bh, rows)) for b in (ws.m, ws.l, ws.alpha))
            qi, oi = q[:, :, r0:r0 + rows], o[:, :, r0:r0 + rows]
        s = _prefix(ws.scores, (*bh, rows, cols))
        td.bgemm(qi, k[:, :, c0:c0 + cols], s, trans_b=True)
        online_rows(_rows3(s), _rows3(m), _rows3(l), _rows3(alpha), scale, causal, r0, c0,
                    first)
        if p_drop > 0:
            dropout_rows(_rows3(s), _rows3(s), p_drop, seed, seq, drow + r0, c0)
        td.bgemm(s, v[:, :, c0:c0 + cols], oi, accumulate=td.WRITE if first else td.RESCALE_ADD,
                 alpha=None if first else alpha)
        if c0 + cols >= (min(seq, r0 + rows) if causal else seq):  # the row block's last
            td.online_finish(oi, l, m, lse, r0)


def _backward_device(dattn, qkv, attn, saved, dqkv, heads, causal, p_drop, seed, ws,
                     block, drow=0) -> None:
    """:func:`attention_backward` on device arrays (module docstring)."""
    q, k, v = _heads(qkv, heads, 3)
    dq, dk, dv = _heads(dqkv, heads, 3)
    do = _heads(dattn, heads)[0]
    seq = qkv.shape[1]
    scale = 1.0 / math.sqrt(q.shape[-1])
    delta = _rows3(ws.delta)
    rowdot(dattn, attn, delta, heads)
    if block is None:
        probs = saved
        pd = probs
        if p_drop > 0:
            pd = ws.dropped
            dropout_rows(_rows3(probs), _rows3(pd), p_drop, seed, seq, drow, 0)
        lower, upper = (td.K_LE_ROW, td.K_GE_ROW) if causal else (td.FULL, td.FULL)
        dp = ws.dprobs
        td.bgemm(pd, do, dv, trans_a=True, mode=upper)
        td.bgemm(do, v, dp, trans_b=True, mode=td.SKIP_UPPER if causal else td.FULL)
        dscores_rows(_rows3(dp), _rows3(probs), _rows3(pd), delta, scale, 0, 0, causal)
        td.bgemm(dp, k, dq, mode=lower)
        td.bgemm(dp, q, dk, trans_a=True, mode=upper)
        return
    lse = _rows3(saved)
    dqkv.fill(0)
    bh = qkv.shape[0], heads
    for r0, rows, c0, cols, _ in _tiles(seq, min(block, seq), causal):
        ri, cj = slice(r0, r0 + rows), slice(c0, c0 + cols)
        p = _prefix(ws.scores, (*bh, rows, cols))
        td.bgemm(q[:, :, ri], k[:, :, cj], p, trans_b=True)
        probs_rows(_rows3(p), lse, scale, causal, r0, c0)
        pd = p
        if p_drop > 0:
            pd = _prefix(ws.dropped, p.shape)
            dropout_rows(_rows3(p), _rows3(pd), p_drop, seed, seq, drow + r0, c0)
        td.bgemm(pd, do[:, :, ri], dv[:, :, cj], trans_a=True, accumulate=td.ADD)
        ds = _prefix(ws.dscores, p.shape)
        td.bgemm(do[:, :, ri], v[:, :, cj], ds, trans_b=True)
        dscores_rows(_rows3(ds), _rows3(p), _rows3(pd), delta, scale, r0)
        td.bgemm(ds, k[:, :, cj], dq[:, :, ri], accumulate=td.ADD)
        td.bgemm(ds, q[:, :, ri], dk[:, :, cj], trans_a=True, accumulate=td.ADD)
