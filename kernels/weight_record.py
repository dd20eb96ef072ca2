"""One parameter of a compressed model as a self-contained byte record, and its decoder.

Two kinds, both little-endian, both starting with ``kind: u8, ndim: u8, dims: u32 * ndim``:

- ``RAW`` (0): a dtype code (:data:`RAW_DTYPES`) and the values (biases, BatchNorm
  parameters and statistics, or any tensor left uncompressed).
- ``SHARED`` (1): a pruned, weight-shared tensor (Deep Compression). Then
  ``value_bits: u8, index_bits: u8, k: u16, entries: u32``, the codebook (``k`` float32: the
  values of codes 1..k; code 0 is the value zero), the canonical Huffman code lengths of the
  value codes (alphabet ``2**value_bits``) and of the gaps (alphabet ``2**index_bits``), 5 bits
  each (:func:`~.huffman.pack_lengths`), ``value_stream_bytes: u32``, the value stream, then
  the gap stream to the end of the record. Entries are those of :mod:`.relative_csr`
  (fillers included).

:func:`decode_into` writes the dense tensor into a caller's array (a block of the device
pool): the two Huffman streams are decoded and scattered in one Numba pass, with no
temporary array of the tensor's size.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from numba import njit

from . import huffman, relative_csr

RAW = 0
SHARED = 1
#: The dtypes a ``RAW`` record holds, by the code byte after its shape.
RAW_DTYPES = ("<f4", "<i8", "<f8", "<f2", "<i4")
_SHARED_HEAD = struct.Struct("<BBHI")


class RecordError(ValueError):
    """Bytes that are not a valid weight record."""


@dataclass(frozen=True)
class RecordInfo:
    """What a record's header says (sizes for reports; nothing is decoded)."""

    kind: int
    shape: tuple[int, ...]
    value_bits: int = 32
    index_bits: int = 0
    k: int = 0
    entries: int = 0
    value_stream_bytes: int = 0
    index_stream_bytes: int = 0
    nbytes: int = 0

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


def _head(kind: int, shape: tuple[int, ...]) -> bytes:
    return struct.pack(f"<BB{len(shape)}I", kind, len(shape), *shape)


def raw_record(values: Any) -> bytes:
    """A ``RAW`` record of ``values`` in their own dtype (one of :data:`RAW_DTYPES`)."""
    a = np.asarray(values)
    dt = a.dtype.newbyteorder("<") if a.dtype.byteorder != "|" else a.dtype
    codes = [np.dtype(d) for d in RAW_DTYPES]
    if dt not in codes:
        raise ValueError(f"raw records hold {', '.join(RAW_DTYPES)}, not {a.dtype}")
    a = np.asarray(a, dtype=dt, order="C")
    return _head(RAW, a.shape) + bytes([codes.index(dt)]) + a.tobytes()


def shared_record(codes: Any, codebook: Any, value_bits: int, index_bits: int) -> bytes:
    """A ``SHARED`` record: ``codes`` (integers of the tensor's shape, 0 for zero, else
    1..k) and ``codebook`` (the ``k`` shared values of codes 1..k)."""
    codes = np.asarray(codes, dtype=np.int64)
    codebook = np.asarray(codebook, dtype="<f4").reshape(-1)
    k = len(codebook)
    if not 1 <= value_bits <= 12 or not 1 <= index_bits <= 12:
        raise ValueError(f"value_bits and index_bits must lie in [1, 12], got {value_bits} "
                         f"and {index_bits}")
    if k > (1 << value_bits) - 1:
        raise ValueError(f"{k} shared values need more than {value_bits} bits (code 0 is zero)")
    if codes.size and (codes.min() < 0 or codes.max() > k):
        raise ValueError(f"codes must lie in [0, {k}]")
    gaps, values = relative_csr.encode(codes, index_bits)
    v_len = huffman.code_lengths(np.bincount(values, minlength=1 << value_bits))
    i_len = huffman.code_lengths(np.bincount(gaps, minlength=1 << index_bits))
    v_stream = huffman.encode(values, v_len)
    i_stream = huffman.encode(gaps, i_len)
    return (_head(SHARED, codes.shape) + _SHARED_HEAD.pack(value_bits, index_bits, k, len(gaps))
            + codebook.tobytes() + huffman.pack_lengths(v_len) + huffman.pack_lengths(i_len)
            + struct.pack("<I", len(v_stream)) + v_stream + i_stream)


class _Reader:
    def __init__(self, buf: bytes) -> None:
        self.buf, self.pos = buf, 0

    def take(self, n: int, what: str) -> bytes:
        if self.pos + n > len(self.buf):
            raise RecordError(f"weight record truncated in its {what} ({len(self.buf)} bytes)")
        out = self.buf[self.pos:self.pos + n]
        self.pos += n
        return out


