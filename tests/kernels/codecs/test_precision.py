"""kernels/codecs/precision.py: fp16 / bf16 / fp8 (E4M3FN) codes, Numba CPU against NumPy."""

from __future__ import annotations

import numpy as np
import pytest
from bits import assert_same_bits
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from minidl.kernels.codecs import precision as pr

SPECIAL = [0.0, -0.0, np.nan, -np.nan, np.inf, -np.inf, 448.0, 449.0, 464.0, -1e30, 65504.0,
           65519.0, 65520.0, 2.0**-9, 2.0**-10, 1.5 * 2.0**-10, 2.0**-24, 2.0**-25, 3 * 2.0**-26,
           2.0**-149, 1.0625, 1.1875, 3.4e38]


def floats32():
    return hnp.arrays(np.float32, st.integers(0, 400), elements=st.one_of(
        st.sampled_from(SPECIAL), st.floats(width=32), st.floats(-500, 500, width=32)))


def nan_aware_equal(a: np.ndarray, b: np.ndarray) -> None:
    assert_same_bits(a, b)


@pytest.mark.parametrize("fmt", pr.FORMATS)
@settings(max_examples=40, deadline=None)
@given(x=floats32())
def test_encode_decode_match_reference(fmt, x):
    want = pr.encode(x, fmt, impl="numpy")
    got = pr.encode(x, fmt)
    assert got.dtype == pr.code_dtype(fmt) and got.shape == x.shape
    np.testing.assert_array_equal(got, want)
    nan_aware_equal(pr.decode(got, fmt), pr.decode(got, fmt, impl="numpy"))


@pytest.mark.parametrize("fmt", pr.FORMATS)
def test_every_code_round_trips(fmt):
    codes = np.arange(65536 if pr.code_dtype(fmt).itemsize == 2 else 256,
                      dtype=pr.code_dtype(fmt))
    vals = pr.decode(codes, fmt)
    nan_aware_equal(vals, pr.decode(codes, fmt, impl="numpy"))
    back = pr.encode(vals, fmt)
    finite = ~np.isnan(vals)
    np.testing.assert_array_equal(back[finite], codes[finite])  # decode is exact
    assert np.isnan(pr.decode(back[~finite], fmt)).all()


def test_fp16_is_numpy_float16_bit_for_bit():
    rng = np.random.default_rng(0)
    u = rng.integers(0, 2**32, 200_000, dtype=np.uint64).astype(np.uint32)  # NaN payloads too
    x = np.concatenate([u.view(np.float32), np.array(SPECIAL, np.float32)])
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(pr.encode(x, "fp16"), x.astype(np.float16).view(np.uint16))


def test_fp8_rules():
    x = np.array([448, 449, 464, 1e30, -1e30, np.inf, -np.inf, np.nan, -np.nan, -0.0, 0.0,
                  1.0, 1.0625, 1.1875, 2.0**-6, 2.0**-9, 2.0**-10, 1.5 * 2.0**-10, 1.5 * 2.0**-9,
                  2.5 * 2.0**-9, 2.0**-149], np.float32)
    want = [0x7E, 0x7E, 0x7E, 0x7E, 0xFE, 0x7F, 0xFF, 0x7F, 0xFF, 0x80, 0x00,
            0x38, 0x38, 0x3A, 0x08, 0x01, 0x00, 0x01, 0x02, 0x02, 0x00]  # ties: even code
    for impl in ("numba", "numpy"):
        assert pr.encode(x, "fp8", impl=impl).tolist() == want
    d = pr.decode(np.array([0x7E, 0xFE, 0x08, 0x01, 0x07, 0x38, 0x80, 0x7F], np.uint8), "fp8")
    assert d[:7].tolist() == [448.0, -448.0, 2.0**-6, 2.0**-9, 7 * 2.0**-9, 1.0, -0.0]
    assert np.signbit(d[6]) and np.isnan(d[7])


def test_bf16_rules():
    x = np.array([1.0, 1.00390625, 1.01171875, 3.4e38, -np.inf, np.nan, -0.0], np.float32)
    c = pr.encode(x, "bf16")
    assert c[:5].tolist() == [0x3F80, 0x3F80, 0x3F82, 0x7F80, 0xFF80]  # tie to even; overflow
    assert (c[5] & 0x7FC0) == 0x7FC0 and c[6] == 0x8000


def test_against_torch():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(1)
    x = np.concatenate([rng.standard_normal(100_000).astype(np.float32)
                        * np.float32(10.0) ** rng.integers(-10, 3, 100_000).astype(np.float32),
                        np.array([0.0, -0.0, 448, 449, 1e30, -1e30], np.float32)])
    t = torch.from_numpy(x)
    np.testing.assert_array_equal(pr.encode(x, "bf16"),
                                  t.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16))
    if hasattr(torch, "float8_e4m3fn"):  # both saturate finite values; inf differs by choice
        np.testing.assert_array_equal(pr.encode(x, "fp8"),
                                      t.to(torch.float8_e4m3fn).view(torch.uint8).numpy())
        want = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()
        np.testing.assert_array_equal(pr.decode(np.arange(256, dtype=np.uint8), "fp8"), want)


def test_buffers_shapes_and_sizes():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((5, 3, 7)).astype(np.float32)
    block = np.zeros(4096, np.uint8)  # a pool block
    c = pr.encode(x, "fp16", out=block)
    assert c.shape == x.shape and c.dtype == np.uint16 and np.shares_memory(c, block)
    assert pr.encoded_nbytes(x.size, "fp16") == 210 and pr.encoded_nbytes(x.size, "fp8") == 105
    y = pr.decode(block, "fp16", shape=x.shape)
    np.testing.assert_array_equal(y, x.astype(np.float16).astype(np.float32))
    y64 = pr.decode(c, "fp16", dtype=np.float64)
    assert y64.dtype == np.float64 and np.array_equal(y64, y)
    out = np.empty((7, 3, 5), np.float32).transpose(2, 1, 0)  # non-contiguous out
    pr.decode(c, "fp16", out=out)
    np.testing.assert_array_equal(out, y)
    big = rng.standard_normal(3 * pr._C + 5).astype(np.float32) * 100  # parallel chunks
    for fmt in pr.FORMATS:
        np.testing.assert_array_equal(pr.encode(big, fmt), pr.encode(big, fmt, impl="numpy"))
        codes = pr.encode(big, fmt)
        nan_aware_equal(pr.decode(codes, fmt), pr.decode(codes, fmt, impl="numpy"))
    assert pr.encode(np.zeros(0, np.float32), "fp8").size == 0
    with pytest.raises(TypeError, match="float32"):
        pr.encode(np.ones(3), "fp16")
    with pytest.raises(ValueError, match="fmt"):
        pr.encode(np.ones(3, np.float32), "fp4")
    with pytest.raises(ValueError, match="shape"):
        pr.decode(block, "fp16")
