"""conv_device's im2col / col2im and pool_device's average pooling on device arrays: one CUDA
kernel launch per tile (per call for pooling) instead of ``kh*kw`` strided slice operations,
and results bit-identical to the slice code the NumPy arrays keep.

Launches are counted by wrapping ``_cuda.Kernel.emulate`` (emulated device arrays run every
launch through it). The bit-equality of the kernels themselves, tile by tile, is in
test_cuda_launch.py's cases (and test_cuda_sim.py under the simulator); here whole forward and
backward passes on the strict CUDA test device are compared bit for bit with the same calls on
NumPy arrays (the GEMMs are NumPy's on both, so only im2col / col2im differ).
"""

from __future__ import annotations

import collections
import math

import numpy as np
import pytest

from minidl.kernels import _cuda
from minidl.kernels.convolution import conv_device as CD
from minidl.kernels.convolution.conv_geometry import conv_output_hw
from minidl.kernels.pooling import pool_device as PD


@pytest.fixture
def launches(monkeypatch) -> collections.Counter:
    """Kernel launches on emulated device arrays, by kernel function name."""
    counts: collections.Counter = collections.Counter()
    original = _cuda.Kernel.emulate

    def counting(self, *args):
        counts[self.py_func.__name__] += 1
        return original(self, *args)

    monkeypatch.setattr(_cuda.Kernel, "emulate", counting)
    return counts


class NoArrayOps:
    """An emulated device array that refuses array operations (slice copies, fills, ufuncs):
    only views and kernel launches."""

    def __init__(self, a: np.ndarray) -> None:
        self._a = a

    def __emulated_device_buffer__(self) -> np.ndarray:
        return self._a

    def __array__(self, *args, **kwargs):
        raise AssertionError("an array operation on a device array")

    def __array_ufunc__(self, *args, **kwargs):
        raise AssertionError("a ufunc on a device array")

    def __setitem__(self, key, value):
        raise AssertionError("a slice assignment on a device array")

    def fill(self, value):
        raise AssertionError("a fill on a device array")

    shape = property(lambda self: self._a.shape)
    dtype = property(lambda self: self._a.dtype)
    size = property(lambda self: self._a.size)
    flags = property(lambda self: self._a.flags)

    def reshape(self, *shape) -> NoArrayOps:
        return NoArrayOps(self._a.reshape(*shape))


@pytest.mark.parametrize("cap,kind", [(16 << 20, "images"), (5000, "band"), (0, "row")])
def test_one_launch_per_tile_and_no_slice_operations(launches, cap, kind):
    """3x3 conv with padding over multi-image tiles, bands and single rows: ``_k_im2col`` and
    ``_k_col2im`` once per tile each (was 9 slice copies + a zero-fill, and 9 slice
    additions + a zero-fill per image), and no array operation on the device arrays."""
    x_shape, k, s, pad, dil = (3, 4, 12, 11), (3, 3), (1, 1), (1, 1), (1, 1)
    lay = CD._device_layout(x_shape, 4, k, s, pad, dil, 1, 4, True, cap)
    assert {"images": lay.images > 1, "band": 1 < lay.rows < lay.ho,
            "row": lay.rows == 1}[kind], lay
    taps = CD._taps(x_shape, k, s, pad, dil, lay.ho, lay.wo)
    x = np.random.default_rng(0).standard_normal(x_shape).astype(np.float32)
    dx_ref = np.empty_like(x)
    dxd = NoArrayOps(np.full_like(x, np.nan))
    tiles = list(CD._tiles(x_shape[0], lay))
    for n0, n1, r0, r1 in tiles:
        size = x_shape[1] * 9 * (n1 - n0) * (r1 - r0) * lay.wo
        col_ref, col = np.empty(size, np.float32), NoArrayOps(np.empty(size, np.float32))
        CD._im2col(x, col_ref, taps, n0, n1, r0, r1)
        CD._im2col(NoArrayOps(x), col, taps, n0, n1, r0, r1)
        np.testing.assert_array_equal(col._a, col_ref)
        CD._col2im(col_ref, dx_ref, taps, n0, n1, r0, r1)
        CD._col2im(col, dxd, taps, n0, n1, r0, r1)
    np.testing.assert_array_equal(dxd._a, dx_ref)
    assert launches == {"_k_im2col": len(tiles), "_k_col2im": len(tiles)}


