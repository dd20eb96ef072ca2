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
    the bytes already allocated (persistent state) per category. The x axis is the step index
    (``by_step``; meta dry runs have no meaningful time) or seconds from the first event.
    """
    current = dict(base or {})
    cats = sorted({e[3] for e in events} | set(current))
    xs: list[float] = []
    ys: dict[str, list[int]] = {c: [] for c in cats}
    t0 = events[0][0] if events else 0.0
    for ev in events:
        t, step, _, cat, delta, _ = ev
        current[cat] = current.get(cat, 0) + delta
        xs.append(float(step) if by_step else t - t0)
        for c in cats:
            ys[c].append(current.get(c, 0))
    labels = [f"{s.layer} ({s.phase})" for s in program.steps]
    return {"x": xs, "bytes": ys, "step_labels": labels,
            "axis": "step" if by_step else "seconds"}


def chrome_trace(events: list[tuple], program: Program, step_times: list[float] | None = None,
                 base: dict[str, int] | None = None) -> dict[str, Any]:
    """A Chrome / Perfetto trace: one counter track of device bytes per category, and one
    slice per step (with its measured duration, or one unit per step for a dry run)."""
    trace: list[dict[str, Any]] = []
    current = dict(base or {})
    if step_times is not None and len(step_times) == len(program.steps) and sum(step_times) > 0:
        starts, t = [], 0.0
        for d in step_times:
            starts.append(t)
            t += float(d) * 1e6
        durations = [float(d) * 1e6 for d in step_times]
    else:
        starts = [float(i) * 1000.0 for i in range(len(program.steps))]
        durations = [1000.0] * len(program.steps)
    for st, s, d in zip(program.steps, starts, durations):
        trace.append({"name": st.layer, "cat": st.phase, "ph": "X", "ts": s, "dur": d,
                      "pid": 1, "tid": 1, "args": {"kind": st.kind, "flops": st.flops}})
    n = len(program.steps)
    for ev in events:
        _, step, op, cat, delta, name = ev
        current[cat] = current.get(cat, 0) + delta
        idx = min(max(step, 0), n - 1) if n else 0
        ts = starts[idx] + (durations[idx] if step >= n else 0.0) if n else 0.0
        trace.append({"name": "device bytes", "ph": "C", "ts": ts, "pid": 1,
                      "args": {c: v for c, v in current.items()}})
        trace.append({"name": f"{op} {name}", "ph": "i", "s": "t", "ts": ts, "pid": 1,
                      "tid": 2, "args": {"category": cat, "bytes": abs(delta)}})
    return {"traceEvents": trace, "displayTimeUnit": "ms"}


def write_chrome_trace(path: str, trace: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(trace, f)
