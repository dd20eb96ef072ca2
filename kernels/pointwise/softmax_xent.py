"""Softmax cross-entropy on device arrays: Numba CUDA kernels over logits (M, K) and integer
targets (M,), which :class:`minidl.layers.SoftmaxCrossEntropy` runs with ``device_kernels``.

Each row of logits is one thread block (a grid-stride loop over the rows): the block finds
the row's largest logit, then adds ``exp(x - max)`` (in the logits' dtype) into float64
partial sums that it adds in shared memory in a fixed tree order (deterministic for a launch
shape).

* Forward (:func:`forward_device`): one kernel writes each row's negative log-likelihood in
  float64, ``lse - x[target]`` with ``lse = log(sum(exp(x - max))) + max`` (label smoothing
  ``eps``: ``(1 - eps) * nll + eps * (lse - mean(x))``) into a per-row vector; a second, one
  block, writes their mean (a float64 sum) into the 0-d loss. No host synchronisation.
* Backward (:func:`backward_device`): one kernel writes ``d = softmax(x) * scale`` minus
  ``scale * eps / K`` and, at the target, minus ``scale * (1 - eps)``, where ``scale`` (the
  upstream gradient over M) is read on the device. ``d`` may be ``x``.

Targets are checked on the host before their upload (the layer's ``check_feed``); on the
device a target out of range makes its row's loss NaN and leaves the target term out of the
row's gradient (nothing is read out of bounds). The host path (NumPy, float32 sums) and these
kernels agree to rounding, not bit for bit.
"""

from __future__ import annotations

import functools
import math
from types import SimpleNamespace
from typing import Any

import numpy as np

from .. import _cuda

cuda: Any = None  # numba.cuda, set by _cuda.bind on first CUDA use

#: Threads of a block at most (the length of its shared arrays).
BLOCK = _cuda.BLOCK
#: Blocks of a launch at most (grid-stride loops cover the rest).
MAX_BLOCKS = _cuda.MAX_BLOCKS

_block_sum_py = _cuda.block_sum_py  # the block reduction, bound as a device function


def _row_argmax_py(x, r, best):
    """Column of a largest ``x[r, :]`` (of a NaN if the row has one), returned to every thread
    of the block (they all call it; ``best``: int64 shared scratch). Threads synchronise before
    writing ``best`` again."""
    tid = cuda.threadIdx.x
    i = -1
    for j in range(tid, x.shape[1], cuda.blockDim.x):
        if i < 0:
            i = j
        else:
            v, w = x[r, j], x[r, i]
            if v > w or (v != v and w == w):
                i = j
    best[tid] = i
    width = cuda.blockDim.x
    cuda.syncthreads()
    while width > 1:
        half = (width + 1) // 2
        if tid < width - half:
            a, b = best[tid], best[tid + half]
            if a < 0:
                best[tid] = b
            elif b >= 0:
                v, w = x[r, b], x[r, a]
                if v > w or (v != v and w == w):
                    best[tid] = b
        cuda.syncthreads()
        width = half
    return best[0]


_d_block_sum: Any = None  # CUDA device versions, set on first CUDA use (_kernels: bind's device=)
_d_row_argmax: Any = None


def _k_xent_rows(x, t, smoothing, eps, nll):
    """``nll[r]`` (float64) of each row ``r`` of the logits ``x`` (M, K) against the target
    class ``t[r]``, with label smoothing ``eps`` when ``smoothing``: one block per row."""
    best = cuda.shared.array(BLOCK, dtype=np.int64)
    part = cuda.shared.array(BLOCK, dtype=np.float64)
    k = x.shape[1]
    tid = cuda.threadIdx.x
    for r in range(cuda.blockIdx.x, x.shape[0], cuda.gridDim.x):
        mx = x[r, _d_row_argmax(x, r, best)]
        sum_exp = 0.0
        sum_x = 0.0
        for j in range(tid, k, cuda.blockDim.x):
            v = x[r, j]
            sum_exp += math.exp(v - mx)
            sum_x += np.float64(v)
        part[tid] = sum_exp
        sum_exp = _d_block_sum(part)
        cuda.syncthreads()
        if smoothing:
            part[tid] = sum_x
            sum_x = _d_block_sum(part)
            cuda.syncthreads()
        if tid == 0:
            lse = math.log(sum_exp) + mx
            c = t[r]
            loss = lse - x[r, c] if c >= 0 and c < k else math.nan
            if smoothing:
                loss = (1.0 - eps) * loss + eps * (lse - sum_x / k)
            nll[r] = loss


