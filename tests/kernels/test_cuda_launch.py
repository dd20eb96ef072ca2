"""Launching the CUDA kernels without a GPU: emulated device arrays and CuPy launches.

Emulated device arrays (``__emulated_device_buffer__``) run each kernel's own Python function,
compiled with njit as one CUDA thread; every kernel must then be bit-equal to its NumPy
reference (``impl="numpy"``) on sizes around 1024 and 4096. The CuPy launch path is checked
with real ``cupy.ndarray`` objects over fake pointers and a recording stand-in for
``numba.cuda`` (no device access happens before the kernel call).

``CASES`` also serves tests/kernels/test_cuda_ptx.py, which compiles to PTX every signature
these cases launch.
"""

from __future__ import annotations

import os
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
from emulated_arrays import D, EmuArray, H, same

from minidl.kernels import _cuda
from minidl.kernels.codecs import bitpack as bp
from minidl.kernels.codecs import precision as pr
from minidl.kernels.codecs import sparse as sp
from minidl.kernels.compression import weight_record as wr
from minidl.kernels.convolution import conv_device as CD
from minidl.kernels.convolution import conv_device_half as CDH
from minidl.kernels.pooling import pool as P
from minidl.kernels.pooling import pool_device as PD
from minidl.kernels.pooling import poolidx as pi

SIZES = (1, 7, 1023, 1024, 1025, 4095, 4096, 4097, 9001)


def _specials(x: np.ndarray) -> np.ndarray:
    x = x.copy()
    x[::7] = 0
    x[3 % x.size] = -0.0
    if x.size > 6:
        x[5], x[6] = np.nan, np.inf
    return x


# ----------------------------------------------------------------------------- cases
def case_bitpack(rng: np.random.Generator) -> None:
    for n in SIZES:
        for dt in (np.float32, np.float64, np.bool_):
            x = _specials(rng.standard_normal(n)).astype(dt)
            pk = bp.pack_sign(D(x))
            same(H(pk), bp.pack_sign(x, impl="numpy"))
            for udt in (np.float32, np.float64, np.bool_):
                same(H(bp.unpack_sign(pk, n, dtype=udt)), bp.unpack_sign(
                    H(pk), n, dtype=udt, impl="numpy"))
            if dt == np.bool_:
                continue
            dy = rng.standard_normal(n).astype(dt)
            want = bp.relu_backward_packed(dy, H(pk), impl="numpy")
            same(H(bp.relu_backward_packed(D(dy), pk)), want)
            ddy = D(dy)
            bp.relu_backward_packed(ddy, pk, out=ddy)  # in place
            same(H(ddy), want)
        for dt in (np.float16, ml_dtypes.bfloat16):  # (read as their bits: _k_pack_half_bits)
            x = _specials(rng.standard_normal(n)).astype(dt)
            if n > 8:
                x[8] = -np.inf
            same(H(bp.pack_sign(D(x))), bp.pack_sign(x, impl="numpy"))


def case_poolidx(rng: np.random.Generator) -> None:
    for bits in (1, 2, 4, 8):
        for n in SIZES:
            for dt in (np.uint8, np.uint16):
                idx = rng.integers(0, 2**bits, n).astype(dt)
                p = pi.pack_indices(D(idx), bits)
                same(H(p), pi.pack_indices(idx, bits, impl="numpy"))
                same(H(pi.unpack_indices(p, bits, n)), pi.unpack_indices(H(p), bits, n,
                                                                         impl="numpy"))
    for k, s, pad, hw, planes in [((2, 2), (2, 2), (0, 0), (64, 65), (2, 3)),
                                  ((3, 3), (2, 2), (1, 1), (45, 46), (2, 2)),
                                  ((3, 3), (1, 1), (1, 1), (33, 31), (1, 4))]:
        ho = (hw[0] + 2 * pad[0] - k[0]) // s[0] + 1
        wo = (hw[1] + 2 * pad[1] - k[1]) // s[1] + 1
        for dt in (np.float32, np.float64):
            idx = rng.integers(0, k[0] * k[1], (*planes, ho, wo)).astype(np.uint8)
            g = rng.standard_normal(idx.shape).astype(dt)
            p = pi.pack_indices(idx, pi.index_bits(k[0] * k[1]))
            want = pi.maxpool_backward_packed(g, p, (*planes, *hw), k, s, pad, impl="numpy")
            same(H(pi.maxpool_backward_packed(D(g), D(p), (*planes, *hw), k, s, pad)), want)


