"""conv_device_half: a convolution on device arrays reading half (float16 / bfloat16) inputs,
weights and output gradients as they are (im2col on their bits, GEMMs through
``blas.gemm``'s GemmEx path) and writing float32 or half outputs: on the strict CUDA test
device, equal to conv_device's float32 path on float32 copies of the same half values (on
NumPy arrays), up to the GEMMs' summation order (and the one rounding of a half output);
every product goes through gemm_ex, inside the half workspace the plan declares."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from minidl.kernels import blas
from minidl.kernels.convolution import conv as C
from minidl.kernels.convolution import conv_device as CD
from minidl.kernels.convolution import conv_device_half as CDH
from minidl.kernels.convolution.conv_geometry import conv_output_hw

strict = pytest.importorskip("minidl.memory.testing.strict_device")
pytestmark = pytest.mark.skipif(not strict.cupy_available(),
                                reason="the strict device reads CuPy's API from cupy")

CASES = {  # x shape, cout, kernel, (stride, padding, dilation, groups), max_workspace
    "3x3-multi-image": ((3, 4, 10, 9), 6, (3, 3), ((1, 1), (1, 1), (1, 1), 1), None),
    "5x3-bands-groups": ((1, 6, 60, 13), 6, (5, 3), ((2, 1), (2, 1), (1, 2), 3), 100_000),
    "one-image-tiles": ((2, 3, 70, 70), 4, (3, 3), ((1, 1), (1, 1), (1, 1), 1), None),
    "rows-all-padding": ((2, 2, 11, 9), 4, (2, 3), ((3, 2), (3, 0), (2, 1), 2), 1),
}


class Arena:
    """Arrays of the strict device at distinct aligned offsets."""

    def __init__(self, dev) -> None:
        self.dev, self.offset = dev, 0

    def put(self, a: np.ndarray):
        nbytes = max(a.nbytes, 1)
        off, self.offset = self.offset, self.offset + -(-nbytes // 512) * 512
        v = self.dev.view(off, a.nbytes, a.shape, a.dtype)
        v.set(np.ascontiguousarray(a))
        return v


@pytest.mark.parametrize("out", ["float32", "half"])
@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("half", [np.float16, ml_dtypes.bfloat16])
@pytest.mark.parametrize("name", sorted(CASES))
def test_half_operands_match_the_float32_path(name, half, accumulate, out, monkeypatch):
    """``y`` and ``dx`` float32, or half (rounded once from the float32 result): within the
    GEMMs' summation order of the float32 path, inside the declared half workspace; the
    forward and dW take one product per tile and group, dx one per dx tile (half the
    columns) and group."""
    x_shape, cout, k, geom, cap = CASES[name]
    stride, padding, dilation, groups = geom
    rng = np.random.default_rng(3)
    ho, wo = conv_output_hw(x_shape[2:], k, stride, padding, dilation)
    x, w, dy = (rng.standard_normal(s).astype(half) for s in
                (x_shape, (cout, x_shape[1] // groups, *k), (x_shape[0], cout, ho, wo)))
    b = rng.standard_normal(cout).astype(np.float32)
    g0 = [rng.standard_normal(s).astype(np.float32) for s in (w.shape, (cout,))]
    f32 = np.float32
    odt = f32 if out == "float32" else half
    nb = CD.conv2d_device_workspace_bytes(x_shape, cout, k, *geom, f32, True, cap)
    # the float32 path on float32 copies (NumPy arrays)
    want_y = np.full(dy.shape, np.nan, f32)
    CD.conv2d_forward_device(x.astype(f32), w.astype(f32), b, want_y, *geom,
                             np.empty(nb, np.uint8), cap)
    want = [np.full(x.shape, np.nan, f32), *(g.copy() for g in g0)]
    CD.conv2d_backward_device(x.astype(f32), w.astype(f32), dy.astype(f32), *want, *geom,
                              np.empty(nb, np.uint8), accumulate, None, cap)
    # the half path on the strict device, in the declared workspaces
    half_out = out == "half"
    fwd_nb, bwd_nb = (CDH.conv2d_device_half_workspace_bytes(x_shape, cout, k, *geom, back,
                                                             cap, half_out)
                      for back in (False, True))
    if cap is None:  # the same tiles as the float32 path's: a smaller workspace
        assert fwd_nb <= nb and bwd_nb <= nb
    elif cap > 1:  # (a cap of 1 byte: the smallest tiles)
        assert fwd_nb <= cap and bwd_nb <= cap
    calls = []
    real = blas.emulated_gemm_ex
    monkeypatch.setattr(blas, "emulated_gemm_ex",
                        lambda *a: calls.append((a[0].dtype, a[2].dtype)) or real(*a))
    mem = Arena(strict.StrictCudaDevice("64MiB"))
    xd, wd, dyd = mem.put(x), mem.put(w), mem.put(dy)
    y = mem.put(np.full(dy.shape, np.nan, odt))
    C.conv2d_forward(xd, wd, mem.put(b), y, *geom, workspace=mem.put(
        np.full(fwd_nb, 0xFF, np.uint8)), max_workspace=cap)
    fwd = len(calls)
    got = [mem.put(np.full(x.shape, np.nan, odt)), *(mem.put(g) for g in g0)]
    C.conv2d_backward(xd, wd, dyd, *got, *geom, workspace=mem.put(
        np.full(bwd_nb, 0xFF, np.uint8)), accumulate=accumulate, max_workspace=cap)
    lay = CDH.half_layout(x_shape, cout, k, *geom, True, half_out, cap)
    dx_tiles = len(list(CD._tiles(x_shape[0], lay.dx_tiles)))
    assert fwd > 0 and len(calls) == 2 * fwd + dx_tiles * groups
    assert set(calls) == {(np.dtype(half), np.dtype(f32))}
    for g, wnt in zip([y, *got[:1]], [want_y, want[0]]):
        g = g.get()
        assert g.dtype == odt
        if half_out:  # one rounding of (nearly) the float32 result: within a half unit
            np.testing.assert_allclose(g.astype(f32), wnt.astype(half).astype(f32),
                                       rtol=2.0 ** -7, atol=1e-6 * math.ceil(np.abs(wnt).max()))
        else:
            np.testing.assert_allclose(g, wnt, rtol=1e-5,
                                       atol=1e-6 * math.ceil(np.abs(wnt).max()))
    for g, wnt in zip(got[1:], want[1:]):
        np.testing.assert_allclose(g.get(), wnt, rtol=1e-5,
                                   atol=1e-6 * math.ceil(np.abs(wnt).max()))
