"""kernels/pooling/poolidx.py: packed max-pool indices and the backward from them."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minidl.kernels.pooling import poolidx as pi


def test_index_bits():
    assert [pi.index_bits(w) for w in (1, 2, 3, 4, 5, 9, 16, 17, 25, 256)] == [
        1, 1, 2, 2, 4, 4, 4, 8, 8, 8]
    for bad in (0, 257):
        with pytest.raises(ValueError):
            pi.index_bits(bad)
    assert pi.packed_index_nbytes(9, 2) == 3 and pi.packed_index_nbytes(9, 4) == 5


def test_layout():
    assert pi.pack_indices(np.array([1, 2, 3, 0, 3], np.uint8), 2).tolist() == [0b00111001, 3]
    assert pi.pack_indices(np.array([5, 15, 9], np.uint8), 4).tolist() == [0xF5, 0x09]
    idx = np.array([1, 0, 1, 1, 0, 0, 0, 1, 1], np.uint8)
    np.testing.assert_array_equal(pi.pack_indices(idx, 1), np.packbits(idx, bitorder="little"))


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@settings(max_examples=25, deadline=None)
@given(n=st.integers(0, 300), seed=st.integers(0, 2**31), signed=st.booleans())
def test_pack_unpack_roundtrip(bits, n, seed, signed):
    idx = np.random.default_rng(seed).integers(0, 2**bits, n).astype(np.uint8)
    src = idx.view(np.int8) if signed else idx
    want = pi.pack_indices(src, bits, impl="numpy")
    got = pi.pack_indices(src, bits)
    np.testing.assert_array_equal(got, want)
    assert got.size == (n * bits + 7) // 8
    for impl in ("numba", "numpy"):
        np.testing.assert_array_equal(pi.unpack_indices(got, bits, n, impl=impl), idx)


def argmax_ref(x, k, s, p):
    """Window index (``di * kw + dj``, padded window) of the first maximum, by loops."""
    n, c, h, w = x.shape
    ho, wo = (h + 2 * p[0] - k[0]) // s[0] + 1, (w + 2 * p[1] - k[1]) // s[1] + 1
    idx = np.zeros((n, c, ho, wo), np.uint8)
    for a in range(n):
        for b in range(c):
            for oh in range(ho):
                for ow in range(wo):
                    best = -np.inf
                    for di in range(k[0]):
                        for dj in range(k[1]):
                            r, q = oh * s[0] - p[0] + di, ow * s[1] - p[1] + dj
                            if 0 <= r < h and 0 <= q < w and x[a, b, r, q] > best:
                                best, idx[a, b, oh, ow] = x[a, b, r, q], di * k[1] + dj
    return idx


def scatter_ref(dy, idx, x_shape, k, s, p):
    dx = np.zeros(x_shape, dy.dtype)
    for (a, b, oh, ow), g in np.ndenumerate(dy):
        di, dj = divmod(int(idx[a, b, oh, ow]), k[1])
        r, q = oh * s[0] - p[0] + di, ow * s[1] - p[1] + dj
        if 0 <= r < x_shape[2] and 0 <= q < x_shape[3]:
            dx[a, b, r, q] += g
    return dx


@st.composite
def pool_cases(draw):
    k = (draw(st.integers(1, 4)), draw(st.integers(1, 4)))
    s = (draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    p = (draw(st.integers(0, k[0] // 2)), draw(st.integers(0, k[1] // 2)))
    h = draw(st.integers(max(1, k[0] - 2 * p[0]), 9))
    w = draw(st.integers(max(1, k[1] - 2 * p[1]), 9))
    return (draw(st.integers(1, 2)), draw(st.integers(1, 3)), h, w), k, s, p


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@settings(max_examples=30, deadline=None)
@given(case=pool_cases(), seed=st.integers(0, 2**31), ints=st.booleans())
def test_maxpool_backward_from_packed(dtype, case, seed, ints):
    shape, k, s, p = case
    rng = np.random.default_rng(seed)
    x = (rng.integers(-2, 3, shape) if ints else rng.standard_normal(shape)).astype(dtype)
    idx = argmax_ref(x, k, s, p)
    dy = rng.standard_normal(idx.shape).astype(dtype)
    pk = pi.pack_indices(idx, pi.index_bits(k[0] * k[1]))
    want = scatter_ref(dy, idx, shape, k, s, p)
    for impl in ("numba", "numpy"):
        got = pi.maxpool_backward_packed(dy, pk, shape, k, s, p, impl=impl)
        np.testing.assert_array_equal(got, want)  # same summation order: bit-identical


@pytest.mark.parametrize("hw", [(8, 8), (9, 7), (64, 66)])
def test_tiled_2x2_and_kernel_pool_convention(hw):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((6, 4) + hw).astype(np.float32)  # (64, 66): parallel driver
    idx = argmax_ref(x, (2, 2), (2, 2), (0, 0))
    dy = rng.standard_normal(idx.shape).astype(np.float32)
    dx = np.full(x.shape, np.nan, np.float32)  # overwritten, not accumulated
    pi.maxpool_backward_packed(dy, pi.pack_indices(idx, 2), x.shape, 2, out=dx)
    np.testing.assert_array_equal(dx, scatter_ref(dy, idx, x.shape, (2, 2), (2, 2), (0, 0)))


def test_matches_kernels_pool_stash():
    """The argmax that kernels/pooling/pool.py's MaxPool2d stashes, packed, gives its backward."""
    kp = pytest.importorskip("minidl.kernels.pooling.pool")
    rng = np.random.default_rng(2)
    for k, s, p, hw in [((2, 2), (2, 2), (0, 0), (9, 8)), ((3, 3), (2, 2), (1, 1), (9, 10)),
                        ((5, 5), (2, 2), (2, 2), (9, 9))]:
        x = rng.standard_normal((2, 3) + hw).astype(np.float32)
        ho, wo = kp.pool_output_hw(hw, k, s, p)
        y, idx = np.empty((2, 3, ho, wo), np.float32), np.empty((2, 3, ho, wo), np.uint8)
        kp.maxpool2d_forward(x, y, idx, k, s, p)
        dy = rng.standard_normal(y.shape).astype(np.float32)
        pk = pi.pack_indices(idx, pi.index_bits(k[0] * k[1]))
        np.testing.assert_array_equal(pi.maxpool_backward_packed(dy, pk, x.shape, k, s, p),
                                      kp.maxpool2d_backward_ref(dy, idx, x.shape, k, s, p))


def test_errors_and_big_sizes():
    with pytest.raises(ValueError):
        pi.pack_indices(np.zeros(3, np.uint8), 3)
    with pytest.raises(ValueError, match="x_shape"):
        pi.maxpool_backward_packed(np.zeros((1, 2, 2, 2), np.float32), np.zeros(2, np.uint8),
                                   (1, 3, 4, 4), 2)
    n = 8 * pi._CHUNK * 2 + 5  # several parallel chunks
    idx = np.random.default_rng(3).integers(0, 4, n).astype(np.uint8)
    pk = pi.pack_indices(idx, 2)
    np.testing.assert_array_equal(pk, pi.pack_indices(idx, 2, impl="numpy"))
    np.testing.assert_array_equal(pi.unpack_indices(pk, 2, n), idx)