def case_sparse(rng: np.random.Generator) -> None:
    for dt in (np.float32, np.float64):
        for n in SIZES + (33000,):
            xs = (rng.standard_normal(n) * (rng.random(n) < 0.3)).astype(dt)
            xs[-min(n, 50):] = 0
            if n > 2:
                xs[1], xs[2] = -0.0, np.nan
            nnz = sp.count_nonzero(D(xs))
            assert nnz == sp.count_nonzero(xs, impl="numpy")
            for fmt, w in (("zvc", 256), ("csr", 256), ("csr", 300), ("csr", 65536),
                           ("dense", 256)):
                nb = sp.encoded_nbytes(n, nnz, fmt, xs.itemsize, w)
                hb = np.zeros(nb, np.uint8)
                sp.encode(xs, hb, fmt, w, impl="numpy")
                db = D(np.zeros(nb + 5, np.uint8))
                assert sp.encode(D(xs), db, fmt, w) == nb
                same(H(db)[:nb], hb)
                out = D(np.full(n, 9, dt))
                sp.decode(db, out, "dense" if fmt == "dense" else None)
                same(H(out), xs)


def case_precision(rng: np.random.Generator) -> None:
    specials = np.array([0, -0.0, np.inf, -np.inf, np.nan, 1e-8, 6e-8, 3e-5, 2.0**-10, 500,
                         65520, 1e-3, 448, 464, -2.0**-9], np.float32)
    for n in SIZES:
        xf = np.concatenate([rng.standard_normal(n).astype(np.float32) * 100, specials])
        for fmt in pr.FORMATS:
            same(H(pr.encode(D(xf), fmt)), pr.encode(xf, fmt, impl="numpy"))
    for fmt in pr.FORMATS:
        cd = pr.code_dtype(fmt)
        codes = np.arange(np.iinfo(cd).max + 1, dtype=np.int64).astype(cd)  # every code
        for dt in (np.float32, np.float64):
            want = pr.decode(codes, fmt, dtype=dt, impl="numpy")
            got = H(pr.decode(D(codes), fmt, dtype=dt))
            fin = ~np.isnan(want)
            same(got[fin], want[fin])
            assert np.isnan(got[~fin]).all()
            assert np.array_equal(np.signbit(got), np.signbit(want))
            out = D(np.zeros(codes.size, dt))
            pr.decode(D(codes), fmt, out=out)
            same(H(out), got)


def case_maxpool(rng: np.random.Generator) -> None:
    for k, s, pad, shape in [((2, 2), (2, 2), (0, 0), (2, 3, 64, 65)),
                             ((3, 3), (2, 2), (1, 1), (2, 2, 45, 46)),
                             ((3, 3), (1, 1), (1, 1), (1, 4, 33, 31)),
                             ((17, 17), (1, 1), (8, 8), (1, 2, 20, 21))]:  # uint16 argmax
        for dt in (np.float32, np.float64):
            x = np.round(rng.standard_normal(shape) * 2).astype(dt)  # ties: first max wins
            x.reshape(-1)[::97] = np.nan
            x.reshape(-1)[5::89] = -np.inf
            y_ref, i_ref = P.maxpool2d_forward_ref(x, k, s, pad)
            y, idx = D(np.full(y_ref.shape, 7, dt)), D(np.full(y_ref.shape, 3, i_ref.dtype))
            P.maxpool2d_forward(D(x), y, idx, k, s, pad)
            same(H(y), y_ref)
            same(H(idx), i_ref)
            dy = rng.standard_normal(y_ref.shape).astype(dt)
            dx = D(np.full(shape, 7, dt))
            P.maxpool2d_backward(D(dy), D(i_ref), dx, k, s, pad)
            same(H(dx), P.maxpool2d_backward_ref(dy, i_ref, shape, k, s, pad))


def case_scan(rng: np.random.Generator) -> None:
    for n in SIZES:
        for odt in (np.int64, np.int32):
            counts = rng.integers(0, 300, n).astype(np.int64)
            offsets = D(np.full(n + 1, -1, odt))
            _cuda.exclusive_scan(D(counts), offsets)
            want = np.zeros(n + 1, odt)
            np.cumsum(counts, out=want[1:])
            same(H(offsets), want)


