"""Residency of the forward blocks in the MILP of :mod:`.optimal_model`, block by block, with
the swap decisions that take a block away for a while.

A block is constant from its definition to its last forward use, then live as long as a later
read remains: a backward read while its producer is kept, a recomputation reading it while a
consumer is recomputed there. The positions after its last forward use are cut into spans at
every such read (and at its swap gap); one relaxed variable per span says "live here", each at
least the next one (a chain: live later means live now, except across the gap of a swap) and at
least every read at the span's end. A swapped block is away from its release (``LAG`` steps
after its last forward use, or as the timed swap plan places it) to its prefetch (``LOOKAHEAD``
steps before its first backward use, recomputations before it counted)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..passes.swap import timed_steps
from .optimal_facts import Drops
from .optimal_state import EPS_ACTION, Lp, ModelState, Terms

#: swap_plan's defaults: a block is released ``LAG`` steps after its last forward use and
#: prefetched ``LOOKAHEAD`` steps before its first backward use.
LAG, LOOKAHEAD = 1, 2

#: (position, rhs constant, terms) meaning "live at and before position" when the terms'
#: sum is at least the constant.
Event = tuple[int, float, Terms]


@dataclass
class BlockLiveness:
    """One block's residency under construction."""

    root: int
    members: list[int]
    last_forward: int  # its last forward use (a step)
    events: list[Event]
    reads: list[tuple[int, int, Terms]]  # recomputations reading it: (step, group end, terms)
    q0: int  # the first position after its last forward use
    qmax: int  # the last position a read may hold it to
    gap: tuple[int, int] | None = None  # [release, prefetch) positions while swapped
    late: int | None = None  # its first backward use, when prefetched among recomputations
    swaps: list[int] = field(default_factory=list)  # its swap variables


def block_liveness(st: ModelState) -> None:
    """Residency rows and swap decisions of every block of the decision-free plan."""
    for r, ms in st.facts.blocks.members.items():
        _block(st, r, ms)


def _block(st: ModelState, r: int, ms: list[int]) -> None:
    f = st.facts
    first = min(f.blocks.life[t].first for t in ms)
    last = max(f.blocks.life[t].last for t in ms)
    if first >= f.nf:  # gradients and backward scratch: no decision changes them
        # (a region before step b holds it only if it was allocated before b: the range
        # starts at b's own position, after b's region)
        st.add_const(f.positions.of_step[first], f.positions.of_step[last], f.sizes.nbytes[r])
        return
    lf = max((f.uses.last_forward[t] for t in ms if t in f.uses.last_forward), default=first)
    q_def = 0 if first < 0 else f.positions.of_step[first]
    dependent = any(f.uses.producer.get(t) in f.drops.step_set for t in ms) or any(
        j in f.drops.step_set for t in ms for j in f.uses.consumers.get(t, ())) or any(
        t in st.pricing.swap_cost for t in ms)
    events, reads = _read_events(st, ms)
    st.add_const(q_def, f.positions.of_step[lf], f.sizes.nbytes[r])
    events = [ev for ev in events if ev[0] > f.positions.of_step[lf]]
    if not events:
        return
    blk = BlockLiveness(r, ms, lf, events, reads, q0=f.positions.of_step[lf] + 1,
                        qmax=max(ev[0] for ev in events))
    _swap_decisions(st, blk)
    if blk.gap is not None:
        _prefetch_events(st, blk)
    if blk.gap is None and (not dependent or all(not ev[2] for ev in blk.events)):
        st.add_const(blk.q0, blk.qmax, f.sizes.nbytes[r])
        return
    spans = _spans(st, blk)
    vs = [st.lp.var(name=f"live{r}@{a}") for a, _ in spans]
    st.counts.chain += len(vs)
    _chain_rows(st, blk, spans, vs)
    if blk.late is not None:
        _late_prefetch_rows(st, blk, spans, vs)
    if blk.gap is not None:  # released after LAG steps only: held until the gap starts
        after = next((i for i, (a, _) in enumerate(spans) if a >= blk.gap[1]), None)
        before = [i for i, (a, _) in enumerate(spans) if a < blk.gap[0]]
        if after is not None and before:
            st.lp.ge([(vs[before[-1]], 1.0), (vs[after], -1.0)], 0.0)


def _read_events(st: ModelState, ms: list[int]
                 ) -> tuple[list[Event], list[tuple[int, int, Terms]]]:
    """The block's reads: backward reads (while the producer is kept) and recomputations of
    its consumers (while recomputed in that group)."""
    f, drop = st.facts, st.drop
    events: list[Event] = []
    reads: list[tuple[int, int, Terms]] = []
    for t in ms:
        p = f.uses.producer.get(t)
        for b in f.uses.backward_readers.get(t, ()):
            events.append((f.positions.of_step[b], 1.0,
                           [(drop[p], -1.0)] if p in f.drops.step_set else []))
        for j in f.uses.consumers.get(t, ()):
            for e, nv in st.groups.need.get(j, {}).items():
                terms = [(nv, 1.0)] + ([(drop[p], -1.0)] if p in f.drops.step_set else [])
                events.append((f.positions.region[f.nodes.first_backward[e]], 0.0, terms))
                reads.append((j, e, terms))
    return events, reads


