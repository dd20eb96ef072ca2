"""Thread policy of the CPU kernels: one pool (Numba's), single-threaded BLAS under it.

Measured on 2-core machines (BENCHMARKS.md, CPU threads): two thread pools on the same cores
(Numba's and a multi-threaded OpenBLAS, whose idle threads keep spinning) made a smallcnn step
3x slower (61 ms against 20 ms). The conv and pool kernels therefore cut the batch into
:func:`num_threads` contiguous chunks and run one serial ``@njit`` kernel per chunk inside a
``prange`` (Numba's OpenMP pool wakes in microseconds; a Python thread pool took ~130 us per
call after idling); their matrix products are Numba's ``np.dot`` on one thread.

:func:`configure_blas` puts NumPy's and SciPy's OpenBLAS on one thread. The kernels call it
once on first use (:func:`ensure_blas_policy`), with the count :func:`set_thread_policy` gave
(1 by default). This module reads no environment variable: ``minidl`` passes the
``MINIDL_NUM_THREADS`` / ``MINIDL_BLAS_THREADS`` settings in (see ``minidl/settings.py``).
Where threads add up partial results, the parts are fixed by the shapes, never by the
thread count (the conv kernels' gradient parts), and BLAS never runs multi-threaded: a
multi-threaded OpenBLAS cuts each product by its thread count, which changed the bits on AMD
EPYC. So results are bit-identical whatever the thread count (on one CPU model: BLAS kernels
differ between CPU models).

For ops made of matrix products and serial loops only (the fused RNN layers),
:func:`run_tasks` runs a dependency graph of tasks on a few Python threads, each calling
single-threaded BLAS; it first lets Numba's idle OpenMP workers go
(:func:`release_parallel_workers`), which otherwise spin on the cores those threads need.
"""

from __future__ import annotations

import ctypes
import glob
import importlib.util
import os
import threading
import time
from typing import Any

import numba
import numpy as np
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

try:  # Numba's own type key of call arguments (what its dispatcher looks overloads up by)
    from numba._dispatcher import compute_fingerprint as _type_key
except ImportError:  # pragma: no cover - a Numba without it: the slower public typeof
    def _type_key(args: tuple) -> object:
        return numba.typeof(args)


class _ThreadPolicy:
    """The process's thread counts (set through :func:`set_thread_policy`)."""

    num_threads: int | None = None  # None: Numba's thread count
    blas_threads = 1
    blas_configured = False
    omp_pause: Any = None  # omp_pause_resource_all of Numba's OpenMP runtime, once looked up
    omp_pause_looked_up = False


def set_thread_policy(num_threads: int | None = None, blas_threads: int = 1) -> None:
    """Set the threads the kernels split work over (``None``: Numba's thread count) and the
    BLAS thread count (applied now if BLAS was configured already, else on first use).
    Process-wide, like ``numba.set_num_threads``; kernels taking ``threads=`` ignore it."""
    if num_threads is not None and num_threads < 1:
        raise ValueError(f"num_threads must be at least 1, got {num_threads}")
    if blas_threads < 1:
        raise ValueError(f"blas_threads must be at least 1, got {blas_threads}")
    _ThreadPolicy.num_threads = num_threads
    if blas_threads != _ThreadPolicy.blas_threads:
        _ThreadPolicy.blas_threads = blas_threads
        if _ThreadPolicy.blas_configured:
            configure_blas(blas_threads)


def num_blas_threads() -> int:
    """The BLAS thread count of the policy (:func:`set_thread_policy`)."""
    return _ThreadPolicy.blas_threads


def num_threads() -> int:
    """Threads the kernels split work over: the count :func:`set_thread_policy` set, else
    Numba's thread count."""
    n = _ThreadPolicy.num_threads
    return max(1, n if n is not None else numba.get_num_threads())


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