def case_weight_record(rng: np.random.Generator) -> None:
    """Compressed weights: shared records into float32 / float64, raw ones of every dtype."""
    for n in SIZES:
        for k, vb, ib, dens in ((1, 1, 1, 0.5), (13, 4, 3, 0.2), (200, 8, 5, 0.05)):
            codes = rng.integers(1, k + 1, n) * (rng.random(n) < dens)
            rec = wr.shared_record(codes, rng.standard_normal(k).astype(np.float32), vb, ib)
            for dt in (np.float32, np.float64):
                out, st = D(np.full(n, 7, dt)), D(np.full(1, 9, np.uint8))
                wr.decode_into(D(np.frombuffer(rec, np.uint8)), out, status=st)
                same(H(out), wr.decode_reference(rec).reshape(-1).astype(dt))
                assert H(st)[0] == 0
        for dt in wr.RAW_DTYPES:
            vals = (rng.standard_normal(n) * 100).astype(dt)
            out = D(np.zeros(n, dt))
            wr.decode_into(D(np.frombuffer(wr.raw_record(vals), np.uint8)), out)
            same(H(out), vals)


# x shape, kernel, stride, padding, dilation, groups (groups shape only the GEMM, not the tiles)
CONV_GEOMETRIES = [
    ((3, 4, 20, 21), (3, 3), (1, 1), (1, 1), (1, 1), 1),
    ((2, 6, 17, 15), (5, 3), (2, 1), (2, 1), (1, 2), 3),
    ((2, 2, 13, 11), (2, 3), (3, 2), (3, 0), (2, 1), 2),  # rows and taps all in the padding
    ((3, 3, 9, 10), (1, 1), (3, 2), (0, 0), (1, 1), 1),  # input rows no output reaches
    ((1, 3, 40, 7), (3, 2), (1, 1), (1, 1), (3, 1), 1),
]
#: column-matrix caps: whole batches per tile, bands of several rows, one row per tile
CONV_COL_CAPS = (16 << 20, 2000, 600, 0)


def case_conv_im2col_col2im(rng: np.random.Generator) -> None:
    """conv_device's im2col / col2im kernels (im2col on half bits too), tile by tile as the
    device convolution runs them (multi-image tiles, bands of rows, one row per tile),
    against the slice code on NumPy arrays; ``dx`` starts as NaN garbage (each image's first
    tile zeroes it) and accumulates over the bands."""
    kinds = set()
    for x_shape, k, s, pad, dil, groups in CONV_GEOMETRIES:
        for cap in CONV_COL_CAPS:
            for dt in (np.float32, np.float64, np.float16, ml_dtypes.bfloat16):
                x = _specials(rng.standard_normal(x_shape).reshape(-1)).reshape(x_shape)
                x, half = x.astype(dt), np.dtype(dt).itemsize == 2  # (half: the uint16 bits)
                lay = CD._device_layout(x_shape, 2 * groups, k, s, pad, dil, groups,
                                        x.itemsize, True, cap)
                kinds.add("images" if lay.images > 1 else "band" if 1 < lay.rows < lay.ho
                          else "row" if lay.rows == 1 < lay.ho else "image")
                taps = CD._taps(x_shape, k, s, pad, dil, lay.ho, lay.wo)
                xd, dx_ref = D(x), np.full(x_shape, np.nan, dt)
                dx = D(dx_ref)
                for n0, n1, r0, r1 in CD._tiles(x_shape[0], lay):
                    size = x_shape[1] * k[0] * k[1] * (n1 - n0) * (r1 - r0) * lay.wo
                    col_ref, col = np.full(size, 7, dt), D(np.full(size, 7, dt))
                    CD._im2col(x, col_ref, taps, n0, n1, r0, r1)
                    (CDH._im2col_half if half else CD._im2col)(xd, col, taps, n0, n1, r0, r1)
                    same(H(col), col_ref)
                    if half:
                        continue
                    dcol = rng.standard_normal(size).astype(dt)
                    dcol[::11] = -0.0
                    CD._col2im(dcol, dx_ref, taps, n0, n1, r0, r1)
                    CD._col2im(D(dcol), dx, taps, n0, n1, r0, r1)
                    same(H(dx), dx_ref)
    assert kinds == {"images", "band", "row", "image"}, kinds


