"""The program as memory sees it: plain data, no layers, no arrays.

The engine lowers a bound network into a :class:`Program`: every tensor of one training
iteration (feature maps, gradient maps, stashes, workspaces, and the persistent parameters,
gradients and optimizer state) with its size and category, and an ordered list of steps, each
naming the tensors it reads and writes, its op tag and its cost. Memory policies turn a
program into a :class:`~minidl.memory.ir.plan.Plan` without knowing anything else about it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from .names import Category, Phase, Role
from .payloads import RewriteSummary
from .step_parts import BackwardSlots, ForwardSlots, GradInput, OpTraits, StepAccess, StepCost
from .units import ALLOCATION_UNIT, aligned


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of the program.

    ``role`` says what it is for the engine (:class:`~.names.Role`: a value, its gradient, a
    stash, a workspace, a parameter, ...), ``category`` what its block holds for the pool's
    statistics (:class:`~.names.Category`); plain strings are accepted and made members.
    ``persistent`` tensors live across iterations.
    """

    id: int
    name: str
    shape: tuple[int, ...]
    dtype: str
    category: Category
    role: Role
    layer: str = ""
    of: int = -1  # for grad / grad_partial: the value (or grad) tensor it belongs to
    persistent: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "category", Category.of(self.category))
        object.__setattr__(self, "role", Role.of(self.role))

    @cached_property
    def nbytes(self) -> int:
        return int(math.prod(self.shape)) * np.dtype(self.dtype).itemsize

    def clone(self, id: int, name: str) -> TensorSpec:
        """This tensor again as tensor ``id`` named ``name``, ``of`` this one (a recomputed or
        decoded copy: passes make thousands)."""
        spec = object.__new__(TensorSpec)
        spec.__dict__.update(self.__dict__)
        spec.__dict__.update(id=id, name=name, of=self.id)
        return spec


#: The fields of a :class:`Step` that hold tensor ids.
_TENSOR_FIELDS = frozenset({"access", "forward", "backward"})


@dataclass(frozen=True)
class Step:
    """One step of the program: a layer's forward or backward, a recomputation, an encode or
    decode, or an accumulation — the one list both memory passes and the executor walk.

    ``access`` is what memory sees (:class:`~.step_parts.StepAccess`). ``forward`` and
    ``backward`` are the same tensors as the layer receives them (llm.c's named buffers,
    :class:`~.step_parts.ForwardSlots`, :class:`~.step_parts.BackwardSlots`); ``cost`` what the
    cost model prices it by, ``op`` what its layer declares and the plan chose
    (:class:`~.step_parts.StepCost`, :class:`~.step_parts.OpTraits`). A pass that substitutes
    tensors (recomputation's clones, decoded stashes) does it through :meth:`remapped`, in
    every slot at once; nothing maps back.
    """

    index: int
    phase: Phase  # a plain string is accepted and made a member
    layer: str
    kind: str  # op tag: conv, relu, pool, ... ; "encode" ; "decode"
    node: int  # index of the layer node in the network (-1 for none)
    access: StepAccess = StepAccess()
    forward: ForwardSlots = field(default_factory=ForwardSlots)
    backward: BackwardSlots = field(default_factory=BackwardSlots)
    cost: StepCost = StepCost()
    op: OpTraits = OpTraits()

    def __post_init__(self) -> None:
        object.__setattr__(self, "phase", Phase.of(self.phase))

    def slot_reads(self) -> tuple[int, ...]:
        """What the step reads, from its named slots: a forward step its inputs, then its
        parameters; a backward step (each tensor once) its output gradients, the inputs and
        outputs it retains, its stash and its parameters. Lowering sets ``access.reads`` to
        this."""
        fw = self.forward
        if self.phase is Phase.BACKWARD:
            bw = self.backward
            return tuple(dict.fromkeys((
                *bw.grad_outputs, *(fw.inputs[j] for j in bw.retained_inputs),
                *(fw.outputs[j] for j in bw.retained_outputs), *fw.stash.values(),
                *fw.params.values())))
        return (*fw.inputs, *fw.params.values())

    def slot_writes(self) -> tuple[int, ...]:
        """What the step writes, from its named slots: a forward step its outputs, then its
        stash; a backward step (each tensor once) per input its gradient (the partial, then
        the gradient it is added into), then its parameters' gradients and partials. Lowering
        sets ``access.writes`` to this."""
        if self.phase is Phase.BACKWARD:
            bw = self.backward
            grads = [t for g in bw.grad_inputs if g is not None
                     for t in ((g.written,) if g.add_into < 0 else (g.written, g.add_into))]
            return tuple(dict.fromkeys((*grads, *bw.grad_params.values(),
                                        *bw.param_partials.values())))
        return (*self.forward.outputs, *self.forward.stash.values())

    @property
    def label(self) -> str:
        return f"{self.layer} ({self.phase})"

    def remapped(self, mapping: dict[int, int], **changes) -> Step:
        """This step with every tensor id substituted through ``mapping`` (ids not in it stay),
        in memory's view and in the named slots alike; ``changes`` replace other fields."""
        if not mapping and not changes:
            return self
        own = self.__dict__
        for k in changes:
            if k not in own:
                raise TypeError(f"Step has no field {k!r}")
        # (a copy with the fields set, without dataclasses.replace's re-validation: the
        # planners rewrite hundreds of thousands of steps)
        step = object.__new__(Step)
        new = step.__dict__
        new.update(own)
        if mapping and not mapping.keys().isdisjoint(self._tensor_ids):
            m = mapping.get
            a, fw, bw = self.access, self.forward, self.backward
            new["access"] = StepAccess(
                tuple([m(t, t) for t in a.reads]), tuple([m(t, t) for t in a.writes]),
                m(a.workspace, a.workspace) if a.workspace >= 0 else a.workspace,
                tuple([(m(x, x), m(y, y)) for x, y in a.shares]) if a.shares else a.shares)
            new["forward"] = ForwardSlots(
                tuple([m(t, t) for t in fw.inputs]), tuple([m(t, t) for t in fw.outputs]),
                {k: m(t, t) for k, t in fw.stash.items()} if fw.stash else fw.stash,
                {k: m(t, t) for k, t in fw.params.items()} if fw.params else fw.params,
                fw.in_shapes, fw.param_casts)
            new["backward"] = BackwardSlots(
                tuple([m(t, t) for t in bw.grad_outputs]) if bw.grad_outputs
                else bw.grad_outputs,
                tuple([None if g is None else GradInput(
                    m(g.written, g.written), m(g.add_into, g.add_into) if g.add_into >= 0
                    else -1) for g in bw.grad_inputs]) if bw.grad_inputs else bw.grad_inputs,
                {k: m(t, t) for k, t in bw.grad_params.items()} if bw.grad_params
                else bw.grad_params,
                {k: m(t, t) for k, t in bw.param_partials.items()} if bw.param_partials
                else bw.param_partials,
                bw.accumulate, bw.retained_inputs, bw.retained_outputs)
            new.pop("_tensor_ids", None)
        new.update(changes)
        if not _TENSOR_FIELDS.isdisjoint(changes):
            new.pop("_tensor_ids", None)
        return step

    @cached_property
    def _tensor_ids(self) -> frozenset[int]:
        """Every tensor id in the step, in memory's view and in the named slots."""
        a, fw, bw = self.access, self.forward, self.backward
        ids = {*a.reads, *a.writes, a.workspace, *fw.inputs, *fw.outputs,
               *fw.stash.values(), *fw.params.values(), *bw.grad_outputs,
               *bw.grad_params.values(), *bw.param_partials.values()}
        for x, y in a.shares:
            ids.update((x, y))
        for g in bw.grad_inputs:
            if g is not None:
                ids.update((g.written, g.add_into))
        return frozenset(ids)


