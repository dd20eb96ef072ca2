"""Releasing Numba's OpenMP workers before Python threads run (``run_tasks``)."""

from __future__ import annotations

import threading

import numba
import numpy as np
import pytest
from numba import njit, prange

from minidl.kernels import parallel


@njit(parallel=True)
def _bump(a):
    for i in prange(a.size):
        a[i] += 1


def test_release_lets_the_pool_go_and_the_next_kernel_starts_it_again():
    a = np.zeros(1 << 14, np.float32)
    _bump(a)
    if numba.threading_layer() != "omp" or numba.get_num_threads() < 2:
        pytest.skip("needs Numba's omp threading layer with at least two threads")
    pause = parallel._omp_pause_function()
    assert pause is not None  # found through Numba's omp layer
    assert pause(1) == 0  # the runtime accepted the soft pause of this thread's pool
    parallel.release_parallel_workers()
    _bump(a)  # the next parallel kernel starts the pool again
    np.testing.assert_array_equal(a, 2)


def test_run_tasks_results_with_the_release(monkeypatch):
    released = []
    release = parallel.release_parallel_workers
    monkeypatch.setattr(parallel, "release_parallel_workers",
                        lambda: (released.append(1), release()))
    arrays = np.zeros((6, 1 << 14), np.float32)
    _bump(arrays[0])
    order, lock = [], threading.Lock()

    def task(k):
        def run(wid):
            with lock:
                order.append(k)
            _bump(arrays[k])  # a parallel kernel on a worker thread too
        return run

    tasks = [(k, [k - 1] if k % 2 else [], task(k)) for k in range(6)]
    parallel.run_tasks(tasks, 2)
    assert sorted(order) == list(range(6)) and released == [1]
    assert all(order.index(k) > order.index(k - 1) for k in range(1, 6, 2))
    np.testing.assert_array_equal(arrays[:, 0], [2, 1, 1, 1, 1, 1])
    assert (arrays == arrays[:, :1]).all()
    parallel.run_tasks(tasks[:1], 1)  # one worker: nothing to release
    assert released == [1]
