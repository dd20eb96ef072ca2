"""Dispatch by array type, and launching the Numba CUDA kernels of the codec modules.

Importing this module does not import ``numba.cuda``: the first real CUDA launch does, so
``minidl.kernels`` imports on machines without CUDA. The kernel modules keep their CUDA kernels
as plain functions that refer to a module-level global ``cuda`` (and, for device functions, to
globals named in :func:`bind`); :func:`bind` wraps each in a :class:`Kernel` that keeps the
Python function and makes the Numba CUDA dispatcher on first use. The Numba CUDA simulator
(``NUMBA_ENABLE_CUDASIM=1``) swaps exactly such a ``cuda`` global for its fake module, so the
same source runs there on small inputs.

CUDA kernels avoid the ``min`` / ``max`` builtins on integers (in this Numba they resolve to an
overload that fails to type in CUDA code) and use conditional expressions instead. Their work
is written as grid-stride loops, so any launch shape covers it.

Device arrays are CuPy arrays, Numba device arrays, anything else with
``__cuda_array_interface__``, the simulator's fake device arrays, and *emulated* device arrays
(below). Temporaries are allocated like the caller's array: through its
``__array_namespace__()`` when it has one, with CuPy for CuPy arrays (so they go through
whatever allocator CuPy uses, e.g. minidl's pool), else with ``numba.cuda.device_array``.

Launching (:func:`launch`, :func:`run`, and :func:`launch_blocks` for kernels of one thread
block per item, whose threads share the item's work through :func:`block_sum_py`):

* CuPy arrays run on CuPy's current stream unless a stream is given: the kernel is launched on
  ``numba.cuda.external_stream(cupy.cuda.get_current_stream().ptr)``, so it is ordered after
  the CuPy work queued before it, and each CuPy argument is passed as
  ``numba.cuda.as_cuda_array(a, sync=False)``. Handing Numba the CuPy array itself would make it
  synchronise the host with the stream exported in the array's ``__cuda_array_interface__``,
  once per argument and launch; a ``cupy.cuda.Stream`` given as ``stream`` is wrapped the same
  way. Numba attaches to the CUDA context current on the thread when it is first used (the
  primary context of CuPy's current device: make ``cuda:N`` current before the first launch).
* Numba device arrays (and the simulator's) run on ``stream`` as given (default: stream 0).
* Emulated device arrays: an object with a method ``__emulated_device_buffer__()`` (returning
  the NumPy array that holds its data) is a device array for :func:`choose`, and a launch with
  such arguments runs the kernel's Python function on the host buffers as ONE CUDA thread (its
  grid-stride loops then cover all the work), compiled with ``numba.njit`` after its global
  ``cuda`` is replaced by a single-thread module (``grid(1) = 0``, ``gridsize(1) = 1``, thread
  and block index 0, block and grid size 1, ``syncthreads`` a no-op, ``shared.array`` /
  ``local.array`` host arrays, ``atomic.add`` read-add-write, ``popc``) and its device
  functions by njit versions (:mod:`._cuda_emulation`). This lets a strict test device (arrays
  that behave as CuPy's but live on the host) run the same kernel code without a GPU.

:func:`compile_ptx` compiles a kernel to PTX for a chosen compute capability without a GPU
(NVVM and libdevice come from the CUDA toolkit wheels, found by ``cuda-pathfinder``).
"""

from __future__ import annotations

import contextlib
import functools
import math
import sys
import threading
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np

from ._cuda_emulation import _rebind, _single_thread

IMPLS = ("auto", "numpy", "numba", "cuda")
cuda: Any = None  # numba.cuda once a real CUDA kernel is made (read by the kernels below)


def _emulated(a: Any) -> bool:
    return hasattr(type(a), "__emulated_device_buffer__")


def _is_cupy(a: Any) -> bool:
    return type(a).__module__.partition(".")[0] == "cupy"


def is_device_array(a: Any) -> bool:
    """True for CuPy / Numba / emulated device arrays (and the simulator's), False for host
    arrays. Looks at the type only: it never reads a property that could touch the device."""
    if isinstance(a, np.ndarray) or a is None:
        return False
    t = type(a)
    return (hasattr(t, "__cuda_array_interface__") or hasattr(t, "__emulated_device_buffer__")
            or t.__module__.startswith("numba.cuda.simulator"))


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


