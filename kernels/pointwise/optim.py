"""Fused optimizer updates: SGD (momentum, dampening, Nesterov, L2) and Adam / AdamW.

Each update is one pass over flat arrays, in place, with no temporaries: a Numba loop reads
``p``, ``g`` and the state of one element, computes in registers and writes ``p`` and the
state back. The NumPy reference of each (:func:`sgd_update_ref`, :func:`adam_update_ref`) is
the ufunc sequence minidl's optimizers ran before: one ufunc per arithmetic operation, so every
intermediate is rounded to the parameter dtype. The Numba loops perform the same IEEE operations
on the same operands in the same order (``fastmath=False``, so LLVM neither reassociates nor
contracts ``a * b + c`` into a fused multiply-add), and results are bit-identical to the
reference. Both follow PyTorch's single-tensor CPU formulas (``torch.optim.SGD`` / ``Adam`` /
``AdamW`` with ``foreach=False``); PyTorch's own kernels may use fused multiply-adds, so they
agree with torch to float32 rounding, not bitwise.

Hyperparameters are Python floats; :func:`sgd_scalars` / :func:`adam_scalars` turn them into
scalars of the parameter dtype exactly as the reference casts them (e.g. ``f(1 - lr * wd)``
computed in float64 then cast, ``f(1 - f(1 - beta1))`` in the parameter dtype), so that float32
math stays float32.

:func:`sgd_update` and :func:`adam_update` dispatch by array type: C-contiguous NumPy arrays of
one float dtype (float32 or float64) go to the Numba loops, such device arrays to the CUDA
kernels; anything else (non-contiguous views, ndarray subclasses, other dtypes) goes to the
reference, whose temporaries (at most two arrays of the parameter's size per call) are
allocated by the array library of the operands through their ``__array_ufunc__``.

Device arrays (CuPy's, the strict test device's) of one float dtype, C-contiguous, are
updated by one Numba CUDA kernel each (:func:`_k_sgd`, :func:`_k_adam`: the same operations in
the same order as the Numba loops); the trainer hands whole parameter groups laid out back to
back (:class:`minidl.net.optim.FlatGroup`), so one launch updates a group.

Arrays of at least :data:`PARALLEL_MIN_SIZE` elements are split into one contiguous chunk per
thread (:func:`~minidl.kernels.parallel.num_threads`) inside a ``prange``; smaller ones run on
the calling thread. Measured on 2 cores, float32, arrays not in cache: two threads took ~0.55x
the time of one from 64 Ki to 16 Mi elements; below 16 Ki waking the pool costs more than the
work; on arrays streamed from DRAM (VGG-16's 103 M-element fc1 weight) they gain nothing, one
core already saturating memory bandwidth; and when the other core is busy, the static chunk
waiting for it makes the parallel loop up to 2x slower than the serial one.
"""

from __future__ import annotations

import functools
import math
from types import SimpleNamespace
from typing import Any

import numpy as np
from numba import njit, prange

from .. import _cuda
from ..parallel import ensure_blas_policy, num_threads

cuda: Any = None  # numba.cuda, set by _cuda.bind on first CUDA use

#: Arrays with at least this many elements are updated by all Numba threads.
PARALLEL_MIN_SIZE = 1 << 16

_NUMBA_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


# ---------------------------------------------------------------- scalars


def sgd_scalars(dtype: Any, lr: float, momentum: float, dampening: float,
                weight_decay: float) -> tuple[Any, Any, Any, Any]:
    """``(weight_decay, momentum, 1 - dampening, -lr)`` in ``dtype``."""
    f = np.dtype(dtype).type
    return f(weight_decay), f(momentum), f(1 - dampening), f(-lr)


