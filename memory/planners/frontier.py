"""The auto planner's curve: every plan worth running, priced by one cost model, and the
fastest one that fits a budget.

``auto`` does not search per budget. It gathers candidate plans of one training program, each
with its peak and its predicted iteration time, keeps the Pareto frontier (no candidate both
larger and slower than another), and for a budget takes the fastest candidate whose placed
peak fits. The candidates do not depend on the budget, so the answer is never slower with
more memory (monotone), and never slower than a fixed spec that fits, since every fixed spec
is a candidate (dominance). Nothing is timed by the clock: a plan is a function of the
program, the costs, the link and the budget.

Candidates:

* every fixed combination of the lossless strategies: ``recompute=`` (each policy or none) x
  ``swap=`` (none, conv, all, auto) x ``binarize`` / ``sparse`` (none, either, both), each
  priced as it runs (``static`` offsets, so its placed peak is exact);
* Rotor's schedules (:mod:`.rotor`) over the program's chain of stages (:mod:`.chain`), for
  memory limits from the least the chain runs in to the plain peak, at several scalings of
  the chain's memory figures (the programme's estimate is conservative: each schedule is then
  placed and priced exactly); recomputation in chains, not only one level;
* torch.compile's activation-memory policy at several shares of the forward steps kept
  (:mod:`.knapsack`): single feature maps dropped where they are cheap;
* those schedules with the swaps the link hides under their compute (:func:`hidden_swaps`),
  and the lowest plans with swaps added while the peak falls (:func:`swap_down`), both in
  :mod:`.frontier_swaps`.

A candidate's (:class:`.candidate.Candidate`) *peak* is its placed (static) arena plus the
persistent state: exactly what a run reaches; its *time* is the cost model's walk of the plan
(:func:`.cost_model.extra_time`: steps at their costs, copies queued on the link, compute
waiting for late copies).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import cached_property

import numpy as np

from ..ir.config import MemoryConfig, RecomputePolicy, SwapPolicy
from ..ir.names import Phase
from ..ir.plan import Plan
from ..ir.program import Program
from ..passes.base_plan import base_plan, plan_peak
from ..passes.block_choices import block_choices
from ..passes.compress import compress_program
from .candidate import BASE, CODEC_BYTES_PER_S, Candidate, priced, pricer
from .certificate import TimeBound, time_bound
from .chain import Chain, chain_of, schedule_program
from .frontier_swaps import SWAP_MOVES, hidden_swaps, swap_down
from .knapsack import KNAPSACK_SHARES, knapsack_candidates
from .rotor import RotorTable, rotor_schedule, rotor_table

# (Candidate, pricer, the knapsack's and the swaps' candidates: importable here as before)
__all__ = ["CODEC_BYTES_PER_S", "KNAPSACK_SHARES", "SWAP_MOVES", "Candidate", "Frontier",
           "build_frontier", "fixed_configs", "hidden_swaps", "knapsack_candidates", "pricer",
           "swap_down"]

#: Plans within this share of the least predicted time are told apart by their traffic:
#: the fewest bytes moved and recomputed wins (:meth:`Frontier.objective`).
TIE_SHARE = 0.005
#: Memory slots of Rotor's table, and the scalings of the chain's memory figures it is run at.
ROTOR_SLOTS = 400
ROTOR_SCALES = (1.0, 0.8, 0.65, 0.5)
#: The candidates' tables reach this many times the plain peak.
ROTOR_RANGE = 2.0
#: Schedules taken from each table (memory limits where its cost falls, spread from the least
#: memory to the least time).
ROTOR_POINTS = 60


#: The lossless encodings of the fixed specs: none, either, both.
_ENCODINGS = ((), ("binarize",), ("sparse",), ("binarize", "sparse"))


def fixed_configs(program: Program) -> list[MemoryConfig]:
    """The fixed specs ``auto`` is never slower than (every lossless combination):
    ``reuse,inplace`` with each recomputation policy or none, each swap policy or none, and
    each set of encodings, in that order."""
    configs = []
    for recompute in (None, *RecomputePolicy):
        for swap in (None, *SwapPolicy):
            for encodings in _ENCODINGS:
                flags = {"reuse": "", "inplace": ""}
                if recompute is not None:
                    flags["recompute"] = recompute.value
                if swap is not None:
                    flags["swap"] = swap.value
                flags.update(dict.fromkeys(encodings, ""))
                configs.append(MemoryConfig(flags))
    return configs


@dataclass
class Frontier:
    """The candidates of one program, the Pareto frontier first by least time."""

    program: Program
    candidates: list[Candidate]
    oracle_s: float
    #: The program's chain of stages (None: not a chain).
    chain: Chain | None = None
    #: The link's bytes per second (the bound's price of swapping).
    bandwidth: float = math.inf
    #: The certificate: a lower bound on every plan of the program (:mod:`.certificate`).
    certificate: TimeBound | None = None

    @cached_property
    def bound(self) -> RecomputeBound | None:
        """Rotor's least times over stage-level recomputation schedules (None: the program is
        not a chain): how far stage-level schedules go, not a bound on every plan. Made
        when first read (no plan needs it)."""
        return None if self.chain is None else recompute_bound(self.program, self.chain)

    def lower_bound(self, budget: int | None) -> float | None:
        """A lower bound on the iteration seconds of any plan of the program within
        ``budget`` (:mod:`.certificate`: recomputation at any grain, swaps, encodings and
        workspace caps included; inf where no plan fits); None without a certificate.
        Without a budget: the oracle's time."""
        if budget is None:
            return self.oracle_s
        if self.certificate is None:
            return None
        return self.certificate.seconds(budget)

    def fastest(self) -> Candidate:
        """The least :meth:`objective` (then the least peak): what ``auto`` runs without a
        budget."""
        return min(self.candidates, key=lambda c: (self.objective(c), c.live_peak, c.source))

    def objective(self, c: Candidate) -> float:
        """What ``auto`` minimises: the predicted seconds, raised by at most
        :data:`TIE_SHARE` in proportion to the bytes the plan moves and recomputes (its
        :attr:`~.candidate.Candidate.traffic` over the most any candidate has). So among
        plans within that share of each other the one with less traffic wins (a plan that
        swaps what it need not, at the same predicted time, loses to one that keeps), while
        the choice stays one fixed order of the candidates: never slower, in this objective,
        with more memory."""
        most = self._most_traffic
        return c.time_s * (1.0 + TIE_SHARE * (c.traffic / most if most else 0.0))

    @cached_property
    def _most_traffic(self) -> int:
        return max((c.traffic for c in self.candidates), default=0)

    def fitting(self, budget: int) -> Candidate | None:
        """The candidate of least :meth:`objective` whose placed peak fits ``budget`` (bytes,
        the persistent state included), or None."""
        for c in sorted(self.candidates,
                        key=lambda c: (self.objective(c), c.live_peak, c.source)):
            if c.live_peak <= budget and c.peak <= budget:
                return c
        return None

    def least_peak(self) -> Candidate:
        """The candidate of least placed peak."""
        return _least_placed(self.candidates)

    def pareto(self) -> list[Candidate]:
        """The candidates no other beats on both peak and :meth:`objective`, by increasing
        peak (placed peaks, computed for the candidates no other beats on live peak and
        objective): the plans ``auto`` chooses among, one per budget range."""
        live: list[Candidate] = []
        for c in sorted(self.candidates, key=lambda c: (c.live_peak, self.objective(c))):
            if not live or self.objective(c) < self.objective(live[-1]):
                live.append(c)
        out: list[Candidate] = []
        for c in sorted(live, key=lambda c: (c.peak, self.objective(c))):
            if not out or self.objective(c) < self.objective(out[-1]):
                out.append(c)
        return out