def test_avgpool_one_launch_each_way(launches):
    x = np.random.default_rng(1).standard_normal((2, 3, 9, 8)).astype(np.float64)
    y, dx = NoArrayOps(np.full((2, 3, 5, 4), np.nan)), NoArrayOps(np.full(x.shape, np.nan))
    PD.avgpool2d_forward_device(NoArrayOps(x), y, (3, 3), (2, 2), (1, 1))
    PD.avgpool2d_backward_device(y, dx, (3, 3), (2, 2), (1, 1))
    assert launches == {"_k_avgpool_fwd": 1, "_k_avgpool_bwd": 1}


def test_host_arrays_keep_the_slice_code(launches):
    """NumPy arrays never launch a kernel (they are the reference)."""
    x, w = np.ones((2, 3, 6, 6)), np.ones((4, 3, 3, 3))
    y, dx, dw = np.empty((2, 4, 6, 6)), np.empty_like(x), np.empty_like(w)
    CD.conv2d_forward_device(x, w, None, y, padding=(1, 1))
    CD.conv2d_backward_device(x, w, y, dx, dw, None, padding=(1, 1))
    PD.avgpool2d_forward_device(x, np.empty((2, 3, 3, 3)), (2, 2), (2, 2))
    assert not launches


# ---------------------------------------------------------------- the strict device
strict = pytest.importorskip("minidl.memory.testing.strict_device")
needs_cupy = pytest.mark.skipif(not strict.cupy_available(),
                                reason="the strict device reads CuPy's API from cupy")


class Arena:
    """Arrays of the strict device at distinct aligned offsets."""

    def __init__(self, dev) -> None:
        self.dev, self.offset = dev, 0

    def empty(self, shape, dtype):
        nbytes = math.prod(shape) * np.dtype(dtype).itemsize
        off, self.offset = self.offset, self.offset + -(-max(nbytes, 1) // 512) * 512
        return self.dev.view(off, nbytes, tuple(shape), dtype)

    def put(self, a: np.ndarray):
        v = self.empty(a.shape, a.dtype)
        v.set(np.ascontiguousarray(a))
        return v


@pytest.fixture(scope="module")
def dev():
    return strict.StrictCudaDevice("64MiB")


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint8)


