"""Canonical Huffman coding: every stream round-trips (hypothesis), the code is optimal-length
and prefix-free, and the Numba coder matches the NumPy reference bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minidl.kernels.compression import huffman

streams = st.integers(1, 300).flatmap(
    lambda a: st.tuples(st.just(a), st.lists(st.integers(0, a - 1), max_size=400)))


def _roundtrip(alphabet: int, symbols: list[int]) -> bytes:
    s = np.array(symbols, dtype=np.int64)
    lengths = huffman.code_lengths(np.bincount(s, minlength=alphabet))
    assert len(lengths) == alphabet
    huffman.check_lengths(lengths)
    buf = huffman.encode(s, lengths)
    assert buf == huffman.encode(s, lengths, impl="numpy")
    assert len(buf) == (huffman.encoded_nbits(s, lengths) + 7) // 8
    for impl in ("numba", "numpy"):
        assert huffman.decode(buf, lengths, len(s), impl=impl).tolist() == symbols
    packed = huffman.pack_lengths(lengths)
    assert len(packed) == huffman.packed_lengths_nbytes(alphabet)
    assert huffman.unpack_lengths(packed, alphabet).tolist() == lengths.tolist()
    return buf


@settings(max_examples=150, deadline=None)
@given(streams)
def test_every_stream_round_trips(case):
    _roundtrip(*case)


def test_empty_and_single_symbol_streams():
    assert _roundtrip(16, []) == b""
    assert _roundtrip(16, [7]) == b"\x00"  # one symbol: a 1-bit code
    assert len(_roundtrip(4, [2] * 17)) == 3
    assert huffman.code_lengths([0, 0, 5]).tolist() == [0, 0, 1]


def test_lengths_are_huffman_optimal():
    counts = np.array([45, 13, 12, 16, 9, 5])  # the textbook example (CLRS 16.3)
    lengths = huffman.code_lengths(counts)
    assert int((counts * lengths).sum()) == 224
    codes = huffman.canonical_codes(lengths)
    words = {format(int(c), f"0{int(n)}b") for c, n in zip(codes, lengths)}
    assert not any(a != b and b.startswith(a) for a in words for b in words)  # prefix-free


def test_skewed_counts_are_length_limited():
    counts = np.array([2 ** i for i in range(40)], dtype=np.int64)  # Fibonacci-like: deep tree
    lengths = huffman.code_lengths(counts, max_length=12)
    assert lengths.max() <= 12
    huffman.check_lengths(lengths)
    s = np.repeat(np.arange(40), 3)
    assert (huffman.decode(huffman.encode(s, lengths), lengths, len(s)) == s).all()


def test_truncated_or_invalid_streams_fail_clearly():
    s = np.arange(8).repeat(5)
    lengths = huffman.code_lengths(np.bincount(s))
    buf = huffman.encode(s, lengths)
    with pytest.raises(huffman.HuffmanError, match="ends or is invalid"):
        huffman.decode(buf[:-3], lengths, len(s))
    with pytest.raises(huffman.HuffmanError, match="Kraft"):
        huffman.DecodeTable([1, 1, 1])
    with pytest.raises(ValueError, match="must lie in"):
        huffman.encode([0, 9], lengths)
    with pytest.raises(ValueError, match="has no code"):
        huffman.encode([0, 1], huffman.code_lengths([4, 0, 1]))
