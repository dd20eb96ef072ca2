"""A lower bound on the iteration time of every plan of a program within a budget: the
certificate ``auto`` reports beside its plan.

The argument is one step at a time. Under the liveness every ``auto`` plan starts from
(``reuse,inplace``: each block freed after its last use, outputs in place), the blocks live
during step ``s`` are those written before it and read at or after it. A plan within
``budget`` holds at most ``budget - persistent`` bytes then, so it must have taken the rest,
``D_s``, off the device by some means:

* for free: a convolution's (or attention's, or a fused RNN's) workspace capped to nothing,
  a stash encoded to its least size (``binarize`` / ``sparse``) — the bound assumes no cost;
* swapped to the host: in a plan of ``T`` seconds at most ``bandwidth * T / 2`` bytes are off
  the device at any moment (each went out before and comes back after it, over links of
  ``bandwidth`` each way);
* dropped and recomputed: each dropped block costs at least one more run of the forward step
  that wrote it (its cost, whatever else a recomputation needs); the cheapest way to drop
  ``x`` bytes is then at most the fractional knapsack of the droppable blocks by cost per
  byte (a lower bound on any integral choice).

What step ``s`` itself reads and writes must be on the device whole (less what its own
workspace cap frees); gradient maps and fed inputs are never recomputed (inputs may be
swapped). So ``T >= oracle + knapsack_s(D_s - free_s - bandwidth * T / 2)`` for every ``s``,
and the least such ``T`` bounds every plan the engine can run for this program: recomputation
inside or across stages, swaps of whole or partial sets of tensors, encodings and per-op
workspace caps included. A batch split into micro-batches is another program, not covered
(the engine reports no certificate for a split plan).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from ..ir.liveness import root_of
from ..ir.names import Category, Phase
from ..ir.program import Program
from ..passes.base_plan import base_plan
from .candidate import BASE
from .floor import VARIANT_OPTIONS

#: Categories whose blocks a plan may drop and recompute (from the forward step writing them).
_RECOMPUTABLE = frozenset({Category.FEATURE_MAP, Category.STASH})
#: Bisection steps of the fixed point (relative precision about 2**-60 of the range).
_ITERATIONS = 60


@dataclass(frozen=True)
class _StepNeed:
    """At one step: the bytes over the room to shed (before the budget), the bytes shed for
    free, and the droppable blocks' cumulative bytes and costs by increasing cost per byte."""

    live: int
    free: int
    #: Bytes a swap could take off the device here (what the step does not touch).
    movable: int
    cum_bytes: np.ndarray
    cum_cost: np.ndarray


@dataclass(frozen=True)
class TimeBound:
    """:func:`time_bound`'s figures for one program (module docstring)."""

    oracle_s: float
    persistent: int
    bandwidth: float
    needs: tuple[_StepNeed, ...]

    @cached_property
    def _table(self) -> tuple[np.ndarray, ...]:
        """The steps' figures as arrays: bytes over the room less the free ones, movable
        bytes, and the knapsack curves padded with their last point to one width."""
        width = max((len(n.cum_bytes) for n in self.needs), default=1)

        def padded(rows: list[np.ndarray]) -> np.ndarray:
            out = np.zeros((len(rows), width))
            for i, r in enumerate(rows):
                out[i, :len(r)] = r
                out[i, len(r):] = r[-1]
            return out

        over = np.array([float(n.live - n.free) for n in self.needs])
        movable = np.array([float(n.movable) for n in self.needs])
        return over, movable, padded([n.cum_bytes for n in self.needs]), \
            padded([n.cum_cost for n in self.needs])

    def _extra(self, room: int, t: float) -> float:
        """The least recomputation seconds every step's shortfall needs with ``room`` bytes
        free and a plan of ``t`` seconds (inf where dropping cannot cover it)."""
        if not self.needs:
            return 0.0
        swap = self.bandwidth * t / 2 if math.isfinite(self.bandwidth) else math.inf
        over, movable, cum_b, cum_c = self._table
        short = over - room - np.minimum(swap, movable)
        rows = np.flatnonzero(short > 0)
        if rows.size == 0:
            return 0.0
        short, b, c = short[rows], cum_b[rows], cum_c[rows]
        if np.any(short > b[:, -1]):
            return math.inf
        # each row's knapsack curve at its shortfall (np.interp, row by row)
        k = np.minimum((b < short[:, None]).sum(axis=1), b.shape[1] - 1)
        at = np.arange(rows.size)
        b0, b1, c0, c1 = b[at, k - 1], b[at, k], c[at, k - 1], c[at, k]
        span = b1 - b0
        frac = np.divide(short - b0, span, out=np.ones_like(span), where=span > 0)
        return float(np.max(c0 + frac * (c1 - c0)))

    def seconds(self, budget: int) -> float:
        """The least iteration seconds of any plan within ``budget`` bytes (the persistent
        state included); inf where no plan fits it."""
        room = budget - self.persistent
        if room < 0:
            return math.inf
        lo = self.oracle_s
        if self._extra(room, lo) == 0.0:
            return lo
        hi = 2 * lo if lo > 0 else 1e-6
        while lo + self._extra(room, hi) > hi:
            hi *= 2
            if hi > 1e6 * max(lo, 1e-6):
                return math.inf  # (no swap allowance makes it fit: nothing does)
        a, b = lo, hi  # g(T) = oracle + extra(T) - T: positive at a, at most 0 at b
        for _ in range(_ITERATIONS):
            mid = 0.5 * (a + b)
            if self.oracle_s + self._extra(room, mid) > mid:
                a = mid
            else:
                b = mid
        return b


