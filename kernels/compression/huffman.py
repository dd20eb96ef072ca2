"""Canonical Huffman coding of symbol streams (Deep Compression's last stage).

A code is given by its *code lengths*, one per symbol of the alphabet ``0 .. A-1`` (0: the
symbol does not occur). Codes are canonical (as DEFLATE's): symbols sorted by (length,
symbol) get consecutive codes, each shifted left when the length grows, so the lengths alone
describe the code and are all a file stores (:func:`pack_lengths`: 5 bits per symbol).

Bit order: codes are written most significant bit first, bytes filled from their most
significant bit; the last byte is padded with zeros. An empty stream has no bytes; a stream of
one distinct symbol gets a 1-bit code (one bit per symbol).

Each op has a NumPy reference (``impl="numpy"``) and a Numba CPU version (``"numba"``, the
default). Decoding is serial by nature (a bit stream); on a device it runs inside the weight
record decoder (:mod:`.weight_record`: one CUDA thread per record, the same canonical tables
built in shared memory, :func:`decode_symbol`'s loop as a device function).
"""

from __future__ import annotations

import heapq
from typing import Any

import numpy as np
from numba import njit

#: Longest code :func:`code_lengths` produces (lengths are stored in 5 bits).
MAX_CODE_LENGTH = 31
_LENGTH_BITS = 5


class HuffmanError(ValueError):
    """A code table or bit stream that cannot be decoded (corrupt or truncated data)."""


# ----------------------------------------------------------------------------- code lengths
def _huffman_lengths(counts: np.ndarray) -> np.ndarray:
    """Unlimited Huffman code lengths of the symbols with ``counts > 0`` (ties broken by the
    lower symbol, so the result is deterministic)."""
    lengths = np.zeros(len(counts), dtype=np.int64)
    used = np.flatnonzero(counts)
    if len(used) == 1:
        lengths[used[0]] = 1
        return lengths
    # heap of (weight, order, members): merging adds one bit to every member
    heap = [(int(counts[s]), i, [int(s)]) for i, s in enumerate(used)]
    heapq.heapify(heap)
    order = len(heap)
    while len(heap) > 1:
        w1, _, m1 = heapq.heappop(heap)
        w2, _, m2 = heapq.heappop(heap)
        for s in m1:
            lengths[s] += 1
        for s in m2:
            lengths[s] += 1
        heapq.heappush(heap, (w1 + w2, order, m1 + m2))
        order += 1
    return lengths


