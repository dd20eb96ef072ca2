"""Lowering: a network bound to input shapes becomes a program of forward and backward steps.

The program (plain data, :mod:`minidl.memory.program`) is the one list of steps that memory
passes rewrite and the executor runs: each step names its layer node and its tensor slots.
:class:`Lowered` adds what only the executor needs: the layer of each node and the
:class:`~minidl.parameter.Parameter` behind each parameter tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .graph import Network
from .layers.base import Layer
from .memory.capabilities import OpCaps, op_caps
from .memory.program import GradInput, Program, Step, TensorSpec
from .memory.units import ALLOCATION_UNIT
from .parameter import Parameter


@dataclass
class Lowered:
    program: Program
    layers: list[Layer]  # node index -> layer (the loss last, in training programs)
    parameters: dict[int, Parameter]  # parameter tensor id -> the parameter
    value_tensors: list[int]  # network value index -> tensor id
    output_tensors: list[int]  # the network outputs' tensor ids
    param_tensors: dict[str, int]  # parameter name -> tensor id
    grad_param_tensors: dict[str, int]


def _float(dt: np.dtype) -> bool:
    return np.issubdtype(dt, np.floating)


class _Builder:
    def __init__(self) -> None:
        self.tensors: list[TensorSpec] = []

    def add(self, name, shape, dtype, category, role, layer="", of=-1, persistent=False) -> int:
        tid = len(self.tensors)
        self.tensors.append(
            TensorSpec(tid, name, tuple(int(s) for s in shape), np.dtype(dtype).name, category,
                       role, layer, of, persistent)
        )
        return tid


def lower(
    net: Network,
    batch_shapes: list[tuple[int, ...]],
    loss: Layer | None = None,
    label_shape: tuple[int, ...] | None = None,
    label_dtype: str = "int64",
    training: bool = True,
    opt_state: list[tuple[str, tuple[int, ...], str]] | None = None,
    accumulate_grads: bool = False,
    options: dict[int, dict[str, Any]] | None = None,
    alignment: int = ALLOCATION_UNIT,
) -> Lowered:
    """Lower ``net`` for ``batch_shapes``. With ``loss`` (taking the network's first output and
    the labels), a training program: forward, loss, then backward in reverse layer order.
    ``accumulate_grads`` adds every parameter gradient into ``.grad`` (micro-batching);
    ``alignment`` is the allocation unit of the pool the program will run on. ``options``
    (node index -> per-op options, e.g. ``{"bptt": schedule}``) size the stash and workspace
    of the layers taking them and ride on their steps to run time."""
    shapes, dtypes = net.infer(batch_shapes)
    options = options or {}

    def opts(i: int) -> dict[str, Any]:
        """The keyword the declarations of node i take (only layers naming options take one)."""
        return {"options": options.get(i, {})} if layers[i].option_names else {}

    b = _Builder()
    n_vals = len(net.values)

    # persistent state first: parameters, their gradients, optimizer state
    param_t: dict[str, int] = {}
    grad_t: dict[str, int] = {}
    for node in net.nodes:
        for p in net.layer_params(node.name).values():
            if p.name not in param_t:
                param_t[p.name] = b.add(p.name, p.shape, p.dtype, "parameter", "param",
                                        node.name, persistent=True)
    if training:
        for node in net.nodes:
            for p in net.layer_params(node.name).values():
                if p.trainable and p.name not in grad_t:
                    grad_t[p.name] = b.add(p.name + ".grad", p.shape, p.dtype, "gradient",
                                           "param_grad", node.name, persistent=True)
        for name, shape, dt in opt_state or []:
            b.add(name, shape, dt, "optimizer_state", "opt_state", persistent=True)

    # values: network inputs, then layer outputs as they are produced
    val_t = [-1] * n_vals
    inputs: list[int] = []
    for k in range(len(net.inputs)):
        val_t[k] = b.add(net.values[k].name, shapes[k], dtypes[k], "input", "value")
        inputs.append(val_t[k])

    nodes = list(net.nodes)
    node_in = [list(nd.in_values) for nd in nodes]
    node_out = [list(nd.out_values) for nd in nodes]
    node_names = [nd.name for nd in nodes]
    node_params = [net.layer_params(nd.name) for nd in nodes]
    label_v = loss_v = -1
    if loss is not None:
        label_v, loss_v = n_vals, n_vals + 1
        shapes = list(shapes) + [tuple(label_shape or (batch_shapes[0][0],)), None]
        dtypes = list(dtypes) + [np.dtype(label_dtype), None]
        out_v = net.output_values[0]
        lshape = loss.output_shapes([shapes[out_v], shapes[label_v]])[0]
        shapes[loss_v] = tuple(lshape)
        dtypes[loss_v] = loss.output_dtypes([dtypes[out_v], dtypes[label_v]])[0]
        loss.name = loss.name or "loss"
        nodes.append(None)  # type: ignore[arg-type]
        node_in.append([out_v, label_v])
        node_out.append([loss_v])
        node_names.append(loss.name)
        node_params.append({})
        val_t.extend([-1, -1])
        val_t[label_v] = b.add("labels", shapes[label_v], dtypes[label_v], "input", "value")
        inputs.append(val_t[label_v])

    layers = [nd.layer for nd in net.nodes] + ([loss] if loss is not None else [])

    # which values carry a gradient: float, downstream of a trainable parameter, upstream of loss
    needs = [False] * len(shapes)
    for i, layer in enumerate(layers):
        has_params = any(p.trainable for p in node_params[i].values())
        src = has_params or any(
            needs[v] for j, v in enumerate(node_in[i]) if j not in layer.nondiff_inputs
        )
        for v in node_out[i]:
            needs[v] = src and _float(dtypes[v])
    reaches = [False] * len(shapes)
    if loss is not None and training:
        reaches[loss_v] = True
        for i in range(len(layers) - 1, -1, -1):
            if any(reaches[v] for v in node_out[i]):
                for v in node_in[i]:
                    reaches[v] = True
    has_grad = [needs[v] and reaches[v] for v in range(len(shapes))]

    steps: list[Step] = []

    def push(**fields) -> None:
        steps.append(Step(index=len(steps), origin=len(steps), **fields))

    def local_params(i: int) -> dict[str, int]:
        return {k: param_t[p.name] for k, p in node_params[i].items()}

    dtype0 = next((d for d in dtypes if d is not None and _float(d)), np.dtype("float32"))
    stash_t: list[dict[str, int]] = []
    caps = [layer_caps(layer) for layer in layers]  # unknown capabilities fail here
    for i, layer in enumerate(layers):
        name = node_names[i]
        in_shapes = [shapes[v] for v in node_in[i]]
        fdt = next((dtypes[v] for v in node_in[i] if _float(dtypes[v])), dtype0)
        for v in node_out[i]:
            val_t[v] = b.add(name if len(node_out[i]) == 1 else f"{name}.{node_out[i].index(v)}",
                             shapes[v], dtypes[v], "feature_map", "value", name)
        st = {
            sname: b.add(f"{name}.{sname}", sshape, sdt, "stash", "stash", name)
            for sname, (sshape, sdt) in layer.stash_specs(in_shapes, fdt, **opts(i)).items()
        }
        stash_t.append(st)
        ws_bytes = layer.forward_workspace_bytes(in_shapes, fdt, **opts(i))
        ws = b.add(f"{name}.fwd_ws", (ws_bytes,), "uint8", "workspace", "workspace", name) \
            if ws_bytes > 0 else -1
        pt = [param_t[p.name] for p in node_params[i].values()]
        reads = tuple(val_t[v] for v in node_in[i]) + tuple(pt)
        writes = tuple(val_t[v] for v in node_out[i]) + tuple(st.values())
        shares = ((val_t[node_out[i][0]], val_t[node_in[i][0]]),) if layer.inplace_forward \
            else ()
        push(phase="forward", layer=name, kind=layer.kind, node=i, reads=reads, writes=writes,
             workspace=ws, flops=int(layer.flops(in_shapes)), shares=shares,
             attrs=layer.memory_attrs(in_shapes), caps=caps[i], options=options.get(i, {}),
             inputs=tuple(val_t[v] for v in node_in[i]),
             outputs=tuple(val_t[v] for v in node_out[i]), stash=st, params=local_params(i),
             in_shapes=tuple(in_shapes))

    grad_of: dict[int, int] = {}
    # with accumulate_grads (micro-batches), every parameter gradient is added, never written
    params_written: set[str] = set(grad_t) if accumulate_grads else set()
    if loss is not None and training:
        seed = b.add("loss.grad", shapes[loss_v], dtypes[loss_v], "gradient_map", "seed", loss.name)
        grad_of[loss_v] = seed
        for i in range(len(layers) - 1, -1, -1):
            layer = layers[i]
            name = node_names[i]
            if not any(has_grad[v] for v in node_out[i]):
                continue
            trainable = {k: p for k, p in node_params[i].items() if p.trainable}
            wants_in = [has_grad[v] and j not in layer.nondiff_inputs
                        for j, v in enumerate(node_in[i])]
            if not trainable and not any(wants_in):
                continue
            in_shapes = [shapes[v] for v in node_in[i]]
            fdt = next((dtypes[v] for v in node_in[i] if _float(dtypes[v])), dtype0)
            g_out = []
            for j, v in enumerate(node_out[i]):
                if v not in grad_of:
                    # an output nothing downstream differentiates (an RNN's last cell state):
                    # its gradient is zeros, made right before this step
                    g_out.append(b.add(f"{name}.zero_grad{j}", shapes[v], dtypes[v],
                                       "gradient_map", "zeros", name))
                else:
                    g_out.append(grad_of[v])
            g_in: list[GradInput | None] = []
            writes: list[int] = []
            for j, v in enumerate(node_in[i]):
                if not wants_in[j]:
                    g_in.append(None)
                    continue
                if v not in grad_of:
                    grad_of[v] = b.add(f"{net_value_name(net, v, node_names, label_v)}.grad",
                                       shapes[v], dtypes[v], "gradient_map", "grad", name,
                                       of=val_t[v])
                    g_in.append(GradInput(grad_of[v]))
                    writes.append(grad_of[v])
                else:
                    part = b.add(f"{name}.grad_in{j}", shapes[v], dtypes[v], "gradient_map",
                                 "grad_partial", name, of=grad_of[v])
                    g_in.append(GradInput(part, grad_of[v]))
                    writes += [part, grad_of[v]]
            gp = {k: grad_t[p.name] for k, p in trainable.items()}
            gpart: dict[str, int] = {}
            adds: set[str] = set()
            for k, p in trainable.items():
                if p.name in params_written:  # shared parameter or micro-batch: accumulate,
                    if layer.accumulates_grads:  # straight into the gradient if the layer can
                        adds.add(k)
                    else:  # or through a partial the executor adds
                        gpart[k] = b.add(f"{name}.{k}.grad_part", p.shape, p.dtype, "gradient",
                                         "grad_partial", name)
                params_written.add(p.name)
            writes += list(gp.values()) + list(gpart.values())
            reads = list(g_out)
            reads += [val_t[node_in[i][j]] for j in layer.retain_inputs]
            reads += [val_t[node_out[i][j]] for j in layer.retain_outputs]
            reads += list(stash_t[i].values())
            reads += [param_t[p.name] for p in node_params[i].values()]
            ws_bytes = layer.backward_workspace_bytes(in_shapes, fdt, **opts(i))
            ws = b.add(f"{name}.bwd_ws", (ws_bytes,), "uint8", "workspace", "workspace", name) \
                if ws_bytes > 0 else -1
            shares = ()
            if layer.inplace_backward and g_in and g_in[0] is not None \
                    and g_in[0].add_into < 0:
                shares = ((g_in[0].written, g_out[0]),)
            push(phase="backward", layer=name, kind=layer.kind, node=i,
                 reads=tuple(dict.fromkeys(reads)), writes=tuple(dict.fromkeys(writes)),
                 workspace=ws, flops=2 * int(layer.flops(in_shapes)), shares=shares,
                 attrs=layer.memory_attrs(in_shapes), caps=caps[i], options=options.get(i, {}),
                 inputs=tuple(val_t[v] for v in node_in[i]),
                 outputs=tuple(val_t[v] for v in node_out[i]), stash=stash_t[i],
                 params=local_params(i), grad_outputs=tuple(g_out), grad_inputs=tuple(g_in),
                 grad_params=gp, param_partials=gpart, accumulate=frozenset(adds),
                 in_shapes=tuple(in_shapes))

    program = Program(
        tensors=b.tensors, steps=steps, inputs=inputs,
        loss=val_t[loss_v] if loss is not None else -1, training=training and loss is not None,
        alignment=alignment,
    )
    parameters = {param_t[p.name]: p for i in range(len(layers)) for p in node_params[i].values()}
    return Lowered(program, layers, parameters, val_t[:n_vals],
                   [val_t[v] for v in net.output_values], param_t, grad_t)


def layer_caps(layer: Layer) -> OpCaps:
    """The memory capabilities ``layer`` declares, checked against memory's vocabulary."""
    return op_caps(f"layer {layer.name or type(layer).__name__}", layer.recompute_cost,
                   tuple(layer.backward_from), layer.sparse_output, layer.convolution,
                   tuple(layer.option_names))


def net_value_name(net: Network, v: int, node_names: list[str], label_v: int) -> str:
    if v < len(net.values):
        return net.values[v].name
    return "labels" if v == label_v else "loss"
