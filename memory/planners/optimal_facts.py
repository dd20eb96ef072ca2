"""What the MILP of :mod:`.optimal_model` reads from a program, computed once before any
variable exists: block sizes in the model's memory unit, who produces and who reads each tensor,
the positions in time at which memory is constrained, and the blocks of the decision-free
``reuse,inplace`` plan."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..ir.liveness import Lifetime, lifetimes, root_of
from ..ir.names import Phase, Role
from ..ir.plan import AutoChoice
from ..ir.program import Program, Step, TensorSpec
from .auto import build

#: Longest run of consecutive dropped steps the model considers on deep programs (all of them
#: up to :data:`FULL_WINDOW_STEPS` forward steps).
MAX_RUN = 24
FULL_WINDOW_STEPS = 48


class Unsupported(ValueError):
    """The program has a shape the model does not describe (steps other than forward then
    backward): the greedy planner decides alone."""


def forward_producers(program: Program) -> dict[int, int]:
    """The forward step that writes each tensor, by tensor id."""
    return {t: s.index for s in program.steps if s.phase == Phase.FORWARD
            for t in s.access.writes}


def droppable_steps(program: Program) -> list[int]:
    """The forward steps a plan may drop (recompute in backward): those writing a value
    tensor, except the loss's."""
    return [s.index for s in program.steps if s.phase == Phase.FORWARD
            and program.loss not in s.access.writes
            and any(program.tensors[t].role == Role.VALUE for t in s.access.writes)]


@dataclass
class BlockSizes:
    """Tensor -> the size of its block, in bytes and in the model's memory units."""

    nbytes: dict[int, int]
    unit: float  # bytes per memory unit of the rows
    units: dict[int, float]


@dataclass
class TensorUses:
    """Which steps write and read the tensors."""

    producer: dict[int, int]  # tensor -> forward step writing it
    consumers: dict[int, list[int]]  # tensor -> forward steps reading it (not its producer)
    backward_readers: dict[int, list[int]]  # tensor -> backward steps reading it
    last_forward: dict[int, int]  # tensor -> last forward step touching it


@dataclass
class NodeSteps:
    """The forward and backward steps of each node."""

    forward_of: dict[int, int | None]  # backward step -> forward step of its node
    first_backward: dict[int, int]  # forward step -> first backward step of its node


@dataclass
class Positions:
    """The positions in time at which memory is constrained: ``("F" | "P" | "B", step
    index)``, each forward step, then per backward step the recomputation region before it
    (``"P"``, only before the first backward step of a forward node) and the step itself."""

    order: list[tuple[str, int]]
    of_step: dict[int, int]  # step -> its position
    region: dict[int, int]  # backward step -> position of the recomputation before it
    of_node: dict[int, list[int]]  # forward node -> positions of its backward


@dataclass
class Drops:
    """The forward steps a plan may drop and what dropping them touches."""

    steps: list[int]
    step_set: set[int]
    window: int  # the longest run of consecutive dropped steps, minus one
    outputs: dict[int, list[int]]  # droppable step -> its non-persistent outputs
    backward_reads: dict[int, set[int]]  # node -> droppable producers its backward reads
    input_producers: dict[int, set[int]]  # droppable step -> droppable producers of its inputs


@dataclass
class Blocks:
    """The blocks of the decision-free ``reuse,inplace`` plan."""

    life: dict[int, Lifetime]
    members: dict[int, list[int]]  # block root -> tensors sharing the block


@dataclass
class ProgramFacts:
    """The program as the model sees it (forward steps come first, ``nf`` of them)."""

    steps: list[Step]
    tensors: list[TensorSpec]
    nf: int
    sizes: BlockSizes
    uses: TensorUses
    nodes: NodeSteps
    positions: Positions
    drops: Drops
    blocks: Blocks


def _uses(steps: list[Step], tensors: list[TensorSpec], nf: int) -> TensorUses:
    """Producers, consumers, backward readers and last forward use of the non-persistent
    tensors."""
    producer = {t: s.index for s in steps[:nf] for t in s.access.writes}
    consumers: dict[int, list[int]] = {}
    for s in steps[:nf]:
        for t in set(s.access.reads):
            if not tensors[t].persistent and producer.get(t) != s.index:
                consumers.setdefault(t, []).append(s.index)
    breaders: dict[int, list[int]] = {}
    for b in steps[nf:]:
        for t in set(b.access.reads):
            if not tensors[t].persistent:
                breaders.setdefault(t, []).append(b.index)
    last_fwd: dict[int, int] = {}
    for s in steps[:nf]:
        a = s.access
        for t in (*a.reads, *a.writes, *((a.workspace,) if a.workspace >= 0 else ())):
            last_fwd[t] = s.index
    return TensorUses(producer, consumers, breaders, last_fwd)


