"""Dropout masks from a counter-based hash of (seed, element index): the same bits for a seed on
any device and in any chunking, with no generator state to carry.

``keep[i] = mix(mix(i ^ k0) ^ k1) >= threshold(p)`` on 32-bit words, ``mix`` being Wellons'
``lowbias32`` integer hash and ``(k0, k1)`` a splitmix64 digest of the seed; ``threshold =
ceil(p * 2**32)``, so an element is kept with probability ``1 - p`` (to within 2**-32).
Output ``y = (x * keep) * (1 / (1 - p))`` in x's dtype.

A Numba loop does C-contiguous NumPy arrays in one pass, and a Numba CUDA kernel the same on
C-contiguous float device arrays (one launch each way: :func:`dropout_forward`,
:func:`dropout_backward_device`; no workspace, no temporary); the reference runs the same
integer arithmetic as ufuncs with ``out=`` on two uint32 buffers of a workspace (the arrays'
own library), so all give identical masks and outputs.
"""

from __future__ import annotations

import functools
import math
from types import SimpleNamespace
from typing import Any

import numpy as np
from numba import njit

from .. import _cuda

cuda: Any = None  # numba.cuda, set by _cuda.bind on first CUDA use

#: Elements per chunk of the reference (its workspace is 8 bytes per element of a chunk).
CHUNK = 1 << 16

_M32 = 0xFFFFFFFF
_M64 = (1 << 64) - 1
_C1, _C2 = 0x7FEB352D, 0x846CA68B  # lowbias32's multipliers


def workspace_bytes(size: int) -> int:
    """Workspace of :func:`dropout_forward` for ``size`` elements."""
    return min(size, CHUNK) * 8


