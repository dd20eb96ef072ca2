"""One-dimensional k-means (Lloyd's algorithm) for weight sharing.

Deep Compression clusters each layer's weights into ``k`` shared values. Its finding is that
*linear* initialisation (centroids evenly spaced between the smallest and largest weight)
beats random and density-based initialisation, because it keeps a few centroids on the rare
large weights, which matter most; :func:`linear_init` is that.

Each Lloyd iteration assigns every value to its nearest centroid (the lowest index on a tie)
and moves each centroid to the mean of its values (a centroid with no values stays where it
is), until no assignment changes or ``max_iter`` iterations. Means are summed in float64 in
index order. ``impl="numpy"`` is the reference; ``"numba"`` (the default) gives the same
labels and centroids (a parallel assignment, a serial update in the same order).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit, prange


def linear_init(x: Any, k: int) -> np.ndarray:
    """``k`` centroids evenly spaced over ``[min(x), max(x)]`` (float64)."""
    x = np.asarray(x)
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if x.size == 0:
        raise ValueError("cannot initialise centroids from an empty array")
    return np.linspace(float(x.min()), float(x.max()), int(k))


def _assign_reference(x: np.ndarray, c: np.ndarray) -> np.ndarray:
    return np.abs(x[:, None] - c[None, :]).argmin(axis=1).astype(np.int64)


def _kmeans_reference(x: np.ndarray, c: np.ndarray,
                      max_iter: int) -> tuple[np.ndarray, np.ndarray, int]:
    labels = _assign_reference(x, c)
    it = 0
    while it < max_iter:
        it += 1
        sums = np.bincount(labels, weights=x, minlength=len(c))
        counts = np.bincount(labels, minlength=len(c))
        c = np.where(counts > 0, sums / np.maximum(counts, 1), c)
        new = _assign_reference(x, c)
        if np.array_equal(new, labels):
            break
        labels = new
    return c, labels, it


@njit(parallel=True, cache=True)
def _assign_numba(x, c, labels):  # pragma: no cover - compiled
    changed = 0
    for i in prange(x.shape[0]):
        best = 0
        bd = abs(x[i] - c[0])
        for j in range(1, c.shape[0]):
            d = abs(x[i] - c[j])
            if d < bd:
                bd = d
                best = j
        if labels[i] != best:
            labels[i] = best
            changed += 1
    return changed


@njit(cache=True)
def _update_numba(x, labels, c):  # pragma: no cover - compiled
    k = c.shape[0]
    sums = np.zeros(k)
    counts = np.zeros(k, dtype=np.int64)
    for i in range(x.shape[0]):
        sums[labels[i]] += x[i]
        counts[labels[i]] += 1
    for j in range(k):
        if counts[j] > 0:
            c[j] = sums[j] / counts[j]


def _kmeans_numba(x: np.ndarray, c: np.ndarray,
                  max_iter: int) -> tuple[np.ndarray, np.ndarray, int]:
    labels = np.full(len(x), -1, dtype=np.int64)
    _assign_numba(x, c, labels)
    it = 0
    while it < max_iter:
        it += 1
        _update_numba(x, labels, c)
        if _assign_numba(x, c, labels) == 0:
            break
    return c, labels, it


def kmeans_1d(x: Any, k: int, init: Any = "linear", max_iter: int = 100,
              impl: str = "numba") -> tuple[np.ndarray, np.ndarray, int]:
    """Cluster the values ``x`` into ``k`` clusters: ``(centroids, labels, iterations)``.

    ``init`` is ``"linear"`` (:func:`linear_init`) or an array of ``k`` starting centroids.
    Centroids are float64, labels int64 in ``[0, k)``."""
    x = np.ascontiguousarray(np.asarray(x, dtype=np.float64).reshape(-1))
    c = linear_init(x, k) if isinstance(init, str) and init == "linear" \
        else np.array(init, dtype=np.float64).reshape(-1)
    if isinstance(init, str) and init != "linear":
        raise ValueError(f"unknown init {init!r}; valid: 'linear' or an array of centroids")
    if len(c) != k:
        raise ValueError(f"init has {len(c)} centroids, k={k}")
    if x.size == 0:
        return c, np.zeros(0, dtype=np.int64), 0
    if impl == "numpy":
        return _kmeans_reference(x, c, max_iter)
    if impl == "numba":
        return _kmeans_numba(x, c.copy(), max_iter)
    raise ValueError(f"unknown impl {impl!r}; valid: numpy, numba")
