"""Estimated times of convolution steps under workspace caps: what vDNN's rule
(:mod:`.workspace_peak`) weighs a lower peak against. The estimates are
:func:`~minidl.kernels.convolution.conv_geometry.conv_config`'s configuration costs for the CPU
kernels (never a clock), in multiply-adds of a large im2col product, from each convolution
step's geometry (``step.op.facts.convolution``, recorded at lowering).
"""

from __future__ import annotations

import functools
from bisect import bisect_right

import numpy as np

from ...kernels.convolution import conv_geometry as CG
from ...kernels.convolution.conv_geometry import REFERENCE_ROWS
from ..ir.names import DeviceKind, Phase
from ..ir.program import Program
from .workspace_caps import OPTION, Key, _key


def _rel_time(x_shape: tuple[int, ...], geom: tuple, itemsize: int, backward: bool,
              cap: int | None) -> float:
    """:func:`~minidl.kernels.convolution.conv_geometry.conv_config`'s estimate of the time of the
    configuration it runs under ``cap`` (``None``: the default configuration), per
    multiply-add relative to a large im2col product on one thread, with the rows of
    :data:`~minidl.kernels.convolution.conv_geometry.REFERENCE_ROWS` threads that fit the cap."""
    cout, kernel, stride, padding, dilation, groups = geom
    cfg = CG.conv_config(x_shape, cout, kernel, stride, padding, dilation, groups, itemsize,
                         backward, cap)
    sz = CG._sized(x_shape, cout, kernel, stride, padding, dilation, groups, backward,
                   itemsize, cfg)
    rows = min(REFERENCE_ROWS, sz.units)
    if cap is not None and sz.per:
        rows = max(1, min(rows, (cap - sz.fixed) // sz.per))
    cols = CG._product_cols(x_shape, kernel, stride, padding, dilation, groups, itemsize, sz)
    return CG.WINOGRAD_TIME.get(cfg.algo, 1.0) * (1.0 + CG.SMALL_PRODUCT_COLS / max(1, cols)) \
        / max(1, rows)


@functools.lru_cache(maxsize=4096)
def _time_steps(x_shape: tuple[int, ...], geom: tuple, itemsize: int, backward: bool
                ) -> tuple[tuple[int, ...], tuple[float, ...], float]:
    """The estimated time of a convolution step as a step function of its cap: the caps at
    which :func:`~minidl.kernels.convolution.conv_geometry.conv_config`'s choice or its rows can
    change
    (each candidate configuration's workspace with 1 to REFERENCE_ROWS rows), the relative
    time (:func:`_rel_time`) from each of them on, and the default configuration's."""
    cout, kernel, stride, padding, dilation, groups = geom
    default = CG.conv_config(x_shape, cout, kernel, stride, padding, dilation, groups,
                             itemsize, backward)
    algos = [default.algo] + {"winograd4": ["winograd", "gemm"],
                              "winograd": ["gemm"]}.get(default.algo, [])
    needs = set()
    for algo in algos:
        for col in CG.LEAN_COL_BYTES:
            for parts in ((CG.GRAD_PARTS, 1) if backward else (CG.GRAD_PARTS,)):
                sz = CG._sized(x_shape, cout, kernel, stride, padding, dilation, groups,
                               backward, itemsize, CG.ConvConfig(algo, col, parts))
                needs.update(r * sz.per + sz.fixed
                             for r in range(1, min(REFERENCE_ROWS, sz.units) + 1))
    caps = tuple(sorted(needs))
    return (caps, tuple(_rel_time(x_shape, geom, itemsize, backward, c) for c in caps),
            _rel_time(x_shape, geom, itemsize, backward, None))


class ConvTimes:
    """Estimated times of a program's convolution steps under caps, in multiply-adds of a
    large im2col product (``flops / 2`` times :func:`_rel_time`), and the iteration's
    estimated time (every other step at its multiply-adds): what
    :func:`~.workspace_peak.peak_options` weighs a lower peak against. Convolutions of the
    CPU kind only (their configurations are the CPU kernels'), with the geometry lowering
    recorded (``step.op.facts.convolution``)."""

    def __init__(self, kind: DeviceKind | str = DeviceKind.CPU) -> None:
        self.kind = DeviceKind.of(kind)

    def _steps(self, program: Program, i: int) -> tuple | None:
        st = program.steps[i]
        geom = st.op.facts.convolution
        if self.kind is not DeviceKind.CPU or geom is None or not st.forward.in_shapes \
                or OPTION not in st.op.caps.options:
            return None
        itemsize = np.dtype(program.tensors[st.forward.inputs[0]].dtype).itemsize
        return _time_steps(tuple(st.forward.in_shapes[0]), geom.as_tuple(), itemsize,
                           st.phase == Phase.BACKWARD)

    def table(self, program: Program) -> tuple[dict[Key, list[tuple[float, tuple]]], float]:
        """Per (node, backward) of the steps taking the option: (weight, time steps) of each
        of its steps (weight: the step's multiply-adds); and the iteration's estimated time
        with every convolution at its default configuration."""
        out: dict[Key, list[tuple[float, tuple]]] = {}
        total = 0.0
        for st in program.steps:
            steps = self._steps(program, st.index) if st.access.workspace >= 0 else None
            if steps is None:
                total += st.cost.flops / 2
                continue
            out.setdefault(_key(program, st.index), []).append((st.cost.flops / 2, steps))
            total += st.cost.flops / 2 * steps[2]
        return out, total


def _extra(steps: list[tuple[float, tuple]], cap: int) -> float:
    """Estimated time over the default configuration's of the steps of one key at ``cap``."""
    out = 0.0
    for weight, (caps, rels, default) in steps:
        i = bisect_right(caps, cap) - 1
        out += weight * (rels[max(i, 0)] - default)
    return out