def _positions(steps: list[Step], nf: int, nodes: NodeSteps) -> Positions:
    """The positions, each step's, each region's and each forward node's backward's."""
    node_f, bwd_of_f = nodes.forward_of, nodes.first_backward
    positions: list[tuple[str, int]] = []
    pos_of_step: dict[int, int] = {}
    region_pos: dict[int, int] = {}
    for s in steps[:nf]:
        pos_of_step[s.index] = len(positions)
        positions.append(("F", s.index))
    for b in steps[nf:]:
        f = node_f[b.index]
        if f is not None and bwd_of_f[f] == b.index:
            region_pos[b.index] = len(positions)
            positions.append(("P", b.index))
        pos_of_step[b.index] = len(positions)
        positions.append(("B", b.index))
    node_positions: dict[int, list[int]] = {}
    for q, (kind, s) in enumerate(positions):
        if kind != "F" and node_f[s] is not None:
            node_positions.setdefault(node_f[s], []).append(q)
    return Positions(positions, pos_of_step, region_pos, node_positions)


def _nodes(steps: list[Step], nf: int) -> NodeSteps:
    """Backward step -> its node's forward step, forward step -> its first backward step."""
    fwd_of_node = {s.node: s.index for s in steps[:nf]}
    node_f = {b.index: fwd_of_node.get(b.node) for b in steps[nf:]}
    bwd_of_f: dict[int, int] = {}
    for b in steps[nf:]:
        f = node_f[b.index]
        if f is not None:
            bwd_of_f.setdefault(f, b.index)
    return NodeSteps(node_f, bwd_of_f)


def _drops(program: Program, nf: int, allow_drop: bool, window: int, uses: TensorUses,
           nodes: NodeSteps) -> Drops:
    """The droppable steps (none unless ``allow_drop``), their outputs, the droppable
    producers each node's backward reads and those of each droppable step's forward
    inputs."""
    steps, tensors, producer = program.steps, program.tensors, uses.producer
    droppable = droppable_steps(program) if allow_drop else []
    dset = set(droppable)
    reads_of: dict[int, set[int]] = {}
    for b in steps[nf:]:
        if nodes.forward_of[b.index] is not None:
            reads_of.setdefault(nodes.forward_of[b.index], set()).update(
                producer[t] for t in b.access.reads if producer.get(t) in dset)
    inputs_of = {k: {producer[t] for t in steps[k].access.reads if producer.get(t) in dset}
                 for k in droppable}
    outputs = {k: [t for t in steps[k].access.writes if not tensors[t].persistent]
               for k in droppable}
    return Drops(droppable, dset, window, outputs, reads_of, inputs_of)


def _blocks(program: Program) -> Blocks:
    """The lifetimes and the blocks' members of the decision-free plan."""
    aliases = build(program, AutoChoice()).aliases
    life = lifetimes(program)
    members: dict[int, list[int]] = {}
    for t in life:
        members.setdefault(root_of(aliases, t), []).append(t)
    return Blocks(life, members)


def program_facts(program: Program, allow_drop: bool = True,
                  window: int | None = None) -> ProgramFacts:
    """The facts of ``program`` (``allow_drop=False``: no droppable step; ``window``: see
    :func:`.optimal_model.build_model`). Raises :class:`Unsupported` unless the steps are
    forward then backward."""
    steps, tensors = program.steps, program.tensors
    nf = sum(1 for s in steps if s.phase == Phase.FORWARD)
    if any(s.phase != Phase.FORWARD for s in steps[:nf]) or \
            any(s.phase != Phase.BACKWARD for s in steps[nf:]):
        raise Unsupported("steps other than forward then backward")
    size = {t.id: program.block_size(t.nbytes) for t in tensors}
    # memory in units of the largest block's power of two: coefficients <= 1 (bytes beside
    # binaries would leave HiGHS with a badly scaled matrix)
    mu = float(2 ** math.ceil(math.log2(max(size.values(), default=1) or 1)))
    nodes = _nodes(steps, nf)
    uses = _uses(steps, tensors, nf)
    if window is None:
        window = nf if nf <= FULL_WINDOW_STEPS else MAX_RUN
    return ProgramFacts(
        steps=steps, tensors=tensors, nf=nf,
        sizes=BlockSizes(size, mu, {t: b / mu for t, b in size.items()}), uses=uses,
        nodes=nodes, positions=_positions(steps, nf, nodes),
        drops=_drops(program, nf, allow_drop, window, uses, nodes), blocks=_blocks(program))
