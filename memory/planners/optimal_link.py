"""The swaps' time in the MILP of :mod:`.optimal_model`: one variable at least the sum of the
swaps' own unhidden transfer times (Capuchin) and at least the congestion of the link wherever
several copies must share an interval of compute."""

from __future__ import annotations

import math

from .optimal_state import EPS_ACTION, Lp

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
    solutions exactly (:func:`.optimal_solve.price_cut`)."""
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