def seed_keys(seed: int) -> tuple[int, int]:
    """The two 32-bit keys of ``seed`` (splitmix64's finaliser of the seed)."""
    z = (int(seed) + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    z ^= z >> 31
    return z & _M32, z >> 32


def keep_threshold(p: float) -> int:
    """Hashes at or above this are kept: ``ceil(p * 2**32)`` (0 < p < 1)."""
    return min(math.ceil(p * 2.0**32), _M32)


# ---------------------------------------------------------------- Numba CPU loop
_U16, _U15 = np.uint64(16), np.uint64(15)
_UC1, _UC2, _UM32 = np.uint64(_C1), np.uint64(_C2), np.uint64(_M32)


@njit(cache=True, nogil=True, error_model="numpy")
def _mix(h):
    """lowbias32 of ``h`` (< 2**32) held in a uint64."""
    h ^= h >> _U16
    h = (h * _UC1) & _UM32
    h ^= h >> _U15
    h = (h * _UC2) & _UM32
    h ^= h >> _U16
    return h


@njit(cache=True, nogil=True, error_model="numpy")
def _dropout_nb(x, y, mask, k0, k1, thresh, one, zero, scale):
    for i in range(x.size):
        h = _mix(_mix(np.uint64(i) ^ k0) ^ k1)
        keep = h >= thresh
        mask[i] = keep
        y[i] = (x[i] * (one if keep else zero)) * scale


# ---------------------------------------------------------------- CUDA kernels
_mix_py = _mix.py_func  # the hash as a device function (bind's device=)
_d_mix: Any = None


def _k_dropout_fwd(x, y, mask, k0, k1, thresh, one, zero, scale):
    """:func:`_dropout_nb`'s arithmetic, one thread per element (``y`` may be ``x``)."""
    for i in range(cuda.grid(1), x.size, cuda.gridsize(1)):
        h = _d_mix(_d_mix(np.uint64(i) ^ k0) ^ k1)
        keep = h >= thresh
        mask[i] = 1 if keep else 0
        y[i] = (x[i] * (one if keep else zero)) * scale


def _k_dropout_bwd(dy, mask, dx, one, zero, scale):
    """``dx = (dy * mask) * scale`` (``dx`` may be ``dy``)."""
    for i in range(cuda.grid(1), dx.size, cuda.gridsize(1)):
        dx[i] = (dy[i] * (one if mask[i] != 0 else zero)) * scale


@functools.cache
def _kernels() -> SimpleNamespace:
    return _cuda.bind(globals(), ["_k_dropout_fwd", "_k_dropout_bwd"],
                      device={"_d_mix": "_mix_py"})


def _on_device(x, *others) -> bool:
    return _cuda.is_device_array(x) and x.dtype in (np.float32, np.float64) and all(
        _cuda.is_device_array(a) and a.flags.c_contiguous for a in (x, *others))


def dropout_backward_device(dy, mask, dx, p: float) -> None:
    """``dx = dy * mask / (1 - p)`` on C-contiguous device arrays (0 < p < 1): one launch,
    the host's arithmetic (``(dy * mask) * scale`` in dy's dtype)."""
    dt = dy.dtype.type
    _cuda.launch(_kernels().k_dropout_bwd, dx.size, _cuda.flat(dy), _cuda.flat(mask),
                 _cuda.flat(dx), dt(1), dt(0), dt(1.0 / (1.0 - p)))


# ---------------------------------------------------------------- reference (any array library)
def _ramp(a, start: int) -> None:
    """``a[i] = start + i`` (uint32) by doubling, in place: log2(size) ufunc calls."""
    a[:1].fill(start)
    k = 1
    while k < a.size:
        j = min(k, a.size - k)
        np.add(a[:j], np.uint32(k), out=a[k:k + j])
        k *= 2


def _mix_ref(h, t) -> None:
    """lowbias32 of the uint32 array ``h`` in place (``t``: scratch of h's size)."""
    for shift, mult in ((16, _C1), (15, _C2), (16, None)):
        np.right_shift(h, np.uint32(shift), out=t)
        np.bitwise_xor(h, t, out=h)
        if mult is not None:
            np.multiply(h, np.uint32(mult), out=h)


def dropout_forward_ref(x, p: float, seed: int, y, mask, workspace) -> None:
    """Reference of :func:`dropout_forward`: ufuncs in chunks of :data:`CHUNK` through the
    uint32 buffers of ``workspace`` (at least :func:`workspace_bytes`)."""
    xf, yf, mf = x.reshape(-1), y.reshape(-1), mask.reshape(-1)
    n = xf.size
    if not n:
        return
    k0, k1 = seed_keys(seed)
    thresh = np.uint32(keep_threshold(p))
    scale = x.dtype.type(1.0 / (1.0 - p))
    chunk = min(n, CHUNK)
    words = workspace[:chunk * 8].view(np.uint32)
    h_buf, t_buf = words[:chunk], words[chunk:]
    for lo in range(0, n, chunk):
        hi = min(lo + chunk, n)
        h, t = h_buf[:hi - lo], t_buf[:hi - lo]
        _ramp(h, lo)
        np.bitwise_xor(h, np.uint32(k0), out=h)
        _mix_ref(h, t)
        np.bitwise_xor(h, np.uint32(k1), out=h)
        _mix_ref(h, t)
        np.greater_equal(h, thresh, out=mf[lo:hi])
        np.multiply(xf[lo:hi], mf[lo:hi], out=yf[lo:hi])
        yf[lo:hi] *= scale


# ---------------------------------------------------------------- dispatcher
def dropout_forward(x, p: float, seed: int, y, mask, workspace) -> None:
    """``mask = hash(seed, i) >= threshold(p)`` (uint8) and ``y = x * mask / (1 - p)`` for
    0 < p < 1; ``y`` and ``mask`` C-contiguous, ``y`` may be ``x``. NumPy arrays take the Numba
    loop, C-contiguous float device arrays the CUDA kernel (``workspace`` unused), others the
    reference (with ``workspace``, see :func:`workspace_bytes`)."""
    if x.size > _M32:
        raise ValueError(f"dropout hashes 32-bit element indices: {x.size} elements is too many")
    if _on_device(x, y, mask):
        k0, k1 = seed_keys(seed)
        dt = x.dtype.type
        _cuda.launch(_kernels().k_dropout_fwd, x.size, _cuda.flat(x), _cuda.flat(y),
                     _cuda.flat(mask), np.uint64(k0), np.uint64(k1),
                     np.uint64(keep_threshold(p)), dt(1), dt(0), dt(1.0 / (1.0 - p)))
    elif (all(type(a) is np.ndarray for a in (x, y, mask)) and x.flags.c_contiguous
            and x.dtype in (np.float32, np.float64)):
        k0, k1 = seed_keys(seed)
        dt = x.dtype.type
        _dropout_nb(x.reshape(-1), y.reshape(-1), mask.reshape(-1), np.uint64(k0),
                    np.uint64(k1), np.uint64(keep_threshold(p)), dt(1), dt(0),
                    dt(1.0 / (1.0 - p)))
    else:
        dropout_forward_ref(x, p, seed, y, mask, workspace)
