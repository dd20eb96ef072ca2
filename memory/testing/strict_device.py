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
  only by the explicit ``get()`` / ``set()`` / ``copy_from_host`` / ``copy_to_host``;
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
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import re
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from ..devices.device import as_shape, check_view
from ..ir.units import ALLOCATION_UNIT, format_size, parse_size
from .stream_model import StreamEvent, StreamModel

__all__ = ["StrictArray", "StrictCudaDevice", "StrictCupyError", "cupy_available"]


class StrictCupyError(TypeError):
    """Code used a device array in a way CuPy would not accept."""


def cupy_available() -> bool:
    """True if the ``cupy`` package imports (no GPU needed)."""
    try:
        import cupy  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _cupy() -> Any:
    try:
        import cupy
    except ImportError as e:
        raise RuntimeError("the strict cuda test device reads CuPy's API from the cupy package, "
                           "which is not installed: pip install 'minidl[test]' (CuPy's API; "
                           "no GPU needed)") from e
    return cupy


# ----------------------------------------------------------------------------- API oracle
_DOC_SIG = re.compile(r"^[\w.]+\((.*?)\)")


@functools.cache
def _signature(fn: Any) -> inspect.Signature | None:
    """``fn``'s signature, from ``inspect`` or the first line of its (Cython) docstring."""
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):
        pass
    doc = (getattr(fn, "__doc__", None) or "").strip().splitlines()
    if not doc:
        return None
    m = _DOC_SIG.match(doc[0].strip())
    if m is None:
        return None
    try:
        return inspect.signature(eval(f"lambda {m.group(1)}: None", {}, {}))  # noqa: S307
    except Exception:
        return None


def _check_call(where: str, fn: Any, args: tuple, kwargs: dict, bound_self: bool) -> None:
    sig = _signature(fn)
    if sig is None:
        return
    try:
        if bound_self and next(iter(sig.parameters), None) == "self":
            sig.bind(None, *args, **kwargs)
        else:
            sig.bind(*args, **kwargs)
    except TypeError as e:
        raise StrictCupyError(f"{where}: CuPy's signature {sig} does not accept this call "
                              f"({e})") from None


@functools.cache
def _ufunc_accepts(name: str, method: str, keywords: tuple[tuple[str, Any], ...]) -> str | None:
    """Ask the real CuPy ufunc whether it takes these keywords (``None``) or why not.

    CuPy parses the keyword arguments before it touches a device, so a call with host scalars
    fails with ``TypeError`` naming the keywords if they are wrong, and with a CUDA error (no
    device here) or succeeds if they are right.
    """
    cp = _cupy()
    uf = getattr(cp, name, None)
    if uf is None:
        return f"cupy has no ufunc {name!r}"
    fn = uf if method == "__call__" else getattr(uf, method, None)
    if fn is None:
        return f"cupy.{name} has no method {method!r}"
    kwargs = dict(keywords)
    nin = getattr(uf, "nin", 2)
    args = (np.zeros(2, np.float32),) if method != "__call__" else (np.float32(1),) * nin
    try:
        fn(*args, **kwargs)
    except TypeError as e:
        msg = str(e)
        if "Wrong arguments" in msg or "unexpected keyword" in msg:
            return msg
    except Exception:
        pass
    return None


# ----------------------------------------------------------------------------- arrays
class _Temp:
    """A device allocation backing arrays created by calls (returned to its allocator)."""

    __slots__ = ("release", "__weakref__")

    def __init__(self, release: Callable[[], None] | None) -> None:
        self.release = release

    def __del__(self) -> None:
        if self.release is not None:
            self.release()


def _is_host_array(x: Any) -> bool:
    return isinstance(x, np.ndarray)


#: Host buffers' ranges in the stream model: their addresses moved above any arena offset.
_HOST_SPACE = 1 << 62
#: CuPy's current device per thread (the strict devices' stand-in for cudaSetDevice).
_CURRENT = threading.local()


def _current_device() -> int:
    return getattr(_CURRENT, "device", 0)


def _host_range(a: np.ndarray) -> tuple[tuple[int, int], ...]:
    """The bytes of a host array as a stream-model range (a space apart from the arena's)."""
    if a.size == 0:
        return ()
    lo, hi = np.lib.array_utils.byte_bounds(a)
    return ((_HOST_SPACE + lo, _HOST_SPACE + hi),)


