"""The record of one CPU convolution call (:class:`HostCall`, made by
:func:`~.conv_geometry.host_call` from the shapes alone) and the cutting of its workspace into
per-thread rows and gradient partials (:func:`cut_workspace`), every buffer aligned to
:data:`_ALIGN` bytes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

_ALIGN = 64


def _aligned(elems: int, itemsize: int) -> int:
    return -(-elems * itemsize // _ALIGN) * _ALIGN


@dataclass(frozen=True)
class HostCall:
    """What one CPU convolution call derives from its shapes alone (Caffe's setup): the
    configuration, the image blocking, the workspace rows and their buffers, and the image
    bounds each row or gradient part takes. Made once per shapes, workspace size and thread
    count by :func:`~.conv_geometry.host_call`; its arrays are shared between calls and never
    written."""

    config: Any  # the call's :class:`~.conv_geometry.ConvConfig`
    nb: int  # images per block
    band: int  # output rows per band (im2col)
    pitch: int  # columns per output row of the im2col matrix (conv_geometry.column_pitch)
    rows: int  # workspace rows, one per thread
    row_elems: int  # elements of one row (aligned)
    offs: np.ndarray  # start of each buffer in a row (elements)
    parts: tuple[tuple[int, int], ...]  # gradient partials: (count, elements)
    bounds: np.ndarray  # image bounds of the rows' blocks (forward) or gradient parts
    parallel: bool  # whether the call runs on its rows' threads
    nbytes: int  # the workspace a call without one allocates


def cut_workspace(workspace: np.ndarray | None, call: HostCall, dtype: np.dtype
                  ) -> tuple[np.ndarray, list[np.ndarray]]:
    """The workspace (``None``: a new one) cut into ``call.rows`` rows of ``dtype`` and the
    gradient partials (each ``(count, elements)``, rows padded to the alignment)."""
    it = dtype.itemsize
    if workspace is None:
        workspace = np.empty(call.nbytes, np.uint8)
    per = call.row_elems * it
    rows = workspace[: call.rows * per].view(dtype).reshape(call.rows, call.row_elems)
    views, start = [], call.rows * per
    for count, e in call.parts:
        stride = _aligned(e, it)
        views.append(workspace[start: start + count * stride].view(dtype)
                     .reshape(count, stride // it))
        start += count * stride
    return rows, views
