"""Sparse weights with relative indices (Deep Compression's CSR, Han et al. 2016, Fig. 2).

A pruned tensor, flattened in C order, is stored as entries ``(gap, value)``: ``gap`` is the
number of zeros skipped since the previous entry (or since the start), ``value`` the stored
symbol (a cluster index; 0 means the value zero). Storing gaps instead of positions lets an
index take only ``index_bits`` bits. When more than ``2**index_bits - 1`` zeros separate two
non-zeros, *filler* entries are inserted: a zero (value 0) stored at the largest gap, as many
as needed, as the paper pads with zeros. Zeros after the last non-zero need no entry: the
decoder knows the tensor's size.

The tensor is one row of a CSR matrix: the relative index runs across the rows of a weight
matrix, so no row-pointer array is stored (the paper's figure shows the same flat layout).
"""

from __future__ import annotations

from typing import Any

import numpy as np


def max_gap(index_bits: int) -> int:
    """Largest gap one entry can store."""
    if not 1 <= index_bits <= 16:
        raise ValueError(f"index_bits must lie in [1, 16], got {index_bits}")
    return (1 << int(index_bits)) - 1


def encode(codes: Any, index_bits: int) -> tuple[np.ndarray, np.ndarray]:
    """``(gaps, values)`` (int64 arrays, fillers included) of the non-zero symbols of
    ``codes`` (any shape, read flattened)."""
    flat = np.asarray(codes).reshape(-1)
    positions = np.flatnonzero(flat)
    span = max_gap(index_bits) + 1  # positions one filler advances by
    gaps = np.diff(positions, prepend=-1) - 1
    fillers = gaps // span
    n = len(positions) + int(fillers.sum())
    out_gaps = np.full(n, span - 1, dtype=np.int64)
    out_values = np.zeros(n, dtype=np.int64)
    # each non-zero comes after its fillers: its slot is its rank plus the fillers so far
    slots = np.arange(len(positions)) + np.cumsum(fillers)
    out_gaps[slots] = gaps - fillers * span
    out_values[slots] = flat[positions]
    return out_gaps, out_values


def decode(gaps: Any, values: Any, size: int) -> np.ndarray:
    """The dense symbols (int64, length ``size``) that :func:`encode` described; raises
    ``ValueError`` if the entries run past ``size``."""
    gaps = np.asarray(gaps, dtype=np.int64)
    values = np.asarray(values, dtype=np.int64)
    if len(gaps) != len(values):
        raise ValueError(f"{len(gaps)} gaps but {len(values)} values")
    positions = np.cumsum(gaps + 1) - 1
    out = np.zeros(int(size), dtype=np.int64)
    if len(positions) and positions[-1] >= size:
        raise ValueError(f"entries reach position {positions[-1]} of a tensor of {size}")
    out[positions] = values
    return out


def num_fillers(values: Any) -> int:
    """Entries that are padding zeros (value 0)."""
    return int((np.asarray(values) == 0).sum())