def flat(a: Any, what: str = "out") -> Any:
    """Flat view of a C-contiguous array (a device array's ``reshape`` could otherwise copy)."""
    if not a.flags["C_CONTIGUOUS"]:
        raise ValueError(f"{what} must be C-contiguous")
    return a.reshape(-1)


# ----------------------------------------------------------------------------- device memory
def empty(like: Any, count: int, dtype: Any) -> Any:
    """A flat device array on the same kind of allocator as ``like``: its array namespace's
    ``empty`` when it has one, CuPy for CuPy arrays, else Numba."""
    if hasattr(type(like), "__array_namespace__"):
        return like.__array_namespace__().empty(count, dtype)
    if _is_cupy(like):
        import cupy

        return cupy.empty(count, dtype)
    return load().device_array(count, dtype)


def to_host(a: Any) -> np.ndarray:
    """Copy a device array to a new NumPy array (Numba's ``copy_to_host`` or CuPy's ``get``)."""
    return a.copy_to_host() if hasattr(a, "copy_to_host") else a.get()


def from_host(dst: Any, src: np.ndarray) -> None:
    """Copy the NumPy array ``src`` into the device array ``dst`` (same shape)."""
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


# ----------------------------------------------------------------------------- kernels
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


#: Environment switch of Numba's on-disk cache for the CUDA kernels (``1``: on). Off by default:
#: the cache is keyed on the kernel's own source file, so a device function edited in another
#: module would be served stale. benchmarks/gpu/check.sh turns it on for one fresh checkout, so
#: the kernels its parallel smoke workers compile are loaded, not compiled again, by each later
#: stage's process.
_DISK_CACHE = {"enabled": False}


def set_disk_cache(enabled: bool) -> None:
    """Compile the CUDA kernels made from now on into Numba's disk cache (``MINIDL_CUDA_CACHE``
    through :class:`minidl.settings.Settings`, applied where a trainer is made)."""
    _DISK_CACHE["enabled"] = bool(enabled)


def disk_cache_options() -> dict[str, Any]:
    """Keyword arguments of ``numba.cuda.jit`` for a kernel: ``cache=True`` once
    :func:`set_disk_cache` turned the cache on (never under the simulator, which has none)."""
    if _DISK_CACHE["enabled"] and not simulator():
        return {"cache": True}
    return {}


class Kernel:
    """A CUDA kernel written as a plain function ``py_func`` of a kernel module.

    ``device`` maps the globals the kernel calls as device functions to the names of the Python
    functions implementing them. The Numba CUDA dispatcher (:attr:`dispatcher`) is made on first
    use; ``kernel[blocks, threads, stream]`` launches it. :meth:`emulate` runs it on the host
    as one CUDA thread.
    """

    def __init__(self, py_func: Callable, globs: dict[str, Any],
                 device: dict[str, str] | None = None) -> None:
        self.py_func = py_func
        self.globs = globs
        self.device = dict(device or {})
        self._dispatcher: Any = None
        self._emulation: Any = None
        self._lock = threading.Lock()
        #: True once launched on a GPU (its compile and load errors are checked until then).
        self.launched = False

    def __repr__(self) -> str:
        return f"<Kernel {self.py_func.__module__}.{self.py_func.__name__}>"

    @property
    def dispatcher(self) -> Any:
        """``numba.cuda.jit`` of the function (its module's ``cuda`` and device globals set)."""
        if self._dispatcher is not None:
            return self._dispatcher
        with self._lock:
            if self._dispatcher is None:
                c = load()
                self.globs["cuda"] = c
                for name, src in self.device.items():
                    if self.globs.get(name) is None:
                        self.globs[name] = c.jit(device=True)(self.globs[src])
                self._dispatcher = c.jit(self.py_func, **disk_cache_options())
            return self._dispatcher

    def __getitem__(self, config: tuple) -> Any:
        return self.dispatcher[config]

    def emulate(self, *args: Any) -> None:
        """Run the kernel as one CUDA thread on the host buffers of emulated device arrays.
        The first argument whose type has ``__emulated_launch__(kernel_name)`` hears of the
        launch once (a device counting its launches)."""
        hook = next((a for a in args if hasattr(type(a), "__emulated_launch__")), None)
        if hook is not None:
            hook.__emulated_launch__(self.py_func.__name__)
        host = []
        for a in args:
            if _emulated(a):
                host.append(a.__emulated_device_buffer__())
            elif isinstance(a, np.ndarray) or is_device_array(a):
                raise TypeError(f"{self!r}: a launch with emulated device arrays got a "
                                f"{type(a).__name__}")
            else:
                host.append(a)
        with self._lock:
            if self._emulation is None:
                self._emulation = _single_thread(self.py_func, self.device)
        self._emulation(*host)


