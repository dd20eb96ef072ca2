"""ThreadedKernel: a serial kernel run per thread through its address, on Numba's pool."""

from __future__ import annotations

import numpy as np
import pytest
from numba import njit
from numba.core import event

from minidl.kernels.parallel import ThreadedKernel


@njit(nogil=True)
def _scale_rows(x, y, factor, bounds, t, threads):
    """Thread ``t`` of ``threads`` writes ``x * factor + t`` over its bounds."""
    for i in range(bounds[t], bounds[t + 1]):
        y[i] = x[i] * factor + t + 100 * threads


SCALE = ThreadedKernel(_scale_rows)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_each_thread_runs_its_share_with_its_index(dtype):
    x = np.arange(10, dtype=dtype)
    y = np.full(10, np.nan, dtype)
    bounds = np.array([0, 3, 7, 10], np.int64)
    SCALE.run(3, x, y, 2.0, bounds)
    want = x * 2 + np.repeat(np.arange(3), [3, 4, 3]) + 300
    np.testing.assert_array_equal(y, want.astype(dtype))
    SCALE.run(1, x, y, 3.0, np.array([0, 10], np.int64))  # on this thread
    np.testing.assert_array_equal(y, (x * 3 + 100).astype(dtype))


def test_argument_types_the_kernel_was_not_compiled_for_get_their_own_address():
    x = np.arange(6, dtype=np.float64)
    frozen = x.copy()
    frozen.flags.writeable = False  # another Numba type: a readonly array
    bounds = np.array([0, 3, 6], np.int64)
    y1, y2 = np.zeros(6), np.zeros(6)
    SCALE.run(2, x, y1, 1.0, bounds)
    SCALE.run(2, frozen, y2, 1.0, bounds)
    np.testing.assert_array_equal(y1, y2)
    assert len({SCALE._address((x, y1, 1.0, bounds)),
                SCALE._address((frozen, y2, 1.0, bounds))}) == 2


class _Compiled(event.Listener):
    def __init__(self) -> None:
        self.names: list[str] = []

    def on_start(self, ev: event.Event) -> None:
        self.names.append(ev.data["dispatcher"].py_func.__name__)

    def on_end(self, ev: event.Event) -> None:
        pass


def test_the_parallel_driver_never_compiles_the_kernel_again():
    x, y = np.arange(8, dtype=np.float32), np.zeros(8, np.float32)
    bounds = np.array([0, 4, 8], np.int64)
    SCALE.run(1, x, y, 1.0, np.array([0, 8], np.int64))  # the kernel compiled here
    listener = _Compiled()
    event.register("numba:compile", listener)
    try:
        SCALE.run(2, x, y, 1.0, bounds)
    finally:
        event.unregister("numba:compile", listener)
    assert "_scale_rows" not in listener.names
    np.testing.assert_array_equal(y, x + np.repeat([0, 1], 4) + 200)
