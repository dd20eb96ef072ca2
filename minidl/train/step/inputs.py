"""A batch checked and converted for a network before it runs: the input's dtype (float
features or integer indices, all finite) and the labels' (integer classes or float targets)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ...net.graph import Network


def check_inputs(net: Network, x: Any, y: Any | None) -> tuple[np.ndarray, np.ndarray | None]:
    """``x`` as a contiguous array of ``net``'s input dtype and ``y`` (when given) as int64
    classes or float targets; ``TypeError`` / ``ValueError`` saying what is wrong."""
    sym = net.inputs[0]
    want = np.dtype(sym.dtype)
    x = np.asarray(x)
    if np.issubdtype(want, np.floating):
        if not (np.issubdtype(x.dtype, np.floating) or np.issubdtype(x.dtype, np.integer)) \
                or x.dtype == np.bool_:
            raise TypeError(f"input must be a float array, got dtype {x.dtype}")
        if np.issubdtype(x.dtype, np.floating) and not np.isfinite(x).all():
            bad = int(np.size(x) - np.isfinite(x).sum())
            raise ValueError(f"input contains {bad} NaN or inf value(s)")
        x = np.ascontiguousarray(x, dtype=want)
    elif np.issubdtype(want, np.integer):
        if not np.issubdtype(x.dtype, np.integer):
            raise TypeError(f"input must be an integer array of indices, got dtype {x.dtype}")
        x = np.ascontiguousarray(x, dtype=want)
    if y is not None:
        y = np.asarray(y)
        if np.issubdtype(y.dtype, np.integer):
            y = np.ascontiguousarray(y, dtype=np.int64)
        else:
            y = np.ascontiguousarray(y, dtype=x.dtype if x.dtype.kind == "f" else np.float32)
        if y.shape[0] != x.shape[0]:
            raise ValueError(f"{x.shape[0]} inputs but {y.shape[0]} labels")
    return x, y