def bind(globs: dict[str, Any], names: list[str],
         device: dict[str, str] | None = None) -> SimpleNamespace:
    """A :class:`Kernel` for each named function of a kernel module (``globs``: its globals),
    as attributes named without the leading underscore; ``device`` as in :class:`Kernel`.

    The module's ``cuda`` global is set here when ``numba.cuda`` is already imported (so its
    functions compile with ``numba.cuda.compile_ptx`` as they are), else on first launch.
    """
    if globs.get("cuda") is None and "numba.cuda" in sys.modules:
        globs["cuda"] = load()
    return SimpleNamespace(**{n.lstrip("_"): Kernel(globs[n], globs, device) for n in names})


def grid(work: int, threads: int = 256) -> tuple[int, int]:
    """Launch shape ``(blocks, threads)`` for ``work`` items handled by grid-stride loops.

    Under the simulator (one Python thread per CUDA thread) it stays at most ``[4, 32]``.
    """
    if simulator():
        return max(1, min(4, math.ceil(work / 32))), 32
    return max(1, min(4096, math.ceil(work / threads))), threads


#: Threads of a block-per-item launch at most (the length of its kernels' shared arrays).
BLOCK = 256
#: Blocks of a launch at most (grid-stride loops cover the rest).
MAX_BLOCKS = 4096


def block_threads(width: int) -> int:
    """Threads of a block whose threads share ``width`` elements (a row, a channel): a power of
    two from 32 to :data:`BLOCK` (32 under the simulator, whose threads are Python threads)."""
    if simulator():
        return 32
    threads = 32
    while threads < width and threads < BLOCK:
        threads *= 2
    return threads


def item_blocks(items: int) -> int:
    """Blocks of a launch with one block per item (row, channel, tile) of ``items``, at most
    :data:`MAX_BLOCKS` (4 under the simulator)."""
    return max(1, min(items, 4 if simulator() else MAX_BLOCKS))


def _launch_args(args: tuple, stream: Any) -> tuple[tuple, Any]:
    """Arguments and stream for a Numba launch: CuPy arrays as Numba views without a host
    synchronisation, on CuPy's current stream unless ``stream`` is given."""
    if not any(_is_cupy(a) for a in args):
        return args, 0 if stream is None else stream
    c = load()
    if stream is None:
        import cupy

        stream = cupy.cuda.get_current_stream()
    if _is_cupy(stream):
        stream = c.external_stream(stream.ptr)
    return tuple(c.as_cuda_array(a, sync=False) if _is_cupy(a) else a for a in args), stream


#: What a machine needs for Numba CUDA kernels, for error messages.
TOOLCHAIN_HINT = ("numba-cuda needs libNVVM no newer than the driver's CUDA version (nvidia-smi's "
                  "\"CUDA Version\"): pip install 'minidl[cuda13]' (CUDA 13.0 NVVM) or "
                  "'minidl[cuda12]'")


class ToolchainError(RuntimeError):
    """Numba could not compile or load a CUDA kernel on this machine (NVVM missing or newer
    than the driver, no numba-cuda, ...)."""


def _toolchain_errors() -> tuple[type, ...]:
    from numba.core.errors import NumbaError

    errors: list[type] = [NumbaError, OSError, ImportError]
    try:
        from numba.cuda.cudadrv import error as cuda_errors
        errors += [cuda_errors.CudaSupportError, cuda_errors.NvvmError,
                   cuda_errors.NvvmSupportError]
    except ImportError:
        pass
    return tuple(errors)


def run(kernel: Kernel, blocks: int, threads: int, *args: Any, stream: Any = None) -> None:
    """Launch ``kernel[blocks, threads, stream](*args)`` as described in the module notes
    (``stream=None``: CuPy's current stream for CuPy arrays, else stream 0; emulated device
    arrays: one host thread). A kernel Numba cannot compile or load on this machine raises
    :class:`ToolchainError` saying what to install."""
    if any(_emulated(a) for a in args):
        kernel.emulate(*args)
        return
    args, stream = _launch_args(args, stream)
    if getattr(kernel, "launched", False):
        kernel[blocks, threads, stream](*args)
        return
    try:
        kernel[blocks, threads, stream](*args)
    except _toolchain_errors() as e:
        raise ToolchainError(f"Numba could not compile or load the CUDA kernel "
                             f"{kernel.py_func.__name__} ({type(e).__name__}: "
                             f"{str(e).splitlines()[0] if str(e) else ''}); {TOOLCHAIN_HINT}"
                             ) from e
    kernel.launched = True


