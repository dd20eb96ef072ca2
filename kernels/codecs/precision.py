"""Reduced-precision copies of float32 arrays (Gist's delayed precision reduction) and back.

A code is an unsigned integer per element (``code_dtype(fmt)``); :func:`encode` writes codes,
:func:`decode` turns them back into float32 (or float64): decoding is exact, every code is a
float32 value, and -0.0 stays -0.0. All formats round to nearest, ties to even, and handle
subnormals.

* ``"fp16"`` (``uint16``): IEEE binary16, bit-identical to ``x.astype(np.float16)``:
  ``|x| >= 65520`` rounds to ±inf; NaN keeps its sign and top 10 payload bits (lowest bit set
  if those are all zero, so it stays NaN); smallest subnormal 2**-24.
* ``"bf16"`` (``uint16``): the top half of the float32 bits, rounded; values that round past
  the largest finite bf16 become ±inf; NaN keeps its sign and top payload bits and gets the
  quiet bit (``| 0x0040``).
* ``"fp8"`` (``uint8``): OCP FP8 E4M3FN (1 sign, 4 exponent bits with bias 7, 3 mantissa
  bits); largest finite ±448, smallest normal 2**-6, subnormals ``k * 2**-9``; no infinities,
  NaN is ``0x7F`` / ``0xFF``. Choices: finite values beyond 448 **saturate** to ±448 (a large
  activation stays large and finite); **±inf and NaN become NaN** of the same sign (an overflow
  that already happened is not disguised as 448; PyTorch's cast maps ±inf to ±448 instead).

Only float32 input is accepted (a float64 source would be rounded twice). ``impl`` and
``stream`` as in :mod:`bitpack`; ``out`` for codes may be any C-contiguous buffer with enough
bytes (e.g. a pool block); encode returns the codes shaped like ``x``.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any

import numpy as np
from numba import njit, prange

from .. import _cuda
from .bitpack import _prefetch, _run

cuda: Any = None  # numba.cuda, set by _cuda.bind on first CUDA use
# CUDA device versions of the scalar rules, set on first CUDA use (_kernels: bind's device=)
_d_fp16_code: Any = None
_d_bf16_code: Any = None
_d_fp8_code: Any = None
_d_fp16_bits: Any = None
_d_fp8_bits: Any = None
FORMATS = ("fp16", "bf16", "fp8")
_CODES = {"fp16": np.dtype(np.uint16), "bf16": np.dtype(np.uint16), "fp8": np.dtype(np.uint8)}
_C = 1 << 16  # elements per CPU task
_AHEAD = 1024  # prefetch distance in elements


def code_dtype(fmt: str) -> np.dtype:
    """Unsigned dtype of one code of ``fmt``."""
    if fmt not in _CODES:
        raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")
    return _CODES[fmt]


def encoded_nbytes(n: int, fmt: str) -> int:
    """Bytes of ``n`` codes of ``fmt``."""
    return int(n) * code_dtype(fmt).itemsize


# ----------------------------------------------------------------------------- scalar rules
# Integer-only (u: float32 bits, h / c: a code, as int64), compiled twice: with njit for the CPU
# loops (``_fp16_code``...) and as CUDA device functions (``_d_fp16_code``..., see _kernels).
# ``(m + 2**(sh-1) - 1 + ((m >> sh) & 1)) >> sh`` is m / 2**sh rounded half to even.
def _fp16_code_py(u):
    s = (u >> 16) & 0x8000
    a = u & 0x7FFFFFFF
    mant = (a & 0x7FFFFF) | 0x800000
    sh = 126 - (a >> 23)
    sh = 31 if sh > 31 else 1 if sh < 1 else sh
    r = (mant + (1 << (sh - 1)) - 1 + ((mant >> sh) & 1)) >> sh  # subnormal (or 0)
    if a >= 0x38800000:
        r = (a - 0x38000000 + 0xFFF + ((a >> 13) & 1)) >> 13
    if a >= 0x477FF000:
        r = 0x7C00
    if a > 0x7F800000:
        r = 0x7C00 | ((a >> 13) & 0x3FF)
        if r == 0x7C00:
            r = 0x7C01
    return s | r


def _bf16_code_py(u):
    if (u & 0x7FFFFFFF) > 0x7F800000:
        return (u >> 16) | 0x40
    return (u + 0x7FFF + ((u >> 16) & 1)) >> 16


def _fp8_code_py(u):
    s = (u >> 24) & 0x80
    a = u & 0x7FFFFFFF
    mant = (a & 0x7FFFFF) | 0x800000
    sh = 141 - (a >> 23)
    sh = 31 if sh > 31 else 1 if sh < 1 else sh
    r = (mant + (1 << (sh - 1)) - 1 + ((mant >> sh) & 1)) >> sh  # subnormal (or 0)
    if a >= 0x3C800000:
        r = (a - 0x3C000000 + 0x7FFFF + ((a >> 20) & 1)) >> 20
    if a >= 0x43E00000:
        r = 0x7E
    if a >= 0x7F800000:
        r = 0x7F
    return s | r


def _fp16_bits_py(h):
    s = (h & 0x8000) << 16
    e = (h >> 10) & 0x1F
    m = h & 0x3FF
    if e == 0x1F:
        return s | 0x7F800000 | (m << 13)
    if e != 0:
        return s | ((e + 112) << 23) | (m << 13)
    if m == 0:
        return s
    e2 = 113
    while (m & 0x400) == 0:
        m <<= 1
        e2 -= 1
    return s | (e2 << 23) | ((m & 0x3FF) << 13)


def _fp8_bits_py(c):
    s = (c & 0x80) << 24
    e = (c >> 3) & 0xF
    m = c & 7
    if e == 0xF and m == 7:
        return s | 0x7FC00000
    if e != 0:
        return s | ((e + 120) << 23) | (m << 20)
    if m == 0:
        return s
    e2 = 121
    while (m & 8) == 0:
        m <<= 1
        e2 -= 1
    return s | (e2 << 23) | ((m & 7) << 20)


_fp16_code = njit(cache=True, inline="always")(_fp16_code_py)
_bf16_code = njit(cache=True, inline="always")(_bf16_code_py)
_fp8_code = njit(cache=True, inline="always")(_fp8_code_py)


# ----------------------------------------------------------------------------- Numba CPU
# The fp16 / fp8 / LUT loops are compute-bound: they prefetch _AHEAD elements ahead, one
# cache line at a time (see bitpack._prefetch).
@njit(cache=True, error_model="numpy")
def _fp16_body(u, out):
    nl = u.size // 16
    for b in range(nl):
        _prefetch(u, 16 * b + _AHEAD)
        for k in range(16):
            out[16 * b + k] = _fp16_code(np.int64(u[16 * b + k]))
    for i in range(16 * nl, u.size):
        out[i] = _fp16_code(np.int64(u[i]))


@njit(cache=True, error_model="numpy")
def _bf16_body(u, out):
    for i in range(u.size):
        out[i] = _bf16_code(np.int64(u[i]))


@njit(cache=True, error_model="numpy")
def _fp8_body(u, out):
    nl = u.size // 16
    for b in range(nl):
        _prefetch(u, 16 * b + _AHEAD)
        for k in range(16):
            out[16 * b + k] = _fp8_code(np.int64(u[16 * b + k]))
    for i in range(16 * nl, u.size):
        out[i] = _fp8_code(np.int64(u[i]))


@njit(cache=True, parallel=True, error_model="numpy")
def _encode_nb(u, out, fmt):
    n = u.size
    for t in prange((n + _C - 1) // _C):
        lo = t * _C
        hi = min(n, lo + _C)
        if fmt == 0:
            _fp16_body(u[lo:hi], out[lo:hi])
        elif fmt == 1:
            _bf16_body(u[lo:hi], out[lo:hi])
        else:
            _fp8_body(u[lo:hi], out[lo:hi])


@njit(cache=True, error_model="numpy")
def _lut_body(c, out, lut):
    nl = c.size // 64
    for b in range(nl):
        _prefetch(c, 64 * b + 4 * _AHEAD)
        for k in range(64):
            out[64 * b + k] = lut[c[64 * b + k]]
    for i in range(64 * nl, c.size):
        out[i] = lut[c[i]]


@njit(cache=True, parallel=True, error_model="numpy")
def _decode_lut_nb(c, out, lut):
    n = c.size
    for t in prange((n + _C - 1) // _C):
        _lut_body(c[t * _C: min(n, t * _C + _C)], out[t * _C: min(n, t * _C + _C)], lut)


@njit(cache=True, error_model="numpy")
def _bf16_dec_body(c, out):
    for i in range(c.size):
        out[i] = np.uint32(c[i]) << 16


@njit(cache=True, parallel=True, error_model="numpy")
def _decode_bf16_nb(c, out):
    n = c.size
    for t in prange((n + _C - 1) // _C):
        _bf16_dec_body(c[t * _C: min(n, t * _C + _C)], out[t * _C: min(n, t * _C + _C)])


@functools.cache
def _lut(fmt: str) -> np.ndarray:
    """float32 bits of every code (fp16: 65536 entries, 256 KiB; fp8: 256)."""
    codes = np.arange(65536 if fmt == "fp16" else 256, dtype=_CODES[fmt])
    return _decode_numpy(codes, fmt).view(np.uint32)


# ----------------------------------------------------------------------------- NumPy reference
def _encode_numpy(x: np.ndarray, fmt: str) -> np.ndarray:
    with np.errstate(all="ignore"):
        return _encode_numpy_(x, fmt)


def _encode_numpy_(x: np.ndarray, fmt: str) -> np.ndarray:
    if fmt == "fp16":
        return x.astype(np.float16).view(np.uint16)
    u = x.view(np.uint32).astype(np.int64)
    if fmt == "bf16":
        r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        return np.where(np.isnan(x), (u >> 16) | 0x40, r).astype(np.uint16)
    # fp8: nearest of the 127 non-negative finite values by value, ties to the even code.
    table = _decode_numpy(np.arange(0x7F, dtype=np.uint8), "fp8")  # 0 .. 448, increasing
    a = np.abs(x.astype(np.float64))
    hi = np.clip(np.searchsorted(table, a), 1, 0x7E)
    lo = hi - 1
    dlo, dhi = a - table[lo], table[hi] - a
    code = np.where((dhi < dlo) | ((dhi == dlo) & (hi % 2 == 0)), hi, lo)
    code = np.where(a >= 448, 0x7E, code)
    code = np.where(np.isnan(a) | np.isinf(a), 0x7F, code)
    return (code | np.where(np.signbit(x), 0x80, 0)).astype(np.uint8)


def _decode_numpy(c: np.ndarray, fmt: str) -> np.ndarray:
    if fmt == "fp16":
        return c.view(np.float16).astype(np.float32)
    if fmt == "bf16":
        return (c.astype(np.uint32) << 16).view(np.float32)
    c = c.astype(np.int64)
    e, m = (c >> 3) & 0xF, c & 7
    mag = np.where(e == 0, np.ldexp(m.astype(np.float64), -9),
                   np.ldexp(1 + m / 8.0, (e - 7).astype(np.int32)))
    mag = np.where((e == 0xF) & (m == 7), np.nan, mag)
    return np.where(c & 0x80, -mag, mag).astype(np.float32)


# ----------------------------------------------------------------------------- CUDA
def _k_encode(u, out, n, fmt):
    for i in range(cuda.grid(1), n, cuda.gridsize(1)):
        v = np.int64(u[i])
        if fmt == 0:
            out[i] = _d_fp16_code(v)
        elif fmt == 1:
            out[i] = _d_bf16_code(v)
        else:
            out[i] = _d_fp8_code(v)


def _k_decode(c, out, n, fmt):
    for i in range(cuda.grid(1), n, cuda.gridsize(1)):
        v = np.int64(c[i])
        if fmt == 0:
            out[i] = _d_fp16_bits(v)
        elif fmt == 1:
            out[i] = v << 16
        else:
            out[i] = _d_fp8_bits(v)


@functools.cache
def _kernels() -> SimpleNamespace:
    rules = ("fp16_code", "bf16_code", "fp8_code", "fp16_bits", "fp8_bits")
    return _cuda.bind(globals(), ["_k_encode", "_k_decode"],
                      device={f"_d_{r}": f"_{r}_py" for r in rules})


# ----------------------------------------------------------------------------- public API
def encode(x: Any, fmt: str, out: Any = None, *, impl: str = "auto", stream: Any = None) -> Any:
    """Codes of the float32 array ``x`` in ``fmt`` (``"fp16"``, ``"bf16"``, ``"fp8"``), shaped
    like ``x``; written into ``out`` when given."""
    impl = _cuda.choose(impl, x, out)
    cd = code_dtype(fmt)
    if x.dtype != np.float32:
        raise TypeError(f"reduced precision encodes float32 only, got {x.dtype}")
    n = x.size
    if impl == "cuda":
        o = _cuda.empty(x, n, cd) if out is None else _cuda.typed_view(out, cd, n)
        u = _cuda.flat(x, "x").view(np.uint32)
        _cuda.launch(_kernels().k_encode, n, u, o, n, FORMATS.index(fmt), stream=stream)
        return o.reshape(x.shape)
    o = np.empty(n, cd) if out is None else _cuda.typed_view(out, cd, n)
    xc = np.ascontiguousarray(x)
    if impl == "numpy":
        o[:] = _encode_numpy(xc.reshape(-1), fmt)
    elif n:
        u = xc.reshape(-1).view(np.uint32)
        if n <= _C:
            (_fp16_body, _bf16_body, _fp8_body)[FORMATS.index(fmt)](u, o)
        else:
            _encode_nb(u, o, FORMATS.index(fmt))
    return o.reshape(x.shape)


def decode(codes: Any, fmt: str, out: Any = None, dtype: Any = np.float32, *,
           shape: tuple[int, ...] | None = None, impl: str = "auto", stream: Any = None) -> Any:
    """Exact float32 (or ``dtype`` / ``out``'s dtype, e.g. float64) values of ``codes``.

    ``codes``: an array of ``code_dtype(fmt)``, or any C-contiguous buffer holding them (a pool
    block; then give ``shape`` or ``out``). The result has ``out``'s shape, else ``shape``,
    else ``codes.shape``.
    """
    impl = _cuda.choose(impl, codes, out)
    cd = code_dtype(fmt)
    if out is not None:
        shape = tuple(out.shape)
    elif shape is None:
        if codes.dtype != cd:
            raise ValueError(f"codes of dtype {codes.dtype}: give shape= or out=")
        shape = tuple(codes.shape)
    n = int(np.prod(shape))
    if impl != "cuda" and not codes.flags.c_contiguous:
        codes = np.ascontiguousarray(codes)
    c = _cuda.typed_view(codes, cd, n, "codes")
    if impl == "cuda":
        o = _cuda.empty(codes, n, dtype) if out is None else _cuda.flat(out, "out")
        f = o if o.dtype == np.float32 else _cuda.empty(o, n, np.float32)
        if f is not o and hasattr(o, "copy_to_device"):
            raise TypeError("CUDA decode into a Numba device array writes float32 only")
        _cuda.launch(_kernels().k_decode, n, c, f.view(np.uint32), n, FORMATS.index(fmt),
                     stream=stream)
        if f is not o:
            o[...] = f  # exact widening on the device (CuPy-like arrays)
        return o.reshape(shape)
    o = np.empty(shape, dtype) if out is None else out
    if impl == "numpy":
        o[...] = _decode_numpy(c, fmt).reshape(shape)
        return o
    direct = o.dtype == np.float32 and o.flags.c_contiguous
    f = o.reshape(-1) if direct else np.empty(n, np.float32)
    if fmt == "bf16":
        _run(_decode_bf16_nb, _bf16_dec_body, n, c, f.view(np.uint32))
    else:
        _run(_decode_lut_nb, _lut_body, n, c, f.view(np.uint32), _lut(fmt))
    if not direct:
        o[...] = f.reshape(shape)
    return o
