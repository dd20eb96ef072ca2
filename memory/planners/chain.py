"""A training program seen as a chain of stages, and programs for schedules over that chain.

The forward graph is cut at its articulation values (:func:`.recompute.articulation_values`:
a value that alone carries everything later forward steps read, e.g. a ResNet block's output):
stage ``k`` is the forward steps between two cuts and the backward steps of the same layers.
What a stage keeps for its backward, what it holds while it runs and what it costs are the
figures a chain planner (:mod:`.rotor`) needs.

A *schedule* is the order in which stages run forward (any number of times) and backward
(once each, in reverse order): Rotor's sequences (Beaumont et al. 2019), Chen et al.'s and
Griewank's as special cases. :func:`schedule_program` writes it as a program: a stage's first
forward run is its original forward steps; every later run is a recomputation whose steps write
*clones* of the stage's tensors (as :mod:`.recompute` does), and every step reads the latest
version of each value it needs. What is kept and what is dropped then follows from liveness
alone: a version lives until its last reader.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

from ..ir.config import MemoryConfig
from ..ir.liveness import root_of
from ..ir.names import Phase, Role
from ..ir.payloads import RecomputeSummary
from ..ir.program import Program, Step
from ..passes.base_plan import base_plan
from ..passes.recompute import articulation_values

__all__ = ["Chain", "LeanBackward", "Stage", "StageBytes", "StageSeconds", "chain_of",
           "schedule_program"]


@dataclass(frozen=True)
class StageBytes:
    """A stage's memory figures, in bytes of blocks."""

    #: The stage's input (the previous cut's value; the fed input for stage 0).
    input: int = 0
    #: What the stage's backward reads that its forward writes (kept if run all at once).
    kept: int = 0
    #: Most the forward holds beyond its input and what it keeps (workspaces, values freed
    #: within the stage).
    forward_extra: int = 0
    #: Most the backward holds beyond what the stage kept and the gradients of its input and
    #: output (workspaces, gradient maps within the stage).
    backward_extra: int = 0
    #: What the stage keeps at the least (its stashes and feature maps at their encoded sizes
    #: where a lossless encoding applies), for lower bounds.
    kept_least: int = 0


@dataclass(frozen=True)
class StageSeconds:
    """A stage's forward and backward compute times, in seconds."""

    forward: float = 0.0
    backward: float = 0.0


@dataclass(frozen=True)
class LeanBackward:
    """A stage's memory-centric backward (``("m", k)``: each backward step recomputes from the
    stage's input what it reads of the stage's forward, then frees it)."""

    #: The most bytes of recomputed values and gradients one backward step holds.
    extra: int = 0
    #: What a backward step must hold at the least (what it reads of the stage and writes),
    #: for lower bounds.
    least: int = 0
    #: The seconds recomputed.
    recompute_s: float = 0.0


@dataclass(frozen=True)
class Stage:
    """One stage: its forward and backward steps (indices into the program), and its figures
    in bytes and seconds."""

    forward: tuple[int, ...]
    backward: tuple[int, ...]
    sizes: StageBytes = StageBytes()
    seconds: StageSeconds = StageSeconds()
    lean: LeanBackward = LeanBackward()
    #: Whether the stage's backward reads its input (else no plan needs to keep it).
    input_read_back: bool = True


@dataclass(frozen=True)
class Chain:
    """The stages of a program in forward order (the last holds the loss)."""

    program: Program
    stages: tuple[Stage, ...]
    #: Bytes of the gradient of each stage's input (as its input: index k for stage k).
    grad_bytes: tuple[int, ...] = field(default=())

    def __len__(self) -> int:
        return len(self.stages)


def _block(program: Program, t: int) -> int:
    return program.block_size(program.tensors[t].nbytes)


