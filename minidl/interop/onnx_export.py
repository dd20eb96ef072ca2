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

import math
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .. import layers as L
from ..memory.runtime.transfer import to_host
from ..net.graph import Network

#: The opset written by default (LayerNormalization needs 17).
DEFAULT_OPSET = 17
MIN_OPSET = 17
#: Outputs of the graph: the network's values as they are, or with (log-)softmax appended.
HEADS = ("logits", "softmax", "log_softmax")
#: Layers that tie a model to one sequence length (the unrolled RNNs).
_PER_STEP = (L.RNNInputProjection, L.TimeStack, L.LSTMCell, L.GRUCell)


class OnnxExportError(ValueError):
    """A network, layer or argument the exporter cannot write; the message is one line."""


def _onnx() -> Any:
    try:
        import onnx
    except ImportError:
        raise ImportError("ONNX export needs the onnx package: pip install 'minidl[onnx]'"
                          ) from None
    return onnx


class _Graph:
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


# ---------------------------------------------------------------------------- converters
# Each takes (graph, node, input tensor names) and returns the output tensor names.
def _linear(g: _Graph, node, ins, w: str = "weight", b: str | None = "bias", x_rank=None):
    x = ins[0]
    rank = x_rank or len(g.shapes[node.in_values[0]])
    bias = [g.param(node, b)] if b and b in g.net.layer_params(node.name) else []
    if rank == 2:
        return [g.op("Gemm", [x, g.param(node, w), *bias], node.name, transB=1)]
    wt = g.op("Transpose", [g.param(node, w)], f"{node.name}/{w}", perm=[1, 0])
    y = g.op("MatMul", [x, wt], node.name)
    return [g.op("Add", [y, bias[0]], node.name) if bias else y]


def _conv(g: _Graph, node, ins):
    c = node.layer
    (ph, pw), bias = c.padding, ["bias"] if c.bias else []
    return [g.op("Conv", [ins[0], g.param(node, "weight"), *(g.param(node, b) for b in bias)],
                 node.name, kernel_shape=list(c.kernel_size), strides=list(c.stride),
                 pads=[ph, pw, ph, pw], dilations=list(c.dilation), group=c.groups)]


def _pool(g: _Graph, node, ins):
    p = node.layer
    (ph, pw) = p.padding
    attrs = dict(kernel_shape=list(p.kernel_size), strides=list(p.stride), pads=[ph, pw, ph, pw],
                 ceil_mode=0)
    if isinstance(p, L.AvgPool2d):
        return [g.op("AveragePool", ins, node.name, count_include_pad=1, **attrs)]
    return [g.op("MaxPool", ins, node.name, **attrs)]


def _batchnorm(g: _Graph, node, ins):
    bn = node.layer
    dt = g.dtypes[node.out_values[0]]
    if bn.affine:
        scale, shift = g.param(node, "weight"), g.param(node, "bias")
    else:
        scale = g.const(np.ones(bn.num_features), dt, f"{node.name}.weight")
        shift = g.const(np.zeros(bn.num_features), dt, f"{node.name}.bias")
    return [g.op("BatchNormalization", [ins[0], scale, shift, g.param(node, "running_mean"),
                                        g.param(node, "running_var")], node.name,
                 epsilon=bn.eps)]


def _gelu(g: _Graph, node, ins):
    x, dt, form = ins[0], g.dtypes[node.in_values[0]], node.layer.approximate
    if g.opset >= 20:
        return [g.op("Gelu", [x], node.name, approximate=form)]
    c = lambda v: g.const(v, dt)  # noqa: E731
    if form == "tanh":  # 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
        x3 = g.op("Mul", [g.op("Mul", [x, x], node.name), x], node.name)
        u = g.op("Add", [x, g.op("Mul", [x3, c(0.044715)], node.name)], node.name)
        t = g.op("Tanh", [g.op("Mul", [u, c(math.sqrt(2.0 / math.pi))], node.name)], node.name)
    else:  # 0.5 x (1 + erf(x / sqrt(2)))
        t = g.op("Erf", [g.op("Mul", [x, c(math.sqrt(0.5))], node.name)], node.name)
    half_x = g.op("Mul", [x, c(0.5)], node.name)
    return [g.op("Mul", [half_x, g.op("Add", [t, c(1.0)], node.name)], node.name)]


