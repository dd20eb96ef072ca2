"""kernels/codecs/sparse.py: CSR and ZVC encodings, Numba CPU against the NumPy reference."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from minidl.kernels.codecs import sparse as sp

SPECIAL = [-0.0, np.nan, np.inf, -np.inf, 1e-45, -3.5]
CASES = [("zvc", 256), ("csr", 1), ("csr", 7), ("csr", 256), ("csr", 300), ("csr", 65536)]


def relu_like(dtype):
    """Mostly zeros, some specials, some ordinary values; any length."""
    width = 32 if dtype == np.float32 else 64
    elements = st.one_of(st.just(0.0), st.just(0.0), st.just(0.0), st.sampled_from(SPECIAL),
                         st.floats(width=width))
    return hnp.arrays(dtype, st.integers(0, 600), elements=elements)


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8)


def roundtrip(x: np.ndarray, fmt: str, w: int) -> None:
    nnz = sp.count_nonzero(x)
    nbytes = sp.encoded_nbytes(x.size, nnz, fmt, x.itemsize, w)
    bufs = []
    for impl in ("numba", "numpy"):
        buf = np.full(nbytes + 9, 0xAB, np.uint8)
        assert sp.encode(x, buf, fmt, w, impl=impl) == nbytes
        assert (buf[nbytes:] == 0xAB).all()
        bufs.append(buf)
        if fmt != "dense":
            h = sp.read_header(buf)
            assert (h.fmt, h.n, h.nnz, h.itemsize, h.nbytes) == (fmt, x.size, nnz, x.itemsize,
                                                                 nbytes)
        for dimpl in ("numba", "numpy"):
            out = np.full(x.shape, 7, x.dtype)
            assert sp.decode(buf, out, "dense" if fmt == "dense" else None, impl=dimpl) is out
            np.testing.assert_array_equal(bits(out), bits(x))  # bit-exact: -0.0, NaN payloads
    np.testing.assert_array_equal(bufs[0], bufs[1])  # identical bytes


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_encode_decode_match_reference(dtype, data):
    x = data.draw(relu_like(dtype))
    nnz = int(np.count_nonzero(x.view(f"u{x.itemsize}")))
    assert sp.count_nonzero(x) == sp.count_nonzero(x, impl="numpy") == nnz
    for fmt, w in CASES + [("dense", 256)]:
        roundtrip(x, fmt, w)


def test_layouts_exact():
    x = np.zeros(20, np.float32)
    x[[1, 9, 10, 19]] = [1.0, -0.0, 2.0, np.nan]
    buf = np.zeros(sp.encoded_nbytes(20, 4, "zvc"), np.uint8)
    assert sp.encode(x, buf, "zvc") == 32 + 16 + 3 == buf.size
    np.testing.assert_array_equal(buf[32:48].view(np.float32)[:3], [1.0, -0.0, 2.0])
    assert buf[48:].tolist() == [0b10, 0b110, 0b1000]
    assert bytes(buf[:2]) == b"SZ" and buf[2] == 2 and buf[3] == 4
    buf = np.zeros(sp.encoded_nbytes(20, 4, "csr", 4, 8), np.uint8)
    assert sp.encode(x, buf, "csr", row_width=8) == buf.size == 32 + 16 + 16 + 4
    assert buf[32:48].view(np.int32).tolist() == [0, 1, 3, 4]  # rows of 8, 8, 4
    assert buf[64:68].tolist() == [1, 1, 2, 3]  # column in the row
    assert sp.read_header(buf).row_width == 8 and sp.read_header(buf).col_bytes == 1
    assert sp.encoded_nbytes(10**6, 10, "csr", 4, 65536) == 104 + 10 * 6  # 17 row pointers


@pytest.mark.parametrize("pattern", ["zeros", "dense", "trailing", "leading", "islands"])
def test_chunk_boundaries(pattern):
    """Several parallel chunks, empty ones, and chunks ending in zeros (compaction edges)."""
    n, c = 3 * sp._C + 17, sp._C
    rng = np.random.default_rng(0)
    x = rng.standard_normal(n).astype(np.float32)
    if pattern == "zeros":
        x[:] = 0
    elif pattern == "trailing":
        x[rng.random(n) < 0.7] = 0
        x[c - 100: c] = x[2 * c - 3: 2 * c + 5] = x[-50:] = 0
    elif pattern == "leading":
        x[: 2 * c + 9] = 0
    elif pattern == "islands":
        x[:] = 0
        x[[0, c - 1, c, 2 * c + 1, n - 1]] = 1.5
    for fmt, w in [("zvc", 256), ("csr", 256), ("csr", 65536), ("csr", 1000)]:
        roundtrip(x, fmt, w)


@settings(max_examples=200, deadline=None)
@given(n=st.integers(0, 10**7), frac=st.floats(0, 1), itemsize=st.sampled_from([2, 4, 8]))
def test_choose_encoding_is_smallest_and_never_expands(n, frac, itemsize):
    nnz = int(n * frac)
    e = sp.choose_encoding(n, nnz, itemsize)
    assert e.nbytes == sp.encoded_nbytes(n, nnz, e.fmt, itemsize, e.row_width or 256)
    assert e.nbytes <= n * itemsize
    assert e.fmt == "dense" or e.nbytes < n * itemsize
    for fmt, w in [("zvc", 256), ("csr", 256), ("csr", 65536)]:
        assert e.nbytes <= sp.encoded_nbytes(n, nnz, fmt, itemsize, w)


def test_choose_encoding_examples():
    n = 1 << 20
    assert sp.choose_encoding(n, n).fmt == "dense"
    assert sp.choose_encoding(n, int(0.3 * n)).fmt == "zvc"  # a 70%-zero ReLU output
    assert sp.choose_encoding(n, n // 20)[::2] == ("csr", 256)
    assert sp.choose_encoding(n, 100)[::2] == ("csr", 65536)
    assert sp.choose_encoding(0, 0).fmt == "dense"


def test_errors():
    x = np.ones(100, np.float32)
    small = np.full(50, 0xAB, np.uint8)
    with pytest.raises(ValueError, match="bytes"):
        sp.encode(x, small, "zvc")
    assert (small == 0xAB).all()  # nothing written
    with pytest.raises(ValueError, match="fmt"):
        sp.encode(x, np.empty(1000, np.uint8), "lz4")
    with pytest.raises(ValueError, match="row_width"):
        sp.encode(x, np.empty(1000, np.uint8), "csr", row_width=70000)
    buf = np.empty(1000, np.uint8)
    sp.encode(x, buf, "zvc")
    with pytest.raises(ValueError, match="items"):
        sp.decode(buf, np.empty(99, np.float32))
    with pytest.raises(ValueError, match="holds zvc"):
        sp.decode(buf, np.empty(100, np.float32), "csr")
    with pytest.raises(ValueError, match="magic"):
        sp.decode(np.zeros(1000, np.uint8), np.empty(100, np.float32))
    with pytest.raises(ValueError):
        sp.encoded_nbytes(10, 11, "zvc")
