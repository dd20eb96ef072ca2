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

Under ZeRO (``zero=1`` / ``2``, ``owned``: this rank's ranges of the flattened parameters,
:func:`~minidl.memory.passes.zero.owned_ranges`) the master weights and the optimizer state hold
only the owned ranges (one block each, as the device's ZeRO lays its shards out). Under
``zero=1`` the gradients still land whole (the ranks all-reduce them there, and the update
reads its ranges); under ``zero=2`` (``shard_gradients``) the host keeps only the owned ranges'
gradients too, which data parallelism's reduce-scatter fills (no landing copies), so the update
is again one flat pass.

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
from ..memory.passes.zero import owned_ranges
from ..memory.runtime.transfer import copy_into
from ..net.graph import Network
from ..net.optim import FlatGroup, Optimizer, OptimizerWrapper
from ..net.parameter import Parameter

#: The host buffer of the gradients (beside ``master``, the optimizer's slots and ``half``)
GRADIENTS = "grad"

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
    as those (by name); ``owned``: ``(parameter index, lo, hi)`` ranges, the only ones whose
    master weights and state this host keeps (ZeRO; default: every parameter whole);
    ``shard_gradients``: also only those ranges' gradients (ZeRO stage 2)."""

    def __init__(self, device: Any, params: list[Parameter], slots: tuple[str, ...],
                 alignment: int, allocate: bool,
                 half_copies: dict[str, Any] | None = None,
                 streamed: frozenset[str] | None = None, half_dtype: Any = None,
                 owned: list[tuple[int, int, int]] | None = None,
                 shard_gradients: bool = False) -> None:
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
        if owned is not None and streamed is not None:
            raise ValueError("offload=parameters streams every master weight: it cannot keep "
                             "only a rank's shard of them")
        self.alignment = alignment
        self.owned = owned
        self.shard_gradients = shard_gradients and owned is not None
        #: ``(parameter, lo, hi)`` whose master and state this host keeps, and their blocks
        #: (by name: the parameter's, or ``name[lo:hi]`` for a range under ZeRO)
        self.pieces = [(p, 0, math.prod(p.shape)) for p in self.params] if owned is None \
            else [(self.params[i], lo, hi) for i, lo, hi in owned]
        self.state_offsets: dict[str, tuple[int, int]] = dict(self.offsets)
        state_end = end
        if owned is not None:
            self.state_offsets, state_end = {}, 0
            for p, lo, hi in self.pieces:
                size = aligned((hi - lo) * self.dtype.itemsize, alignment)
                self.state_offsets[f"{p.name}[{lo}:{hi}]"] = (state_end, size)
                state_end += size
        #: Bytes of each master / state slot buffer (``array_bytes`` unless sharded)
        self.state_bytes = state_end
        #: Bytes of the gradients' buffer: every landing buffer, or the owned ranges'
        self.grad_bytes = state_end if self.shard_gradients else end
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
            for key in ("master", GRADIENTS, *self.slots):
                n = self.grad_bytes if key == GRADIENTS else state_end
                self._buffers[key] = device.host_empty((n,), np.uint8)
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
        return self.grad_bytes + self.state_bytes * (1 + len(self.slots)) + self.half_bytes

    @property
    def values(self) -> int:
        """Elements the host update updates (the owned ranges')."""
        return sum(hi - lo for _, lo, hi in self.pieces)

    def by_kind(self) -> dict[str, int]:
        """Host bytes by what they hold (the report's breakdown)."""
        kinds = {"master": self.state_bytes, "gradient": self.grad_bytes,
                 "optimizer_state": self.state_bytes * len(self.slots)}
        if self.half_bytes:
            kinds["half_parameters"] = self.half_bytes
        return kinds

    def _half_view(self, name: str, shape: tuple[int, ...], dtype: np.dtype) -> Any:
        off, _ = self.half_offsets[name]
        n = math.prod(shape) * dtype.itemsize
        return self._buffers["half"][off:off + n].view(dtype).reshape(shape)

    def for_rank(self, ranks: int, rank: int = 0, shard_gradients: bool = False) -> HostState:
        """What ``rank`` of ``ranks`` keeps under ZeRO (``shard_gradients``: stage 2; nothing
        allocated: a dry run's figures)."""
        sizes = [math.prod(p.shape) for p in self.params]
        return HostState(self._device, self.params, self.slots, self.alignment, False,
                         half_copies=self.half_copies, owned=owned_ranges(sizes, ranks, rank),
                         shard_gradients=shard_gradients)

    def _view(self, key: str, name: str, shape: tuple[int, ...]) -> Any:
        whole = key == GRADIENTS and not self.shard_gradients
        off, _ = (self.offsets if whole else self.state_offsets)[name]
        n = math.prod(shape) * self.dtype.itemsize
        return self._buffers[key][off:off + n].view(self.dtype).reshape(shape)

    def _flat(self, key: str) -> Any:
        return self._buffers[key].view(self.dtype)

    def flat_gradients(self) -> Any:
        """The landing buffers of every gradient as one flat array (blocks back to back in
        parameter order; data parallelism all-reduces ranges of it in place)."""
        return self._flat(GRADIENTS)

    def alloc_state(self, name: str, shape: tuple[int, ...], dtype: Any) -> Any:
        """The optimizer's ``alloc`` (``init_state``): state ``{param}.{slot}`` in its slot's
        buffer, zeroed; a meta array when nothing is allocated."""
        param, _, slot = name.rpartition(".")
        if not self.allocated:
            return MetaArray(shape, dtype)
        return self._view(slot, param, tuple(shape))

    def bind(self, optimizer: Optimizer) -> None:
        """Master weights from the parameters' values, each parameter's ``.grad`` its landing
        buffer, and the optimizer's one flat group over the host buffers (under ZeRO
        ``optimizer`` steps the owned ranges, :class:`~minidl.distributed.zero.ShardParameter`
        s: their values the master's ranges, their gradients the landing buffers')."""
        if self.owned is not None:
            self._bind_ranges(optimizer)
            return
        for p in self.params:
            p.grad = self._view(GRADIENTS, p.name, p.shape)
            if p.name in self.half_copies or self.streamed:  # the master is the parameter
                master = self._view("master", p.name, p.shape)
                copy_into(master, p.data)
                p.data = master
        self.download()
        optimizer.flat_groups = [FlatGroup(
            tuple(self.params), self._flat("master"), self._flat(GRADIENTS),
            {s: self._flat(s) for s in self.slots},
            tuple((p.data, p.grad) for p in self.params))]

    def _bind_ranges(self, optimizer: Optimizer) -> None:
        """ZeRO's :meth:`bind`: the shards' values the master's ranges, their gradients the
        landing buffers' ranges (stage 1: per-range updates, the landing buffers being laid
        out otherwise) or the gradient shards (stage 2: one flat update)."""
        names = [f"{p.name}[{lo}:{hi}]" for p, lo, hi in self.pieces]
        if [s.name for s in optimizer.params] != names:
            raise ValueError("offload under ZeRO: the optimizer's shards are not this host's "
                             "owned ranges")
        for p in self.params:
            p.grad = None if self.shard_gradients else self._view(GRADIENTS, p.name, p.shape)
        for shard, (p, lo, hi) in zip(optimizer.params, self.pieces):
            shard.own_grad = self._view(GRADIENTS, shard.name, (hi - lo,)) if p.grad is None \
                else p.grad.reshape(-1)[lo:hi]
            shard.own_data = self._view("master", shard.name, (hi - lo,))
        optimizer.flat_groups = [] if not self.shard_gradients else [FlatGroup(
            tuple(optimizer.params), self._flat("master"), self._flat(GRADIENTS),
            {s: self._flat(s) for s in self.slots},
            tuple((s.data, s.grad) for s in optimizer.params))]
        self.download()

    def homes(self, program: Program) -> dict[int, Any]:
        """The landing buffer (bytes) of each of ``program``'s offloaded gradients, by tensor;
        meta arrays of their sizes when nothing is allocated (a dry run)."""
        out = {}
        for t in program.tensors:
            if t.persistent:
                continue
            if t.role == Role.PARAM_GRAD and not self.shard_gradients:
                key, (off, size) = GRADIENTS, self.offsets[t.name.removesuffix(".grad")]
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
        if self.owned is not None:  # (the all-gather wrote every parameter's values)
            for p in self.params:
                half = self.half_copies.get(p.name)
                if half is not None:
                    copy_into(half, p.data)
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
        if self.allocated and self.owned is not None:
            for p, lo, hi in self.pieces:
                copy_into(self._view("master", f"{p.name}[{lo}:{hi}]", (hi - lo,)),
                          p.data.reshape(-1)[lo:hi])
            for p in self.params:
                if p.name in self.half_copies:
                    copy_into(self.half_copies[p.name], p.data)
        elif self.allocated:
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
