"""Carrying out encode / decode steps with the kernels of :mod:`minidl.kernels` (NumPy / Numba
CPU, Numba CUDA by array type). Backward straight from an encoding is layer math: the layer's
``backward_from_encoded``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ...kernels.codecs import bitpack, precision, sparse
from ...kernels.codecs.sparse_format import header_for
from ...kernels.compression import weight_record
from ...kernels.pooling import poolidx
from ..ir.names import Codec


@dataclass(eq=False)
class CodecState:
    """What the encoding of one tensor leaves for its decoding and the caller, in one
    iteration: a packed argmax's window ``size`` (given), and for ``sparse`` the non-zero
    count, the format chosen and (for the compressed formats) the header it wrote."""

    window: int = 0
    nnz: int = 0
    fmt: str = ""
    header: Any = None


def encode(codec: Codec, x: Any, out: Any, state: CodecState) -> int:
    """Encode ``x`` into the byte buffer ``out``; returns the bytes needed. When the data needs
    more than ``out`` holds (a sparse tensor denser than planned), nothing is written and the
    caller must provide a larger buffer. ``sparse`` leaves the non-zero count in
    ``state.nnz``."""
    if codec == Codec.SIGN:
        bitpack.pack_sign(x.reshape(-1), out=out[:bitpack.packed_nbytes(x.size)])
        return bitpack.packed_nbytes(x.size)
    if codec == Codec.POOLIDX:
        bits = poolidx.index_bits(state.window)
        nb = poolidx.packed_index_nbytes(x.size, bits)
        poolidx.pack_indices(x.reshape(-1), bits, out=out[:nb])
        return nb
    if codec == Codec.SPARSE:
        # the format and size depend on the count: on a GPU this read is the step's one host
        # synchronisation per sparse stash (kept in state.nnz for the density it measures)
        nnz = state.nnz = sparse.count_nonzero(x)
        enc = sparse.choose_encoding(x.size, nnz, x.dtype.itemsize)
        if enc.nbytes > out.size:
            return enc.nbytes
        if enc.fmt == "dense":
            out[:enc.nbytes] = x.reshape(-1).view(np.uint8)
        else:
            sparse.encode(x, out[:enc.nbytes], enc.fmt, enc.row_width or 256, nnz=nnz)
            state.header = header_for(enc.fmt, x.size, nnz, x.dtype.itemsize,
                                          enc.row_width or 256)
        state.fmt = enc.fmt
        return enc.nbytes
    codes = precision.code_dtype(codec)
    if x.dtype != np.float32:  # a half feature map (fp8 below bf16 / fp16): its exact values
        x = x.astype(np.float32)
    precision.encode(x.reshape(-1), codec, out=out.view(codes)[:x.size])
    return x.size * codes.itemsize


def decode(codec: Codec, buf: Any, out: Any, state: CodecState) -> None:
    """Decode the byte buffer ``buf`` into the dense array ``out`` (``state``: what its
    encoding left)."""
    if codec == Codec.WEIGHTS:
        # a compressed model's parameter (Deep Compression), decoded by the kernels of out's
        # device (its records are checked when the model is loaded: a device reports nothing)
        weight_record.decode_into(buf, out)
        return
    if codec == Codec.SPARSE:
        if state.fmt == "dense":
            out.reshape(-1).view(np.uint8)[...] = buf[:out.nbytes]
        else:  # (the header the encoder wrote, known here: not read back from the device)
            sparse.decode(buf, out, header=state.header)
        return
    codes = precision.code_dtype(codec)
    precision.decode(buf.view(codes)[:out.size], codec, out=out.reshape(-1), dtype=out.dtype)


def density(x: Any) -> float:
    """Fraction of non-zero elements."""
    return sparse.count_nonzero(x) / max(int(x.size), 1)
