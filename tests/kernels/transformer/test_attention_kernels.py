"""Attention row kernels (kernels/transformer/attention_rows.py): the Numba kernels equal the
references
(the arrays' own library: what a device runs), their bits do not depend on the thread count,
and the dropout masks are the same whatever the tiling; the forms' layouts."""

from __future__ import annotations

import numpy as np
import pytest

from minidl.kernels.parallel import set_thread_policy
from minidl.kernels.transformer import attention as ak
from minidl.kernels.transformer import attention_rows as ar


class _Wrapped(np.ndarray):
    """A NumPy subclass: not ``type(a) is np.ndarray``, so the kernels take the references."""


def _ref(a):
    return a.view(_Wrapped)


def _scores(rng, n=6, rows=40, cols=40, dtype=np.float32):
    return (rng.standard_normal((n, rows, cols)) * 3).astype(dtype)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype,tol", [(np.float32, 1e-6), (np.float64, 1e-14)])
def test_softmax_and_probs_rows_equal_references(causal, dtype, tol):
    rng = np.random.default_rng(0)
    s = _scores(rng, dtype=dtype)
    a, b = s.copy(), s.copy()
    ar.softmax_rows(a, 0.3, causal)
    ar.softmax_rows(_ref(b), 0.3, causal)
    np.testing.assert_allclose(a, b, rtol=0, atol=tol)
    np.testing.assert_allclose(a.sum(axis=2), 1, rtol=10 * tol)
    if causal:
        assert (a[:, 0, 1:] == 0).all() and (np.triu(a[0], 1) == 0).all()
    # rebuilt from the log-sum-exp: the same probabilities, for any tile
    lse = np.log(np.exp(s.astype(np.float64) * 0.3 - np.where(
        np.triu(np.ones((40, 40), bool), 1) & causal, np.inf, 0)).sum(axis=2)).astype(dtype)
    tile = s[:, 8:24, 0:16].copy()
    ar.probs_rows(tile, lse, 0.3, causal, 8, 0)
    tref = s[:, 8:24, 0:16].copy()
    ar.probs_rows(_ref(tref), lse, 0.3, causal, 8, 0)
    np.testing.assert_allclose(tile, a[:, 8:24, 0:16], rtol=0, atol=30 * tol)
    np.testing.assert_allclose(tref, tile, rtol=0, atol=10 * tol)


@pytest.mark.parametrize("causal", [False, True])
def test_online_rows_equal_reference_and_whole_rows(causal):
    rng = np.random.default_rng(1)
    s = _scores(rng, rows=16, cols=48, dtype=np.float64)
    n, rows = s.shape[:2]
    outs = []
    for ref in (False, True):
        m, l, alpha = (np.empty((n, rows)) for _ in range(3))
        acc = np.zeros((n, rows, 48))
        for c0 in range(0, 48, 16):
            if causal and c0 > 32 + rows - 1:
                continue
            t = s[:, :, c0:c0 + 16].copy()
            args = [t, m, l, alpha]
            ar.online_rows(*([_ref(x) for x in args] if ref else args), 0.5, causal, 32, c0,
                           c0 == 0)
            acc *= alpha[:, :, None]  # rescale what was accumulated
            acc[:, :, c0:c0 + 16] = t
        outs.append(acc / l[:, :, None])
    np.testing.assert_allclose(outs[0], outs[1], rtol=0, atol=1e-14)
    whole = s.copy()
    mask = np.arange(48)[None, :] > np.arange(32, 48)[:, None]
    if causal:
        whole[:, mask] = -np.inf
    e = np.exp(whole * 0.5 - (whole * 0.5).max(axis=2, keepdims=True))
    np.testing.assert_allclose(outs[0], e / e.sum(axis=2, keepdims=True), rtol=0, atol=1e-14)


