"""The strict test device's array, :class:`StrictArray`, and its ``xp``, :class:`StrictNamespace`:
CuPy's array API over NumPy data, every call checked against CuPy (:mod:`.strict_oracle`) and run
by the device (its ``_run``: the current device, stream accesses, launches, allocations).

What CuPy refuses is refused: implicit conversion to NumPy (``__array__``), host arrays as
operands, indices and assigned values, Python sequences assigned into an array. Host data moves
only by ``get()`` / ``set()`` (synchronising reads and writes); ``float()`` / ``int()`` /
``bool()`` work on one-element arrays.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from .strict_oracle import StrictCupyError, _check_call, _cupy, _kw_token, _ufunc_accepts

__all__ = ["StrictArray", "StrictNamespace"]


def _is_host_array(x: Any) -> bool:
    return isinstance(x, np.ndarray)


class StrictArray:
    """A device array of a :class:`StrictCudaDevice` (see the module docstring)."""

    __slots__ = ("_a", "_dev", "_owner", "__weakref__")
    __array_priority__ = 100

    def __init__(self, data: np.ndarray, device: Any, owner: Any = None) -> None:
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


class StrictNamespace:
    """The device's ``xp``: CuPy's module-level API over :class:`StrictArray` (checked)."""

    def __init__(self, device: Any) -> None:
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