def fixed_candidates(program: Program, make: Callable[[Program, MemoryConfig], Plan],
                     price: Callable[[Plan], tuple[float, float]]) -> list[Candidate]:
    """Every fixed spec's plan (:func:`fixed_configs`), priced."""
    out: list[Candidate] = []
    seen: set[int] = set()
    for config in fixed_configs(program):
        plan = make(program, config)
        if id(plan) not in seen:  # (specs that make the same plan: priced once, by the first)
            seen.add(id(plan))
            out.append(priced(plan, price, config.spec))
    return out


def program_chain(program: Program, costs: Sequence[float],
                  sizes: dict[int, int] | None = None) -> Chain | None:
    """The program's chain of stages for Rotor's programme, or None (not a chain, or the
    network forces memory choices on blocks: those the fixed specs honour). ``sizes``: the
    program's :func:`least_sizes`, where the caller has them."""
    if block_choices(program):
        return None
    return chain_of(program, list(costs), least_sizes(program) if sizes is None else sizes)


def least_sizes(program: Program) -> dict[int, int]:
    """The bytes the feature maps and stashes a lossless encoding applies to are kept in
    (``binarize`` and ``sparse``, the sizes the planner prices them at)."""
    encoded = compress_program(program, binarize=True, use_sparse=True)
    out = {}
    for st in encoded.steps:
        if st.phase == Phase.ENCODE:
            src = st.op.codec.source
            out[src] = min(out.get(src, 1 << 62), encoded.block_sizes[st.access.writes[0]])
    return out