def case_avgpool(rng: np.random.Generator) -> None:
    """Average pooling's gather kernels against the slice code on NumPy arrays."""
    for k, s, pad, shape in [((2, 2), (2, 2), (0, 0), (2, 3, 64, 65)),
                             ((3, 3), (2, 2), (1, 1), (2, 2, 45, 46)),
                             ((3, 2), (1, 3), (1, 1), (1, 4, 33, 31)),
                             ((1, 1), (3, 2), (0, 0), (2, 2, 20, 21)),
                             ((7, 7), (1, 1), (3, 3), (1, 2, 20, 21))]:
        ho, wo = P.pool_output_hw(shape[2:], k, s, pad)
        for dt in (np.float32, np.float64):
            x = rng.standard_normal(shape).astype(dt)
            x.reshape(-1)[::13] = -0.0
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


def case_toolchain_probe(rng: np.random.Generator) -> None:
    """The kernel the GPU check launches first (``_cuda.toolchain_problem``)."""
    for n in SIZES:
        a = D(np.full(n, np.nan, np.float32))
        _cuda.launch(_cuda._kernels().k_fill_probe, n, a, np.float32(2.5))
        assert np.all(H(a) == 2.5)


def case_optim(rng: np.random.Generator) -> None:
    """The optimizers' update kernels against the Numba CPU loops (the same operations)."""
    from minidl.kernels.pointwise import optim as O

    for dt in (np.float32, np.float64):
        for n in (1, 1025, 4097):
            p, g, m, v = (rng.standard_normal(n).astype(dt) for _ in range(4))
            v = np.abs(v)
            for kw in ({}, {"momentum": 0.9}, {"momentum": 0.9, "weight_decay": 5e-4},
                       {"momentum": 0.8, "dampening": 0.1, "first_step": True},
                       {"momentum": 0.9, "nesterov": True, "weight_decay": 1e-2}):
                want, buf = p.copy(), m.copy()
                O.sgd_update(want, g, buf, 0.05, **kw)
                got, dbuf = D(p), D(m)
                O.sgd_update(got, D(g), dbuf, 0.05, **kw)
                same(H(got), want)
                if kw.get("momentum"):
                    same(H(dbuf), buf)
            for decoupled, wd in ((False, 0.0), (False, 1e-2), (True, 1e-2)):
                for beta1 in (0.9, 0.3):  # both branches of the lerp
                    want, wm, wv = p.copy(), m.copy(), v.copy()
                    O.adam_update(want, g, wm, wv, 1e-3, beta1, 0.999, 1e-8, wd, 3, decoupled)
                    got, dm, dv = D(p), D(m), D(v)
                    O.adam_update(got, D(g), dm, dv, 1e-3, beta1, 0.999, 1e-8, wd, 3, decoupled)
                    same(H(got), want)
                    same(H(dm), wm)
                    same(H(dv), wv)


def case_relu(rng: np.random.Generator) -> None:
    """ReLU's backward kernel against the NumPy reference (NaN and -0.0 outputs included)."""
    from minidl.kernels.pointwise import relu as R

    for dt in (np.float32, np.float64):
        for n in SIZES:
            dy, y = rng.standard_normal(n).astype(dt), rng.standard_normal(n).astype(dt)
            y[::7] = np.nan
            y[::5] = -0.0
            want = np.empty(n, dt)
            R.relu_backward_ref(dy, y, want)
            got = D(np.full(n, np.nan, dt))
            R.relu_backward(D(dy), D(y), got)
            same(H(got), want)


def case_gelu(rng: np.random.Generator) -> None:
    """GELU's kernels (both forms) against the generic float64 Numba loops' bits."""
    from minidl.kernels.transformer import gelu as G

    for dt in (np.float32, np.float64):
        x = (4 * rng.standard_normal(4097)).astype(dt)
        dy = rng.standard_normal(4097).astype(dt)
        for tanh_form in (False, True):
            want = np.empty_like(x)
            G._fwd(x, want, tanh_form, 0, x.size)
            got = D(np.full_like(x, np.nan))
            G.gelu_forward(D(x), got, "tanh" if tanh_form else "none")
            same(H(got), want)
            G._bwd(dy, x, want, tanh_form, 0, x.size)
            got = D(np.full_like(x, np.nan))
            G.gelu_backward(D(dy), D(x), got, "tanh" if tanh_form else "none")
            same(H(got), want)


