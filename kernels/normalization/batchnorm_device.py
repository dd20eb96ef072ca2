"""Batch-normalisation CUDA kernels (device arrays) on (N, C, S) views, and the layer's
per-channel bookkeeping on the device: the device half of :mod:`.batchnorm` (whose
dispatchers send device arrays here; its NumPy reference and Numba CPU loops stay there).

A forward is at most three launches (statistics, :func:`finalize_device`, apply) and a
backward three (sums, :func:`backward_finalize_device`, apply), with no host
synchronisation and no array of their own. The device adds per-thread partial sums in a
tree, another order than the CPU's: results agree to rounding, not bit for bit.
"""

from __future__ import annotations

import functools
import math
from types import SimpleNamespace
from typing import Any

import numpy as np

from .. import _cuda

cuda: Any = None  # numba.cuda, set by _cuda.bind on first CUDA use


# ---------------------------------------------------------------- CUDA kernels (device arrays)
# Each reduction runs one thread block per channel (a grid-stride loop over the channels):
# every thread adds its share of the channel's N*S elements into float64 partial sums, which
# the block adds in shared memory in a fixed tree order (deterministic for a launch shape).
# The per-channel bookkeeping (the float64 statistics into the stash, the running statistics,
# the batch counter, scale and shift; backward's parameter gradients and the coefficients of
# dx) is one small kernel, so forward and backward make at most three launches each, read no
# value on the host and create no array.

#: Threads of a reduction block at most (the length of its shared arrays).
BLOCK = _cuda.BLOCK
#: Blocks of a launch at most (grid-stride loops cover the rest).
MAX_BLOCKS = _cuda.MAX_BLOCKS

_block_sum_py = _cuda.block_sum_py  # the block reduction, bound as a device function


def _nsc_index_py(e, c, s):
    """Indices ``(i, ch, j)`` of the flat (C-order) element ``e`` of an (N, C, S) array."""
    i = e // (c * s)
    r = e - i * c * s
    ch = r // s
    return i, ch, r - ch * s


_d_block_sum: Any = None  # CUDA device versions of the two above (_kernels: bind's device=)
_d_nsc_index: Any = None


