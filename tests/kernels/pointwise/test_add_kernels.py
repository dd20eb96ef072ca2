"""kernels.add: the two-thread sum and copy against NumPy, in place, and the fallbacks."""

from __future__ import annotations

import numpy as np
import pytest

from minidl.kernels.pointwise import add as A


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n", [0, 5, 70001, 1 << 18])  # serial and split over the threads
def test_add_and_copy_match_numpy(dtype, n):
    rng = np.random.default_rng(n)
    a, b = rng.standard_normal(n).astype(dtype), rng.standard_normal(n).astype(dtype)
    out = np.full(n, 7, dtype)
    A.add(a, b, out)
    assert np.array_equal(out, a + b)
    want = a + b
    A.add(a, b, a)  # in place over the first operand
    assert np.array_equal(a, want)
    dst = np.empty_like(b)
    A.copy(b, dst)
    assert np.array_equal(dst, b)


def test_other_arrays_go_to_numpy():
    x = np.arange(12.0).reshape(3, 4)[:, ::2]  # not contiguous
    out = np.empty((3, 2))
    A.add(x, x, out)
    assert np.array_equal(out, 2 * x)
    h = np.ones(4, np.float16)
    A.add(h, h, h)
    assert h.dtype == np.float16 and h.tolist() == [2.0] * 4
    i = np.arange(4)
    A.copy(i, out.reshape(-1)[:4].view(np.int64))  # integers: NumPy's copyto
