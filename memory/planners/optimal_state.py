"""The MILP of :mod:`.optimal_model` under construction: :class:`Lp` (variables, sparse rows,
objective) and :class:`ModelState`, the variable index maps and per-position memory terms its
constraint families share."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
from scipy.sparse import csr_array

from .optimal_facts import ProgramFacts

#: Objective added per decision (in iterations): among equal estimated times, fewer actions.
EPS_ACTION = 1e-9

#: A row's terms: (variable, coefficient) pairs.
Terms = list[tuple[int, float]]


class Lp:
    """Variables, a sparse constraint matrix and the objective of a mixed-integer program."""

    def __init__(self) -> None:
        self.lb: list[float] = []
        self.ub: list[float] = []
        self.integer: list[int] = []
        self.cost: list[float] = []
        self.rows: list[tuple[Terms, float, float]] = []
        self.names: list[str] = []

    def var(self, ub: float = 1.0, integer: bool = False, cost: float = 0.0,
            name: str = "") -> int:
        """Add a variable in ``[0, ub]``; returns its index."""
        self.names.append(name)
        self.lb.append(0.0)
        self.ub.append(ub)
        self.integer.append(1 if integer else 0)
        self.cost.append(cost)
        return len(self.lb) - 1

    def ge(self, terms: Terms, rhs: float) -> int:
        """Add ``sum(coef * x) >= rhs``; returns the row."""
        self.rows.append((terms, rhs, math.inf))
        return len(self.rows) - 1

    def le(self, terms: Terms, rhs: float) -> int:
        """Add ``sum(coef * x) <= rhs``; returns the row."""
        self.rows.append((terms, -math.inf, rhs))
        return len(self.rows) - 1

    def matrix(self) -> csr_array:
        """The rows as a sparse matrix (variables as columns)."""
        data, ri, ci = [], [], []
        for r, (terms, _, _) in enumerate(self.rows):
            for c, v in terms:
                ri.append(r)
                ci.append(c)
                data.append(v)
        return csr_array((data, (ri, ci)), shape=(len(self.rows), len(self.lb)))


#: "Step f and step f itself are in one segment": always true, no variable.
SAME_STEP = "one"
#: A segment's indicator: a variable, :data:`SAME_STEP`, or None (never one segment).
Segment = int | str | None


@dataclass
class Pricing:
    """How the objective prices the decisions (in the units of the step costs)."""

    step_costs: list[float]  # per step: its recomputation
    swap_cost: dict[int, float]  # per swap candidate: its unhidden transfer time
    copy_cost: dict[int, float]  # per swap candidate: one transfer's time
    early_release: bool  # a swapped block away from one step after its offload


@dataclass
class RecomputeGroups:
    """The recomputation groups' variables and what their regions hold."""

    need: dict[int, dict[int, int]] = field(default_factory=dict)  # step -> group end -> var
    #: per group end (a kept step): the clones its recomputation makes, (step, tensor, variable)
    clones: dict[int, list[tuple[int, int, int]]] = field(default_factory=dict)
    #: per region position: blocks a recomputation there reads (memory units, live-at-the-
    #: region var, live-after var or None, last step of the region that may read it)
    region_reads: dict[int, list[tuple[float, int, int | None, int]]] = field(
        default_factory=dict)


@dataclass
class SwapWindows:
    """Per swap candidate, the steps its copies run within."""

    compute: dict[int, tuple[int, int]] = field(default_factory=dict)  # (last fwd, 1st bwd)
    #: (last forward, release) and (prefetch, first backward): its copy on each engine runs
    #: within that window or compute stalls
    engines: dict[int, tuple[tuple[int, int], tuple[int, int]]] = field(default_factory=dict)


@dataclass
class Counts:
    """Sizes of the model's families, for its stats."""

    need_rows: int = 0
    clones: int = 0
    chain: int = 0


@dataclass
class ModelState:
    """What the constraint families of :func:`.optimal_model.build_model` build together, in
    the order they run (variables are numbered as they are made, rows as they are added)."""

    facts: ProgramFacts
    pricing: Pricing
    lp: Lp = field(default_factory=Lp)
    drop: dict[int, int] = field(default_factory=dict)  # droppable step -> d variable
    swap: dict[int, int] = field(default_factory=dict)  # candidate -> s variable
    runs: dict[tuple[int, int], int] = field(default_factory=dict)  # (f, g) -> segment var
    groups: RecomputeGroups = field(default_factory=RecomputeGroups)
    swap_windows: SwapWindows = field(default_factory=SwapWindows)
    #: per node: the "its region runs one step / two steps" indicators
    #: (:func:`.optimal_liveness.region_steps`)
    region_indicators: dict[int, tuple[int | None, int | None]] = field(default_factory=dict)
    counts: Counts = field(default_factory=Counts)

    def __post_init__(self) -> None:
        npos = len(self.facts.positions.order)
        #: per position: the decision-dependent blocks' terms, and the clones' terms
        self.mem_terms: list[Terms] = [[] for _ in range(npos)]
        self.clone_terms: list[Terms] = [[] for _ in range(npos)]
        #: bytes no decision changes, as differences (prefix sums give each position's)
        self.const = np.zeros(npos + 1, dtype=np.int64)

    def add_const(self, q0: int, q1: int, nbytes: int) -> None:
        """``nbytes`` live at positions ``q0..q1`` inclusive, whatever the decisions."""
        if q1 >= q0:
            self.const[q0] += nbytes
            self.const[q1 + 1] -= nbytes
