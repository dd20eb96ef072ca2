"""Embedding rows: the gather of forward and the scatter-add of backward into the weight
gradient (Numba for NumPy arrays; the arrays' own ``take`` / ``add.at`` otherwise), and the
positional table's gradient on device arrays.

Device arrays (C-contiguous, float gradients) take Numba CUDA kernels, one launch each, with
no atomics and no temporary: the scatter-add gives each thread one column of a range of
vocabulary rows, which it zeroes (unless accumulating) and then adds the rows of ``dy`` into in
index order — the host loop's order, so the same bits, whatever the launch shape. (``add.at``
on a GPU adds with atomics, in no fixed order.) The positional gradient sums each table entry
over the batch in order, in the gradient's dtype (as the host's ``sum`` over axis 0).
"""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any

import numpy as np
from numba import njit

from .. import _cuda

cuda: Any = None  # numba.cuda, set by _cuda.bind on first CUDA use

#: Threads of the device scatter-add (columns x vocabulary ranges) it aims for.
SCATTER_THREADS = 1 << 15


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


# ---------------------------------------------------------------- CUDA kernels
def _k_embedding_grad(idx, dy, gw, reset, groups):
    """Thread (group, column j): rows ``[g * span, (g + 1) * span)`` of column j of ``gw``,
    zeroed if ``reset``, then ``gw[idx[i], j] += dy[i, j]`` for the rows i landing there, in
    order."""
    vocab, width = gw.shape
    span = (vocab + groups - 1) // groups
    for t in range(cuda.grid(1), groups * width, cuda.gridsize(1)):
        g = t // width
        j = t - g * width
        lo = g * span
        hi = lo + span if lo + span < vocab else vocab
        if reset:
            for v in range(lo, hi):
                gw[v, j] = 0
        for i in range(idx.size):
            r = idx[i]
            if r >= lo and r < hi:
                gw[r, j] += dy[i, j]


def _k_positional_grad(dy, gw, accumulate):
    """``gw[t] (=, +=) sum_n dy[n, t]`` for t < T (summed in order in gw's dtype); rows from
    T on zeroed unless ``accumulate``."""
    batch, seq, width = dy.shape
    acc = cuda.local.array(1, gw.dtype)
    for e in range(cuda.grid(1), gw.size, cuda.gridsize(1)):
        t = e // width
        j = e - t * width
        if t < seq:
            acc[0] = 0
            if batch > 0:
                acc[0] = dy[0, t, j]
            for n in range(1, batch):
                acc[0] += dy[n, t, j]
            if accumulate:
                gw[t, j] += acc[0]
            else:
                gw[t, j] = acc[0]
        elif not accumulate:
            gw[t, j] = 0


@functools.cache
def _kernels() -> SimpleNamespace:
    return _cuda.bind(globals(), ["_k_embedding_grad", "_k_positional_grad"])


def _on_device(*arrays) -> bool:
    return all(_cuda.is_device_array(a) and a.flags.c_contiguous for a in arrays)


def _scatter_device(idx, dy, gw, reset: bool) -> None:
    vocab, width = gw.shape
    groups = max(1, min(vocab, SCATTER_THREADS // max(1, width)))
    _cuda.launch(_kernels().k_embedding_grad, groups * width, idx, dy, gw, bool(reset),
                 int(groups))


# ---------------------------------------------------------------- dispatchers
def embedding_backward(idx: np.ndarray, dy: np.ndarray, gw: np.ndarray) -> None:
    """``gw`` (V, E) overwritten with the sum of the rows of ``dy`` (M, E) at ``idx`` (M,).

    Rows are added in index order, as the reference does, so results are bit-identical;
    C-contiguous device arrays run one kernel (the same order); other array types and layouts
    go through ``np.add.at``."""
    if _on_device(idx, dy, gw) and gw.size:
        _scatter_device(idx, dy, gw, True)
        return
    gw.fill(0)
    embedding_accumulate(idx, dy, gw)


def embedding_accumulate(idx: np.ndarray, rows: np.ndarray, acc: np.ndarray) -> None:
    """``acc[idx[i]] += rows[i]`` for every row i, in order (no reset)."""
    if not idx.size:
        return
    if all(type(a) is np.ndarray for a in (idx, rows, acc)) and acc.flags.c_contiguous:
        _scatter_add(np.ascontiguousarray(idx), np.ascontiguousarray(rows), acc)
    elif _on_device(idx, rows, acc):
        _scatter_device(idx, rows, acc, False)
    else:
        np.add.at(acc, idx, rows)


def positional_grad_device(dy: Any, gw: Any, accumulate: bool) -> None:
    """The gradient of a positional table ``gw`` (context, D) from ``dy`` (N, T, D) on
    C-contiguous device arrays: ``gw[:T]`` written (or added into) with the sum of ``dy`` over
    the batch, ``gw[T:]`` zeroed unless ``accumulate``. One launch."""
    _cuda.launch(_kernels().k_positional_grad, gw.size, dy, gw, bool(accumulate))
