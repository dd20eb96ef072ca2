"""The device paths of conv2d and average pooling against the NumPy references: on NumPy arrays
(array operations: strided slice copies and additions), and on the strict CUDA test device
(array operations checked against the installed CuPy, and the im2col / col2im / average pooling
CUDA kernels run as one emulated thread; no array created outside outputs and workspace).
Tiling constants are shrunk so that small shapes cross tile and band boundaries."""

from __future__ import annotations

import contextlib
import math

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from minidl.kernels.convolution import conv as K
from minidl.kernels.convolution import conv_device as D
from minidl.kernels.pooling import pool as P
from minidl.kernels.pooling import pool_device as PD

SETTINGS = settings(max_examples=60, deadline=None)
STRICT_SETTINGS = settings(max_examples=15, deadline=None)
PAD = 512  # canary bytes on each side of the workspace
CANARY = 0xA5


@contextlib.contextmanager
def tiling(max_col_bytes: int, min_cols: int):
    """Shrink the device tiling bounds (read at call time) for small test shapes."""
    saved = D.DEVICE_MAX_COL_BYTES, D.DEVICE_MIN_COLS
    D.DEVICE_MAX_COL_BYTES, D.DEVICE_MIN_COLS = max_col_bytes, min_cols
    try:
        yield
    finally:
        D.DEVICE_MAX_COL_BYTES, D.DEVICE_MIN_COLS = saved


