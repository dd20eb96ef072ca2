"""Timing helpers of the benchmark scripts.

PyTorch is never timed in the process that times minidl: the scripts build it in a
:class:`minidl.tools.child_process.ChildProcess` (the child process ``minidl bench
--compare-torch`` times PyTorch in) and alternate the two with
:func:`minidl.tools.child_process.alternate`, :func:`require_torch_absent` guarding the minidl
side. :func:`median_ms` and :func:`alternated_median_ms` time calls in one process.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from minidl.tools.child_process import ChildProcess

__all__ = ["ChildProcess", "alternated_median_ms", "median_ms", "require_torch_absent"]


def require_torch_absent() -> None:
    """Raise if PyTorch is imported in this process (the one that times minidl)."""
    if "torch" in sys.modules:
        raise RuntimeError("torch is imported in the process that times minidl; PyTorch must "
                           "run in a ChildProcess of its own")


def median_ms(step: Callable[[], Any], repeats: int, warmup: int = 2) -> float:
    """Median wall time (ms) of ``repeats`` calls of ``step`` after ``warmup`` untimed ones."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    return float(np.median(times)) * 1e3


def alternated_median_ms(calls: list[Callable[[], Any]], repeats: int,
                         warmup: int = 1) -> list[float]:
    """Median wall time (ms) of each of ``calls``, run in turn ``repeats`` times after
    ``warmup`` untimed rounds: in one process, each timed beside the others under the same
    load (an A/B of kernels on a noisy machine)."""
    for _ in range(warmup):
        for call in calls:
            call()
    times: list[list[float]] = [[] for _ in calls]
    for _ in range(repeats):
        for call, own in zip(calls, times):
            t = time.perf_counter()
            call()
            own.append(time.perf_counter() - t)
    return [float(np.median(own)) * 1e3 for own in times]
