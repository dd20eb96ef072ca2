"""The mixed-integer program of ``auto,planner=optimal`` (:mod:`.optimal`): Checkmate's
formulation (Jain et al. 2020) over the schedules :func:`.auto.build` makes, extended with
swapping.

Decisions: ``d[k] = 1`` drops forward step ``k`` (its outputs and stash are recomputed in
backward, one recomputation per run of consecutive dropped steps, before that run's first
backward step); ``s[t] = 1`` swaps feature map ``t``. The objective estimates the extra time:
per swap the transfer time its idle compute does not hide (and the link's congestion, below),
per recomputed step its cost, once per group of backward steps that needs it — a map whose
producer's input was dropped too pays for the whole chain.

Memory is constrained at every *position*: each forward step, each backward step and, before
each backward step, the recomputations placed there. What is live:

* blocks (tensors sharing one block in the ``reuse,inplace`` plan) no decision changes: constant;
* a forward block: from its definition to its last forward use, then as long as a later read
  remains — a backward read while its producer is kept, a recomputation reading it while a
  consumer is recomputed there; a swapped block is away from its release to its prefetch;
* a clone (a dropped step's output or stash) from its group's recomputation to its group's last
  backward read; a recomputation also holds one step's scratch and transient clones.

Products of binaries ("these steps are in one segment", "recomputed in this group") are
linearised with lower bounds only: the objective and the budget push them down, and at integral
decisions their least values are the products; no such relaxed variable can lower memory (where
a product would, it is bounded from above by drop binaries instead). Dropping an in-place op's
output while keeping the op it writes over is left out (the block is held until the
recomputation anyway: never less memory, more time).

Swaps are priced by their own unhidden transfer time (Capuchin) and, where several share the
link, by its congestion (:func:`link_rows`); :mod:`.optimal` checks every solution on the built
plan and prices it exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ..ir.names import Role
from ..ir.program import Program
from ..passes.swap import swap_candidates
from .optimal_facts import (
    FULL_WINDOW_STEPS,
    MAX_RUN,
    Positions,
    Unsupported,
    droppable_steps,
    program_facts,
)
from .optimal_link import MAX_LINK_ROWS, link_rows
from .optimal_liveness import LAG, LOOKAHEAD, block_liveness, region_steps
from .optimal_state import EPS_ACTION, SAME_STEP, Lp, ModelState, Pricing, Segment, Terms

__all__ = ["EPS_ACTION", "FULL_WINDOW_STEPS", "LAG", "LOOKAHEAD", "MAX_LINK_ROWS", "MAX_RUN",
           "Lp", "Model", "Unsupported", "build_model", "droppable_steps", "link_rows",
           "region_steps", "swap_costs"]


def swap_costs(program: Program, costs: list[float], bandwidth: float) -> dict[int, float]:
    """Extra seconds of swapping each candidate feature map, as the greedy planner prices it
    (two transfers minus the compute between its last forward and first backward use)."""
    out = {}
    for c in swap_candidates(program, {}, "all"):
        if c.first_backward - c.last_forward >= LAG + 2:
            idle = sum(costs[c.last_forward + 1:c.first_backward])
            out[c.root] = max(0.0, 2.0 * c.nbytes / bandwidth - idle)
    return out


@dataclass
class MemoryRows:
    """The memory budget's rows of the model."""

    rows: list[int]  # per position: the memory row
    const: list[int]  # per position: bytes no decision changes
    region_rows: dict[int, list[int]]  # region position -> its step-by-step rows
    unit: float  # bytes per unit of the rows


@dataclass
class Model:
    """The program's MILP and what is needed to read a solution back."""

    lp: Lp
    drop: dict[int, int]  # forward step index -> variable
    swap: dict[int, int]  # tensor id -> variable
    memory: MemoryRows
    positions: Positions
    window: int
    link: int | None = None  # the swaps' time (its cost is the objective's swap part)
    stats: dict = field(default_factory=dict)


