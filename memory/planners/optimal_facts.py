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
class ProgramFacts:
    """The program as the model sees it. Positions are ``("F" | "P" | "B", step index)`` in
    time order: each forward step, then per backward step the recomputation region before it
    (``"P"``, only before the first backward step of a forward node) and the step itself."""

    steps: list[Step]
    tensors: list[TensorSpec]
    nf: int  # forward steps (they come first)
    size: dict[int, int]  # tensor -> bytes of its block
    mu: float  # bytes per memory unit of the rows
    fs: dict[int, float]  # tensor -> block size in memory units
    producer: dict[int, int]  # tensor -> forward step writing it
    droppable: list[int]
    dset: set[int]
    window: int  # the longest run of consecutive dropped steps, minus one
    node_f: dict[int, int | None]  # backward step -> forward step of its node
    bwd_of_f: dict[int, int]  # forward step -> first backward step of its node
    consumers: dict[int, list[int]]  # tensor -> forward steps reading it (not its producer)
    breaders: dict[int, list[int]]  # tensor -> backward steps reading it
    outs: dict[int, list[int]]  # droppable step -> its non-persistent outputs
    last_fwd: dict[int, int]  # tensor -> last forward step touching it
    positions: list[tuple[str, int]]
    pos_of_step: dict[int, int]
    region_pos: dict[int, int]  # backward step -> position of the recomputation before it
    node_positions: dict[int, list[int]]  # forward node -> positions of its backward
    reads_of: dict[int, set[int]]  # node -> droppable producers its backward reads
    inputs_of: dict[int, set[int]]  # droppable step -> droppable producers of its inputs
    life: dict[int, Lifetime]
    members: dict[int, list[int]]  # block root -> tensors sharing the block


def _readers(steps: list[Step], tensors: list[TensorSpec], nf: int,
             producer: dict[int, int]) -> tuple[dict, dict, dict]:
    """(consumers, backward readers, last forward use) of the non-persistent tensors."""
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
    return consumers, breaders, last_fwd


def _positions(steps: list[Step], nf: int, node_f: dict[int, int | None],
               bwd_of_f: dict[int, int]) -> tuple[list, dict, dict, dict]:
    """(positions, step -> position, backward step -> its region's position, forward node ->
    the positions of its backward)."""
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
    return positions, pos_of_step, region_pos, node_positions


def _nodes(steps: list[Step], nf: int) -> tuple[dict[int, int | None], dict[int, int]]:
    """(backward step -> its node's forward step, forward step -> its first backward step)."""
    fwd_of_node = {s.node: s.index for s in steps[:nf]}
    node_f = {b.index: fwd_of_node.get(b.node) for b in steps[nf:]}
    bwd_of_f: dict[int, int] = {}
    for b in steps[nf:]:
        f = node_f[b.index]
        if f is not None:
            bwd_of_f.setdefault(f, b.index)
    return node_f, bwd_of_f


def _droppable_reads(steps: list[Step], nf: int, node_f: dict[int, int | None],
                     producer: dict[int, int], droppable: list[int], dset: set[int]
                     ) -> tuple[dict[int, set[int]], dict[int, set[int]]]:
    """(node -> droppable producers its backward reads, droppable step -> droppable producers
    of its forward inputs)."""
    reads_of: dict[int, set[int]] = {}
    for b in steps[nf:]:
        if node_f[b.index] is not None:
            reads_of.setdefault(node_f[b.index], set()).update(
                producer[t] for t in b.access.reads if producer.get(t) in dset)
    inputs_of = {k: {producer[t] for t in steps[k].access.reads if producer.get(t) in dset}
                 for k in droppable}
    return reads_of, inputs_of


def _blocks(program: Program) -> tuple[dict[int, Lifetime], dict[int, list[int]]]:
    """(lifetimes, block root -> members) of the decision-free plan."""
    aliases = build(program, AutoChoice()).aliases
    life = lifetimes(program)
    members: dict[int, list[int]] = {}
    for t in life:
        members.setdefault(root_of(aliases, t), []).append(t)
    return life, members


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
    producer = {t: s.index for s in steps[:nf] for t in s.access.writes}
    droppable = droppable_steps(program) if allow_drop else []
    dset = set(droppable)
    node_f, bwd_of_f = _nodes(steps, nf)
    consumers, breaders, last_fwd = _readers(steps, tensors, nf, producer)
    positions, pos_of_step, region_pos, node_positions = _positions(steps, nf, node_f, bwd_of_f)
    reads_of, inputs_of = _droppable_reads(steps, nf, node_f, producer, droppable, dset)
    life, members = _blocks(program)
    return ProgramFacts(
        steps=steps, tensors=tensors, nf=nf, size=size, mu=mu,
        fs={t: b / mu for t, b in size.items()}, producer=producer, droppable=droppable,
        dset=dset,
        window=window if window is not None else (nf if nf <= FULL_WINDOW_STEPS else MAX_RUN),
        node_f=node_f, bwd_of_f=bwd_of_f, consumers=consumers, breaders=breaders,
        outs={k: [t for t in steps[k].access.writes if not tensors[t].persistent]
              for k in droppable},
        last_fwd=last_fwd, positions=positions, pos_of_step=pos_of_step, region_pos=region_pos,
        node_positions=node_positions, reads_of=reads_of, inputs_of=inputs_of, life=life,
        members=members)