def chain_of(program: Program, costs: list[float],
             least_sizes: dict[int, int] | None = None) -> Chain | None:
    """The chain of ``program`` (a training program of forward and backward steps only), with
    ``costs`` seconds per step; ``None`` when it does not cut into at least two stages or its
    backward steps do not run stage by stage in reverse. ``least_sizes``: the bytes some
    tensors can be kept in at the least (lossless encodings), for the stages'
    ``sizes.kept_least``."""
    if not program.training or any(st.phase not in (Phase.FORWARD, Phase.BACKWARD)
                                   for st in program.steps):
        return None
    forward = [st for st in program.steps if st.phase == Phase.FORWARD]
    # sizes count blocks, not tensors: what the plain plan shares (an in-place output, an
    # input gradient written over the output gradient) is one block
    aliases = base_plan(program, MemoryConfig.parse("reuse,inplace")).aliases
    cuts = _cuts(program, aliases)
    producer = {t: st.index for st in forward for t in st.access.writes}
    stage_of = _stage_of(forward, sorted({producer[t] for t in cuts if t in producer}))
    count = max(stage_of.values(), default=0) + 1
    split = _steps_by_stage(program, forward, stage_of, count)
    if split is None:
        return None
    fwd_steps, bwd_steps = split
    if count < 2 or any(not f for f in fwd_steps):
        return None
    cut_value = {stage_of[producer[t]] + 1: t for t in cuts if t in producer}
    sizes = _StageSizes(program, aliases, costs, least_sizes or {})
    stages, grads = [], []
    for k in range(count):
        stage, grad = sizes.stage(fwd_steps[k], bwd_steps[k], cut_value.get(k),
                                  cut_value.get(k + 1))
        stages.append(stage)
        grads.append(grad)
    return Chain(program, tuple(stages), tuple(grads))


def _cuts(program: Program, aliases: dict[int, int]) -> list[int]:
    """The values the chain is cut at: the articulation values, where one the next shares (an
    in-place ReLU over a block's sum) counts once, as the later."""
    cuts = articulation_values(program)
    return [t for t, nxt in zip(cuts, [*cuts[1:], None])
            if nxt is None or root_of(aliases, t) != root_of(aliases, nxt)]


def _stage_of(forward: list[Step], cut_at: list[int]) -> dict[int, int]:
    """Forward step index -> stage: a stage ends with the step making a cut (``cut_at``,
    ascending)."""
    stage_of: dict[int, int] = {}
    k = 0
    for st in forward:
        stage_of[st.index] = k
        if cut_at and st.index == cut_at[0]:
            cut_at.pop(0)
            k += 1
    return stage_of


def _steps_by_stage(program: Program, forward: list[Step], stage_of: dict[int, int],
                    count: int) -> tuple[list[list[int]], list[list[int]]] | None:
    """Each stage's forward and backward steps; ``None`` when a backward step has no forward
    step or runs after an earlier stage's."""
    fwd_of_node = {st.node: st.index for st in forward}
    fwd_steps: list[list[int]] = [[] for _ in range(count)]
    bwd_steps: list[list[int]] = [[] for _ in range(count)]
    for st in forward:
        fwd_steps[stage_of[st.index]].append(st.index)
    last = count
    for st in program.steps:
        if st.phase != Phase.BACKWARD:
            continue
        f = fwd_of_node.get(st.node)
        if f is None:
            return None
        s = stage_of[f]
        if s > last:
            return None  # a backward step after an earlier stage's: not a chain
        last = s
        bwd_steps[s].append(st.index)
    return fwd_steps, bwd_steps


