"""The transformer layers' device kernels: LayerNorm, attention (strided batched GEMM, row
kernels), dropout, embeddings (minidl.kernels.transformer.transformer_device and the device paths of
layernorm / attention_rows / attention / dropout / embedding / blas.batched_gemm).

* Emulated launches (one host thread, ``CUDA_LAUNCH_CASES``; test_cuda_ptx.py compiles every
  signature they launch to PTX): every kernel, both float dtypes, head views of a fused qkv
  (strided operands), every GEMM mode and accumulation, against the host (NumPy / Numba)
  paths: bit for bit where the arithmetic is the same (dropout, embedding gradients,
  LayerNorm's parameter gradients), else to float rounding.
* The Numba CUDA simulator: many threads and blocks, so the block reductions, the GEMM's
  shared-memory tiles and the grid-stride loops are checked with real thread semantics.
* (A small GPT and BERT on the strict CUDA device: test_transformer_strict_device.py.)
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from emulated_arrays import D, EmuArray, H, same
from transformer_cases import DTYPES, _heads, _normal, close

from minidl.kernels import blas
from minidl.kernels.normalization import layernorm as LN
from minidl.kernels.pointwise import dropout as DR
from minidl.kernels.transformer import attention as AK
from minidl.kernels.transformer import attention_rows as AR
from minidl.kernels.transformer import embedding as EM
from minidl.kernels.transformer import transformer_device as TD


# ----------------------------------------------------------------------------- cases
def case_bgemm(rng: np.random.Generator) -> None:
    """Head views of a fused qkv (strided), both transposes, every mode and accumulation,
    tiles cut by the matrix edges (T = 19, 33; hd = 5, 16), against float64 ``matmul``. Every
    device operand comes from ``D`` (the strided ones are views of a ``D`` array), so the
    check's smoke run, which swaps ``D`` / ``H`` for CuPy's, launches on CuPy arrays only."""
    for dt in DTYPES:
        for b, t, heads, hd in ((2, 19, 3, 5), (1, 33, 2, 16)):
            d = heads * hd
            qkv = _normal(rng, b, t, 3 * d, dtype=dt)
            q, k, v = _heads(qkv, heads, 3)
            dev_heads = _heads(D(qkv), heads, 3)
            dq, dk, dv = dev_heads[0], dev_heads[1], dev_heads[2]
            p = _normal(rng, b, heads, t, t, dtype=dt)
            lower = np.tril(p)  # (as a causal P; its transpose is upper triangular)
            dp, dlower = D(p), D(lower)
            cases = [(q, k, dq, dk, False, True, TD.FULL), (p, v, dp, dv, False, False, TD.FULL),
                     (p, q, dp, dq, True, False, TD.FULL),
                     (q, k, dq, dk, False, True, TD.SKIP_UPPER),
                     (lower, v, dlower, dv, False, False, TD.K_LE_ROW),
                     (lower, k, dlower, dk, True, False, TD.K_GE_ROW)]
            for a, bb, dev_a, dev_b, ta, tb, mode in cases:
                op_a = a.swapaxes(-1, -2) if ta else a
                op_b = bb.swapaxes(-1, -2) if tb else bb
                want = np.matmul(op_a.astype(np.float64), op_b.astype(np.float64))
                for acc in (TD.WRITE, TD.ADD, TD.RESCALE_ADD):
                    c0 = _normal(rng, *want.shape, dtype=dt)
                    alpha = _normal(rng, *want.shape[:3], dtype=dt)
                    c = D(c0)
                    TD.bgemm(dev_a, dev_b, c, ta, tb, mode, acc,
                             D(alpha) if acc == TD.RESCALE_ADD else None)
                    ref = want + (0 if acc == TD.WRITE else c0 * (
                        1 if acc == TD.ADD else alpha[..., None]))
                    got = H(c)
                    if mode == TD.SKIP_UPPER:  # lower triangle computed, tiles above kept
                        rows, cols = np.indices((t, t))
                        keep = cols // TD.TILE > rows // TD.TILE
                        same(got[..., keep], c0[..., keep], "skipped tiles")
                        lo = cols <= rows
                        got, ref = got[..., lo], ref[..., lo]
                    close(got, ref.astype(dt), f"bgemm {dt} {ta} {tb} {mode} {acc}", scale=10)
            # blas.batched_gemm sends strided device operands to bgemm (into a strided c too)
            out = _normal(rng, b, t, d, dtype=dt)
            o = _heads(out, heads, 1)[0]
            dev_out = D(out)
            blas.batched_gemm(dp, dv, _heads(dev_out, heads, 1)[0])
            blas.batched_gemm(p, v, o)
            close(H(dev_out), out, "batched_gemm", scale=10)


def case_attention_rows(rng: np.random.Generator) -> None:
    """Every row kernel against the host's Numba kernels (dropout masks bit for bit)."""
    for dt in DTYPES:
        n, t, heads = 4, 37, 2
        s = _normal(rng, n, t, t, dtype=dt, scale=3)
        for causal in (False, True):
            want, got = s.copy(), D(s)
            AR.softmax_rows(want, 0.3, causal)
            AR.softmax_rows(got, 0.3, causal)
            close(H(got), want, f"softmax {causal}")
            # one key tile (rows 8.., columns 4..) of the running softmax, first and later
            tile = _normal(rng, n, 9, 7, dtype=dt, scale=3)
            ml = [_normal(rng, n, 9, dtype=dt) for _ in range(3)]
            ml[1] = np.abs(ml[1]) + 1
            for first in (True, False):
                want = [tile.copy()] + [x.copy() for x in ml]
                got = [D(tile)] + [D(x) for x in ml]
                AR.online_rows(*want, 0.5, causal, 8, 4, first)
                AR.online_rows(*got, 0.5, causal, 8, 4, first)
                for g, w in zip(got, want):
                    close(H(g), w, f"online {causal} {first}")
            lse = _normal(rng, n, t, dtype=dt)
            want, got = tile.copy(), D(tile)
            AR.probs_rows(want, lse, 0.5, causal, 8, 4)
            AR.probs_rows(got, D(lse), 0.5, causal, 8, 4)
            close(H(got), want, f"probs {causal}")
            # dscores: the host form, and the device's masked form (dp garbage where masked)
            dp, p, pd = (_normal(rng, n, 9, 7, dtype=dt) for _ in range(3))
            delta = _normal(rng, n, t, dtype=dt)
            want, got = dp.copy(), D(dp)
            AR.dscores_rows(want, p, pd, delta, 0.25, 8)
            AR.dscores_rows(got, D(p), D(pd), D(delta), 0.25, 8)
            close(H(got), want, "dscores")
            if causal:
                rows, cols = np.indices((9, 7))
                masked = cols + 4 > rows + 8
                pm, pdm = np.where(masked, 0, p).astype(dt), np.where(masked, 0, pd).astype(dt)
                garbage = np.where(masked, np.nan, dp).astype(dt)
                got = D(garbage)
                AR.dscores_rows(got, D(pm), D(pdm), D(delta), 0.25, 8, 4, causal=True)
                want = dp.copy()
                AR.dscores_rows(want, pm, pdm, delta, 0.25, 8)
                close(H(got), want, "dscores causal")
        for p_drop, seed in ((0.2, 7), (0.6, 123456789)):
            want, got = np.empty_like(s), D(np.full_like(s, np.nan))
            AR.dropout_rows(s, want, p_drop, seed, t, 0, 0)
            AR.dropout_rows(D(s), got, p_drop, seed, t, 0, 0)
            same(H(got), want, "dropout rows")
            tile_in = s[:, 8:17, 4:11].copy()
            want, got = tile_in.copy(), D(tile_in)
            AR.dropout_rows(want, want, p_drop, seed, t, 8, 4)  # in place, on a tile
            AR.dropout_rows(got, got, p_drop, seed, t, 8, 4)
            same(H(got), want, "dropout tile")
        a, b = _normal(rng, 2, t, heads * 6, dtype=dt), _normal(rng, 2, t, heads * 6, dtype=dt)
        want, got = np.empty((2 * heads, t), dt), D(np.full((2 * heads, t), np.nan, dt))
        AR.rowdot(a, b, want, heads)
        AR.rowdot(D(a), D(b), got, heads)
        close(H(got), want, "rowdot")
        # the end of a blockwise row block: o /= l, lse = log(l) + m
        out = _normal(rng, 2, t, heads * 6, dtype=dt)
        l_run = np.abs(_normal(rng, 2, heads, 9, dtype=dt)) + 0.5
        m_run = _normal(rng, 2, heads, 9, dtype=dt)
        lse_full = np.full((2 * heads, t), np.nan, dt)
        dev_out, dev_lse = D(out), D(lse_full)
        TD.online_finish(_heads(dev_out, heads, 1)[0][:, :, 8:17], D(l_run), D(m_run), dev_lse, 8)
        o = _heads(out, heads, 1)[0]
        o[:, :, 8:17] /= l_run[..., None]
        lse_full[:, 8:17] = (np.log(l_run) + m_run).reshape(2 * heads, 9)
        close(H(dev_out), out, "finish o")
        close(H(dev_lse), lse_full, "finish lse")


