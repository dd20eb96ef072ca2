"""Bit-for-bit comparison of float arrays that treats every NaN as the same value.

Kernels promise the same bits as their NumPy references for every finite value, for ±inf and
for ±0. A NaN made by invalid arithmetic (inf - inf, 0 * inf, 0 / 0) is another matter: its sign
and payload come from the instruction the compiler picked for this CPU (x86's "indefinite" NaN
is negative, 0xFFC00000; NumPy's ufuncs may give 0x7FC00000 on the same inputs; vector width and
fused multiply-add change which one appears), not from anything minidl controls. So a NaN must
meet a NaN at the same position, with any sign and payload; every other element is compared by
its bit pattern, which keeps -0.0 != 0.0 and catches a flushed subnormal.
"""

from __future__ import annotations

import numpy as np

_UINT = {np.dtype(np.float16): np.uint16, np.dtype(np.float32): np.uint32,
         np.dtype(np.float64): np.uint64}


def assert_same_bits(got: np.ndarray, want: np.ndarray) -> None:
    """Equal dtype, shape, NaN positions, and bit patterns everywhere else."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, got.shape,
                                                                  want.dtype, want.shape)
    got_nan, want_nan = np.isnan(got), np.isnan(want)
    np.testing.assert_array_equal(got_nan, want_nan, err_msg="NaN positions differ")
    u = _UINT[got.dtype]
    np.testing.assert_array_equal(got[~got_nan].view(u), want[~want_nan].view(u))
