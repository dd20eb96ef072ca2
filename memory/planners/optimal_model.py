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
from scipy.sparse import csr_array

from ..ir.liveness import lifetimes, root_of
from ..ir.plan import AutoChoice
from ..ir.program import Program
from ..passes.swap import swap_candidates, timed_steps
from .auto import build

#: swap_plan's defaults: a block is released ``LAG`` steps after its last forward use and
#: prefetched ``LOOKAHEAD`` steps before its first backward use.
LAG, LOOKAHEAD = 1, 2
#: Objective added per decision (in iterations): among equal estimated times, fewer actions.
EPS_ACTION = 1e-9
#: Longest run of consecutive dropped steps the model considers on deep programs (all of them
#: up to :data:`FULL_WINDOW_STEPS` forward steps).
MAX_RUN = 24
FULL_WINDOW_STEPS = 48


class Unsupported(ValueError):
    """The program has a shape the model does not describe (steps other than forward then
    backward): the greedy planner decides alone."""


def swap_costs(program: Program, costs: list[float], bandwidth: float) -> dict[int, float]:
    """Extra seconds of swapping each candidate feature map, as the greedy planner prices it
    (two transfers minus the compute between its last forward and first backward use)."""
    out = {}
    for c in swap_candidates(program, {}, "all"):
        if c.first_backward - c.last_forward >= LAG + 2:
            idle = sum(costs[c.last_forward + 1:c.first_backward])
            out[c.root] = max(0.0, 2.0 * c.nbytes / bandwidth - idle)
    return out


class Lp:
    """Variables, a sparse constraint matrix and the objective of a mixed-integer program."""

    def __init__(self) -> None:
        self.lb: list[float] = []
        self.ub: list[float] = []
        self.integer: list[int] = []
        self.cost: list[float] = []
        self.rows: list[tuple[list[tuple[int, float]], float, float]] = []
        self.names: list[str] = []

    def var(self, ub: float = 1.0, integer: bool = False, cost: float = 0.0,
            name: str = "") -> int:
        self.names.append(name)
        self.lb.append(0.0)
        self.ub.append(ub)
        self.integer.append(1 if integer else 0)
        self.cost.append(cost)
        return len(self.lb) - 1

    def ge(self, terms: list[tuple[int, float]], rhs: float) -> int:
        """Add ``sum(coef * x) >= rhs``; returns the row."""
        self.rows.append((terms, rhs, math.inf))
        return len(self.rows) - 1

    def le(self, terms: list[tuple[int, float]], rhs: float) -> int:
        self.rows.append((terms, -math.inf, rhs))
        return len(self.rows) - 1

    def matrix(self) -> csr_array:
        data, ri, ci = [], [], []
        for r, (terms, _, _) in enumerate(self.rows):
            for c, v in terms:
                ri.append(r)
                ci.append(c)
                data.append(v)
        return csr_array((data, (ri, ci)), shape=(len(self.rows), len(self.lb)))


@dataclass
class Model:
    """The program's MILP and what is needed to read a solution back."""

    lp: Lp
    drop: dict[int, int]  # forward step index -> variable
    swap: dict[int, int]  # tensor id -> variable
    mem_rows: list[int]  # per position: the memory row
    mem_const: list[int]  # per position: bytes no decision changes
    positions: list[tuple[str, int]]  # ("F" | "P" | "B", step index) in time order
    pos_of_step: dict[int, int]
    region_pos: dict[int, int]  # backward step index -> position of the recomputation before it
    window: int
    mem_unit: float  # bytes per unit of the memory rows
    region_rows: dict[int, list[int]]  # region position -> its step-by-step rows
    link: int | None = None  # the swaps' time (its cost is the objective's swap part)
    stats: dict = field(default_factory=dict)