def build_model(program: Program, costs: list[float], swap_cost: dict[int, float],
                budget_iter: int, window: int | None = None,
                copy_cost: dict[int, float] | None = None, allow_drop: bool = True,
                early_release: bool = False) -> Model:
    """The MILP of ``program`` for ``budget_iter`` bytes of iteration tensors, objective in the
    units of ``costs`` / ``swap_cost`` (per step, per candidate); ``window``: the longest run
    of consecutive dropped steps minus one (default: all of them on programs up to
    :data:`FULL_WINDOW_STEPS` forward steps, else :data:`MAX_RUN`). ``copy_cost``: one
    transfer's time per candidate; with it the swaps' time is at least the link's congestion
    (:func:`link_rows`) instead of the sum of their own costs alone, and a swapped block is
    away from when compute reaches the end of its offload (:func:`.swap.timed_steps`) — or, with
    ``early_release``, from one step after its offload, compute waiting for the copy (the two
    placements of :func:`.optimal.evaluate_placements`). ``allow_drop=False``: no
    recomputation (swaps only; ``swap_cost`` empty: recomputation only).

    The constraint families run in this order (it numbers the variables and rows): drop
    decisions, recomputation groups, clones, the blocks' residency and swaps
    (:mod:`.optimal_liveness`), the memory budget per position, per step inside recomputation
    regions, the swaps' time (:mod:`.optimal_link`), the longest run of drops, in-place
    blocks."""
    facts = program_facts(program, allow_drop, window)
    st = ModelState(facts, Pricing(costs, swap_cost, copy_cost or {}, early_release))
    st.drop = {k: st.lp.var(integer=True, cost=EPS_ACTION, name=f"d{k}")
               for k in facts.drops.steps}
    recompute_groups(st)
    clones(st)
    block_liveness(st)
    mem_const, mem_rows = budget_rows(st, budget_iter)
    region_rows = region_step_rows(st, mem_const, budget_iter)
    link, n_link_rows = link_rows(st.lp, st.swap, st.swap_windows.compute, swap_cost,
                                  st.pricing.copy_cost, costs, st.swap_windows.engines)
    longest_run_rows(st)
    inplace_rows(st)
    memory = MemoryRows(mem_rows, mem_const, region_rows, facts.sizes.unit)
    model = Model(st.lp, st.drop, st.swap, memory, facts.positions, facts.drops.window, link)
    counts = st.counts
    model.stats = dict(variables=len(st.lp.lb), binaries=len(st.drop) + len(st.swap),
                       constraints=len(st.lp.rows), window=facts.drops.window,
                       clones=counts.clones, need_rows=counts.need_rows, chain_vars=counts.chain,
                       link_rows=n_link_rows)
    return model


# ---------------------------------------------------------------- segments of dropped steps


def segment(st: ModelState, f: int, g: int) -> Segment:
    """``d[f] * ... * d[g-1]``: steps ``f`` and ``g`` in one segment (a run of dropped steps
    ``f..g-1`` recomputed together): :data:`SAME_STEP` when ``f == g``, the drop variable for
    one step, else a product variable (bounded from below), made once; None where the steps
    between are not all droppable or more than the window apart."""
    if g == f:
        return SAME_STEP
    facts = st.facts
    if g - f > facts.drops.window or any(i not in facts.drops.step_set for i in range(f, g)):
        return None
    if g == f + 1:
        return st.drop[f]
    key = (f, g)
    if key not in st.runs:
        prev = segment(st, f, g - 1)
        v = st.lp.var(name=f"run{f},{g}")
        st.lp.ge([(v, 1.0)] + ([(prev, -1.0)] if prev != SAME_STEP else [])
                 + [(st.drop[g - 1], -1.0)], -1.0 if prev != SAME_STEP else 0.0)
        st.runs[key] = v
    return st.runs[key]


# ---------------------------------------------------------------- recomputation groups


