"""Shared pytest setup: the ``gpu`` marker is skipped where no GPU can run minidl's CUDA path.

A GPU test needs CuPy with a CUDA device *and* Numba CUDA able to compile and load kernels
there (libNVVM present and no newer than the driver's CUDA): without the second, every test
launching a Numba kernel (max pooling, the codecs, ...) would fail instead of skipping. The
reason printed with the skip says which is missing.
"""

from __future__ import annotations

import functools

import pytest


@functools.cache
def gpu_problem() -> str | None:
    """Why the GPU tests cannot run here, or ``None`` when they can."""
    try:
        import cupy

        if not cupy.cuda.is_available():
            return "no CUDA device (cupy.cuda.is_available() is false)"
    except Exception as e:  # noqa: BLE001 -- not installed, or a broken driver
        return f"no usable CuPy ({type(e).__name__}: {e})"
    from minidl.kernels._cuda import toolchain_problem

    problem = toolchain_problem()
    return None if problem is None else f"Numba CUDA cannot run kernels here: {problem}"


def pytest_collection_modifyitems(config, items):
    if not any("gpu" in item.keywords for item in items):
        return
    why = gpu_problem()
    if why is None:
        return
    skip_gpu = pytest.mark.skip(reason=why)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
