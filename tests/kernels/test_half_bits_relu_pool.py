"""ReLU and max pooling on half device arrays (float16, bfloat16) read as their uint16 bits.

Each half-bits result must equal, bit for bit, the reference: the existing float32 kernel run
on float32 copies of the half operands (the emulated CUDA kernel where there is one, else the
Numba CPU kernel), its result rounded to the half dtype with ``astype``. Argmax indices must be
equal too. Data: negatives, -0.0, +0.0, +/-inf, NaN (quiet NaNs, plus float16 NaN payloads,
which the float32 round trip keeps), many ties. ``CUDA_LAUNCH_CASES`` also serves
test_cuda_ptx.py (every launched signature compiles to PTX).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from emulated_arrays import D, H
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from minidl.kernels.pointwise import relu as R
from minidl.kernels.pooling import pool as P
from minidl.kernels.pooling import pool_half as PH
from minidl.kernels.pooling import poolidx as pi

HALVES = (np.float16, ml_dtypes.bfloat16)
F32 = np.float32
#: (kernel, stride, padding): non-overlapping (backward on bits) and overlapping windows
GEOMS = [((2, 2), (2, 2), (0, 0)), ((3, 3), (3, 3), (1, 1)), ((2, 3), (3, 4), (1, 1)),
         ((1, 1), (1, 1), (1, 1)),  # windows entirely in the padding
         ((3, 3), (2, 2), (1, 1)), ((3, 2), (1, 1), (1, 0))]


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint16)


def _same(got: np.ndarray, want: np.ndarray, what: str = "") -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, want.dtype)
    bad = np.flatnonzero(_bits(got) != _bits(want))
    assert bad.size == 0, (what, bad[:5], _bits(got).ravel()[bad[:5]],
                           _bits(want).ravel()[bad[:5]])


def half_data(rng: np.random.Generator, shape, dt, nan: bool = True) -> np.ndarray:
    """Rounded normals (ties), with -0.0, +0.0, +/-inf, negatives and (``nan``) NaNs."""
    x = np.round(rng.standard_normal(shape) * 2).astype(F32)
    flat = x.reshape(-1)
    n = flat.size
    for value, frac in ((-0.0, 0.08), (0.0, 0.08), (np.inf, 0.03), (-np.inf, 0.03),
                        (-1.5, 0.05)):
        flat[rng.random(n) < frac] = value
    if nan:
        flat[rng.random(n) < 0.04] = np.nan
        flat[rng.random(n) < 0.02] = -np.nan
    h = x.astype(dt)
    if nan and dt == np.float16:  # NaN payloads (kept by float16's round trip)
        b = h.reshape(-1).view(np.uint16)
        b[rng.random(n) < 0.02] = rng.choice([0x7C01, 0xFC01, 0x7FFF, 0xFD55])
    return h


def _round_trip(h: np.ndarray) -> np.ndarray:
    return h.astype(F32)


# ----------------------------------------------------------------------------- ReLU
def relu_refs(x, dy, y):
    """Forward (Numba CPU float32 kernel) and backward (emulated float32 CUDA kernel)."""
    dt = x.dtype
    fwd = np.full(x.shape, np.nan, F32)
    R.relu_forward(_round_trip(x), fwd)
    bwd = D(np.full(x.shape, np.nan, F32))
    R.relu_backward(D(_round_trip(dy)), D(_round_trip(y)), bwd)
    return fwd.astype(dt), H(bwd).astype(dt)


def check_relu(rng: np.random.Generator, n: int, dt) -> None:
    x = half_data(rng, n, dt)
    dy = half_data(rng, n, dt)
    y = half_data(rng, n, dt)
    want_f, want_b = relu_refs(x, dy, y)
    out = D(np.full(n, 7, dt))
    R.relu_forward(D(x), out)
    _same(H(out), want_f, "forward")
    xd = D(x)
    R.relu_forward(xd, xd)  # in place
    _same(H(xd), want_f, "forward in place")
    out = D(np.full(n, 7, dt))
    R.relu_backward(D(dy), D(y), out)
    _same(H(out), want_b, "backward")
    dyd = D(dy)
    R.relu_backward(dyd, D(y), dyd)  # in place
    _same(H(dyd), want_b, "backward in place")


def case_relu_half(rng: np.random.Generator) -> None:
    for dt in HALVES:
        for n in (1, 7, 1024, 4097):
            check_relu(rng, n, dt)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("dt", HALVES, ids=["float16", "bfloat16"])
def test_relu_half_bits_match_float32_rounded(dt, seed):
    check_relu(np.random.default_rng(seed), 3001, dt)


@pytest.mark.parametrize("dt", HALVES, ids=["float16", "bfloat16"])
def test_relu_half_bits_every_pattern(dt):
    """All 65536 bit patterns of x and of y (bfloat16 NaNs: only the quiet ones round-trip
    through float32, so the others are left out)."""
    x = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(dt)
    if dt != np.float16:
        x = x[~np.isnan(x.astype(F32)) | np.isin(x.view(np.uint16), [0x7FC0, 0xFFC0])]
    dy = np.random.default_rng(0).standard_normal(x.size).astype(dt)
    want_f, want_b = relu_refs(x, dy, x)
    out = D(np.full(x.size, 7, dt))
    R.relu_forward(D(x), out)
    _same(H(out), want_f, "forward")
    out = D(np.full(x.size, 7, dt))
    R.relu_backward(D(dy), D(x), out)
    _same(H(out), want_b, "backward")
    assert not np.signbit(want_f.astype(F32)[~np.isnan(want_f.astype(F32))]).any()


# ----------------------------------------------------------------------------- max pooling
def check_maxpool(rng: np.random.Generator, shape, kernel, stride, padding, dt) -> None:
    ho, wo = P.pool_output_hw(shape[2:], kernel, stride, padding)
    x = half_data(rng, shape, dt)
    # reference: the emulated float32 CUDA kernels on float32 copies, rounded to half
    adt = P.argmax_dtype(kernel)
    y32, i_ref = D(np.full((*shape[:2], ho, wo), 7, F32)), D(np.full((*shape[:2], ho, wo), 9, adt))
    P.maxpool2d_forward(D(_round_trip(x)), y32, i_ref, kernel, stride, padding)
    i_ref = H(i_ref)
    y, idx = D(np.full(i_ref.shape, 7, dt)), D(np.full(i_ref.shape, 9, adt))
    P.maxpool2d_forward(D(x), y, idx, kernel, stride, padding)
    _same(H(y), H(y32).astype(dt), "maxpool forward")
    assert np.array_equal(H(idx), i_ref), "argmax"
    assert H(idx).dtype == i_ref.dtype
    if not P.maxpool_half_exact(kernel, stride):
        return
    dy = half_data(rng, i_ref.shape, dt)
    dx32 = D(np.full(shape, 7, F32))
    P.maxpool2d_backward(D(_round_trip(dy)), D(i_ref), dx32, kernel, stride, padding)
    want = H(dx32).astype(dt)
    dx = D(np.full(shape, 7, dt))
    P.maxpool2d_backward(D(dy), D(i_ref), dx, kernel, stride, padding)
    _same(H(dx), want, "maxpool backward")
    if kernel[0] * kernel[1] > 256:  # (no packed indices)
        return
    bits = pi.index_bits(kernel[0] * kernel[1])
    if np.any(i_ref >= 2 ** bits):  # (windows entirely in the padding: no packed index)
        return
    pk = pi.pack_indices(i_ref, bits)
    dx32 = H(pi.maxpool_backward_packed(D(_round_trip(dy)), D(pk), shape, kernel, stride,
                                        padding))
    got = H(pi.maxpool_backward_packed(D(dy), D(pk), shape, kernel, stride, padding))
    _same(got, dx32.astype(dt), "packed backward")
    _same(got, want, "packed backward = backward")


def case_maxpool_half(rng: np.random.Generator) -> None:
    for dt in HALVES:
        for kernel, stride, padding in GEOMS:
            check_maxpool(rng, (2, 3, 9, 10), kernel, stride, padding, dt)
        check_maxpool(rng, (1, 2, 20, 21), (17, 17), (17, 17), (8, 8), dt)  # uint16 argmax


@pytest.mark.parametrize("dt", HALVES, ids=["float16", "bfloat16"])
@pytest.mark.parametrize("geom", GEOMS, ids=str)
@pytest.mark.parametrize("seed", range(3))
def test_maxpool_half_bits_match_float32_rounded(geom, dt, seed):
    check_maxpool(np.random.default_rng(seed), (2, 3, 12, 11), *geom, dt)


@settings(max_examples=40, deadline=None)
@given(kernel=st.tuples(st.integers(1, 4), st.integers(1, 4)),
       extra=st.tuples(st.integers(0, 2), st.integers(0, 2)),
       overlap=st.booleans(), pad=st.tuples(st.integers(0, 2), st.integers(0, 2)),
       hw=st.tuples(st.integers(1, 9), st.integers(1, 9)), seed=st.integers(0, 2**31),
       half=st.sampled_from(HALVES))
def test_maxpool_half_bits_any_geometry(kernel, extra, overlap, pad, hw, seed, half):
    stride = ((max(1, kernel[0] - 1 - extra[0]), max(1, kernel[1] - 1 - extra[1])) if overlap
              else (kernel[0] + extra[0], kernel[1] + extra[1]))
    padding = (min(pad[0], kernel[0] // 2), min(pad[1], kernel[1] // 2))
    ho, wo = P.pool_output_hw(hw, kernel, stride, padding)
    assume(ho >= 1 and wo >= 1)
    check_maxpool(np.random.default_rng(seed), (2, 2, *hw), kernel, stride, padding, half)


def test_maxpool_half_exact():
    assert P.maxpool_half_exact((2, 2), (2, 2)) and P.maxpool_half_exact((3, 3), (3, 4))
    assert not P.maxpool_half_exact((3, 3), (2, 2)) and not P.maxpool_half_exact((2, 3), (2, 2))
    assert P.maxpool_half_exact is PH.maxpool_half_exact


@pytest.mark.parametrize("dt", HALVES, ids=["float16", "bfloat16"])
def test_half_bits_backward_refuses_overlapping_windows(dt):
    shape, kernel, stride, padding = (1, 2, 7, 7), (3, 3), (2, 2), (1, 1)
    dy = D(np.zeros((1, 2, 4, 4), dt))
    idx = D(np.zeros((1, 2, 4, 4), np.uint8))
    with pytest.raises(ValueError, match="non-overlapping"):
        PH.maxpool2d_backward_half(dy, idx, D(np.zeros(shape, dt)), kernel, stride, padding)
    pk = D(pi.pack_indices(np.zeros((1, 2, 4, 4), np.uint8), 4))
    with pytest.raises(ValueError, match="non-overlapping"):
        PH.maxpool_backward_packed_half(dy, pk, D(np.zeros(int(np.prod(shape)), dt)), shape, 4,
                                        kernel, stride, padding)


strict = pytest.importorskip("minidl.memory.testing.strict_device")


@pytest.mark.skipif(not strict.cupy_available(), reason="the strict device reads CuPy's API")
@pytest.mark.parametrize("dt", HALVES, ids=["float16", "bfloat16"])
def test_strict_device_half_arrays(dt):
    """The half-bits paths on the strict test device's arrays (no host conversion)."""
    rng = np.random.default_rng(5)
    dev = strict.StrictCudaDevice("4MiB")
    offset = [0]

    def put(a):
        v = dev.view(offset[0], a.nbytes, a.shape, a.dtype)
        offset[0] += -(-max(a.nbytes, 1) // 512) * 512
        v.set(np.ascontiguousarray(a))
        return v

    x = half_data(rng, (2, 3, 8, 6), dt)
    want_f, want_b = relu_refs(x, x, x)
    a = put(x)
    R.relu_forward(a, a)
    _same(a.get(), want_f, "relu forward")
    g = put(x)
    R.relu_backward(g, put(x), g)
    _same(g.get(), want_b, "relu backward")
    y32, i32 = D(np.zeros((2, 3, 4, 3), F32)), D(np.zeros((2, 3, 4, 3), np.uint8))
    P.maxpool2d_forward(D(_round_trip(x)), y32, i32, (2, 2), (2, 2))
    y, idx = put(np.zeros((2, 3, 4, 3), dt)), put(np.zeros((2, 3, 4, 3), np.uint8))
    P.maxpool2d_forward(put(x), y, idx, (2, 2), (2, 2))
    _same(y.get(), H(y32).astype(dt), "maxpool forward")
    assert np.array_equal(idx.get(), H(i32))
    dx = put(np.full(x.shape, 7, dt))
    P.maxpool2d_backward(y, idx, dx, (2, 2), (2, 2))
    dx32 = D(np.zeros(x.shape, F32))
    P.maxpool2d_backward(y32, i32, dx32, (2, 2), (2, 2))
    _same(dx.get(), H(dx32).astype(dt), "maxpool backward")


CUDA_LAUNCH_CASES = {"relu_half": case_relu_half, "maxpool_half": case_maxpool_half}


@pytest.mark.parametrize("name", sorted(CUDA_LAUNCH_CASES))
def test_launch_cases(name):
    with np.errstate(invalid="ignore"):
        CUDA_LAUNCH_CASES[name](np.random.default_rng(3))