class StrictArray:
    """A device array of a :class:`StrictCudaDevice` (see the module docstring)."""

    __slots__ = ("_a", "_dev", "_owner", "__weakref__")
    __array_priority__ = 100

    def __init__(self, data: np.ndarray, device: StrictCudaDevice, owner: Any = None) -> None:
        self._a = data
        self._dev = device
        self._owner = owner

    # -- what CuPy refuses
    def __array__(self, *args: Any, **kwargs: Any) -> np.ndarray:
        raise TypeError("Implicit conversion to a NumPy array is not allowed. "
                        "Please use `.get()` to construct a NumPy array explicitly.")

    # -- the dispatch protocols
    def __array_ufunc__(self, ufunc: np.ufunc, method: str, *inputs: Any, **kwargs: Any) -> Any:
        where = f"numpy.{ufunc.__name__}" + ("" if method == "__call__" else f".{method}")
        keys = tuple(sorted(((k, _kw_token(v)) for k, v in kwargs.items()), key=lambda kv: kv[0]))
        why = _ufunc_accepts(ufunc.__name__, method, keys)
        if why is not None:
            raise StrictCupyError(f"{where}: {why}")
        out = kwargs.get("out")
        outs = out if isinstance(out, tuple) else (() if out is None else (out,))
        return self._dev._run(where, getattr(ufunc, method) if method != "__call__" else ufunc,
                              inputs, kwargs, tuple(o for o in outs if o is not None))

    def __array_function__(self, func: Any, types: Any, args: tuple, kwargs: dict) -> Any:
        cp = _cupy()
        where = f"{func.__module__}.{func.__name__}"
        try:
            module = functools.reduce(getattr, func.__module__.split(".")[1:], cp)
            cupy_func = getattr(module, func.__name__)
        except AttributeError:
            raise StrictCupyError(f"{where}: CuPy has no such function") from None
        _check_call(where, cupy_func, args, kwargs, bound_self=False)
        out = kwargs.get("out")
        outs = (out,) if isinstance(out, StrictArray) else ()
        if func.__name__ == "copyto":
            outs = (args[0],) if args else (kwargs["dst"],)
        return self._dev._run(where, func, args, kwargs, outs)

    def __array_namespace__(self, api_version: str | None = None) -> StrictNamespace:
        return self._dev.xp

    def __emulated_device_buffer__(self) -> np.ndarray:
        """The backing NumPy array, for kernel-launch emulation (reads and writes it)."""
        rng = self._dev._ranges((self,))
        self._dev.streams.issue("compute", rng, rng, "a kernel launch")
        return self._a

    def __emulated_launch__(self, kernel: str) -> None:
        """A kernel is launched with this array among its arguments (once per launch)."""
        self._dev._check_current(f"kernel {kernel}")
        self._dev.launches += 1

    # -- attributes CuPy has
    shape = property(lambda self: self._a.shape)
    dtype = property(lambda self: self._a.dtype)
    ndim = property(lambda self: self._a.ndim)
    size = property(lambda self: self._a.size)
    nbytes = property(lambda self: self._a.nbytes)
    itemsize = property(lambda self: self._a.itemsize)
    strides = property(lambda self: self._a.strides)
    flags = property(lambda self: self._a.flags)

    @property
    def T(self) -> StrictArray:
        return StrictArray(self._a.T, self._dev, self)

    def __len__(self) -> int:
        return len(self._a)

    def __repr__(self) -> str:
        return f"StrictArray(shape={self.shape}, dtype={self.dtype})"

    def __getattr__(self, name: str) -> Any:
        cp = _cupy()
        cupy_method = getattr(cp.ndarray, name, None)
        if cupy_method is None or name.startswith("_"):
            raise AttributeError(f"cupy.ndarray has no attribute {name!r}")
        np_method = getattr(self._a, name)
        dev = self._dev
        if not callable(cupy_method):  # a property (real, imag, base, ...)
            if isinstance(np_method, np.ndarray):
                return StrictArray(np_method, dev, self)
            return np_method

        def call(*args: Any, **kwargs: Any) -> Any:
            where = f"cupy.ndarray.{name}"
            _check_call(where, cupy_method, args, kwargs, bound_self=True)
            out = kwargs.get("out")
            outs = (out,) if isinstance(out, StrictArray) else ()
            if name == "fill":
                outs = (self,)
            return dev._run(where, np_method, args, kwargs, outs, receiver=self)

        return call

    # -- explicit transfers (CuPy's API)
    def get(self, stream: Any = None, order: str = "C", out: np.ndarray | None = None,
            blocking: bool = True) -> np.ndarray:
        """A NumPy copy (a synchronising device-to-host copy)."""
        self._dev._sync_read(self)
        if out is not None:
            np.copyto(out, self._a)
            return out
        return self._a.copy(order=order)

    def set(self, arr: np.ndarray, stream: Any = None) -> None:
        """Copy the host array ``arr`` (same shape) into this array."""
        if not _is_host_array(arr):
            raise StrictCupyError(f"set() takes a NumPy array, got {type(arr).__name__}")
        if arr.shape != self.shape:
            raise ValueError(f"shape mismatch: {arr.shape} into {self.shape}")
        self._dev._host_write(self)
        np.copyto(self._a, arr, casting="unsafe")

    def item(self) -> Any:
        self._dev._sync_read(self)
        return self._a.item()

    def tolist(self) -> Any:
        self._dev._sync_read(self)
        return self._a.tolist()

    def _scalar(self, kind: type) -> Any:
        if self.size != 1:
            raise TypeError("only size-1 arrays can be converted to Python scalars")
        self._dev._sync_read(self)
        return kind(self._a.reshape(()))

    def __float__(self) -> float:
        return self._scalar(float)

    def __int__(self) -> int:
        return self._scalar(int)

    def __bool__(self) -> bool:
        return self._scalar(bool)

    def __index__(self) -> int:
        if not np.issubdtype(self.dtype, np.integer) or self.ndim != 0:
            raise TypeError("only integer scalar arrays can be converted to a scalar index")
        return self._scalar(int)

    def __iter__(self) -> Iterator[StrictArray]:
        for i in range(len(self)):
            yield self[i]

    # -- indexing
    def __getitem__(self, key: Any) -> Any:
        _check_index(key)
        return self._dev._run("cupy.ndarray.__getitem__", self._a.__getitem__, (key,), {}, (),
                              receiver=self)

    def __setitem__(self, key: Any, value: Any) -> None:
        _check_index(key)
        if _is_host_array(value):
            raise StrictCupyError(
                "assigning a NumPy array into a device array is an implicit host-to-device "
                "copy (CuPy refuses it): copy it explicitly with set() / copy_from_host")
        if isinstance(value, (list, tuple)):
            raise StrictCupyError("assigning a Python sequence into a device array is an "
                                  "implicit host-to-device copy (CuPy refuses it)")
        self._dev._run("cupy.ndarray.__setitem__", self._a.__setitem__, (key, value), {},
                       (self,), receiver=self)


