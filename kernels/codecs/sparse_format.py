"""The byte format of sparse encodings (see :mod:`minidl.kernels.codecs.sparse`): header, section
offsets of the csr and zvc layouts, encoded sizes, the choice of encoding and a NumPy
encoder.

Buffer layout (little-endian; offsets in bytes from the start of ``buf``, which should be
8-byte aligned, as pool blocks are):

* header, 32 bytes (``HEADER_DTYPE``): ``0`` magic ``b"SZ"``; ``2`` u8 format (1 csr, 2 zvc);
  ``3`` u8 value itemsize; ``4`` u8 column index bytes (csr: 1 if ``row_width <= 256`` else 2;
  zvc: 0); ``5`` u8 row pointer bytes (csr: 4 if ``n < 2**31`` else 8; zvc: 0); ``6`` u16 0;
  ``8`` u32 row width (zvc: 0); ``12`` u32 0; ``16`` u64 ``n``; ``24`` u64 ``nnz``.
* zvc: values (``nnz * itemsize``) at 32, then the mask (``ceil(n / 8)`` bytes, bit ``i % 8`` of
  byte ``i // 8`` is 1 where element ``i`` is non-zero, as in :mod:`bitpack`).
  Total ``32 + nnz * itemsize + ceil(n / 8)``.
* csr: ``rows = ceil(n / W)`` (the last row may be short). Row pointers (``rows + 1`` of
  ``pb`` bytes; ``rowptr[r]`` = index of row ``r``'s first value, ``rowptr[rows] = nnz``) at
  32; values at ``V = align8(32 + (rows + 1) * pb)``; column indices (position in the row,
  ``cb`` bytes each) at ``V + nnz * itemsize``. Total ``V + nnz * (itemsize + cb)``.
* dense: the ``n * itemsize`` raw bytes, no header (decode with ``fmt="dense"``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from .. import _cuda

FORMATS = ("dense", "csr", "zvc")
_CODES = {"csr": 1, "zvc": 2}
HEADER_NBYTES = 32
HEADER_DTYPE = np.dtype([
    ("magic", "S2"), ("fmt", "u1"), ("itemsize", "u1"), ("col_bytes", "u1"),
    ("ptr_bytes", "u1"), ("_r0", "<u2"), ("row_width", "<u4"), ("_r1", "<u4"),
    ("n", "<u8"), ("nnz", "<u8")])
_MAGIC = b"SZ"


class Encoding(NamedTuple):
    """What :func:`choose_encoding` picked: format, exact encoded bytes, CSR row width (or 0)."""
    fmt: str
    nbytes: int
    row_width: int


class Header(NamedTuple):
    """The decoded header of an encoded buffer (``nbytes`` = total encoded size)."""
    fmt: str
    n: int
    nnz: int
    itemsize: int
    row_width: int
    col_bytes: int
    ptr_bytes: int
    nbytes: int


class _Layout(NamedTuple):
    total: int
    vals: int  # offset of the values
    meta: int  # offset of the mask (zvc) or of the row pointers (csr)
    cols: int  # offset of the column indices (csr)
    rows: int
    col_bytes: int
    ptr_bytes: int


def _layout(n: int, nnz: int, fmt: str, itemsize: int, row_width: int) -> _Layout:
    if fmt == "zvc":
        return _Layout(32 + nnz * itemsize + (n + 7) // 8, 32, 32 + nnz * itemsize, 0, 0, 0, 0)
    if fmt != "csr":
        raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")
    if not 1 <= row_width <= 65536:
        raise ValueError(f"row_width must be in [1, 65536], got {row_width}")
    rows = (n + row_width - 1) // row_width
    cb = 1 if row_width <= 256 else 2
    pb = 4 if n < 2**31 else 8
    vals = (32 + (rows + 1) * pb + 7) // 8 * 8
    return _Layout(vals + nnz * (itemsize + cb), vals, 32, vals + nnz * itemsize, rows, cb, pb)


def encoded_nbytes(n: int, nnz: int, fmt: str, itemsize: int = 4, row_width: int = 256) -> int:
    """Exact size in bytes of ``n`` elements with ``nnz`` non-zeros encoded as ``fmt``."""
    n, nnz = int(n), int(nnz)
    if not 0 <= nnz <= n:
        raise ValueError(f"nnz={nnz} not in [0, n={n}]")
    if fmt == "dense":
        return n * itemsize
    return _layout(n, nnz, fmt, itemsize, row_width).total


def choose_encoding(n: int, nnz: int, itemsize: int = 4,
                    row_widths: tuple[int, ...] = (256, 65536)) -> Encoding:
    """Smallest of dense, zvc and csr (each row width in ``row_widths``); never expands:
    dense unless an encoding is strictly smaller than ``n * itemsize``."""
    best = Encoding("dense", int(n) * itemsize, 0)
    cands = [("zvc", 0)] + [("csr", w) for w in row_widths]
    for fmt, w in cands:
        nb = encoded_nbytes(n, nnz, fmt, itemsize, w or 256)
        if nb < best.nbytes:
            best = Encoding(fmt, nb, w)
    return best


def header_for(fmt: str, n: int, nnz: int, itemsize: int = 4, row_width: int = 256) -> Header:
    """The header :func:`read_header` would find in a buffer encoded with these figures
    (computed on the host: decoding with it needs no read of the device buffer)."""
    lay = _layout(n, nnz, fmt, itemsize, row_width or 256)
    return Header(fmt, int(n), int(nnz), int(itemsize), int(row_width) if fmt == "csr" else 0,
                  lay.col_bytes, lay.ptr_bytes, lay.total)


def read_header(buf: Any) -> Header:
    """Parse the 32-byte header of a csr / zvc buffer (host or device)."""
    raw = _cuda.byte_view(buf, HEADER_NBYTES, "buf")
    if _cuda.is_device_array(raw):
        raw = _cuda.to_host(raw)
    h = np.asarray(raw).view(HEADER_DTYPE)[0]
    if h["magic"] != _MAGIC or int(h["fmt"]) not in (1, 2):
        raise ValueError("not a csr/zvc buffer (bad magic or format); dense needs fmt='dense'")
    fmt = "csr" if int(h["fmt"]) == 1 else "zvc"
    n, nnz, isz, w = int(h["n"]), int(h["nnz"]), int(h["itemsize"]), int(h["row_width"])
    lay = _layout(n, nnz, fmt, isz, w or 256)
    return Header(fmt, n, nnz, isz, w, lay.col_bytes, lay.ptr_bytes, lay.total)


def _header_bytes(fmt: str, n: int, nnz: int, itemsize: int, row_width: int,
                  lay: _Layout) -> np.ndarray:
    h = np.zeros(1, HEADER_DTYPE)
    h["magic"], h["fmt"], h["itemsize"] = _MAGIC, _CODES[fmt], itemsize
    h["col_bytes"], h["ptr_bytes"] = lay.col_bytes, lay.ptr_bytes
    h["row_width"] = row_width if fmt == "csr" else 0
    h["n"], h["nnz"] = n, nnz
    return h.view(np.uint8)


def _csr_arrays(b: Any, lay: _Layout) -> tuple[Any, Any]:
    """Row pointers and column indices of a csr buffer ``b`` (flat bytes)."""
    ptr = b[lay.meta: lay.meta + (lay.rows + 1) * lay.ptr_bytes]
    return (ptr.view(np.dtype(f"<i{lay.ptr_bytes}")),
            b[lay.cols: lay.total].view(np.dtype(f"<u{lay.col_bytes}")))


def _bits(a: Any) -> Any:
    """Flat view of ``a`` as unsigned integers of its itemsize."""
    if a.dtype.itemsize not in (1, 2, 4, 8):
        raise TypeError(f"itemsize {a.dtype.itemsize} not supported")
    return a.reshape(-1).view(np.dtype(f"u{a.dtype.itemsize}"))


def _encode_numpy(xb: np.ndarray, buf: Any, fmt: str, row_width: int) -> int:
    n, isz = xb.size, xb.dtype.itemsize
    nzm = xb != 0
    nnz = int(np.count_nonzero(nzm))
    lay = _layout(n, nnz, fmt, isz, row_width)
    b = _cuda.byte_view(buf, lay.total, "buf")
    b[:HEADER_NBYTES] = _header_bytes(fmt, n, nnz, isz, row_width, lay)
    b[lay.vals: lay.vals + nnz * isz] = xb[nzm].view(np.uint8)
    if fmt == "zvc":
        b[lay.meta: lay.total] = np.packbits(nzm, bitorder="little")
        return lay.total
    idx = np.flatnonzero(nzm)
    ptr = np.zeros(lay.rows + 1, np.int64)
    np.cumsum(np.bincount(idx // row_width, minlength=lay.rows), out=ptr[1:])
    b[lay.meta: lay.meta + ptr.size * lay.ptr_bytes] = ptr.astype(f"<i{lay.ptr_bytes}").view(
        np.uint8)
    b[lay.cols: lay.total] = (idx % row_width).astype(f"<u{lay.col_bytes}").view(np.uint8)
    return lay.total
