"""Devices built by name: ``make_device("cpu" | "meta" | "cuda" | "cuda:<id>" | "cuda-strict",
capacity)`` (``cuda-strict``: the CUDA code path on the CPU with CuPy's rules checked, for tests
without a GPU; see :mod:`.strict_device`)."""

from __future__ import annotations

from typing import Any

from .devices.cuda_device import CudaDevice
from .devices.device import CpuDevice, MetaDevice, available_host_memory

__all__ = ["DEVICE_NAMES", "auto_host_capacity", "is_auto", "make_device"]

#: Names accepted by :func:`make_device`.
DEVICE_NAMES = ("cpu", "meta", "cuda", "cuda-strict")


#: ``capacity="auto"`` on the cpu device: this share of the host memory available when the
#: device is made (the arena's pages are touched only when used).
AUTO_HOST_SHARE = 0.75
#: ``capacity="auto"`` on the cuda-strict test device (its arena is zeroed up front).
AUTO_STRICT_CAPACITY = 1 << 30


def is_auto(capacity: Any) -> bool:
    """Whether ``capacity`` asks for the device's own size (``"auto"``)."""
    return isinstance(capacity, str) and capacity.strip().lower() == "auto"


def auto_host_capacity() -> int:
    """``capacity="auto"`` on the cpu device: :data:`AUTO_HOST_SHARE` of the host memory
    available now, in whole MiB."""
    mib = 1 << 20
    return max(mib, int(AUTO_HOST_SHARE * available_host_memory()) // mib * mib)


def make_device(name: str, capacity: int | str | None = None, **kwargs: Any) -> Any:
    """Build a device by name: ``"cpu"``, ``"meta"``, ``"cuda"`` or ``"cuda:<id>"``.

    ``capacity`` defaults to 256 MiB for cpu, unlimited for meta; cuda needs one.
    ``"auto"``: what the machine has (cpu: :func:`auto_host_capacity`; cuda: the GPU's free
    memory less what its libraries need beside the arena; meta: unlimited; cuda-strict:
    :data:`AUTO_STRICT_CAPACITY`).
    """
    key = name.strip().lower() if isinstance(name, str) else name
    if is_auto(capacity):
        capacity = {"cpu": auto_host_capacity, "meta": lambda: None,
                    "cuda-strict": lambda: AUTO_STRICT_CAPACITY}.get(
                        key, lambda: "auto")()
    if key == "cpu":
        return CpuDevice("256MiB" if capacity is None else capacity, **kwargs)
    if key == "meta":
        return MetaDevice(capacity, **kwargs)
    if key == "cuda-strict":
        from .testing.strict_device import StrictCudaDevice

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
