"""The per-layer node emitters of the ONNX exporter: one converter per minidl layer class
(:data:`CONVERTERS`), each writing the layer's eval-mode math as standard ONNX operators (the
table in :mod:`~minidl.interop.onnx_export`)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from .. import layers as L
from ..net.graph import Network
from .onnx_graph import OnnxExportError, OnnxGraph


# ---------------------------------------------------------------------------- converters
# Each takes (graph, node, input tensor names) and returns the output tensor names.
def _linear(g: OnnxGraph, node, ins, w: str = "weight", b: str | None = "bias", x_rank=None):
    x = ins[0]
    rank = x_rank or len(g.shapes[node.in_values[0]])
    bias = [g.param(node, b)] if b and b in g.net.layer_params(node.name) else []
    if rank == 2:
        return [g.op("Gemm", [x, g.param(node, w), *bias], node.name, transB=1)]
    wt = g.op("Transpose", [g.param(node, w)], f"{node.name}/{w}", perm=[1, 0])
    y = g.op("MatMul", [x, wt], node.name)
    return [g.op("Add", [y, bias[0]], node.name) if bias else y]


def _conv(g: OnnxGraph, node, ins):
    c = node.layer
    (ph, pw), bias = c.padding, ["bias"] if c.bias else []
    return [g.op("Conv", [ins[0], g.param(node, "weight"), *(g.param(node, b) for b in bias)],
                 node.name, kernel_shape=list(c.kernel_size), strides=list(c.stride),
                 pads=[ph, pw, ph, pw], dilations=list(c.dilation), group=c.groups)]


def _pool(g: OnnxGraph, node, ins):
    p = node.layer
    (ph, pw) = p.padding
    attrs = dict(kernel_shape=list(p.kernel_size), strides=list(p.stride), pads=[ph, pw, ph, pw],
                 ceil_mode=0)
    if isinstance(p, L.AvgPool2d):
        return [g.op("AveragePool", ins, node.name, count_include_pad=1, **attrs)]
    return [g.op("MaxPool", ins, node.name, **attrs)]


def _batchnorm(g: OnnxGraph, node, ins):
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


def _gelu(g: OnnxGraph, node, ins):
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


def _flatten(g: OnnxGraph, node, ins):
    rank = len(g.shapes[node.in_values[0]])
    start, end = node.layer.start_dim % rank, node.layer.end_dim % rank
    if start == 1 and end == rank - 1:
        return [g.op("Flatten", ins, node.name, axis=1)]
    parts = [g.op("Shape", ins, node.name, start=0, end=start), g.const([-1])]
    if end < rank - 1:
        parts.append(g.op("Shape", ins, node.name, start=end + 1))
    shape = g.op("Concat", parts, node.name, axis=0)
    return [g.op("Reshape", [ins[0], shape], node.name)]


def _add(g: OnnxGraph, node, ins):
    return [g.op("Add" if len(ins) == 2 else "Sum", ins, node.name)]


def _concat(g: OnnxGraph, node, ins):
    return [g.op("Concat", ins, node.name, axis=node.layer._axis(len(g.shapes[node.in_values[0]])))]


def _time_stack(g: OnnxGraph, node, ins):
    one = g.const([1])
    return [g.op("Concat", [g.op("Unsqueeze", [x, one], node.name) for x in ins], node.name,
                 axis=1)]


def _positional(g: OnnxGraph, node, ins):
    table = g.op("Slice", [g.param(node, "weight"), g.const([0]), g.dim(ins[0], 1),
                           g.const([0])], node.name)
    return [g.op("Add", [ins[0], table], node.name)]


def _zero_state(g: OnnxGraph, node, ins):
    dt = g.dtypes[node.out_values[0]]
    shape = g.op("Concat", [g.dim(ins[0], 0), g.const(list(node.layer.shape))], node.name,
                 axis=0)
    value = g.onnx.numpy_helper.from_array(np.zeros(1, dt))
    return [g.op("ConstantOfShape", [shape], node.name, value=value)]


def _attention(g: OnnxGraph, node, ins):
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


def _split(g: OnnxGraph, x: str, parts: int, size: int, axis: int, prefix: str) -> list[str]:
    return g.op("Split", [x, g.const([size] * parts)], prefix, outputs=[
        g.fresh(f"{prefix}/part{i}") for i in range(parts)], axis=axis)


def _rnn_projection(g: OnnxGraph, node, ins):
    p = node.layer
    if p.step_inputs:
        return [_linear(g, node, [x], x_rank=2)[0] for x in ins]
    y = _linear(g, node, ins, x_rank=3)[0]  # (N, T, G)
    one = g.const([1])
    return [g.op("Squeeze", [part, one], node.name)
            for part in _split(g, y, p.steps, 1, 1, node.name)]


def _cell_product(g: OnnxGraph, node, h: str) -> str:
    """``h @ weight_hh.T + bias_hh``."""
    bias = [g.param(node, "bias_hh")] if node.layer.bias else []
    return g.op("Gemm", [h, g.param(node, "weight_hh"), *bias], node.name, transB=1)


def _lstm_cell(g: OnnxGraph, node, ins):
    gx, h_prev, c_prev = ins
    n, hid = node.name, node.layer.hidden_size
    hw = _cell_product(g, node, h_prev)
    i, f, gg, o = _split(g, g.op("Add", [gx, hw], n), 4, hid, 1, n)
    i, f, o = (g.op("Sigmoid", [t], n) for t in (i, f, o))
    c = g.op("Add", [g.op("Mul", [f, c_prev], n), g.op("Mul", [i, g.op("Tanh", [gg], n)], n)], n)
    return [g.op("Mul", [o, g.op("Tanh", [c], n)], n), c]


def _gru_cell(g: OnnxGraph, node, ins):
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


def _recurrent(g: OnnxGraph, node, ins):
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
    def convert(g: OnnxGraph, node, ins):
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


def converter_for(node: Any) -> Callable:
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
        converter_for(node)
