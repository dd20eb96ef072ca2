"""``recompute=sqrt|speed|memory|cost``: drop feature maps in forward, recompute them from kept
checkpoints when backward needs them (Chen et al. 2016; SuperNeurons).

Recomputation is a rewrite of the program, Checkmate-style: recomputed forward steps are
inserted before the backward steps that need them, writing *clones* of the dropped tensors
(new tensor ids), and those backward steps read the clones. Every later pass (liveness,
in-place sharing, swapping, static offsets) then works on the rewritten program unchanged:
originals die at their last forward use, clones live from their recomputation to their last
backward use. A recomputed step is its forward step with the clones substituted in every slot
(:meth:`~minidl.memory.ir.program.Step.remapped`); its ``origin`` stays the forward step's.

Policies choose the *checkpoints* (feature maps kept) and how backward steps are *grouped*
(all steps of a group share one recomputation):

* ``sqrt`` — Chen et al.: candidate checkpoints are the articulation points of the forward
  graph (values that alone carry everything later steps read: every layer of a chain, the block
  outputs of a ResNet); every ⌈√m⌉-th of the m candidates is kept; one recomputation per
  segment. Extra compute: at most one forward pass.
* ``speed`` — SuperNeurons' speed-centric: checkpoints are the outputs of ops declaring an
  expensive recompute cost (conv, linear, embedding, add and concat joins; whole-sequence ops)
  and of fork points; cheap ones (ReLU, BN, pooling, dropout, activations) are dropped; a
  segment is recomputed once and kept for the rest of its backward.
* ``memory`` — memory-centric: same checkpoints, but each backward step recomputes what it
  needs and frees it at once.
* ``cost`` — cost-aware: memory-centric peak, then per segment switch to speed-centric when
  that does not raise the peak.
"""

from __future__ import annotations

import math
from dataclasses import replace

from ..ir.capabilities import RecomputeCost
from ..ir.config import RecomputePolicy
from ..ir.liveness import lifetimes
from ..ir.names import Category, Phase, Role
from ..ir.payloads import RecomputeSummary
from ..ir.program import Program, Step
from .block_choices import BlockChoices, block_choices

#: Ops whose outputs the speed / memory / cost policies keep as checkpoints.
KEPT_COSTS = (RecomputeCost.EXPENSIVE, RecomputeCost.SEQUENCE)
POLICIES = tuple(p.value for p in RecomputePolicy)


def _forward_steps(program: Program) -> list[Step]:
    return [s for s in program.steps if s.phase == Phase.FORWARD]


def _outputs(program: Program, st: Step) -> list[int]:
    return [t for t in st.access.writes if program.tensors[t].role == Role.VALUE]


def articulation_values(program: Program) -> list[int]:
    """Values that alone cross the cut after their producer: everything forward steps after
    it read from earlier steps is this value (or persistent / fed)."""
    fwd = _forward_steps(program)
    fed = set(program.inputs)
    last_read: dict[int, int] = {}
    made_at: dict[int, int] = {}
    for k, st in enumerate(fwd):
        for t in st.access.reads:
            last_read[t] = k
        for t in st.access.writes:
            made_at[t] = k
    expiring: dict[int, list[int]] = {}
    for t, lr in last_read.items():
        if t not in fed and not program.tensors[t].persistent and t in made_at:
            expiring.setdefault(lr, []).append(t)
    open_: set[int] = set()
    out = []
    for k, st in enumerate(fwd):
        open_ |= {t for t in st.access.writes if last_read.get(t, -1) > k and t not in fed}
        open_ -= set(expiring.get(k, ()))
        outs = _outputs(program, st)
        if len(outs) != 1 or program.tensors[outs[0]].category != Category.FEATURE_MAP:
            continue
        if open_ <= {outs[0]}:
            out.append(outs[0])
    return out


def choose_checkpoints(program: Program, policy: RecomputePolicy | str) -> set[int]:
    """The feature maps a policy keeps."""
    fwd = _forward_steps(program)
    if policy == RecomputePolicy.SQRT:
        cands = articulation_values(program)
        if not cands:
            return set()
        every = max(1, math.ceil(math.sqrt(len(cands))))
        return {c for i, c in enumerate(cands) if (i + 1) % every == 0} | {
            t for st in fwd if st.op.caps.cost is RecomputeCost.SEQUENCE
            for t in _outputs(program, st)}
    readers: dict[int, int] = {}
    for st in fwd:
        for t in st.access.reads:
            readers[t] = readers.get(t, 0) + 1
    keep = set()
    for st in fwd:
        for t in _outputs(program, st):
            if st.op.caps.cost in KEPT_COSTS or readers.get(t, 0) > 1:
                keep.add(t)
    return keep


