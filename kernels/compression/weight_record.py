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
pool), with no temporary array of the tensor's size, chosen by the array type as the other
kernels are: on the host the two Huffman streams are decoded and scattered in one Numba pass;
on a device (CuPy, Numba or emulated device arrays, the record itself on the device) two Numba
CUDA kernels run: a grid-stride pass that copies a ``RAW`` record's bytes or zeroes the
output, then ONE thread that parses the ``SHARED`` header, builds both canonical decode tables
and the codebook in its local memory and decodes the entries straight into the output
(Huffman decoding is bit-serial, and the record holds one stream of each kind: a thread per
stream would need a scratch of the entries' positions and values, which the plans do not
hold). The device decoder reads nothing on the host and does not synchronise: it reports
problems only through an optional ``status`` byte; :func:`check` validates a record on the
host (a compressed model's records are checked so when it is loaded).
"""

from __future__ import annotations

import functools
import struct
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np
from numba import njit

from .. import _cuda
from . import huffman, relative_csr

cuda: Any = None  # numba.cuda, set by _cuda.bind on first CUDA use

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
def _walk_shared(vbuf, vt, ibuf, it, entries, table, out, size, write):  # pragma: no cover
    """Walk ``entries`` (gap, value) pairs of a ``SHARED`` record; with ``write``, scatter them
    into the zeroed flat ``out`` (``size`` elements). Returns the number of entries that decode
    to a value code in the table at a position below ``size`` before the first that does not
    (``entries`` for a valid record)."""
    if write:
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
        if pos >= size:
            return e
        if write:
            out[pos] = table[v]
    return entries


def _shared_entries(parts: dict, rec: Any, table: np.ndarray, out: np.ndarray,
                    write: bool) -> None:
    """Decode (``write``) or only check a ``SHARED`` record's streams; a bad stream raises."""
    u8 = np.frombuffer
    done = _walk_shared(u8(parts["v_stream"], np.uint8), _table_arrays(parts["v_len"]),
                        u8(parts["i_stream"], np.uint8), _table_arrays(parts["i_len"]),
                        rec.entries, table, out, rec.size, write)
    if done < rec.entries:
        raise RecordError(f"weight record's streams are invalid after {done} of "
                          f"{rec.entries} entries")


def _table_arrays(lengths: np.ndarray) -> tuple[np.ndarray, ...]:
    try:
        t = huffman.DecodeTable(lengths)
    except huffman.HuffmanError as e:
        raise RecordError(f"weight record has an invalid code table: {e}") from None
    return t.first, t.count, t.offset, t.symbols


#: What the device decoder's ``status`` byte means (:func:`decode_into`).
STATUS = {0: "decoded", 1: "the header is invalid or does not fit the destination",
          2: "a stream ends early or holds an invalid code", 3: "an entry lies past the end"}
#: Destination dtypes a ``SHARED`` record decodes into on a device.
DEVICE_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))


def _raw_code(dtype: Any) -> int:
    """The ``RAW`` dtype code of ``dtype`` (255 if a raw record cannot hold it)."""
    dt = np.dtype(dtype)
    dt = dt.newbyteorder("<") if dt.byteorder != "|" else dt
    codes = [np.dtype(d) for d in RAW_DTYPES]
    return codes.index(dt) if dt in codes else 255


def decode_into(buf: Any, out: Any, *, impl: str = "auto", stream: Any = None,
                status: Any = None) -> None:
    """Decode the record ``buf`` into ``out`` (an array of the record's shape, or of its size).

    On the host (``impl`` ``"numba"``, or ``"numpy"``: :func:`decode_reference`), ``buf`` is
    bytes or a uint8 array and ``out`` a NumPy array; a bad record raises
    :class:`RecordError`. On a device (``"cuda"``, chosen for device arrays), ``buf`` is the
    record as a flat uint8 device array and ``out`` a C-contiguous device array (float32 or
    float64 for a ``SHARED`` record, a ``RAW`` record's own dtype); the kernels run on
    ``stream`` (CuPy's current stream for CuPy arrays) and nothing waits for them. ``status``
    (optional, a uint8 device array) then receives a code of :data:`STATUS` (0: decoded);
    without it nothing is reported, so check records with :func:`check` first."""
    impl = _cuda.choose(impl, buf, out, status)
    if impl == "cuda":
        _decode_device(buf, out, stream, status)
        return
    if status is not None:
        raise ValueError("status is for device decoding; host decoding raises RecordError")
    rec, parts = _parse(buf)
    if out.size != rec.size:
        raise RecordError(f"weight record holds {rec.shape} ({rec.size} values), the "
                          f"destination has {out.size}")
    flat = out.reshape(-1)
    if impl == "numpy":
        flat[...] = decode_reference(buf).reshape(-1)
        return
    if rec.kind == RAW:
        flat[...] = parts["values"]
        return
    table = np.concatenate([[0.0], parts["codebook"]]).astype(out.dtype)
    _shared_entries(parts, rec, table, flat, True)


