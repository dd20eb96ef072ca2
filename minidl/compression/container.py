"""The compressed model file: self-describing, versioned, checksummed, written atomically.

Layout (little-endian)::

    magic       8 bytes  b"MINIDLDC"
    version     u16      FORMAT_VERSION
    header_len  u32      bytes of the header
    file_len    u64      bytes of the whole file (truncation is reported as such)
    header      zlib-compressed JSON: the model (builder name, input shape, classes, width),
                the input preprocessing, and per parameter its name and record length
    records     one weight record per parameter, in the header's order
                (:mod:`minidl.kernels.compression.weight_record`)
    crc32       u32      of every byte before it

:func:`read` checks all of it and raises :class:`CompressedModelError` with one line saying
what is wrong (not this format, a newer version, truncated, corrupted).
"""

from __future__ import annotations

import json
import os
import struct
import tempfile
import zlib
from dataclasses import dataclass, field
from typing import Any

from ..kernels.compression import weight_record

MAGIC = b"MINIDLDC"
FORMAT_VERSION = 1
_FIXED = struct.Struct("<8sHIQ")
_CRC = struct.Struct("<I")


class CompressedModelError(ValueError):
    """A file that is not a valid minidl compressed model; the message says why."""


@dataclass
class CompressedModel:
    """A compressed model in memory: what to build (``model``: ``name``, ``input_shape``,
    ``num_classes``, ``width``), how inputs were preprocessed (``preprocess``: ``mean`` and
    ``std`` per channel, or empty) and one weight record per parameter, in layer order."""

    model: dict[str, Any]
    records: dict[str, bytes]
    preprocess: dict[str, Any] = field(default_factory=dict)

    def record_bytes(self) -> int:
        return sum(len(r) for r in self.records.values())


def to_bytes(cm: CompressedModel) -> bytes:
    """The file's bytes."""
    header = zlib.compress(json.dumps({
        "format": "minidl deep compression", "model": cm.model, "preprocess": cm.preprocess,
        "params": [[name, len(rec)] for name, rec in cm.records.items()],
    }, separators=(",", ":")).encode(), 9)
    body = b"".join(cm.records.values())
    total = _FIXED.size + len(header) + len(body) + _CRC.size
    head = _FIXED.pack(MAGIC, FORMAT_VERSION, len(header), total) + header
    data = head + body
    return data + _CRC.pack(zlib.crc32(data))


def write(cm: CompressedModel, path: str | os.PathLike) -> int:
    """Write ``cm`` to ``path`` atomically (a temporary file renamed into place); returns the
    file's size in bytes."""
    path = os.fspath(path)
    data = to_bytes(cm)
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # as open() would make it (mkstemp's is 0600)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return len(data)


def from_bytes(data: bytes, name: str = "data") -> CompressedModel:
    """Parse and check a file's bytes (``name`` is used in error messages)."""
    if len(data) < len(MAGIC) or data[:len(MAGIC)] != MAGIC:
        raise CompressedModelError(
            f"{name} is not a minidl compressed model (it starts with {data[:8]!r}, not "
            f"{MAGIC!r}); make one with 'minidl compress'")
    if len(data) < _FIXED.size + _CRC.size:
        raise CompressedModelError(f"{name} is truncated: {len(data)} bytes, shorter than "
                                   f"the fixed header")
    _, version, header_len, total = _FIXED.unpack_from(data)
    if version != FORMAT_VERSION:
        raise CompressedModelError(f"{name} is format version {version}; this minidl reads "
                                   f"version {FORMAT_VERSION}")
    if len(data) < total:
        raise CompressedModelError(f"{name} is truncated: {len(data):,} of {total:,} bytes")
    if len(data) > total:
        raise CompressedModelError(f"{name} has {len(data) - total:,} bytes after its end "
                                   f"({total:,} bytes): not one compressed model")
    (crc,) = _CRC.unpack_from(data, total - _CRC.size)
    if zlib.crc32(data[:total - _CRC.size]) != crc:
        raise CompressedModelError(f"{name} is corrupted: its CRC-32 checksum does not match")
    try:
        header = json.loads(zlib.decompress(data[_FIXED.size:_FIXED.size + header_len]))
        params = [(str(n), int(size)) for n, size in header["params"]]
        model, preprocess = dict(header["model"]), dict(header.get("preprocess") or {})
    except (zlib.error, ValueError, KeyError, TypeError) as e:
        raise CompressedModelError(f"{name} has an unreadable header ({e})") from None
    records: dict[str, bytes] = {}
    pos = _FIXED.size + header_len
    for pname, size in params:
        records[pname] = data[pos:pos + size]
        pos += size
        try:
            weight_record.info(records[pname])
        except weight_record.RecordError as e:
            raise CompressedModelError(f"{name}: parameter {pname}: {e}") from None
    listed, held = pos - _FIXED.size - header_len, total - _CRC.size - _FIXED.size - header_len
    if listed != held:
        raise CompressedModelError(f"{name}: its header lists {listed:,} bytes of records, "
                                   f"the file holds {held:,}")
    return CompressedModel(model, records, preprocess)


def read(path: str | os.PathLike) -> CompressedModel:
    """Read and check a compressed model file."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise CompressedModelError(f"{path}: no such file" + (
            " (it is a folder)" if os.path.isdir(path) else ""))
    with open(path, "rb") as f:
        data = f.read()
    return from_bytes(data, path)