def recompute_groups(st: ModelState) -> None:
    """``need[k][e]``: step ``k`` recomputed in the group ending at kept step ``e`` (priced at
    ``costs[k]``), at least 1 when ``k`` is dropped and a backward step of a node in the
    segment ending at ``e`` reads its output, or a step recomputed in that group reads it."""
    cap = 3 * st.facts.drops.window + 4
    for k in reversed(st.facts.drops.steps):
        rows: dict[int, list[tuple[Terms, float]]] = {}  # e -> (terms, rhs)
        for t in st.facts.drops.outputs[k]:
            _backward_read_rows(st, k, t, cap, rows)
            for j in st.facts.uses.consumers.get(t, ()):
                for e, nv in st.groups.need.get(j, {}).items():
                    if e - k <= cap:
                        rows.setdefault(e, []).append(([(st.drop[k], -1.0), (nv, -1.0)], -1.0))
        if rows:
            st.groups.need[k] = {}
            for e, rs in rows.items():
                v = st.lp.var(cost=st.pricing.step_costs[k], name=f"need{k},{e}")
                st.groups.need[k][e] = v
                for terms, rhs in rs:
                    st.lp.ge([(v, 1.0)] + terms, rhs)
                    st.counts.need_rows += 1


def _backward_read_rows(st: ModelState, k: int, t: int, cap: int,
                        rows: dict[int, list[tuple[Terms, float]]]) -> None:
    """Rows for ``need[k][e]`` from the backward reads of ``k``'s output ``t``: the reader's
    node ``f`` in the segment ending at ``e`` (``e`` kept)."""
    facts = st.facts
    for b in facts.uses.backward_readers.get(t, ()):
        f = facts.nodes.forward_of[b]
        if f is None:
            continue
        for e in range(f, min(facts.nf, f + facts.drops.window + 1)):
            r = segment(st, f, e)
            if r is None:
                break
            if e not in facts.nodes.first_backward or e - k > cap:
                continue
            terms = [(st.drop[k], -1.0)]
            if r != SAME_STEP:
                terms.append((r, -1.0))
            if e in facts.drops.step_set:
                terms.append((st.drop[e], 1.0))
            rhs = -1.0 if r != SAME_STEP else 0.0
            rows.setdefault(e, []).append((terms, rhs))


def clones(st: ModelState) -> None:
    """Clones of dropped steps' outputs read in backward: ``clone[t][g]`` live at node ``g``'s
    backward positions when ``t``'s producer is dropped and a reader's node is in the segment
    ending at ``g``."""
    facts = st.facts
    for k in facts.drops.steps:
        for t in facts.drops.outputs[k]:
            forward_of = facts.nodes.forward_of
            readers = sorted({forward_of[b] for b in facts.uses.backward_readers.get(t, ())
                              if forward_of[b] is not None})
            if not readers:
                continue
            for g in range(readers[0], min(facts.nf, readers[-1] + facts.drops.window + 1)):
                lows = _segments_to(st, readers, g)
                if not lows or g not in facts.positions.of_node:
                    continue
                v = st.lp.var(name=f"clone{t},{g}")
                st.counts.clones += 1
                for r in lows:
                    if r == SAME_STEP:
                        st.lp.ge([(v, 1.0), (st.drop[k], -1.0)], 0.0)
                    else:
                        st.lp.ge([(v, 1.0), (st.drop[k], -1.0), (r, -1.0)], -1.0)
                st.groups.clones.setdefault(g, []).append((k, t, v))
                for q in facts.positions.of_node[g]:
                    st.clone_terms[q].append((v, facts.sizes.units[t]))


def _segments_to(st: ModelState, readers: list[int], g: int) -> list[Segment]:
    """The segments from each of the (sorted) reader nodes up to ``g`` that can exist."""
    lows = []
    for fr in readers:
        if fr > g:
            break
        r = segment(st, fr, g)
        if r is None:
            continue
        lows.append(r)
    return lows


# ---------------------------------------------------------------- the memory budget


def budget_rows(st: ModelState, budget_iter: int) -> tuple[list[int], list[int]]:
    """One row per position: the decision-dependent blocks and the clones live there within
    ``budget_iter`` less the bytes no decision changes. Returns (those bytes, the rows)."""
    npos = len(st.facts.positions.order)
    mem_const = np.cumsum(st.const[:npos]).tolist()
    mem_rows = [st.lp.le(st.mem_terms[q] + st.clone_terms[q],
                         (budget_iter - mem_const[q]) / st.facts.sizes.unit) for q in range(npos)]
    return mem_const, mem_rows