def toolchain_problem() -> str | None:
    """Why Numba CUDA kernels cannot run on this machine's GPU (CuPy's current device), or
    ``None`` when a trivial kernel compiles, loads and runs there. Needs CuPy and a GPU."""
    try:
        import cupy

        a = cupy.zeros(4, np.float32)
        launch(_kernels().k_fill_probe, a.size, a, np.float32(2.0))
        if float(a.sum()) != 8.0:
            return "a trivial Numba CUDA kernel ran but wrote wrong values"
    except ToolchainError as e:
        return str(e)
    except Exception as e:  # noqa: BLE001 -- any failure is the answer
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return None


def launch(kernel: Kernel, work: int, *args: Any, stream: Any = None) -> None:
    """:func:`run` ``kernel`` on ``grid(work)`` (nothing when ``work`` is 0)."""
    if work <= 0:
        return
    run(kernel, *grid(work), *args, stream=stream)


def launch_blocks(kernel: Kernel, items: int, width: int, *args: Any,
                  stream: Any = None) -> None:
    """:func:`run` ``kernel`` with one block per item of ``items`` (grid-stride over them) and
    :func:`block_threads` of ``width`` threads per block; nothing when ``items`` is 0."""
    if items <= 0:
        return
    run(kernel, item_blocks(items), block_threads(width), *args, stream=stream)



# ----------------------------------------------------------------------------- PTX
@contextlib.contextmanager
def _current_device_cc(cc: tuple[int, int]) -> Iterator[None]:
    """While compiling, answer Numba's "current device" query with compute capability ``cc``.

    Numba compiles the device functions a kernel calls for the current device, which a machine
    without a GPU lacks; ``compile_ptx`` itself takes ``cc`` as an argument.
    """
    from numba.cuda import dispatcher

    saved = dispatcher.get_current_device
    dispatcher.get_current_device = lambda: SimpleNamespace(compute_capability=cc)
    try:
        yield
    finally:
        dispatcher.get_current_device = saved


_PTX_LOCK = threading.Lock()


def compile_ptx(kernel: Kernel, argtypes: tuple, cc: tuple[int, int]) -> str:
    """PTX of ``kernel`` for the Numba types ``argtypes`` on compute capability ``cc``.

    Needs no GPU, only NVVM (the CUDA toolkit wheels of the ``cuda`` extra). The device
    functions are compiled afresh for ``cc``.
    """
    c = load()
    over: dict[str, Any] = {"cuda": c}
    for name, src in kernel.device.items():
        over[name] = c.jit(device=True)(_rebind(kernel.py_func.__globals__[src], over))
    with _PTX_LOCK, _current_device_cc(cc):
        ptx, _ = c.compile_ptx(_rebind(kernel.py_func, over), argtypes, cc=cc)
    return ptx


def block_sum_py(part):
    """Device function: sum of ``part[:blockDim.x]`` (float64) in a fixed tree order, returned
    to every thread of the block (all of them call it; ``part`` may be written again as soon as
    it returns). A kernel module binds it as a device function (``bind``'s ``device=``)."""
    tid = cuda.threadIdx.x
    width = cuda.blockDim.x
    cuda.syncthreads()
    while width > 1:
        half = (width + 1) // 2
        if tid < width - half:
            part[tid] += part[tid + half]
        cuda.syncthreads()
        width = half
    total = part[0]
    cuda.syncthreads()
    return total


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


def _k_fill_probe(a, value):
    """``a[:] = value`` (the toolchain probe of :func:`toolchain_problem`)."""
    for i in range(cuda.grid(1), a.size, cuda.gridsize(1)):
        a[i] = value


@functools.cache
def _kernels() -> SimpleNamespace:
    return bind(globals(), ["_k_exclusive_scan", "_k_fill_probe"])


def exclusive_scan(counts: Any, offsets: Any, stream: Any = None) -> None:
    """Device exclusive prefix sum of ``counts`` (n) into ``offsets`` (n + 1, last = total)."""
    threads = 32 if simulator() else 1024
    run(_kernels().k_exclusive_scan, 1, threads, counts, offsets, counts.size, stream=stream)