def time_bound(program: Program, costs: Sequence[float], bandwidth: float,
               least_sizes: dict[int, int] | None = None) -> TimeBound:
    """The certificate of ``program`` (module docstring): ``costs`` seconds per lowered step
    (the oracle is their sum), a link of ``bandwidth`` bytes/s each way, ``least_sizes``
    the bytes a lossless encoding keeps of a tensor (:func:`.frontier.least_sizes`)."""
    plan = base_plan(program, BASE)
    aliases = plan.aliases
    sizes = program.block_sizes
    tensors = program.tensors
    least = least_sizes or {}
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    writer: dict[int, int] = {}  # a block's forward writer (what recomputing it reruns)
    for i, st in enumerate(program.steps):
        for t in (*st.access.writes, *st.access.reads):
            if tensors[t].persistent:
                continue
            r = root_of(aliases, t)
            first.setdefault(r, i)
            last[r] = max(last.get(r, i), i)
        if st.phase == Phase.FORWARD:
            for t in st.access.writes:
                if not tensors[t].persistent and root_of(aliases, t) == t:
                    writer.setdefault(t, i)
    roots = sorted(first)
    starts = np.array([first[r] for r in roots])
    ends = np.array([last[r] for r in roots])
    needs = []
    for s, st in enumerate(program.steps):
        pinned = {root_of(aliases, t) for t in (*st.access.reads, *st.access.writes)
                  if not tensors[t].persistent}
        own_ws = st.access.workspace if st.access.workspace >= 0 else -1
        live_idx = np.flatnonzero((starts <= s) & (ends >= s))
        live = free = movable = 0
        drops: list[tuple[float, int]] = []
        for k in live_idx:
            r = roots[k]
            size = sizes[r]
            live += size
            if r == own_ws and st.op.caps.options & VARIANT_OPTIONS:
                free += size  # (its own workspace, capped to nothing)
                continue
            if r in pinned:
                continue
            kept = size
            if r in least:  # encoded to its least size for free (the bound's assumption)
                kept = min(size, program.block_size(least[r]))
                free += size - kept
            movable += kept
            if tensors[r].category in _RECOMPUTABLE and r in writer:
                drops.append((float(costs[writer[r]]), kept))
        drops.sort(key=lambda d: d[0] / d[1] if d[1] else 0.0)
        cum_b = np.concatenate([[0.0], np.cumsum([b for _, b in drops], dtype=float)])
        cum_c = np.concatenate([[0.0], np.cumsum([c for c, _ in drops], dtype=float)])
        needs.append(_StepNeed(live, free, movable, cum_b, cum_c))
    return TimeBound(float(sum(costs)), program.persistent_bytes(), bandwidth, tuple(needs))