def split(n_items: int, parts: int, work: int, serial_below: int, force: bool = False
          ) -> np.ndarray | None:
    """Bounds (``int64``, ``chunks + 1`` entries) cutting ``n_items`` into up to ``parts``
    chunks for a parallel launch, or ``None``: run serially on the calling thread.

    Serial when ``parts`` is 1 or ``work`` is below ``serial_below``, unless ``force``: a
    launch costs microseconds on idle cores but stalls for milliseconds when another process
    holds one of them, which small calls (gradient checks, tiny layers) cannot amortise.
    """
    if not force and (parts <= 1 or work < serial_below):
        return None
    return np.array([0] + [b for _, b in chunks(max(n_items, 1), parts)], np.int64)


def run_pages(serial, par, arrays: tuple, n: int, serial_below: int) -> None:
    """An elementwise kernel over ``n`` elements: ``serial(*arrays, 0, n)`` on the calling
    thread, or ``par(*arrays, bounds)`` with the elements cut into whole 4 KiB pages (1024
    elements) per thread, so that threads never share a cache line (see :func:`split`)."""
    bounds = split(n // 1024, num_threads(), n, serial_below)
    if bounds is None:
        serial(*arrays, 0, n)
    else:
        bounds *= 1024
        bounds[-1] = n
        par(*arrays, bounds)


def _openblas_libraries() -> list[str]:
    """Paths of the OpenBLAS builds bundled with the NumPy and SciPy wheels (Linux, macOS)."""
    paths: list[str] = []
    for pkg in ("numpy", "scipy"):
        spec = importlib.util.find_spec(pkg)
        if spec is None or not spec.submodule_search_locations:
            continue
        pkg_dir = list(spec.submodule_search_locations)[0]
        root = os.path.dirname(pkg_dir)
        paths += glob.glob(os.path.join(root, f"{pkg}.libs", "*openblas*"))
        paths += glob.glob(os.path.join(pkg_dir, ".dylibs", "*openblas*"))
    return paths


def configure_blas(threads: int = 1) -> None:
    """Set the thread count of NumPy's and SciPy's BLAS (process-wide).

    Uses ``threadpoolctl`` when installed (any BLAS vendor), else the bundled OpenBLAS
    libraries directly; silently does nothing where neither applies.
    """
    try:
        from threadpoolctl import ThreadpoolController

        ThreadpoolController().select(user_api="blas").limit(limits=threads)
        return
    except Exception:  # pragma: no cover - threadpoolctl missing or failing
        pass
    for path in _openblas_libraries():  # pragma: no cover - exercised without threadpoolctl
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for name in ("scipy_openblas_set_num_threads64_", "scipy_openblas_set_num_threads",
                     "openblas_set_num_threads64_", "openblas_set_num_threads"):
            setter = getattr(lib, name, None)
            if setter is not None:
                setter(ctypes.c_int(threads))
                break


def ensure_blas_policy() -> None:
    """Apply :func:`configure_blas` once per process (with the policy's BLAS thread count)."""
    if _ThreadPolicy.blas_configured:
        return
    _ThreadPolicy.blas_configured = True
    # Numba's np.dot binds SciPy's BLAS: load it now so that it is configured too.
    try:
        import scipy.linalg.cython_blas  # noqa: F401
    except ImportError:  # pragma: no cover
        pass
    configure_blas(_ThreadPolicy.blas_threads)


#: ``omp_pause_soft`` of OpenMP 5.0's ``omp_pause_resource_t``.
_OMP_PAUSE_SOFT = 1


def _omp_pause_function() -> Any:
    """``omp_pause_resource_all`` of the OpenMP runtime Numba's ``omp`` threading layer runs on
    (looked up through that layer's library, whose dependencies include the runtime), or
    ``None``: another layer, no ``prange`` kernel run yet, or a runtime without it."""
    if _ThreadPolicy.omp_pause_looked_up:
        return _ThreadPolicy.omp_pause
    try:
        layer = numba.threading_layer()
    except ValueError:  # no parallel kernel has run: nothing spins, look again next time
        return None
    _ThreadPolicy.omp_pause_looked_up = True
    if layer == "omp":
        try:
            from numba.np.ufunc import omppool

            fn = ctypes.CDLL(omppool.__file__).omp_pause_resource_all
            fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
            _ThreadPolicy.omp_pause = fn
        except (ImportError, OSError, AttributeError):  # pragma: no cover - other builds
            pass
    return _ThreadPolicy.omp_pause


def release_parallel_workers() -> None:
    """Let the idle workers of Numba's OpenMP pool go (``omp_pause_resource_all``, soft)
    before Python threads take the cores: after a parallel region, GNU libgomp's workers spin
    for 300,000 rounds (3-8 ms measured here) and held a core from the fused RNN layers'
    second lane, which started its first task 2.4 ms late (0.4 ms with this). The next
    ``prange`` kernel starts the pool again (~0.1 ms, twice per RNN training step). Only
    the calling thread's pool is released, and nothing when it is not the ``omp`` layer."""
    fn = _omp_pause_function()
    if fn is not None:
        fn(_OMP_PAUSE_SOFT)


def critical_path_order(tasks: list, durations: dict) -> list:
    """``tasks`` (as :func:`run_tasks` takes them) reordered by their longest path to the end
    of the graph (list scheduling's HLFET priority): a task's path is its own duration plus
    its longest successor's, durations from ``durations`` (key -> seconds, e.g. measured by
    an earlier :func:`run_tasks`; 1 where unknown). Ties keep the given order. The order
    never changes results (:func:`run_tasks`), only how soon the work ends."""
    index = {key: i for i, (key, _, _) in enumerate(tasks)}
    succ: list[list[int]] = [[] for _ in tasks]
    indegree = [0] * len(tasks)
    for i, (_, deps, _) in enumerate(tasks):
        for d in deps:
            succ[index[d]].append(i)
            indegree[i] += 1
    order = [i for i in range(len(tasks)) if indegree[i] == 0]
    for i in order:  # Kahn's topological order (the list grows while it is walked)
        for j in succ[i]:
            indegree[j] -= 1
            if indegree[j] == 0:
                order.append(j)
    if len(order) != len(tasks):
        raise ValueError("critical_path_order: the dependencies have a cycle")
    path = [0.0] * len(tasks)
    for i in reversed(order):
        path[i] = durations.get(tasks[i][0], 1.0) + max((path[j] for j in succ[i]),
                                                        default=0.0)
    return [tasks[i] for i in sorted(range(len(tasks)), key=lambda i: (-path[i], i))]


class _TaskList:
    """The shared state of one :func:`run_tasks` call: the tasks not yet taken (in priority
    order), those running and done, and the errors, all under one condition variable."""

    def __init__(self, tasks: list, durations: dict | None) -> None:
        self.pending = list(tasks)
        self.done: set = set()
        self.running: set = set()
        self.failed: list[BaseException] = []
        self.cond = threading.Condition()
        self.durations = durations

    def _take(self):
        """The first pending task whose dependencies are done, marked running (or None)."""
        for i, (key, deps, fn) in enumerate(self.pending):
            if all(d in self.done for d in deps):
                del self.pending[i]
                self.running.add(key)
                return key, fn
        return None

    def _next(self):
        """(Holding ``cond``) the next task to run, waiting while none is ready; None once
        all are taken or one failed."""
        while True:
            if self.failed or not self.pending:
                return None
            job = self._take()
            if job is not None:
                return job
            if not self.running:  # nothing runs and nothing is ready: a bug
                self.failed.append(RuntimeError("run_tasks: unsatisfiable tasks"))
                self.cond.notify_all()
                return None
            self.cond.wait()

    def work(self, wid: int) -> None:
        """Worker ``wid``'s loop: take a ready task, run it, mark it done, until none is
        left or one failed."""
        while True:
            with self.cond:
                job = self._next()
            if job is None:
                return
            key, fn = job
            start = time.perf_counter()
            try:
                fn(wid)
            except BaseException as e:  # noqa: BLE001 - re-raised on the calling thread
                with self.cond:
                    self.failed.append(e)
                    self.cond.notify_all()
                return
            with self.cond:
                if self.durations is not None:
                    self.durations[key] = time.perf_counter() - start
                self.running.discard(key)
                self.done.add(key)
                self.cond.notify_all()


def run_tasks(tasks: list, workers: int, durations: dict | None = None) -> None:
    """Run ``tasks`` — (key, dependency keys, fn(worker id)) in priority order — on
    ``workers`` threads (the calling one included): each free worker takes the first task
    whose dependencies are done (list scheduling). Results depend only on the dependencies,
    never on the interleaving. Errors stop the others and propagate. Meant for ops of large
    matrix products and serial Numba loops (the fused RNN layers), each worker keeping BLAS
    single-threaded: the one-pool policy of this module, with the pool being these threads.
    ``durations`` (a dict): each task's run time in seconds is stored there under its key
    (for :func:`critical_path_order` next time).
    """
    state = _TaskList(tasks, durations)
    if workers > 1:
        release_parallel_workers()
    threads = [threading.Thread(target=state.work, args=(w,), daemon=True)
               for w in range(1, workers)]
    for th in threads:
        th.start()
    state.work(0)
    for th in threads:
        th.join()
    if state.failed:
        raise state.failed[0]


# ----------------------------------------------------------------------------- threaded rows
@intrinsic
def _call_address(typingctx, address, args, t, threads):
    """Call the compiled Numba function at ``address`` (its native entry, Numba's calling
    convention) with ``*args, t, threads``; its signature must be exactly those types."""
    if not isinstance(address, types.Integer) or not isinstance(args, types.BaseTuple):
        return None
    argtys = tuple(args.types) + (types.int64, types.int64)
    sig = types.void(address, args, types.int64, types.int64)

    def codegen(context, builder, signature, llargs):
        addr, packed, tv, nv = llargs
        values = [builder.extract_value(packed, i) for i in range(len(args.types))]
        fnty = context.call_conv.get_function_type(types.none, argtys)
        fn = builder.inttoptr(addr, fnty.as_pointer())
        status, _ = context.call_conv.call_function(builder, fn, types.none, argtys,
                                                    values + [tv, nv])
        with cgutils.if_unlikely(builder, status.is_error):
            context.call_conv.return_status_propagate(builder, status)
        return context.get_dummy_value()

    return sig, codegen


@njit(nogil=True, cache=True, parallel=True)
def _run_rows(address, threads, args):
    for t in prange(threads):
        _call_address(address, args, np.int64(t), np.int64(threads))


class ThreadedKernel:
    """A serial ``@njit(nogil=True)`` kernel whose last two parameters are ``t, threads`` (it
    does thread ``t``'s share of the work), run on Numba's pool: ``run(threads, *args)``.

    The ``prange`` driver calls the kernel through its compiled address instead of as a
    Numba function. A jitted function that calls another links the callee's code into its
    own and LLVM optimises all of it again: the conv kernels' ``prange`` drivers took 13-17 s
    each to compile (per dtype, on top of the kernel's own 11 s, and again per driver), about
    a third of the test suite's cold compile time. Through the address the driver compiles
    once per argument types in about a second and never again when the kernel changes, and
    the serial and the threaded path run the same machine code (so the same bits)."""

    def __init__(self, kernel) -> None:
        self.kernel = kernel
        self._addresses: dict = {}  # argument types -> the kernel's address for them

    def _address(self, args: tuple) -> int:
        key = _type_key(args)
        address = self._addresses.get(key)
        if address is None:
            argtys = tuple(numba.typeof(a) for a in args) + (types.int64, types.int64)
            self.kernel.compile(argtys)
            cres = self.kernel.overloads[argtys]
            address = cres.library.get_pointer_to_function(cres.fndesc.llvm_func_name)
            self._addresses[key] = address
        return address

    def run(self, threads: int, *args) -> None:
        """``kernel(*args, t, threads)`` for ``t`` in ``range(threads)``, in parallel (one
        thread: on the calling thread, no launch)."""
        if threads == 1:
            self.kernel(*args, 0, 1)
        else:
            _run_rows(self._address(args), threads, args)
