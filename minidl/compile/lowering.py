"""Lowering: a network bound to input shapes becomes a program of forward and backward steps.

The program (plain data, :mod:`minidl.memory.ir.program`) is the one list of steps that memory
passes rewrite and the executor runs: each step names its layer node and its tensor slots.
:class:`Lowered` adds what only the executor needs: the layer of each node and the
:class:`~minidl.net.parameter.Parameter` behind each parameter tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..layers.base import Layer
from ..memory.ir.capabilities import OpCaps, op_caps
from ..memory.ir.names import DeviceKind
from ..memory.ir.payloads import OpFacts
from ..memory.ir.precision import FLOAT32_STATISTICS_OPS, Precision, is_float
from ..memory.ir.program import Program, Step, TensorSpec
from ..memory.ir.step_parts import (
    BackwardSlots,
    ForwardSlots,
    GradInput,
    OpTraits,
    StepAccess,
    StepCost,
)
from ..memory.ir.units import ALLOCATION_UNIT
from ..net.graph import Network
from ..net.parameter import Parameter
from .lowering_precision import PrecisionLowering

#: ``(name, shape, dtype)`` of a persistent tensor the caller declares.
TensorDecl = tuple[str, tuple[int, ...], str]


@dataclass(frozen=True)
class Sharding:
    """What a rank keeps of the persistent state when it is sharded across ranks (ZeRO stages
    2 and 3 build one; lowering knows only this value).

    ``gradient_shards``: the gradient shards kept instead of full persistent gradients; the
    full gradients become tensors of the iteration (written by backward, handed on, freed
    after their last write). ``parameter_shards`` (with ``gradient_shards``): the parameter
    shards kept instead of the trainable parameters; every step using a trainable parameter
    then reads a tensor of its own (the parameter gathered whole just before that step, freed
    after its last use), which :attr:`Lowered.parameters` maps to the parameter."""

    gradient_shards: tuple[TensorDecl, ...] = ()
    parameter_shards: tuple[TensorDecl, ...] | None = None


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
    return is_float(dt)


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
    device_kind: str = "cpu",
    sharding: Sharding | None = None,
    grad_shards: list[TensorDecl] | None = None,
    param_shards: list[TensorDecl] | None = None,
    precision: Precision | str = Precision.FP32,
    half_parameters: frozenset[str] = frozenset(),
) -> Lowered:
    """Lower ``net`` for ``batch_shapes``. With ``loss`` (taking the network's first output and
    the labels), a training program: forward, loss, then backward in reverse layer order.
    ``accumulate_grads`` adds every parameter gradient into ``.grad`` (micro-batching);
    ``alignment`` is the allocation unit of the pool the program will run on. ``options``
    (node index -> per-op options, e.g. ``{"bptt": schedule}``) size the stash and workspace
    of the layers taking them and ride on their steps to run time. ``device_kind`` (``"cpu"``
    or ``"cuda"``) is the kind of device the program will run on: layers naming
    ``"device_kind"`` in their :attr:`~minidl.layers.base.Layer.option_names` get it as an
    option (their workspaces differ per kind), so a dry run on the meta device plans for it.

    ``sharding`` (:class:`Sharding`): the persistent state this rank keeps as shards
    (``grad_shards`` / ``param_shards``: the same given as lists, as before ``Sharding``).

    ``precision`` (:class:`~minidl.memory.ir.precision.Precision`): under ``bf16-mixed`` /
    ``fp16-mixed`` every value, gradient, stash and workspace takes the dtype of
    :mod:`~minidl.memory.ir.precision`'s op policy (with the cast copies and half weights an
    op keeps for its backward); the parameters, their gradients and the optimizer state stay
    as declared. Matrix ops' steps carry the dtype of their products (``matmul_dtype``).
    ``half_parameters``: trainable parameters the device keeps only as their half copy (in
    the precision's half dtype; ``offload=optimizer`` keeps the float32 master on the host):
    their tensors take that dtype, and the ops read them without a cast copy."""
    if sharding is None and (grad_shards is not None or param_shards is not None):
        sharding = Sharding(tuple(grad_shards or ()),
                            None if param_shards is None else tuple(param_shards))
    options = dict(options or {})
    layers = [node.layer for node in net.nodes] + ([loss] if loss is not None else [])
    for i, layer in enumerate(layers):  # (the loss is the last node)
        if "device_kind" in getattr(layer, "option_names", ()):
            options[i] = {**options.get(i, {}), "device_kind": device_kind}
    lo = _Lowering(net, batch_shapes, loss, label_shape, label_dtype, training, options)
    lo.precision = Precision.of(precision)
    if half_parameters and lo.precision.half_dtype is None:
        raise ValueError(f"half parameters need a mixed precision, not {lo.precision.value}")
    lo.half_on_device = frozenset(half_parameters)
    lo.device_kind = DeviceKind(str(device_kind).lower())
    lo.gather = sharding is not None and sharding.parameter_shards is not None and training \
        and loss is not None
    lo.persistent(opt_state or [], sharding)
    lo.graph()
    lo.apply_precision()
    lo.forward_steps()
    if loss is not None and training:
        lo.backward_steps(accumulate_grads)
    return lo.lowered(alignment)


class _Lowering(PrecisionLowering):
    """The state of one lowering, built in the order of the tensor ids: persistent state,
    inputs, forward steps (with their outputs, stashes, workspaces), backward steps."""

    def __init__(self, net: Network, batch_shapes: list[tuple[int, ...]], loss: Layer | None,
                 label_shape: tuple[int, ...] | None, label_dtype: str, training: bool,
                 options: dict[int, dict[str, Any]]) -> None:
        self.net, self.loss, self.training, self.options = net, loss, training, options
        self.batch_shapes, self.label_shape, self.label_dtype = \
            batch_shapes, label_shape, label_dtype
        shapes, dtypes = net.infer(batch_shapes)
        self.shapes, self.dtypes = list(shapes), list(dtypes)
        self.b = _Builder()
        self.n_vals = len(net.values)
        self.param_t: dict[str, int] = {}
        self.grad_t: dict[str, int] = {}
        self.steps: list[Step] = []
        self.stash_t: list[dict[str, int]] = []
        #: Parameter shards: trainable parameters are gathered per step into tensors of their own
        self.gather = False
        self.gathered: dict[int, Any] = {}  # such a tensor -> its Parameter
        self.precision = Precision.FP32
        #: Under mixed precision, per node the dtype it computes in (else None)
        self.compute_dt: list[np.dtype | None] = []
        #: Per node, the inputs its backward reads from a cast copy in its stash
        self.cast_kept: list[frozenset[int]] = []

    # ---------------------------------------------------------------- tensors
    def persistent(self, opt_state: list[TensorDecl], sharding: Sharding | None = None) -> None:
        """Parameters (with parameter shards: the buffers, then the shards), then their
        gradients (or, sharded, the gradient shards: the full gradients are then not
        persistent), then optimizer state."""
        grad_shards = None if sharding is None else sharding.gradient_shards
        param_shards = None if sharding is None else sharding.parameter_shards
        net, b = self.net, self.b
        for node in net.nodes:
            for p in net.layer_params(node.name).values():
                if self.gather and p.trainable:
                    continue  # gathered per step (see _step_params)
                if p.name not in self.param_t:
                    dtype = np.dtype(self.precision.half_dtype) \
                        if p.name in self.half_on_device else p.dtype
                    self.param_t[p.name] = b.add(p.name, p.shape, dtype, "parameter", "param",
                                                 node.name, persistent=True)
        if not self.training:
            return
        for name, shape, dt in (param_shards or []) if self.gather else []:
            b.add(name, shape, dt, "parameter", "param_shard", persistent=True)
        for node in net.nodes:
            for p in net.layer_params(node.name).values():
                if p.trainable and p.name not in self.grad_t:
                    self.grad_t[p.name] = b.add(p.name + ".grad", p.shape, p.dtype, "gradient",
                                                "param_grad", node.name,
                                                persistent=grad_shards is None)
        for name, shape, dt in grad_shards or []:
            b.add(name, shape, dt, "gradient", "grad_shard", persistent=True)
        for name, shape, dt in opt_state:
            b.add(name, shape, dt, "optimizer_state", "opt_state", persistent=True)

    def graph(self) -> None:
        """The fed tensors (inputs, labels) and the node lists, the loss as the last node."""
        net, b, shapes, dtypes = self.net, self.b, self.shapes, self.dtypes
        self.val_t = [-1] * self.n_vals
        self.inputs: list[int] = []
        for k in range(len(net.inputs)):
            self.val_t[k] = b.add(net.values[k].name, shapes[k], dtypes[k], "input", "value")
            self.inputs.append(self.val_t[k])
        nodes = list(net.nodes)
        self.node_in = [list(nd.in_values) for nd in nodes]
        self.node_out = [list(nd.out_values) for nd in nodes]
        self.node_names = [nd.name for nd in nodes]
        self.node_memory = [nd.memory for nd in nodes] + [""]  # the loss: the planner's
        self.node_params = [net.layer_params(nd.name) for nd in nodes]
        self.label_v = self.loss_v = -1
        loss = self.loss
        if loss is not None:
            label_v, loss_v = self.n_vals, self.n_vals + 1
            self.label_v, self.loss_v = label_v, loss_v
            shapes += [tuple(self.label_shape or (self.batch_shapes[0][0],)), None]
            dtypes += [np.dtype(self.label_dtype), None]
            out_v = net.output_values[0]
            shapes[loss_v] = tuple(loss.output_shapes([shapes[out_v], shapes[label_v]])[0])
            dtypes[loss_v] = loss.output_dtypes([dtypes[out_v], dtypes[label_v]])[0]
            loss.name = loss.name or "loss"
            self.node_in.append([out_v, label_v])
            self.node_out.append([loss_v])
            self.node_names.append(loss.name)
            self.node_params.append({})
            self.val_t.extend([-1, -1])
            self.val_t[label_v] = b.add("labels", shapes[label_v], dtypes[label_v], "input",
                                        "value")
            self.inputs.append(self.val_t[label_v])
        self.layers = [nd.layer for nd in net.nodes] + ([loss] if loss is not None else [])
        self.caps = [layer_caps(layer) for layer in self.layers]  # unknown ones fail here
        self.dtype0 = next((d for d in dtypes if d is not None and _float(d)),
                           np.dtype("float32"))

    def _opts(self, i: int) -> dict[str, Any]:
        """The keyword the declarations of node i take (only layers naming options take one)."""
        return {"options": self.options.get(i, {})} if self.layers[i].option_names else {}

    def _float_dtype(self, i: int) -> np.dtype:
        cdt = self.compute_dt[i] if self.compute_dt else None
        if cdt is not None:  # mixed precision: its compute dtype, statistics in float32
            return np.dtype("float32") if self.layers[i].kind in FLOAT32_STATISTICS_OPS \
                else cdt
        return next((self.dtypes[v] for v in self.node_in[i] if _float(self.dtypes[v])),
                    self.dtype0)

    def _step_params(self, i: int, phase: str) -> dict[str, int]:
        """The parameter tensors one step of node i reads, by the layer's local names: the
        persistent ones, or under ZeRO stage 3 for trainable parameters a tensor of this step
        (gathered just before it)."""
        out = {}
        for k, p in self.node_params[i].items():
            if self.gather and p.trainable:
                dtype = np.dtype(self.precision.half_dtype) \
                    if p.name in self.half_on_device else p.dtype
                tid = self.b.add(f"{p.name}@{phase}", p.shape, dtype, "parameter", "param",
                                 self.node_names[i])
                self.gathered[tid] = p
                out[k] = tid
            else:
                out[k] = self.param_t[p.name]
        return out

    def _push(self, i: int, phase: str, workspace: int, shares: tuple[tuple[int, int], ...],
              flops: int, stash: dict[str, int], params: dict[str, int],
              backward: BackwardSlots | None = None, recompute_flops: int = 0) -> None:
        """One step of node i: its named slots filled in here, its reads and writes derived
        from them (:meth:`Step.slot_reads`, :meth:`Step.slot_writes`)."""
        in_shapes = [self.shapes[v] for v in self.node_in[i]]
        step = Step(
            index=len(self.steps), phase=phase, layer=self.node_names[i],
            kind=self.layers[i].kind, node=i,
            forward=ForwardSlots(inputs=tuple(self.val_t[v] for v in self.node_in[i]),
                                 outputs=tuple(self.val_t[v] for v in self.node_out[i]),
                                 stash=stash, params=params, in_shapes=tuple(in_shapes),
                                 param_casts=self.param_casts(i)),
            backward=backward or BackwardSlots(),
            cost=StepCost(flops, recompute_flops, self._matmul_dtype(i), origin=len(self.steps)),
            op=OpTraits(facts=OpFacts.of(self.layers[i].memory_attrs(in_shapes)),
                        caps=self.caps[i], options=self.options.get(i, {}),
                        forced=self.node_memory[i]))
        self.steps.append(step.remapped({}, access=StepAccess(
            step.slot_reads(), step.slot_writes(), workspace, shares)))

    # ---------------------------------------------------------------- steps
    def forward_steps(self) -> None:
        """One forward step per node (the loss last): outputs, stash and workspace made here."""
        b, shapes, dtypes, val_t = self.b, self.shapes, self.dtypes, self.val_t
        for i, layer in enumerate(self.layers):
            name, node_in, node_out = self.node_names[i], self.node_in[i], self.node_out[i]
            in_shapes = [shapes[v] for v in node_in]
            fdt = self._float_dtype(i)
            for v in node_out:
                val_t[v] = b.add(name if len(node_out) == 1 else f"{name}.{node_out.index(v)}",
                                 shapes[v], dtypes[v], "feature_map", "value", name)
            st = {
                sname: b.add(f"{name}.{sname}", sshape, sdt, "stash", "stash", name)
                for sname, (sshape, sdt) in layer.stash_specs(in_shapes, fdt,
                                                              **self._opts(i)).items()
            }
            casts, transient = self._cast_stash(i, name)
            st.update(casts)
            self.stash_t.append(st)
            params = self._step_params(i, "forward")
            ws_bytes = self.forward_workspace(
                i, lambda dt, shapes=None, i=i, s=in_shapes: self.layers[i]
                .forward_workspace_bytes(shapes or s, dt, **self._opts(i)),
                st, params, transient)
            ws = b.add(f"{name}.fwd_ws", (ws_bytes,), "uint8", "workspace", "workspace",
                       name) if ws_bytes > 0 else -1
            shares = ((val_t[node_out[0]], val_t[node_in[0]]),) if layer.inplace_forward \
                else ()
            self._push(i, phase="forward", workspace=ws, shares=shares,
                       flops=int(layer.flops(in_shapes)), stash=st, params=params)

    def _gradient_flags(self) -> list[bool]:
        """Per value: does it carry a gradient (float, downstream of a trainable parameter,
        upstream of the loss)?"""
        n = len(self.shapes)
        needs = [False] * n
        for i, layer in enumerate(self.layers):
            has_params = any(p.trainable for p in self.node_params[i].values())
            src = has_params or any(needs[v] for j, v in enumerate(self.node_in[i])
                                    if j not in layer.nondiff_inputs)
            for v in self.node_out[i]:
                needs[v] = src and _float(self.dtypes[v])
        reaches = [False] * n
        reaches[self.loss_v] = True
        for i in range(len(self.layers) - 1, -1, -1):
            if any(reaches[v] for v in self.node_out[i]):
                for v in self.node_in[i]:
                    reaches[v] = True
        return [needs[v] and reaches[v] for v in range(n)]

    def backward_steps(self, accumulate_grads: bool) -> None:
        """One backward step per node that has a gradient to give, in reverse order."""
        has_grad = self._gradient_flags()
        loss = self.loss
        grad_of = {self.loss_v: self.b.add("loss.grad", self.shapes[self.loss_v],
                                           self.dtypes[self.loss_v], "gradient_map", "seed",
                                           loss.name)}
        # with accumulate_grads (micro-batches), every parameter gradient is added, never written
        params_written: set[str] = set(self.grad_t) if accumulate_grads else set()
        for i in range(len(self.layers) - 1, -1, -1):
            self._backward_step(i, has_grad, grad_of, params_written)

    def _backward_step(self, i: int, has_grad: list[bool], grad_of: dict[int, int],
                       params_written: set[str]) -> None:
        b, shapes, dtypes, val_t = self.b, self.shapes, self.dtypes, self.val_t
        layer, name = self.layers[i], self.node_names[i]
        node_in, node_out = self.node_in[i], self.node_out[i]
        if not any(has_grad[v] for v in node_out):
            return
        trainable = {k: p for k, p in self.node_params[i].items() if p.trainable}
        wants_in = [has_grad[v] and j not in layer.nondiff_inputs for j, v in enumerate(node_in)]
        if not trainable and not any(wants_in):
            return
        in_shapes = [shapes[v] for v in node_in]
        g_out = []
        for j, v in enumerate(node_out):
            if v not in grad_of:
                # an output nothing downstream differentiates (an RNN's last cell state):
                # its gradient is zeros, made right before this step
                g_out.append(b.add(f"{name}.zero_grad{j}", shapes[v], dtypes[v],
                                   "gradient_map", "zeros", name))
            else:
                g_out.append(grad_of[v])
        g_in: list[GradInput | None] = []
        for j, v in enumerate(node_in):
            if not wants_in[j]:
                g_in.append(None)
                continue
            if v not in grad_of:
                vname = net_value_name(self.net, v, self.node_names, self.label_v)
                grad_of[v] = b.add(f"{vname}.grad", shapes[v], dtypes[v], "gradient_map",
                                   "grad", name, of=val_t[v])
                g_in.append(GradInput(grad_of[v]))
            else:
                part = b.add(f"{name}.grad_in{j}", shapes[v], dtypes[v], "gradient_map",
                             "grad_partial", name, of=grad_of[v])
                g_in.append(GradInput(part, grad_of[v]))
        gp = {k: self.grad_t[p.name] for k, p in trainable.items()}
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
        params = self._step_params(i, "backward")
        retained = tuple(j for j in layer.retain_inputs
                         if not self.cast_kept or j not in self.cast_kept[i])
        ws_bytes = self.backward_workspace(
            i, lambda dt, shapes=None: layer.backward_workspace_bytes(
                shapes or in_shapes, dt, **self._opts(i)),
            g_out, g_in, retained, params, wants_in, list(gp.values()))
        ws = b.add(f"{name}.bwd_ws", (ws_bytes,), "uint8", "workspace", "workspace", name) \
            if ws_bytes > 0 else -1
        # forward work a BPTT schedule runs again inside the backward
        redo = int(layer.recompute_flops(in_shapes, self.options.get(i) or None))
        shares = ()
        if layer.inplace_backward and g_in and g_in[0] is not None and g_in[0].add_into < 0:
            shares = ((g_in[0].written, g_out[0]),)
        slots = BackwardSlots(
            grad_outputs=tuple(g_out), grad_inputs=tuple(g_in), grad_params=gp,
            param_partials=gpart, accumulate=frozenset(adds),
            retained_inputs=retained, retained_outputs=tuple(layer.retain_outputs))
        self._push(i, phase="backward", workspace=ws, shares=shares,
                   flops=2 * int(layer.flops(in_shapes)) + redo, stash=self.stash_t[i],
                   params=params, backward=slots, recompute_flops=redo)

    def lowered(self, alignment: int) -> Lowered:
        training = self.training and self.loss is not None
        program = Program(
            tensors=self.b.tensors, steps=self.steps, inputs=self.inputs,
            loss=self.val_t[self.loss_v] if self.loss is not None else -1, training=training,
            alignment=alignment)
        parameters = {self.param_t[p.name]: p for params in self.node_params
                      for p in params.values() if p.name in self.param_t}
        parameters.update(self.gathered)
        return Lowered(program, self.layers, parameters, self.val_t[:self.n_vals],
                       [self.val_t[v] for v in self.net.output_values], self.param_t,
                       self.grad_t)


def layer_caps(layer: Layer) -> OpCaps:
    """The memory capabilities ``layer`` declares, checked against memory's vocabulary."""
    return op_caps(f"layer {layer.name or type(layer).__name__}", layer.recompute_cost,
                   tuple(layer.backward_from), layer.sparse_output, layer.convolution,
                   tuple(layer.option_names))


def net_value_name(net: Network, v: int, node_names: list[str], label_v: int) -> str:
    if v < len(net.values):
        return net.values[v].name
    return "labels" if v == label_v else "loss"
