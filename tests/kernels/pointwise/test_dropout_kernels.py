"""Dropout masks (``minidl.kernels.pointwise.dropout``): the Numba loop and the ufunc reference
give the
same bits for any size and chunking, the rate is 1 - p, seeds give independent masks."""

from __future__ import annotations

import numpy as np
import pytest

from minidl.kernels.pointwise import dropout as kd


def _run(fn, x, p, seed, **kw):
    y, mask = np.full_like(x, np.nan), np.full(x.shape, 7, np.uint8)
    ws = np.full(kd.workspace_bytes(x.size), 0xFF, np.uint8)
    fn(x, p, seed, y, mask, ws, **kw)
    return y, mask


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n", [1, 5, 1000, kd.CHUNK + 3])
@pytest.mark.parametrize("p", [1e-9, 0.3, 0.5, 1 - 1e-9])
def test_numba_loop_and_reference_agree_bit_for_bit(dtype, n, p):
    x = np.random.default_rng(n).standard_normal(n).astype(dtype)
    y, m = _run(kd.dropout_forward, x, p, 12345)
    y_ref, m_ref = _run(kd.dropout_forward_ref, x, p, 12345)
    np.testing.assert_array_equal(m, m_ref)
    np.testing.assert_array_equal(y, y_ref)
    np.testing.assert_array_equal(y, x * m * dtype(1 / (1 - p)))


def test_in_place_and_independent_of_chunking(monkeypatch):
    x = np.random.default_rng(0).standard_normal(5000).astype(np.float32)
    _, want = _run(kd.dropout_forward_ref, x, 0.4, 9)
    monkeypatch.setattr(kd, "CHUNK", 333)
    y, m = _run(kd.dropout_forward_ref, x, 0.4, 9)
    np.testing.assert_array_equal(m, want)
    z = x.copy()
    kd.dropout_forward(z, 0.4, 9, z, m, None)  # y is x
    np.testing.assert_array_equal(z, y)


def test_rate_and_seed_independence():
    x = np.ones(200_000, np.float32)
    masks = np.array([_run(kd.dropout_forward, x, 0.5, s)[1] for s in range(16)], float)
    assert np.all(np.abs(masks.mean(axis=1) - 0.5) < 0.005)
    corr = np.corrcoef(masks)
    np.fill_diagonal(corr, 0)
    assert np.abs(corr).max() < 0.02
    lag = np.corrcoef(masks[0, :-1], masks[0, 1:])[0, 1]
    assert abs(lag) < 0.01
    for p in (0.1, 0.9):
        assert abs(_run(kd.dropout_forward, x, p, 3)[1].mean() - (1 - p)) < 0.005


def test_keys_and_threshold():
    assert kd.seed_keys(0) != kd.seed_keys(1)
    assert all(0 <= k < 2**32 for k in kd.seed_keys(2**63 + 5))
    assert kd.keep_threshold(0.5) == 2**31
    assert kd.keep_threshold(1 - 1e-12) == 2**32 - 1
