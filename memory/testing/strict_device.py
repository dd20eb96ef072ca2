"""A strict test device whose arrays behave as CuPy's do where it matters, on the CPU.

The GPU path cannot run here (no GPU), but everything above the kernels — layers, losses,
optimizers, codecs, the executor, the trainer — can be driven with arrays that obey CuPy's
rules, checked against the installed ``cupy`` package itself:

* no implicit conversion to NumPy: ``__array__`` raises ``TypeError`` (as CuPy's does), so
  ``np.array(x)``, ``np.asarray(x)``, a Numba CPU kernel, or mixing with a host array fails;
* every NumPy ufunc, ufunc method and function reaching an array (``__array_ufunc__``,
  ``__array_function__``) and every method called on one is looked up in ``cupy`` (the same
  name resolution CuPy uses) and its keyword arguments are checked against CuPy's: signatures
  read with ``inspect`` or from the Cython docstrings, and for ufuncs by calling the real CuPy
  ufunc, which rejects unknown keywords before touching a device;
* host (NumPy) arrays are refused as operands, indices and assigned values; host data moves
  only by the explicit ``get()`` / ``set()`` / ``copy_from_host`` / ``fetch_async``;
* reductions return 0-d arrays, not scalars; ``float()`` / ``int()`` / ``bool()`` work on
  one-element arrays (a synchronising read, as in CuPy);
* every array a call creates is a device allocation: it comes from the allocator routed by
  :meth:`StrictCudaDevice.route_allocations` (the pool, as CuPy's allocator would under
  ``route_cupy_allocations``), or else is counted in :attr:`StrictCudaDevice.default_pool_bytes`
  (CuPy's own pool, outside the arena);
* kernels run on a recorded compute stream and copies on a copy stream
  (:class:`~.stream_model.StreamModel`): a copy that reads a block before its producer, or a
  prefetch into a block a queued kernel still reads, raises :class:`~.stream_model.StreamRace`;
  the pinned host buffers the copies read and write are tracked too (a host-to-device copy
  reading a buffer an unfinished device-to-host copy still writes is a race);
* what a GPU step costs the host is counted: :attr:`StrictCudaDevice.host_syncs` (every
  ``float()``, ``get()``, ``synchronize()`` or wait on a copy: the host stops until the device
  catches up) and :attr:`StrictCudaDevice.launches` (array operations that write or make an
  array, and kernel launches, on the compute stream; views and reshapes launch nothing);
* ``device_id=N`` with N > 0 is a second GPU: an array operation issued while another device is
  current (CuPy's current device, per thread; :meth:`StrictCudaDevice.activate` makes this one
  current) raises, as it would run on the wrong GPU.

The data live in a NumPy arena, so results are exact and comparable with the CPU device.

Here is the device itself (the arena, allocations, the current device, running a checked
call); the array type and its ``xp`` are in :mod:`.strict_array`, the copies and fetches on the
recorded streams in :mod:`.strict_copies`, CuPy's API as the oracle in :mod:`.strict_oracle`
(their names stay importable from here).
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from ..devices.device import as_shape, check_view
from ..ir.names import DeviceKind
from ..ir.units import ALLOCATION_UNIT, format_size, parse_size
from .stream_model import StreamModel
from .strict_array import StrictArray, StrictNamespace
from .strict_copies import (
    StrictCopyEngine,
    StrictHostResult,
    _host_range,
)
from .strict_oracle import StrictCupyError, _cupy, cupy_available

__all__ = ["StrictArray", "StrictCudaDevice", "StrictCupyError", "cupy_available"]


class _Temp:
    """A device allocation backing arrays created by calls (returned to its allocator)."""

    __slots__ = ("release", "__weakref__")

    def __init__(self, release: Callable[[], None] | None) -> None:
        self.release = release

    def __del__(self) -> None:
        if self.release is not None:
            self.release()


#: CuPy's current device per thread (the strict devices' stand-in for cudaSetDevice).
_CURRENT = threading.local()


def _current_device() -> int:
    return getattr(_CURRENT, "device", 0)


class StrictCudaDevice:
    """A CUDA-kind device for tests: CuPy-strict arrays over a host arena (module docstring).

    ``copy_waits_for_compute=False`` turns off the event the copy stream waits on before each
    copy (what the CUDA device does), so tests can show the races it prevents. ``device_id``
    is the GPU it stands for (see the module docstring).
    """

    name = "cuda-strict"
    kind = DeviceKind.CUDA
    has_storage = True
    asynchronous = True

    def __init__(self, capacity: int | str = "256MiB", pinned_capacity: int | str = "1GiB",
                 copy_waits_for_compute: bool = True, device_id: int = 0) -> None:
        _cupy()
        self.device_id = int(device_id)
        #: Times the host waited for the device (a synchronising read, a wait on a copy, ...).
        self.host_syncs = 0
        #: Array operations and kernel launches issued on the compute stream.
        self.launches = 0
        self.capacity = parse_size(capacity)
        self.pinned_capacity = parse_size(pinned_capacity)
        raw = np.zeros(self.capacity + ALLOCATION_UNIT, dtype=np.uint8)
        shift = (-raw.ctypes.data) % ALLOCATION_UNIT
        self._arena: np.ndarray = raw[shift:shift + self.capacity]
        self._base = self._arena.ctypes.data
        self.xp = StrictNamespace(self)
        self.streams = StreamModel()
        self.copy_waits_for_compute = copy_waits_for_compute
        self.copies_complete_at_once = True
        self._allocate: Callable[[int], tuple[np.ndarray, Callable[[], None]]] | None = None
        #: Bytes CuPy's own pool would hold now (allocations made outside a routed scope).
        self.default_pool_bytes = 0
        self.default_pool_peak = 0
        #: Calls checked against CuPy (for tests: proof that the device was exercised).
        self.checked_calls = 0
        self._copy_engine: StrictCopyEngine | None = None

    # -- the device interface
    def view(self, offset: int, nbytes: int, shape: Any, dtype: Any = np.float32) -> StrictArray:
        dtype = np.dtype(dtype)
        shape = as_shape(shape)
        check_view(self, offset, nbytes, shape, dtype)
        count = math.prod(shape)
        data = self._arena[offset:offset + count * dtype.itemsize].view(dtype).reshape(shape)
        return StrictArray(data, self)

    def host_empty(self, shape: Any, dtype: Any = np.float32) -> np.ndarray:
        return np.empty(as_shape(shape), np.dtype(dtype))

    def fill(self, offset: int, nbytes: int, value: int | float) -> None:
        self.launches += 1
        self.streams.issue("compute", (), ((offset, offset + nbytes),), "a fill")
        region = self._arena[offset:offset + nbytes]
        if isinstance(value, float) and math.isnan(value):
            n4 = nbytes // 4
            region[:4 * n4].view(np.float32)[:] = np.nan
            region[4 * n4:] = 0xFF
        else:
            region[:] = int(value)

    @property
    def copy_engine(self) -> StrictCopyEngine:
        if self._copy_engine is None:
            self._copy_engine = StrictCopyEngine(self)
        return self._copy_engine

    def synchronize(self) -> None:
        self.host_syncs += 1
        self.streams.synchronize()

    @contextlib.contextmanager
    def activate(self) -> Iterator[None]:
        """Make this device CuPy's current device on this thread within the block."""
        previous = _current_device()
        _CURRENT.device = self.device_id
        try:
            yield
        finally:
            _CURRENT.device = previous

    def _check_current(self, what: str) -> None:
        current = _current_device()
        if current != self.device_id:
            raise StrictCupyError(f"{what} on cuda:{self.device_id} ran while cuda:{current} was "
                                  "CuPy's current device: it would run on the wrong GPU (make "
                                  "the device current with its activate())")

    def close(self) -> None:
        if self._copy_engine is not None:
            self._copy_engine.close()

    def __enter__(self) -> StrictCudaDevice:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"StrictCudaDevice(capacity={format_size(self.capacity)!r})"

    # -- explicit transfers
    def copy_from_host(self, dst: StrictArray, src: np.ndarray) -> None:
        """Host-to-device copy into ``dst`` queued on the compute stream from pinned staging
        (as :meth:`~.cuda_device.CudaDevice.copy_from_host`: the host does not wait)."""
        host = np.ascontiguousarray(src, dtype=dst.dtype).reshape(dst.shape)
        self._check_current("an upload")
        self.streams.issue("compute", _host_range(host), self._ranges((dst,)), "an upload")
        np.copyto(dst._a, host)

    def fetch_async(self, src: StrictArray) -> StrictHostResult:
        """A device-to-host copy queued on the compute stream (as
        :meth:`~.cuda_device.CudaDevice.fetch_async`): reading its result before the host has
        waited for that point of the stream counts a host synchronisation."""
        self._check_current("a fetch")
        host = np.empty(src.shape, src.dtype)
        self.streams.issue("compute", self._ranges((src,)), _host_range(host), "a fetch")
        np.copyto(host, src._a)
        return StrictHostResult(self, host, self.streams.record("compute"))

    def outside_arena(self) -> dict[str, int]:
        """What CuPy's own pool would hold beside the arena (temporaries made outside a routed
        scope): now and at most."""
        return {"cupy_pool": self.default_pool_bytes, "cupy_pool_peak": self.default_pool_peak,
                "total": self.default_pool_bytes}

    # -- CuPy's allocator
    @contextlib.contextmanager
    def route_allocations(self, allocate: Callable[[int], tuple[int, Callable[[], None]]]
                          ) -> Iterator[None]:
        """Within the block, arrays created by calls take their bytes from ``allocate``
        (``nbytes -> (arena offset, release)``), as CuPy's allocator does under
        :meth:`~.cuda_device.CudaDevice.route_allocations`."""

        def take(nbytes: int) -> tuple[np.ndarray, Callable[[], None]]:
            offset, release = allocate(nbytes)
            if offset < 0 or offset + nbytes > self.capacity:
                raise ValueError(f"allocator returned offset {offset} for {nbytes} bytes, "
                                 f"outside the arena of {self.capacity} bytes")
            return self._arena[offset:offset + nbytes], release

        previous = self._allocate
        self._allocate = take
        try:
            yield
        finally:
            self._allocate = previous

    def _new_buffer(self, nbytes: int) -> tuple[np.ndarray, _Temp]:
        if self._allocate is not None:
            raw, release = self._allocate(nbytes)
            return raw, _Temp(release)
        rounded = -(-max(nbytes, 1) // 512) * 512
        self.default_pool_bytes += rounded
        self.default_pool_peak = max(self.default_pool_peak, self.default_pool_bytes)

        def release() -> None:
            self.default_pool_bytes -= rounded

        return np.empty(nbytes, np.uint8), _Temp(release)

    # -- running a call
    def _ranges(self, arrays: tuple) -> tuple[tuple[int, int], ...]:
        out = []
        base, end = self._base, self._base + self.capacity
        for a in arrays:
            if not isinstance(a, StrictArray) or a.size == 0:
                continue
            lo, hi = np.lib.array_utils.byte_bounds(a._a)
            if base <= lo < end:
                out.append((lo - base, hi - base))
        return tuple(out)

    def _sync_read(self, a: StrictArray) -> None:
        self.host_syncs += 1
        self.streams.synchronize()

    def _host_write(self, a: StrictArray) -> None:
        self.host_syncs += 1
        self.streams.synchronize()
        self.streams.issue("compute", (), self._ranges((a,)), "a host-to-device set()")

    def _unwrap(self, x: Any, host_ok: bool, where: str, found: list) -> Any:
        if isinstance(x, StrictArray):
            found.append(x)
            return x._a
        if isinstance(x, np.ndarray) and not host_ok:
            raise StrictCupyError(
                f"{where}: a NumPy array (shape {x.shape}) given to a device operation: CuPy "
                "refuses host arrays (copy it to the device explicitly)")
        if isinstance(x, (list, tuple)):
            items = [self._unwrap(v, host_ok, where, found) for v in x]
            return type(x)(items) if isinstance(x, tuple) else items
        return x

    def _run(self, where: str, fn: Callable, args: tuple, kwargs: dict, outs: tuple,
             receiver: StrictArray | None = None, host_inputs_ok: bool = False) -> Any:
        self._check_current(where)
        self.checked_calls += 1
        found: list[StrictArray] = [] if receiver is None else [receiver]
        a = self._unwrap(tuple(args), host_inputs_ok, where, found)
        k = {key: self._unwrap(v, host_inputs_ok, where, found) for key, v in kwargs.items()}
        out_ids = {id(o) for o in outs}
        reads = self._ranges(tuple(x for x in found if id(x) not in out_ids))
        writes = self._ranges(tuple(outs))
        result = fn(*a, **k)
        wrapped = self._wrap(result, found, outs)
        new = [w for w in (wrapped if isinstance(wrapped, tuple) else (wrapped,))
               if isinstance(w, StrictArray) and w._owner is not None and
               isinstance(w._owner, _Temp)]
        self.streams.issue("compute", reads, writes + self._ranges(tuple(new)), where)
        if outs or new:  # (a view or a reshape launches nothing)
            self.launches += 1
        return wrapped

    def _wrap(self, result: Any, found: list[StrictArray], outs: tuple) -> Any:
        if isinstance(result, tuple):
            return tuple(self._wrap(r, found, outs) for r in result)
        if isinstance(result, np.generic):
            result = np.asarray(result)  # CuPy returns 0-d arrays, never NumPy scalars
        if not isinstance(result, np.ndarray):
            return result
        for o in outs:
            if isinstance(o, StrictArray) and result is o._a:
                return o
        for x in found:
            if result.size and np.shares_memory(result, x._a):
                return StrictArray(result, self, x._owner if x._owner is not None else x)
        raw, owner = self._new_buffer(result.nbytes)
        data = raw[:result.nbytes].view(result.dtype).reshape(result.shape) \
            if result.nbytes else np.empty(result.shape, result.dtype)
        np.copyto(data, result)
        return StrictArray(data, self, owner)