class _StageSizes:
    """A stage's figures in blocks (aliases sharing one block count once) and seconds."""

    def __init__(self, program: Program, aliases: dict[int, int], costs: list[float],
                 least_sizes: dict[int, int]) -> None:
        self.program = program
        self.aliases = aliases
        self.costs = costs
        self.grad_of = {t.of: t.id for t in program.tensors if t.role == Role.GRAD}
        self.least_root: dict[int, int] = {}
        for t, nbytes in least_sizes.items():
            r = root_of(aliases, t)
            self.least_root[r] = min(self.least_root.get(r, nbytes), nbytes)

    def blocks(self, ts: Iterable[int], but: Iterable[int] = ()) -> int:
        """Bytes of the blocks of the non-persistent ``ts``, but those of ``but``."""
        aliases, tensors = self.aliases, self.program.tensors
        skip = {root_of(aliases, t) for t in but}
        roots = {root_of(aliases, t) for t in ts if not tensors[t].persistent} - skip
        return sum(_block(self.program, r) for r in roots)

    def _made(self, i: int) -> tuple[int, ...]:
        """What step ``i`` writes, with its workspace."""
        a = self.program.steps[i].access
        return (*a.writes, a.workspace) if a.workspace >= 0 else a.writes

    def stage(self, fwd: list[int], bwd: list[int], inp: int | None,
              out: int | None) -> tuple[Stage, int]:
        """The stage of forward steps ``fwd`` and backward steps ``bwd`` between the cut
        values ``inp`` (None: the fed input) and ``out`` (None: the last stage), and the bytes
        of its input's gradient."""
        program, aliases = self.program, self.aliases
        tensors, steps = program.tensors, program.steps
        written = {t for i in fwd for t in steps[i].access.writes}
        read_back = {t for i in bwd for t in steps[i].access.reads}
        kept = {t for t in written & read_back if not tensors[t].persistent}
        ends = [t for t in (inp, out) if t is not None]
        in_bytes = _block(program, inp) if inp is not None else sum(
            _block(program, t) for t in program.inputs)
        # (the fed input has no gradient; a cut value's is its size)
        grad = sum(_block(program, self.grad_of[t]) for t in program.inputs
                   if t in self.grad_of) if inp is None else in_bytes
        flows = [self.grad_of[t] for t in ends if t in self.grad_of]  # gradients crossing
        skip = {root_of(aliases, t) for t in ends}
        kept_roots = {root_of(aliases, t) for t in kept} - skip
        kept_least = sum(min(_block(program, r), self.least_root.get(r, _block(program, r)))
                         for r in kept_roots)
        reads_input = inp is None or root_of(aliases, inp) in {root_of(aliases, t)
                                                                 for t in read_back}
        fwd_extra = max((self.blocks(self._made(i), but=[*kept, *ends]) for i in fwd),
                        default=0)
        bwd_extra = max((self.blocks(self._made(i), but=flows) for i in bwd), default=0)
        costs = self.costs
        sizes = StageBytes(input=in_bytes, kept=self.blocks(kept, but=ends),
                           forward_extra=fwd_extra, backward_extra=bwd_extra,
                           kept_least=kept_least)
        seconds = StageSeconds(forward=sum(costs[i] for i in fwd),
                               backward=sum(costs[i] for i in bwd))
        lean = self._lean(fwd, bwd, written, ends, flows)
        return Stage(tuple(fwd), tuple(bwd), sizes, seconds, lean, reads_input), grad

    def _lean(self, fwd: list[int], bwd: list[int], written: set[int], ends: list[int],
              flows: list[int]) -> LeanBackward:
        """The memory-centric backward's figures: the most bytes a backward step holds, the
        least it must, and the seconds recomputed."""
        program = self.program
        lean_extra, lean_least, lean_s = 0, 0, 0.0
        for i in bwd:
            st = program.steps[i]
            need = _closure(program, fwd, st.access.reads)
            # held at once: what the step reads of the stage, plus the largest value made on
            # the way to it (the rest dies as the recomputation goes); and what it writes
            read = self.blocks(set(st.access.reads) & written, but=ends)
            passing = max((self.blocks([t], but=[*st.access.reads, *ends]) for j in need
                           for t in program.steps[j].access.writes), default=0)
            own = self.blocks(self._made(i), but=flows)
            lean_extra = max(lean_extra, read + passing + own)
            lean_least = max(lean_least, read + own)
            lean_s += sum(self.costs[j] for j in need)
        return LeanBackward(extra=lean_extra, least=lean_least, recompute_s=lean_s)


def _closure(program: Program, forward: Sequence[int], reads: Sequence[int]) -> list[int]:
    """The forward steps among ``forward`` (one stage's) that must run again to produce what
    ``reads`` needs of the stage, with what those read in turn, in forward order."""
    producer = {t: i for i in forward for t in program.steps[i].access.writes}
    todo, seen = [producer[t] for t in reads if t in producer], set()
    while todo:
        i = todo.pop()
        if i in seen:
            continue
        seen.add(i)
        todo += [producer[t] for t in program.steps[i].access.reads if t in producer]
    return sorted(seen)


def schedule_program(chain: Chain, ops: list[tuple[str, int]]) -> Program:
    """The program running ``ops`` in order: ``("f", k)`` runs stage ``k`` forward (its
    original steps the first time, a recomputation writing clones afterwards), ``("b", k)``
    runs its backward steps reading the latest version of every value, ``("m", k)`` runs them
    memory-centric (each recomputes from the stage's input what it reads of the stage, then
    frees it). Every stage must run forward before its backward, and backward once each,
    last stage first (module docstring)."""
    writer = _ScheduleWriter(chain)
    for kind, k in ops:
        writer.check(kind, k)
        if kind == "b":
            writer.backward(k)
        elif kind == "m":
            writer.lean_backward(k)
        else:
            writer.forward(k)
    return writer.program()