def _flatten(g: _Graph, node, ins):
    rank = len(g.shapes[node.in_values[0]])
    start, end = node.layer.start_dim % rank, node.layer.end_dim % rank
    if start == 1 and end == rank - 1:
        return [g.op("Flatten", ins, node.name, axis=1)]
    parts = [g.op("Shape", ins, node.name, start=0, end=start), g.const([-1])]
    if end < rank - 1:
        parts.append(g.op("Shape", ins, node.name, start=end + 1))
    shape = g.op("Concat", parts, node.name, axis=0)
    return [g.op("Reshape", [ins[0], shape], node.name)]


def _add(g: _Graph, node, ins):
    return [g.op("Add" if len(ins) == 2 else "Sum", ins, node.name)]


def _concat(g: _Graph, node, ins):
    return [g.op("Concat", ins, node.name, axis=node.layer._axis(len(g.shapes[node.in_values[0]])))]


def _time_stack(g: _Graph, node, ins):
    one = g.const([1])
    return [g.op("Concat", [g.op("Unsqueeze", [x, one], node.name) for x in ins], node.name,
                 axis=1)]


def _positional(g: _Graph, node, ins):
    table = g.op("Slice", [g.param(node, "weight"), g.const([0]), g.dim(ins[0], 1),
                           g.const([0])], node.name)
    return [g.op("Add", [ins[0], table], node.name)]


def _zero_state(g: _Graph, node, ins):
    dt = g.dtypes[node.out_values[0]]
    shape = g.op("Concat", [g.dim(ins[0], 0), g.const(list(node.layer.shape))], node.name,
                 axis=0)
    value = g.onnx.numpy_helper.from_array(np.zeros(1, dt))
    return [g.op("ConstantOfShape", [shape], node.name, value=value)]


def _attention(g: _Graph, node, ins):
    a, x, n = node.layer, ins[0], node.name
    dt = g.dtypes[node.in_values[0]]
    hd = a.dim // a.heads
    qkv = _linear(g, node, [x], "qkv.weight", "qkv.bias", x_rank=3)[0]
    qkv = g.op("Reshape", [qkv, g.const([0, 0, 3, a.heads, hd])], n)  # (N, T, 3, H, hd)
    qkv = g.op("Transpose", [qkv], n, perm=[2, 0, 3, 1, 4])  # (3, N, H, T, hd)
    q, k, v = (g.op("Gather", [qkv, g.const(i)], n, axis=0) for i in range(3))
    kt = g.op("Transpose", [k], n, perm=[0, 1, 3, 2])
    scores = g.op("Mul", [g.op("MatMul", [q, kt], n), g.const(1.0 / math.sqrt(hd), dt)], n)
    if a.causal:  # keys after the query masked: lower triangle of a (T, T) matrix of ones
        t = g.dim(x, 1)
        ones = g.op("ConstantOfShape", [g.op("Concat", [t, t], n, axis=0)], n,
                    value=g.onnx.numpy_helper.from_array(np.ones(1, np.bool_)))
        keep = g.op("Trilu", [ones], n, upper=0)
        scores = g.op("Where", [keep, scores, g.const(-np.inf, dt)], n)
    probs = g.op("Softmax", [scores], n, axis=-1)
    heads = g.op("Transpose", [g.op("MatMul", [probs, v], n)], n, perm=[0, 2, 1, 3])
    heads = g.op("Reshape", [heads, g.const([0, 0, a.dim])], n)
    return _linear(g, node, [heads], "proj.weight", "proj.bias", x_rank=3)


def _split(g: _Graph, x: str, parts: int, size: int, axis: int, prefix: str) -> list[str]:
    return g.op("Split", [x, g.const([size] * parts)], prefix, outputs=[
        g.fresh(f"{prefix}/part{i}") for i in range(parts)], axis=axis)


def _rnn_projection(g: _Graph, node, ins):
    p = node.layer
    if p.step_inputs:
        return [_linear(g, node, [x], x_rank=2)[0] for x in ins]
    y = _linear(g, node, ins, x_rank=3)[0]  # (N, T, G)
    one = g.const([1])
    return [g.op("Squeeze", [part, one], node.name)
            for part in _split(g, y, p.steps, 1, 1, node.name)]


def _cell_product(g: _Graph, node, h: str) -> str:
    """``h @ weight_hh.T + bias_hh``."""
    bias = [g.param(node, "bias_hh")] if node.layer.bias else []
    return g.op("Gemm", [h, g.param(node, "weight_hh"), *bias], node.name, transB=1)


