"""kernels/codecs/bitpack.py: Numba CPU against the NumPy reference and ``np.packbits``."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from minidl.kernels.codecs import bitpack as bp

SPECIAL = [0.0, -0.0, np.nan, -np.nan, np.inf, -np.inf, 1.0, -1.0, 1e-45, -1e-45]


def arrays(dtype):
    width = 32 if dtype == np.float32 else 64
    elements = st.one_of(st.sampled_from(SPECIAL), st.floats(width=width))
    return hnp.arrays(dtype, st.integers(0, 300), elements=elements)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and np.array_equal(
        np.ascontiguousarray(a).view(np.uint8), np.ascontiguousarray(b).view(np.uint8))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_pack_unpack_match_reference(dtype, data):
    x = data.draw(arrays(dtype))
    want = np.packbits(x > 0, bitorder="little")
    for impl in ("numba", "numpy"):
        got = bp.pack_sign(x, impl=impl)
        assert got.dtype == np.uint8 and got.size == bp.packed_nbytes(x.size) == (x.size + 7) // 8
        np.testing.assert_array_equal(got, want)
        for out_dtype in (np.float32, np.float64, bool):
            u = bp.unpack_sign(got, x.shape, dtype=out_dtype, impl=impl)
            assert u.dtype == out_dtype
            np.testing.assert_array_equal(u, (x > 0).astype(out_dtype))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_relu_backward_from_mask(dtype, data):
    x = data.draw(arrays(dtype))
    dy = data.draw(hnp.arrays(dtype, x.shape, elements=st.one_of(
        st.sampled_from(SPECIAL), st.floats(width=32 if dtype == np.float32 else 64))))
    pk = bp.pack_sign(x)
    want = np.where(x > 0, dy, dtype(0))
    for impl in ("numba", "numpy"):
        assert same_bits(bp.relu_backward_packed(dy, pk, impl=impl), want)
        inplace = dy.copy()
        res = bp.relu_backward_packed(inplace, pk, out=inplace, impl=impl)
        assert res is inplace and same_bits(inplace, want)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_relu_backward_from_mask_on_the_parallel_path(dtype):
    """Above ``_SERIAL`` elements the chunked parallel drivers run; an odd size leaves a tail."""
    rng = np.random.default_rng(0)
    n = 3 * bp._SERIAL + 5
    x = rng.standard_normal(n).astype(dtype)
    dy = rng.choice(np.array(SPECIAL + [2.5, -3.0], dtype), n)
    pk = bp.pack_sign(x)
    want = np.where(x > 0, dy, dtype(0))
    assert same_bits(bp.relu_backward_packed(dy, pk), want)
    inplace = dy.copy()
    assert same_bits(bp.relu_backward_packed(inplace, pk, out=inplace), want)


def test_layout_and_padding_bits():
    x = np.array([1, -1, 0, 2, 3, -0.0, np.nan, np.inf, 5, 0, 7], np.float32)
    pk = bp.pack_sign(x)
    assert pk.tolist() == [0b10011001, 0b101]  # bit i%8 of byte i//8; unused high bits are 0
    assert bp.pack_sign(np.ones(13, np.float32))[-1] == 0b11111


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 31, 32, 33, 8 * bp._CHUNK * 2 + 13])
@pytest.mark.parametrize("kind", ["zeros", "ones", "random"])
def test_sizes_and_chunk_boundaries(n, kind):
    rng = np.random.default_rng(n)
    x = {"zeros": np.zeros(n, np.float32), "ones": np.ones(n, np.float32),
         "random": rng.standard_normal(n).astype(np.float32)}[kind]
    pk = bp.pack_sign(x)
    np.testing.assert_array_equal(pk, np.packbits(x > 0, bitorder="little"))
    np.testing.assert_array_equal(bp.unpack_sign(pk, n), (x > 0).astype(np.float32))
    dy = rng.standard_normal(n).astype(np.float32)
    np.testing.assert_array_equal(bp.relu_backward_packed(dy, pk), np.where(x > 0, dy, 0))


def test_bool_input_shapes_and_buffers():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 5, 7)).astype(np.float32)
    block = np.full(1024, 0xEE, np.uint8)  # a pool block larger than needed
    pk = bp.pack_sign(x, out=block)
    assert pk.size == 14 and np.shares_memory(pk, block) and (block[14:] == 0xEE).all()
    np.testing.assert_array_equal(pk, bp.pack_sign(x > 0))  # bool input
    np.testing.assert_array_equal(pk, bp.pack_sign(x.transpose(2, 0, 1).copy().transpose(1, 2, 0)))
    np.testing.assert_array_equal(bp.unpack_sign(pk, x.shape, dtype=bool), x > 0)
    out = np.empty((7, 3, 5), np.float64).transpose(1, 2, 0)  # non-contiguous out
    assert bp.unpack_sign(pk, x.shape, out=out) is out
    np.testing.assert_array_equal(out, x > 0)
    flat = np.empty(105, np.float32)  # another shape, same size
    assert bp.unpack_sign(pk, x.shape, out=flat) is flat
    np.testing.assert_array_equal(flat, (x > 0).reshape(-1))
    dy = rng.standard_normal((3, 5, 7)).astype(np.float32)
    dx = np.empty((7, 5, 3), np.float32).transpose(2, 1, 0)
    bp.relu_backward_packed(dy, pk, out=dx)
    np.testing.assert_array_equal(dx, np.where(x > 0, dy, 0))


def test_errors():
    x = np.ones(20, np.float32)
    with pytest.raises(ValueError, match="bytes"):
        bp.pack_sign(x, out=np.empty(2, np.uint8))
    with pytest.raises(ValueError, match="impl"):
        bp.pack_sign(x, impl="fortran")
    with pytest.raises(TypeError):
        bp.pack_sign(x, impl="cuda")
    with pytest.raises(ValueError, match="packed"):
        bp.relu_backward_packed(x, np.zeros(2, np.uint8))


@pytest.mark.parametrize("half", ["float16", "bfloat16"])
def test_half_maps_pack_and_relu_backward_like_float32(half):
    """Mixed precision's half feature maps: the sign mask of a float16 / bfloat16 array is
    that of its float32 values (special values included), and ReLU backward from it keeps
    ``dy`` where the bit is set and gives +0.0 elsewhere, in the half dtype, in place too."""
    import ml_dtypes  # noqa: F401 (registers bfloat16)

    dtype = np.dtype(half)
    rng = np.random.default_rng(0)
    x = np.concatenate([np.array(SPECIAL, np.float32),
                        rng.standard_normal(70_001).astype(np.float32)]).astype(dtype)
    dy = rng.standard_normal(x.size).astype(np.float32).astype(dtype)
    pk = bp.pack_sign(x)
    np.testing.assert_array_equal(pk, np.packbits(x.astype(np.float32) > 0, bitorder="little"))
    want = np.where(x.astype(np.float32) > 0, dy, dtype.type(0))
    assert same_bits(bp.relu_backward_packed(dy, pk), want)
    inplace = dy.copy()
    bp.relu_backward_packed(inplace, pk, out=inplace)
    assert same_bits(inplace, want)