def _release_and_fetch(st: ModelState, lf: int, fb: int, cands: list[int]
                       ) -> tuple[int, int, bool]:
    """(release step, prefetch step, timed) of a swap between forward step ``lf`` and backward
    step ``fb``: timed (placed as the timed swap plan places them) when the copies' times are
    known, unless released early."""
    release = lf + LAG
    fetch = max(lf + LAG + 1, fb - LOOKAHEAD)
    copies = [st.pricing.copy_cost[t] for t in cands if t in st.pricing.copy_cost]
    timed = bool(copies)
    if timed and not st.pricing.early_release:
        release, fetch = timed_steps(lf, fb, max(copies), st.pricing.step_costs, LAG, LOOKAHEAD)
    return release, fetch, timed


def _swap_decisions(st: ModelState, blk: BlockLiveness) -> None:
    """The block's swap variables (one per candidate sharing it, at most one swapped, none
    with a dropped producer of a tensor read in backward) and its gap."""
    f, lp = st.facts, st.lp
    fb = min((b for t in blk.members for b in f.uses.backward_readers.get(t, ())), default=None)
    cands = [t for t in blk.members if t in st.pricing.swap_cost]
    if not cands or fb is None or fb - blk.last_forward < LAG + 2:
        return
    release, fetch, timed = _release_and_fetch(st, blk.last_forward, fb, cands)
    if fetch == fb - LOOKAHEAD and fetch >= f.nf:
        blk.late = fb  # the lookahead counts recomputations before fb: refined below
        fetch = fb
    g0, g1 = f.positions.of_step[release] + 1, f.positions.of_step[fetch]
    if g1 <= g0:
        return
    blk.gap = (g0, g1)
    for t in cands:
        st.swap[t] = lp.var(integer=True, cost=st.pricing.swap_cost[t] + EPS_ACTION, name=f"s{t}")
        st.swap_windows.compute[t] = (blk.last_forward, fb)
        if timed:
            st.swap_windows.engines[t] = ((blk.last_forward, release),
                                    (min(fetch, fb - LOOKAHEAD), fb))
        blk.swaps.append(st.swap[t])
    if len(blk.swaps) > 1:
        lp.le([(v, 1.0) for v in blk.swaps], 1.0)
    tails = {f.uses.producer.get(t) for t in blk.members
             if f.uses.backward_readers.get(t)} & f.drops.step_set
    for v in blk.swaps:
        for p in tails:
            lp.le([(v, 1.0), (st.drop[p], 1.0)], 1.0)


def _prefetch_events(st: ModelState, blk: BlockLiveness) -> None:
    """A recomputation of consumer j reading the swapped block has it prefetched LOOKAHEAD
    steps ahead: from the backward step before its region, and from the one before that
    unless another recomputation runs before j in the region."""
    f = st.facts
    for j, e, terms in blk.reads:
        b = f.nodes.first_backward[e]
        q = f.positions.region[b]
        if b - 1 < f.nf:
            continue
        for q2 in range(f.positions.of_step[b - 1], q):
            blk.events.append((q2, 0.0, terms))
        if b - LOOKAHEAD < f.nf:
            continue
        # (another input's dropped producer runs first; the binaries are exact where
        # the relaxed "recomputed here" variables would let the solver cheat)
        first = [(st.drop[f.uses.producer[u]], -1.0) for u in set(f.steps[j].access.reads)
                 if u not in blk.members and f.uses.producer.get(u) in f.drops.step_set]
        for q2 in range(f.positions.of_step[b - LOOKAHEAD], f.positions.of_step[b - 1]):
            blk.events.append((q2, 0.0, terms + first))


def _spans(st: ModelState, blk: BlockLiveness) -> list[tuple[int, int]]:
    """The block's spans ``[start, end)`` of positions: cut after every read, at the gap's
    ends and at every position of a late prefetch."""
    q0, qmax = blk.q0, blk.qmax
    cuts = {q0, qmax + 1} | {ev[0] + 1 for ev in blk.events}
    if blk.gap:
        cuts |= {blk.gap[0], blk.gap[1]}
    if blk.late is not None:
        pos = st.facts.positions.of_step
        cuts |= set(range(pos[blk.late - LOOKAHEAD], pos[blk.late] + 1))
    cuts = sorted(c for c in cuts if q0 <= c <= qmax + 1)
    return list(zip(cuts[:-1], cuts[1:]))


