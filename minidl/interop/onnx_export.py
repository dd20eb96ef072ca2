"""ONNX export of a network for inference: :func:`export_onnx` (``minidl export``).

The exporter walks the :class:`~minidl.net.graph.Network` graph node by node (the nodes are in
topological order) and writes each layer as standard ONNX operators of opset 17 or later, the
eval-mode math of the layer (Dropout is the identity, BatchNorm uses its running statistics):

==========================  ============================================================
minidl layer                ONNX operators
==========================  ============================================================
Conv2d                      Conv (pads, strides, dilations, groups)
Linear                      Gemm on (N, F) inputs; MatMul (weight transposed) + Add else
ReLU, LeakyReLU, Sigmoid,   Relu, LeakyRelu, Sigmoid, Tanh
Tanh
GELU                        its erf or tanh form (Erf / Tanh, Mul, Add); Gelu from opset 20
MaxPool2d, AvgPool2d        MaxPool, AveragePool (count_include_pad=1), floor mode
GlobalAvgPool2d             GlobalAveragePool + Flatten
BatchNorm1d, BatchNorm2d    BatchNormalization (running statistics)
LayerNorm                   LayerNormalization (last axis)
Flatten                     Flatten (start_dim 1, end_dim -1) or Reshape
Add, Concat, TimeStack      Add / Sum, Concat, Unsqueeze + Concat
Dropout                     Identity
Embedding                   Gather
PositionalEmbedding         Slice of the table to the input's length + Add
MultiHeadAttention          MatMul + Reshape / Transpose into heads, scaled MatMul, the
                            causal mask (Trilu + Where), Softmax, MatMul, projection
LSTM, GRU (fused)           one ONNX LSTM / GRU per layer (gates reordered from PyTorch's
                            i,f,g,o to ONNX's i,o,f,c and r,z,n to z,r,h; GRU with
                            linear_before_reset=1, PyTorch's formula), the owned embedding
                            as Gather
RNNInputProjection,         the unrolled forms: MatMul / Gemm + Split, the cell's gate math
LSTMCell, GRUCell,          (Gemm, Split, Sigmoid, Tanh, Mul, Add), ConstantOfShape
ZeroState
==========================  ============================================================

Anything else (the losses, BatchNorm without running statistics, a fused RNN taking its
initial states as inputs) is refused with one line naming the layer and its type
(:class:`OnnxExportError`). ``head="softmax"`` or ``"log_softmax"`` appends Softmax /
LogSoftmax over the last axis to each output.

The batch dimension is dynamic (``"batch"``); so is the sequence length (``"seq"``) of token
models without per-step nodes (GPT and BERT up to their context, the fused char RNNs; the
unrolled RNNs are built for one length), and the image size (``"height"``, ``"width"``) of
image models whose output shape does not depend on it (a global pooling before the
classifier: the ResNets); see :func:`dynamic_dims`. Parameters are initializers under their
state-dict names (a tied weight once); the fused RNNs' reordered gate blocks are new tensors
(``lstm.W_l0``, ...).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from .. import layers as L
from ..net.graph import Network
from .onnx_converters import CONVERTERS, SUPPORTED_LAYERS, check_exportable, converter_for
from .onnx_graph import OnnxExportError, OnnxGraph

#: The opset written by default (LayerNormalization needs 17).
DEFAULT_OPSET = 17
MIN_OPSET = 17
#: Outputs of the graph: the network's values as they are, or with (log-)softmax appended.
HEADS = ("logits", "softmax", "log_softmax")
#: Layers that tie a model to one sequence length (the unrolled RNNs).
_PER_STEP = (L.RNNInputProjection, L.TimeStack, L.LSTMCell, L.GRUCell)


def _onnx() -> Any:
    try:
        import onnx
    except ImportError:
        raise ImportError("ONNX export needs the onnx package: pip install 'minidl[onnx]'"
                          ) from None
    return onnx


def _resolve(net: Network, input_shape: Sequence[int] | None) -> tuple[Network, tuple[int, ...]]:
    """The build of ``net`` for per-sample ``input_shape`` (default: the network's own)."""
    if len(net.inputs) != 1 and input_shape is not None:
        raise OnnxExportError("input_shape is for one-input networks; this one has "
                              f"{len(net.inputs)} inputs")
    shape = tuple(int(d) for d in input_shape) if input_shape is not None \
        else net.input_shapes[0]
    if shape is None:
        raise OnnxExportError(f"{net.name} has no fixed input shape: pass input_shape=(C, H, W) "
                              "or (T,)")
    if any(d < 1 for d in shape):
        raise OnnxExportError(f"input_shape must be positive, got {shape}")
    return net.for_shapes([(1, *shape)]), shape


def _propagate(net: Network, batch_shapes: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
    """Every value's shape for these input shapes (:meth:`Network.infer` without its check of
    the inputs' declared per-sample shapes); raises where a layer refuses its input."""
    shapes: list[Any] = [None] * len(net.values)
    shapes[:len(batch_shapes)] = [tuple(s) for s in batch_shapes]
    for node in net.nodes:
        outs = node.layer.output_shapes([shapes[v] for v in node.in_values])
        for v, s in zip(node.out_values, outs):
            shapes[v] = tuple(int(d) for d in s)
    return shapes


def _probe(shape: tuple[int, ...], free: dict[int, str]) -> tuple[int, ...]:
    """Another per-sample shape, differing on the ``free`` axes (batch-first numbering)."""
    if len(shape) == 1:
        return (shape[0] - 1 if shape[0] > 1 else 2,)
    return tuple(2 * d if a + 1 in free else d for a, d in enumerate(shape))


def dynamic_dims(net: Network, shape: Sequence[int]) -> dict[int, str]:
    """The first input's axes (batch-first numbering, beside the batch) the exported file
    leaves free: ``{1: "seq"}`` for a token model without per-step nodes, ``{2: "height",
    3: "width"}`` for an image model whose layers take other sizes to the same output shape
    (a global pooling before the classifier), else none. ``net`` is the build for ``shape``."""
    shape = tuple(shape)
    dt = np.dtype(net.inputs[0].dtype)
    if np.issubdtype(dt, np.integer) and len(shape) == 1:
        if any(isinstance(n.layer, _PER_STEP) for n in net.nodes):
            return {}
        free = {1: "seq"}
    elif len(shape) == 3:
        free = {2: "height", 3: "width"}
    else:
        return {}
    extra = [(1, *s.shape) for s in net.inputs[1:] if s.shape is not None]
    try:
        a = _propagate(net, [(1, *shape), *extra])
        b = _propagate(net, [(1, *_probe(shape, free)), *extra])
    except (ValueError, TypeError, IndexError):
        return {}
    if len(shape) == 3 and any(a[v] != b[v] for v in net.output_values):
        return {}
    return free


def to_onnx(net: Network, input_shape: Sequence[int] | None = None, *,
            opset: int = DEFAULT_OPSET, head: str = "logits") -> Any:
    """The ``onnx.ModelProto`` of ``net``'s eval-mode forward (see the module docstring) for
    per-sample ``input_shape`` (default: the network's), the batch dimension dynamic."""
    onnx = _onnx()
    _check_head_and_opset(onnx, head, opset)
    net, shape = _resolve(net, input_shape)
    check_exportable(net)
    extra = [s.shape for s in net.inputs[1:]]
    if any(s is None for s in extra):
        raise OnnxExportError(f"{net.name}: every input after the first needs a fixed shape")
    shapes, dtypes = net.infer([(1, *shape), *((1, *s) for s in extra)])
    g = OnnxGraph(onnx, net, opset, shapes, dtypes)
    free = dynamic_dims(net, shape)
    probe = _propagate(net, [(1, *_probe(shape, free)), *((1, *s) for s in extra)]) \
        if free else shapes
    names, inputs = _graph_inputs(g, free)
    for node in net.nodes:
        outs = converter_for(node)(g, node, [names[v] for v in node.in_values])
        for v, t in zip(node.out_values, outs):
            names[v] = t
    outputs = _graph_outputs(g, names, probe, free, head)
    h = onnx.helper
    inits = [onnx.numpy_helper.from_array(a, name) for name, a in g.inits.items()]
    graph = h.make_graph(g.nodes, net.name, inputs, outputs, inits)
    ir = 8 if opset <= 18 else 9 if opset <= 20 else 10
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", opset)], ir_version=ir,
                         producer_name="minidl", doc_string=f"{net.name}, exported by minidl")
    return model


def _check_head_and_opset(onnx: Any, head: str, opset: int) -> None:
    """:class:`OnnxExportError` for a head not in :data:`HEADS` or an opset outside
    :data:`MIN_OPSET` to the onnx package's newest."""
    if head not in HEADS:
        raise OnnxExportError(f"head must be one of {', '.join(HEADS)}, got {head!r}")
    newest = onnx.defs.onnx_opset_version()
    if not MIN_OPSET <= opset <= newest:
        raise OnnxExportError(f"opset {opset} is not supported: {MIN_OPSET} to {newest} (this "
                              "onnx package's newest)")


def _graph_inputs(g: OnnxGraph, free: dict[int, str]) -> tuple[dict[int, str], list[Any]]:
    """The graph's inputs: each network input's tensor name (by value) and value info, the
    batch dimension ``"batch"`` and the first input's ``free`` axes named."""
    h, net = g.h, g.net
    names: dict[int, str] = {}
    inputs = []
    for k in range(len(net.inputs)):
        names[k] = g.fresh(net.values[k].name)
        dims: list[Any] = ["batch", *g.shapes[k][1:]]
        if k == 0:
            for axis, label in free.items():
                dims[axis] = label
        elem = h.np_dtype_to_tensor_dtype(np.dtype(g.dtypes[k]))
        inputs.append(h.make_tensor_value_info(names[k], elem, dims))
    return names, inputs


def _graph_outputs(g: OnnxGraph, names: dict[int, str], probe: list[tuple[int, ...]],
                   free: dict[int, str], head: str) -> list[Any]:
    """The graph's outputs: each network output through the ``head`` (Identity, Softmax or
    LogSoftmax) under the name ``output`` (``output0``, ... for several), its dimensions that
    follow a free input axis named as that axis (else ``<output>_dim<i>``)."""
    h, net, shapes = g.h, g.net, g.shapes
    outputs = []
    for k, v in enumerate(net.output_values):
        name = g.fresh("output" if len(net.output_values) == 1 else f"output{k}")
        if head == "logits":
            g.op("Identity", [names[v]], name, outputs=[name])
        else:
            op = "Softmax" if head == "softmax" else "LogSoftmax"
            g.op(op, [names[v]], name, outputs=[name], axis=-1)
        dims = ["batch", *shapes[v][1:]]
        for i in range(1, len(dims)):  # dims that follow a dynamic input dim
            if shapes[v][i] != probe[v][i]:
                same = [lab for a, lab in free.items()
                        if (shapes[0][a], probe[0][a]) == (shapes[v][i], probe[v][i])]
                dims[i] = same[0] if same else f"{name}_dim{i}"
        outputs.append(h.make_tensor_value_info(
            name, h.np_dtype_to_tensor_dtype(np.dtype(g.dtypes[v])), dims))
    return outputs


def export_onnx(net: Network, path: str | os.PathLike, input_shape: Sequence[int] | None = None,
                *, opset: int = DEFAULT_OPSET, head: str = "logits") -> Any:
    """Write ``net`` (eval mode) to the ONNX file ``path`` for per-sample ``input_shape``
    (``(C, H, W)`` or ``(T,)``; default the network's), the batch dimension dynamic; checked
    with ``onnx.checker``. Weights over 2 GiB go to ``path + ".data"`` beside it (ONNX's
    external data). Returns the ``onnx.ModelProto``."""
    onnx = _onnx()
    model = to_onnx(net, input_shape, opset=opset, head=head)
    big = sum(t.ByteSize() for t in model.graph.initializer) > (1 << 31) - (1 << 24)
    if not big:
        onnx.checker.check_model(model, full_check=False)
    path = os.fspath(path)
    onnx.save_model(model, path, save_as_external_data=big, all_tensors_to_one_file=True,
                    location=os.path.basename(path) + ".data")
    if big:
        onnx.checker.check_model(path)
    return model


def run_onnx(path: str | os.PathLike, *inputs: np.ndarray) -> list[np.ndarray]:
    """The outputs of the ONNX file ``path`` on ``inputs``, by onnxruntime (CPU)."""
    try:
        import onnxruntime as ort
    except ImportError:
        raise ImportError("running an ONNX file needs onnxruntime: pip install onnxruntime"
                          ) from None
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    sess = ort.InferenceSession(os.fspath(path), opts, providers=["CPUExecutionProvider"])
    feed = {i.name: np.ascontiguousarray(x) for i, x in zip(sess.get_inputs(), inputs)}
    return sess.run(None, feed)


__all__ = ["CONVERTERS", "DEFAULT_OPSET", "HEADS", "OnnxExportError", "SUPPORTED_LAYERS",
           "check_exportable", "export_onnx", "run_onnx", "to_onnx"]
