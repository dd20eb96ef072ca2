"""CUDA versions of the codec kernels (bitpack, poolidx, sparse, precision).

The Numba CUDA simulator must be switched on before ``numba.cuda`` is first imported, and
other test files import numba in this process, so the simulator checks run in a subprocess
with ``NUMBA_ENABLE_CUDASIM=1`` on small inputs (launches of at most [4, 32]). A second
subprocess compiles every kernel to PTX for a real GPU (compute capability 7.5) when NVVM is
installed, which catches typing errors the simulator (plain Python) cannot see.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from minidl.kernels import _cuda

SIM_SCRIPT = textwrap.dedent("""
    import numpy as np
    from numba import config, cuda
    from minidl.kernels import bitpack as bp, poolidx as pi, sparse as sp, precision as pr
    assert config.ENABLE_CUDASIM
    rng = np.random.default_rng(0)
    D, H = cuda.to_device, (lambda a: a.copy_to_host())

    def same(a, b):
        assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
        assert np.array_equal(a.view(np.uint8), b.view(np.uint8))

    # bitpack: lengths not multiple of 8, -0.0, NaN, inf; in-place ReLU backward; a stream
    n = 1003
    x = rng.standard_normal(n).astype(np.float32)
    x[::7] = 0; x[3] = -0.0; x[5] = np.nan; x[6] = np.inf
    pk = bp.pack_sign(D(x), stream=cuda.stream())
    same(H(pk), np.packbits(x > 0, bitorder="little"))
    for dt in (np.float32, bool):
        same(H(bp.unpack_sign(pk, n, dtype=dt)), (x > 0).astype(dt))
    dy = rng.standard_normal(n).astype(np.float32)
    want = np.where(x > 0, dy, np.float32(0))
    same(H(bp.relu_backward_packed(D(dy), pk)), want)
    ddy = D(dy)
    bp.relu_backward_packed(ddy, pk, out=ddy)
    same(H(ddy), want)
    same(H(bp.pack_sign(D(np.zeros(0, np.float32)))), np.zeros(0, np.uint8))

    # poolidx: every bit width; backward with overlapping windows and padding
    for bits in (1, 2, 4, 8):
        idx = rng.integers(0, 2**bits, 301).astype(np.uint8)
        p = pi.pack_indices(D(idx), bits)
        same(H(p), pi.pack_indices(idx, bits, impl="numpy"))
        same(H(pi.unpack_indices(p, bits, idx.size)), idx)
    for k, s, pad, hw in [((2, 2), (2, 2), (0, 0), (8, 9)), ((3, 3), (2, 2), (1, 1), (7, 8)),
                          ((3, 3), (1, 1), (1, 1), (5, 5))]:
        ho = (hw[0] + 2 * pad[0] - k[0]) // s[0] + 1
        wo = (hw[1] + 2 * pad[1] - k[1]) // s[1] + 1
        idx = rng.integers(0, k[0] * k[1], (2, 2, ho, wo)).astype(np.uint8)
        g = rng.standard_normal(idx.shape).astype(np.float32)
        p = pi.pack_indices(idx, pi.index_bits(k[0] * k[1]))
        want = pi.maxpool_backward_packed(g, p, (2, 2) + hw, k, s, pad, impl="numpy")
        same(H(pi.maxpool_backward_packed(D(g), D(p), (2, 2) + hw, k, s, pad)), want)

    # sparse: both dtypes, every format, byte-identical buffers, bit-exact decode
    for dt in (np.float32, np.float64):
        xs = (rng.standard_normal(2000) * (rng.random(2000) < 0.3)).astype(dt)
        xs[-50:] = 0; xs[1] = -0.0; xs[2] = np.nan
        nnz = sp.count_nonzero(D(xs))
        assert nnz == sp.count_nonzero(xs, impl="numpy")
        for fmt, w in (("zvc", 256), ("csr", 256), ("csr", 300), ("csr", 65536), ("dense", 256)):
            nb = sp.encoded_nbytes(xs.size, nnz, fmt, xs.itemsize, w)
            hb = np.zeros(nb, np.uint8)
            sp.encode(xs, hb, fmt, w, impl="numpy")
            db = D(np.zeros(nb, np.uint8))
            assert sp.encode(D(xs), db, fmt, w) == nb
            same(H(db), hb)
            out = D(np.full(xs.size, 9, dt))
            sp.decode(db, out, "dense" if fmt == "dense" else None)
            same(H(out), xs)

    # precision: specials, subnormals, overflow
    xf = np.concatenate([rng.standard_normal(300).astype(np.float32) * 100, np.array(
        [0, -0.0, np.inf, -np.inf, np.nan, 1e-8, 6e-8, 3e-5, 2.0**-10, 500, 65520, 1e-3],
        np.float32)])
    for fmt in pr.FORMATS:
        c = pr.encode(D(xf), fmt)
        same(H(c), pr.encode(xf, fmt, impl="numpy"))
        codes = np.arange(256, dtype=np.uint8) if fmt == "fp8" else rng.integers(
            0, 65536, 2000).astype(np.uint16)
        want = pr.decode(codes, fmt, impl="numpy")
        got = H(pr.decode(D(codes), fmt))
        fin = ~np.isnan(want)
        same(got[fin], want[fin])
        assert np.isnan(got[~fin]).all()
        assert np.array_equal(np.signbit(got), np.signbit(want))
    print("SIM OK")
