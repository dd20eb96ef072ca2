"""GEMM on device arrays straight into the output: ``np.matmul(a, b, out=c)``, which CuPy hands
to cuBLAS as it is when the operands are laid out for it (no copy, no temporary)."""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["gemm", "gemm_layout_ok"]


def gemm_layout_ok(a: Any, b: Any, out: Any) -> bool:
    """True for 2-D C- or F-contiguous operands of the output's dtype and a C-contiguous
    output: what :func:`gemm` takes."""
    return all(m.ndim == 2 and (m.flags.c_contiguous or m.flags.f_contiguous) for m in (a, b)) \
        and out.flags.c_contiguous and out.dtype == a.dtype == b.dtype


def gemm(a: Any, b: Any, out: Any) -> None:
    """``out = a @ b`` for 2-D operands CuPy gives cuBLAS as they are: C- or F-contiguous
    operands (a transpose is a flag), a C-contiguous output, one dtype (anything else and
    CuPy copies). A 1x1 product goes as a batch of one: CuPy's 2-D path turns it into an
    elementwise product and a (CUB) sum, both with temporaries."""
    if not gemm_layout_ok(a, b, out):
        raise AssertionError("device GEMM operands must be 2-D, C- or F-contiguous, of the "
                             "output's dtype, and the output C-contiguous")
    if out.shape == (1, 1):  # a (1, k) row and a (k, 1) column: C-contiguous either way
        np.matmul(a[None], b[None], out=out[None])
    else:
        np.matmul(a, b, out=out)
