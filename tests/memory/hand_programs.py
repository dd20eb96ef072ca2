"""Small training programs built by hand for the memory-pass unit tests: no network, no
layers, only :mod:`minidl.memory` records.

:func:`lower_layers` turns a list of :class:`HandLayer` into a :class:`Program` the way the
engine lowers a network (persistent state first, then inputs, forward steps in order with their
outputs, stashes and workspaces, the loss, then backward steps in reverse with fan-out partial
gradients), so the passes see the shapes of real programs. Tensors are found by name with
:func:`ids`; plans are rendered with :func:`render` for exact comparisons.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from minidl.memory.ir.capabilities import OpCaps, op_caps
from minidl.memory.ir.payloads import OpFacts, PoolWindow
from minidl.memory.ir.plan import Plan
from minidl.memory.ir.program import Program, Step, TensorSpec
from minidl.memory.ir.step_parts import (
    BackwardSlots,
    ForwardSlots,
    GradInput,
    OpTraits,
    StepAccess,
    StepCost,
)

#: Capabilities of the op kinds used here, as their layers declare them.
CAPS: dict[str, OpCaps] = {
    "conv": op_caps("conv", cost="expensive", convolution=True),
    "linear": op_caps("linear", cost="expensive"),
    "add": op_caps("add", cost="expensive"),
    "relu": op_caps("relu", backward_from=("sign",), sparse_output=True),
    "pool": op_caps("pool", backward_from=("packed_argmax",)),
    "loss": op_caps("loss"),
}
#: A 2x2 max-pool's facts, as lowering states them for memory.
MAX_POOL_2X2 = OpFacts(pool=PoolWindow(4, (2, 2), (2, 2), (0, 0)))
#: float32 elements in one 512-byte allocation unit: a shape of (k * UNIT,) is k units.
UNIT = 128


@dataclass
class HandLayer:
    """One layer as lowering sees it. ``inputs`` name values (``"x"`` is the data); the output
    value is named after the layer. ``keeps`` says what backward reads: ``"inputs"``,
    ``"output"`` or nothing."""

    name: str
    kind: str
    inputs: tuple[str, ...]
    units: int
    params: tuple[str, ...] = ()
    stash: dict[str, int] = field(default_factory=dict)  # stash name -> units
    fwd_workspace: int = 0  # units
    bwd_workspace: int = 0
    keeps: str = "inputs"
    inplace_forward: bool = False
    inplace_backward: bool = False
    facts: OpFacts = OpFacts()
    flops: int = 1000


def lower_layers(layers: list[HandLayer], input_units: int = 4, loss_after: str | None = None,
                 alignment: int = 512) -> Program:
    """The training program of ``layers`` on data ``x`` with a ``loss`` layer reading the last
    layer's output (or ``loss_after``) and ``labels``."""
    tensors: list[TensorSpec] = []

    def add(name, units, category, role, layer="", of=-1, persistent=False) -> int:
        tensors.append(TensorSpec(len(tensors), name, (units * UNIT,), "float32", category,
                                  role, layer, of, persistent))
        return len(tensors) - 1

    param_t = {f"{ly.name}.{p}": add(f"{ly.name}.{p}", 1, "parameter", "param", ly.name,
                                     persistent=True) for ly in layers for p in ly.params}
    grad_t = {name: add(f"{name}.grad", 1, "gradient", "param_grad", name.split(".")[0],
                        persistent=True) for name in param_t}
    value = {"x": add("x", input_units, "input", "value")}
    value["labels"] = add("labels", 1, "input", "value")
    loss = HandLayer("loss", "loss", (loss_after or layers[-1].name, "labels"), 1)
    every = [*layers, loss]
    steps: list[Step] = []
    stash_of: dict[str, dict[str, int]] = {}
    for node, ly in enumerate(every):
        out = value[ly.name] = add(ly.name, ly.units, "feature_map", "value", ly.name)
        stash = {k: add(f"{ly.name}.{k}", u, "stash", "stash", ly.name)
                 for k, u in ly.stash.items()}
        stash_of[ly.name] = stash
        ws = add(f"{ly.name}.fwd_ws", ly.fwd_workspace, "workspace", "workspace", ly.name) \
            if ly.fwd_workspace else -1
        ins = tuple(value[v] for v in ly.inputs)
        params = {p: param_t[f"{ly.name}.{p}"] for p in ly.params}
        steps.append(Step(
            len(steps), "forward", ly.name, ly.kind, node,
            StepAccess(ins + tuple(params.values()), (out, *stash.values()), ws,
                       ((out, ins[0]),) if ly.inplace_forward else ()),
            ForwardSlots(inputs=ins, outputs=(out,), stash=stash, params=params),
            cost=StepCost(ly.flops, origin=len(steps)),
            op=OpTraits(facts=ly.facts, caps=CAPS[ly.kind])))
    grad_of = {value["loss"]: add("loss.grad", 1, "gradient_map", "seed", "loss")}
    fed = {"x", "labels"}
    for node in range(len(every) - 1, -1, -1):
        ly = every[node]
        ins = tuple(value[v] for v in ly.inputs)
        g_in: list[GradInput | None] = []
        writes: list[int] = []
        for v in ly.inputs:
            if v in fed:
                g_in.append(None)
            elif value[v] not in grad_of:
                grad_of[value[v]] = add(f"{v}.grad", tensors[value[v]].shape[0] // UNIT,
                                        "gradient_map", "grad", ly.name, of=value[v])
                g_in.append(GradInput(grad_of[value[v]]))
                writes.append(grad_of[value[v]])
            else:
                part = add(f"{ly.name}.grad_in{ly.inputs.index(v)}",
                           tensors[value[v]].shape[0] // UNIT, "gradient_map", "grad_partial",
                           ly.name, of=grad_of[value[v]])
                g_in.append(GradInput(part, grad_of[value[v]]))
                writes += [part, grad_of[value[v]]]
        gp = {p: grad_t[f"{ly.name}.{p}"] for p in ly.params}
        writes += gp.values()
        g_out = grad_of[value[ly.name]]
        kept = ins if ly.keeps == "inputs" else (value[ly.name],) if ly.keeps == "output" else ()
        params = {p: param_t[f"{ly.name}.{p}"] for p in ly.params}
        reads = (g_out, *kept, *stash_of[ly.name].values(), *params.values())
        ws = add(f"{ly.name}.bwd_ws", ly.bwd_workspace, "workspace", "workspace", ly.name) \
            if ly.bwd_workspace else -1
        shares = ((g_in[0].written, g_out),) if ly.inplace_backward and g_in and g_in[0] \
            and g_in[0].add_into < 0 else ()
        steps.append(Step(
            len(steps), "backward", ly.name, ly.kind, node,
            StepAccess(tuple(dict.fromkeys(reads)), tuple(dict.fromkeys(writes)), ws, shares),
            ForwardSlots(inputs=ins, outputs=(value[ly.name],), stash=stash_of[ly.name],
                         params=params),
            BackwardSlots(grad_outputs=(g_out,), grad_inputs=tuple(g_in), grad_params=gp),
            cost=StepCost(2 * ly.flops, origin=len(steps)),
            op=OpTraits(facts=ly.facts, caps=CAPS[ly.kind])))
    return Program(tensors=tensors, steps=steps, inputs=[value["x"], value["labels"]],
                   loss=value["loss"], alignment=alignment)