CASES = {"bitpack": case_bitpack, "poolidx": case_poolidx, "sparse": case_sparse,
         "precision": case_precision, "maxpool": case_maxpool, "scan": case_scan,
         "weight_record": case_weight_record, "conv_im2col_col2im": case_conv_im2col_col2im,
         "avgpool": case_avgpool, "toolchain_probe": case_toolchain_probe, "optim": case_optim,
         "relu": case_relu, "gelu": case_gelu}
#: What test_cuda_ptx.py compiles (other test modules here may define their own).
CUDA_LAUNCH_CASES = CASES


@pytest.mark.parametrize("name", sorted(CASES))
def test_emulated_kernels_bit_equal_to_numpy(name):
    with np.errstate(invalid="ignore"):  # signalling NaN codes widened to float64
        CASES[name](np.random.default_rng(0))


# ----------------------------------------------------------------------------- emulation rules
def _k_probe(x, hist, firsts, out):
    """Uses the parts of ``numba.cuda`` the codec kernels do not (atomics, local memory)."""
    tmp = cuda.local.array(4, dtype=np.int64)
    for j in range(4):
        tmp[j] += j  # local arrays start at zero in the emulation
    for i in range(cuda.grid(1), x.size, cuda.gridsize(1)):
        old = cuda.atomic.add(hist, x[i] & 3, 1)
        if old == 0:
            firsts[x[i] & 3] = i
    out[0] = cuda.threadIdx.x + cuda.blockIdx.x * cuda.blockDim.x + cuda.gridDim.x
    out[1] = tmp[3] + cuda.popc(np.uint32(x[0]))


cuda = None  # replaced in the emulation, as in a kernel module


def test_emulation_single_thread_module():
    k = _cuda.bind(globals(), ["_k_probe"]).k_probe
    before = globals()["cuda"]
    x = np.array([5, 2, 7, 1, 6, 11], np.int64)
    hist, firsts, out = D(np.zeros(4, np.int32)), D(np.full(4, -1, np.int64)), D(np.zeros(2,
                                                                                        np.int64))
    _cuda.launch(k, x.size, D(x), hist, firsts, out)
    same(H(hist), np.bincount(x & 3, minlength=4).astype(np.int32))
    same(H(firsts), np.array([-1, 0, 1, 2], np.int64))
    same(H(out), np.array([1, 3 + 2], np.int64))  # thread 0 of a 1x1 grid; popc(5) = 2
    assert globals()["cuda"] is before  # the emulation leaves the module's global alone


def test_emulated_arrays_are_device_arrays():
    e, h = D(np.zeros(3, np.float32)), np.zeros(3, np.float32)
    assert _cuda.is_device_array(e) and not _cuda.is_device_array(h)
    assert _cuda.choose("auto", e, e) == "cuda"
    with pytest.raises(TypeError, match="mix"):
        _cuda.choose("auto", e, h)
    with pytest.raises(TypeError):
        bp.pack_sign(e, out=np.zeros(1, np.uint8))
    # a launch that mixes emulated and host arrays is refused, not run
    with pytest.raises(TypeError, match="ndarray"):
        _cuda.launch(bp._kernels().k_pack, 1, e, np.zeros(1, np.uint8), 3)


def test_device_memory_helpers_on_array_objects():
    like = D(np.zeros(2, np.float32))
    t = _cuda.empty(like, 5, np.int64)
    assert isinstance(t, EmuArray) and t.shape == (5,) and t.dtype == np.int64
    _cuda.from_host(t, np.arange(5, dtype=np.int64))
    u = _cuda.empty(like, 5, np.int64)
    _cuda.copy(u, t)
    host = _cuda.to_host(u)
    assert isinstance(host, np.ndarray)
    same(host, np.arange(5, dtype=np.int64))
    with pytest.raises(ValueError, match="C-contiguous"):
        _cuda.flat(D(np.zeros((4, 4), np.float32))[:, ::2])


def test_emulation_does_not_import_numba_cuda():
    script = (f"import sys; sys.path.insert(0, {os.path.dirname(__file__)!r})\n"
              "import numpy as np\n"
              "from test_cuda_launch import D, H, same\n"
              "from minidl.kernels.codecs import bitpack, precision\n"
              "x = np.linspace(-1, 1, 999, dtype=np.float32)\n"
              "same(H(bitpack.pack_sign(D(x))), bitpack.pack_sign(x, impl='numpy'))\n"
              "same(H(precision.encode(D(x), 'fp16')), precision.encode(x, 'fp16', "
              "impl='numpy'))\n"
              "assert 'numba.cuda' not in sys.modules, 'numba.cuda imported'\n"
              "print('EMU OK')\n")
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and "EMU OK" in r.stdout, r.stdout + r.stderr


