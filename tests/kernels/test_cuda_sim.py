"""CUDA kernels (bitpack, poolidx, sparse, precision, pooling, conv im2col / col2im, the scan,
batch norm, softmax cross-entropy) in the simulator.

The Numba CUDA simulator must be switched on before ``numba.cuda`` is first imported, and other
test files import numba in this process, so each check runs in a subprocess with
``NUMBA_ENABLE_CUDASIM=1``, on Numba (simulator) device arrays. Launches there are at most
``[4, 32]`` (128 threads; the scan runs one block of 32), so the sizes below give every thread
several grid-stride steps (work > 128, and > 128 chunks of 256 elements for the sparse
counts), with lengths that are not multiples of 8 or 32. Results are compared bit for bit with
the NumPy references, but for batch norm and softmax cross-entropy, whose blocks add float64
partial sums in a tree (the CPU in another order): within rounding; their channels or rows
spread over the 4 blocks, their values over a block's 32 threads. PTX compilation is in
test_cuda_ptx.py, the emulated (one-thread) launches in test_cuda_launch.py (and
test_norm_loss_device_kernels.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from minidl.kernels import _cuda

PRELUDE = textwrap.dedent("""
    import numpy as np
    from numba import config, cuda
    from minidl.kernels import _cuda
    assert config.ENABLE_CUDASIM and _cuda.grid(10**6) == (4, 32)
    rng = np.random.default_rng(0)
    D, H = cuda.to_device, (lambda a: a.copy_to_host())

    def same(a, b):
        assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
        assert np.array_equal(np.ascontiguousarray(a).view(np.uint8),
                              np.ascontiguousarray(b).view(np.uint8))