def case_attention_forms(rng: np.random.Generator) -> None:
    """Whole attention forward / backward on device arrays (EmuArray views) in both forms,
    causal or not, with dropout, against the host's; T = 21 (causal tiles skipped, their
    workspace left NaN)."""
    b, t, heads, hd = 2, 21, 2, 4
    d = heads * hd
    for dt in DTYPES:
        qkv = _normal(rng, b, t, 3 * d, dtype=dt)
        dattn = _normal(rng, b, t, d, dtype=dt)
        for causal in (False, True):
            for block in (None, 4):
                for p_drop in (0.0, 0.3):
                    drop = p_drop > 0
                    host, dev = {}, {}
                    for name, arrays in (("host", host), ("dev", dev)):
                        wrap = (lambda a: a) if name == "host" else D
                        saved = np.zeros(AK.stash_shapes(b, t, d, heads, block)[
                            "probs" if block is None else "lse"], dt)
                        fl = AK.forward_layout(b, t, d, heads, block, drop)
                        bl = AK.backward_layout(b, t, d, heads, block, drop)
                        fws = wrap(np.full(fl.nbytes(dt), 0xFF, np.uint8))  # NaN garbage
                        bws = wrap(np.full(bl.nbytes(dt), 0xFF, np.uint8))
                        attn, saved = wrap(np.full((b, t, d), np.nan, dt)), wrap(saved)
                        fw = fl.carve(fws, dt) if fl.entries else None
                        bw = bl.carve(bws, dt)
                        AK.attention_forward(wrap(qkv), attn, saved, heads, causal, p_drop, 5,
                                             fw, block)
                        bw.dattn[...] = wrap(dattn)
                        AK.attention_backward(bw.dattn, wrap(qkv), attn, saved, bw.dqkv, heads,
                                              causal, p_drop, 5, bw, block)
                        get = (lambda a: a) if name == "host" else H
                        arrays.update(attn=get(attn), dqkv=get(bw.dqkv), saved=get(saved))
                    for key in host:
                        close(dev[key], host[key], f"{key} {dt} {causal} {block} {p_drop}",
                              scale=10)