""")

PTX_SCRIPT = textwrap.dedent("""
    from types import SimpleNamespace
    from numba import cuda, types as t
    import numba.cuda.dispatcher as disp
    from minidl.kernels import _cuda, bitpack as bp, poolidx as pi, sparse as sp, precision as pr
    # No GPU: device functions (and overloaded builtins) are compiled for the current
    # device's compute capability; pretend it is 7.5 so that compile_ptx can type everything.
    disp.get_current_device = lambda: SimpleNamespace(compute_capability=(7, 5))
    for m in (bp, pi, sp, pr, _cuda):
        m._kernels()
    A = lambda d: d[::1]
    f32, f64, u8, u16, u32, u64 = t.float32, t.float64, t.uint8, t.uint16, t.uint32, t.uint64
    i8, i32, i64, b1 = t.int8, t.int32, t.int64, t.boolean
    checks = [
        (bp._k_pack, (A(f32), A(u8), i64)), (bp._k_pack, (A(b1), A(u8), i64)),
        (bp._k_unpack, (A(u8), A(f32), i64)), (bp._k_unpack, (A(u8), A(b1), i64)),
        (bp._k_relu_bwd, (A(f32), A(u8), A(f32), i64, f32)),
        (bp._k_relu_bwd, (A(f64), A(u8), A(f64), i64, f64)),
        (pi._k_pack, (A(u8), A(u8), i64, i64)), (pi._k_pack, (A(i8), A(u8), i64, i64)),
        (pi._k_unpack, (A(u8), A(u8), i64, i64)),
        (pi._k_maxpool_bwd, (A(f32), A(u8), A(f32)) + (i64,) * 12 + (f32,)),
        (sp._k_counts, (A(u32), A(i64), i64, i64, u32)),
        (sp._k_counts, (A(u64), A(i64), i64, i64, u64)),
        (sp._k_zvc_encode, (A(u32), A(u8), A(u32), A(i64), i64, i64, u32)),
        (sp._k_mask_counts, (A(u8), A(i64), i64)),
        (sp._k_zvc_decode, (A(u8), A(u32), A(i64), A(u32), i64, i64, u32)),
        (sp._k_csr_encode, (A(u32), A(i32), A(u32), A(u8), i64, i64, u32)),
        (sp._k_csr_encode, (A(u64), A(i64), A(u64), A(u16), i64, i64, u64)),
        (sp._k_csr_decode, (A(u32), A(u8), A(i32), A(u32), i64, i64, u32)),
        (sp._k_csr_decode, (A(u64), A(u16), A(i64), A(u64), i64, i64, u64)),
        (_cuda._k_exclusive_scan, (A(i64), A(i64), i64)),
        (_cuda._k_exclusive_scan, (A(i64), A(i32), i64)),
        (pr._k_encode, (A(u32), A(u16), i64, i64)), (pr._k_encode, (A(u32), A(u8), i64, i64)),
        (pr._k_decode, (A(u16), A(u32), i64, i64)), (pr._k_decode, (A(u8), A(u32), i64, i64)),
    ]
    try:
        cuda.compile_ptx(checks[0][0], checks[0][1], cc=(7, 5))
    except Exception as e:  # no NVVM / CUDA toolkit on this machine
        print("SKIP", type(e).__name__, str(e).strip().splitlines()[0][:200])
        raise SystemExit(0)
    for fn, sig in checks:
        cuda.compile_ptx(fn, sig, cc=(7, 5))
    print("PTX OK", len(checks))
""")


def _run(script: str, sim: bool, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    if sim:
        env["NUMBA_ENABLE_CUDASIM"] = "1"
    return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_cuda_kernels_under_simulator():
    r = _run(SIM_SCRIPT, sim=True)
    assert r.returncode == 0 and "SIM OK" in r.stdout, r.stdout + r.stderr


def test_cuda_kernels_compile_to_ptx():
    r = _run(PTX_SCRIPT, sim=False)
    assert r.returncode == 0, r.stdout + r.stderr
    if r.stdout.startswith("SKIP"):
        pytest.skip(r.stdout.strip())
    assert "PTX OK" in r.stdout


def test_import_does_not_load_numba_cuda():
    script = ("import sys, numpy as np\n"
              "from minidl.kernels import bitpack, poolidx, sparse, precision\n"
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
