"""The ONNX graph being written by :func:`~minidl.interop.onnx_export.to_onnx`: its nodes and
initializers, unique tensor names, cached constants and shape lookups."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..memory.runtime.transfer import to_host
from ..net.graph import Network


class OnnxExportError(ValueError):
    """A network, layer or argument the exporter cannot write; the message is one line."""


class OnnxGraph:
    """The ONNX nodes and initializers being written, with unique tensor names."""

    def __init__(self, onnx: Any, net: Network, opset: int, shapes, dtypes) -> None:
        self.onnx, self.h, self.net, self.opset = onnx, onnx.helper, net, opset
        self.shapes, self.dtypes = shapes, dtypes
        self.nodes: list[Any] = []
        self.inits: dict[str, np.ndarray] = {}
        self.taken: set[str] = {p for p, _ in net.named_parameters(True)}
        self.cache: dict[Any, str] = {}

    def fresh(self, base: str) -> str:
        name, k = base, 1
        while name in self.taken:
            k += 1
            name = f"{base}_{k}"
        self.taken.add(name)
        return name

    def op(self, op_type: str, inputs: Sequence[str], prefix: str, outputs: int | list[str] = 1,
           **attrs: Any) -> Any:
        """Add one node; returns its output name (or the list, for several outputs)."""
        several = isinstance(outputs, list) or outputs > 1
        outs = outputs if isinstance(outputs, list) else [
            self.fresh(f"{prefix}/{op_type}") for _ in range(outputs)]
        while inputs and inputs[-1] == "":  # trailing optional inputs left out
            inputs = inputs[:-1]
        self.nodes.append(self.h.make_node(op_type, list(inputs), outs,
                                           name=self.fresh(f"{prefix}:{op_type}"), **attrs))
        return outs if several else outs[0]

    def const(self, value: Any, dtype: Any = np.int64, name: str = "const") -> str:
        a = np.asarray(value, dtype=dtype)
        key = ("const", a.dtype.str, a.shape, a.tobytes())
        if key not in self.cache:
            self.cache[key] = self.fresh(name)
            self.inits[self.cache[key]] = a
        return self.cache[key]

    def param(self, node: Any, local: str) -> str:
        """The initializer of parameter ``local`` of ``node`` (by its state-dict name)."""
        p = self.net.layer_params(node.name)[local]
        if p.name not in self.inits:
            self.inits[p.name] = np.ascontiguousarray(to_host(p.data))
        return p.name

    def array(self, node: Any, local: str) -> np.ndarray:
        return np.asarray(to_host(self.net.layer_params(node.name)[local].data))

    def dim(self, x: str, axis: int) -> str:
        """``x``'s size on ``axis`` as a 1-element int64 tensor (Shape + Gather, cached)."""
        key = ("dim", x, axis)
        if key not in self.cache:
            shape = self.op("Shape", [x], f"{x}/shape")
            self.cache[key] = self.op("Gather", [shape, self.const([axis])], f"{x}/dim{axis}",
                                      axis=0)
        return self.cache[key]
