"""Elementwise activation kernels: a NumPy reference and a Numba CPU version of each op.

Every public function writes its result into ``out`` and is safe when ``out`` is the same
array as its first operand (in-place forward / backward). NumPy arrays that are C-contiguous
go to the Numba loops (one pass, no temporaries); anything else (non-contiguous views, CuPy
arrays through NumPy's dispatch protocols) goes to the NumPy reference.
"""

from __future__ import annotations

import numpy as np
from numba import njit


def _use_numba(*arrays) -> bool:
    return all(type(a) is np.ndarray and a.flags.c_contiguous for a in arrays)


def _flat(a: np.ndarray) -> np.ndarray:
    return a.reshape(-1)


# ---------------------------------------------------------------- Numba CPU loops
# Scalars (slope, one) are passed in the array dtype so float32 math stays float32, as in NumPy.
@njit(cache=True, error_model="numpy")
def _leaky_relu_fwd_nb(x, slope, y):
    for i in range(x.size):
        v = x[i]
        y[i] = v if v > 0 else v * slope


@njit(cache=True, error_model="numpy")
def _leaky_relu_bwd_nb(dy, ref, slope, dx):
    for i in range(dy.size):
        g = dy[i]
        dx[i] = g if ref[i] > 0 else g * slope


@njit(cache=True, error_model="numpy")
def _sigmoid_bwd_nb(dy, y, one, dx):
    for i in range(dy.size):
        v = y[i]
        dx[i] = dy[i] * (v * (one - v))


@njit(cache=True, error_model="numpy")
def _tanh_bwd_nb(dy, y, one, dx):
    for i in range(dy.size):
        v = y[i]
        dx[i] = dy[i] * (one - v * v)


# ---------------------------------------------------------------- NumPy references
def leaky_relu_forward_ref(x, slope, out):
    np.copyto(out, np.where(x > 0, x, x * slope))


def leaky_relu_backward_ref(dy, ref, slope, out):
    np.copyto(out, np.where(ref > 0, dy, dy * slope))


def sigmoid_backward_ref(dy, y, out):
    np.copyto(out, dy * (y * (1 - y)))


def tanh_backward_ref(dy, y, out):
    np.copyto(out, dy * (1 - y * y))


# ---------------------------------------------------------------- dispatchers
def leaky_relu_forward(x, slope: float, out) -> None:
    """out = x if x > 0 else slope * x."""
    s = x.dtype.type(slope)
    if _use_numba(x, out):
        _leaky_relu_fwd_nb(_flat(x), s, _flat(out))
    else:
        leaky_relu_forward_ref(x, s, out)


def leaky_relu_backward(dy, ref, slope: float, out) -> None:
    """out = dy if ref > 0 else slope * dy (``ref`` is the input, or the output if slope >= 0)."""
    s = dy.dtype.type(slope)
    if _use_numba(dy, ref, out):
        _leaky_relu_bwd_nb(_flat(dy), _flat(ref), s, _flat(out))
    else:
        leaky_relu_backward_ref(dy, ref, s, out)


def sigmoid_backward(dy, y, out) -> None:
    """out = dy * y * (1 - y), from the sigmoid's output ``y``."""
    if _use_numba(dy, y, out):
        _sigmoid_bwd_nb(_flat(dy), _flat(y), dy.dtype.type(1), _flat(out))
    else:
        sigmoid_backward_ref(dy, y, out)


def tanh_backward(dy, y, out) -> None:
    """out = dy * (1 - y**2), from the tanh's output ``y``."""
    if _use_numba(dy, y, out):
        _tanh_bwd_nb(_flat(dy), _flat(y), dy.dtype.type(1), _flat(out))
    else:
        tanh_backward_ref(dy, y, out)