def _kw_token(v: Any) -> Any:
    """A hashable stand-in for a keyword value: dtypes and strings as they are, else None."""
    if isinstance(v, type) and issubclass(v, np.generic):
        return np.dtype(v)
    if isinstance(v, (np.dtype, str, bool)):
        return v
    return None


def _check_index(key: Any) -> None:
    keys = key if isinstance(key, tuple) else (key,)
    for k in keys:
        if _is_host_array(k):
            raise StrictCupyError("indexing a device array with a NumPy array is an implicit "
                                  "host-to-device copy: put the index on the device")
        if isinstance(k, list):
            raise StrictCupyError("indexing a device array with a Python list is an implicit "
                                  "host-to-device copy: put the index on the device")


def _binary(ufunc: np.ufunc, reflected: bool = False) -> Callable:
    if reflected:
        return lambda self, other: ufunc(other, self)
    return lambda self, other: ufunc(self, other)


def _inplace(ufunc: np.ufunc) -> Callable:
    def op(self: StrictArray, other: Any) -> StrictArray:
        ufunc(self, other, out=self)
        return self

    return op


for _name, _uf in [("add", np.add), ("sub", np.subtract), ("mul", np.multiply),
                   ("truediv", np.true_divide), ("floordiv", np.floor_divide),
                   ("mod", np.remainder), ("pow", np.power), ("matmul", np.matmul),
                   ("and", np.bitwise_and), ("or", np.bitwise_or), ("xor", np.bitwise_xor),
                   ("lshift", np.left_shift), ("rshift", np.right_shift)]:
    setattr(StrictArray, f"__{_name}__", _binary(_uf))
    setattr(StrictArray, f"__r{_name}__", _binary(_uf, reflected=True))
    setattr(StrictArray, f"__i{_name}__", _inplace(_uf))
for _name, _uf in [("lt", np.less), ("le", np.less_equal), ("gt", np.greater),
                   ("ge", np.greater_equal), ("eq", np.equal), ("ne", np.not_equal)]:
    setattr(StrictArray, f"__{_name}__", _binary(_uf))
StrictArray.__neg__ = lambda self: np.negative(self)
StrictArray.__pos__ = lambda self: np.positive(self)
StrictArray.__abs__ = lambda self: np.absolute(self)
StrictArray.__invert__ = lambda self: np.invert(self)
StrictArray.__hash__ = None  # type: ignore[assignment]