def _k_xent_mean(nll, out):
    """One block: ``out[0]`` = the mean of ``nll`` (a float64 sum; NaN without rows)."""
    part = cuda.shared.array(BLOCK, dtype=np.float64)
    tid = cuda.threadIdx.x
    acc = 0.0
    for i in range(tid, nll.size, cuda.blockDim.x):
        acc += nll[i]
    part[tid] = acc
    total = _d_block_sum(part)
    if tid == 0:
        out[0] = total / nll.size if nll.size > 0 else math.nan


def _k_xent_backward(x, t, g, inv_rows, smoothing, eps, d):
    """``d`` (M, K) = the gradient of the mean loss over the logits ``x``, times the upstream
    gradient ``g[0]``: one block per row (``d`` may be ``x``)."""
    best = cuda.shared.array(BLOCK, dtype=np.int64)
    part = cuda.shared.array(BLOCK, dtype=np.float64)
    k = x.shape[1]
    tid = cuda.threadIdx.x
    scale = g[0] * inv_rows
    off = scale * (eps / k) if smoothing else 0.0
    hit = scale * (1.0 - eps)
    for r in range(cuda.blockIdx.x, x.shape[0], cuda.gridDim.x):
        mx = x[r, _d_row_argmax(x, r, best)]
        acc = 0.0
        for j in range(tid, k, cuda.blockDim.x):
            acc += math.exp(x[r, j] - mx)
        part[tid] = acc
        factor = scale / _d_block_sum(part)
        cuda.syncthreads()
        c = t[r]
        for j in range(tid, k, cuda.blockDim.x):  # each element read, then written
            v = math.exp(x[r, j] - mx) * factor - off
            if j == c:
                v -= hit
            d[r, j] = v


@functools.cache
def _kernels() -> SimpleNamespace:
    return _cuda.bind(globals(), ["_k_xent_rows", "_k_xent_mean", "_k_xent_backward"],
                      device={"_d_block_sum": "_block_sum_py", "_d_row_argmax": "_row_argmax_py"})


def nll_rows_device(x: Any, t: Any, label_smoothing: float, nll: Any) -> None:
    """Each row's negative log-likelihood of the logits ``x`` (M, K) against the integer
    targets ``t`` (M,) into ``nll``, a float64 vector of M: one kernel."""
    eps = float(label_smoothing)
    _cuda.launch_blocks(_kernels().k_xent_rows, x.shape[0], x.shape[1], x, t, eps != 0.0, eps,
                        nll)


def mean_device(nll: Any, out: Any) -> None:
    """The mean of the float64 rows' losses ``nll`` into the 0-d (or one-element) ``out``."""
    _cuda.run(_kernels().k_xent_mean, 1, _cuda.block_threads(nll.size), nll, out.reshape(-1))


def forward_device(x: Any, t: Any, label_smoothing: float, nll: Any, out: Any) -> None:
    """The mean softmax cross-entropy of the logits ``x`` (M, K) against the integer targets
    ``t`` (M,) into the 0-d (or one-element) ``out``, through ``nll``, a float64 vector of M
    (each row's loss): two kernels, no host synchronisation."""
    nll_rows_device(x, t, label_smoothing, nll)
    mean_device(nll, out)


def backward_device(x: Any, t: Any, grad: Any, label_smoothing: float, d: Any,
                    rows: int | None = None) -> None:
    """``d`` (M, K) = d(loss)/d(logits) times the 0-d upstream gradient ``grad`` (read on the
    device): one kernel; ``d`` may be ``x``. ``rows``: the loss's rows when ``x`` is a block
    of them (the mean's divisor; default M)."""
    m = x.shape[0]
    if m == 0:
        return
    eps = float(label_smoothing)
    _cuda.launch_blocks(_kernels().k_xent_backward, m, x.shape[1], x, t, grad.reshape(-1),
                        1.0 / (rows or m), eps != 0.0, eps, d)
