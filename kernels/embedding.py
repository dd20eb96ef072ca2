"""Embedding rows: the gather of forward and the scatter-add of backward into the weight
gradient (Numba for NumPy arrays; the arrays' own ``take`` / ``add.at`` otherwise)."""

from __future__ import annotations

import numpy as np
from numba import njit


def take_rows(table, idx, out) -> None:
    """``out[...] = table[idx]`` (rows of ``table`` (V, ...) at the in-range indices ``idx``),
    with no temporary. NumPy needs ``mode="clip"`` to write ``out`` unbuffered; CuPy's
    ``take`` has no ``mode`` (it wraps), which is the same for in-range indices."""
    if type(table) is np.ndarray:
        np.take(table, idx, axis=0, out=out, mode="clip")
    else:
        np.take(table, idx, axis=0, out=out)


def embedding_backward_ref(idx: np.ndarray, dy: np.ndarray, gw: np.ndarray) -> None:
    """NumPy reference: ``gw = 0; gw[idx[i]] += dy[i]`` for every row i, in order."""
    gw.fill(0)
    np.add.at(gw, idx, dy)


@njit(cache=True, nogil=True, error_model="numpy")
def _scatter_add(idx, dy, gw):
    for i in range(idx.shape[0]):
        r = idx[i]
        for j in range(dy.shape[1]):
            gw[r, j] += dy[i, j]


def embedding_backward(idx: np.ndarray, dy: np.ndarray, gw: np.ndarray) -> None:
    """``gw`` (V, E) overwritten with the sum of the rows of ``dy`` (M, E) at ``idx`` (M,).

    Rows are added in index order, as the reference does, so results are bit-identical; other
    array types and layouts go through ``np.add.at``."""
    gw.fill(0)
    embedding_accumulate(idx, dy, gw)


def embedding_accumulate(idx: np.ndarray, rows: np.ndarray, acc: np.ndarray) -> None:
    """``acc[idx[i]] += rows[i]`` for every row i, in order (no reset)."""
    if not idx.size:
        return
    if all(type(a) is np.ndarray for a in (idx, rows, acc)) and acc.flags.c_contiguous:
        _scatter_add(np.ascontiguousarray(idx), np.ascontiguousarray(rows), acc)
    else:
        np.add.at(acc, idx, rows)