def case_layernorm(rng: np.random.Generator) -> None:
    """Forward; backward with dx (also in place over dy), without, accumulating; 600 rows
    (three parts of the parameter sums): parameter gradients bit for bit."""
    for dt in DTYPES:
        for rows, dim in ((5, 7), (600, 33)):
            x = _normal(rng, rows, dim, dtype=dt, scale=2) + 0.5
            w, b = _normal(rng, dim, dtype=dt), _normal(rng, dim, dtype=dt)
            want = [np.full((rows, dim), np.nan, dt), np.zeros(rows, dt), np.zeros(rows, dt)]
            LN.layernorm_forward(x, w, b, *want, 1e-5)
            got = [D(np.full_like(a, np.nan)) for a in want]
            LN.layernorm_forward(D(x), D(w), D(b), *got, 1e-5)
            for g, a in zip(got, want):
                close(H(g), a, f"ln forward {dt}")
            mean, rstd = want[1:]
            dy = _normal(rng, rows, dim, dtype=dt)
            ws_shape = LN.backward_workspace_shape(rows, dim)
            for mode in ("dx", "inplace", "none", "accumulate"):
                dwb = [_normal(rng, dim, dtype=dt) for _ in range(2)]
                acc = mode == "accumulate"
                hw = [a.copy() for a in dwb]
                hdy = dy.copy()
                hdx = hdy if mode == "inplace" else None if mode == "none" else np.empty_like(dy)
                LN.layernorm_backward(hdy, x, w, mean, rstd, hdx, *hw, np.empty(ws_shape, dt),
                                      accumulate=acc)
                dw = [D(a) for a in dwb]
                ddy = D(dy)
                ddx = ddy if mode == "inplace" else None if mode == "none" else D(
                    np.full_like(dy, np.nan))
                LN.layernorm_backward(ddy, D(x), D(w), D(mean), D(rstd), ddx, *dw,
                                      D(np.full(ws_shape, np.nan, dt)), accumulate=acc)
                for g, a in zip(dw, hw):
                    same(H(g), a, f"ln dweight/dbias {mode}")
                if hdx is not None:
                    close(H(ddx), hdx, f"ln dx {mode}", scale=10)