""")

SCRIPTS = {
    # lengths not multiple of 8, -0.0, NaN, inf; in-place ReLU backward; an explicit stream
    "bitpack": """
        from minidl.kernels.codecs import bitpack as bp
        for n, dt in ((2053, np.float32), (1111, np.float64), (1029, np.bool_)):
            x = rng.standard_normal(n)
            x[::7] = 0; x[3] = -0.0; x[5] = np.nan; x[6] = np.inf
            x = x.astype(dt)
            for stream in (None, cuda.stream()):
                pk = bp.pack_sign(D(x), stream=stream)
                same(H(pk), np.packbits(x > 0, bitorder="little"))
            for udt in (np.float32, bool):
                same(H(bp.unpack_sign(pk, n, dtype=udt)), (x > 0).astype(udt))
            if dt == np.bool_:
                continue
            dy = rng.standard_normal(n).astype(dt)
            want = bp.relu_backward_packed(dy, H(pk), impl="numpy")
            same(H(bp.relu_backward_packed(D(dy), pk)), want)
            ddy = D(dy)
            bp.relu_backward_packed(ddy, pk, out=ddy)
            same(H(ddy), want)
        same(H(bp.pack_sign(D(np.zeros(0, np.float32)))), np.zeros(0, np.uint8))
        import ml_dtypes
        for dt in (np.float16, ml_dtypes.bfloat16):  # read as their bits
            x = rng.standard_normal(1029)
            x[::7] = 0; x[3] = -0.0; x[5] = np.nan; x[6] = np.inf; x[8] = -np.inf
            x = x.astype(dt)
            same(H(bp.pack_sign(D(x))), np.packbits(x > 0, bitorder="little"))
    """,
    # every bit width; backward with overlapping windows and padding
    "poolidx": """
        from minidl.kernels.pooling import poolidx as pi
        for bits in (1, 2, 4, 8):
            idx = rng.integers(0, 2**bits, 1301).astype(np.uint8)
            p = pi.pack_indices(D(idx), bits)
            same(H(p), pi.pack_indices(idx, bits, impl="numpy"))
            same(H(pi.unpack_indices(p, bits, idx.size)), idx)
        for k, s, pad, hw in [((2, 2), (2, 2), (0, 0), (17, 19)),
                              ((3, 3), (2, 2), (1, 1), (15, 13)),
                              ((3, 3), (1, 1), (1, 1), (9, 11))]:
            ho = (hw[0] + 2 * pad[0] - k[0]) // s[0] + 1
            wo = (hw[1] + 2 * pad[1] - k[1]) // s[1] + 1
            idx = rng.integers(0, k[0] * k[1], (2, 3, ho, wo)).astype(np.uint8)
            for dt in (np.float32, np.float64):
                g = rng.standard_normal(idx.shape).astype(dt)
                p = pi.pack_indices(idx, pi.index_bits(k[0] * k[1]))
                want = pi.maxpool_backward_packed(g, p, (2, 3) + hw, k, s, pad, impl="numpy")
                same(H(pi.maxpool_backward_packed(D(g), D(p), (2, 3) + hw, k, s, pad)), want)
    """,
    # count / zvc / csr with more chunks (256 elements) and rows than the 128 threads
    "sparse": """
        from minidl.kernels.codecs import sparse as sp
        for dt, n in ((np.float32, 33333), (np.float64, 4101)):
            xs = (rng.standard_normal(n) * (rng.random(n) < 0.3)).astype(dt)
            xs[-50:] = 0; xs[1] = -0.0; xs[2] = np.nan
            nnz = sp.count_nonzero(D(xs))
            assert nnz == sp.count_nonzero(xs, impl="numpy")
            fmts = (("zvc", 256), ("csr", 256), ("csr", 30), ("dense", 256))
            for fmt, w in fmts:
                nb = sp.encoded_nbytes(n, nnz, fmt, xs.itemsize, w)
                hb = np.zeros(nb, np.uint8)
                sp.encode(xs, hb, fmt, w, impl="numpy")
                db = D(np.zeros(nb, np.uint8))
                assert sp.encode(D(xs), db, fmt, w) == nb
                same(H(db), hb)
                out = D(np.full(n, 9, dt))
                sp.decode(db, out, "dense" if fmt == "dense" else None)
                same(H(out), xs)
    """,
    # the scan on its own: one block of 32 threads over many more counts, both offset types
    "scan": """
        for n, odt in ((1, np.int64), (31, np.int32), (1000, np.int64), (4097, np.int32)):
            counts = rng.integers(0, 300, n).astype(np.int64)
            offsets = D(np.full(n + 1, -1, odt))
            _cuda.exclusive_scan(D(counts), offsets)
            want = np.zeros(n + 1, odt)
            np.cumsum(counts, out=want[1:])
            same(H(offsets), want)
    """,
    # specials, subnormals, overflow; every fp8 code; float64 output
    "precision": """
        from minidl.kernels.codecs import precision as pr
        xf = np.concatenate([rng.standard_normal(301).astype(np.float32) * 100, np.array(
            [0, -0.0, np.inf, -np.inf, np.nan, 1e-8, 6e-8, 3e-5, 2.0**-10, 500, 65520, 1e-3,
             448, 464], np.float32)])
        for fmt in pr.FORMATS:
            c = pr.encode(D(xf), fmt)
            same(H(c), pr.encode(xf, fmt, impl="numpy"))
            codes = np.arange(256, dtype=np.uint8) if fmt == "fp8" else rng.integers(
                0, 65536, 777).astype(np.uint16)
            want = pr.decode(codes, fmt, impl="numpy")
            got = H(pr.decode(D(codes), fmt))
            fin = ~np.isnan(want)
            same(got[fin], want[fin])
            assert np.isnan(got[~fin]).all()
            assert np.array_equal(np.signbit(got), np.signbit(want))
    """,
    # max pooling forward (ties, NaN, -inf, padding) and backward (overlapping windows)
    # half (float16 / bfloat16) device arrays on their uint16 bits: ReLU (in place), max
    # pooling (non-overlapping windows: the backward and the packed backward on bits too)
    "half_bits": """
        import ml_dtypes
        from minidl.kernels.pointwise import relu as R
        from minidl.kernels.pooling import pool as P
        from minidl.kernels.pooling import poolidx as pi
        f32 = np.float32
        for dt in (np.float16, ml_dtypes.bfloat16):
            x = np.round(rng.standard_normal(2053) * 2).astype(f32)
            x[::7] = -0.0; x[::11] = 0; x[5] = np.nan; x[6] = np.inf; x[9] = -np.inf
            x = x.astype(dt)
            want = np.empty(x.shape, f32)
            R.relu_forward(x.astype(f32), want)
            out = D(x)
            R.relu_forward(out, out)
            same(H(out), want.astype(dt))
            dy = rng.standard_normal(x.size).astype(dt)
            R.relu_backward(dy.astype(f32), x.astype(f32), want)
            out = D(dy)
            R.relu_backward(out, D(x), out)
            same(H(out), want.astype(dt))
            xs = x[:2 * 3 * 17 * 19].reshape(2, 3, 17, 19)
            for k, s, pad in (((2, 2), (2, 2), (0, 0)), ((3, 3), (3, 3), (1, 1))):
                y_ref, i_ref = P.maxpool2d_forward_ref(xs.astype(f32), k, s, pad)
                y, idx = D(np.zeros(y_ref.shape, dt)), D(np.zeros(y_ref.shape, i_ref.dtype))
                P.maxpool2d_forward(D(xs), y, idx, k, s, pad)
                same(H(y), y_ref.astype(dt))
                same(H(idx), i_ref)
                g = rng.standard_normal(y_ref.shape).astype(dt)
                want = P.maxpool2d_backward_ref(g.astype(f32), i_ref, xs.shape, k, s,
                                                pad).astype(dt)
                dx = D(np.full(xs.shape, 7, dt))
                P.maxpool2d_backward(D(g), idx, dx, k, s, pad)
                same(H(dx), want)
                pk = pi.pack_indices(i_ref, pi.index_bits(k[0] * k[1]))
                same(H(pi.maxpool_backward_packed(D(g), D(pk), xs.shape, k, s, pad)), want)
    """,
    "maxpool": """
        from minidl.kernels.pooling import pool as P
        for k, s, pad, shape in [((2, 2), (2, 2), (0, 0), (2, 3, 17, 19)),
                                 ((3, 3), (2, 2), (1, 1), (1, 3, 15, 13)),
                                 ((3, 3), (1, 1), (1, 1), (2, 1, 9, 11)),
                                 ((17, 17), (1, 1), (8, 8), (1, 1, 12, 13))]:  # uint16 argmax
            for dt in (np.float32, np.float64):
                x = np.round(rng.standard_normal(shape) * 2).astype(dt)
                x.reshape(-1)[::41] = np.nan
                x.reshape(-1)[3::37] = -np.inf
                y_ref, i_ref = P.maxpool2d_forward_ref(x, k, s, pad)
                y, idx = D(np.full(y_ref.shape, 7, dt)), D(np.full(y_ref.shape, 3, i_ref.dtype))
                P.maxpool2d_forward(D(x), y, idx, k, s, pad)
                same(H(y), y_ref)
                same(H(idx), i_ref)
                dy = rng.standard_normal(y_ref.shape).astype(dt)
                dx = D(np.full(shape, 7, dt))
                P.maxpool2d_backward(D(dy), D(i_ref), dx, k, s, pad)
                same(H(dx), P.maxpool2d_backward_ref(dy, i_ref, shape, k, s, pad))
    """,
    # conv_device's im2col / col2im tile kernels: a multi-image tile, bands of rows (dx
    # accumulated over them from NaN garbage), padding, stride, dilation
    "conv_device": """
        from minidl.kernels.convolution import conv_device as CD
        for x_shape, k, s, pad, dil, cap in [
                ((3, 2, 7, 6), (3, 3), (1, 1), (1, 1), (1, 1), 1 << 20),
                ((1, 3, 9, 7), (3, 2), (2, 1), (2, 1), (1, 2), 2100)]:
            for dt in (np.float32, np.float64):
                x = rng.standard_normal(x_shape).astype(dt)
                lay = CD._device_layout(x_shape, 2, k, s, pad, dil, 1, x.itemsize, True, cap)
                assert lay.images > 1 or 1 < lay.rows < lay.ho, lay
                taps = CD._taps(x_shape, k, s, pad, dil, lay.ho, lay.wo)
                dx_ref = np.full(x_shape, np.nan, dt)
                dx = D(dx_ref)
                for n0, n1, r0, r1 in CD._tiles(x_shape[0], lay):
                    size = x_shape[1] * k[0] * k[1] * (n1 - n0) * (r1 - r0) * lay.wo
                    col_ref, col = np.full(size, 7, dt), D(np.full(size, 7, dt))
                    CD._im2col(x, col_ref, taps, n0, n1, r0, r1)
                    CD._im2col(D(x), col, taps, n0, n1, r0, r1)
                    same(H(col), col_ref)
                    dcol = rng.standard_normal(size).astype(dt)
                    CD._col2im(dcol, dx_ref, taps, n0, n1, r0, r1)
                    CD._col2im(D(dcol), dx, taps, n0, n1, r0, r1)
                    same(H(dx), dx_ref)
    """,
    # average pooling's gather kernels (padding, overlapping and gapped windows)
    "avgpool": """
        from minidl.kernels.pooling import pool as P
        from minidl.kernels.pooling import pool_device as PD
        for k, s, pad, shape in [((3, 3), (2, 2), (1, 1), (2, 2, 11, 13)),
                                 ((2, 3), (3, 1), (1, 1), (1, 3, 10, 9))]:
            ho, wo = P.pool_output_hw(shape[2:], k, s, pad)
            for dt in (np.float32, np.float64):
                x = rng.standard_normal(shape).astype(dt)
                y_ref = np.full((*shape[:2], ho, wo), np.nan, dt)
                PD.avgpool2d_forward_device(x, y_ref, k, s, pad)
                y = D(np.full(y_ref.shape, np.nan, dt))
                PD.avgpool2d_forward_device(D(x), y, k, s, pad)
                same(H(y), y_ref)
                dy = rng.standard_normal(y_ref.shape).astype(dt)
                dx_ref = np.full(shape, np.nan, dt)
                PD.avgpool2d_backward_device(dy, dx_ref, k, s, pad)
                dx = D(np.full(shape, np.nan, dt))
                PD.avgpool2d_backward_device(D(dy), dx, k, s, pad)
                same(H(dx), dx_ref)
    """,
    # batch norm: channels over 4 blocks (grid-stride), channels' values fewer and more than
    # the 32 threads; the finalize block's 40 channels over 32 threads, the counter read by
    # all before it is incremented; float64 tree sums, so compared within 1e-12
    "batchnorm": """
        from minidl.kernels.normalization import batchnorm as bnk
        def close(a, b, rtol):
            np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol * np.abs(b).max())
        for dt in (np.float32, np.float64):
            for shape in ((3, 6, 7), (4, 3, 20), (5, 2, 1)):
                n, c, s = shape
                x = (rng.standard_normal(shape) * 3 + 1).astype(dt)
                dy = rng.standard_normal(shape).astype(dt)
                m, v = np.empty(c), np.empty(c)
                bnk.stats(x, m, v)
                dm, dv = D(np.zeros(c)), D(np.zeros(c))
                bnk.stats(D(x), dm, dv)
                close(H(dm), m, 1e-12)
                close(H(dv), v, 1e-12)
                mean, k, shift, coef = (rng.standard_normal(c).astype(dt) for _ in range(4))
                y, dy_ = np.empty_like(x), np.empty_like(x)
                bnk.apply(x, mean, k, shift, y)
                dyd = D(np.full(shape, np.nan, dt))
                bnk.apply(D(x), D(mean), D(k), D(shift), dyd)
                close(H(dyd), y, 1e-6)
                sums = np.empty(c), np.empty(c)
                bnk.reduce(dy, x, mean, *sums)
                dsums = D(np.zeros(c)), D(np.zeros(c))
                bnk.reduce(D(dy), D(x), D(mean), *dsums)
                close(H(dsums[0]), sums[0], 1e-12)
                close(H(dsums[1]), sums[1], 1e-12)
                bnk.backward_apply(dy, x, mean, k, shift, coef, dy_)
                dd = D(dy)
                bnk.backward_apply(dd, D(x), D(mean), D(k), D(shift), D(coef), dd)
                close(H(dd), dy_, 1e-6)
            c = 40
            m64, v64 = rng.standard_normal(c), rng.uniform(0.1, 2, c)
            w, b, rm, rv = (rng.uniform(0.5, 2, c).astype(dt) for _ in range(4))
            outs = [D(np.full(c, np.nan, dt)) for _ in range(4)]
            drm, drv, tracked = D(rm), D(rv), D(np.array([4]))
            bnk.finalize_device(D(m64), D(v64), 1e-5, *outs, weight=D(w), bias=D(b),
                                running_mean=drm, running_var=drv, tracked=tracked,
                                momentum=None, unbias=1.25, update=True)
            inv = (1.0 / np.sqrt(v64 + 1e-5)).astype(dt)
            same(H(outs[0]), m64.astype(dt))
            same(H(outs[1]), inv)
            same(H(outs[2]), w * inv)
            same(H(outs[3]), b)
            close(H(drm), (0.8 * rm + 0.2 * m64).astype(dt), 1e-6)
            close(H(drv), (0.8 * rv + 0.2 * v64 * 1.25).astype(dt), 1e-6)
            assert H(tracked)[0] == 5
            sums = rng.standard_normal(c), rng.standard_normal(c)
            outs = [D(np.full(c, np.nan, dt)) for _ in range(3)]
            gw = D(np.ones(c, dt))
            bnk.backward_finalize_device(*(D(a) for a in sums), D(inv), *outs, weight=D(w),
                                         grad_weight=gw, accumulate=("weight",), count=12.0)
            inv64 = inv.astype(np.float64)
            same(H(gw), (1 + sums[1] * inv64).astype(dt))
            same(H(outs[0]), (w.astype(np.float64) * inv64).astype(dt))
            same(H(outs[1]), (sums[0] / 12.0).astype(dt))
            same(H(outs[2]), (inv64 * (sums[1] * inv64) / 12.0).astype(dt))
    """,
    # softmax cross-entropy: rows over 4 blocks, classes fewer and more than the 32 threads,
    # a NaN row, ties and -inf; against the layer's host path (float32 sums there)
    "softmax_xent": """
        from minidl.kernels.pointwise import softmax_xent as sx
        from minidl.layers import Context, SoftmaxCrossEntropy
        for dt, rtol in ((np.float32, 2e-6), (np.float64, 1e-12)):
            for m, k in ((6, 45), (5, 3)):
                x = (rng.standard_normal((m, k)) * 2).astype(dt)
                x[1, :] = 1.5
                x[2, 0], x[3, 2] = -np.inf, np.nan
                t = rng.integers(0, k, m)
                g = np.array(0.8, dt)
                for eps in (0.0, 0.1):
                    layer = SoftmaxCrossEntropy(eps)
                    ws = np.empty(layer.forward_workspace_bytes([x.shape, t.shape], dt), np.uint8)
                    loss, dx = np.empty((), dt), np.empty_like(x)
                    with np.errstate(invalid="ignore"):
                        layer.forward(Context(), [x, t], [loss], {}, {}, ws)
                        layer.backward(Context(), [g], [dx, None], [x, t], [loss], {}, {}, {},
                                       None)
                    nll, dloss = D(np.zeros(m)), D(np.zeros(1, dt))
                    sx.forward_device(D(x), D(t), eps, nll, dloss)
                    assert np.isnan(H(dloss)[0]) and np.isnan(loss)  # the NaN row
                    want = ~np.isnan(x).any(axis=1)
                    assert not np.isnan(H(nll)[want]).any() and np.isnan(H(nll)[~want]).all()
                    x2, t2 = x[want], t[want]
                    l2, dx2 = np.empty((), dt), np.empty_like(x2)
                    layer.forward(Context(), [x2, t2], [l2], {}, {}, ws)
                    layer.backward(Context(), [g], [dx2, None], [x2, t2], [l2], {}, {}, {}, None)
                    sx.forward_device(D(x2), D(t2), eps, D(np.zeros(len(x2))), dloss)
                    np.testing.assert_allclose(H(dloss)[0], l2, rtol=rtol)
                    ddx = D(np.full(x.shape, np.nan, dt))
                    sx.backward_device(D(x), D(t), D(g), eps, ddx)
                    got = H(ddx)
                    np.testing.assert_allclose(got, dx, rtol=rtol, atol=rtol * float(g) / m)
    """,
}


def _run(script: str, sim: bool, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    if sim:
        env["NUMBA_ENABLE_CUDASIM"] = "1"
    return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_cuda_kernels_under_simulator(name):
    script = PRELUDE + textwrap.dedent(SCRIPTS[name]) + "\nprint('SIM OK')\n"
    r = _run(script, sim=True)
    assert r.returncode == 0 and "SIM OK" in r.stdout, r.stdout + r.stderr


def test_import_does_not_load_numba_cuda():
    script = ("import sys, numpy as np\n"
              "from minidl.kernels.codecs import bitpack, sparse, precision\n"
              "from minidl.kernels.pooling import poolidx, pool\n"
              "bitpack.pack_sign(np.ones(9, np.float32))\n"
              "assert 'numba.cuda' not in sys.modules, 'numba.cuda imported'\n"
              "print('LAZY OK')\n")
    r = _run(script, sim=False, timeout=120)
    assert r.returncode == 0 and "LAZY OK" in r.stdout, r.stdout + r.stderr


class _FakeDeviceArray:
    __cuda_array_interface__ = {"shape": (1,), "typestr": "<f4", "data": (0, False),
                                "version": 3}


def test_dispatch_by_array_type():
    host, dev = np.zeros(3, np.float32), _FakeDeviceArray()
    assert _cuda.choose("auto", host, None) == "numba"
    assert _cuda.choose("auto", dev, dev) == "cuda"
    assert _cuda.choose("numpy", host) == "numpy"
    with pytest.raises(TypeError, match="mix"):
        _cuda.choose("auto", host, dev)
    with pytest.raises(TypeError):
        _cuda.choose("numba", dev)
    with pytest.raises(TypeError):
        _cuda.choose("cuda", host)
    with pytest.raises(ValueError):
        _cuda.choose("gpu", host)