class _ScheduleWriter:
    """:func:`schedule_program`'s state: the steps and clones written so far, the latest
    version of each value, how often each stage ran forward and which ran backward."""

    def __init__(self, chain: Chain) -> None:
        self.chain = chain
        self.source = chain.program
        self.tensors = list(self.source.tensors)
        self.steps: list[Step] = []
        self.version: dict[int, int] = {}
        self.runs = [0] * len(chain)
        self.done = [False] * len(chain)
        self.recomputed_flops = 0
        self.recomputed = 0

    def refuse(self, why: str) -> None:
        raise ValueError(f"not a schedule of the chain's {len(self.chain)} stages: {why}")

    def check(self, kind: str, k: int) -> None:
        """Refuse an operation the schedule may not run now; note a stage's backward."""
        runs, done = self.runs, self.done
        if kind not in ("f", "b", "m") or not 0 <= k < len(self.chain):
            self.refuse(f"unknown operation {(kind, k)!r} (valid: 'f', 'b' or 'm' of a stage)")
        if kind != "f":
            if runs[k] == 0:
                self.refuse(f"stage {k}'s backward before its forward")
            if done[k]:
                self.refuse(f"stage {k}'s backward twice")
            if k + 1 < len(self.chain) and not done[k + 1]:
                self.refuse(f"stage {k}'s backward before stage {k + 1}'s")
            done[k] = True
        elif runs[k] == 0 and k > 0 and runs[k - 1] == 0:
            self.refuse(f"stage {k} runs forward before stage {k - 1}")

    def _replay(self, i: int, versions: dict[int, int]) -> None:
        """Step ``i`` as it is, reading the ``versions`` of what it reads."""
        st = self.source.steps[i]
        self.steps.append(st.remapped({t: versions[t] for t in st.access.reads if t in versions},
                                      index=len(self.steps)))

    def _recompute(self, i: int, remap: dict[int, int], tag: str) -> None:
        """Forward step ``i`` again, writing clones (recorded in ``remap``)."""
        st = self.source.steps[i]
        tensors = self.tensors
        local = {t: remap[t] for t in st.access.reads if t in remap}
        for t in (*st.access.writes, *((st.access.workspace,) if st.access.workspace >= 0 else ())):
            spec = tensors[t]
            nid = len(tensors)
            tensors.append(spec.clone(nid, f"{spec.name}@{tag}"))
            local[t] = nid
            if t in st.access.writes:
                remap[t] = nid
        self.steps.append(st.remapped(local, index=len(self.steps), phase="recompute"))
        self.recomputed_flops += st.cost.flops
        self.recomputed += 1

    def forward(self, k: int) -> None:
        """Stage ``k`` forward: its steps the first time, a recomputation afterwards."""
        self.runs[k] += 1
        for i in self.chain.stages[k].forward:
            if self.runs[k] == 1:
                self._replay(i, self.version)
            else:
                self._recompute(i, self.version, f"r{k}.{self.runs[k]}")

    def backward(self, k: int) -> None:
        """Stage ``k``'s backward steps, reading the latest versions."""
        for i in self.chain.stages[k].backward:
            self._replay(i, self.version)

    def lean_backward(self, k: int) -> None:
        """Stage ``k``'s backward, memory-centric: each step recomputes what it needs from the
        stage input."""
        stage = self.chain.stages[k]
        for n, i in enumerate(stage.backward):
            local = dict(self.version)
            for j in _closure(self.source, stage.forward, self.source.steps[i].access.reads):
                self._recompute(j, local, f"m{k}.{n}")
            self._replay(i, local)

    def program(self) -> Program:
        """The schedule's program, once every stage ran backward."""
        if not all(self.done):
            self.refuse(f"stage {self.done.index(False)} has no backward")
        src = self.source
        rewrites = replace(src.rewrites, recompute=RecomputeSummary(
            recomputed_flops=self.recomputed_flops, recomputed_steps=self.recomputed,
            dropped_layers=sum(1 for r in self.runs if r > 1), checkpoints=0))
        return Program(tensors=self.tensors, steps=self.steps, inputs=list(src.inputs),
                       loss=src.loss, training=True, rewrites=rewrites, alignment=src.alignment)
