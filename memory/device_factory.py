"""Devices built by name: ``make_device("cpu" | "meta" | "cuda" | "cuda:<id>" | "cuda-strict",
capacity)`` (``cuda-strict``: the CUDA code path on the CPU with CuPy's rules checked, for tests
without a GPU; see :mod:`.strict_device`)."""

from __future__ import annotations

from typing import Any

from .cuda_device import CudaDevice
from .device import CpuDevice, MetaDevice

__all__ = ["DEVICE_NAMES", "make_device"]

#: Names accepted by :func:`make_device`.
DEVICE_NAMES = ("cpu", "meta", "cuda", "cuda-strict")


def make_device(name: str, capacity: int | str | None = None, **kwargs: Any) -> Any:
    """Build a device by name: ``"cpu"``, ``"meta"``, ``"cuda"`` or ``"cuda:<id>"``.

    ``capacity`` defaults to 256 MiB for cpu, unlimited for meta; cuda needs one.
    """
    key = name.strip().lower() if isinstance(name, str) else name
    if key == "cpu":
        return CpuDevice("256MiB" if capacity is None else capacity, **kwargs)
    if key == "meta":
        return MetaDevice(capacity, **kwargs)
    if key == "cuda-strict":
        from .strict_device import StrictCudaDevice

        return StrictCudaDevice("256MiB" if capacity is None else capacity, **kwargs)
    if isinstance(key, str) and (key == "cuda" or key.startswith("cuda:")):
        if capacity is None:
            raise ValueError("the cuda device needs a capacity, e.g. make_device('cuda', '4GiB')")
        if key != "cuda":
            ident = key.split(":", 1)[1]
            if not ident.isdigit():
                raise ValueError(f"invalid device {name!r}: expected 'cuda:<integer id>'")
            kwargs.setdefault("device_id", int(ident))
        return CudaDevice(capacity, **kwargs)
    raise ValueError(f"unknown device {name!r}; valid devices: {', '.join(DEVICE_NAMES)} "
                     "(or 'cuda:<id>')")