def _conv_both_ways(dev, x_shape, cout, k, geom, dtype, max_workspace, x_strided=False):
    """Forward and backward on NumPy arrays and on the strict device (the same workspace
    layout): every output bit-identical."""
    stride, padding, dilation, groups = geom
    rng = np.random.default_rng(7)
    x = rng.standard_normal(x_shape).astype(dtype)
    w = rng.standard_normal((cout, x_shape[1] // groups, *k)).astype(dtype)
    b = rng.standard_normal(cout).astype(dtype)
    ho, wo = conv_output_hw(x_shape[2:], k, stride, padding, dilation)
    dy = rng.standard_normal((x_shape[0], cout, ho, wo)).astype(dtype)
    mem = Arena(dev)
    if x_strided:  # a non-contiguous x on the device takes the slice code
        wide = np.concatenate([x, x], axis=3)
        xd, x_host = mem.put(wide)[:, :, :, :x_shape[3]], wide[:, :, :, :x_shape[3]]
        assert not xd.flags.c_contiguous
    else:
        xd, x_host = mem.put(x), x
    got, want = [], []
    for run_on_device in (False, True):
        put = mem.put if run_on_device else np.array
        xx = xd if run_on_device else x_host
        nb = CD.conv2d_device_workspace_bytes(x_shape, cout, k, *geom, dtype, True,
                                              max_workspace)
        ws = put(np.full(nb, 0xFF, np.uint8))
        y = put(np.full(dy.shape, np.nan, dtype))
        CD.conv2d_forward_device(xx, put(w), put(b), y, *geom, workspace=ws,
                                 max_workspace=max_workspace)
        dx, dw, db = (put(np.full(a.shape, np.nan, dtype)) for a in (x, w, b))
        CD.conv2d_backward_device(xx, put(w), put(dy), dx, dw, db, *geom, workspace=ws,
                                  max_workspace=max_workspace)
        out = [a.get() if run_on_device else a for a in (y, dx, dw, db)]
        (got if run_on_device else want).append(out)
    for g, wnt in zip(got[0], want[0]):
        assert np.array_equal(_bits(g), _bits(wnt))


CONV_CASES = {  # x shape, cout, kernel, (stride, padding, dilation, groups), max_workspace
    "3x3-multi-image": ((3, 4, 10, 9), 6, (3, 3), ((1, 1), (1, 1), (1, 1), 1), None),
    "5x3-bands-groups": ((1, 6, 60, 13), 6, (5, 3), ((2, 1), (2, 1), (1, 2), 3), 100_000),
    "rows-all-padding": ((2, 2, 11, 9), 4, (2, 3), ((3, 2), (3, 0), (2, 1), 2), 1),
    "strided-1x1": ((3, 3, 9, 10), 2, (1, 1), ((3, 2), (0, 0), (1, 1), 1), 1),
}


@needs_cupy
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", sorted(CONV_CASES))
def test_conv_on_the_strict_device_is_bit_identical_to_the_slice_code(dev, launches, name,
                                                                       dtype):
    x_shape, cout, k, geom, cap = CONV_CASES[name]
    lay = CD.device_layout(x_shape, cout, k, *geom, np.dtype(dtype).itemsize, True, cap)
    assert {"3x3-multi-image": lay.images > 1, "5x3-bands-groups": 1 < lay.rows < lay.ho
            }.get(name, lay.rows == 1), lay
    _conv_both_ways(dev, x_shape, cout, k, geom, dtype, cap)
    assert launches["_k_im2col"] > 0 and launches["_k_col2im"] > 0


@needs_cupy
def test_non_contiguous_x_takes_the_slice_code_on_the_device(dev, launches):
    _conv_both_ways(dev, (2, 2, 7, 6), 3, (3, 3), ((1, 1), (1, 1), (1, 1), 1), np.float32,
                    None, x_strided=True)
    assert launches["_k_im2col"] == 0 and launches["_k_col2im"] > 0  # dx is contiguous


@needs_cupy
def test_strict_device_launches_once_per_tile(dev, launches):
    """A 3x3 padded conv on the strict device: ``_k_im2col`` once per tile forward, and
    ``_k_im2col`` + ``_k_col2im`` once per tile backward; with one output row per tile it makes
    exactly as many CuPy calls as a 1x1 unpadded conv (none per tap)."""
    calls = {}
    for k, pad in (((3, 3), (1, 1)), ((1, 1), (0, 0))):
        mem = Arena(dev)
        rng = np.random.default_rng(2)
        x = mem.put(rng.standard_normal((2, 3, 6, 7)).astype(np.float32))
        w = mem.put(rng.standard_normal((4, 3, *k)).astype(np.float32))
        y = mem.put(np.zeros((2, 4, 6, 7), np.float32))
        geom = ((1, 1), pad, (1, 1), 1)
        lay = CD.device_layout(x.shape, 4, k, *geom, 4, True, max_workspace=1)
        assert lay.rows == 1
        tiles = len(list(CD._tiles(2, lay)))
        ws = mem.put(np.zeros(lay.nbytes, np.uint8))
        launches.clear()
        before = dev.checked_calls
        CD.conv2d_forward_device(x, w, None, y, *geom, workspace=ws, max_workspace=1)
        forward = dev.checked_calls - before
        assert launches == {"_k_im2col": tiles}
        dx, dw = mem.put(np.zeros((2, 3, 6, 7), np.float32)), mem.put(np.zeros(w.shape,
                                                                                np.float32))
        launches.clear()
        before = dev.checked_calls
        CD.conv2d_backward_device(x, w, y, dx, dw, None, *geom, workspace=ws, max_workspace=1)
        assert launches == {"_k_im2col": tiles, "_k_col2im": tiles}
        calls[k] = (forward, dev.checked_calls - before)
    assert calls[(3, 3)] == calls[(1, 1)], calls


@needs_cupy
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_avgpool_on_the_strict_device_is_bit_identical(dev, launches, dtype):
    rng = np.random.default_rng(3)
    mem = Arena(dev)
    for k, s, pad, shape in [((3, 3), (2, 2), (1, 1), (2, 3, 9, 8)),
                             ((2, 3), (3, 1), (1, 1), (1, 2, 10, 7))]:
        x = rng.standard_normal(shape).astype(dtype)
        ho, wo = (shape[2] + 2 * pad[0] - k[0]) // s[0] + 1, (shape[3] + 2 * pad[1] - k[1]
                                                             ) // s[1] + 1
        dy = rng.standard_normal((*shape[:2], ho, wo)).astype(dtype)
        y_ref, dx_ref = np.empty(dy.shape, dtype), np.empty(shape, dtype)
        PD.avgpool2d_forward_device(x, y_ref, k, s, pad)
        PD.avgpool2d_backward_device(dy, dx_ref, k, s, pad)
        y, dx = mem.put(np.full(dy.shape, np.nan, dtype)), mem.put(np.full(shape, np.nan, dtype))
        PD.avgpool2d_forward_device(mem.put(x), y, k, s, pad)
        PD.avgpool2d_backward_device(mem.put(dy), dx, k, s, pad)
        assert np.array_equal(_bits(y.get()), _bits(y_ref))
        assert np.array_equal(_bits(dx.get()), _bits(dx_ref))
    assert launches == {"_k_avgpool_fwd": 2, "_k_avgpool_bwd": 2}
