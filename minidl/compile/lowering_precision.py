"""Lowering under a precision (:mod:`~minidl.memory.ir.precision`): each value's dtype as its
producer writes it, the cast copies and half weights ops keep for their backward, and the
dtype of matrix ops' products on their steps. A part of :class:`~.lowering._Lowering`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ..kernels.array_api import is_half_dtype
from ..memory.ir.names import DeviceKind
from ..memory.ir.precision import FLOAT32_OPS, MATRIX_OPS, Precision, is_float, op_dtype
from .mixed_staging import backward_staging_bytes, forward_staging_bytes, io_staging_bytes
from .mixed_steps import DEVICE_HALF_OPERAND_KINDS, HALF_MATMULS, batch_chunk, device_half_io

__all__ = ["PrecisionLowering"]


class PrecisionLowering:
    """The precision's share of a lowering's state and steps (its other attributes are the
    lowering's: layers, node lists, shapes and dtypes per value, the tensor builder)."""

    precision: Precision = Precision.FP32
    #: Under mixed precision, per node the dtype it computes in (else None)
    compute_dt: list[np.dtype | None]
    #: Per node, the inputs its backward reads from a cast copy in its stash
    cast_kept: list[frozenset[int]]
    #: Trainable parameters the device keeps only as their half copy (read without a cast)
    half_on_device: frozenset[str] = frozenset()
    #: The kind of device the program runs on (``"cpu"`` / ``"cuda"``)
    device_kind: DeviceKind = DeviceKind.CPU

    def apply_precision(self) -> None:
        """Under mixed precision, every float value retyped as its producer writes it (the
        op policy of :mod:`~minidl.memory.ir.precision`), node by node in order."""
        self.compute_dt = [None] * len(self.layers)
        self.cast_kept = [frozenset()] * len(self.layers)
        if self.precision.half_dtype is None:
            return
        for i, layer in enumerate(self.layers):
            ins = [self.dtypes[v].name for v in self.node_in[i] if is_float(self.dtypes[v])]
            cdt = self.compute_dt[i] = np.dtype(op_dtype(layer.kind, ins, self.precision))
            for v in self.node_out[i]:
                if is_float(self.dtypes[v]):
                    self.dtypes[v] = cdt

    def _casts(self, i: int) -> list[int]:
        """Positions of node i's float inputs in another dtype than it computes in, which it
        reads through a cast copy: none for the float32 ops (minidl's losses and
        normalisations read half inputs chunk by chunk into float32, as fused kernels do)."""
        cdt = self.compute_dt[i]
        if cdt is None or self.layers[i].kind in FLOAT32_OPS:
            return []
        return [j for j, v in enumerate(self.node_in[i])
                if is_float(self.dtypes[v]) and self.dtypes[v] != cdt]

    def _half_params(self, i: int) -> dict:
        """Node i's trainable parameters an op computing in half uses a half copy of
        (autocast's weight cast: made at its forward, kept for its backward). Buffers (batch
        norm's running statistics) stay float32 and are read and updated in place."""
        cdt = self.compute_dt[i]
        if cdt is None or cdt.itemsize != 2:
            return {}
        return {k: p for k, p in self.node_params[i].items()
                if p.trainable and is_float(np.dtype(p.dtype)) and np.dtype(p.dtype) != cdt}

    def param_casts(self, i: int) -> dict[str, str]:
        """Node i's parameters its steps round to its half compute dtype before computing
        (autocast's weight casts: the trainable float parameters of an op computing in half,
        but those the device keeps only in half); each step makes its own copy in its
        workspace (a cast is cheaper than keeping the copy from forward to backward)."""
        cdt = self.compute_dt[i] if self.compute_dt else None
        return {k: cdt.name for k, p in self._half_params(i).items()
                if p.name not in self.half_on_device}

    def _cast_copies(self, i: int) -> list[tuple[tuple[int, ...], np.dtype]]:
        """``(shape, dtype)`` of node i's rounded parameter copies (:meth:`param_casts`)."""
        casts = self.param_casts(i)
        return [(tuple(self.node_params[i][k].shape), np.dtype(dt)) for k, dt in casts.items()]

    def _cast_stash(self, i: int, name: str) -> tuple[dict[str, int], list]:
        """Under mixed precision, node i's cast copies of the inputs its backward reads, as
        stash entries; and ``(shape, dtype)`` of its other input casts (live for the forward
        only: in its workspace)."""
        cdt = self.compute_dt[i]
        if cdt is None:
            return {}, []
        backward = self.training and self.loss is not None
        stash, transient, kept = {}, [], set()
        for j in self._casts(i):
            shape = self.shapes[self.node_in[i][j]]
            if backward and j in self.layers[i].retain_inputs:
                stash[f"input{j}@{cdt.name}"] = self.b.add(
                    f"{name}.input{j}@{cdt.name}", shape, cdt, "stash", "stash", name)
                kept.add(j)
            else:
                transient.append((tuple(shape), cdt))
        self.cast_kept[i] = frozenset(kept)
        return stash, transient

    def io_dtype(self, i: int) -> np.dtype:
        """The dtype node i's kernels see when they take its arrays as they are: its half
        compute dtype, or (a float32 op such as the loss) its first float input's."""
        cdt = self.compute_dt[i]
        if cdt.itemsize == 2:
            return cdt
        return next((self.dtypes[v] for v in self.node_in[i] if is_float(self.dtypes[v])), cdt)

    def forward_workspace(self, i: int, ws_of: Callable[[np.dtype], int],
                          stash: dict[str, int], params: dict[str, int],
                          transient: list) -> int:
        """Node i's forward workspace bytes (``ws_of(dtype)``: its layer's in that dtype):
        under mixed precision, what the step stages there (:mod:`.mixed_staging`), or on a
        device its layer's in the dtype its kernels see then the inputs and parameters it
        rounds, or on the CPU its layer's in its dtype beside its ``transient`` input casts and
        rounded parameter copies."""
        fdt = self._float_dtype(i)
        staged = self.forward_staging(i, stash, params, ws_of)
        if staged is not None:
            return staged
        copies = self._cast_copies(i)
        if self._on_device_as_is(i):
            return io_staging_bytes(ws_of(self.io_dtype(i)), [*transient, *copies])
        return ws_of(fdt) + sum(int(np.prod(s)) * dt.itemsize for s, dt in [*transient, *copies])

    def backward_workspace(self, i: int, ws_of: Callable[..., int], g_out: list[int],
                           g_in: list, retained: tuple, params: dict[str, int],
                           wants_in: list[bool], grads: list[int] = ()) -> int:
        """Node i's backward workspace bytes, as :meth:`forward_workspace`: on the CPU its
        layer's, its input gradients before their cast (:meth:`_backward_casts`) and its
        rounded parameter copies."""
        fdt = self._float_dtype(i)
        staged = self.backward_staging(i, g_out, g_in, retained, params, ws_of, grads)
        if staged is not None:
            return staged
        copies = self._cast_copies(i)
        if self._on_device_as_is(i):
            return io_staging_bytes(ws_of(self.io_dtype(i)), copies)
        return ws_of(fdt) + self._backward_casts(i, wants_in) + sum(
            int(np.prod(s)) * dt.itemsize for s, dt in copies)

    def _backward_casts(self, i: int, wants_in: list[bool]) -> int:
        """Bytes of node i's backward input gradients in its compute dtype before their cast
        to the dtype the inputs are kept in (autocast rounds them to half first): its
        workspace. Weight gradients need none: they are written in float32 straight into
        ``.grad`` (GemmEx's float32 output on a device)."""
        cdt = self.compute_dt[i]
        if cdt is None:
            return 0
        return cdt.itemsize * sum(int(np.prod(self.shapes[self.node_in[i][j]]))
                                  for j in self._casts(i) if wants_in[j])

    def _decl(self, tid: int) -> tuple[tuple[int, ...], np.dtype]:
        t = self.b.tensors[tid]
        return t.shape, np.dtype(t.dtype)

    def _mixed_on_device(self, i: int) -> bool:
        """Whether node i computes under mixed precision on a CUDA device."""
        return self.device_kind == DeviceKind.CUDA and self.compute_dt[i] is not None

    def _stages(self, i: int) -> bool:
        """Whether node i's mixed steps stage float32 arrays in their workspace
        (:mod:`.mixed_staging`): on a CUDA device, a layer whose kernels do not take its half
        arrays as they are."""
        return self._mixed_on_device(i) and not device_half_io(self.layers[i])

    def _staged_params(self, i: int, params: dict[str, int]) -> list:
        casts = self.param_casts(i)
        return [(self._decl(tid), casts.get(k, "")) for k, tid in params.items()]

    def _on_device_as_is(self, i: int) -> bool:
        """Whether node i runs on a CUDA device on its arrays as they are
        (:func:`~.mixed_steps.device_half_io`): its workspace is its layer's, then the inputs
        and parameters it rounds for the step."""
        return self._mixed_on_device(i) and device_half_io(self.layers[i])

    def _half_step(self, i: int, decls: list) -> bool:
        return self._matmul_dtype(i) in HALF_MATMULS or any(
            d is not None and is_half_dtype(d[1]) for d in decls)

    def _chunk(self, i: int) -> tuple[Callable[[Any], Any], bool]:
        """``(cut, chunked)``: node i's decls as one batch chunk of its staged step sees them
        (:func:`~.mixed_steps.batch_chunk`: batch-first shapes cut to the chunk), and whether
        the step runs in more than one chunk."""
        batch = self.shapes[self.node_in[i][0]][0] if self.node_in[i] else 1
        cb = batch_chunk(self.layers[i], batch)
        if cb >= batch:
            return (lambda d: d), False
        return (lambda d: None if d is None else ((cb, *tuple(d[0])[1:]), d[1])), True

    def forward_staging(self, i: int, stash: dict[str, int], params: dict[str, int],
                        ws_of: Callable[..., int]) -> int | None:
        """Node i's forward workspace when it stages its float32 arrays there (else
        ``None``): :func:`~.mixed_staging.forward_staging_bytes` over its tensors (a batch
        chunk of them where the step runs in chunks); ``stash``: its stash entries (its own
        and the cast copies), ``ws_of(dtype, in_shapes)``: the layer's workspace bytes."""
        if not self._stages(i):
            return None
        cdt, (cut, _) = self.compute_dt[i], self._chunk(i)
        ins = [(cut((self.shapes[v], self.dtypes[v])),
                None if f"input{j}@{cdt.name}" not in stash
                else cut(self._decl(stash[f"input{j}@{cdt.name}"])))
               for j, v in enumerate(self.node_in[i])]
        outs = [cut((self.shapes[v], self.dtypes[v])) for v in self.node_out[i]]
        own = [cut(self._decl(t)) for k, t in stash.items() if "@" not in k]
        pars = self._staged_params(i, params)
        if not self._half_step(i, [d for d, _ in ins] + outs + own + [d for d, _ in pars]):
            return None
        ws32 = ws_of(np.dtype(np.float32), [d[0] for d, _ in ins])
        return forward_staging_bytes(ins, outs, own, pars, self._matmul_dtype(i), ws32,
                                     self.layers[i].kind in DEVICE_HALF_OPERAND_KINDS)

    def backward_staging(self, i: int, g_out: list[int], g_in: list, retained: tuple,
                         params: dict[str, int], ws_of: Callable[..., int],
                         grads: list[int] = ()) -> int | None:
        """Node i's backward workspace when it stages its float32 arrays there (else
        ``None``): :func:`~.mixed_staging.backward_staging_bytes` (a batch chunk's, as in
        :meth:`forward_staging`); ``g_in``: its :class:`GradInput` or ``None`` per input,
        ``retained``: the inputs it reads as they are (the others it keeps read from their
        cast copies); ``grads``: its parameters' gradient tensors (a chunked step adds each
        chunk's into them from a partial it stages)."""
        if not self._stages(i):
            return None
        layer, cdt, stash = self.layers[i], self.compute_dt[i], self.stash_t[i]
        cut, chunked = self._chunk(i)
        ins = []
        for j, v in enumerate(self.node_in[i]):
            cast = stash.get(f"input{j}@{cdt.name}")
            ins.append(self._decl(cast) if cast is not None and j in layer.retain_inputs
                       else (self.shapes[v], self.dtypes[v]) if j in retained else None)
        outs = [(self.shapes[v], self.dtypes[v]) if j in layer.retain_outputs else None
                for j, v in enumerate(self.node_out[i])]
        gos = [self._decl(t) for t in g_out]
        gis = [None if g is None else self._decl(g.written) for g in g_in]
        own = [self._decl(t) for k, t in stash.items() if "@" not in k]
        pars = self._staged_params(i, params)
        if not self._half_step(i, ins + outs + gos + gis + own + [d for d, _ in pars]):
            return None
        ins, outs, gos, gis, own = ([cut(d) for d in ds] for ds in (ins, outs, gos, gis, own))
        ws32 = ws_of(np.dtype(np.float32), [cut((self.shapes[v], None))[0]
                                            for v in self.node_in[i]])
        partials = [self._decl(t) for t in grads] if chunked else []
        return backward_staging_bytes(ins, outs, gos, gis, own, pars, ws32,
                                      layer.kind in DEVICE_HALF_OPERAND_KINDS, partials)

    def _matmul_dtype(self, i: int) -> str:
        """Node i's steps' ``cost.matmul_dtype``: its matrix products' dtype (``""``: float32
        on CUDA cores)."""
        if self.precision is Precision.FP32 or self.layers[i].kind not in MATRIX_OPS:
            return ""
        return self.precision.matmul_dtype
