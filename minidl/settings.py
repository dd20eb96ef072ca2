"""Process settings, and the one place minidl reads the environment.

Every option below is also an argument (``Trainer(debug=..., threads=...)``,
:func:`minidl.kernels.parallel.set_thread_policy`); the environment only supplies the
defaults when a user passes nothing. The variables:

``MINIDL_DEBUG_POOL``
    ``1`` (anything but empty or ``0``): every :class:`~minidl.Trainer` built without
    ``debug=`` poisons freed device bytes with float32 NaN, so a read of freed memory shows up
    as NaN. Read each time a Trainer is built.
``MINIDL_NUM_THREADS``
    Threads the CPU kernels split work over (default: Numba's thread count). Applied when a
    :class:`~minidl.Trainer` is built (it calls
    :func:`~minidl.kernels.parallel.set_thread_policy`; importing minidl leaves the process's
    threads alone); ``Trainer(threads=...)`` or ``set_thread_policy`` override it.
``MINIDL_BLAS_THREADS``
    Threads of NumPy's and SciPy's BLAS (default 1: one thread pool, Numba's, on the cores;
    a multi-threaded OpenBLAS also changes results by thread count). Applied by a Trainer too.
    This module imports nothing but the standard library, so that ``minidl/__init__.py`` can
    read it before NumPy loads.
``MINIDL_CUDA_CACHE``
    ``1``: compile the CUDA kernels into Numba's disk cache (off by default: a kernel module
    edited in place could be served stale); the GPU check turns it on so that the kernels its
    parallel smoke workers compile are loaded by the later stages. Applied by a Trainer, or
    :func:`minidl.kernels._cuda.set_disk_cache`.
``OMPI_COMM_WORLD_SIZE``, ``PMI_SIZE``
    Set by ``mpiexec`` (Open MPI; MPICH and Intel MPI): the number of ranks of the job. More
    than one makes ``minidl train`` train data-parallel over MPI
    (:mod:`minidl.distributed.data_parallel`).
``OPENBLAS_THREAD_TIMEOUT``
    Not read by minidl: *set* (to ``22`` unless already set) when ``minidl`` is imported, the
    one side effect of the import. OpenBLAS's idle workers spin ~2^28 cycles (~0.1 s) after
    each threaded call, which made the next Numba ``prange`` kernel 10x slower; 2^22 cycles
    (~1.5 ms) lets them sleep in time. OpenBLAS reads it when it loads, so it only has an
    effect if NumPy was not imported before minidl.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass

__all__ = ["OPENBLAS_THREAD_TIMEOUT", "Settings", "set_openblas_thread_timeout"]

#: Variables in which MPI launchers give each process the number of ranks of its job.
MPI_SIZE_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE")

#: Value given to ``OPENBLAS_THREAD_TIMEOUT`` at import unless the user set one.
OPENBLAS_THREAD_TIMEOUT = "22"


def _flag(value: str | None) -> bool:
    return value not in (None, "", "0")


def _count(environ: Mapping[str, str], name: str) -> int | None:
    value = environ.get(name, "").strip()
    if not value:
        return None
    try:
        n = int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r}: expected a positive whole number") from None
    if n < 1:
        raise ValueError(f"{name}={value!r}: expected a positive whole number")
    return n


@dataclass(frozen=True)
class Settings:
    """Options with a process-wide default: pool poisoning and thread counts.

    ``debug_pool``: poison freed device bytes with NaN. ``num_threads``: threads of the CPU
    kernels (``None``: Numba's count). ``blas_threads``: threads of NumPy's/SciPy's BLAS.
    ``mpi_ranks``: ranks of the MPI job this process was launched in by ``mpiexec`` (1 outside).
    ``cuda_disk_cache``: CUDA kernels compiled into Numba's disk cache.
    """

    debug_pool: bool = False
    num_threads: int | None = None
    blas_threads: int = 1
    mpi_ranks: int = 1
    cuda_disk_cache: bool = False

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> Settings:
        """The settings the ``MINIDL_*`` variables of the module docstring ask for."""
        env = os.environ if environ is None else environ
        return cls(debug_pool=_flag(env.get("MINIDL_DEBUG_POOL")),
                   num_threads=_count(env, "MINIDL_NUM_THREADS"),
                   blas_threads=_count(env, "MINIDL_BLAS_THREADS") or 1,
                   mpi_ranks=max(_count(env, v) or 1 for v in MPI_SIZE_VARIABLES),
                   cuda_disk_cache=env.get("MINIDL_CUDA_CACHE", "").strip() == "1")


def set_openblas_thread_timeout(environ: MutableMapping[str, str] | None = None) -> None:
    """Set ``OPENBLAS_THREAD_TIMEOUT`` unless it is set (see the module docstring)."""
    (os.environ if environ is None else environ).setdefault("OPENBLAS_THREAD_TIMEOUT",
                                                          OPENBLAS_THREAD_TIMEOUT)
