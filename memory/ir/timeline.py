"""Where the bytes went over one iteration: device bytes by category through time, as data,
as a Chrome/Perfetto trace, and (with matplotlib) as a stacked-area PNG."""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

from .program import Program


def category_series(events: list[tuple], program: Program, base: dict[str, int] | None = None,
                    by_step: bool = True) -> dict[str, Any]:
    """:func:`series` of ``program``'s steps."""
    return series(events, [f"{s.layer} ({s.phase})" for s in program.steps], base, by_step)


def series(events: list[tuple], step_labels: list[str], base: dict[str, int] | None = None,
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
    return {"x": xs, "bytes": ys, "step_labels": list(step_labels),
            "axis": "step" if by_step else "seconds"}


def _events_per_step(events: list[tuple]) -> dict[int, int]:
    counts: dict[int, int] = {}
    for ev in events:
        counts[ev[1]] = counts.get(ev[1], 0) + 1
    return counts


#: Trace threads of the device process: (tid, name).
COMPUTE_TID, EVENTS_TID, D2H_TID, H2D_TID = 1, 2, 3, 4
_THREADS = ((COMPUTE_TID, "compute"), (EVENTS_TID, "memory events"),
            (D2H_TID, "copy device to host"), (H2D_TID, "copy host to device"))


def chrome_trace(events: list[tuple], program: Program, step_times: list[float] | None = None,
                 base: dict[str, int] | None = None) -> dict[str, Any]:
    """:func:`trace` of ``program``'s steps (a dry run's, or one iteration laid out by its
    measured step times)."""
    steps = [(st.layer, st.phase, st.kind, st.cost.flops) for st in program.steps]
    return trace(events, steps, step_times, base)


def trace(events: list[tuple], steps: list[tuple[str, str, str, int]],
          step_times: list[float] | None = None, base: dict[str, int] | None = None,
          spans: list[tuple[float, float]] | None = None,
          copies: list[tuple[float, float, str, str, int]] | None = None) -> dict[str, Any]:
    """A Chrome / Perfetto trace of one iteration: named threads ``compute`` (one slice per
    step: layer, phase, kind), ``memory events`` (an instant per block event) and the two copy
    directions; the ``device bytes`` counter holds one series per category (Perfetto draws
    one track per category, Chrome a stacked counter).

    ``steps`` are (layer, phase, kind, flops). With ``spans`` (each step's compute (start,
    end) in seconds, on the clock of the events' times: a recorded real run) every event sits
    at its own time and ``copies`` (start, end, name, ``"d2h"`` or ``"h2d"``, bytes) are
    slices on the copy threads. Without, the steps are laid end to end with ``step_times``
    (or one unit each) and the ``j``-th of a step's ``m`` events at ``j / m`` of the way
    through its slice; events before the first step (``step < 0``) and after the last in
    slices of their own ("setup", "end"). Timestamps are microseconds, increasing per track.
    """
    out: list[dict[str, Any]] = [{"ph": "M", "name": "process_name", "pid": 1,
                                  "args": {"name": "minidl device"}}]
    for tid, name in _THREADS:
        out.append({"ph": "M", "name": "thread_name", "pid": 1, "tid": tid,
                    "args": {"name": name}})
        out.append({"ph": "M", "name": "thread_sort_index", "pid": 1, "tid": tid,
                    "args": {"sort_index": tid}})
    if spans is not None:
        t0 = min([e[0] for e in events[:1]] + [s for s, _ in spans[:1]]
                 + [c[0] for c in copies or []])
        starts = [(s - t0) * 1e6 for s, _ in spans]
        durations = [max(e - s, 0.0) * 1e6 for s, e in spans]
        times = [(e[0] - t0) * 1e6 for e in events]
    else:
        starts, durations = _layout(len(steps), step_times)
        times = _event_times(events, starts, durations)
    for (layer, phase, kind, flops), s, d in zip(steps, starts, durations):
        out.append({"name": layer, "cat": phase, "ph": "X", "ts": s, "dur": d, "pid": 1,
                    "tid": COMPUTE_TID, "args": {"phase": phase, "kind": kind, "flops": flops}})
    for start, end, name, lane, nbytes in copies or []:
        out.append({"name": name, "cat": "copy", "ph": "X", "ts": (start - t0) * 1e6,
                    "dur": max(end - start, 0.0) * 1e6, "pid": 1,
                    "tid": D2H_TID if lane == "d2h" else H2D_TID, "args": {"bytes": nbytes}})
    current = {c: 0 for c in sorted({e[3] for e in events})}  # every category's track at once
    current.update(base or {})
    for ev, ts in zip(events, times):
        _, step, op, cat, delta, name = ev
        current[cat] = current.get(cat, 0) + delta
        out.append({"name": "device bytes", "ph": "C", "ts": ts, "pid": 1,
                    "args": dict(current)})
        out.append({"name": f"{op} {name}", "ph": "i", "s": "t", "ts": ts, "pid": 1,
                    "tid": EVENTS_TID, "args": {"category": cat, "bytes": abs(delta),
                                                "step": step}})
    return {"traceEvents": out, "displayTimeUnit": "ms"}


def _layout(n: int, step_times: list[float] | None) -> tuple[list[float], list[float]]:
    """Steps end to end (microseconds) after a setup slice: measured durations, or 1 ms."""
    if step_times is not None and len(step_times) == n and sum(step_times) > 0:
        durations = [float(d) * 1e6 for d in step_times]
    else:
        durations = [1000.0] * n
    unit = max(min(durations, default=1000.0), 1.0)  # the setup and end slices' length
    starts, t = [], unit
    for d in durations:
        starts.append(t)
        t += d
    return starts, durations


def _event_times(events: list[tuple], starts: list[float], durations: list[float]) -> list[float]:
    """Distinct increasing times for events laid out in their steps' slices."""
    n = len(starts)
    unit = max(min(durations, default=1000.0), 1.0)
    end = (starts[-1] + durations[-1]) if n else unit
    per_step = _events_per_step(events)
    seen: dict[int, int] = {}
    out = []
    for ev in events:
        step = ev[1]
        j = seen.get(step, 0)
        seen[step] = j + 1
        if step < 0:
            s0, d0 = 0.0, unit
        elif step >= n:
            s0, d0 = end, unit
        else:
            s0, d0 = starts[step], durations[step]
        out.append(s0 + d0 * j / per_step[step])
    return out


def write_chrome_trace(path: str, trace: dict[str, Any]) -> None:
    """Write ``trace`` as JSON, atomically."""
    write_json_atomic(path, trace)


def write_json_atomic(path: str | os.PathLike, data: Any) -> None:
    """Write ``data`` as JSON, atomically (a temporary file renamed into place)."""
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(suffix=".json", dir=folder)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
        # the mode of a file open() makes (0666 less the umask), not mkstemp's private 0600
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