@dataclass(frozen=True)
class RecomputeBound:
    """A lower bound on the iteration time of every recomputation schedule of a chain at a
    memory budget: Rotor's programme with every figure at its least (module docstring of
    :mod:`.rotor`; no swapping or encoding in it)."""

    table: RotorTable
    base: int  # bytes outside the table's memory: the persistent state and the fed input
    stages: int

    def seconds(self, budget: int) -> float:
        """The bound at ``budget`` bytes (inf: no recomputation schedule fits)."""
        slots = -(-(budget - self.base) // self.table.unit)
        if slots < 0:
            return math.inf
        return float(self.table.cost[(0, self.stages - 1)][min(slots, self.table.slots)])

    def with_swaps(self, budget: int, bandwidth: float, oracle_s: float) -> float:
        """A lower bound on every plan within ``budget``, swaps included. In a plan of ``T``
        seconds, the bytes off the device at any moment were offloaded before it and come
        back after it, over links of ``bandwidth`` each way: at most ``bandwidth * T / 2``.
        Without its swaps the plan fits ``budget + bandwidth * T / 2``, and its compute is
        a recomputation schedule there, no faster than :meth:`seconds` of it; so ``T`` is
        at least the least ``t`` with ``t >= seconds(budget + bandwidth * t / 2)``, and
        never below the oracle's time."""
        cost = self.table.cost[(0, self.stages - 1)]
        unit = self.table.unit
        m0 = max(0, -(-(budget - self.base) // unit))
        if m0 > self.table.slots:
            return max(oracle_s, float(cost[-1]))
        m = np.arange(m0, self.table.slots + 1)
        # the fewest bytes off the device that reach slot m (none for the budget's own slot)
        off = np.maximum(0, (m - 1) * unit + 1 - (budget - self.base))
        off[0] = 0
        lows = np.maximum(cost[m0:], 2 * off / bandwidth)
        return max(oracle_s, float(lows.min()))


#: Memory slots of the lower bound's table (finer than the candidates').
BOUND_SLOTS = 1000


def recompute_bound(program: Program, chain: Chain) -> RecomputeBound:
    least = replace(chain, stages=tuple(replace(s, lean=replace(s.lean, extra=s.lean.least))
                                        for s in chain.stages))
    top = plan_peak(base_plan(program, BASE))
    table = rotor_table(least, max(1, -(-2 * top // BOUND_SLOTS)), BOUND_SLOTS, bound=True)
    first = chain.stages[0]  # (a fed input no backward reads is freed after its last use)
    return RecomputeBound(table, program.persistent_bytes()
                          + (first.sizes.input if first.input_read_back else 0), len(chain))


def rotor_candidates(program: Program, chain: Chain | None, costs: Sequence[float],
                     price: Callable[[Plan], tuple[float, float]]) -> list[Candidate]:
    """Rotor's schedules of the program's chain (module docstring); none without a chain."""
    if chain is None:
        return []
    top = plan_peak(base_plan(program, BASE))
    seen: set[tuple] = set()
    out = []
    for scale in ROTOR_SCALES:
        # (the table reaches twice the plain peak: the programme's figures overestimate)
        table = rotor_table(_scaled(chain, scale),
                            max(1, -(-int(ROTOR_RANGE * top) // ROTOR_SLOTS)),
                            ROTOR_SLOTS)
        least = table.least_slots()
        if least is None:
            continue
        for slots in _levels(table.cost[(0, len(chain) - 1)], least, ROTOR_POINTS):
            ops = tuple(rotor_schedule(table, int(slots)))
            if ops in seen:
                continue
            seen.add(ops)
            plan = base_plan(schedule_program(chain, list(ops)), BASE)
            out.append(priced(plan, price, f"rotor {int(slots)}/{ROTOR_SLOTS} x{scale:g}"))
    return out


def _levels(cost: np.ndarray, least: int, points: int = ROTOR_POINTS) -> list[int]:
    """Memory limits (slots) worth a schedule: the least of each new cost on the table's
    curve, at most about ``points`` of them, spread evenly over the logarithm of the cost
    (dense where the time falls fast with memory, at the low end); the least memory and the
    least time always among them."""
    finite = np.isfinite(cost)
    steps = [m for m in range(least, len(cost))
             if finite[m] and (m == least or cost[m] < cost[m - 1])]
    if len(steps) <= points:
        return steps
    logs = np.log(cost[steps])
    ratio = (logs[0] - logs[-1]) / (points - 1)
    picks, last = [0], logs[0]
    for i in range(1, len(steps) - 1):
        if last - logs[i] >= ratio * (1 - 1e-9):
            picks.append(i)
            last = logs[i]
    picks.append(len(steps) - 1)
    return [steps[i] for i in picks]


def _scaled(chain: Chain, scale: float) -> Chain:
    """The chain with its stages' memory figures scaled (their times as they are)."""
    if scale == 1.0:
        return chain
    stages = tuple(replace(s, sizes=replace(s.sizes, kept=int(s.sizes.kept * scale),
                                            forward_extra=int(s.sizes.forward_extra * scale),
                                            backward_extra=int(s.sizes.backward_extra * scale)))
                   for s in chain.stages)
    return replace(chain, stages=stages)


def build_frontier(program: Program, costs: Sequence[float], bandwidth: float,
                   make: Callable[[Program, MemoryConfig], Plan],
                   step_cost: Callable[[Program, int], float] | None = None) -> Frontier:
    """Every candidate of ``program`` (module docstring), priced with ``costs`` (seconds per
    lowered step) on a link of ``bandwidth`` bytes/s; ``make(program, config)`` plans a
    fixed spec."""
    price = pricer(costs, bandwidth, step_cost)
    sizes = least_sizes(program)
    chain = program_chain(program, costs, sizes)
    cands = fixed_candidates(program, make, price)
    cands += knapsack_candidates(program, costs, price)
    rotor = rotor_candidates(program, chain, costs, price)
    cands += rotor + hidden_swaps(rotor, costs, bandwidth, price)
    cands += swap_down(cands, costs, bandwidth, price)
    cert = time_bound(program, costs, bandwidth, sizes)
    return Frontier(program, cands, sum(costs), chain, bandwidth, cert)


def frontier_plan(program: Program, budget: int | None, costs: Sequence[float],
                  bandwidth: float, make: Callable[[Program, MemoryConfig], Plan],
                  step_cost: Callable[[Program, int], float] | None = None,
                  cost_source: str = "cost model", measured: bool = False) -> Plan:
    """The auto plan for ``budget`` (bytes, the persistent state included; ``None``: the
    fastest): the fastest candidate of the program's frontier whose placed peak fits, with
    static offsets and notes saying what was chosen and what else was on the curve.

    Raises :class:`~.auto.BudgetTooSmall` when no candidate fits."""
    from .auto import BudgetTooSmall  # (auto's greedy walk imports this module's callers)

    fr = build_frontier(program, costs, bandwidth, make, step_cost)
    pick = fr.fastest() if budget is None else fr.fitting(budget)
    if pick is None:
        low = fr.least_peak()
        persistent = program.persistent_bytes()
        raise BudgetTooSmall(
            f"no plan fits the budget of {budget:,} B: the smallest peak the auto planner "
            f"reaches is {low.peak:,} B ({low.peak / 2**20:.1f} MiB: {persistent:,} B of "
            f"parameters, gradients and optimizer state, {low.peak - persistent:,} B of "
            f"feature maps, gradient maps and workspace, with {low.source}); "
            + ("the persistent state alone exceeds the budget" if persistent >= budget
               else "a larger budget, a smaller batch or batch splitting (split=K) would fit"))
    return _noted(fr, pick, budget, cost_source, measured)


def _least_placed(cands: list[Candidate]) -> Candidate:
    """The candidate of least placed peak, placing only those whose live peak (a lower bound
    of the placed one) could still beat the best placed so far."""
    best = None
    for c in sorted(cands, key=lambda c: (c.live_peak, c.time_s)):
        if best is not None and c.live_peak >= best.peak:
            break
        if best is None or c.peak < best.peak:
            best = c
    assert best is not None
    return best


def _noted(fr: Frontier, pick: Candidate, budget: int | None, cost_source: str,
           measured: bool) -> Plan:
    """``pick``'s placed plan with the auto planner's notes and choice."""
    from ..ir.plan import AutoChoice, CurvePoint

    plan = pick.placed
    recomputed = sum(1 for s in plan.program.steps if s.phase == Phase.RECOMPUTE)
    over = 100 * pick.extra_s / fr.oracle_s if fr.oracle_s > 0 else 0.0
    faster = [c for c in fr.candidates if c.time_s < pick.time_s]
    head = (f"auto: budget {budget:,} B; " if budget is not None else "auto without a budget: ")
    note = (f"{head}{pick.source} ({len(plan.swapping.blocks)} feature maps swapped, {recomputed} "
            f"forward steps recomputed); peak {pick.peak:,} B, estimated overhead "
            f"{1000 * pick.extra_s:.2f} ms per iteration ({over:.1f} %, {cost_source}); "
            f"the fastest of {len(fr.candidates)} candidate plans that fits")
    notes = [note]
    if budget is not None and faster:
        nxt = _least_placed(faster)
        notes.append(f"auto: {budget - pick.peak:,} B of the budget left unused: the next "
                     f"faster plan ({nxt.source}, {1000 * nxt.time_s:.2f} ms) needs "
                     f"{nxt.peak:,} B")
    low = fr.lower_bound(budget)
    if low is not None and budget is not None:
        notes.append(
            f"auto: lower bound {1000 * low:.2f} ms per iteration at this budget, over every "
            f"plan of this program (the whole batch: recomputation at any grain, swaps on the "
            f"link, encodings and workspace caps; memory/planners/certificate.py); this plan "
            f"is {100 * max(0.0, pick.time_s / low - 1):.1f} % above it")
    curve = tuple(CurvePoint(c.peak, c.time_s, c.source, _summary(c.plan),
                             fr.lower_bound(c.peak)) for c in fr.pareto())
    choice = AutoChoice(swapped=set(plan.swapping.blocks), dropped=set(), extra_time_s=pick.extra_s,
                        peak=pick.peak, path=[(pick.source, "", pick.peak, pick.extra_s)],
                        curve=curve, lower_bound_s=low, oracle_s=fr.oracle_s)
    plan = plan.with_notes(*notes, first=True)
    return replace(plan, provenance=replace(plan.provenance, measured=measured, auto=choice))


def _summary(plan: Plan) -> str:
    """What a plan does, in a few words."""
    steps = plan.program.steps
    recomputed = sum(1 for s in steps if s.phase == Phase.RECOMPUTE)
    encoded = sum(1 for s in steps if s.phase == Phase.ENCODE)
    parts = [f"{recomputed} forward steps recomputed" if recomputed else "",
             f"{len(plan.swapping.blocks)} feature maps swapped" if plan.swapping.blocks else "",
             f"{encoded} stashes encoded" if encoded else ""]
    return ", ".join(p for p in parts if p) or "everything kept"
