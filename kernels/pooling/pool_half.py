"""Max pooling on half device arrays (float16, or ``ml_dtypes.bfloat16``) read as their
``uint16`` bits: Numba CUDA has no bfloat16, and no float32 temporary is needed.

Every result is bit-identical to casting the half operands to float32, running the float32
kernel of :mod:`.pool` (or :mod:`.poolidx`) and rounding the result back to the half dtype:

* forward (any geometry): the float32 kernel's rules on an order-preserving key of the bits
  (``0x8000 + bits`` for a clear sign bit, ``0x8000 - magnitude`` for a set one, so -0.0 and
  +0.0 tie): the first maximum of the in-bounds taps wins, a NaN (magnitude above +inf's
  pattern) wins over everything and only a later NaN replaces it (the last NaN), padding is
  skipped (it counts as -inf). ``y`` takes the chosen element's bits; a window of -inf only
  (or one entirely in the padding) gives -inf with the index of its first in-bounds tap.
* backward, only for windows that do not overlap (:func:`maxpool_half_exact`: stride >=
  kernel in both dimensions): each ``dx`` element then receives at most one ``dy``, which the
  float32 kernel adds to +0.0, so ``dx`` is that ``dy``'s bits (-0.0 becoming +0.0, as
  ``0.0 + -0.0``; a signalling NaN quieted, as the addition quiets it on the host: its
  payload kept, the quiet bit set), else +0.0. Overlapping windows sum gradients in float32:
  the half-bits backward refuses them (``ValueError``); :func:`.pool.maxpool2d_backward` and
  :func:`.poolidx.maxpool_backward_packed` keep their generic kernel for them.

NaN bits are otherwise copied as they are (the float32 round trip keeps float16 payloads and
bfloat16's quiet NaN). A GPU's float32 addition returns its canonical NaN instead: the
backward's NaN bits may then differ from the float32 path's (both are NaN).
"""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any

import numpy as np

from .. import _cuda
from ..array_api import half_inf_bits

cuda: Any = None  # numba.cuda, set by _cuda.bind on first CUDA use

Pair = tuple[int, int]


def maxpool_half_exact(kernel: Pair, stride: Pair) -> bool:
    """Whether max-pool windows of ``kernel`` and ``stride`` do not overlap (``stride >=
    kernel`` in both dimensions): then the backward on half device arrays is a copy of bits,
    exactly the float32 kernel's result rounded to half, and :func:`maxpool2d_backward_half`
    (and the packed backward) take half arrays. Overlapping windows sum in float32: pass
    float32 arrays for them."""
    return int(stride[0]) >= int(kernel[0]) and int(stride[1]) >= int(kernel[1])


def _inf_bits(dtype: np.dtype) -> np.int32:
    """+inf's bit pattern in ``dtype`` (:func:`~..array_api.half_inf_bits`)."""
    return np.int32(half_inf_bits(dtype))


def _nan_bits(dtype: np.dtype) -> tuple[np.int32, np.int32]:
    """+inf's bit pattern and the quiet-NaN bit (the mantissa's highest)."""
    return _inf_bits(dtype), np.int32(0x0200 if dtype == np.float16 else 0x0040)


# ----------------------------------------------------------------------------- CUDA
def _window_py(e, h, w, ho, wo, kh, kw, sh, sw, ph, pw):
    """Output element ``e``'s window (one plane of ``h`` x ``w`` per ``ho`` x ``wo`` outputs):
    ``(base, i0, i1, j0, j1)``, its in-bounds taps ``i0:i1`` x ``j0:j1``, tap ``(i, j)`` at
    flat input index ``base + i * w + j`` (padding's taps skipped). A device function of the
    max-pool forward kernels here and in :mod:`.pool`."""
    p = e // (ho * wo)
    r = e - p * ho * wo
    oh = r // wo
    ow = r - oh * wo
    h0 = oh * sh - ph
    w0 = ow * sw - pw
    i0 = -h0 if h0 < 0 else 0
    i1 = h - h0 if h - h0 < kh else kh
    j0 = -w0 if w0 < 0 else 0
    j1 = w - w0 if w - w0 < kw else kw
    return (p * h + h0) * w + w0, i0, i1, j0, j1


_d_window: Any = None  # its device version (bind's device=)


def _k_maxpool_fwd_half_bits(x, y, idx, npl, h, w, ho, wo, kh, kw, sh, sw, ph, pw, inf_bits):
    """``pool._k_maxpool_fwd`` on ``uint16`` bits (module docstring: the key, NaN, ties)."""
    for e in range(cuda.grid(1), npl * ho * wo, cuda.gridsize(1)):
        base, i0, i1, j0, j1 = _d_window(e, h, w, ho, wo, kh, kw, sh, sw, ph, pw)
        mb = 0x8000 | inf_bits  # -inf
        mk = 0x8000 - inf_bits  # its key
        k = i0 * kw + j0
        for i in range(i0, i1):
            for j in range(j0, j1):
                b = x[base + i * w + j]
                mag = b & 0x7FFF
                if mag > inf_bits:  # NaN: taken; above every key, so only a NaN replaces it
                    mb = b
                    mk = 0x10000
                    k = i * kw + j
                else:
                    vk = 0x8000 + b if b < 0x8000 else 0x8000 - mag
                    if vk > mk:
                        mb = b
                        mk = vk
                        k = i * kw + j
        y[e] = mb
        idx[e] = k


