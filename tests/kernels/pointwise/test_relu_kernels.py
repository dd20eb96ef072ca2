"""ReLU kernels: the multi-threaded Numba loops against the NumPy references."""

from __future__ import annotations

import numpy as np
import pytest

from minidl.kernels.pointwise import relu as R


@pytest.mark.parametrize("dtype,shape", [
    (np.float64, (0,)), (np.float64, (7,)), (np.float64, (3, 5, 1000)),
    (np.float32, (3, 5, 1000)), (np.float32, (64, 32, 28, 28)), (np.float32, (70001,)),
])
def test_matches_reference_and_in_place(dtype, shape):
    rng = np.random.default_rng(0)
    x = rng.standard_normal(shape).astype(dtype)
    if x.size > 3:
        x.flat[:3] = [np.nan, 0.0, -0.0]
    want = np.empty_like(x)
    R.relu_forward_ref(x, want)
    got = np.full_like(x, 7)
    R.relu_forward(x, got)
    np.testing.assert_array_equal(got, want)
    y = x.copy()
    R.relu_forward(y, y)
    np.testing.assert_array_equal(y, want)

    dy = rng.standard_normal(shape).astype(dtype)
    want_dx = np.empty_like(dy)
    R.relu_backward_ref(dy, want, want_dx)
    dx = np.full_like(dy, 7)
    R.relu_backward(dy, want, dx)
    np.testing.assert_array_equal(dx, want_dx)
    R.relu_backward(dy, want, dy)
    np.testing.assert_array_equal(dy, want_dx)


def test_non_contiguous_uses_reference():
    x = np.random.default_rng(1).standard_normal((6, 8))[:, ::2]
    out = np.empty((6, 4))
    R.relu_forward(x, out)
    np.testing.assert_array_equal(out, np.maximum(x, 0))
    dx = np.empty((6, 8))[:, 1::2]
    R.relu_backward(x, out, dx)
    np.testing.assert_array_equal(dx, np.where(out > 0, x, 0))


def test_layer_backward_zero_is_positive_and_masks_nan_and_float16_falls_back():
    """The ReLU layer's backward (these kernels) gives +0.0 where the output is not positive,
    also for NaN or negative gradients there (PyTorch's threshold_backward does the same),
    and bits equal to Gist's packed-mask backward."""
    from minidl.kernels.codecs.bitpack import pack_sign, relu_backward_packed

    y = np.array([1.0, 0.0, 2.0, 0.0, 0.0] * 20000, np.float32)
    dy = np.array([-3.0, -2.0, np.nan, np.nan, 5.0] * 20000, np.float32)
    dx = np.empty_like(dy)
    R.relu_backward(dy, y, dx)
    assert np.array_equal(dx.view(np.uint32)[:5],
                          np.array([-3.0, 0.0, np.nan, 0.0, 0.0], np.float32).view(np.uint32))
    packed = relu_backward_packed(dy, pack_sign(y))
    assert np.array_equal(dx.view(np.uint32), packed.view(np.uint32))
    h = np.array([-1.0, 2.0], np.float16)
    out = np.empty_like(h)
    R.relu_forward(h, out)
    assert out.dtype == np.float16 and out.tolist() == [0.0, 2.0]