def test_dropout_masks_do_not_depend_on_tiling_and_match_reference():
    rng = np.random.default_rng(2)
    p = rng.random((3, 20, 20)).astype(np.float32)
    whole = np.empty_like(p)
    ar.dropout_rows(p, whole, 0.3, 99, 20, 0, 0)
    tiled = np.empty_like(p)
    for r0 in range(0, 20, 7):
        for c0 in range(0, 20, 6):
            t = p[:, r0:r0 + 7, c0:c0 + 6].copy()
            ar.dropout_rows(t, t, 0.3, 99, 20, r0, c0)
            tiled[:, r0:r0 + 7, c0:c0 + 6] = t
    np.testing.assert_array_equal(whole, tiled)
    ref = np.empty_like(p)
    ar.dropout_rows(_ref(p), _ref(ref), 0.3, 99, 20, 0, 0)
    np.testing.assert_array_equal(whole, ref)
    kept = (whole != 0).mean()
    assert 0.6 < kept < 0.8
    np.testing.assert_allclose(whole[whole != 0], (p / 0.7)[whole != 0], rtol=1e-6)


def test_dscores_and_rowdot_equal_references():
    rng = np.random.default_rng(3)
    dp, p, pd = (rng.standard_normal((4, 10, 12)) for _ in range(3))
    delta = rng.standard_normal((4, 30))
    a, b = dp.copy(), dp.copy()
    ar.dscores_rows(a, p, pd, delta, 0.25, 5)
    ar.dscores_rows(_ref(b), _ref(p), _ref(pd), _ref(delta), 0.25, 5)
    np.testing.assert_allclose(a, (pd * dp - p * delta[:, 5:15, None]) * 0.25, rtol=1e-14)
    np.testing.assert_allclose(a, b, rtol=1e-14)
    x, y = rng.standard_normal((2, 7, 12)), rng.standard_normal((2, 7, 12))
    out, ref = np.empty((6, 7)), np.empty((6, 7))
    ar.rowdot(x, y, out, 3)
    ar.rowdot(_ref(x), _ref(y), _ref(ref), 3)
    want = (x * y).reshape(2, 7, 3, 4).sum(3).transpose(0, 2, 1).reshape(6, 7)
    np.testing.assert_allclose(out, want, rtol=1e-13)
    np.testing.assert_allclose(ref, want, rtol=1e-13)


@pytest.mark.parametrize("block", [None, 16])
def test_attention_bits_do_not_depend_on_threads(block):
    """Large enough for the threaded kernels: 1 and 2 threads give the same bits."""
    rng = np.random.default_rng(4)
    b, t, d, h = 2, 64, 32, 4
    qkv = rng.standard_normal((b, t, 3 * d)).astype(np.float32)
    dattn = rng.standard_normal((b, t, d)).astype(np.float32)
    saved_shape = ak.stash_shapes(b, t, d, h, block)["probs" if block is None else "lse"]
    results = []
    try:
        for threads in (1, 2):
            set_thread_policy(threads)
            attn, saved = np.empty((b, t, d), np.float32), np.empty(saved_shape, np.float32)
            fl, bl = (f(b, t, d, h, block, True) for f in (ak.forward_layout,
                                                             ak.backward_layout))
            fw = fl.carve(np.empty(fl.nbytes(np.float32), np.uint8), np.float32) \
                if fl.entries else None
            ak.attention_forward(qkv, attn, saved, h, True, 0.2, 7, fw, block)
            bw = bl.carve(np.empty(bl.nbytes(np.float32), np.uint8), np.float32)
            dqkv = np.empty_like(qkv)
            ak.attention_backward(dattn, qkv, attn, saved, dqkv, h, True, 0.2, 7, bw, block)
            results.append((attn, saved, dqkv))
    finally:
        set_thread_policy(None)
    for x, y in zip(*results, strict=True):
        np.testing.assert_array_equal(x, y)


