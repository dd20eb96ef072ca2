"""Dispatch by array type and lazily loaded Numba CUDA helpers for the codec kernels.

Importing this module does not import ``numba.cuda``: :func:`bind` does, the first time a CUDA
path runs, so ``minidl.kernels`` imports on machines without CUDA. The kernel modules keep
their CUDA kernels as plain functions that refer to a module-level global ``cuda`` and compile
them with :func:`bind` (the Numba CUDA simulator, ``NUMBA_ENABLE_CUDASIM=1``, swaps exactly
such a global for its fake module, so the same source runs there on small inputs).

CUDA kernels avoid the ``min`` / ``max`` builtins on integers (in this Numba they resolve to an
overload that fails to type in CUDA code) and use conditional expressions instead.

Device arrays are CuPy arrays, Numba device arrays, or anything else with
``__cuda_array_interface__`` (and the simulator's fake device arrays). Temporaries are
allocated with CuPy when the caller's array is a CuPy array (so they go through whatever
allocator CuPy uses, e.g. minidl's pool), else with ``numba.cuda.device_array``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import numpy as np

IMPLS = ("auto", "numpy", "numba", "cuda")
cuda: Any = None  # numba.cuda once bind() ran (read by the kernels below)


def is_device_array(a: Any) -> bool:
    """True for CuPy / Numba device arrays (and the simulator's), False for host arrays."""
    if isinstance(a, np.ndarray) or a is None:
        return False
    return hasattr(a, "__cuda_array_interface__") or type(a).__module__.startswith(
        "numba.cuda.simulator")


def choose(impl: str, *arrays: Any) -> str:
    """Resolve ``impl``: ``"auto"`` is ``"cuda"`` for device arrays, ``"numba"`` for host ones."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    on_dev = [is_device_array(a) for a in arrays if a is not None]
    if impl == "auto":
        if any(on_dev) and not all(on_dev):
            raise TypeError("mix of host and device arrays")
        return "cuda" if any(on_dev) else "numba"
    if impl == "cuda" and not all(on_dev):
        raise TypeError("impl='cuda' needs device arrays")
    if impl != "cuda" and any(on_dev):
        raise TypeError(f"impl={impl!r} needs host (NumPy) arrays")
    return impl


def byte_view(out: Any, nbytes: int, what: str = "out") -> Any:
    """First ``nbytes`` bytes of a C-contiguous host or device array, as flat ``uint8``."""
    if not out.flags["C_CONTIGUOUS"]:
        raise ValueError(f"{what} must be C-contiguous")
    if out.nbytes < nbytes:
        raise ValueError(f"{what} has {out.nbytes} bytes, {nbytes} needed")
    return out.reshape(-1).view(np.uint8)[:nbytes]


def typed_view(out: Any, dtype: Any, count: int, what: str = "out") -> Any:
    """First ``count`` items of ``dtype`` of a C-contiguous buffer (any dtype, enough bytes)."""
    dtype = np.dtype(dtype)
    if out.dtype == dtype and out.flags["C_CONTIGUOUS"] and out.size >= count:
        return out.reshape(-1)[:count]
    return byte_view(out, count * dtype.itemsize, what).view(dtype)


# ----------------------------------------------------------------------------- CUDA side
def load() -> Any:
    """``numba.cuda`` (imported on first call)."""
    global cuda
    if cuda is None:
        from numba import cuda as _cuda

        cuda = _cuda
    return cuda


def simulator() -> bool:
    """True under the Numba CUDA simulator."""
    from numba import config

    return bool(config.ENABLE_CUDASIM)


def bind(globs: dict[str, Any], names: list[str]) -> SimpleNamespace:
    """Set ``globs["cuda"]`` to ``numba.cuda`` and return ``cuda.jit`` of each named function."""
    globs["cuda"] = load()
    return SimpleNamespace(**{n.lstrip("_"): cuda.jit(globs[n]) for n in names})


def grid(work: int, threads: int = 256) -> tuple[int, int]:
    """Launch shape ``(blocks, threads)`` for ``work`` items handled by grid-stride loops.

    Under the simulator (one Python thread per CUDA thread) it stays at most ``[4, 32]``.
    """
    if simulator():
        return max(1, min(4, math.ceil(work / 32))), 32
    return max(1, min(4096, math.ceil(work / threads))), threads


def launch(kernel: Callable, work: int, *args: Any, stream: Any = 0) -> None:
    """Run ``kernel[grid(work)](*args)`` on ``stream`` (nothing when ``work`` is 0)."""
    if work <= 0:
        return
    blocks, threads = grid(work)
    kernel[blocks, threads, stream](*args)


def empty(like: Any, count: int, dtype: Any) -> Any:
    """A flat device array on the same kind of allocator as ``like`` (CuPy or Numba)."""
    if type(like).__module__.startswith("cupy"):
        import cupy

        return cupy.empty(count, dtype)
    return load().device_array(count, dtype)


def to_host(a: Any) -> np.ndarray:
    """Copy a device array to a NumPy array."""
    return a.get() if hasattr(a, "get") and not hasattr(a, "copy_to_host") else a.copy_to_host()


def from_host(dst: Any, src: np.ndarray) -> None:
    """Copy the NumPy array ``src`` into the device array ``dst`` (same size)."""
    if hasattr(dst, "copy_to_device"):
        dst.copy_to_device(src)
    else:
        dst.set(src)


def copy(dst: Any, src: Any) -> None:
    """Device-to-device copy of equally sized arrays."""
    if dst.size == 0:
        return
    if hasattr(dst, "copy_to_device"):
        dst.copy_to_device(src)
    else:
        dst[...] = src


def _k_exclusive_scan(counts, offsets, n):
    """One block: ``offsets[i] = sum(counts[:i])`` for ``i <= n`` (``offsets[n]`` = total)."""
    part = cuda.shared.array(1024, dtype=np.int64)
    tid = cuda.threadIdx.x
    nt = cuda.blockDim.x
    seg = (n + nt - 1) // nt
    lo = tid * seg if tid * seg < n else n  # (no min/max: see _cuda's notes)
    hi = lo + seg if lo + seg < n else n
    s = 0
    for i in range(lo, hi):
        s += counts[i]
    part[tid] = s
    cuda.syncthreads()
    if tid == 0:
        acc = 0
        for t in range(nt):
            v = part[t]
            part[t] = acc
            acc += v
        offsets[n] = acc
    cuda.syncthreads()
    acc = part[tid]
    for i in range(lo, hi):
        offsets[i] = acc
        acc += counts[i]


@functools.cache
def _kernels() -> SimpleNamespace:
    return bind(globals(), ["_k_exclusive_scan"])


def exclusive_scan(counts: Any, offsets: Any, stream: Any = 0) -> None:
    """Device exclusive prefix sum of ``counts`` (n) into ``offsets`` (n + 1, last = total)."""
    threads = 32 if simulator() else 1024
    _kernels().k_exclusive_scan[1, threads, stream](counts, offsets, counts.size)