def droppable_steps(program: Program) -> list[int]:
    """The forward steps a plan may drop (recompute in backward): those writing a value
    tensor, except the loss's."""
    return [s.index for s in program.steps if s.phase == "forward"
            and program.loss not in s.writes
            and any(program.tensors[t].role == "value" for t in s.writes)]


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
    recomputation (swaps only; ``swap_cost`` empty: recomputation only)."""
    steps, tensors = program.steps, program.tensors
    nf = sum(1 for s in steps if s.phase == "forward")
    if any(s.phase != "forward" for s in steps[:nf]) or \
            any(s.phase != "backward" for s in steps[nf:]):
        raise Unsupported("steps other than forward then backward")
    size = {t.id: program.block_size(t.nbytes) for t in tensors}
    # memory in units of the largest block's power of two: coefficients <= 1 (bytes beside
    # binaries would leave HiGHS with a badly scaled matrix)
    mu = float(2 ** math.ceil(math.log2(max(size.values(), default=1) or 1)))
    fs = {t: b / mu for t, b in size.items()}
    producer = {t: s.index for s in steps[:nf] for t in s.writes}
    droppable = droppable_steps(program) if allow_drop else []
    dset = set(droppable)
    W = window if window is not None else (nf if nf <= FULL_WINDOW_STEPS else MAX_RUN)
    fwd_of_node = {s.node: s.index for s in steps[:nf]}
    node_f = {b.index: fwd_of_node.get(b.node) for b in steps[nf:]}
    bwd_of_f: dict[int, int] = {}
    for b in steps[nf:]:
        f = node_f[b.index]
        if f is not None:
            bwd_of_f.setdefault(f, b.index)
    consumers: dict[int, list[int]] = {}
    for s in steps[:nf]:
        for t in set(s.reads):
            if not tensors[t].persistent and producer.get(t) != s.index:
                consumers.setdefault(t, []).append(s.index)
    breaders: dict[int, list[int]] = {}
    for b in steps[nf:]:
        for t in set(b.reads):
            if not tensors[t].persistent:
                breaders.setdefault(t, []).append(b.index)
    outs = {k: [t for t in steps[k].writes if not tensors[t].persistent] for k in droppable}
    last_fwd: dict[int, int] = {}
    for s in steps[:nf]:
        for t in (*s.reads, *s.writes, *((s.workspace,) if s.workspace >= 0 else ())):
            last_fwd[t] = s.index

    # positions in time order: forward steps, then per backward step its recomputation region
    # (before the first backward step of a node) and the step itself
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
    npos = len(positions)
    node_positions: dict[int, list[int]] = {}  # forward node f -> positions of its backward
    for q, (kind, s) in enumerate(positions):
        if kind != "F" and node_f[s] is not None:
            node_positions.setdefault(node_f[s], []).append(q)

    lp = Lp()
    drop = {k: lp.var(integer=True, cost=EPS_ACTION, name=f"d{k}") for k in droppable}

    # run(f, g) = d[f] * ... * d[g-1]: f and g in one segment (None: zero)
    runs: dict[tuple[int, int], int] = {}

    def run(f: int, g: int):
        if g == f:
            return "one"
        if g - f > W or any(i not in dset for i in range(f, g)):
            return None
        if g == f + 1:
            return drop[f]
        key = (f, g)
        if key not in runs:
            prev = run(f, g - 1)
            v = lp.var(name=f"run{f},{g}")
            lp.ge([(v, 1.0)] + ([(prev, -1.0)] if prev != "one" else [])
                  + [(drop[g - 1], -1.0)], -1.0 if prev != "one" else 0.0)
            runs[key] = v
        return runs[key]

    # need[k][e]: step k recomputed in the group ending at kept step e
    need: dict[int, dict[int, int]] = {}
    cap = 3 * W + 4
    n_need_rows = 0
    for k in reversed(droppable):
        rows: dict[int, list[tuple[list[tuple[int, float]], float]]] = {}  # e -> (terms, rhs)
        for t in outs[k]:
            for b in breaders.get(t, ()):
                f = node_f[b]
                if f is None:
                    continue
                for e in range(f, min(nf, f + W + 1)):
                    r = run(f, e)
                    if r is None:
                        break
                    if e not in bwd_of_f or e - k > cap:
                        continue
                    terms = [(drop[k], -1.0)]
                    if r != "one":
                        terms.append((r, -1.0))
                    if e in dset:
                        terms.append((drop[e], 1.0))
                    rhs = -1.0 if r != "one" else 0.0
                    rows.setdefault(e, []).append((terms, rhs))
            for j in consumers.get(t, ()):
                for e, nv in need.get(j, {}).items():
                    if e - k <= cap:
                        rows.setdefault(e, []).append(([(drop[k], -1.0), (nv, -1.0)], -1.0))
        if rows:
            need[k] = {}
            for e, rs in rows.items():
                v = lp.var(cost=costs[k], name=f"need{k},{e}")
                need[k][e] = v
                for terms, rhs in rs:
                    lp.ge([(v, 1.0)] + terms, rhs)
                    n_need_rows += 1

    # memory rows, filled below
    mem_terms: list[list[tuple[int, float]]] = [[] for _ in range(npos)]
    # per region position: blocks a recomputation there reads (bytes, live-at-the-region var,
    # live-after var or None, last step of the region that may read it)
    region_reads: dict[int, list[tuple[float, int, int | None, int]]] = {}
    const = np.zeros(npos + 1, dtype=np.int64)

    def add_const(q0: int, q1: int, nbytes: int) -> None:  # positions q0..q1 inclusive
        if q1 >= q0:
            const[q0] += nbytes
            const[q1 + 1] -= nbytes

    # clones of dropped steps' outputs read in backward, live at a node's backward positions
    clone_terms: list[list[tuple[int, float]]] = [[] for _ in range(npos)]
    clone_at: dict[int, list[tuple[int, int, int]]] = {}  # node -> (step, tensor, variable)
    n_clones = 0
    for k in droppable:
        for t in outs[k]:
            readers = sorted({node_f[b] for b in breaders.get(t, ()) if node_f[b] is not None})
            if not readers:
                continue
            for g in range(readers[0], min(nf, readers[-1] + W + 1)):
                lows = []
                for fr in readers:
                    if fr > g:
                        break
                    r = run(fr, g)
                    if r is None:
                        continue
                    lows.append(r)
                if not lows or g not in node_positions:
                    continue
                v = lp.var(name=f"clone{t},{g}")
                n_clones += 1
                for r in lows:
                    if r == "one":
                        lp.ge([(v, 1.0), (drop[k], -1.0)], 0.0)
                    else:
                        lp.ge([(v, 1.0), (drop[k], -1.0), (r, -1.0)], -1.0)
                clone_at.setdefault(g, []).append((k, t, v))
                for q in node_positions[g]:
                    clone_terms[q].append((v, fs[t]))

    # swap variables, one per candidate whose block can be swapped
    base = build(program, AutoChoice())
    aliases = base.aliases
    life = lifetimes(program)
    members: dict[int, list[int]] = {}
    for t in life:
        members.setdefault(root_of(aliases, t), []).append(t)
    swap: dict[int, int] = {}
    swap_window: dict[int, tuple[int, int]] = {}  # candidate -> (last forward, first backward)
    # candidate -> (last forward, release) and (prefetch, first backward): its copy on each
    # engine runs within that window or compute stalls
    engine_windows: dict[int, tuple[tuple[int, int], tuple[int, int]]] = {}
    n_chain = 0
    z_cache: dict[int, tuple[int | None, int | None]] = {}
    reads_of: dict[int, set[int]] = {}  # node -> droppable producers its backward reads
    for b in steps[nf:]:
        if node_f[b.index] is not None:
            reads_of.setdefault(node_f[b.index], set()).update(
                producer[t] for t in b.reads if producer.get(t) in dset)
    inputs_of = {k: {producer[t] for t in steps[k].reads if producer.get(t) in dset}
                 for k in droppable}
    for r, ms in members.items():
        first = min(life[t].first for t in ms)
        last = max(life[t].last for t in ms)
        if first >= nf:  # gradients and backward scratch: no decision changes them
            # (a region before step b holds it only if it was allocated before b: the range
            # starts at b's own position, after b's region)
            add_const(pos_of_step[first], pos_of_step[last], size[r])
            continue
        lf = max((last_fwd[t] for t in ms if t in last_fwd), default=first)
        q_def = 0 if first < 0 else pos_of_step[first]
        dependent = any(producer.get(t) in dset for t in ms) or any(
            j in dset for t in ms for j in consumers.get(t, ())) or any(
            t in swap_cost for t in ms)
        # events: (position, rhs constant, terms) meaning "live at and before position"
        events: list[tuple[int, float, list[tuple[int, float]]]] = []
        reads: list[tuple[int, int, list[tuple[int, float]]]] = []  # recomputations reading it
        for t in ms:
            p = producer.get(t)
            for b in breaders.get(t, ()):
                events.append((pos_of_step[b], 1.0, [(drop[p], -1.0)] if p in dset else []))
            for j in consumers.get(t, ()):
                for e, nv in need.get(j, {}).items():
                    terms = [(nv, 1.0)] + ([(drop[p], -1.0)] if p in dset else [])
                    events.append((region_pos[bwd_of_f[e]], 0.0, terms))
                    reads.append((j, e, terms))
        add_const(q_def, pos_of_step[lf], size[r])
        events = [ev for ev in events if ev[0] > pos_of_step[lf]]
        if not events:
            continue
        qmax = max(ev[0] for ev in events)
        q0 = pos_of_step[lf] + 1
        # the swap gap: away from the release (LAG steps after the last forward use) to the
        # prefetch (LOOKAHEAD steps before the first backward use)
        gap = None
        late = None
        svars: list[int] = []
        fb = min((b for t in ms for b in breaders.get(t, ())), default=None)
        cands = [t for t in ms if t in swap_cost]
        if cands and fb is not None and fb - lf >= LAG + 2:
            release = lf + LAG
            fetch = max(lf + LAG + 1, fb - LOOKAHEAD)
            copies = [copy_cost[t] for t in cands if t in (copy_cost or {})]
            timed = bool(copies)
            if timed and not early_release:  # placed as the timed swap plan places them
                release, fetch = timed_steps(lf, fb, max(copies), costs, LAG, LOOKAHEAD)
            if fetch == fb - LOOKAHEAD and fetch >= nf:
                late = fb  # the lookahead counts recomputations before fb: refined below
                fetch = fb
            g0, g1 = pos_of_step[release] + 1, pos_of_step[fetch]
            if g1 > g0:
                gap = (g0, g1)
                for t in cands:
                    swap[t] = lp.var(integer=True, cost=swap_cost[t] + EPS_ACTION, name=f"s{t}")
                    swap_window[t] = (lf, fb)
                    if timed:
                        engine_windows[t] = ((lf, release), (min(fetch, fb - LOOKAHEAD), fb))
                    svars.append(swap[t])
                if len(svars) > 1:
                    lp.le([(v, 1.0) for v in svars], 1.0)
                tails = {producer.get(t) for t in ms if breaders.get(t)} & dset
                for v in svars:
                    for p in tails:
                        lp.le([(v, 1.0), (drop[p], 1.0)], 1.0)
        if gap is not None:
            # a recomputation of consumer j reading the swapped block has it prefetched
            # LOOKAHEAD steps ahead: from the backward step before its region, and from the
            # one before that unless another recomputation runs before j in the region
            for j, e, terms in reads:
                b = bwd_of_f[e]
                q = region_pos[b]
                if b - 1 < nf:
                    continue
                for q2 in range(pos_of_step[b - 1], q):
                    events.append((q2, 0.0, terms))
                if b - LOOKAHEAD < nf:
                    continue
                # (another input's dropped producer runs first; the binaries are exact where
                # the relaxed "recomputed here" variables would let the solver cheat)
                first = [(drop[producer[u]], -1.0) for u in set(steps[j].reads)
                         if u not in ms and producer.get(u) in dset]
                for q2 in range(pos_of_step[b - LOOKAHEAD], pos_of_step[b - 1]):
                    events.append((q2, 0.0, terms + first))
        if gap is None and (not dependent or all(not ev[2] for ev in events)):
            add_const(q0, qmax, size[r])
            continue
        cuts = {q0, qmax + 1} | {ev[0] + 1 for ev in events}
        if gap:
            cuts |= {gap[0], gap[1]}
        if late is not None:
            cuts |= set(range(pos_of_step[late - LOOKAHEAD], pos_of_step[late] + 1))
        cuts = sorted(c for c in cuts if q0 <= c <= qmax + 1)
        spans = list(zip(cuts[:-1], cuts[1:]))  # [start, end) per run
        vs = [lp.var(name=f"live{r}@{a}") for a, _ in spans]
        last_reader: dict[int, int] = {}  # region position -> last step there reading it
        for j, e, _ in reads:
            q = region_pos[bwd_of_f[e]]
            last_reader[q] = max(last_reader.get(q, -1), j)
        n_chain += len(vs)
        events_at: dict[int, list[tuple[float, list[tuple[int, float]]]]] = {}
        for q, rhs, terms in events:
            events_at.setdefault(q, []).append((rhs, terms))
        for i, (a, b) in enumerate(spans):
            for q in range(a, b):
                if q in last_reader:  # read inside the region: live after it only if read later
                    nxt = next((vs[i2] for i2, (a2, b2) in enumerate(spans) if a2 <= q + 1 < b2),
                               None)
                    region_reads.setdefault(q, []).append((fs[r], vs[i], nxt, last_reader[q]))
                    if nxt is not None:
                        mem_terms[q].append((nxt, fs[r]))
                else:
                    mem_terms[q].append((vs[i], fs[r]))
            in_gap = gap is not None and gap[0] <= a < gap[1]
            if i + 1 < len(spans):
                lp.ge([(vs[i], 1.0), (vs[i + 1], -1.0)] + [(s, 1.0) for s in svars if in_gap],
                      0.0)
            for rhs, terms in events_at.get(b - 1, ()):
                lp.ge([(vs[i], 1.0)] + [(v, -c) for v, c in terms], rhs)
        if late is not None:
            # prefetched LOOKAHEAD steps before its first backward use fb, counting the
            # recomputations placed before fb: at the region before fb always, at the step
            # before unless the region runs two steps, before that unless it runs one
            def var_at(q: int, spans=spans, vs=vs) -> int:
                return next(vs[i] for i, (a, b) in enumerate(spans) if a <= q < b)

            vfb = var_at(pos_of_step[late])
            z1, z2 = region_steps(lp, drop, dset, reads_of, inputs_of, node_f[late],
                                   late in region_pos, z_cache)
            if late in region_pos:
                lp.ge([(var_at(region_pos[late]), 1.0), (vfb, -1.0)], 0.0)
            for q in range(pos_of_step[late - LOOKAHEAD], pos_of_step[late - 1] + 1):
                z = z2 if q == pos_of_step[late - 1] else z1
                lp.ge([(var_at(q), 1.0), (vfb, -1.0)] + ([(z, 1.0)] if z is not None else []),
                      0.0)
        if gap is not None:  # released after LAG steps only: held until the gap starts
            after = next((i for i, (a, _) in enumerate(spans) if a >= gap[1]), None)
            before = [i for i, (a, _) in enumerate(spans) if a < gap[0]]
            if after is not None and before:
                lp.ge([(vs[before[-1]], 1.0), (vs[after], -1.0)], 0.0)

    mem_const = np.cumsum(const[:npos]).tolist()
    mem_rows = [lp.le(mem_terms[q] + clone_terms[q], (budget_iter - mem_const[q]) / mu)
                for q in range(npos)]
    region_rows: dict[int, list[int]] = {}
    # inside a recomputation region, step by step: what is live across the region, the clones
    # made so far (steps run in forward order), and this step's scratch: its workspace, its
    # outputs no backward step reads and the inputs it reads from such transient clones
    no_breader = {t for t in size if not breaders.get(t)}
    for e in sorted({e for ne in need.values() for e in ne}):
        q = region_pos[bwd_of_f[e]]
        across = lp.var(ub=math.inf, name=f"across{e}")
        lp.ge([(across, 1.0)] + [(v, -c) for v, c in mem_terms[q]], mem_const[q] / mu)
        made = sorted(clone_at.get(e, []))
        for k in sorted(k for k, ne in need.items() if e in ne):
            ne = need[k]
            st = steps[k]
            trans = sum(size[t] for t in outs[k] if t in no_breader)
            if st.workspace >= 0:
                trans += size[st.workspace]
            terms = [(across, 1.0), (ne[e], trans / mu)]
            terms += [(v, fs[t]) for j, t, v in made if j <= k]
            for f, here, nxt, last in region_reads.get(q, ()):
                if k <= last:
                    terms += [(here, f)] + ([(nxt, -f)] if nxt is not None else [])
            rhs = budget_iter / mu
            for t in set(st.reads):
                p = producer.get(t)
                if p in need and e in need[p] and t in no_breader and p != k:
                    terms += [(need[p][e], fs[t]), (ne[e], fs[t])]
                    rhs += fs[t]
            region_rows.setdefault(q, []).append(lp.le(terms, rhs))

    link, n_link_rows = link_rows(lp, swap, swap_window, swap_cost, copy_cost or {}, costs,
                                  engine_windows)
    # at most W consecutive dropped steps (the windows above cover every segment)
    for f in range(nf - W):
        if all(i in dset for i in range(f, f + W + 1)):
            lp.le([(drop[i], 1.0) for i in range(f, f + W + 1)], float(W))
    # dropping an in-place op's output but keeping the block it writes over never saves memory
    # (the block is held until the recomputation) and costs time: drop the whole block
    for ms in members.values():
        tails = [t for t in ms if breaders.get(t)]
        if len(ms) < 2 or len(tails) != 1:
            continue
        p = producer.get(tails[0])
        if p not in dset or any(tensors[t].role == "stash" for t in steps[p].writes):
            continue
        for t in ms:
            q = producer.get(t)
            if q in dset and q != p:
                lp.ge([(drop[q], 1.0), (drop[p], -1.0)], 0.0)
    model = Model(lp, drop, swap, mem_rows, mem_const, positions, pos_of_step, region_pos, W,
                   mu, region_rows, link)
    model.stats = dict(variables=len(lp.lb), binaries=len(drop) + len(swap),
                       constraints=len(lp.rows), window=W, clones=n_clones, need_rows=n_need_rows,
                       chain_vars=n_chain, link_rows=n_link_rows)
    return model


#: At most this many link-congestion rows (the most congested windows first).
MAX_LINK_ROWS = 2000


def link_rows(lp: Lp, swap: dict[int, int], window: dict[int, tuple[int, int]],
              swap_cost: dict[int, float], copy_cost: dict[int, float], costs: list[float],
              engine_windows: dict[int, tuple[tuple[int, int], tuple[int, int]]] | None = None
              ) -> tuple[int | None, int]:
    """The swaps' time as one variable ``z`` >= the sum of their own costs, and >= each
    window's congestion. A candidate's copy must run within an interval of compute or compute
    stalls: with ``engine_windows`` (its timed release and prefetch steps), its offload between
    its last forward use and its release, its prefetch between its prefetch step and its first
    backward use, one copy engine each way; without, both copies between its last forward and
    first backward use (``window``). For every interval ``[a, b)`` the candidates whose
    intervals lie inside copy on one engine within the compute of ``[a, b)`` plus any stall, so
    the stall is at least their copies' time minus that compute. Returns ``z`` (None without
    swaps) and the number of congestion rows; the solver adds rows on ``z`` as it prices
    solutions exactly (:func:`.optimal.price_cut`)."""
    if not swap:
        return None, 0
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    # per engine: candidate -> [start, end) in prefix indices (compute of steps start..end-1)
    engines: list[dict[int, tuple[int, int]]] = []
    if engine_windows:
        engines.append({t: (w[0][0] + 1, w[0][1] + 1) for t, w in engine_windows.items()})
        engines.append({t: (w[1][0], w[1][1]) for t, w in engine_windows.items()})
    untimed = {t: (window[t][0] + 1, window[t][1]) for t in swap
               if t in copy_cost and t not in (engine_windows or {})}
    if untimed:
        engines.append(untimed)
    rows = []
    for spans in engines:
        for a in sorted({s for s, _ in spans.values()}):
            for b in sorted({e for _, e in spans.values()}):
                members = [t for t, (s, e) in spans.items() if s >= a and e <= b]
                if not members or spans is untimed and len(members) < 2:
                    continue  # one untimed candidate: its own cost says as much
                avail = prefix[b] - prefix[a] if b > a else 0.0
                need = sum(copy_cost[t] for t in members)
                if need > avail:
                    rows.append((need - avail, members, avail))
    rows.sort(key=lambda r: -r[0])
    z = lp.var(ub=math.inf, cost=1.0, name="link")
    for v in swap.values():
        lp.cost[v] = EPS_ACTION
    lp.ge([(z, 1.0)] + [(v, -swap_cost[t]) for t, v in swap.items()], 0.0)
    for _, members, avail in rows[:MAX_LINK_ROWS]:
        lp.ge([(z, 1.0)] + [(swap[t], -copy_cost[t]) for t in members], -avail)
    return z, min(len(rows), MAX_LINK_ROWS)


def region_steps(lp: Lp, drop: dict[int, int], dset: set[int], reads_of: dict[int, set[int]],
                  inputs_of: dict[int, set[int]], e: int | None, has_region: bool, cache: dict
                  ) -> tuple[int | None, int | None]:
    """Indicators that the recomputation region before node ``e``'s backward certainly runs at
    least one step and at least two, bounded from above by products of drops only (exact
    binaries: relaxed "recomputed here" variables would let the solver pay a little to move a
    prefetch). One step: ``e`` kept and its backward (or, ``e - 1`` dropped, that of ``e - 1``)
    reads the output of a dropped step ``k``; two: ``k``'s input comes from a dropped step too.
    ``reads_of``: node -> droppable producers its backward reads; ``inputs_of``: step ->
    droppable producers of its forward inputs. None where no such reason exists."""
    if e is None or not has_region:
        return None, None
    if e in cache:
        return cache[e]

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