def _lstm_cell(g: _Graph, node, ins):
    gx, h_prev, c_prev = ins
    n, hid = node.name, node.layer.hidden_size
    hw = _cell_product(g, node, h_prev)
    i, f, gg, o = _split(g, g.op("Add", [gx, hw], n), 4, hid, 1, n)
    i, f, o = (g.op("Sigmoid", [t], n) for t in (i, f, o))
    c = g.op("Add", [g.op("Mul", [f, c_prev], n), g.op("Mul", [i, g.op("Tanh", [gg], n)], n)], n)
    return [g.op("Mul", [o, g.op("Tanh", [c], n)], n), c]


def _gru_cell(g: _Graph, node, ins):
    gx, h_prev = ins
    n, hid = node.name, node.layer.hidden_size
    hw = _cell_product(g, node, h_prev)
    xr, xz, xn = _split(g, gx, 3, hid, 1, n)
    hr, hz, hn = _split(g, hw, 3, hid, 1, n)
    r = g.op("Sigmoid", [g.op("Add", [xr, hr], n)], n)
    z = g.op("Sigmoid", [g.op("Add", [xz, hz], n)], n)
    new = g.op("Tanh", [g.op("Add", [xn, g.op("Mul", [r, hn], n)], n)], n)
    one_minus_z = g.op("Sub", [g.const(1.0, g.dtypes[node.in_values[1]]), z], n)
    return [g.op("Add", [g.op("Mul", [one_minus_z, new], n), g.op("Mul", [z, h_prev], n)], n)]


#: PyTorch's gate blocks in ONNX's order: LSTM i,f,g,o -> i,o,f,c; GRU r,z,n -> z,r,h.
_GATE_ORDER = {"lstm": (0, 3, 1, 2), "gru": (1, 0, 2)}


def _recurrent(g: _Graph, node, ins):
    r, n = node.layer, node.name
    hid, order = r.hidden_size, _GATE_ORDER[r.cell]

    def gates(a: np.ndarray) -> np.ndarray:  # reorder the gate blocks along axis 0, add dir
        return np.concatenate([a[k * hid:(k + 1) * hid] for k in order])[None]

    x = ins[0]
    if r.vocab_size is not None:
        x = g.op("Gather", [g.param(node, "embedding"), x], n, axis=0)  # (N, T, I)
    x = g.op("Transpose", [x], n, perm=[1, 0, 2])  # time-major (T, N, I)
    op = "LSTM" if r.cell == "lstm" else "GRU"
    attrs = {"hidden_size": hid} | ({"linear_before_reset": 1} if r.cell == "gru" else {})
    for k in range(r.num_layers):
        w = g.const(gates(g.array(node, f"weight_ih_l{k}")), r.dtype, f"{n}.W_l{k}")
        rr = g.const(gates(g.array(node, f"weight_hh_l{k}")), r.dtype, f"{n}.R_l{k}")
        b = ""
        if r.bias:
            b = g.const(np.concatenate([gates(g.array(node, f"bias_ih_l{k}")),
                                        gates(g.array(node, f"bias_hh_l{k}"))], axis=1),
                        r.dtype, f"{n}.B_l{k}")
        y = g.op(op, [x, w, rr, b], n, **attrs)  # (T, 1, N, H)
        x = g.op("Squeeze", [y, g.const([1])], n)
    return [g.op("Transpose", [x], n, perm=[1, 0, 2])]


def _simple(op_type: str, **attrs: Any) -> Callable:
    def convert(g: _Graph, node, ins):
        extra = {k: v(node.layer) if callable(v) else v for k, v in attrs.items()}
        return [g.op(op_type, ins, node.name, **extra)]
    return convert