@dataclass
class Program:
    """All tensors and steps of one training (or inference) iteration."""

    tensors: list[TensorSpec]
    steps: list[Step]
    inputs: list[int]  # fed tensors (data, labels)
    loss: int = -1  # the loss value tensor, -1 for inference programs
    training: bool = True
    #: What the rewriting passes (recomputation, compression) did to this program.
    rewrites: RewriteSummary = RewriteSummary()
    #: The allocation unit of the pool the program is planned for: every size a pass rounds
    #: (block intervals, peaks, bounds) is rounded to it (see :meth:`block_size`).
    alignment: int = ALLOCATION_UNIT

    def block_size(self, nbytes: int) -> int:
        """Bytes a block of ``nbytes`` occupies in this program's pool."""
        return aligned(nbytes, self.alignment)

    @cached_property
    def block_sizes(self) -> list[int]:
        """:meth:`block_size` of every tensor, by id (programs are never changed once
        made)."""
        return [aligned(t.nbytes, self.alignment) for t in self.tensors]

    def tensor(self, tid: int) -> TensorSpec:
        return self.tensors[tid]

    @property
    def persistent(self) -> list[TensorSpec]:
        return [t for t in self.tensors if t.persistent]

    def persistent_bytes(self) -> int:
        return sum(self.block_size(t.nbytes) for t in self.persistent)

    def step_footprint(self, step: Step) -> int:
        """Aligned bytes of the non-persistent tensors one step touches, workspace included;
        an output the op may write over an operand (``shares``) is counted once."""
        a = step.access
        ids = set(a.reads) | set(a.writes)
        if a.workspace >= 0:
            ids.add(a.workspace)
        ids -= {w for w, r in a.shares if r in ids
                and self.tensors[w].nbytes == self.tensors[r].nbytes}
        return sum(self.block_size(self.tensors[i].nbytes) for i in ids
                   if not self.tensors[i].persistent)

    def lower_bound_bytes(self) -> int:
        """Persistent state plus the largest single step's own inputs, outputs and workspace:
        no strategy can go below this without splitting the batch."""
        biggest = max((self.step_footprint(s) for s in self.steps), default=0)
        return self.persistent_bytes() + biggest