def adam_scalars(dtype: Any, lr: float, beta1: float, beta2: float, eps: float,
                 weight_decay: float, step: int, decoupled: bool) -> tuple[Any, ...]:
    """Scalars of one Adam step in ``dtype``, cast as the reference casts them.

    Returns ``(wd, decay, lerp_low, lerp_w, beta2, one_minus_beta2, bc2_sqrt, eps,
    neg_step_size)``: ``wd`` is the L2 coefficient, ``decay = 1 - lr * wd`` the decoupled
    factor, ``lerp_low`` (a bool) picks the branch of ``torch.lerp`` for the weight
    ``1 - beta1`` and ``lerp_w`` is that weight (or ``1 - weight`` on the high branch).
    """
    f = np.dtype(dtype).type
    w = 1 - beta1
    lerp_low = w < 0.5
    lerp_w = f(w) if lerp_low else f(1 - f(w))
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    step_size = lr / bias_correction1
    decay = f(1 - lr * weight_decay) if decoupled else f(1)
    return (f(weight_decay), decay, bool(lerp_low), lerp_w, f(beta2), f(1 - beta2),
            f(bias_correction2**0.5), f(eps), f(-step_size))


# ---------------------------------------------------------------- Numba loops
# All scalars arrive in the array dtype (never a Python literal in the arithmetic: Numba would
# promote float32 * int64 to float64). The loops run over whole (sliced) arrays from index 0, so
# indices are provably non-negative, and their flags only select between values computed in
# registers (no conditional loads or stores): LLVM then vectorizes them. SGD without momentum
# has its own loop since it has no buffer to load and store.


@njit(cache=True, fastmath=False, error_model="numpy")
def _sgd_plain(p, g, wd, neg_lr, has_wd):
    for i in range(p.size):
        d = g[i]
        x = p[i]
        if has_wd:  # grad + wd * param
            d = d + x * wd
        p[i] = x + d * neg_lr


@njit(cache=True, fastmath=False, error_model="numpy")
def _sgd_momentum(p, g, buf, wd, mom, one_minus_damp, neg_lr, has_wd, damp, nesterov,
                  first_step):
    for i in range(p.size):
        d = g[i]
        x = p[i]
        if has_wd:  # grad + wd * param
            d = d + x * wd
        b = buf[i] * mom  # buf * momentum + (1 - dampening) * d
        b = b + d * one_minus_damp if damp else b + d
        if first_step:
            b = d
        buf[i] = b
        if nesterov:  # d + momentum * buf
            d = d + b * mom
        else:
            d = b
        p[i] = x + d * neg_lr


@njit(cache=True, fastmath=False, error_model="numpy")
def _adam(p, g, m, v, wd, decay, lerp_low, lerp_w, beta2, one_minus_beta2, bc2_sqrt, eps,
          neg_step, has_wd, decoupled):
    for i in range(p.size):
        gi = g[i]
        x = p[i]
        if has_wd:
            if decoupled:  # param * (1 - lr * wd)
                x = x * decay
            else:  # grad + wd * param
                gi = gi + x * wd
        mi = m[i]
        t = gi - mi  # m.lerp_(g, 1 - beta1)
        if lerp_low:
            mi = mi + t * lerp_w
        else:  # end - (end - start) * (1 - weight)
            mi = gi - t * lerp_w
        vi = v[i] * beta2 + gi * one_minus_beta2 * gi  # v * beta2 + (1 - beta2) * g * g
        denom = np.sqrt(vi) / bc2_sqrt + eps
        p[i] = x + mi * neg_step / denom
        m[i] = mi
        v[i] = vi


@njit(cache=True, parallel=True, fastmath=False, error_model="numpy")
def _sgd_plain_parallel(p, g, wd, neg_lr, has_wd, parts):
    n = p.size
    size = (n + parts - 1) // parts
    for c in prange(parts):
        lo, hi = min(n, c * size), min(n, (c + 1) * size)
        _sgd_plain(p[lo:hi], g[lo:hi], wd, neg_lr, has_wd)


@njit(cache=True, parallel=True, fastmath=False, error_model="numpy")
def _sgd_momentum_parallel(p, g, buf, wd, mom, one_minus_damp, neg_lr, has_wd, damp, nesterov,
                           first_step, parts):
    n = p.size
    size = (n + parts - 1) // parts
    for c in prange(parts):
        lo, hi = min(n, c * size), min(n, (c + 1) * size)
        _sgd_momentum(p[lo:hi], g[lo:hi], buf[lo:hi], wd, mom, one_minus_damp, neg_lr, has_wd,
                      damp, nesterov, first_step)


