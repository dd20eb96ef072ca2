"""Relative-index sparse storage (fillers for long gaps) and weight records: round trips,
the fused Numba decoder against the step-by-step NumPy reference, corrupt records."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minidl.kernels.compression import relative_csr, weight_record


def test_fillers_pad_gaps_longer_than_the_index_width():
    codes = np.zeros(40, dtype=np.int64)
    codes[[0, 3, 12, 39]] = [5, 1, 2, 7]
    gaps, values = relative_csr.encode(codes, index_bits=3)  # gaps of at most 7
    # 0 | 2 zeros | 8 zeros: one filler (7 zeros + itself), gap 0 | 26 zeros: three fillers, 2
    assert gaps.tolist() == [0, 2, 7, 0, 7, 7, 7, 2]
    assert values.tolist() == [5, 1, 0, 2, 0, 0, 0, 7]
    assert relative_csr.num_fillers(values) == 4
    assert relative_csr.decode(gaps, values, 40).tolist() == codes.tolist()


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=300), st.integers(1, 6), st.integers(0, 400))
def test_round_trip_with_long_gaps(dense, bits, lead):
    codes = np.array([0] * lead + dense, dtype=np.int64)  # long leading runs of zeros
    gaps, values = relative_csr.encode(codes, bits)
    assert gaps.max(initial=0) <= relative_csr.max_gap(bits)
    assert relative_csr.decode(gaps, values, len(codes)).tolist() == codes.tolist()


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 5), st.integers(1, 5), st.floats(0.0, 1.0), st.integers(0, 2 ** 31))
def test_weight_record_decoders_agree(vbits, ibits, density, seed):
    rng = np.random.default_rng(seed)
    k = rng.integers(1, 2 ** vbits)
    codes = np.where(rng.random((7, 3, 5)) < density, rng.integers(1, k + 1, (7, 3, 5)), 0)
    codebook = rng.normal(size=k).astype(np.float32)
    rec = weight_record.shared_record(codes, codebook, vbits, ibits)
    expected = np.concatenate([[0.0], codebook]).astype(np.float32)[codes]
    out = np.full(codes.shape, np.nan, dtype=np.float32)
    weight_record.decode_into(rec, out)
    assert (out == expected).all()
    assert (weight_record.decode_reference(rec) == expected).all()
    info = weight_record.info(rec)
    assert (info.shape, info.k, info.nbytes) == ((7, 3, 5), k, len(rec))


def test_raw_records_and_corrupt_records():
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    out = np.zeros((2, 3), dtype=np.float32)
    weight_record.decode_into(weight_record.raw_record(x), out)
    assert (out == x).all()
    codes = np.array([0, 1, 2, 0, 0, 0, 0, 0, 3, 1] * 20)
    rec = weight_record.shared_record(codes, [0.5, -1.0, 2.0], 2, 2)
    with pytest.raises(weight_record.RecordError, match="truncated"):
        weight_record.decode_into(rec[:12], np.zeros(200, dtype=np.float32))
    with pytest.raises(weight_record.RecordError, match="invalid after"):
        weight_record.decode_into(rec[:-4], np.zeros(200, dtype=np.float32))
    with pytest.raises(weight_record.RecordError, match="destination"):
        weight_record.decode_into(rec, np.zeros(10, dtype=np.float32))
    with pytest.raises(weight_record.RecordError, match="unknown weight record kind"):
        weight_record.info(b"\x07\x00")
