"""Where the bytes went over one iteration: device bytes by category through time, as data,
as a Chrome/Perfetto trace, and (with matplotlib) as a stacked-area PNG."""

from __future__ import annotations

import json
from typing import Any

from .program import Program


def category_series(events: list[tuple], program: Program, base: dict[str, int] | None = None,
                    by_step: bool = True) -> dict[str, Any]:
    """Cumulative bytes per category after every block event.

    ``events`` are the runtime's (time, step, op, category, delta, tensor) records; ``base``
    the bytes already allocated (persistent state) per category. One point per event, so no
    value within a step hides another (the peak is a point). The x axis is the step index
    (``by_step``; meta dry runs have no meaningful time), the ``j``-th of a step's ``m`` events
    at ``step + j / m``, or seconds from the first event.
    """
    current = dict(base or {})
    cats = sorted({e[3] for e in events} | set(current))
    xs: list[float] = []
    ys: dict[str, list[int]] = {c: [] for c in cats}
    t0 = events[0][0] if events else 0.0
    per_step = _events_per_step(events)
    seen: dict[int, int] = {}
    for ev in events:
        t, step, _, cat, delta, _ = ev
        current[cat] = current.get(cat, 0) + delta
        j = seen.get(step, 0)
        seen[step] = j + 1
        xs.append(step + j / per_step[step] if by_step else t - t0)
        for c in cats:
            ys[c].append(current.get(c, 0))
    labels = [f"{s.layer} ({s.phase})" for s in program.steps]
    return {"x": xs, "bytes": ys, "step_labels": labels,
            "axis": "step" if by_step else "seconds"}


def _events_per_step(events: list[tuple]) -> dict[int, int]:
    counts: dict[int, int] = {}
    for ev in events:
        counts[ev[1]] = counts.get(ev[1], 0) + 1
    return counts


def chrome_trace(events: list[tuple], program: Program, step_times: list[float] | None = None,
                 base: dict[str, int] | None = None) -> dict[str, Any]:
    """A Chrome / Perfetto trace: one counter track of device bytes per category, and one
    slice per step (with its measured duration, or one unit per step for a dry run).

    Events get distinct, increasing timestamps: the ``j``-th of a step's ``m`` events at
    ``j / m`` of the way through its slice; events before the first step (``step < 0``) and
    after the last in slices of their own ("setup", "end")."""
    trace: list[dict[str, Any]] = []
    current = dict(base or {})
    if step_times is not None and len(step_times) == len(program.steps) and sum(step_times) > 0:
        durations = [float(d) * 1e6 for d in step_times]
    else:
        durations = [1000.0] * len(program.steps)
    unit = max(min(durations, default=1000.0), 1.0)  # the setup and end slices' length
    starts, t = [], unit
    for d in durations:
        starts.append(t)
        t += d
    for st, s, d in zip(program.steps, starts, durations):
        trace.append({"name": st.layer, "cat": st.phase, "ph": "X", "ts": s, "dur": d,
                      "pid": 1, "tid": 1, "args": {"kind": st.kind, "flops": st.flops}})
    n = len(program.steps)
    per_step = _events_per_step(events)
    seen: dict[int, int] = {}
    for ev in events:
        _, step, op, cat, delta, name = ev
        current[cat] = current.get(cat, 0) + delta
        j = seen.get(step, 0)
        seen[step] = j + 1
        if step < 0:
            s0, d0 = 0.0, unit
        elif step >= n:
            s0, d0 = t, unit
        else:
            s0, d0 = starts[step], durations[step]
        ts = s0 + d0 * j / per_step[step]
        trace.append({"name": "device bytes", "ph": "C", "ts": ts, "pid": 1,
                      "args": {c: v for c, v in current.items()}})
        trace.append({"name": f"{op} {name}", "ph": "i", "s": "t", "ts": ts, "pid": 1,
                      "tid": 2, "args": {"category": cat, "bytes": abs(delta)}})
    return {"traceEvents": trace, "displayTimeUnit": "ms"}


def write_chrome_trace(path: str, trace: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(trace, f)