@njit(cache=True, parallel=True, fastmath=False, error_model="numpy")
def _adam_parallel(p, g, m, v, wd, decay, lerp_low, lerp_w, beta2, one_minus_beta2, bc2_sqrt,
                   eps, neg_step, has_wd, decoupled, parts):
    n = p.size
    size = (n + parts - 1) // parts
    for c in prange(parts):
        lo, hi = min(n, c * size), min(n, (c + 1) * size)
        _adam(p[lo:hi], g[lo:hi], m[lo:hi], v[lo:hi], wd, decay, lerp_low, lerp_w, beta2,
              one_minus_beta2, bc2_sqrt, eps, neg_step, has_wd, decoupled)


# ---------------------------------------------------------------- CUDA kernels
# One launch updates a whole flat array (a parameter, or a group of parameters laid out
# back to back with their gradients and state: minidl.net.optim.FlatGroup). The arithmetic is the
# Numba loops' above, operation for operation, so an emulated launch (one host thread) gives
# their bits; on a GPU, NVVM may contract a multiply-add into an FMA (last-bit differences).


def _k_sgd(p, g, buf, wd, mom, one_minus_damp, neg_lr, has_wd, has_mom, damp, nesterov,
           first_step):
    for i in range(cuda.grid(1), p.size, cuda.gridsize(1)):
        d = g[i]
        x = p[i]
        if has_wd:  # grad + wd * param
            d = d + x * wd
        if has_mom:
            b = buf[i] * mom  # buf * momentum + (1 - dampening) * d
            b = b + d * one_minus_damp if damp else b + d
            if first_step:
                b = d
            buf[i] = b
            d = d + b * mom if nesterov else b
        p[i] = x + d * neg_lr


def _k_adam(p, g, m, v, wd, decay, lerp_low, lerp_w, beta2, one_minus_beta2, bc2_sqrt, eps,
            neg_step, has_wd, decoupled):
    for i in range(cuda.grid(1), p.size, cuda.gridsize(1)):
        gi = g[i]
        x = p[i]
        if has_wd:
            if decoupled:  # param * (1 - lr * wd)
                x = x * decay
            else:  # grad + wd * param
                gi = gi + x * wd
        mi = m[i]
        t = gi - mi  # m.lerp_(g, 1 - beta1)
        mi = mi + t * lerp_w if lerp_low else gi - t * lerp_w
        vi = v[i] * beta2 + gi * one_minus_beta2 * gi
        denom = math.sqrt(vi) / bc2_sqrt + eps
        p[i] = x + mi * neg_step / denom
        m[i] = mi
        v[i] = vi


@functools.cache
def _kernels() -> SimpleNamespace:
    return _cuda.bind(globals(), ["_k_sgd", "_k_adam"])


def _on_device(p: Any, *others: Any) -> bool:
    """True when the CUDA kernels apply: device arrays, C-contiguous, one float dtype, one
    shape (anything else on a device goes to the NumPy reference)."""
    if not _cuda.is_device_array(p) or np.dtype(p.dtype) not in _NUMBA_DTYPES \
            or not p.flags.c_contiguous:
        return False
    return all(_cuda.is_device_array(a) and a.dtype == p.dtype and a.flags.c_contiguous
               and a.shape == p.shape for a in others)


# ---------------------------------------------------------------- NumPy references
# One ufunc per operation, as minidl's optimizers ran them before the fused kernels. A ufunc
# called without ``out`` allocates its result through the operands' array library (NumPy,
# CuPy, ...); at most two such temporaries of the parameter's size live at once.


def _ufunc(ufunc, a, b, out=None):
    return ufunc(a, b) if out is None else ufunc(a, b, out=out)


