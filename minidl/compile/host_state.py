"""The persistent state a spec with ``offload=optimizer`` keeps on the host (ZeRO-Offload):
float32 master weights, the gradients' landing buffers and the optimizer state, laid out as
the engine lays them out on the device (each parameter's block rounded to the pool's unit,
back to back), so one flat update over them is every parameter's update
(:class:`~minidl.net.optim.FlatGroup`, the fused host kernel of
:mod:`minidl.kernels.pointwise.optim`).

The plan copies each gradient into its landing buffer as backward writes it
(:mod:`minidl.memory.passes.offload_state`; :meth:`HostState.homes` hands the runtime the
buffers); :class:`OffloadedOptimizer` updates on the host and copies the updated master
weights into the device's parameters (on a CPU device with an emulated host link,
``Trainer(emulate_link=)``, through its throttled copy engine, so the copy back takes the
link's time as the gradients' copies do). On a meta device (a dry run) nothing is allocated:
the bytes are counted.

In mixed precision the device keeps a matrix op's parameter only as its half copy
(:func:`half_parameters`, ZeRO-Offload's fp16 parameters): its ``data`` is then the host's
float32 master and the update rounds the master into the device's copy, which the ops read
as they read autocast's cast copy, so training is bit-identical to on-device training.

Under ``offload=parameters`` the device keeps no trainable parameter at all: every step's are
streamed in from their host homes (:meth:`HostState.homes`: the float32 master, or the half
copy the host keeps for a parameter only matrix ops read, rounded from the master after each
update; :mod:`minidl.memory.passes.stream_parameters`), so nothing is copied back.
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np

from ..memory.devices.device import MetaArray
from ..memory.ir.names import Role
from ..memory.ir.precision import MATRIX_OPS, Precision, is_float
from ..memory.ir.program import Program, aligned
from ..memory.runtime.transfer import copy_into
from ..net.graph import Network
from ..net.optim import FlatGroup, Optimizer, OptimizerWrapper
from ..net.parameter import Parameter


def half_parameters(net: Network, precision: Precision) -> frozenset[str]:
    """Under mixed precision, the trainable float parameters only matrix ops read (which
    compute with a half copy of them): the device can keep just that copy. Parameters a
    float32 op or one in its input's dtype also reads (embeddings, a tied head's embedding,
    norms) stay float32; none outside mixed precision."""
    if precision.half_dtype is None:
        return frozenset()
    matrix: dict[str, bool] = {}
    for node in net.nodes:
        for p in net.layer_params(node.name).values():
            if p.trainable and is_float(p.dtype) and np.dtype(p.dtype).itemsize > 2:
                kind = getattr(node.layer, "kind", None)
                matrix[p.name] = matrix.get(p.name, True) and kind in MATRIX_OPS
    return frozenset(name for name, only in matrix.items() if only)


class HostState:
    """Host buffers for ``params`` (the optimizer's trainable parameters, one dtype) and
    ``slots`` state arrays each, on ``device``'s host memory, blocks rounded to
    ``alignment``; ``half_copies``: the device's half arrays of the parameters it keeps only
    as those (by name)."""

    def __init__(self, device: Any, params: list[Parameter], slots: tuple[str, ...],
                 alignment: int, allocate: bool,
                 half_copies: dict[str, Any] | None = None,
                 streamed: frozenset[str] | None = None, half_dtype: Any = None) -> None:
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
        #: ``offload=parameters``: the device keeps no trainable parameter; each step's are
        #: streamed from the master (or, for the names in ``streamed``, from a half copy the
        #: host keeps beside it, rounded after each update)
        self.streamed = streamed is not None
        self.half_offsets: dict[str, tuple[int, int]] = {}
        half_end = 0
        for p in self.params if self.streamed else ():
            if p.name in streamed:
                size = aligned(math.prod(p.shape) * np.dtype(half_dtype).itemsize, alignment)
                self.half_offsets[p.name] = (half_end, size)
                half_end += size
        self.half_bytes = half_end
        self.half_copies = dict(half_copies or {})
        #: Bytes the update copies back to the device: each parameter's block there
        self.upload_bytes = 0 if self.streamed else sum(
            aligned(math.prod(h.shape) * h.dtype.itemsize, alignment)
            if (h := self.half_copies.get(p.name)) is not None else self.offsets[p.name][1]
            for p in self.params)
        self.allocated = allocate
        #: The copy back's chunks (:class:`~.chunked_upload.ChunkedUpload`), or ``None``: one
        #: transfer per parameter.
        self.chunks: Any = None
        self._device = device
        self._buffers: dict[str, Any] = {}
        if allocate:
            for key in ("master", "grad", *self.slots):
                self._buffers[key] = device.host_empty((end,), np.uint8)
                self._buffers[key][...] = 0
            if self.half_offsets:
                self._buffers["half"] = device.host_empty((half_end,), np.uint8)
                self._buffers["half"][...] = 0
        if self.half_offsets:
            half = np.dtype(half_dtype)
            self.half_copies = {
                p.name: self._half_view(p.name, p.shape, half) if allocate
                else MetaArray(p.shape, half) for p in self.params if p.name in streamed}

    @property
    def nbytes(self) -> int:
        """Host bytes held: master weights, gradients, every state slot and the streamed
        half copies."""
        return self.array_bytes * (2 + len(self.slots)) + self.half_bytes

    def by_kind(self) -> dict[str, int]:
        """Host bytes by what they hold (the report's breakdown)."""
        kinds = {"master": self.array_bytes, "gradient": self.array_bytes,
                 "optimizer_state": self.array_bytes * len(self.slots)}
        if self.half_bytes:
            kinds["half_parameters"] = self.half_bytes
        return kinds

    def _half_view(self, name: str, shape: tuple[int, ...], dtype: np.dtype) -> Any:
        off, _ = self.half_offsets[name]
        n = math.prod(shape) * dtype.itemsize
        return self._buffers["half"][off:off + n].view(dtype).reshape(shape)

    def _view(self, key: str, name: str, shape: tuple[int, ...]) -> Any:
        off, _ = self.offsets[name]
        n = math.prod(shape) * self.dtype.itemsize
        return self._buffers[key][off:off + n].view(self.dtype).reshape(shape)

    def _flat(self, key: str) -> Any:
        return self._buffers[key].view(self.dtype)

    def flat_gradients(self) -> Any:
        """The landing buffers of every gradient as one flat array (blocks back to back in
        parameter order; data parallelism all-reduces ranges of it in place)."""
        return self._flat("grad")

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
            if p.name in self.half_copies or self.streamed:  # the master is the parameter
                master = self._view("master", p.name, p.shape)
                copy_into(master, p.data)
                p.data = master
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
            if t.persistent:
                continue
            if t.role == Role.PARAM_GRAD:
                key, (off, size) = "grad", self.offsets[t.name.removesuffix(".grad")]
            elif t.role == Role.PARAM and self.streamed:  # (``{name}@{phase}[@r{group}]``)
                name = t.name.partition("@")[0]
                key, (off, size) = ("half", self.half_offsets[name]) \
                    if name in self.half_offsets else ("master", self.offsets[name])
            else:
                continue
            out[t.id] = self._buffers[key][off:off + size] if self.allocated \
                else MetaArray((size,), np.uint8)
        return out

    def upload(self) -> None:
        """The updated master weights into the device's parameters (rounded into the half
        copies), in :attr:`chunks` where set; over the emulated link where the device has one."""
        if self.streamed:  # (the steps stream from the master and the host's half copies)
            for name, half in self.half_copies.items():
                copy_into(half, self._view("master", name, half.shape))
            return
        engine = self._device.copy_engine if getattr(self._device, "link_bytes_per_s", None) \
            else None
        params = self.params if self.chunks is None else \
            self.chunks.upload(self._device, self._buffers["master"], engine)
        for p in params:
            half = self.half_copies.get(p.name)
            dst, src = p.data if half is None else half, self._view("master", p.name, p.shape)
            if engine is None:
                copy_into(dst, src)
            else:
                engine.copy_async(dst, src.astype(dst.dtype, copy=False))
        if engine is not None:
            engine.synchronize()

    def download(self) -> None:
        """The master weights from the device's parameters (after they were set there); a
        half copy's parameter is its master: the copy is rounded from it."""
        if self.allocated:
            for p in self.params:
                half = self.half_copies.get(p.name)
                if half is None:
                    copy_into(self._view("master", p.name, p.shape), p.data)
                else:
                    copy_into(half, p.data)


class OffloadedOptimizer(OptimizerWrapper):
    """``inner`` stepping on the host (:class:`HostState`): the update over the host buffers,
    then the parameters copied back to the device; loading a state (a checkpoint) takes the
    master weights from the device's freshly loaded parameters."""

    def __init__(self, inner: Optimizer, host_state: HostState) -> None:
        super().__init__(inner)
        self.host_state = host_state
        #: The last step's seconds: the host update, then the parameters' copy back.
        self.last_update_s = self.last_upload_s = 0.0

    def step(self) -> None:
        t0 = time.perf_counter()
        self.inner.step()
        t1 = time.perf_counter()
        self.host_state.upload()
        self.last_update_s, self.last_upload_s = t1 - t0, time.perf_counter() - t1

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.inner.load_state_dict(d)
        self.host_state.download()

    def params_changed(self) -> None:
        """The parameters were set on the device (data parallelism's broadcast from rank 0):
        the master weights from them."""
        self.host_state.download()

    def __repr__(self) -> str:
        return f"OffloadedOptimizer({self.inner!r})"
