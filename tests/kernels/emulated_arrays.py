"""Device arrays without a GPU, shared by the kernel tests: :class:`EmuArray`, a minimal
CuPy-like array over a host buffer that ``minidl.kernels._cuda`` sees as a device array
(``__emulated_device_buffer__``) and launches on as one emulated CUDA thread; ``D`` / ``H`` copy
to and from it; ``same`` compares bit for bit."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np


class EmuArray:
    """A minimal CuPy-like array over a host buffer: no implicit conversion to or from host
    arrays; new arrays of its namespace hold garbage (0xA5 bytes), as new device memory
    would. Views and new arrays are of the array's own class (a subclass stands for another
    device array type, as CuPy's arrays do beside these in benchmarks/gpu/smoke.py)."""

    def __init__(self, a: np.ndarray) -> None:
        self._a = a

    def __emulated_device_buffer__(self) -> np.ndarray:
        return self._a

    def __array__(self, *args, **kwargs):
        raise TypeError("implicit conversion of a device array")

    def __array_namespace__(self) -> SimpleNamespace:
        return SimpleNamespace(empty=lambda shape, dtype: type(self)(
            np.full(np.dtype(dtype).itemsize * int(np.prod(shape)), 0xA5, np.uint8)
            .view(dtype).reshape(shape)))

    shape = property(lambda self: self._a.shape)
    dtype = property(lambda self: self._a.dtype)
    size = property(lambda self: self._a.size)
    ndim = property(lambda self: self._a.ndim)
    nbytes = property(lambda self: self._a.nbytes)
    flags = property(lambda self: self._a.flags)

    def reshape(self, *shape) -> EmuArray:
        return type(self)(self._a.reshape(*shape))

    def transpose(self, *axes) -> EmuArray:
        return type(self)(self._a.transpose(*axes))

    def swapaxes(self, i: int, j: int) -> EmuArray:
        return type(self)(self._a.swapaxes(i, j))

    def view(self, dtype) -> EmuArray:
        return type(self)(self._a.view(dtype))

    def fill(self, value) -> None:
        self._a.fill(value)

    def __getitem__(self, key) -> EmuArray:
        return type(self)(self._a[key])

    def __setitem__(self, key, value) -> None:
        if isinstance(value, np.ndarray):
            raise TypeError("implicit host-to-device copy")
        self._a[key] = value._a if isinstance(value, EmuArray) else value

    def get(self) -> np.ndarray:
        return self._a.copy()

    def set(self, host: np.ndarray) -> None:
        assert isinstance(host, np.ndarray) and host.shape == self._a.shape
        self._a[...] = host


def D(a: np.ndarray) -> EmuArray:
    """``a`` copied to an emulated device array."""
    return EmuArray(np.array(a, copy=True))


def H(a: EmuArray) -> np.ndarray:
    """An emulated device array copied back to the host."""
    assert isinstance(a, EmuArray), type(a)
    return a.get()


def same(got: np.ndarray, want: np.ndarray, what: str = "") -> None:
    """Equal bit for bit (NaNs, signed zeros), same shape and dtype."""
    assert got.shape == want.shape and got.dtype == want.dtype, (what, got.shape, want.shape,
                                                                 got.dtype, want.dtype)
    assert np.array_equal(np.ascontiguousarray(got).view(np.uint8),
                          np.ascontiguousarray(want).view(np.uint8)), what