def sgd_update_ref(p, g, buf, lr: float, momentum: float, dampening: float,
                   weight_decay: float, nesterov: bool, first_step: bool) -> None:
    """Reference of :func:`sgd_update` (ufuncs, at most two temporaries)."""
    if p.ndim == 0:  # ufuncs return scalars for 0-d operands: work on 1-element views
        p, g, buf = (None if a is None else a.reshape(1) for a in (p, g, buf))
    wd, mom, one_minus_damp, neg_lr = sgd_scalars(p.dtype, lr, momentum, dampening,
                                                  weight_decay)
    d, s0 = g, None
    if weight_decay != 0:  # grad + wd * param
        s0 = np.multiply(p, wd)
        d = np.add(g, s0, out=s0)
    if momentum != 0:
        if first_step:
            buf[...] = d
        else:  # buf * momentum + (1 - dampening) * d
            np.multiply(buf, mom, out=buf)
            if dampening == 0:
                np.add(buf, d, out=buf)
            else:  # d may be s0: it is not needed afterwards (no Nesterov with dampening)
                s0 = _ufunc(np.multiply, d, one_minus_damp, s0)
                np.add(buf, s0, out=buf)
        if nesterov:  # d + momentum * buf
            s1 = np.multiply(buf, mom)
            d = np.add(d, s1, out=s1)
        else:
            d = buf
    out = d if d is not g and d is not buf else s0
    np.add(p, _ufunc(np.multiply, d, neg_lr, out), out=p)


def adam_update_ref(p, g, exp_avg, exp_avg_sq, lr: float, beta1: float, beta2: float,
                    eps: float, weight_decay: float, step: int, decoupled: bool) -> None:
    """Reference of :func:`adam_update` (ufuncs, two temporaries)."""
    if p.ndim == 0:  # ufuncs return scalars for 0-d operands: work on 1-element views
        p, g, exp_avg, exp_avg_sq = (a.reshape(1) for a in (p, g, exp_avg, exp_avg_sq))
    wd, decay, lerp_low, lerp_w, b2, one_minus_b2, bc2_sqrt, eps_, neg_step = adam_scalars(
        p.dtype, lr, beta1, beta2, eps, weight_decay, step, decoupled)
    m, v = exp_avg, exp_avg_sq
    s0 = None
    if weight_decay != 0:
        if decoupled:  # param * (1 - lr * wd)
            np.multiply(p, decay, out=p)
        else:  # grad + wd * param
            s0 = np.multiply(p, wd)
            g = np.add(g, s0, out=s0)
    t = np.subtract(g, m)  # m.lerp_(g, 1 - beta1)
    np.multiply(t, lerp_w, out=t)
    if lerp_low:
        np.add(m, t, out=m)
    else:  # end - (end - start) * (1 - weight)
        np.subtract(g, t, out=m)
    # v = v * beta2 + (1 - beta2) * g * g
    np.multiply(g, one_minus_b2, out=t)
    np.multiply(t, g, out=t)
    np.multiply(v, b2, out=v)
    np.add(v, t, out=v)
    # param += (-step_size * m) / (sqrt(v) / sqrt(bias_correction2) + eps)
    denom = np.sqrt(v) if s0 is None else np.sqrt(v, out=s0)
    np.divide(denom, bc2_sqrt, out=denom)
    np.add(denom, eps_, out=denom)
    num = np.multiply(m, neg_step, out=t)
    np.divide(num, denom, out=num)
    np.add(p, num, out=p)


# ---------------------------------------------------------------- dispatchers


def _fusable(p, *others) -> bool:
    """True when the Numba loops apply: C-contiguous NumPy arrays, one float32/float64 dtype,
    one shape."""
    if type(p) is not np.ndarray or p.dtype not in _NUMBA_DTYPES or not p.flags.c_contiguous:
        return False
    return all(type(a) is np.ndarray and a.dtype == p.dtype and a.flags.c_contiguous
               and a.shape == p.shape for a in others)


