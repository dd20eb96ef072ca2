"""1-D k-means with linear initialisation against a NumPy reference."""

from __future__ import annotations

import numpy as np
import pytest

from minidl.kernels.compression import kmeans


def _lloyd(x: np.ndarray, k: int, iters: int = 100) -> tuple[np.ndarray, np.ndarray]:
    """A plain Lloyd loop written independently of the module: nearest centroid (lowest index
    on ties), mean update, empty clusters stay."""
    c = np.linspace(x.min(), x.max(), k)
    labels = None
    for _ in range(iters + 1):
        new = np.array([int(np.argmin(np.abs(v - c))) for v in x])
        if labels is not None and (new == labels).all():
            break
        labels = new
        c = np.array([x[labels == j].mean() if (labels == j).any() else c[j] for j in range(k)])
    return c, labels


@pytest.mark.parametrize("k", [1, 2, 7, 31])
@pytest.mark.parametrize("seed", [0, 1])
def test_numba_and_numpy_match_an_independent_lloyd(k, seed):
    rng = np.random.default_rng(seed)
    x = np.concatenate([rng.normal(-0.1, 0.02, 300), rng.normal(0.08, 0.05, 200),
                        rng.standard_t(2, 20) * 0.1])
    ref_c, ref_l = _lloyd(x, k)
    for impl in ("numpy", "numba"):
        c, labels, it = kmeans.kmeans_1d(x, k, impl=impl)
        assert (labels == ref_l).all()
        np.testing.assert_allclose(c, ref_c, rtol=1e-12, atol=1e-15)
        assert 1 <= it <= 100 or k == 1


def test_linear_init_spans_the_range_and_keeps_the_extremes():
    x = np.array([-3.0, 0.0, 0.1, 0.2, 5.0])
    np.testing.assert_allclose(kmeans.linear_init(x, 5), [-3, -1, 1, 3, 5])
    c, labels, _ = kmeans.kmeans_1d(x, 3)
    assert c.min() == -3.0 and c.max() == 5.0  # the rare large weights keep their own value
    assert labels.tolist() == [0, 1, 1, 1, 2]


def test_empty_clusters_stay_and_bad_arguments_fail():
    c, labels, _ = kmeans.kmeans_1d(np.array([0.0, 0.0, 1.0]), 4)
    assert set(labels.tolist()) == {0, 3} and c[1] == pytest.approx(1 / 3)
    with pytest.raises(ValueError, match="k must be"):
        kmeans.kmeans_1d(np.ones(3), 0)
    with pytest.raises(ValueError, match="centroids"):
        kmeans.kmeans_1d(np.ones(3), 2, init=[0.0])
