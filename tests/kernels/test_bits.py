"""The NaN-aware bit comparison itself: any NaN meets any NaN, every other bit pattern counts."""

from __future__ import annotations

import numpy as np
import pytest
from bits import assert_same_bits


def _f32(*bits: int) -> np.ndarray:
    return np.array(bits, np.uint32).view(np.float32)


def test_nan_sign_and_payload_do_not_count():
    assert_same_bits(_f32(0xFFC00000, 0x3F800000), _f32(0x7FC00000, 0x3F800000))
    assert_same_bits(_f32(0x7FC00001), _f32(0x7F800001))  # quiet vs signalling payloads


@pytest.mark.parametrize("got, want", [
    (_f32(0x80000000), _f32(0x00000000)),   # -0.0 vs 0.0
    (_f32(0x00000001), _f32(0x00000000)),   # a flushed subnormal
    (_f32(0x7F800000), _f32(0x7FC00000)),   # inf vs NaN
    (_f32(0x7FC00000, 0), _f32(0, 0x7FC00000)),  # NaNs at other positions
    (_f32(0x3F800000), _f32(0x3F800001)),   # one ulp
])
def test_every_other_difference_fails(got, want):
    with pytest.raises(AssertionError):
        assert_same_bits(got, want)


def test_dtype_and_shape_must_match():
    with pytest.raises(AssertionError):
        assert_same_bits(np.zeros(2, np.float32), np.zeros(2, np.float64))
    with pytest.raises(AssertionError):
        assert_same_bits(np.zeros(2, np.float32), np.zeros((1, 2), np.float32))