def _parts(n: int) -> int:
    """Chunks to split ``n`` elements into: :func:`num_threads` from ``PARALLEL_MIN_SIZE`` on."""
    if n < PARALLEL_MIN_SIZE:
        return 1
    parts = num_threads()
    if parts > 1:
        ensure_blas_policy()  # the project's thread policy: Numba's pool, single-threaded BLAS
    return parts


def sgd_update(p, g, buf, lr: float, momentum: float = 0.0, dampening: float = 0.0,
               weight_decay: float = 0.0, nesterov: bool = False,
               first_step: bool = False) -> None:
    """One ``torch.optim.SGD`` step of one parameter, in place.

    ``d = g + weight_decay * p``; with ``momentum``: ``buf = d`` on the first step, else
    ``buf = momentum * buf + (1 - dampening) * d``, then ``d = d + momentum * buf`` (Nesterov)
    or ``d = buf``; finally ``p += -lr * d``. ``buf`` may be None when ``momentum == 0``.
    """
    has_mom = momentum != 0
    wd, mom, one_minus_damp, neg_lr = sgd_scalars(p.dtype, lr, momentum, dampening, weight_decay)
    if _on_device(p, g, *((buf,) if has_mom else ())):
        pf = _cuda.flat(p)
        _cuda.launch(_kernels().k_sgd, pf.size, pf, _cuda.flat(g),
                     _cuda.flat(buf) if has_mom else pf, wd, mom, one_minus_damp, neg_lr,
                     weight_decay != 0, has_mom, dampening != 0, bool(nesterov),
                     bool(first_step))
        return
    if not _fusable(p, g, *((buf,) if has_mom else ())):
        sgd_update_ref(p, g, buf, lr, momentum, dampening, weight_decay, nesterov, first_step)
        return
    pf, gf = p.reshape(-1), g.reshape(-1)
    parts = _parts(pf.size)
    if not has_mom:
        if parts > 1:
            _sgd_plain_parallel(pf, gf, wd, neg_lr, weight_decay != 0, parts)
        else:
            _sgd_plain(pf, gf, wd, neg_lr, weight_decay != 0)
        return
    args = (pf, gf, buf.reshape(-1), wd, mom, one_minus_damp, neg_lr, weight_decay != 0,
            dampening != 0, bool(nesterov), bool(first_step))
    if parts > 1:
        _sgd_momentum_parallel(*args, parts)
    else:
        _sgd_momentum(*args)


def adam_update(p, g, exp_avg, exp_avg_sq, lr: float, beta1: float = 0.9, beta2: float = 0.999,
                eps: float = 1e-8, weight_decay: float = 0.0, step: int = 1,
                decoupled: bool = False) -> None:
    """One ``torch.optim.Adam`` (``decoupled=False``, L2 added to the gradient) or ``AdamW``
    (``decoupled=True``: ``p *= 1 - lr * weight_decay`` first) step of one parameter, in place.

    ``step`` is the parameter's step count after this step (1 on the first), used for the bias
    corrections.
    """
    if _on_device(p, g, exp_avg, exp_avg_sq):
        pf = _cuda.flat(p)
        _cuda.launch(_kernels().k_adam, pf.size, pf, _cuda.flat(g), _cuda.flat(exp_avg),
                     _cuda.flat(exp_avg_sq),
                     *adam_scalars(p.dtype, lr, beta1, beta2, eps, weight_decay, step, decoupled),
                     weight_decay != 0, bool(decoupled))
        return
    if not _fusable(p, g, exp_avg, exp_avg_sq):
        adam_update_ref(p, g, exp_avg, exp_avg_sq, lr, beta1, beta2, eps, weight_decay, step,
                        decoupled)
        return
    pf = p.reshape(-1)
    args = (pf, g.reshape(-1), exp_avg.reshape(-1), exp_avg_sq.reshape(-1),
            *adam_scalars(p.dtype, lr, beta1, beta2, eps, weight_decay, step, decoupled),
            weight_decay != 0, bool(decoupled))
    parts = _parts(pf.size)
    if parts > 1:
        _adam_parallel(*args, parts)
    else:
        _adam(*args)