def _k_bn_stats(x, mean, var):
    """Per-channel mean and biased variance of x (N, C, S) into float64 (C,): one block per
    channel, two passes (the variance sums squared deviations from the mean)."""
    part = cuda.shared.array(BLOCK, dtype=np.float64)
    s = x.shape[2]
    count = x.shape[0] * s
    tid = cuda.threadIdx.x
    for ch in range(cuda.blockIdx.x, x.shape[1], cuda.gridDim.x):
        acc = 0.0
        for e in range(tid, count, cuda.blockDim.x):
            acc += np.float64(x[e // s, ch, e % s])
        part[tid] = acc
        total = _d_block_sum(part)
        mu = total / count if count > 0 else math.nan
        cuda.syncthreads()
        acc = 0.0
        for e in range(tid, count, cuda.blockDim.x):
            d = np.float64(x[e // s, ch, e % s]) - mu
            acc += d * d
        part[tid] = acc
        total = _d_block_sum(part)
        if tid == 0:
            mean[ch] = mu
            var[ch] = total / count if count > 0 else math.nan
        cuda.syncthreads()


def _k_bn_finalize(mean64, var64, eps, weight, bias, affine, mean, invstd, scale, shift,
                   running_mean, running_var, tracked, update, momentum, cumulative, unbias):
    """One block, per channel: ``mean`` and ``invstd = 1 / sqrt(var + eps)`` (the stash, in the
    compute dtype) and ``scale`` / ``shift`` of the apply from the statistics ``mean64`` /
    ``var64``; with ``update`` the running statistics (``cumulative``: weight
    ``1 / (tracked + 1)``, else ``momentum``; the variance times ``unbias``) and, once every
    thread has read it, ``tracked += 1``."""
    batches = tracked[0] + 1
    for ch in range(cuda.threadIdx.x, mean.size, cuda.blockDim.x):
        m = mean64[ch]
        v = var64[ch]
        mean[ch] = m
        root = math.sqrt(v + eps)
        invstd[ch] = 1.0 / root if root != 0.0 else math.inf  # (not raised when emulated)
        if affine:
            scale[ch] = weight[ch] * invstd[ch]  # in the compute dtype, as the host's
            shift[ch] = bias[ch]
        else:
            scale[ch] = invstd[ch]
            shift[ch] = 0.0
        if update:
            mom = 1.0 / batches if cumulative else momentum
            running_mean[ch] = (1.0 - mom) * running_mean[ch] + mom * m
            running_var[ch] = (1.0 - mom) * running_var[ch] + mom * v * unbias
    cuda.syncthreads()
    if update and cuda.threadIdx.x == 0:
        tracked[0] = batches


def _k_bn_apply(x, mean, scale, shift, y):
    """``y = (x - mean) * scale + shift`` per channel of (N, C, S) arrays (``y`` may be ``x``)."""
    c, s = x.shape[1], x.shape[2]
    for e in range(cuda.grid(1), x.size, cuda.gridsize(1)):
        i, ch, j = _d_nsc_index(e, c, s)
        y[i, ch, j] = (x[i, ch, j] - mean[ch]) * scale[ch] + shift[ch]


def _k_bn_reduce(dy, x, mean, sum_dy, sum_dy_xmu):
    """Per-channel float64 ``sum(dy)`` and ``sum(dy * (x - mean))``: one block per channel."""
    part_dy = cuda.shared.array(BLOCK, dtype=np.float64)
    part_xmu = cuda.shared.array(BLOCK, dtype=np.float64)
    s = x.shape[2]
    count = x.shape[0] * s
    tid = cuda.threadIdx.x
    for ch in range(cuda.blockIdx.x, x.shape[1], cuda.gridDim.x):
        m = mean[ch]
        a = 0.0
        b = 0.0
        for e in range(tid, count, cuda.blockDim.x):
            i = e // s
            j = e - i * s
            g = np.float64(dy[i, ch, j])
            a += g
            b += g * (x[i, ch, j] - m)
        part_dy[tid] = a
        part_xmu[tid] = b
        a = _d_block_sum(part_dy)
        b = _d_block_sum(part_xmu)
        if tid == 0:
            sum_dy[ch] = a
            sum_dy_xmu[ch] = b
        cuda.syncthreads()


def _k_bn_backward_finalize(sum_dy, sum_dy_xmu, norm_dy, norm_dy_xmu, count, invstd, weight,
                            affine, grad_weight, weight_mode, grad_bias, bias_mode,
                            batch_stats, k, shift, coef):
    """Per channel: the parameter gradients from this batch's sums (``*_mode``: 0 none,
    1 written, 2 added), and the coefficients of :func:`_k_bn_backward_apply` (``k``, and
    with ``batch_stats`` ``shift`` / ``coef`` from the normalising sums ``norm_*`` over
    ``count`` rows, else zeros), in the compute dtype."""
    for ch in range(cuda.grid(1), invstd.size, cuda.gridsize(1)):
        inv = np.float64(invstd[ch])
        dgamma = sum_dy_xmu[ch] * inv
        if weight_mode == 1:
            grad_weight[ch] = dgamma
        elif weight_mode == 2:
            grad_weight[ch] = grad_weight[ch] + dgamma
        if bias_mode == 1:
            grad_bias[ch] = sum_dy[ch]
        elif bias_mode == 2:
            grad_bias[ch] = grad_bias[ch] + sum_dy[ch]
        k[ch] = np.float64(weight[ch]) * inv if affine else inv
        if batch_stats:
            shift[ch] = norm_dy[ch] / count
            coef[ch] = inv * (norm_dy_xmu[ch] * inv) / count
        else:
            shift[ch] = 0.0
            coef[ch] = 0.0


def _k_bn_backward_apply(dy, x, mean, k, shift, coef, dx):
    """``dx = k * (dy - shift - (x - mean) * coef)`` per channel (``dx`` may be ``dy``)."""
    c, s = x.shape[1], x.shape[2]
    for e in range(cuda.grid(1), x.size, cuda.gridsize(1)):
        i, ch, j = _d_nsc_index(e, c, s)
        dx[i, ch, j] = k[ch] * (dy[i, ch, j] - shift[ch] - (x[i, ch, j] - mean[ch]) * coef[ch])


@functools.cache
def _kernels() -> SimpleNamespace:
    return _cuda.bind(globals(), ["_k_bn_stats", "_k_bn_finalize", "_k_bn_apply", "_k_bn_reduce",
                                  "_k_bn_backward_finalize", "_k_bn_backward_apply"],
                      device={"_d_block_sum": "_block_sum_py", "_d_nsc_index": "_nsc_index_py"})


# ---------------------------------------------------------------- device versions
def stats_device(x, mean, var) -> None:
    """:func:`~.batchnorm.stats` on device arrays: one kernel (float64 sums, two passes)."""
    _cuda.launch_blocks(_kernels().k_bn_stats, x.shape[1], x.shape[0] * x.shape[2], x, mean,
                        var)


def apply_device(x, mean, scale, shift, out) -> None:
    """:func:`~.batchnorm.apply` on device arrays: one kernel."""
    _cuda.launch(_kernels().k_bn_apply, x.size, x, mean, scale, shift, out)


def reduce_device(dy, x, mean, sum_dy, sum_dy_xmu) -> None:
    """:func:`~.batchnorm.reduce` on device arrays: one kernel (float64 sums)."""
    _cuda.launch_blocks(_kernels().k_bn_reduce, x.shape[1], x.shape[0] * x.shape[2], dy, x,
                        mean, sum_dy, sum_dy_xmu)


def backward_apply_device(dy, x, mean, k, shift, coef, out) -> None:
    """:func:`~.batchnorm.backward_apply` on device arrays: one kernel; ``out`` may be ``dy``."""
    _cuda.launch(_kernels().k_bn_backward_apply, x.size, dy, x, mean, k, shift, coef, out)


def finalize_device(mean64, var64, eps: float, mean, invstd, scale, shift, weight=None,
                    bias=None, running_mean=None, running_var=None, tracked=None,
                    momentum: float | None = 0.1, unbias: float = 1.0,
                    update: bool = False) -> None:
    """The per-channel bookkeeping of a forward on device arrays, one kernel (one block).

    From the statistics ``mean64`` / ``var64`` (C,) (the batch's, float64; or the running
    ones): ``mean`` and ``invstd = 1 / sqrt(var + eps)`` (the stash) and the apply's ``scale``
    (``weight * invstd``, or ``invstd`` without ``weight``) and ``shift`` (``bias``, or 0), in
    the compute dtype. With ``update``, the running statistics as PyTorch
    (``(1 - w) * running + w * batch``, the variance times ``unbias = count / (count - 1)``,
    ``w = momentum``, or ``1 / num_batches_tracked`` for ``momentum=None``) and ``tracked``
    (the int64 counter, one element) plus one: all on the device, nothing read on the host.
    """
    if update and (running_mean is None or running_var is None or tracked is None):
        raise ValueError("updating the running statistics needs running_mean, running_var "
                         "and tracked")
    if mean.size == 0:
        return
    affine = weight is not None
    if not update:  # read (tracked[0]) or typed, never written: stand-ins
        running_mean = running_var = invstd
        tracked = mean64 if tracked is None else tracked
    _cuda.run(_kernels().k_bn_finalize, 1, _cuda.block_threads(mean.size), mean64, var64,
              float(eps), weight if affine else invstd, bias if affine else invstd, affine, mean,
              invstd, scale, shift, running_mean, running_var, tracked.reshape(-1), bool(update),
              0.0 if momentum is None else float(momentum), momentum is None, float(unbias))


def backward_finalize_device(sum_dy, sum_dy_xmu, invstd, k, shift, coef, weight=None,
                             grad_weight=None, grad_bias=None, accumulate: tuple = (),
                             norm_dy=None, norm_dy_xmu=None, count: float = 0.0,
                             batch_stats: bool = True) -> None:
    """The per-channel bookkeeping of a backward on device arrays, one kernel.

    From this batch's float64 sums (:func:`~.batchnorm.reduce`) and the stashed ``invstd``:
    the gradients ``grad_weight = sum_dy_xmu * invstd`` and ``grad_bias = sum_dy`` where given
    (added into when their name, ``"weight"`` / ``"bias"``, is in ``accumulate``), and the
    coefficients of :func:`~.batchnorm.backward_apply` in the compute dtype:
    ``k = weight * invstd`` (or ``invstd``), and
    with ``batch_stats`` ``shift = norm_dy / count``, ``coef = invstd**2 * norm_dy_xmu / count``
    (``norm_*``: the sums the statistics were normalised over, by default this batch's; a
    data-parallel sync-BN passes the global batch's), else zeros (running statistics are
    constants).
    """
    if invstd.size == 0:
        return
    norm_dy = sum_dy if norm_dy is None else norm_dy
    norm_dy_xmu = sum_dy_xmu if norm_dy_xmu is None else norm_dy_xmu

    def mode(grad, name: str) -> int:
        return 0 if grad is None else 2 if name in accumulate else 1

    _cuda.launch(_kernels().k_bn_backward_finalize, invstd.size, sum_dy, sum_dy_xmu, norm_dy,
                 norm_dy_xmu, float(count), invstd, k if weight is None else weight,
                 weight is not None, k if grad_weight is None else grad_weight,
                 mode(grad_weight, "weight"), k if grad_bias is None else grad_bias,
                 mode(grad_bias, "bias"), bool(batch_stats), k, shift, coef)