def check(buf: Any, dtype: Any = None) -> RecordInfo:
    """Validate a record on the host without making its tensor: the header, a ``RAW``
    record's values, every entry of a ``SHARED`` record's streams, and (``dtype`` given) that
    it decodes into that dtype on any device (a ``RAW`` record into its own dtype, a
    ``SHARED`` one into float32 or float64). Returns the header; raises :class:`RecordError`."""
    rec, parts = _parse(buf)
    dt = None if dtype is None else np.dtype(dtype)
    if rec.kind == RAW:
        values = parts["values"]
        if dt is not None and _raw_code(dt) != _raw_code(values.dtype):
            raise RecordError(f"raw weight record holds {values.dtype}, the destination is "
                              f"{dt}")
        return rec
    if dt is not None and dt not in DEVICE_FLOATS:
        raise RecordError(f"a shared weight record decodes into float32 or float64, not {dt}")
    # value codes 0..k are valid: a table of k + 1 entries, nothing written
    _shared_entries(parts, rec, np.zeros(rec.k + 1), np.empty(0), False)
    return rec


# ----------------------------------------------------------------------------- CUDA
# Device functions (bound to the globals below by _cuda.bind) and the two kernels. Records
# are read byte by byte (a record's fields are not aligned in its buffer).
def _le(buf, pos, nbytes):
    """The little-endian unsigned integer of ``nbytes`` bytes at ``buf[pos]``."""
    v = 0
    for j in range(nbytes):
        v |= np.int64(buf[pos + j]) << (8 * j)
    return v


def _code_table(buf, pos, alphabet, lens, count, first, offset, fill, symbols):
    """Canonical decode tables (as :class:`~.huffman.DecodeTable`'s) from the 5-bit code
    lengths packed at ``buf[pos]``; False if they are not a prefix code."""
    for s in range(alphabet):
        n = 0
        for j in range(5):
            q = 5 * s + j
            n = (n << 1) | ((np.int64(buf[pos + (q >> 3)]) >> (7 - (q & 7))) & 1)
        lens[s] = n
    for n in range(32):
        count[n] = 0
    for s in range(alphabet):
        count[lens[s]] += 1
    count[0] = 0
    code = 0
    off = 0
    kraft = 0
    for n in range(1, 32):
        if n > 1:
            code = (code + count[n - 1]) << 1
        first[n] = code
        offset[n] = off
        fill[n] = off
        off += count[n]
        kraft += count[n] << (31 - n)
    if kraft > (1 << 31):
        return False
    for s in range(alphabet):  # symbols sorted by (length, symbol)
        n = lens[s]
        if n > 0:
            symbols[fill[n]] = s
            fill[n] += 1
    return True


def _symbol(buf, start, nbits, bitpos, first, count, offset, symbols):
    """One symbol of the stream at ``buf[start]`` (``nbits`` bits) at bit ``bitpos``, as
    :func:`~.huffman.decode_symbol`: (symbol or -1, next bit position)."""
    code = 0
    for n in range(1, 32):
        if bitpos >= nbits:
            return -1, bitpos
        bit = (np.int64(buf[start + (bitpos >> 3)]) >> (7 - (bitpos & 7))) & 1
        bitpos += 1
        code = (code << 1) | bit
        d = code - first[n]
        if d < count[n]:
            return np.int64(symbols[offset[n] + d]), bitpos
    return -1, bitpos


def _write_entries(buf, v0, i0, entries, size, k, vfirst, vcount, voffset, vsym, ifirst, icount,
                   ioffset, isym, values, out):
    """The ``entries`` (gap, value code) pairs of the Huffman streams at ``buf[i0]`` (gaps)
    and ``buf[v0]`` (codes), each code's value ``values[code]`` (float32 bits) written at its
    position of ``out``; a code of :data:`STATUS`: 0, or 2 (a bad symbol) / 3 (a position
    past ``size``) where it stops."""
    n = buf.shape[0]
    pos = -1
    vbit = 0
    ibit = 0
    for _ in range(entries):
        g, ibit = symbol(buf, i0, 8 * (n - i0), ibit, ifirst, icount, ioffset, isym)
        v, vbit = symbol(buf, v0, 8 * (i0 - v0), vbit, vfirst, vcount, voffset, vsym)
        if g < 0 or v < 0 or v > k:
            return 2
        pos += g + 1
        if pos >= size:
            return 3
        out[pos] = np.uint32(values[v]).view(np.float32)
    return 0


le: Any = None
code_table: Any = None
symbol: Any = None
write_entries: Any = None