def case_dropout_layer(rng: np.random.Generator) -> None:
    """The Dropout layer's kernels: the host's masks and outputs bit for bit (NaN / inf
    inputs included), backward in place."""
    for dt in DTYPES:
        for n in (1, 1000, 4097):
            x = _normal(rng, n, dtype=dt)
            x[::13] = np.nan
            x[5 % n] = np.inf
            for p in (0.1, 0.5):
                y, mask = np.empty_like(x), np.empty(n, np.uint8)
                DR.dropout_forward(x, p, 11, y, mask, None)
                dy, dmask = D(np.full_like(x, 7)), D(np.full(n, 9, np.uint8))
                DR.dropout_forward(D(x), p, 11, dy, dmask, None)
                same(H(dy), y, "dropout y")
                same(H(dmask), mask, "dropout mask")
                g = _normal(rng, n, dtype=dt)
                want = np.multiply(g, mask)
                want *= dt(1.0 / (1.0 - p))
                dg = D(g)
                DR.dropout_backward_device(dg, D(mask), dg, p)
                same(H(dg), want, "dropout dx")


def case_embeddings(rng: np.random.Generator) -> None:
    """Embedding's scatter-add (written and accumulated; repeated indices) and the positional
    table's gradient: the host's bits."""
    for dt in DTYPES:
        for vocab, width, m in ((7, 3, 40), (300, 130, 257)):
            idx = rng.integers(0, vocab, m)
            idx[: m // 3] = idx[0]  # many repeats of one row
            dy = _normal(rng, m, width, dtype=dt)
            want = np.full((vocab, width), np.nan, dt)
            EM.embedding_backward(idx, dy, want)
            got = D(np.full((vocab, width), np.nan, dt))
            EM.embedding_backward(D(idx), D(dy), got)
            same(H(got), want, "embedding grad")
            EM.embedding_accumulate(idx, dy, want)
            EM.embedding_accumulate(D(idx), D(dy), got)
            same(H(got), want, "embedding accumulate")
        for batch, seq, ctx, width in ((3, 5, 8, 6), (1, 16, 16, 33)):
            dy = _normal(rng, batch, seq, width, dtype=dt)
            gw0 = _normal(rng, ctx, width, dtype=dt)
            for acc in (False, True):
                want = gw0.copy()
                if acc:
                    want[:seq] += dy.sum(axis=0)
                else:
                    np.sum(dy, axis=0, out=want[:seq])
                    want[seq:] = 0
                got = D(gw0)
                EM.positional_grad_device(D(dy), got, acc)
                same(H(got), want, f"positional grad {acc}")


CUDA_LAUNCH_CASES = {"bgemm": case_bgemm, "attention_rows": case_attention_rows,
                     "attention_forms": case_attention_forms, "layernorm": case_layernorm,
                     "dropout_layer": case_dropout_layer, "embeddings": case_embeddings}


@pytest.mark.parametrize("name", sorted(CUDA_LAUNCH_CASES))
def test_emulated_kernels_match_the_host(name):
    CUDA_LAUNCH_CASES[name](np.random.default_rng(0))


class _Foreign(EmuArray):
    """Another device array type: CuPy's, as benchmarks/gpu/smoke.py runs these cases with
    ``D`` / ``H`` swapped for CuPy's (its views and new arrays stay of this class)."""


def _foreign_host(a: _Foreign) -> np.ndarray:
    assert isinstance(a, _Foreign), type(a)
    return a.get()


@pytest.mark.parametrize("name", sorted(CUDA_LAUNCH_CASES))
def test_cases_launch_only_on_the_array_type_of_d(name, monkeypatch):
    """With ``D`` / ``H`` of another array type (as on a GPU, where they are CuPy's), every
    kernel launch gets arrays of that type only: a case that wrapped an operand itself would
    mix two types in one launch, which a real device refuses (TypeError in kernels/_cuda.py)."""
    from minidl.kernels import _cuda

    launches = []
    emulate = _cuda.Kernel.emulate

    def only_foreign(kernel, *args):
        mixed = [type(a).__name__ for a in args
                 if hasattr(type(a), "__emulated_device_buffer__") and type(a) is not _Foreign]
        if mixed:
            raise TypeError(f"{kernel!r} got {mixed} beside arrays of D's type")
        launches.append(kernel)
        emulate(kernel, *args)

    monkeypatch.setattr(_cuda.Kernel, "emulate", only_foreign)
    monkeypatch.setitem(globals(), "D", lambda a: _Foreign(np.array(a, copy=True)))
    monkeypatch.setitem(globals(), "H", _foreign_host)
    CUDA_LAUNCH_CASES[name](np.random.default_rng(0))
    assert launches, "no kernel was launched"


def test_bgemm_refuses_bad_shapes():
    a = D(np.zeros((1, 1, 4, 3), np.float32))
    with pytest.raises(ValueError, match="shapes"):
        TD.bgemm(a, a, D(np.zeros((1, 1, 4, 4), np.float32)))
    with pytest.raises(ValueError, match="square"):
        TD.bgemm(a, a, D(np.zeros((1, 1, 4, 4), np.float32)), trans_b=True, mode=TD.K_LE_ROW)
    with pytest.raises(ValueError, match="alpha"):
        TD.bgemm(a, a, D(np.zeros((1, 1, 4, 4), np.float32)), trans_b=True,
                 accumulate=TD.RESCALE_ADD)


# ----------------------------------------------------------------------------- simulator
SIM_SCRIPT = """
import numpy as np
from numba import config, cuda
from minidl.kernels import _cuda
from minidl.kernels.transformer import attention_rows as AR
from minidl.kernels.pointwise import dropout as DR
from minidl.kernels.transformer import embedding as EM
from minidl.kernels.normalization import layernorm as LN
from minidl.kernels.transformer import transformer_device as TD
assert config.ENABLE_CUDASIM and _cuda.grid(10**6) == (4, 32)
rng = np.random.default_rng(0)
D, H = cuda.to_device, (lambda a: a.copy_to_host())
for dt in (np.float32, np.float64):
    tol = dict(rtol=1e-5, atol=1e-5) if dt == np.float32 else dict(rtol=1e-12, atol=1e-12)
    f = lambda *s: rng.standard_normal(s).astype(dt)
    # GEMM on head views of a fused qkv: 4 blocks of 32 threads over 2 matrices of 2x2 tiles
    b, t, h, hd = 1, 20, 2, 8
    qkv = f(b, t, 3 * h * hd)
    heads = lambda a, parts: a.reshape(b, t, parts, h, hd).transpose((2, 0, 3, 1, 4))
    q, k, v = heads(qkv, 3)
    dq, dk, dv = heads(D(qkv), 3)
    s_dev = D(np.full((b, h, t, t), np.nan, dt))
    TD.bgemm(dq, dk, s_dev, trans_b=True)
    np.testing.assert_allclose(H(s_dev), q @ k.swapaxes(-1, -2), **tol)
    p = np.tril(f(b, h, t, t))
    out = D(np.full((b, t, h * hd), np.nan, dt))
    TD.bgemm(D(p), dv, heads(out, 1)[0], mode=TD.K_LE_ROW)
    np.testing.assert_allclose(heads(H(out), 1)[0], p @ v, **tol)
    dres = D(np.zeros((b, h, t, hd), dt))
    TD.bgemm(D(p), dq, dres, trans_a=True, mode=TD.K_GE_ROW, accumulate=TD.ADD)
    np.testing.assert_allclose(H(dres), p.swapaxes(-1, -2) @ q, **tol)
    # row kernels: 32-thread block reductions over rows longer than a block (few rows: each
    # simulated synchronisation is slow), elementwise kernels over more work than the threads
    s = f(2, 5, 45) * 3
    for causal in (False, True):
        want, got = s.copy(), D(s)
        AR.softmax_rows(want, 0.4, causal)
        AR.softmax_rows(got, 0.4, causal)
        np.testing.assert_allclose(H(got), want, **tol)
        ml = [f(2, 5), np.abs(f(2, 5)) + 1, f(2, 5)]
        want, got = [s.copy()] + [a.copy() for a in ml], [D(s)] + [D(a) for a in ml]
        AR.online_rows(*want, 0.4, causal, 40, 0, False)
        AR.online_rows(*got, 0.4, causal, 40, 0, False)
        for g, w in zip(got, want):
            np.testing.assert_allclose(H(g), w, **tol)
    s = f(3, 45, 45)
    want, got = np.empty_like(s), D(s)
    AR.dropout_rows(s, want, 0.3, 9, 45, 0, 0)
    AR.dropout_rows(D(s), got, 0.3, 9, 45, 0, 0)
    np.testing.assert_array_equal(H(got), want)
    a, c = f(3, 45, 12), f(3, 45, 12)
    want, got = np.empty((6, 45), dt), D(np.zeros((6, 45), dt))
    AR.rowdot(a, c, want, 2)
    AR.rowdot(D(a), D(c), got, 2)
    np.testing.assert_allclose(H(got), want, **tol)
    # LayerNorm: rows of 45 columns; the parameter sums over 300 rows (two parts)
    for rows in (9, 300):
        x, w, bias, dy = f(rows, 45) + 1, f(45), f(45), f(rows, 45)
        want = [np.empty((rows, 45), dt), np.empty(rows, dt), np.empty(rows, dt)]
        LN.layernorm_forward(x, w, bias, *want, 1e-5)
        if rows < 10:
            got = [D(np.zeros_like(a)) for a in want]
            LN.layernorm_forward(D(x), D(w), D(bias), *got, 1e-5)
            for g, a in zip(got, want):
                np.testing.assert_allclose(H(g), a, **tol)
        ws = LN.backward_workspace_shape(rows, 45)
        hw = [np.empty(45, dt), np.empty(45, dt)]
        hdx = np.empty_like(dy) if rows < 10 else None
        LN.layernorm_backward(dy, x, w, want[1], want[2], hdx, *hw, np.empty(ws, dt))
        dw, ddx = [D(np.zeros(45, dt)) for _ in range(2)], D(np.zeros_like(dy))
        LN.layernorm_backward(D(dy), D(x), D(w), D(want[1]), D(want[2]),
                              ddx if rows < 10 else None, *dw, D(np.zeros(ws, dt)))
        if rows < 10:
            np.testing.assert_allclose(H(ddx), hdx, **tol)
        for g, a in zip(dw, hw):
            np.testing.assert_array_equal(H(g), a)
    # dropout layer, embedding and positional gradients
    xs = f(3001)
    y, m = np.empty_like(xs), np.empty(3001, np.uint8)
    DR.dropout_forward(xs, 0.4, 3, y, m, None)
    dy_, dm = D(np.zeros_like(xs)), D(np.zeros(3001, np.uint8))
    DR.dropout_forward(D(xs), 0.4, 3, dy_, dm, None)
    np.testing.assert_array_equal(H(dy_), y)
    np.testing.assert_array_equal(H(dm), m)
    idx, rows = rng.integers(0, 50, 200), f(200, 9)
    want = np.empty((50, 9), dt)
    EM.embedding_backward(idx, rows, want)
    got = D(np.full((50, 9), np.nan, dt))
    EM.embedding_backward(D(idx), D(rows), got)
    np.testing.assert_array_equal(H(got), want)
    g3 = f(4, 30, 9)
    got = D(np.full((40, 9), np.nan, dt))
    EM.positional_grad_device(D(g3), got, False)
    want = np.zeros((40, 9), dt)
    np.sum(g3, axis=0, out=want[:30])
    np.testing.assert_array_equal(H(got), want)
print("SIM OK")
"""


def test_kernels_under_the_simulator():
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["NUMBA_ENABLE_CUDASIM"] = "1"
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(SIM_SCRIPT)], env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "SIM OK" in r.stdout, r.stdout + r.stderr
