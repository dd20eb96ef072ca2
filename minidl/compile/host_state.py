"""The persistent state a spec with ``offload=optimizer`` keeps on the host (ZeRO-Offload):
float32 master weights, the gradients' landing buffers and the optimizer state, laid out as
the engine lays them out on the device (each parameter's block rounded to the pool's unit,
back to back), so one flat update over them is every parameter's update
(:class:`~minidl.net.optim.FlatGroup`, the fused host kernel of
:mod:`minidl.kernels.pointwise.optim`).

The plan copies each gradient into its landing buffer as backward writes it
(:mod:`minidl.memory.passes.offload_state`; :meth:`HostState.homes` hands the runtime the
buffers); :class:`OffloadedOptimizer` updates on the host and copies the updated master
weights into the device's parameters. On a meta device (a dry run) nothing is allocated: the
bytes are counted.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..memory.devices.device import MetaArray
from ..memory.ir.names import Role
from ..memory.ir.program import Program, aligned
from ..memory.runtime.transfer import copy_into
from ..net.optim import FlatGroup, Optimizer, OptimizerWrapper
from ..net.parameter import Parameter


class HostState:
    """Host buffers for ``params`` (the optimizer's trainable parameters, one dtype) and
    ``slots`` state arrays each, on ``device``'s host memory, blocks rounded to
    ``alignment``."""

    def __init__(self, device: Any, params: list[Parameter], slots: tuple[str, ...],
                 alignment: int, allocate: bool) -> None:
        dtypes = {np.dtype(p.dtype) for p in params}
        if len(dtypes) > 1:
            raise ValueError("offload=optimizer updates one flat group: the trainable "
                             f"parameters must share a dtype, got {sorted(map(str, dtypes))}")
        self.dtype = dtypes.pop() if dtypes else np.dtype(np.float32)
        self.params = list(params)
        self.slots = tuple(slots)
        self.offsets: dict[str, tuple[int, int]] = {}  # name -> (offset, block bytes)
        end = 0
        for p in self.params:
            size = aligned(math.prod(p.shape) * self.dtype.itemsize, alignment)
            self.offsets[p.name] = (end, size)
            end += size
        self.array_bytes = end
        self.allocated = allocate
        self._buffers: dict[str, Any] = {}
        if allocate:
            for key in ("master", "grad", *self.slots):
                self._buffers[key] = device.host_empty((end,), np.uint8)
                self._buffers[key][...] = 0

    @property
    def nbytes(self) -> int:
        """Host bytes held: master weights, gradients and every state slot."""
        return self.array_bytes * (2 + len(self.slots))

    def by_kind(self) -> dict[str, int]:
        """Host bytes by what they hold (the report's breakdown)."""
        return {"master": self.array_bytes, "gradient": self.array_bytes,
                "optimizer_state": self.array_bytes * len(self.slots)}

    def _view(self, key: str, name: str, shape: tuple[int, ...]) -> Any:
        off, _ = self.offsets[name]
        n = math.prod(shape) * self.dtype.itemsize
        return self._buffers[key][off:off + n].view(self.dtype).reshape(shape)

    def _flat(self, key: str) -> Any:
        return self._buffers[key].view(self.dtype)

    def alloc_state(self, name: str, shape: tuple[int, ...], dtype: Any) -> Any:
        """The optimizer's ``alloc`` (``init_state``): state ``{param}.{slot}`` in its slot's
        buffer, zeroed; a meta array when nothing is allocated."""
        param, _, slot = name.rpartition(".")
        if not self.allocated:
            return MetaArray(shape, dtype)
        return self._view(slot, param, tuple(shape))

    def bind(self, optimizer: Optimizer) -> None:
        """Master weights from the parameters' values, each parameter's ``.grad`` its landing
        buffer, and the optimizer's one flat group over the host buffers."""
        for p in self.params:
            p.grad = self._view("grad", p.name, p.shape)
        self.download()
        optimizer.flat_groups = [FlatGroup(
            tuple(self.params), self._flat("master"), self._flat("grad"),
            {s: self._flat(s) for s in self.slots},
            tuple((p.data, p.grad) for p in self.params))]

    def homes(self, program: Program) -> dict[int, Any]:
        """The landing buffer (bytes) of each of ``program``'s offloaded gradients, by tensor;
        meta arrays of their sizes when nothing is allocated (a dry run)."""
        out = {}
        for t in program.tensors:
            if t.role == Role.PARAM_GRAD and not t.persistent:
                off, size = self.offsets[t.name.removesuffix(".grad")]
                out[t.id] = self._buffers["grad"][off:off + size] if self.allocated \
                    else MetaArray((size,), np.uint8)
        return out

    def upload(self) -> None:
        """The updated master weights into the device's parameters."""
        for p in self.params:
            copy_into(p.data, self._view("master", p.name, p.shape))

    def download(self) -> None:
        """The master weights from the device's parameters (after they were set there)."""
        if self.allocated:
            for p in self.params:
                copy_into(self._view("master", p.name, p.shape), p.data)


class OffloadedOptimizer(OptimizerWrapper):
    """``inner`` stepping on the host (:class:`HostState`): the update over the host buffers,
    then the parameters copied back to the device; loading a state (a checkpoint) takes the
    master weights from the device's freshly loaded parameters."""

    def __init__(self, inner: Optimizer, host_state: HostState) -> None:
        super().__init__(inner)
        self.host_state = host_state

    def step(self) -> None:
        self.inner.step()
        self.host_state.upload()

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.inner.load_state_dict(d)
        self.host_state.download()

    def __repr__(self) -> str:
        return f"OffloadedOptimizer({self.inner!r})"
