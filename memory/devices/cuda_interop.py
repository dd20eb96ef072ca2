"""CuPy itself: importing it when a CUDA device is built, and routing its own allocations
(temporaries of CuPy's functions) to arena bytes of a pool instead of CuPy's caching pool.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

__all__ = ["CUDA_INSTALL_HINT", "pool_allocator", "route_allocations"]

#: How to install the GPU stack, for error messages: the extra matching the driver's CUDA.
CUDA_INSTALL_HINT = ("pip install 'minidl[cuda13]' or 'minidl[cuda12]', the one matching the "
                     "\"CUDA Version\" nvidia-smi prints (over a CuPy already installed: pip "
                     "install --no-deps -e .)")


def _import_cupy() -> Any:
    try:
        import cupy
    except ImportError as e:
        raise RuntimeError(
            f"the cuda device needs CuPy, which is not installed: {CUDA_INSTALL_HINT}; or use "
            "the cpu or meta device") from e
    try:
        ok = bool(cupy.cuda.is_available())
    except Exception:  # a broken driver or runtime counts as unavailable
        ok = False
    if not ok:
        raise RuntimeError("CuPy is installed but no CUDA device is available "
                           "(cupy.cuda.is_available() is False); use the cpu or meta device")
    return cupy


class _Release:
    """Owner of a CuPy temporary: calls ``release`` when CuPy drops the memory."""

    __slots__ = ("release",)

    def __init__(self, release: Any) -> None:
        self.release = release

    def __del__(self) -> None:
        self.release()


@contextlib.contextmanager
def route_allocations(device: Any, allocate: Any) -> Iterator[None]:
    """Within the block, CuPy's own allocations *on this thread* take arena bytes of
    ``device`` (a :class:`~.cuda_device.CudaDevice`) from ``allocate`` (``nbytes -> (offset,
    release)``; ``cupy.cuda.using_allocator``); the previous allocator is restored on exit and
    temporaries still alive then are released when CuPy frees them."""
    cp = device._cp
    base = device.base_ptr
    device_id = device.device_id

    def cupy_allocator(nbytes: int) -> Any:
        offset, release = allocate(nbytes)
        mem = cp.cuda.UnownedMemory(base + offset, nbytes, _Release(release), device_id)
        return cp.cuda.MemoryPointer(mem, 0)

    # per thread (CuPy's set_allocator is process-wide: other threads' temporaries would land
    # in this pool, which is not thread-safe; and it refuses to run inside using_allocator)
    with cp.cuda.using_allocator(cupy_allocator):
        yield


def pool_allocator(pool: Any) -> Any:
    """``nbytes -> (offset, release)`` over ``pool`` (workspace blocks tagged "cupy.temp");
    the release is deferred to the pool's next call, since CuPy may free from a finalizer in
    the middle of another pool call."""

    def allocate(nbytes: int) -> tuple[int, Any]:
        block = pool.allocate(max(nbytes, 1), tag="cupy.temp", category="workspace")
        return block.offset, lambda: pool.free_deferred(block)

    return allocate
