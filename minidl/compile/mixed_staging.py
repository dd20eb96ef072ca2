"""Where a mixed-precision step's float32 arrays live on a CUDA device: inside the step's own
workspace, which the lowering sizes for them (:func:`forward_staging_bytes`,
:func:`backward_staging_bytes`), so that the plan and the dry run count every byte and the
arena needs no scratch block for them.

A layer whose device kernels read half operands (or none) computes in float32 on copies of
its half arrays (:mod:`.mixed_steps`): float32 copies of half inputs, output gradients, kept
outputs and half weight copies, float32 arrays for the half outputs and input gradients it
writes (rounded back afterwards), and its float32 workspace. :class:`Staging` hands them out
of the step's workspace one after the other, each at a :data:`STAGING_ALIGN`-byte boundary;
the two ``*_staging_bytes`` functions add up the same arrays from the shapes and dtypes the
lowering knows, in the same terms (mirror :func:`.mixed_steps.forward` / ``backward``). An
array that does not fit (a mismatch, or a host workspace: the CPU device's float32 copies
stay on the host heap) is made like the layer's arrays instead.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..kernels._cuda import is_device_array
from ..kernels.array_api import is_half_dtype, namespace, round_into
from ..memory.ir.precision import is_float

__all__ = ["STAGING_ALIGN", "Staging", "backward_staging_bytes", "forward_staging_bytes",
           "io_staging_bytes"]

#: Alignment of each array carved out of a workspace (cuBLAS and vector loads).
STAGING_ALIGN = 256
F32 = np.dtype(np.float32)
#: ``(shape, dtype)`` of one array; ``None`` where the step has none.
Decl = tuple[tuple[int, ...], Any]


def _aligned(nbytes: int) -> int:
    return -(-int(nbytes) // STAGING_ALIGN) * STAGING_ALIGN


def _nbytes(shape: Sequence[int], dtype: Any) -> int:
    return math.prod(shape) * np.dtype(dtype).itemsize


class Staging:
    """Arrays carved one after the other out of ``workspace`` from byte ``start`` on (a device
    array); past its end, or with a host or no workspace, new arrays made like ``like``."""

    def __init__(self, workspace: Any, like: Any, start: int = 0) -> None:
        self.buf = workspace if workspace is not None and is_device_array(workspace) else None
        self.like = like
        self.offset = _aligned(start)
        #: Bytes that did not fit and became arrays of their own (0 when the plan is exact).
        self.spilled = 0

    def empty(self, shape: Sequence[int], dtype: Any) -> Any:
        """An uninitialised array of ``shape`` and ``dtype``."""
        dtype, shape = np.dtype(dtype), tuple(int(s) for s in shape)
        n = _nbytes(shape, dtype)
        if self.buf is not None and self.offset + n <= self.buf.nbytes:
            flat = self.buf.reshape(-1).view(np.uint8)[self.offset: self.offset + n]
            self.offset += _aligned(n)
            return flat.view(dtype).reshape(shape)
        if self.buf is not None:
            self.spilled += n
        return namespace(self.like).empty(shape, dtype)

    def copy(self, a: Any, dtype: Any) -> Any:
        """``a`` converted to ``dtype`` in a new array (rounded when narrower)."""
        out = self.empty(a.shape, dtype)
        round_into(out, a)
        return out


def _up(decl: Decl | None, keep_half: bool) -> int:
    """Bytes of the float32 copy of a half array (none when kept half, or not half)."""
    if decl is None or keep_half or not is_half_dtype(decl[1]):
        return 0
    return _aligned(_nbytes(decl[0], F32))


def _params(params: Sequence[tuple[Decl, str]], reads_half: bool) -> int:
    """Per parameter ``(decl, the half dtype it is rounded to or "")``: its rounded copy (and
    that copy's float32 copy unless ``reads_half``), else the float32 copy of a half one."""
    total = 0
    for (shape, dtype), cast in params:
        if cast:
            total += _aligned(_nbytes(shape, cast)) + _up((shape, cast), reads_half)
        else:
            total += _up((shape, dtype), reads_half)
    return total


def forward_staging_bytes(inputs: Sequence[tuple[Decl, Decl | None]], outputs: Sequence[Decl],
                          own: Sequence[Decl], params: Sequence[tuple[Decl, str]],
                          matmul_dtype: str, workspace: int, reads_half: bool) -> int:
    """Bytes of a forward step's staged arrays (:func:`.mixed_steps.forward`): per input
    ``(decl, its cast copy's decl or None)``, the float32 copy of its cast copy, else of the
    input rounded to ``matmul_dtype`` first when it is in another float dtype (that rounded
    copy staged too), else of a half input; a float32 array per half output and half own
    stash entry; the layer's float32 ``workspace`` bytes; the parameters' copies
    (:func:`_params`: ``(decl, the half dtype the step rounds it to, or "")``).
    ``reads_half``: the layer takes its half inputs and weights as they are (no float32
    copies of them)."""
    total = 0
    for (shape, dtype), cast in inputs:
        if cast is not None:
            total += _up(cast, reads_half)
        elif matmul_dtype and is_float(np.dtype(dtype)) and np.dtype(dtype).name != matmul_dtype:
            total += _aligned(_nbytes(shape, matmul_dtype))
            total += _up((shape, matmul_dtype), reads_half)
        else:
            total += _up((shape, dtype), reads_half)
    total += sum(_up(d, False) for d in (*outputs, *own))
    total += _aligned(workspace) if workspace > 0 else 0
    return total + _params(params, reads_half)


def backward_staging_bytes(inputs: Sequence[Decl | None], outputs: Sequence[Decl | None],
                           grad_outputs: Sequence[Decl], grad_inputs: Sequence[Decl | None],
                           own: Sequence[Decl], params: Sequence[tuple[Decl, str]],
                           workspace: int, reads_half: bool,
                           partials: Sequence[Decl] = ()) -> int:
    """Bytes of a backward step's staged arrays (:func:`.mixed_steps.backward`): float32
    copies of the half inputs it reads (``None``: not read; a cast copy's decl where it reads
    that), kept outputs and output gradients (unless ``reads_half``), a float32 array per
    half input gradient and half own stash entry, the layer's float32 ``workspace`` bytes,
    the parameters' copies as in :func:`forward_staging_bytes`, and the ``partials`` a step
    run in batch chunks writes each chunk's parameter gradients into."""
    total = sum(_aligned(_nbytes(*d)) for d in partials)
    total += sum(_up(d, reads_half) for d in (*inputs, *outputs, *grad_outputs))
    total += sum(_up(d, False) for d in (*grad_inputs, *own))
    total += _aligned(workspace) if workspace > 0 else 0
    return total + _params(params, reads_half)


def io_staging_bytes(workspace: int, staged: Sequence[Decl]) -> int:
    """Bytes of the workspace of a layer that takes its half arrays as they are: its own
    ``workspace`` (declared for the half dtype), then ``staged`` arrays (the inputs it rounds
    for the step, the weights it rounds), each at a :data:`STAGING_ALIGN` boundary."""
    return _aligned(workspace) + sum(_aligned(_nbytes(*d)) for d in staged)