def _segments(program: Program, checkpoints: set[int]) -> dict[int, int]:
    """Forward step index -> segment id; a segment ends with a checkpoint's producer."""
    seg: dict[int, int] = {}
    s = 0
    for st in _forward_steps(program):
        seg[st.index] = s
        if any(t in checkpoints for t in _outputs(program, st)):
            s += 1
    return seg


def recompute_program(program: Program, checkpoints: set[int],
                      groups: dict[int, int]) -> Program:
    """Rewrite ``program`` so dropped feature maps (forward outputs that are not checkpoints
    and whose layers are not the loss) are recomputed in backward.

    ``groups`` maps each backward step index to a group id; steps of one group share one
    recomputation placed before the group's first step.
    """
    rewrite = _Rewrite(program, checkpoints, groups)
    for st in program.steps:
        rewrite.step(st)
    return rewrite.program()


class _Rewrite:
    """:func:`recompute_program`'s rewrite, step by step: the new tensors (clones) and steps,
    and what was recomputed."""

    def __init__(self, program: Program, checkpoints: set[int], groups: dict[int, int]):
        self.source = program
        self.checkpoints = checkpoints
        self.groups = groups
        fwd = _forward_steps(program)
        self.fed = set(program.inputs)
        self.producer: dict[int, Step] = {}
        for st in fwd:
            for t in st.access.writes:
                self.producer[t] = st
        self.life = lifetimes(program)
        self.dropped_steps = _dropped_steps(program, fwd, checkpoints,
                                            self.producer.get(program.loss))
        self.tensors = list(program.tensors)
        self.steps: list[Step] = []
        self.by_group: dict[int, list[Step]] = {}
        for st in program.steps:
            if st.phase == Phase.BACKWARD:
                self.by_group.setdefault(groups.get(st.index, st.index), []).append(st)
        self.first_of_group = {g: ss[0].index for g, ss in self.by_group.items()}
        self.group_remap: dict[int, dict[int, int]] = {}
        self.recomputed_flops = 0
        self.recomputed = 0

    def available(self, t: int) -> bool:
        """Still on device when backward runs, without recomputation."""
        tp = self.source.tensors[t]
        if tp.persistent or t in self.fed:
            return True
        p = self.producer.get(t)
        if p is None:
            return True
        if p.index in self.dropped_steps:
            return False
        return self.life[t].backward_use or t in self.checkpoints

    def _clone(self, t: int, tag: str) -> int:
        spec = self.tensors[t]
        nid = len(self.tensors)
        self.tensors.append(spec.clone(nid, f"{spec.name}@{tag}"))
        return nid

    def _emit(self, st: Step, phase: str, remap: dict[int, int]) -> None:
        self.steps.append(st.remapped(remap, index=len(self.steps), phase=phase))

    def step(self, st: Step) -> None:
        """Emit ``st``; a backward step first in its group after the group's recomputation,
        and reading what it recomputed."""
        if st.phase != Phase.BACKWARD:
            self._emit(st, st.phase, {})
            return
        g = self.groups.get(st.index, st.index)
        if self.first_of_group[g] == st.index:
            self._recompute_group(g)
        self._emit(st, "backward", self.group_remap.get(g, {}))

    def _to_recompute(self, g: int) -> set[int]:
        """The forward steps making what group ``g``'s steps read that is not available, and
        what those read in turn that is not."""
        needed: set[int] = set()
        for b in self.by_group[g]:
            needed |= {t for t in b.access.reads if not self.available(t)}
        todo: set[int] = set()
        stack = [self.producer[t].index for t in needed]
        while stack:
            k = stack.pop()
            if k in todo:
                continue
            todo.add(k)
            for t in self.source.steps[k].access.reads:
                if not self.available(t):
                    stack.append(self.producer[t].index)
        return todo

    def _recompute_group(self, g: int) -> None:
        """Emit group ``g``'s recomputation, in forward order, writing clones."""
        remap: dict[int, int] = {}
        for k in sorted(self._to_recompute(g)):
            f = self.source.steps[k]
            for t in f.access.writes:
                remap[t] = self._clone(t, f"r{g}")
            for t in f.forward.params.values():  # a parameter of the iteration (ZeRO-3's
                # gathered, a streamed one) is fetched again, not kept from forward to here
                if t not in remap and not self.source.tensors[t].persistent:
                    remap[t] = self._clone(t, f"r{g}")
            if f.access.workspace >= 0:
                remap[f.access.workspace] = self._clone(f.access.workspace, f"r{g}")
            self._emit(f, "recompute", dict(remap))
            self.recomputed_flops += f.cost.flops
            self.recomputed += 1
        self.group_remap[g] = remap

    def program(self) -> Program:
        """The rewritten program (its rewrites counting what was recomputed and dropped)."""
        src = self.source
        rewrites = replace(src.rewrites, recompute=RecomputeSummary(
            recomputed_flops=self.recomputed_flops, recomputed_steps=self.recomputed,
            dropped_layers=len(self.dropped_steps), checkpoints=len(self.checkpoints)))
        return Program(tensors=self.tensors, steps=self.steps, inputs=list(src.inputs),
                       loss=src.loss, training=src.training, rewrites=rewrites,
                       alignment=src.alignment)


