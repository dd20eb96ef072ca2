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

from .capabilities import OpCaps
from .names import Category, Phase, Role
from .payloads import CodecStep, EncodedInput, OpFacts, OpOptions, RewriteSummary
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


@dataclass(frozen=True)
class GradInput:
    """Where a backward step writes one input's gradient: ``written``, then added into
    ``add_into`` when that gradient already has a writer (fan-out; -1 otherwise)."""

    written: int
    add_into: int = -1


#: The fields of a :class:`Step` that hold tensor ids.
_TENSOR_FIELDS = frozenset({"reads", "writes", "workspace", "shares", "inputs", "outputs",
                            "stash", "params", "grad_outputs", "grad_inputs", "grad_params",
                            "param_partials"})


@dataclass(frozen=True)
class Step:
    """One step of the program: a layer's forward or backward, a recomputation, an encode or
    decode, or an accumulation — the one list both memory passes and the executor walk.

    ``reads`` / ``writes`` / ``workspace`` are what memory sees. The named slots below them are
    the same tensors as the layer receives them (llm.c's named buffers): inputs and outputs in
    the layer's order, the stash by name, parameters and their gradients by the layer's local
    names. A pass that substitutes tensors (recomputation's clones, decoded stashes) does it
    through :meth:`remapped`, in every slot at once; nothing maps back.
    """

    index: int
    phase: Phase  # a plain string is accepted and made a member
    layer: str
    kind: str  # op tag: conv, relu, pool, ... ; "encode" ; "decode"
    node: int  # index of the layer node in the network (-1 for none)
    reads: tuple[int, ...]
    writes: tuple[int, ...]
    workspace: int = -1  # tensor id of this step's workspace, or -1
    flops: int = 0
    #: (written, read) tensor pairs the op allows to share one block: an in-place forward
    #: (output over input) or an in-place backward (input gradient over output gradient).
    shares: tuple[tuple[int, int], ...] = ()
    #: Plain facts a pass needs about the op (a max-pool's window, attention's shape, a fused
    #: RNN's time units), from its layer.
    facts: OpFacts = OpFacts()
    #: An encode / decode step's codec and the tensor it encodes or decodes (else None).
    codec: CodecStep | None = None
    #: A backward step starting from an encoded stash: which encoding, in which tensor.
    from_encoded: EncodedInput | None = None
    # ---- the layer's named slots (tensor ids)
    inputs: tuple[int, ...] = ()
    outputs: tuple[int, ...] = ()
    stash: dict[str, int] = field(default_factory=dict)
    params: dict[str, int] = field(default_factory=dict)  # local name -> parameter tensor
    grad_outputs: tuple[int, ...] = ()
    grad_inputs: tuple[GradInput | None, ...] = ()
    grad_params: dict[str, int] = field(default_factory=dict)  # local name -> .grad tensor
    #: Shared parameters whose gradient this step writes into a partial the executor adds.
    param_partials: dict[str, int] = field(default_factory=dict)
    #: Parameters whose gradient the layer adds straight into ``.grad`` (``ctx.accumulate``).
    accumulate: frozenset[str] = frozenset()
    #: Positions in ``inputs`` / ``outputs`` a backward step reads (its layer's
    #: ``retain_inputs`` / ``retain_outputs``).
    retained_inputs: tuple[int, ...] = ()
    retained_outputs: tuple[int, ...] = ()
    in_shapes: tuple[tuple[int, ...], ...] = ()
    #: What memory passes may do with the op (declared by its layer).
    caps: OpCaps = OpCaps()
    #: Per-op options the plan set (a BPTT schedule, ...), handed to the layer at run time
    #: (a plain ``{name: value}`` mapping is accepted and made an :class:`OpOptions`).
    options: OpOptions = OpOptions()
    #: The user's choice for the feature maps this op's forward writes, from a block the
    #: network marks (``"recompute"``, ``"swap"`` or ``"keep"``; ``""``: the planner's to make).
    #: Every planner honours it (:mod:`.block_choices`).
    forced: str = ""
    #: Index of the lowered step this one runs (itself for lowered steps; a recomputation's
    #: forward step; -1 for steps a pass added): measured step times are keyed by it.
    origin: int = -1
    #: Of ``flops``, the forward FLOPs a backward step runs again inside the op (a fused RNN's
    #: BPTT schedule keeping fewer states): recomputation the cost model counts as such.
    recompute_flops: int = 0
    #: What the op's matrix products run in on tensor cores (``"bfloat16"``, ``"float16"``,
    #: ``"tf32"``; ``""``: float32 on CUDA cores), set by lowering from the precision
    #: (:mod:`.precision`); the cost model prices the step's FLOPs at that rate.
    matmul_dtype: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "phase", Phase.of(self.phase))
        if type(self.options) is not OpOptions:
            object.__setattr__(self, "options", OpOptions.of(self.options))
        if type(self.facts) is not OpFacts:
            object.__setattr__(self, "facts", OpFacts.of(self.facts))

    def slot_reads(self) -> tuple[int, ...]:
        """What the step reads, from its named slots: a forward step its inputs, then its
        parameters; a backward step (each tensor once) its output gradients, the inputs and
        outputs it retains, its stash and its parameters. Lowering sets ``reads`` to this."""
        if self.phase is Phase.BACKWARD:
            return tuple(dict.fromkeys((
                *self.grad_outputs, *(self.inputs[j] for j in self.retained_inputs),
                *(self.outputs[j] for j in self.retained_outputs), *self.stash.values(),
                *self.params.values())))
        return (*self.inputs, *self.params.values())

    def slot_writes(self) -> tuple[int, ...]:
        """What the step writes, from its named slots: a forward step its outputs, then its
        stash; a backward step (each tensor once) per input its gradient (the partial, then
        the gradient it is added into), then its parameters' gradients and partials. Lowering
        sets ``writes`` to this."""
        if self.phase is Phase.BACKWARD:
            grads = [t for g in self.grad_inputs if g is not None
                     for t in ((g.written,) if g.add_into < 0 else (g.written, g.add_into))]
            return tuple(dict.fromkeys((*grads, *self.grad_params.values(),
                                        *self.param_partials.values())))
        return (*self.outputs, *self.stash.values())

    @property
    def attrs(self) -> dict:
        """The former plain-dict view of :attr:`facts`, :attr:`codec` and
        :attr:`from_encoded` (a new dict; for reading only)."""
        out: dict = {}
        f = self.facts
        window = f.pool if self.codec is None else self.codec.window
        if self.codec is not None:
            out.update(codec=self.codec.codec, source=self.codec.source)
        if window is not None:
            out.update(window=window.size, kernel=window.kernel, stride=window.stride,
                       padding=window.padding)
        if f.attention is not None:
            out["attention"] = dict(vars(f.attention))
        if f.time_units is not None:
            out["time_units"] = f.time_units
        if self.from_encoded is not None:
            out.update(backward_from=self.from_encoded.encoding,
                       encoded=self.from_encoded.tensor)
        return out

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
            new["reads"] = tuple([m(t, t) for t in self.reads])
            new["writes"] = tuple([m(t, t) for t in self.writes])
            if self.workspace >= 0:
                new["workspace"] = m(self.workspace, self.workspace)
            if self.shares:
                new["shares"] = tuple([(m(a, a), m(b, b)) for a, b in self.shares])
            new["inputs"] = tuple([m(t, t) for t in self.inputs])
            new["outputs"] = tuple([m(t, t) for t in self.outputs])
            for name in ("stash", "params", "grad_params", "param_partials"):
                d = own[name]
                if d:
                    new[name] = {k: m(t, t) for k, t in d.items()}
            if self.grad_outputs:
                new["grad_outputs"] = tuple([m(t, t) for t in self.grad_outputs])
            if self.grad_inputs:
                new["grad_inputs"] = tuple([None if g is None else GradInput(
                    m(g.written, g.written), m(g.add_into, g.add_into) if g.add_into >= 0
                    else -1) for g in self.grad_inputs])
            new.pop("_tensor_ids", None)
        new.update(changes)
        if not _TENSOR_FIELDS.isdisjoint(changes):
            new.pop("_tensor_ids", None)
        return step

    @cached_property
    def _tensor_ids(self) -> frozenset[int]:
        """Every tensor id in the step, in memory's view and in the named slots."""
        ids = {*self.reads, *self.writes, self.workspace, *self.inputs, *self.outputs,
               *self.stash.values(), *self.params.values(), *self.grad_outputs,
               *self.grad_params.values(), *self.param_partials.values()}
        for a, b in self.shares:
            ids.update((a, b))
        for g in self.grad_inputs:
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

    @property
    def meta(self) -> dict:
        """The former plain-dict view of :attr:`rewrites` (a new dict; for reading only)."""
        return self.rewrites.as_dict()

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
        ids = set(step.reads) | set(step.writes)
        if step.workspace >= 0:
            ids.add(step.workspace)
        ids -= {w for w, r in step.shares if r in ids
                and self.tensors[w].nbytes == self.tensors[r].nbytes}
        return sum(self.block_size(self.tensors[i].nbytes) for i in ids
                   if not self.tensors[i].persistent)

    def lower_bound_bytes(self) -> int:
        """Persistent state plus the largest single step's own inputs, outputs and workspace:
        no strategy can go below this without splitting the batch."""
        biggest = max((self.step_footprint(s) for s in self.steps), default=0)
        return self.persistent_bytes() + biggest