def _k_raw_or_zero(buf, out, code, itemsize, shared_ok, status, report):
    """Grid-stride over the bytes of ``out``: a ``RAW`` record's values when its dtype code is
    ``code`` and its size fits, else zeros (a ``SHARED`` record's entries come next). Thread 0
    writes ``status[0]``: 0 for such a ``RAW`` record, or a ``SHARED`` one the
    next kernel decodes (``shared_ok``), else 1; nothing unless ``report``."""
    n = buf.shape[0]
    nbytes = out.shape[0]
    kind = np.int64(buf[0]) if n >= 2 else 255
    ndim = np.int64(buf[1]) if n >= 2 else 0
    start = 3 + 4 * ndim  # the values, after the dims and the dtype code
    raw = False
    if kind == 0 and start <= n:
        if buf[start - 1] == code and n - start >= nbytes:
            size = 1
            for d in range(ndim):
                size *= le(buf, 2 + 4 * d, 4)
            raw = size * itemsize == nbytes
    for i in range(cuda.grid(1), nbytes, cuda.gridsize(1)):
        out[i] = buf[start + i] if raw else np.uint8(0)
    if cuda.grid(1) == 0 and report:
        status[0] = 0 if raw or (kind == 1 and shared_ok) else 1


def _k_decode_shared(buf, out, status, report):
    """ONE thread: parse the ``SHARED`` record in ``buf``, build its decode tables and
    codebook in shared memory and write each entry's value at its position in the zeroed
    ``out`` (float32 or float64, flat). Nothing for other records. ``status[0]`` (if
    ``report``): a code of :data:`STATUS`."""
    n = buf.shape[0]
    if cuda.grid(1) != 0 or n < 2 or buf[0] != 1:
        return
    if report:
        status[0] = 1
    ndim = np.int64(buf[1])
    p = 2 + 4 * ndim
    if p + 8 > n:
        return
    size = 1
    for d in range(ndim):
        size *= le(buf, 2 + 4 * d, 4)
    vb = np.int64(buf[p])
    ib = np.int64(buf[p + 1])
    k = le(buf, p + 2, 2)
    entries = le(buf, p + 4, 4)
    book = p + 8
    vl = book + 4 * k
    il = vl + (5 * (1 << vb) + 7) // 8 if vb <= 12 else n
    vs = il + (5 * (1 << ib) + 7) // 8 if ib <= 12 else n
    if vb < 1 or vb > 12 or ib < 1 or ib > 12 or k > (1 << vb) - 1 or size != out.shape[0] \
            or vs + 4 > n:
        return
    v0 = vs + 4
    i0 = v0 + le(buf, vs, 4)
    if i0 > n:
        return
    lens = cuda.shared.array(4096, dtype=np.uint8)
    fill = cuda.shared.array(32, dtype=np.int64)
    vcount = cuda.shared.array(32, dtype=np.int64)
    vfirst = cuda.shared.array(32, dtype=np.int64)
    voffset = cuda.shared.array(32, dtype=np.int64)
    vsym = cuda.shared.array(4096, dtype=np.int16)
    icount = cuda.shared.array(32, dtype=np.int64)
    ifirst = cuda.shared.array(32, dtype=np.int64)
    ioffset = cuda.shared.array(32, dtype=np.int64)
    isym = cuda.shared.array(4096, dtype=np.int16)
    values = cuda.shared.array(4096, dtype=np.uint32)  # float32 bits of codes 0..k
    if not code_table(buf, vl, 1 << vb, lens, vcount, vfirst, voffset, fill, vsym):
        return
    if not code_table(buf, il, 1 << ib, lens, icount, ifirst, ioffset, fill, isym):
        return
    values[0] = 0
    for c in range(k):
        values[c + 1] = le(buf, book + 4 * c, 4)
    code = write_entries(buf, v0, i0, entries, size, k, vfirst, vcount, voffset, vsym, ifirst,
                         icount, ioffset, isym, values, out)
    if report:
        status[0] = code


@functools.cache
def _kernels() -> SimpleNamespace:
    return _cuda.bind(globals(), ["_k_raw_or_zero", "_k_decode_shared"],
                      device={"le": "_le", "code_table": "_code_table", "symbol": "_symbol",
                              "write_entries": "_write_entries"})


def _decode_device(buf: Any, out: Any, stream: Any, status: Any) -> None:
    if buf.dtype != np.uint8 or len(buf.shape) != 1:
        raise ValueError(f"a record on the device is a flat uint8 array, got {buf.dtype} of "
                         f"shape {tuple(buf.shape)}")
    if status is not None and (status.dtype != np.uint8 or status.size < 1):
        raise ValueError(f"status must be a uint8 device array of at least one element, got "
                         f"{status.dtype} of size {status.size}")
    flat = _cuda.flat(out)
    # (without a status the record stands in for it, never written: no array is made)
    st = buf if status is None else _cuda.flat(status, "status")
    shared_ok = flat.dtype in DEVICE_FLOATS
    k = _kernels()
    _cuda.launch(k.k_raw_or_zero, max(flat.nbytes, 1), buf, _cuda.byte_view(flat, flat.nbytes),
                 _raw_code(flat.dtype), flat.dtype.itemsize, shared_ok, st, status is not None,
                 stream=stream)
    if shared_ok:
        _cuda.run(k.k_decode_shared, 1, 1, buf, flat, st, status is not None, stream=stream)


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
