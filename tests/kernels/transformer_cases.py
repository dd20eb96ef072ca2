"""What the transformer kernel tests share: the float dtypes and their tolerances, a
tolerance check, normal samples and the per-head view of a fused projection."""

from __future__ import annotations

import numpy as np

DTYPES = (np.float32, np.float64)
TOL = {np.float32: dict(rtol=1e-5, atol=1e-6), np.float64: dict(rtol=1e-12, atol=1e-13)}


def close(got: np.ndarray, want: np.ndarray, what: str = "", scale: float = 1.0) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, (what, got.shape, want.shape)
    tol = TOL[want.dtype.type]
    np.testing.assert_allclose(got, want, rtol=tol["rtol"], atol=tol["atol"] * scale,
                               err_msg=what)


def _normal(rng, *shape, dtype=np.float32, scale=1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(dtype)


def _heads(a: np.ndarray, heads: int, parts: int) -> np.ndarray:
    b, t, w = a.shape
    return a.reshape(b, t, parts, heads, w // parts // heads).transpose(2, 0, 3, 1, 4)