def _dropped_steps(program: Program, fwd: list[Step], checkpoints: set[int],
                   loss_step: Step | None) -> set[int]:
    """Forward steps (indices) none of whose outputs is a checkpoint, but the loss's."""
    dropped = set()
    for st in fwd:
        if st is loss_step:
            continue
        outs = _outputs(program, st)
        if outs and not any(t in checkpoints for t in outs):
            dropped.add(st.index)
    return dropped


def honour_blocks(checkpoints: set[int], blocks: BlockChoices) -> set[int]:
    """A policy's checkpoints with the network's block choices applied: feature maps of
    forced-recompute ops dropped, forced-keep and forced-swap ones kept."""
    return (set(checkpoints) - blocks.recomputed) | blocks.kept | blocks.swapped


def dropping_program(program: Program, dropped: set[int]) -> Program:
    """``program`` with exactly the forward steps ``dropped`` (indices) recomputed in backward,
    once per run of consecutive dropped steps (speed-centric): the rewrite of the auto
    planner's choice and of blocks forced to recompute."""
    if not dropped:
        return program
    producer_of = {t: st.index for st in program.steps if st.phase == Phase.FORWARD
                   for t in st.access.writes}
    keep = {t for st in _forward_steps(program) for t in _outputs(program, st)
            if producer_of.get(t) not in dropped}
    fwd_of_node = {s.node: s.index for s in program.steps if s.phase == Phase.FORWARD}
    seg, s = {}, 0
    for st in program.steps:
        if st.phase == Phase.FORWARD:
            seg[st.index] = s
            if st.index not in dropped:
                s += 1
    groups = {st.index: seg.get(fwd_of_node.get(st.node, -1), -1 - st.index)
              for st in program.steps if st.phase == Phase.BACKWARD}
    return recompute_program(program, keep, groups)


def policy_program(program: Program, policy: RecomputePolicy | str, peak_of=None) -> Program:
    """The rewritten program for ``policy``; ``peak_of(program) -> bytes`` is needed by
    ``cost`` to compare candidate rewrites. Blocks the network forces (:mod:`.block_choices`)
    are honoured: forced-recompute ops are never checkpoints, forced keep / swap ones are."""
    if policy not in POLICIES:
        raise ValueError(f"unknown recompute policy {policy!r}; valid: {', '.join(POLICIES)}")
    if not program.training:
        return program
    checkpoints = honour_blocks(choose_checkpoints(program, policy), block_choices(program))
    seg = _segments(program, checkpoints)
    bwd = [s for s in program.steps if s.phase == Phase.BACKWARD]
    fwd_of_node = {s.node: s.index for s in program.steps if s.phase == Phase.FORWARD}
    per_segment = {s.index: seg.get(fwd_of_node.get(s.node, -1), -1 - s.index) for s in bwd}
    per_step = {s.index: -1 - s.index for s in bwd}
    if policy in (RecomputePolicy.SQRT, RecomputePolicy.SPEED):
        return recompute_program(program, checkpoints, per_segment)
    if policy == RecomputePolicy.MEMORY:
        return recompute_program(program, checkpoints, per_step)
    # cost-aware: start memory-centric; switch segments to speed-centric while the peak holds
    if peak_of is None:
        raise ValueError("recompute=cost needs a peak estimator")
    groups = dict(per_step)
    best = recompute_program(program, checkpoints, groups)
    limit = peak_of(best)
    for sid in sorted(set(per_segment.values())):
        trial = dict(groups)
        for b, s in per_segment.items():
            if s == sid:
                trial[b] = s + 10 ** 9  # one shared group for the segment
        cand = recompute_program(program, checkpoints, trial)
        if peak_of(cand) <= limit:
            groups, best = trial, cand
    return best