#: Layer class -> converter (subclasses take their base's).
CONVERTERS: dict[type, Callable] = {
    L.Conv2d: _conv,
    L.Linear: _linear,
    L.ReLU: _simple("Relu"),
    L.LeakyReLU: _simple("LeakyRelu", alpha=lambda layer: layer.negative_slope),
    L.Sigmoid: _simple("Sigmoid"),
    L.Tanh: _simple("Tanh"),
    L.GELU: _gelu,
    L.MaxPool2d: _pool,
    L.AvgPool2d: _pool,
    L.GlobalAvgPool2d: lambda g, node, ins: [g.op(
        "Flatten", [g.op("GlobalAveragePool", ins, node.name)], node.name, axis=1)],
    L.BatchNorm1d: _batchnorm,
    L.BatchNorm2d: _batchnorm,
    L.LayerNorm: lambda g, node, ins: [g.op(
        "LayerNormalization", [ins[0], g.param(node, "weight"), g.param(node, "bias")],
        node.name, axis=-1, epsilon=node.layer.eps)],
    L.Flatten: _flatten,
    L.Add: _add,
    L.Concat: _concat,
    L.TimeStack: _time_stack,
    L.Dropout: _simple("Identity"),
    L.Embedding: lambda g, node, ins: [g.op("Gather", [g.param(node, "weight"), ins[0]],
                                            node.name, axis=0)],
    L.PositionalEmbedding: _positional,
    L.MultiHeadAttention: _attention,
    L.LSTM: _recurrent,
    L.GRU: _recurrent,
    L.RNNInputProjection: _rnn_projection,
    L.LSTMCell: _lstm_cell,
    L.GRUCell: _gru_cell,
    L.ZeroState: _zero_state,
}
SUPPORTED_LAYERS = tuple(sorted(c.__name__ for c in CONVERTERS))


def _converter(node: Any) -> Callable:
    """The converter of ``node``'s layer; :class:`OnnxExportError` when there is none."""
    layer = node.layer
    if isinstance(layer, L.BatchNorm1d | L.BatchNorm2d) and not layer.track_running_stats:
        raise OnnxExportError(f"cannot export layer {node.name!r} ({layer.describe()}) to ONNX: "
                              "without running statistics it normalises with the batch's "
                              "statistics even in inference")
    if isinstance(layer, L.LSTM | L.GRU) and layer.initial_state:
        raise OnnxExportError(f"cannot export layer {node.name!r} ({layer.describe()}) to ONNX: "
                              "initial states as inputs are not supported (zero states are)")
    for cls in type(layer).__mro__:
        if cls in CONVERTERS:
            return CONVERTERS[cls]
    raise OnnxExportError(
        f"cannot export layer {node.name!r} ({node.layer.describe()}) to ONNX: "
        f"{type(node.layer).__name__} is not supported (supported: {', '.join(SUPPORTED_LAYERS)})")


def check_exportable(net: Network) -> None:
    """Raise :class:`OnnxExportError` naming the first layer the exporter cannot write."""
    for node in net.nodes:
        _converter(node)


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
    if head not in HEADS:
        raise OnnxExportError(f"head must be one of {', '.join(HEADS)}, got {head!r}")
    newest = onnx.defs.onnx_opset_version()
    if not MIN_OPSET <= opset <= newest:
        raise OnnxExportError(f"opset {opset} is not supported: {MIN_OPSET} to {newest} (this "
                              "onnx package's newest)")
    net, shape = _resolve(net, input_shape)
    check_exportable(net)
    extra = [s.shape for s in net.inputs[1:]]
    if any(s is None for s in extra):
        raise OnnxExportError(f"{net.name}: every input after the first needs a fixed shape")
    shapes, dtypes = net.infer([(1, *shape), *((1, *s) for s in extra)])
    g = _Graph(onnx, net, opset, shapes, dtypes)
    free = dynamic_dims(net, shape)
    probe = _propagate(net, [(1, *_probe(shape, free)), *((1, *s) for s in extra)]) \
        if free else shapes
    h = onnx.helper
    names: dict[int, str] = {}
    inputs = []
    for k in range(len(net.inputs)):
        names[k] = g.fresh(net.values[k].name)
        dims: list[Any] = ["batch", *shapes[k][1:]]
        if k == 0:
            for axis, label in free.items():
                dims[axis] = label
        elem = h.np_dtype_to_tensor_dtype(np.dtype(dtypes[k]))
        inputs.append(h.make_tensor_value_info(names[k], elem, dims))
    for node in net.nodes:
        outs = _converter(node)(g, node, [names[v] for v in node.in_values])
        for v, t in zip(node.out_values, outs):
            names[v] = t
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
            name, h.np_dtype_to_tensor_dtype(np.dtype(dtypes[v])), dims))
    inits = [onnx.numpy_helper.from_array(a, name) for name, a in g.inits.items()]
    graph = h.make_graph(g.nodes, net.name, inputs, outputs, inits)
    ir = 8 if opset <= 18 else 9 if opset <= 20 else 10
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", opset)], ir_version=ir,
                         producer_name="minidl", doc_string=f"{net.name}, exported by minidl")
    return model


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
