"""The price of the host's part of an iteration whose persistent state is offloaded
(``offload=optimizer``, :mod:`~..passes.offload_state`): the optimizer update over the host's
float32 arrays, then the updated parameters copied back over the host link.

The update is bound by host memory bandwidth: per float32 value it reads the parameter, its
gradient and each state slot and writes the parameter and each slot, ``12 + 8 * slots`` bytes
(Adam, two slots: 28). :data:`HOST_UPDATE_BYTES_PER_S` is what the fused host kernel
(kernels/pointwise/optim.py) moved on this repository's machine, Adam over 100 M values on 2
cores (benchmarks/offload/host_adam.py, BENCHMARKS section 26: 33.6 GB/s, the best of its runs; the
same kernel as PyTorch's fused CPU Adam to within 3 %); a many-core server moves several
times that, so the figure errs slow. The gradients' copies to the host are plan actions priced
by :func:`~.cost_model.simulate`; the parameters' copy back is the iteration's last transfer,
of the device's bytes of them (in mixed precision the half copies the device keeps: half the
float32 master's).
"""

from __future__ import annotations

from dataclasses import dataclass

from .targets import DeviceProfile

#: Bytes per second of state the host update moves (see the module docstring).
HOST_UPDATE_BYTES_PER_S = 33.6e9


@dataclass(frozen=True)
class HostUpdate:
    """Seconds of the host update and of the parameters' copy back to the device."""

    update_s: float
    upload_s: float
    state_moved_bytes: int

    @property
    def total_s(self) -> float:
        return self.update_s + self.upload_s

    def as_dict(self) -> dict[str, float | int]:
        return {"host_update_s": self.update_s, "parameter_upload_s": self.upload_s,
                "host_update_bytes": self.state_moved_bytes,
                "host_update_bytes_per_s": HOST_UPDATE_BYTES_PER_S}


def host_update(values: int, slots: int, parameter_bytes: int, profile: DeviceProfile,
                bytes_per_s: float = HOST_UPDATE_BYTES_PER_S) -> HostUpdate:
    """The host's part for ``values`` float32 parameters with ``slots`` state arrays each,
    ``parameter_bytes`` (the device's blocks of them) copied back to ``profile``'s device
    over its host link."""
    moved = values * (12 + 8 * slots)
    return HostUpdate(moved / bytes_per_s, parameter_bytes / profile.link_h2d_bytes_per_s,
                      moved)
