"""Batch splitting over a few threads that run serial, GIL-free Numba kernels.

Measured on 2-core machines (see PERFORMANCE-NOTES): one pool at a time is fastest. The conv
and pool kernels therefore never use ``parallel=True`` nor a multi-threaded BLAS: the caller
cuts the batch into ``num_threads()`` contiguous chunks, runs chunk 0 on its own thread and
the others on a small worker pool, each chunk being one ``@njit(nogil=True)`` call whose matrix
products go through Numba's ``np.dot`` (SciPy's BLAS, set to one thread here; NumPy's own BLAS,
used by other layers, is left alone). Chunking depends only on the batch size and the thread
count, so results are deterministic.
"""

from __future__ import annotations

import ctypes
import glob
import importlib.util
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

_MAX_THREADS = 8
_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_pool_size = 0
_blas_configured = False


def num_threads() -> int:
    """Threads the kernels split a batch over: ``MINIDL_NUM_THREADS`` or the usable cores."""
    env = os.environ.get("MINIDL_NUM_THREADS")
    if env:
        return max(1, int(env))
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        n = os.cpu_count() or 1
    return max(1, min(n, _MAX_THREADS))


def chunks(n: int, parts: int) -> list[tuple[int, int]]:
    """Split ``range(n)`` into at most ``parts`` contiguous, non-empty ``(start, stop)``."""
    parts = max(1, min(parts, n))
    step, extra = divmod(n, parts)
    out, start = [], 0
    for i in range(parts):
        stop = start + step + (1 if i < extra else 0)
        out.append((start, stop))
        start = stop
    return out


def _executor(workers: int) -> ThreadPoolExecutor:
    global _pool, _pool_size
    with _lock:
        if _pool is None or _pool_size < workers:
            if _pool is not None:
                _pool.shutdown(wait=True)
            _pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="minidl-kernel")
            _pool_size = workers
        return _pool


def run_chunks(fn: Callable[..., Any], args_per_chunk: Sequence[tuple]) -> None:
    """Call ``fn(*args)`` for every tuple, the first on this thread, the rest on workers.

    ``fn`` must release the GIL (``@njit(nogil=True)``) for the calls to overlap.
    """
    single_thread_numba_blas()
    if len(args_per_chunk) == 1:
        fn(*args_per_chunk[0])
        return
    pool = _executor(len(args_per_chunk) - 1)
    futures: list[Future] = [pool.submit(fn, *a) for a in args_per_chunk[1:]]
    try:
        fn(*args_per_chunk[0])
    finally:
        for f in futures:
            f.result()


def single_thread_numba_blas() -> None:
    """Set the BLAS behind Numba's ``np.dot`` (SciPy's bundled OpenBLAS) to one thread.

    Several kernel threads call it at once; a multi-threaded BLAS under them oversubscribes
    the cores (measured 1.7x slower). NumPy's BLAS is a different library and is not touched;
    when SciPy's BLAS cannot be found (other builds) nothing changes.
    """
    global _blas_configured
    if _blas_configured:
        return
    _blas_configured = True
    spec = importlib.util.find_spec("scipy")
    if spec is None or not spec.submodule_search_locations:
        return
    root = os.path.dirname(list(spec.submodule_search_locations)[0])
    paths = glob.glob(os.path.join(root, "scipy.libs", "*openblas*")) + glob.glob(
        os.path.join(root, "scipy", ".dylibs", "*openblas*")
    )
    for path in paths:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for name in ("scipy_openblas_set_num_threads", "openblas_set_num_threads"):
            setter = getattr(lib, name, None)
            if setter is not None:
                setter(ctypes.c_int(1))
                break