def code_lengths(counts: Any, max_length: int = MAX_CODE_LENGTH) -> np.ndarray:
    """Huffman code lengths (``uint8``) for symbol ``counts`` (one per symbol of the alphabet).

    Symbols that never occur get 0; a single occurring symbol gets 1. Codes longer than
    ``max_length`` (only for very skewed counts) are avoided by halving the counts (keeping
    them >= 1) until the longest code fits: slightly longer streams, never an invalid code."""
    counts = np.asarray(counts, dtype=np.int64)
    if counts.ndim != 1 or (counts < 0).any():
        raise ValueError("counts must be a 1-D array of non-negative integers")
    if len(np.flatnonzero(counts)) > (1 << max_length):
        raise ValueError(f"{len(np.flatnonzero(counts))} symbols cannot have codes of at most "
                         f"{max_length} bits")
    work = counts.copy()
    while True:
        lengths = _huffman_lengths(work)
        if lengths.max(initial=0) <= max_length:
            return lengths.astype(np.uint8)
        work = np.where(work > 0, (work + 1) // 2, 0)


def canonical_codes(lengths: Any) -> np.ndarray:
    """The canonical code (``uint64``) of every symbol with a non-zero length (0 for others)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    codes = np.zeros(len(lengths), dtype=np.uint64)
    order = np.lexsort((np.arange(len(lengths)), lengths))
    code, prev = 0, 0
    for s in order:
        n = int(lengths[s])
        if n == 0:
            continue
        code <<= n - prev
        codes[s] = code
        code += 1
        prev = n
    return codes


def check_lengths(lengths: Any) -> None:
    """Raise :class:`HuffmanError` unless ``lengths`` describe a prefix code (Kraft's sum is at
    most 1; a complete code has exactly 1, a single symbol 1/2)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if (lengths < 0).any() or (lengths > MAX_CODE_LENGTH).any():
        raise HuffmanError(f"code lengths must lie in [0, {MAX_CODE_LENGTH}]")
    kraft = sum(1 << (MAX_CODE_LENGTH - int(n)) for n in lengths if n)
    if kraft > 1 << MAX_CODE_LENGTH:
        raise HuffmanError("code lengths do not describe a prefix code (Kraft sum > 1)")


# ----------------------------------------------------------------------------- tables
def packed_lengths_nbytes(alphabet: int) -> int:
    """Bytes :func:`pack_lengths` writes for an alphabet of ``alphabet`` symbols."""
    return (int(alphabet) * _LENGTH_BITS + 7) // 8


def pack_lengths(lengths: Any) -> bytes:
    """The code lengths, 5 bits each (most significant bit first)."""
    lengths = np.asarray(lengths, dtype=np.uint8)
    if (lengths > MAX_CODE_LENGTH).any():
        raise ValueError(f"code lengths above {MAX_CODE_LENGTH} cannot be packed")
    bits = ((lengths[:, None] >> np.arange(_LENGTH_BITS - 1, -1, -1, dtype=np.uint8)) & 1)
    return np.packbits(bits.reshape(-1)).tobytes()


def unpack_lengths(buf: Any, alphabet: int) -> np.ndarray:
    """The code lengths of an alphabet of ``alphabet`` symbols from :func:`pack_lengths`."""
    raw = np.frombuffer(bytes(buf), dtype=np.uint8)
    if len(raw) < packed_lengths_nbytes(alphabet):
        raise HuffmanError(f"code table truncated: {len(raw)} bytes, "
                           f"{packed_lengths_nbytes(alphabet)} expected")
    bits = np.unpackbits(raw)[:alphabet * _LENGTH_BITS].reshape(alphabet, _LENGTH_BITS)
    weights = (1 << np.arange(_LENGTH_BITS - 1, -1, -1)).astype(np.uint8)
    return (bits * weights).sum(axis=1).astype(np.uint8)


class DecodeTable:
    """What canonical decoding needs, per code length L (1 .. 31): ``first[L]`` (the first
    code of that length), ``count[L]`` and ``offset[L]`` (where its symbols start in
    ``symbols``, the symbols sorted by (length, symbol))."""

    def __init__(self, lengths: Any) -> None:
        lengths = np.asarray(lengths, dtype=np.int64)
        check_lengths(lengths)
        n = MAX_CODE_LENGTH + 1
        self.count = np.bincount(lengths[lengths > 0], minlength=n)[:n].astype(np.int64)
        order = np.lexsort((np.arange(len(lengths)), lengths))
        self.symbols = order[lengths[order] > 0].astype(np.int64)
        self.first = np.zeros(n, dtype=np.int64)
        self.offset = np.zeros(n, dtype=np.int64)
        code = off = 0
        for L in range(1, n):
            code = (code + self.count[L - 1]) << 1 if L > 1 else 0
            self.first[L] = code
            self.offset[L] = off
            off += self.count[L]


# ----------------------------------------------------------------------------- encode
def encoded_nbits(symbols: Any, lengths: Any) -> int:
    """Bits of the encoded stream (without padding)."""
    symbols = np.asarray(symbols, dtype=np.int64)
    return int(np.asarray(lengths, dtype=np.int64)[symbols].sum()) if len(symbols) else 0


def _check_symbols(symbols: np.ndarray, lengths: np.ndarray) -> None:
    if len(symbols) == 0:
        return
    if symbols.min() < 0 or symbols.max() >= len(lengths):
        raise ValueError(f"symbols must lie in [0, {len(lengths)}), got "
                         f"[{symbols.min()}, {symbols.max()}]")
    if (lengths[symbols] == 0).any():
        bad = int(symbols[lengths[symbols] == 0][0])
        raise ValueError(f"symbol {bad} has no code (its length is 0)")


@njit(cache=True)
def _encode_numba(symbols, codes, lengths, out):  # pragma: no cover - compiled
    acc = np.uint64(0)
    nacc = 0
    pos = 0
    for i in range(symbols.shape[0]):
        s = symbols[i]
        n = lengths[s]
        acc = (acc << np.uint64(n)) | codes[s]
        nacc += n
        while nacc >= 8:
            nacc -= 8
            out[pos] = np.uint8((acc >> np.uint64(nacc)) & np.uint64(0xFF))
            pos += 1
        acc &= (np.uint64(1) << np.uint64(nacc)) - np.uint64(1)
    if nacc > 0:
        out[pos] = np.uint8((acc << np.uint64(8 - nacc)) & np.uint64(0xFF))


def encode(symbols: Any, lengths: Any, impl: str = "numba") -> bytes:
    """The Huffman bit stream of ``symbols`` under the canonical code of ``lengths``."""
    symbols = np.ascontiguousarray(symbols, dtype=np.int64).reshape(-1)
    lengths = np.asarray(lengths, dtype=np.int64)
    _check_symbols(symbols, lengths)
    codes = canonical_codes(lengths)
    nbytes = (encoded_nbits(symbols, lengths) + 7) // 8
    if impl == "numpy":
        bits = [format(int(codes[s]), f"0{int(lengths[s])}b") for s in symbols]
        text = "".join(bits)
        text += "0" * (-len(text) % 8)
        return bytes(int(text[i:i + 8], 2) for i in range(0, len(text), 8))
    if impl != "numba":
        raise ValueError(f"unknown impl {impl!r}; valid: numpy, numba")
    out = np.zeros(nbytes, dtype=np.uint8)
    _encode_numba(symbols, codes, lengths, out)
    return out.tobytes()


# ----------------------------------------------------------------------------- decode
@njit(cache=True)
def decode_symbol(buf, bitpos, first, count, offset, symbols):  # pragma: no cover - compiled
    """One symbol from ``buf`` at bit ``bitpos``: (symbol, next bit position), symbol -1 when
    the stream ends or holds no valid code there."""
    code = 0
    nbits = buf.shape[0] * 8
    for L in range(1, first.shape[0]):
        if bitpos >= nbits:
            return -1, bitpos
        bit = (buf[bitpos >> 3] >> (7 - (bitpos & 7))) & 1
        bitpos += 1
        code = (code << 1) | bit
        d = code - first[L]
        if d < count[L]:
            return symbols[offset[L] + d], bitpos
    return -1, bitpos


@njit(cache=True)
def _decode_numba(buf, n, first, count, offset, symbols, out):  # pragma: no cover - compiled
    bitpos = 0
    for i in range(n):
        s, bitpos = decode_symbol(buf, bitpos, first, count, offset, symbols)
        if s < 0:
            return i
        out[i] = s
    return n


def decode(buf: Any, lengths: Any, n: int, impl: str = "numba") -> np.ndarray:
    """``n`` symbols (``int64``) decoded from the bit stream ``buf`` (bytes or a uint8 array).
    Raises :class:`HuffmanError` if the stream ends early or holds no valid code."""
    raw = np.frombuffer(bytes(buf), dtype=np.uint8) if not isinstance(buf, np.ndarray) \
        else np.ascontiguousarray(buf, dtype=np.uint8)
    table = DecodeTable(lengths)
    out = np.zeros(int(n), dtype=np.int64)
    if n == 0:
        return out
    if impl == "numpy":
        done = _decode_reference(raw, int(n), table, out)
    elif impl == "numba":
        done = _decode_numba(raw, int(n), table.first, table.count, table.offset,
                             table.symbols, out)
    else:
        raise ValueError(f"unknown impl {impl!r}; valid: numpy, numba")
    if done < n:
        raise HuffmanError(f"bit stream ends or is invalid after {done} of {n} symbols")
    return out


def _decode_reference(raw: np.ndarray, n: int, table: DecodeTable, out: np.ndarray) -> int:
    bits = np.unpackbits(raw)
    pos = 0
    for i in range(n):
        code = 0
        for L in range(1, MAX_CODE_LENGTH + 1):
            if pos >= len(bits):
                return i
            code = (code << 1) | int(bits[pos])
            pos += 1
            d = code - int(table.first[L])
            if d < table.count[L]:
                out[i] = table.symbols[table.offset[L] + d]
                break
        else:
            return i
    return n