# ----------------------------------------------------------------------------- namespace
class StrictNamespace:
    """The device's ``xp``: CuPy's module-level API over :class:`StrictArray` (checked)."""

    def __init__(self, device: StrictCudaDevice) -> None:
        self._dev = weakref.proxy(device)

    def __getattr__(self, name: str) -> Any:
        cp = _cupy()
        cupy_attr = getattr(cp, name, None)
        if cupy_attr is None or name.startswith("_"):
            raise AttributeError(f"cupy has no attribute {name!r}")
        np_attr = getattr(np, name, None)
        if np_attr is None:
            raise AttributeError(f"cupy.{name} has no NumPy counterpart to emulate it with")
        if not callable(np_attr) or isinstance(np_attr, type):
            return np_attr  # dtypes and constants
        dev = self._dev

        def call(*args: Any, **kwargs: Any) -> Any:
            where = f"cupy.{name}"
            if not isinstance(cupy_attr, np.ufunc):
                _check_call(where, cupy_attr, args, kwargs, bound_self=False)
            out = kwargs.get("out")
            outs = (out,) if isinstance(out, StrictArray) else ()
            return dev._run(where, np_attr, args, kwargs, outs, host_inputs_ok=name in (
                "asarray", "array"))

        return call


# ----------------------------------------------------------------------------- copies
class StrictCopyEvent:
    """A copy on the strict device's copy stream: ``wait()`` (host), ``order_compute()``."""

    def __init__(self, device: StrictCudaDevice, nbytes: int, event: StreamEvent) -> None:
        self.nbytes = nbytes
        self._dev = device
        self._event = event
        self.elapsed_s = 0.0

    def done(self) -> bool:
        return False if not self._dev.copies_complete_at_once else True

    def wait(self, timeout: float | None = None) -> None:
        """The host waits for the copy."""
        self._dev.host_syncs += 1
        self._dev.streams.host_wait(self._event)

    def order_compute(self) -> None:
        """Later compute work waits for this copy on the device (no host synchronisation)."""
        self._dev.streams.wait_event("compute", self._event)


class StrictHostResult:
    """A fetch of :meth:`StrictCudaDevice.fetch_async`: ``ready()`` once the host has waited
    for its point of the compute stream, ``result()`` (a host synchronisation if not)."""

    def __init__(self, device: StrictCudaDevice, host: np.ndarray, event: StreamEvent) -> None:
        self._dev, self._host, self._event = device, host, event

    def ready(self) -> bool:
        return self._dev.streams.host_reached(self._event)

    def result(self) -> np.ndarray:
        if not self.ready():
            self._dev.host_syncs += 1
            self._dev.streams.host_wait(self._event)
        return self._host


class StrictCopyEngine:
    """Copies on the recorded copy stream, ordered after the compute work issued before."""

    def __init__(self, device: StrictCudaDevice) -> None:
        self._dev = device
        self.total_bytes = 0
        self.num_copies = 0
        self.busy_s = 0.0
        self.closed = False

    def copy_async(self, dst: Any, src: Any) -> StrictCopyEvent:
        """Queue ``dst[...] = src`` (one side a device array, the other pinned host memory)."""
        dev = self._dev
        if dst.shape != src.shape or dst.dtype != src.dtype:
            raise ValueError(f"copy needs arrays of the same shape and dtype, got dst "
                             f"{dst.shape} {dst.dtype} and src {src.shape} {src.dtype}")
        streams = dev.streams
        d_dev, s_dev = isinstance(dst, StrictArray), isinstance(src, StrictArray)
        if not (d_dev or s_dev):
            raise ValueError("a device copy needs at least one device array")
        stream = "h2d" if d_dev and not s_dev else "d2h"  # one copy stream per direction
        if dev.copy_waits_for_compute:
            streams.wait_event(stream, streams.record("compute"))
        streams.issue(stream, dev._ranges((src,)) if s_dev else _host_range(src),
                      dev._ranges((dst,)) if d_dev else _host_range(dst), f"a {stream} copy")
        np.copyto(dst._a if d_dev else dst, src._a if s_dev else src)
        self.total_bytes += int(dst.nbytes)
        self.num_copies += 1
        return StrictCopyEvent(dev, int(dst.nbytes), streams.record(stream))

    def synchronize(self) -> None:
        self._dev.host_syncs += 1
        for stream in ("h2d", "d2h"):
            self._dev.streams.host_wait(self._dev.streams.record(stream))

    def close(self) -> None:
        self.closed = True


# ----------------------------------------------------------------------------- device
class StrictCudaDevice:
    """A CUDA-kind device for tests: CuPy-strict arrays over a host arena (module docstring).

    ``copy_waits_for_compute=False`` turns off the event the copy stream waits on before each
    copy (what the CUDA device does), so tests can show the races it prevents. ``device_id``
    is the GPU it stands for (see the module docstring).
    """

    name = "cuda-strict"
    kind = "cuda"
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

    def copy_to_host(self, src: StrictArray) -> np.ndarray:
        """Device-to-host copy of ``src`` (synchronous, as ``ndarray.get``)."""
        return src.get()

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