def test_layouts_and_forms():
    assert ak.parse_form(None) is None and ak.parse_form("keep") is None
    assert ak.parse_form("blockwise:64") == 64
    with pytest.raises(ValueError, match="'blockwise:-1'"):
        ak.parse_form("blockwise:-1")
    keep = ak.forward_layout(2, 100, 8, 2, None, False)
    assert keep.nbytes(np.float32) == 0
    assert ak.forward_layout(2, 100, 8, 2, None, True).nbytes(np.float32) >= 2 * 2 * 100 * 100 * 4
    blk = ak.backward_layout(2, 100, 8, 2, 16, False)
    assert blk.nbytes(np.float32) < ak.backward_layout(2, 100, 8, 2, None, False).nbytes(
        np.float32) / 4
    # a block larger than the sequence is a one-tile blockwise form
    assert ak.forward_layout(1, 10, 8, 2, 64, False) == ak.forward_layout(1, 10, 8, 2, 10, False)


def _run_form(qkv, dattn, heads, causal, block, poison):
    """attn and dqkv of one form (float64), the workspaces filled with ``poison`` first."""
    b, t, d3 = qkv.shape
    d = d3 // 3
    saved = np.full(ak.stash_shapes(b, t, d, heads, block)["probs" if block is None
                                                             else "lse"], poison)
    fl, bl = (f(b, t, d, heads, block, False) for f in (ak.forward_layout, ak.backward_layout))
    fw = fl.carve(np.full(fl.nbytes(np.float64) // 8, poison).view(np.uint8), np.float64) \
        if fl.entries else None
    bw = bl.carve(np.full(bl.nbytes(np.float64) // 8, poison).view(np.uint8), np.float64)
    attn, dqkv = np.full((b, t, d), poison), np.full_like(qkv, poison)
    ak.attention_forward(qkv, attn, saved, heads, causal, 0.0, 0, fw, block)
    ak.attention_backward(dattn, qkv, attn, saved, dqkv, heads, causal, 0.0, 0, bw, block)
    return attn, dqkv


@pytest.mark.parametrize("causal", [False, True])
def test_keep_form_row_blocks_equal_dense_attention(causal):
    """The keep form multiplies causal query rows in blocks of CAUSAL_ROWS with the keys up to
    the block's end only: over several blocks (and a short last one), with NaN in every
    buffer beforehand, it equals dense masked attention and the blockwise form."""
    rng = np.random.default_rng(5)
    b, t, d, h = 2, 2 * ak.CAUSAL_ROWS + 22, 16, 2
    qkv = rng.standard_normal((b, t, 3 * d))
    dattn = rng.standard_normal((b, t, d))
    attn, dqkv = _run_form(qkv, dattn, h, causal, None, np.nan)
    q, k, v = (qkv[..., i * d:(i + 1) * d].reshape(b, t, h, d // h).transpose(0, 2, 1, 3)
               for i in range(3))
    s = q @ k.transpose(0, 1, 3, 2) / np.sqrt(d // h)
    if causal:
        s = np.where(np.triu(np.ones((t, t), bool), 1), -np.inf, s)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    want = (p @ v).transpose(0, 2, 1, 3).reshape(b, t, d)
    np.testing.assert_allclose(attn, want, rtol=0, atol=1e-12)
    do = dattn.reshape(b, t, h, d // h).transpose(0, 2, 1, 3)
    dp = do @ v.transpose(0, 1, 3, 2)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True)) / np.sqrt(d // h)
    grads = [ds @ k, ds.transpose(0, 1, 3, 2) @ q, p.transpose(0, 1, 3, 2) @ do]
    want = np.concatenate([g.transpose(0, 2, 1, 3).reshape(b, t, d) for g in grads], axis=2)
    np.testing.assert_allclose(dqkv, want, rtol=0, atol=1e-12)
    blockwise = _run_form(qkv, dattn, h, causal, 32, 0.0)
    np.testing.assert_allclose(attn, blockwise[0], rtol=0, atol=1e-12)
    np.testing.assert_allclose(dqkv, blockwise[1], rtol=0, atol=1e-12)