@st.composite
def conv_cases(draw):
    groups = draw(st.integers(1, 3))
    cin, cout = groups * draw(st.integers(1, 3)), groups * draw(st.integers(1, 3))
    kernel = (draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    stride = (draw(st.integers(1, 3)), draw(st.integers(1, 2)))
    padding = (draw(st.integers(0, 2)), draw(st.integers(0, 2)))
    dilation = (draw(st.integers(1, 2)), draw(st.integers(1, 2)))
    hw = (draw(st.integers(1, 9)), draw(st.integers(1, 9)))
    ho, wo = K.conv_output_hw(hw, kernel, stride, padding, dilation)
    assume(ho >= 1 and wo >= 1)
    return dict(x_shape=(draw(st.integers(1, 5)), cin, *hw), cout=cout, kernel=kernel,
                geom=(stride, padding, dilation, groups), bias=draw(st.booleans()),
                need_dx=draw(st.booleans()), accumulate=draw(st.booleans()),
                accumulate_bias=draw(st.sampled_from([None, False, True])),
                # 1 byte: one output row per tile; up to whole batches per tile
                tiling=(draw(st.sampled_from([1, 200, 1000, 5000, 1 << 20])),
                        draw(st.sampled_from([1, 7, 64, 4096]))),
                seed=draw(st.integers(0, 2**31)))


# ---------------------------------------------------------------- memory for one run
class HostMem:
    """NumPy arrays; the workspace sits between two canary regions of one buffer."""

    def put(self, a: np.ndarray):
        return np.array(a, copy=True)

    def get(self, a) -> np.ndarray:
        return np.array(a, copy=True)

    def workspace(self, nbytes: int):
        buf = self.put(np.full(nbytes + 2 * PAD, CANARY, np.uint8))
        ws = buf[PAD:PAD + nbytes]
        ws.fill(0xFF)  # NaN in any float dtype: the path must not read what it did not write
        return ws, (buf[:PAD], buf[PAD + nbytes:])


class StrictMem(HostMem):
    """Views of the strict device's arena at distinct aligned offsets."""

    def __init__(self, dev) -> None:
        self.dev, self.offset = dev, 0

    def empty(self, shape, dtype):
        dtype = np.dtype(dtype)
        nbytes = math.prod(shape) * dtype.itemsize
        off, self.offset = self.offset, self.offset + -(-max(nbytes, 1) // PAD) * PAD
        return self.dev.view(off, nbytes, tuple(shape), dtype)

    def put(self, a: np.ndarray):
        v = self.empty(a.shape, a.dtype)
        v.set(np.ascontiguousarray(a))
        return v

    def get(self, a) -> np.ndarray:
        return a.get()


def _canaries_intact(mem, canaries) -> None:
    for c in canaries:
        assert (mem.get(c) == CANARY).all(), "the device path wrote outside its workspace"


def _close(got, want, dtype) -> None:
    tol = 1e-12 if dtype == np.float64 else 1e-5
    scale = float(np.abs(want).max()) if want.size else 0.0
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * scale)


def run_conv(case, dtype, mem, direct: bool = True) -> None:
    """Forward and backward through the device path on ``mem``'s arrays, against conv_ref
    (in float64) with the workspace of exactly the declared size."""
    rng = np.random.default_rng(case["seed"])
    n, cin, h, w = case["x_shape"]
    cout, geom = case["cout"], case["geom"]
    groups = geom[3]
    x = rng.standard_normal(case["x_shape"])
    wt = rng.standard_normal((cout, cin // groups, *case["kernel"]))
    b = rng.standard_normal(cout) if case["bias"] else None
    x, wt = x.astype(dtype), wt.astype(dtype)
    b = None if b is None else b.astype(dtype)

    def f64(a):
        return None if a is None else a.astype(np.float64)

    y_ref = K.conv2d_forward_ref(f64(x), f64(wt), f64(b), *geom)
    dy = rng.standard_normal(y_ref.shape).astype(dtype)
    dx_ref, dw_ref, db_ref = K.conv2d_backward_ref(f64(x), f64(wt), f64(dy), *geom)
    fwd = K.conv2d_forward_device if direct else K.conv2d_forward
    bwd = K.conv2d_backward_device if direct else K.conv2d_backward
    with tiling(*case["tiling"]):
        nb = D.conv2d_device_workspace_bytes(x.shape, cout, case["kernel"], *geom, dtype,
                                             False)
        ws, canaries = mem.workspace(nb)
        xd, wd, bd = mem.put(x), mem.put(wt), None if b is None else mem.put(b)
        y = mem.put(np.full(y_ref.shape, np.nan, dtype))
        fwd(xd, wd, bd, y, *geom, workspace=ws)
        _canaries_intact(mem, canaries)
        _close(mem.get(y), y_ref, dtype)

        acc, acc_b = case["accumulate"], case["accumulate_bias"]
        acc_b = acc if acc_b is None else acc_b
        dw0 = rng.standard_normal(wt.shape).astype(dtype) if acc else \
            np.full(wt.shape, np.nan, dtype)
        db0 = rng.standard_normal(cout).astype(dtype) if acc_b else np.full(cout, np.nan, dtype)
        dx = mem.put(np.full(x.shape, np.nan, dtype)) if case["need_dx"] else None
        dwd, dbd = mem.put(dw0), mem.put(db0) if case["bias"] else None
        nb = D.conv2d_device_workspace_bytes(x.shape, cout, case["kernel"], *geom, dtype, True)
        ws, canaries = mem.workspace(nb)
        bwd(xd, wd, mem.put(dy), dx, dwd, dbd, *geom, workspace=ws, accumulate=acc,
            accumulate_bias=case["accumulate_bias"])
        _canaries_intact(mem, canaries)
    _close(mem.get(dwd), dw_ref + (dw0 if acc else 0), dtype)
    if case["bias"]:
        _close(mem.get(dbd), db_ref + (db0 if acc_b else 0), dtype)
    if case["need_dx"]:
        _close(mem.get(dx), dx_ref, dtype)


@SETTINGS
@given(case=conv_cases())
def test_conv_device_float64_matches_reference(case):
    run_conv(case, np.float64, HostMem())


@SETTINGS
@given(case=conv_cases())
def test_conv_device_float32_matches_reference(case):
    run_conv(case, np.float32, HostMem())


def _fd_case(**kw):
    case = dict(x_shape=(3, 4, 7, 6), cout=6, kernel=(3, 2),
                geom=((2, 1), (1, 2), (2, 1), 2), bias=True, seed=5, tiling=(700, 1))
    case.update(kw)
    return case


@pytest.mark.parametrize("case", [_fd_case(), _fd_case(
    x_shape=(4, 3, 5, 5), cout=2, kernel=(3, 3), geom=((1, 1), (1, 1), (1, 1), 1),
    tiling=(1 << 20, 64))], ids=["banded-groups", "multi-image-tiles"])
def test_conv_device_gradients_by_finite_differences(case):
    """Backward of the device path against central differences of ``<r, y(x, w, b)>``."""
    rng = np.random.default_rng(case["seed"])
    geom, cout = case["geom"], case["cout"]
    x = rng.standard_normal(case["x_shape"])
    wt = rng.standard_normal((cout, x.shape[1] // geom[3], *case["kernel"]))
    b = rng.standard_normal(cout)
    with tiling(*case["tiling"]):
        y = np.empty(K.conv2d_forward_ref(x, wt, b, *geom).shape)
        r = rng.standard_normal(y.shape)

        def loss() -> float:
            K.conv2d_forward_device(x, wt, b, y, *geom)
            return float(np.vdot(r, y))

        dx, dw, db = np.empty_like(x), np.empty_like(wt), np.empty_like(b)
        K.conv2d_backward_device(x, wt, r, dx, dw, db, *geom)
        h = 1e-6
        for a, g in ((x, dx), (wt, dw), (b, db)):
            for flat in rng.choice(a.size, size=min(a.size, 12), replace=False):
                idx = np.unravel_index(flat, a.shape)
                v = a[idx]
                a[idx] = v + h
                up = loss()
                a[idx] = v - h
                down = loss()
                a[idx] = v
                assert abs((up - down) / (2 * h) - g[idx]) <= 1e-6 * max(1.0, abs(g[idx]))


@given(x_shape=st.tuples(st.integers(1, 64), st.integers(1, 64), st.integers(1, 300),
                         st.integers(1, 300)),
       cout=st.integers(1, 64), k=st.integers(1, 5), s=st.integers(1, 3),
       itemsize=st.sampled_from([4, 8]))
@settings(max_examples=200, deadline=None)
def test_tiling_bounds_and_covers_every_output_once(x_shape, cout, k, s, itemsize):
    geom = ((k, k), (s, s), (k // 2, k // 2), (1, 1))
    ho, wo = K.conv_output_hw(x_shape[2:], *geom[:2], geom[2], geom[3])
    assume(ho >= 1 and wo >= 1)
    lay = D.device_layout(x_shape, cout, *geom, 1, itemsize, True)
    row = x_shape[1] * k * k * wo * itemsize  # column bytes of one output row
    assert lay.col[1] * itemsize <= max(D.DEVICE_MAX_COL_BYTES, row)
    assert lay.blocked == (lay.images > 1 or lay.rows < lay.ho)
    assert lay.images == 1 or lay.rows == lay.ho
    assert lay.nbytes == D.conv2d_device_workspace_bytes(x_shape, cout, *geom, 1,
                                                         np.dtype(f"f{itemsize}"), True)
    assert lay.nbytes >= D.conv2d_device_workspace_bytes(x_shape, cout, *geom, 1,
                                                         np.dtype(f"f{itemsize}"), False)
    seen = np.zeros((x_shape[0], ho), np.int64)
    for n0, n1, r0, r1 in D._tiles(x_shape[0], lay):
        assert (n1 - n0) * (r1 - r0) * wo * x_shape[1] * k * k <= lay.col[1]
        seen[n0:n1, r0:r1] += 1
    assert (seen == 1).all()


def test_tap_range_matches_brute_force():
    for off in range(-6, 7):
        for stride in (1, 2, 3):
            for size in range(1, 8):
                for out in range(1, 8):
                    ok = [o for o in range(out) if 0 <= o * stride + off < size]
                    lo, hi = D.tap_range(off, stride, size, out)
                    assert list(range(lo, hi)) == ok


def test_workspace_too_small_and_missing():
    x, w = np.ones((2, 3, 5, 5)), np.ones((4, 3, 3, 3))
    y = np.empty((2, 4, 3, 3))
    nb = D.conv2d_device_workspace_bytes(x.shape, 4, (3, 3), (1, 1), (0, 0), (1, 1), 1,
                                         x.dtype, False)
    with pytest.raises(ValueError, match="workspace"):
        D.conv2d_forward_device(x, w, None, y, workspace=np.empty(nb - 1, np.uint8))
    D.conv2d_forward_device(x, w, None, y)  # NumPy arrays: allocates one
    np.testing.assert_allclose(y, 27.0)
    with pytest.raises(ValueError, match="C-contiguous"):
        D.conv2d_forward_device(x, w, None, np.empty((2, 3, 3, 4)).transpose(0, 3, 1, 2))


def test_gemm_refuses_operands_cupy_would_copy():
    a = np.ones((4, 6))
    with pytest.raises(AssertionError):
        D.gemm(a[:, ::2], np.ones((3, 2)), np.empty((4, 2)))
    with pytest.raises(AssertionError):
        D.gemm(a, np.ones((6, 2)), np.empty((2, 4)).T)
    out = np.empty((6, 2))
    D.gemm(a.T, np.ones((4, 2)), out)  # a transpose is fine (F-contiguous)
    np.testing.assert_array_equal(out, 4.0)
    one = np.empty((1, 1))
    D.gemm(a[:1], np.ones((6, 1)), one)  # 1x1: as a batch of one
    np.testing.assert_array_equal(one, 6.0)


# ---------------------------------------------------------------- average pooling
@st.composite
def pool_cases(draw):
    kernel = (draw(st.integers(1, 4)), draw(st.integers(1, 4)))
    stride = (draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    padding = (draw(st.integers(0, kernel[0] // 2)), draw(st.integers(0, kernel[1] // 2)))
    hw = (draw(st.integers(1, 9)), draw(st.integers(1, 9)))
    ho, wo = P.pool_output_hw(hw, kernel, stride, padding)
    assume(ho >= 1 and wo >= 1)
    return dict(x_shape=(draw(st.integers(1, 3)), draw(st.integers(1, 3)), *hw),
                pool=(kernel, stride, padding), out=(ho, wo), seed=draw(st.integers(0, 2**31)))


def run_avgpool(case, dtype, mem, direct: bool = True) -> None:
    rng = np.random.default_rng(case["seed"])
    x = rng.standard_normal(case["x_shape"]).astype(dtype)
    n, c = x.shape[:2]
    y_ref = P.avgpool2d_forward_ref(x.astype(np.float64), *case["pool"])
    dy = rng.standard_normal(y_ref.shape).astype(dtype)
    dx_ref = P.avgpool2d_backward_ref(dy.astype(np.float64), x.shape, *case["pool"])
    y = mem.put(np.full(y_ref.shape, np.nan, dtype))
    dx = mem.put(np.full(x.shape, np.nan, dtype))
    fwd = PD.avgpool2d_forward_device if direct else P.avgpool2d_forward
    bwd = PD.avgpool2d_backward_device if direct else P.avgpool2d_backward
    fwd(mem.put(x), y, *case["pool"])
    bwd(mem.put(dy), dx, *case["pool"])
    _close(mem.get(y), y_ref, dtype)
    _close(mem.get(dx), dx_ref, dtype)


@SETTINGS
@given(case=pool_cases(), dtype=st.sampled_from([np.float32, np.float64]))
def test_avgpool_device_matches_reference(case, dtype):
    run_avgpool(case, dtype, HostMem())


@pytest.mark.parametrize("shape", [(3, 4, 5, 7), (1, 1, 4, 4), (2, 3, 1, 1)])
def test_global_avgpool_device_matches_the_mean(shape):
    x = np.random.default_rng(0).standard_normal(shape)
    y = np.full(shape[:2], np.nan)
    nb = PD.global_avgpool2d_workspace_bytes(shape, x.dtype)
    buf = np.full(nb + 2 * PAD, CANARY, np.uint8)
    PD.global_avgpool2d_forward_device(x, y, buf[PAD:PAD + nb])
    _canaries_intact(HostMem(), (buf[:PAD], buf[PAD + nb:]))
    np.testing.assert_allclose(y, x.mean(axis=(2, 3)), rtol=1e-14, atol=1e-14)


# ---------------------------------------------------------------- the strict device
strict = pytest.importorskip("minidl.memory.testing.strict_device")
needs_cupy = pytest.mark.skipif(not strict.cupy_available(),
                                reason="the strict device reads CuPy's API from cupy")


@pytest.fixture(scope="module")
def dev():
    return strict.StrictCudaDevice("64MiB")


@needs_cupy
@STRICT_SETTINGS
@given(case=conv_cases(), dtype=st.sampled_from([np.float32, np.float64]),
       direct=st.booleans())
def test_conv_on_the_strict_device(dev, case, dtype, direct):
    """Every call accepted by CuPy's API, no array created (CuPy's pool stays empty), nothing
    written outside the workspace; ``direct=False`` goes through kernels.conv's dispatch."""
    calls = dev.checked_calls
    run_conv(case, dtype, StrictMem(dev), direct)
    assert dev.checked_calls > calls
    assert dev.default_pool_peak == 0


@needs_cupy
@STRICT_SETTINGS
@given(case=pool_cases(), dtype=st.sampled_from([np.float32, np.float64]),
       direct=st.booleans())
def test_avgpool_on_the_strict_device(dev, case, dtype, direct):
    run_avgpool(case, dtype, StrictMem(dev), direct)
    assert dev.default_pool_peak == 0


@needs_cupy
def test_host_and_device_arrays_do_not_mix(dev):
    mem = StrictMem(dev)
    x = mem.put(np.ones((1, 1, 3, 3), np.float32))
    with pytest.raises(TypeError, match="mix"):
        K.conv2d_forward(x, np.ones((1, 1, 1, 1), np.float32), None,
                         mem.put(np.empty((1, 1, 3, 3), np.float32)))
    with pytest.raises(TypeError, match="mix"):
        P.avgpool2d_forward(x, np.empty((1, 1, 1, 1), np.float32), (3, 3), (3, 3))
    with pytest.raises(ValueError, match="declared workspace"):
        K.conv2d_forward(x, mem.put(np.ones((1, 1, 1, 1), np.float32)), None,
                         mem.put(np.empty((1, 1, 3, 3), np.float32)))


@pytest.mark.parametrize("acc,acc_b", [(True, False), (False, True)])
def test_cpu_kernel_accumulates_the_bias_on_its_own(acc, acc_b):
    """``accumulate_bias`` differing from ``accumulate`` on the CPU path (a shared bias)."""
    rng = np.random.default_rng(3)
    x, wt = rng.standard_normal((2, 3, 6, 5)), rng.standard_normal((4, 3, 3, 3))
    dy = rng.standard_normal((2, 4, 4, 3))
    dx_ref, dw_ref, db_ref = K.conv2d_backward_ref(x, wt, dy)
    dw0, db0 = rng.standard_normal(wt.shape), rng.standard_normal(4)
    dx, dw, db = np.empty_like(x), dw0.copy(), db0.copy()
    K.conv2d_backward(x, wt, dy, dx, dw, db, accumulate=acc, accumulate_bias=acc_b)
    np.testing.assert_allclose(dw, dw_ref + (dw0 if acc else 0), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(db, db_ref + (db0 if acc_b else 0), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(dx, dx_ref, rtol=1e-12, atol=1e-12)