# ----------------------------------------------------------------------------- CuPy launches
class _RecordingNumbaCuda:
    """Stand-in for ``numba.cuda``: records stream wrapping and array views."""

    def __init__(self) -> None:
        self.views: list[tuple[object, bool]] = []

    def external_stream(self, ptr: int) -> tuple[str, int]:
        return ("external", ptr)

    def as_cuda_array(self, a: object, sync: bool = True) -> tuple[str, int]:
        self.views.append((a, sync))
        return ("view", id(a))


class _RecordingKernel:
    def __init__(self) -> None:
        self.launches: list[tuple[tuple, tuple]] = []

    def __getitem__(self, config: tuple):
        return lambda *args: self.launches.append((config, args))


def _fake_cupy_array(cupy, n: int, dtype) -> object:
    """A real ``cupy.ndarray`` over a made-up device pointer (never dereferenced here)."""
    mem = cupy.cuda.UnownedMemory(0x7F0000000000, n * np.dtype(dtype).itemsize, None,
                                  device_id=0)
    return cupy.ndarray((n,), dtype, memptr=cupy.cuda.MemoryPointer(mem, 0))


@pytest.mark.filterwarnings("ignore:ExternalStream is deprecated:DeprecationWarning")
def test_cupy_launch_on_current_stream_without_synchronisation(monkeypatch):
    cupy = pytest.importorskip("cupy")
    fake = _RecordingNumbaCuda()
    monkeypatch.setattr(_cuda, "cuda", fake)
    monkeypatch.setattr(cupy.cuda, "get_current_stream",
                        lambda *a: cupy.cuda.ExternalStream(0x5EED, device_id=0))
    monkeypatch.setattr(_cuda, "simulator", lambda: False)
    a, b = _fake_cupy_array(cupy, 3000, np.float32), _fake_cupy_array(cupy, 375, np.uint8)
    assert _cuda.is_device_array(a) and _cuda.choose("auto", a, b) == "cuda"
    k = _RecordingKernel()
    _cuda.launch(k, 3000, a, b, 3000, np.float32(0))
    (config, args), = k.launches
    assert config == (12, 256, ("external", 0x5EED))  # CuPy's current stream
    assert args == (("view", id(a)), ("view", id(b)), 3000, np.float32(0))
    assert [(x is a or x is b, sync) for x, sync in fake.views] == [(True, False)] * 2
    # a CuPy stream given explicitly is wrapped the same way; others pass through
    _cuda.run(k, 1, 32, a, stream=cupy.cuda.ExternalStream(0xAB, device_id=0))
    assert k.launches[-1][0] == (1, 32, ("external", 0xAB))
    numba_stream = object()
    _cuda.run(k, 1, 32, a, stream=numba_stream)
    assert k.launches[-1][0][2] is numba_stream
    assert all(sync is False for _, sync in fake.views)


def test_non_cupy_launch_keeps_arguments_and_stream_zero(monkeypatch):
    fake = _RecordingNumbaCuda()
    monkeypatch.setattr(_cuda, "cuda", fake)
    k = _RecordingKernel()
    arr = object()  # e.g. a Numba device array: passed through untouched
    _cuda.run(k, 2, 64, arr, 5)
    assert k.launches == [((2, 64, 0), (arr, 5))] and fake.views == []


def test_a_kernel_numba_cannot_build_raises_one_clear_error(monkeypatch):
    """NVVM missing (or newer than the driver): the first launch says what to install."""
    from numba.cuda.cudadrv.error import NvvmSupportError

    class Broken:
        launched = False
        py_func = _cuda._k_fill_probe

        def __getitem__(self, config):
            def launch(*args):
                raise NvvmSupportError("libNVVM cannot be found")
            return launch

    monkeypatch.setattr(_cuda, "_launch_args", lambda args, stream: (args, 0))
    with pytest.raises(_cuda.ToolchainError, match=r"_k_fill_probe.*minidl\[cuda13\]"):
        _cuda.run(Broken(), 1, 32, np.zeros(4, np.float32))