def chain() -> Program:
    """conv -> relu -> pool -> linear -> loss; the conv has forward and backward workspaces,
    the max-pool an argmax stash, the ReLU is in place both ways."""
    return lower_layers([
        HandLayer("conv", "conv", ("x",), 4, params=("w",), fwd_workspace=2, bwd_workspace=3,
                  flops=8000),
        HandLayer("relu", "relu", ("conv",), 4, keeps="output", inplace_forward=True,
                  inplace_backward=True, flops=100),
        HandLayer("pool", "pool", ("relu",), 2, stash={"argmax": 2}, keeps="",
                  facts=MAX_POOL_2X2, flops=200),
        HandLayer("fc", "linear", ("pool",), 1, params=("w",), flops=4000),
    ])


def residual() -> Program:
    """conv1 -> relu1 -> conv2 -> add(relu1, conv2) -> relu2 -> fc -> loss: a fork at relu1,
    a join at add (in place, but relu1 is still read by conv2's backward)."""
    return lower_layers([
        HandLayer("conv1", "conv", ("x",), 4, params=("w",), flops=8000),
        HandLayer("relu1", "relu", ("conv1",), 4, keeps="output", inplace_forward=True,
                  inplace_backward=True, flops=100),
        HandLayer("conv2", "conv", ("relu1",), 4, params=("w",), flops=8000),
        HandLayer("add", "add", ("relu1", "conv2"), 4, keeps="", inplace_forward=True,
                  flops=100),
        HandLayer("relu2", "relu", ("add",), 4, keeps="output", inplace_forward=True,
                  inplace_backward=True, flops=100),
        HandLayer("fc", "linear", ("relu2",), 1, params=("w",), flops=4000),
    ])


def joint_recompute() -> Program:
    """conv -> pool -> relu -> add(relu, pool) with a two-unit input: recomputing the three
    first layers together costs less than the swap a greedy walk takes one move at a time."""
    return lower_layers([
        HandLayer("conv0", "conv", ("x",), 2, params=("w",), fwd_workspace=2, flops=8000),
        HandLayer("pool1", "pool", ("conv0",), 1, stash={"argmax": 1}, keeps="", flops=100,
                  facts=MAX_POOL_2X2),
        HandLayer("relu2", "relu", ("pool1",), 1, keeps="output", inplace_backward=True,
                  flops=4000),
        HandLayer("add3", "add", ("relu2", "pool1"), 1, keeps="", flops=1000),
    ], input_units=2)


def linear_chain(n: int, units: int = 2) -> Program:
    """``n`` linear layers in a row (every output is an articulation point)."""
    return lower_layers([HandLayer(f"l{i}", "linear", ("x",) if i == 0 else (f"l{i - 1}",),
                                   units, params=("w",)) for i in range(n)])


def ids(program: Program) -> dict[str, int]:
    """Tensor name -> id."""
    return {t.name: t.id for t in program.tensors}


def _name(program: Program, action) -> str:
    return f"{action.kind} {program.tensors[action.tensor].name}"


def render(plan: Plan) -> list[tuple[str, list[str], list[str]]]:
    """Per step: (label, actions before, actions after), actions as ``"op tensor-name"``;
    ``begin`` and ``end`` as pseudo-steps."""
    p = plan.program
    rows = [("begin", [], [_name(p, a) for a in plan.begin])]
    rows += [(st.label, [_name(p, a) for a in sp.before], [_name(p, a) for a in sp.after])
             for st, sp in zip(p.steps, plan.steps)]
    rows.append(("end", [_name(p, a) for a in plan.end], []))
    return rows