def _k_maxpool_bwd_half_bits(dy, idx, dx, npl, h, w, ho, wo, bits, kh, kw, sh, sw, ph, pw,
                             inf_bits, quiet):
    """Non-overlapping windows: each ``dx`` element is its window's ``dy`` bits where it is
    the argmax (-0.0 as +0.0, a NaN quieted: ``quiet`` is the quiet bit), else +0.0. ``idx``:
    one index per window (``bits == 0``), or the indices packed ``bits`` bits each
    (:mod:`.poolidx`)."""
    m = (1 << bits) - 1
    for t in range(cuda.grid(1), npl * h * w, cuda.gridsize(1)):
        p = t // (h * w)
        r = t - p * h * w
        hp = r // w + ph
        wp = r - (r // w) * w + pw
        oh = hp // sh
        ow = wp // sw
        di = hp - oh * sh
        dj = wp - ow * sw
        g = 0
        if oh < ho and ow < wo and di < kh and dj < kw:
            e = (p * ho + oh) * wo + ow
            s = e * bits
            slot = idx[e] if bits == 0 else (idx[s >> 3] >> (s & 7)) & m
            if slot == di * kw + dj:
                g = dy[e]
                if g == 0x8000:
                    g = 0
                elif (g & 0x7FFF) > inf_bits:
                    g |= quiet
        dx[t] = g


@functools.cache
def _kernels() -> SimpleNamespace:
    return _cuda.bind(globals(), ["_k_maxpool_fwd_half_bits", "_k_maxpool_bwd_half_bits"],
                      device={"_d_window": "_window_py"})


def _bits(a: Any, what: str) -> Any:
    if not a.flags["C_CONTIGUOUS"]:
        raise ValueError(f"{what} must be C-contiguous on the device")
    return a.reshape(-1).view(np.uint16)


def _check_exact(kernel: Pair, stride: Pair) -> None:
    if not maxpool_half_exact(kernel, stride):
        raise ValueError(f"max-pool backward on half bits needs non-overlapping windows "
                         f"(stride {tuple(stride)} >= kernel {tuple(kernel)}): use float32")


# ----------------------------------------------------------------------------- public API
def maxpool2d_forward_half(x: Any, y: Any, idx: Any, kernel: Pair, stride: Pair,
                           padding: Pair = (0, 0), stream: Any = None) -> None:
    """Max pooling of half device array ``x`` into ``y`` (same dtype) and ``idx``, on the
    bits (any geometry; exact: module docstring)."""
    n, c, h, w = x.shape
    _cuda.launch(_kernels().k_maxpool_fwd_half_bits, y.size, _bits(x, "x"), _bits(y, "y"),
                 _cuda.flat(idx, "idx"), n * c, h, w, y.shape[2], y.shape[3], *kernel,
                 *stride, *padding, _inf_bits(x.dtype), stream=stream)


def maxpool2d_backward_half(dy: Any, idx: Any, dx: Any, kernel: Pair, stride: Pair,
                            padding: Pair = (0, 0), stream: Any = None) -> None:
    """Overwrite half device array ``dx`` with half ``dy`` at each window's argmax, on the
    bits; non-overlapping windows only (:func:`maxpool_half_exact`, else ``ValueError``)."""
    _check_exact(kernel, stride)
    n, c, h, w = dx.shape
    _cuda.launch(_kernels().k_maxpool_bwd_half_bits, dx.size, _bits(dy, "dy"),
                 _cuda.flat(idx, "idx"), _bits(dx, "dx"), n * c, h, w, dy.shape[2],
                 dy.shape[3], 0, *kernel, *stride, *padding, *_nan_bits(dx.dtype),
                 stream=stream)


def maxpool_backward_packed_half(dy: Any, packed: Any, dx: Any, x_shape: tuple[int, ...],
                                 bits: int, kernel: Pair, stride: Pair, padding: Pair,
                                 stream: Any = None) -> None:
    """:func:`maxpool2d_backward_half` from packed argmax indices (``packed``: the bytes,
    ``bits`` per index; ``dx``: a flat half device array of ``prod(x_shape)`` elements)."""
    _check_exact(kernel, stride)
    n, c, h, w = x_shape
    _cuda.launch(_kernels().k_maxpool_bwd_half_bits, dx.size, _bits(dy, "dy"), packed,
                 _bits(dx, "dx"), n * c, h, w, dy.shape[2], dy.shape[3], bits, *kernel,
                 *stride, *padding, *_nan_bits(dx.dtype), stream=stream)