def region_step_rows(st: ModelState, mem_const: list[int], budget_iter: int
                     ) -> dict[int, list[int]]:
    """The budget inside each recomputation region, step by step: what is live across the
    region (one variable per region), the clones made so far (steps run in forward order), and
    this step's scratch: its workspace, its outputs no backward step reads and the inputs it
    reads from such transient clones. Returns region position -> its rows."""
    facts = st.facts
    region_rows: dict[int, list[int]] = {}
    no_breader = {t for t in facts.sizes.nbytes if not facts.uses.backward_readers.get(t)}
    for e in sorted({e for ne in st.groups.need.values() for e in ne}):
        q = facts.positions.region[facts.nodes.first_backward[e]]
        across = st.lp.var(ub=math.inf, name=f"across{e}")
        st.lp.ge([(across, 1.0)] + [(v, -c) for v, c in st.mem_terms[q]],
                 mem_const[q] / facts.sizes.unit)
        made = sorted(st.groups.clones.get(e, []))
        for k in sorted(k for k, ne in st.groups.need.items() if e in ne):
            row = _region_step_row(st, k, e, q, across, made, no_breader, budget_iter)
            region_rows.setdefault(q, []).append(row)
    return region_rows


def _region_step_row(st: ModelState, k: int, e: int, q: int, across: int,
                     made: list[tuple[int, int, int]], no_breader: set[int],
                     budget_iter: int) -> int:
    """The budget while step ``k`` is recomputed in the group ending at ``e`` (region
    position ``q``)."""
    facts = st.facts
    ne = st.groups.need[k]
    step = facts.steps[k]
    trans = sum(facts.sizes.nbytes[t] for t in facts.drops.outputs[k] if t in no_breader)
    if step.access.workspace >= 0:
        trans += facts.sizes.nbytes[step.access.workspace]
    terms = [(across, 1.0), (ne[e], trans / facts.sizes.unit)]
    terms += [(v, facts.sizes.units[t]) for j, t, v in made if j <= k]
    for f, here, nxt, last in st.groups.region_reads.get(q, ()):
        if k <= last:
            terms += [(here, f)] + ([(nxt, -f)] if nxt is not None else [])
    rhs = budget_iter / facts.sizes.unit
    for t in set(step.access.reads):
        p = facts.uses.producer.get(t)
        if p in st.groups.need and e in st.groups.need[p] and t in no_breader and p != k:
            terms += [(st.groups.need[p][e], facts.sizes.units[t]), (ne[e], facts.sizes.units[t])]
            rhs += facts.sizes.units[t]
    return st.lp.le(terms, rhs)


# ---------------------------------------------------------------- shape of the drop decisions


def longest_run_rows(st: ModelState) -> None:
    """At most ``window`` consecutive dropped steps (the windows above cover every segment)."""
    facts, w = st.facts, st.facts.drops.window
    for f in range(facts.nf - w):
        if all(i in facts.drops.step_set for i in range(f, f + w + 1)):
            st.lp.le([(st.drop[i], 1.0) for i in range(f, f + w + 1)], float(w))


def inplace_rows(st: ModelState) -> None:
    """Dropping an in-place op's output but keeping the block it writes over never saves
    memory (the block is held until the recomputation) and costs time: drop the whole block."""
    facts = st.facts
    for ms in facts.blocks.members.values():
        tails = [t for t in ms if facts.uses.backward_readers.get(t)]
        if len(ms) < 2 or len(tails) != 1:
            continue
        p = facts.uses.producer.get(tails[0])
        if p not in facts.drops.step_set or any(facts.tensors[t].role == Role.STASH
                                      for t in facts.steps[p].access.writes):
            continue
        for t in ms:
            q = facts.uses.producer.get(t)
            if q in facts.drops.step_set and q != p:
                st.lp.ge([(st.drop[q], 1.0), (st.drop[p], -1.0)], 0.0)