def _chain_rows(st: ModelState, blk: BlockLiveness, spans: list[tuple[int, int]],
                vs: list[int]) -> None:
    """The spans' memory terms and rows: each span's variable at least the next one's (unless
    swapped across the gap) and at least each read at its end."""
    f = st.facts
    last_reader: dict[int, int] = {}  # region position -> last step there reading it
    for j, e, _ in blk.reads:
        q = f.positions.region[f.nodes.first_backward[e]]
        last_reader[q] = max(last_reader.get(q, -1), j)
    events_at: dict[int, list[tuple[float, Terms]]] = {}
    for q, rhs, terms in blk.events:
        events_at.setdefault(q, []).append((rhs, terms))
    for i, (a, b) in enumerate(spans):
        _span_memory(st, blk.root, spans, vs, i, last_reader)
        in_gap = blk.gap is not None and blk.gap[0] <= a < blk.gap[1]
        if i + 1 < len(spans):
            st.lp.ge([(vs[i], 1.0), (vs[i + 1], -1.0)]
                     + [(s, 1.0) for s in blk.swaps if in_gap], 0.0)
        for rhs, terms in events_at.get(b - 1, ()):
            st.lp.ge([(vs[i], 1.0)] + [(v, -c) for v, c in terms], rhs)


def _span_memory(st: ModelState, r: int, spans: list[tuple[int, int]], vs: list[int], i: int,
                 last_reader: dict[int, int]) -> None:
    """Span ``i``'s variable in the memory terms of its positions; at a region reading the
    block, the variable of the position after it (live after the region only if read later),
    the region's step-by-step rows adding it back up to the last step reading it."""
    size = st.facts.sizes.units[r]
    a, b = spans[i]
    for q in range(a, b):
        if q in last_reader:
            nxt = next((vs[i2] for i2, (a2, b2) in enumerate(spans) if a2 <= q + 1 < b2), None)
            st.groups.region_reads.setdefault(q, []).append((size, vs[i], nxt, last_reader[q]))
            if nxt is not None:
                st.mem_terms[q].append((nxt, size))
        else:
            st.mem_terms[q].append((vs[i], size))


def _var_at(spans: list[tuple[int, int]], vs: list[int], q: int) -> int:
    return next(vs[i] for i, (a, b) in enumerate(spans) if a <= q < b)


def _late_prefetch_rows(st: ModelState, blk: BlockLiveness, spans: list[tuple[int, int]],
                        vs: list[int]) -> None:
    """Prefetched LOOKAHEAD steps before its first backward use fb, counting the
    recomputations placed before fb: at the region before fb always, at the step before
    unless the region runs two steps, before that unless it runs one."""
    f, late = st.facts, blk.late
    assert late is not None
    vfb = _var_at(spans, vs, f.positions.of_step[late])
    z1, z2 = region_steps(st.lp, st.drop, f.drops, f.nodes.forward_of[late],
                          late in f.positions.region, st.region_indicators)
    if late in f.positions.region:
        st.lp.ge([(_var_at(spans, vs, f.positions.region[late]), 1.0), (vfb, -1.0)], 0.0)
    for q in range(f.positions.of_step[late - LOOKAHEAD], f.positions.of_step[late - 1] + 1):
        z = z2 if q == f.positions.of_step[late - 1] else z1
        st.lp.ge([(_var_at(spans, vs, q), 1.0), (vfb, -1.0)]
                 + ([(z, 1.0)] if z is not None else []), 0.0)


def region_steps(lp: Lp, drop: dict[int, int], drops: Drops, e: int | None, has_region: bool,
                 cache: dict) -> tuple[int | None, int | None]:
    """Indicators that the recomputation region before node ``e``'s backward certainly runs at
    least one step and at least two, bounded from above by products of drops only (exact
    binaries: relaxed "recomputed here" variables would let the solver pay a little to move a
    prefetch). One step: ``e`` kept and its backward (or, ``e - 1`` dropped, that of ``e - 1``)
    reads the output of a dropped step ``k``; two: ``k``'s input comes from a dropped step too.
    ``drops``: the droppable steps, the droppable producers each node's backward reads and
    those of each step's forward inputs. None where no such reason exists."""
    if e is None or not has_region:
        return None, None
    if e in cache:
        return cache[e]
    dset, reads_of, inputs_of = drops.step_set, drops.backward_reads, drops.input_producers

    def conj(*vs: int) -> int:  # <= each factor
        if len(set(vs)) == 1:
            return vs[0]
        z = lp.var(name="and" + ",".join(map(str, vs)))
        for v in set(vs):
            lp.le([(z, 1.0), (v, -1.0)], 0.0)
        return z

    one: list[int] = []
    two: list[int] = []
    readers = [(e, ())] + ([(e - 1, (drop[e - 1],))] if e - 1 in dset else [])
    for f, extra in readers:
        for k in sorted(reads_of.get(f, ())):
            if k == e:
                continue
            one.append(conj(drop[k], *extra))
            for k2 in sorted(inputs_of.get(k, ())):
                two.append(conj(drop[k], drop[k2], *extra))
    if not one:
        cache[e] = (None, None)
        return cache[e]
    z1 = lp.var(name=f"region1@{e}")
    lp.le([(z1, 1.0)] + [(v, -1.0) for v in one], 0.0)
    if e in dset:
        lp.le([(z1, 1.0), (drop[e], 1.0)], 1.0)
    z2 = None
    if two:
        z2 = lp.var(name=f"region2@{e}")
        lp.le([(z2, 1.0)] + [(v, -1.0) for v in two], 0.0)
        lp.le([(z2, 1.0), (z1, -1.0)], 0.0)
    cache[e] = (z1, z2)
    return cache[e]
