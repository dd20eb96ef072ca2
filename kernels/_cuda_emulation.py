"""The one-thread stand-in for ``numba.cuda`` that emulated launches compile against (see
:mod:`._cuda`'s notes on emulated device arrays): a kernel's Python function compiled with
``numba.njit`` after its global ``cuda`` is replaced by a module of one CUDA thread
(``grid(1) = 0``, ``gridsize(1) = 1``, thread and block index 0, block and grid size 1,
``syncthreads`` a no-op, ``shared.array`` / ``local.array`` host arrays, ``atomic.add``
read-add-write, ``popc``) and its device functions by njit versions."""

from __future__ import annotations

import collections
import inspect
import os
import threading
import types
from collections.abc import Callable
from typing import Any

import numpy as np


def _rebind(fn: Callable, overrides: dict[str, Any]) -> Callable:
    """``fn`` with the same code over a copy of its globals updated with ``overrides``."""
    return types.FunctionType(fn.__code__, {**fn.__globals__, **overrides}, fn.__name__,
                              fn.__defaults__, fn.__closure__)


def _st_grid(ndim):
    return 0  # one-dimensional launches only (the kernels use grid(1))


def _st_gridsize(ndim):
    return 1


def _st_syncthreads():
    pass


def _st_empty(shape, dtype):
    return np.empty(shape, dtype)


def _st_zeros(shape, dtype):
    return np.zeros(shape, dtype)


def _st_atomic_add(ary, idx, val):
    old = ary[idx]
    ary[idx] = old + val
    return old


def _st_popc(x):
    n = 0
    while x:
        x &= x - 1
        n += 1
    return n


_ST_MODULE: types.ModuleType | None = None
_ST_LOCK = threading.Lock()


def _single_thread_cuda() -> types.ModuleType:
    """The module ``cuda`` is replaced by in emulated kernels (built once)."""
    global _ST_MODULE
    with _ST_LOCK:
        if _ST_MODULE is None:
            from numba import njit

            dim3 = collections.namedtuple("Dim3", "x y z")
            m = types.ModuleType("minidl_single_thread_cuda", "numba.cuda as one CUDA thread")
            m.grid, m.gridsize = njit(_st_grid), njit(_st_gridsize)
            m.syncthreads, m.popc = njit(_st_syncthreads), njit(_st_popc)
            m.threadIdx = m.blockIdx = dim3(0, 0, 0)
            m.blockDim = m.gridDim = dim3(1, 1, 1)
            for name, fn in (("shared", _st_empty), ("local", _st_zeros)):
                sub = types.ModuleType(f"{m.__name__}.{name}")
                sub.array = njit(fn)
                setattr(m, name, sub)
            m.atomic = types.ModuleType(f"{m.__name__}.atomic")
            m.atomic.add = njit(_st_atomic_add)
            _ST_MODULE = m
        return _ST_MODULE


def _single_thread(fn: Callable, device: dict[str, str]) -> Callable:
    """``numba.njit`` of kernel ``fn`` over the one-thread ``cuda`` and njit device functions,
    its machine code kept in Numba's disk cache (:func:`_disk_cached`)."""
    from numba import njit

    fake = {"cuda": _single_thread_cuda()}
    for name, src in device.items():
        fake[name] = njit(_rebind(fn.__globals__[src], fake))
    sources = [fn, *(fn.__globals__[src] for src in device.values())]
    return _disk_cached(njit(_rebind(fn, fake)), sources)


def _disk_cached(dispatcher: Any, sources: list[Callable]) -> Any:
    """``dispatcher`` (an emulated kernel) loading from and saving to Numba's disk cache, as the
    ``@njit(cache=True)`` kernels do, so that each process (pytest workers, CLI runs) does not
    compile every emulated kernel again.

    Its entries are apart from the kernel's own (``<kernel>-emulated`` files) and are valid only
    while none of the files its code comes from has changed: the kernel's module, the modules
    of its device functions and this module (the one-thread ``cuda``). A kernel Numba cannot
    cache stays compiled in memory only, silently.
    """
    from numba.core.caching import CompileResultCacheImpl, FunctionCache

    files = sorted({inspect.getfile(f) for f in sources} | {__file__})

    class Impl(CompileResultCacheImpl):
        def get_filename_base(self, fullname: str, abiflags: str) -> str:
            return super().get_filename_base(fullname + "-emulated", abiflags)

        def check_cachable(self, cres: Any) -> bool:
            return not cres.lifted and not cres.library.has_dynamic_globals

    class Cache(FunctionCache):
        _impl_class = Impl

        def __init__(self, py_func: Callable) -> None:
            super().__init__(py_func)
            stamp = tuple((os.stat(f).st_mtime, os.stat(f).st_size) for f in files)
            self._cache_file._source_stamp = stamp  # the index is valid for these files only

    try:
        dispatcher._cache = Cache(dispatcher.py_func)
    except Exception:  # noqa: BLE001 -- no cache folder Numba can use: compile in memory
        pass
    return dispatcher