def _parse(buf: Any) -> tuple[RecordInfo, dict[str, Any]]:
    data = bytes(np.asarray(buf, dtype=np.uint8)) if isinstance(buf, np.ndarray) else bytes(buf)
    r = _Reader(data)
    kind, ndim = struct.unpack("<BB", r.take(2, "header"))
    shape = struct.unpack(f"<{ndim}I", r.take(4 * ndim, "shape"))
    size = int(np.prod(shape, dtype=np.int64))
    if kind == RAW:
        (code,) = r.take(1, "dtype")
        if code >= len(RAW_DTYPES):
            raise RecordError(f"raw weight record has an unknown dtype code {code}")
        dt = np.dtype(RAW_DTYPES[code])
        values = np.frombuffer(r.take(dt.itemsize * size, "values"), dtype=dt)
        return RecordInfo(RAW, shape, nbytes=len(data)), {"values": values}
    if kind != SHARED:
        raise RecordError(f"unknown weight record kind {kind} (valid: {RAW} raw, "
                          f"{SHARED} shared)")
    vb, ib, k, entries = _SHARED_HEAD.unpack(r.take(_SHARED_HEAD.size, "header"))
    if not (1 <= vb <= 12 and 1 <= ib <= 12) or k > (1 << vb) - 1:
        raise RecordError(f"weight record header is invalid (value_bits {vb}, index_bits "
                          f"{ib}, k {k})")
    codebook = np.frombuffer(r.take(4 * k, "codebook"), dtype="<f4")
    v_len = huffman.unpack_lengths(
        r.take(huffman.packed_lengths_nbytes(1 << vb), "code table"), 1 << vb)
    i_len = huffman.unpack_lengths(
        r.take(huffman.packed_lengths_nbytes(1 << ib), "code table"), 1 << ib)
    (v_bytes,) = struct.unpack("<I", r.take(4, "stream size"))
    v_stream = r.take(v_bytes, "value stream")
    i_stream = data[r.pos:]
    info = RecordInfo(SHARED, shape, vb, ib, k, entries, v_bytes, len(i_stream), len(data))
    return info, {"codebook": codebook, "v_len": v_len, "i_len": i_len, "v_stream": v_stream,
                  "i_stream": i_stream}


def info(buf: Any) -> RecordInfo:
    """The header of a record (raises :class:`RecordError` if it is malformed)."""
    return _parse(buf)[0]


@njit(cache=True)
def _decode_shared(vbuf, vt, ibuf, it, entries, table, out):  # pragma: no cover - compiled
    """Scatter ``entries`` (gap, value) pairs into the zeroed flat ``out``; returns the number
    of entries decoded (fewer: a stream ended, or an entry fell outside ``out``)."""
    out[:] = 0
    pos = -1
    vbit = 0
    ibit = 0
    for e in range(entries):
        g, ibit = huffman.decode_symbol(ibuf, ibit, it[0], it[1], it[2], it[3])
        v, vbit = huffman.decode_symbol(vbuf, vbit, vt[0], vt[1], vt[2], vt[3])
        if g < 0 or v < 0 or v >= table.shape[0]:
            return e
        pos += g + 1
        if pos >= out.shape[0]:
            return e
        out[pos] = table[v]
    return entries


def _table_arrays(lengths: np.ndarray) -> tuple[np.ndarray, ...]:
    try:
        t = huffman.DecodeTable(lengths)
    except huffman.HuffmanError as e:
        raise RecordError(f"weight record has an invalid code table: {e}") from None
    return t.first, t.count, t.offset, t.symbols


def decode_into(buf: Any, out: np.ndarray) -> None:
    """Decode the record ``buf`` into ``out`` (a NumPy float array of the record's shape, or
    of its size)."""
    rec, parts = _parse(buf)
    if out.size != rec.size:
        raise RecordError(f"weight record holds {rec.shape} ({rec.size} values), the "
                          f"destination has {out.size}")
    flat = out.reshape(-1)
    if rec.kind == RAW:
        flat[...] = parts["values"]
        return
    table = np.concatenate([[0.0], parts["codebook"]]).astype(out.dtype)
    u8 = np.frombuffer
    done = _decode_shared(u8(parts["v_stream"], np.uint8), _table_arrays(parts["v_len"]),
                          u8(parts["i_stream"], np.uint8), _table_arrays(parts["i_len"]),
                          rec.entries, table, flat)
    if done < rec.entries:
        raise RecordError(f"weight record's streams are invalid after {done} of "
                          f"{rec.entries} entries")


def decode_reference(buf: Any) -> np.ndarray:
    """The dense float32 tensor of a record, step by step in NumPy (Huffman, then the
    relative indices, then the codebook): the reference :func:`decode_into` is tested on."""
    rec, parts = _parse(buf)
    if rec.kind == RAW:
        return parts["values"].reshape(rec.shape).copy()
    values = huffman.decode(parts["v_stream"], parts["v_len"], rec.entries, impl="numpy")
    gaps = huffman.decode(parts["i_stream"], parts["i_len"], rec.entries, impl="numpy")
    codes = relative_csr.decode(gaps, values, rec.size)
    table = np.concatenate([[0.0], parts["codebook"]]).astype(np.float32)
    return table[codes].reshape(rec.shape)
