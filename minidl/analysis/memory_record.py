"""Memory snapshots of real runs (PyTorch's ``_record_memory_history`` + ``_snapshot``, for
minidl): :meth:`Trainer.record_memory <minidl.train.trainer.Trainer.record_memory>` keeps, of the
iterations run inside it, the one with the highest peak; :meth:`MemoryRecorder.snapshot`
turns it into plain data (a JSON file), from which come the Chrome / Perfetto trace, the PNG
timeline and the text of :func:`show_memory` (``minidl show-memory FILE``). A ``.pickle`` /
``.pkl`` file gets PyTorch's snapshot format instead (:mod:`minidl.interop.memory_viz`: what
``torch.cuda.memory._dump_snapshot`` writes, for https://pytorch.org/memory_viz).

A snapshot holds every step (layer, phase: forward, backward, recompute, encode, decode; its
compute span in seconds), every block event (alloc, free, prefetch, release: time, step,
category, bytes, tensor and the layer owning it), every plan action applied (offload, await,
... with its start and end), the copies on the host link, the persistent bytes by category,
the peak (bytes, where, by category, the tensors live there) and the device's capacity and
budget. A dry run (the meta device) records the same events in the same order, untimed.

Every block event has its block's address: its offset in the device arena, as the runtime
logged it with the event (``RuntimeRecording.event_offsets``: where the pool placed the block,
or where it was when given back; a GPU's library temporaries that overflow into the arena
are no events and are left out). ``arena`` holds the blocks live when the iteration ended
(the persistent ones: an iteration frees what it allocates) and the span the iteration
used.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from ..compile.engine import Compiled, PeakInfo
from ..interop import memory_viz
from ..interop.memory_viz import SNAPSHOT_FORMAT
from ..memory.devices.traits import device_traits
from ..memory.ir.plan import EFFECTS, ENDING_KINDS
from ..memory.ir.timeline import series, trace, write_chrome_trace, write_json_atomic
from ..memory.ir.units import format_size
from ..memory.ir.walk import Where, walk
from ..memory.runtime.pool import Pool
from ..memory.runtime.recording import RuntimeRecording
from .report import persistent_by_category, plot_timeline

SNAPSHOT_VERSION = 2  # 2: every event's block address and the arena's blocks ("arena")
EVENT_FIELDS = ("time_s", "step", "op", "category", "delta_bytes", "tensor", "layer", "addr")
ACTION_FIELDS = ("start_s", "end_s", "step", "action", "tensor")
BLOCK_FIELDS = ("offset", "bytes", "requested_bytes", "tensor", "category", "layer")


@dataclass
class _Capture:
    """One recorded iteration, as the runtime left it (turned into data only when asked)."""

    compiled: Compiled
    recording: RuntimeRecording
    step_times: list[float]
    peak: PeakInfo
    iteration: int
    timed: bool
    #: The pool when the iteration ended: policy, alignment, capacity and its live blocks as
    #: (offset, size, requested bytes, tag, category), by offset.
    arena: dict[str, Any]


def _arena(pool: Pool) -> dict[str, Any]:
    return {"policy": pool.policy, "alignment": pool.alignment, "capacity": int(pool.capacity),
            "blocks": [(b.offset, b.size, b.nbytes, b.tag, b.category)
                       for b in pool.live_blocks()]}


class MemoryRecorder:
    """What :meth:`Trainer.record_memory` collects: the number of iterations recorded and the
    one with the highest peak (the latest of equal peaks)."""

    def __init__(self, model: str, memory: str, device: str, capacity: int,
                 budget: int | None) -> None:
        self.model, self.memory, self.device = model, memory, device
        self.capacity, self.budget = capacity, budget
        self.iterations = 0
        self._best: _Capture | None = None
        self._snap: tuple[_Capture, dict[str, Any]] | None = None

    def capture(self, c: Compiled, peak: PeakInfo, iteration: int, timed: bool) -> None:
        """Keep iteration ``iteration`` (just run by ``c``'s executor with ``record=True``)
        if its peak is at least the highest so far."""
        self.iterations += 1
        if self._best is None or peak.bytes >= self._best.peak.bytes:
            self._best = _Capture(c, c.executor.last_runtime.recording,
                                  list(c.executor.step_times), peak, iteration, timed,
                                  _arena(c.executor.pool))

    def snapshot(self) -> dict[str, Any]:
        """The recorded iteration with the highest peak as plain data (see module docstring;
        the same dict until another iteration is kept)."""
        if self._best is None:
            raise RuntimeError("no iteration was recorded: train (step / fit) inside "
                               "trainer.record_memory()")
        if self._snap is None or self._snap[0] is not self._best:
            self._snap = (self._best, plain_data(_snapshot(self._best, self)))
        return self._snap[1]

    def save_snapshot(self, path: str | os.PathLike) -> None:
        """Write :meth:`snapshot` (atomically): PyTorch's snapshot pickle for a ``.pickle`` /
        ``.pkl`` path (:mod:`minidl.interop.memory_viz`), minidl's JSON otherwise."""
        save_snapshot(self.snapshot(), path)

    def save_trace(self, path: str | os.PathLike) -> None:
        """Write the Chrome / Perfetto trace of the recorded iteration."""
        write_chrome_trace(os.fspath(path), snapshot_trace(self.snapshot()))

    def save_plot(self, path: str | os.PathLike) -> None:
        """Save the PNG timeline of device bytes by category, with the peak and the budget."""
        plot_snapshot(self.snapshot(), path)


def _compute_spans(cap: _Capture, t0: float) -> list[tuple[float, float]]:
    """Each step's compute (start, end) in seconds from ``t0``: it starts when the step's
    ``before`` actions are done (when the executor moved to the step, if it has none) and
    lasts its measured step time."""
    rt, plan = cap.recording, cap.compiled.plan
    marks = {pos: t for t, pos in rt.step_marks}
    before_ends: dict[int, list[float]] = {}
    for _, end, pos, *_ in rt.actions:
        before_ends.setdefault(pos, []).append(end)
    spans = []
    for visit in walk(plan):
        if visit.where is Where.BEFORE:
            i = visit.step
            ends = before_ends.get(i, [])[:len(visit.actions)]
            start = ends[-1] if ends else marks.get(i, t0)
            spans.append((start - t0, start - t0 + float(cap.step_times[i])))
    return spans


def _copies(cap: _Capture, names: list[str], nbytes: list[int],
            t0: float) -> list[tuple[float, float, str, str, int]]:
    """The host-link copies: queued at their action, run one after another per direction,
    each for its measured duration."""
    lane_free = {"d2h": 0.0, "h2d": 0.0}
    out = []
    for start, _, _, action, tid, copy in cap.recording.actions:
        if copy is None:
            continue
        lane = EFFECTS[action].copy
        begin = max(start - t0, lane_free[lane])
        end = begin + float(copy.elapsed_s or 0.0)
        lane_free[lane] = end
        out.append((begin, end, f"{action} {names[tid]}", lane, nbytes[tid]))
    return out


def _addresses(cap: _Capture) -> tuple[list[int], int]:
    """Every event's block offset, as the runtime logged it (where the pool placed the block,
    or where it was when given back), and the highest end of any block (the arena's span)."""
    rt = cap.recording
    addrs = list(rt.event_offsets)
    if len(addrs) != len(rt.events):
        raise RuntimeError(f"{len(rt.events)} block events but {len(addrs)} offsets logged: "
                           "the recorded iteration is incomplete")
    span = max((off + size for off, size, *_ in cap.arena["blocks"]), default=0)
    for (_, _, op, _, delta, _), off in zip(rt.events, addrs):
        if op not in ENDING_KINDS:
            span = max(span, off + delta)
    return addrs, span


def plain_data(value: Any) -> Any:
    """``value`` with every string subclass (the program's Phase / Role / Category members)
    made a plain ``str``, through dicts, lists and tuples: snapshots pickle as plain data."""
    if isinstance(value, str):
        return str.__str__(value) if type(value) is not str else value
    if isinstance(value, dict):
        return {plain_data(k): plain_data(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(plain_data(v) for v in value)
    return value


def _snapshot(cap: _Capture, rec: MemoryRecorder) -> dict[str, Any]:
    c, rt = cap.compiled, cap.recording
    prog = c.plan.program
    names = [t.name for t in prog.tensors]
    owner = {t.name: t.layer for t in prog.tensors}
    role = {t.name: t.role for t in prog.tensors}
    sizes = [prog.block_size(t.nbytes) for t in prog.tensors]
    times = [a[0] for a in rt.actions] + [e[0] for e in rt.events] + [t for t, _ in rt.step_marks]
    t0 = min(times, default=0.0)
    timed = cap.timed
    spans = _compute_spans(cap, t0) if timed else None
    steps = []
    for i, st in enumerate(prog.steps):
        row: dict[str, Any] = {"index": i, "layer": st.layer, "phase": st.phase, "kind": st.kind,
                               "flops": int(st.cost.flops)}
        if spans is not None:
            row["start_s"], row["end_s"] = spans[i]
        steps.append(row)
    p = cap.peak
    addrs, span = _addresses(cap)
    return {
        "format": SNAPSHOT_FORMAT, "version": SNAPSHOT_VERSION,
        "model": rec.model, "memory": rec.memory, "device": rec.device,
        "capacity_bytes": int(rec.capacity),
        "budget_bytes": None if rec.budget is None else int(rec.budget),
        "iteration": cap.iteration, "iterations_recorded": rec.iterations, "timed": timed,
        "persistent_bytes": persistent_by_category(c),
        "peak": {"bytes": int(p.bytes), "step": p.position, "layer": p.step, "phase": p.phase,
                 "by_category": dict(sorted(p.by_category.items(), key=lambda kv: -kv[1])),
                 "live": [{"tensor": n, "layer": owner.get(n, ""), "role": role.get(n, ""),
                           "category": cat, "bytes": b} for n, cat, b in p.live]},
        "steps": steps,
        "event_fields": list(EVENT_FIELDS),
        "events": [[(t - t0) if timed else None, step, op, cat, delta, name,
                    owner.get(name, ""), addr]
                   for (t, step, op, cat, delta, name), addr in zip(rt.events, addrs)],
        "action_fields": list(ACTION_FIELDS),
        "actions": [[(s - t0) if timed else None, (e - t0) if timed else None, pos, action,
                     names[tid]] for s, e, pos, action, tid, _ in rt.actions],
        "copies": [{"start_s": s, "end_s": e, "name": n, "direction": lane, "bytes": b}
                   for s, e, n, lane, b in _copies(cap, names, sizes, t0)] if timed else [],
        "arena": {"policy": cap.arena["policy"], "alignment": cap.arena["alignment"],
                  "reserved_bytes": span, "block_fields": list(BLOCK_FIELDS),
                  "blocks": [[off, size, nbytes, tag, cat, owner.get(tag, "")]
                             for off, size, nbytes, tag, cat in cap.arena["blocks"]]},
    }


def save_snapshot(snapshot: dict[str, Any], path: str | os.PathLike) -> None:
    """Write ``snapshot`` atomically (a temporary file renamed into place): PyTorch's memory
    snapshot pickle for a ``.pickle`` / ``.pkl`` path
    (:func:`minidl.interop.memory_viz.torch_snapshot`,
    minidl's snapshot inside it), JSON otherwise."""

    if memory_viz.is_pickle_path(path):
        memory_viz.save_torch_snapshot(snapshot, path)
    else:
        write_json_atomic(path, snapshot)


def load_snapshot(path: str | os.PathLike) -> dict[str, Any]:
    """Read a snapshot file (JSON, or a pickle :func:`save_snapshot` wrote); ``ValueError``
    saying what the file is otherwise (PyTorch's own snapshots: how to open them)."""

    path = os.fspath(path)
    if memory_viz.is_pickle_file(path):
        return memory_viz.minidl_snapshot(memory_viz.load_pickle(path), path)
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except UnicodeDecodeError:
        raise ValueError(f"{path} is a binary file, not a minidl memory snapshot") from None
    except json.JSONDecodeError:
        raise ValueError(f"{path} is not JSON, so not a minidl memory snapshot (written by "
                         "minidl train --snapshot or MemoryRecorder.save_snapshot)") from None
    if not isinstance(data, dict) or data.get("format") != SNAPSHOT_FORMAT:
        what = "a Chrome trace" if isinstance(data, dict) and "traceEvents" in data else "JSON"
        raise ValueError(f"{path} is {what}, not a minidl memory snapshot (written by "
                         "minidl train --snapshot or MemoryRecorder.save_snapshot)")
    return data


def _event_tuples(snap: dict[str, Any]) -> list[tuple]:
    """The runtime's (time, step, op, category, delta, tensor) records back from a snapshot
    (untimed snapshots get their step index as time)."""
    return [(e[0] if e[0] is not None else float(e[1]), e[1], e[2], e[3], e[4], e[5])
            for e in snap["events"]]


def snapshot_trace(snap: dict[str, Any]) -> dict[str, Any]:
    """The Chrome / Perfetto trace of a snapshot (:func:`minidl.memory.ir.timeline.trace`): real
    times and copy slices for a recorded run, the steps end to end for a dry run."""
    steps = [(s["layer"], s["phase"], s["kind"], s["flops"]) for s in snap["steps"]]
    events = _event_tuples(snap)
    if not snap["timed"]:
        return trace(events, steps, None, snap["persistent_bytes"])
    spans = [(s["start_s"], s["end_s"]) for s in snap["steps"]]
    copies = [(c["start_s"], c["end_s"], c["name"], c["direction"], c["bytes"])
              for c in snap["copies"]]
    return trace(events, steps, None, snap["persistent_bytes"], spans=spans, copies=copies)


def snapshot_series(snap: dict[str, Any]) -> dict[str, Any]:
    """Device bytes by category after every event (seconds for a recorded run, steps for a
    dry run): what :func:`minidl.analysis.report.plot_timeline` draws."""
    labels = [f"{s['layer']} ({s['phase']})" for s in snap["steps"]]
    return series(_event_tuples(snap), labels, snap["persistent_bytes"], by_step=not snap["timed"])


#: The device's capacity is drawn only when it is at most this many times the peak.
OFF_CHART = 2.0


def plot_snapshot(snap: dict[str, Any], path: str | os.PathLike) -> None:
    """The PNG timeline of a snapshot: stacked bytes by category, the peak, and the budget
    (the device's capacity when the spec sets none)."""
    budget, label = snap["budget_bytes"], "budget"
    p = snap["peak"]
    title = (f"{snap['model']}, memory {snap['memory']!r}, iteration {snap['iteration']} on "
             f"{snap['device']}: peak at {p['layer']} ({p['phase']})")
    if budget is None:
        budget, label = snap["capacity_bytes"], "device memory"
        if budget > OFF_CHART * p["bytes"]:  # (a device far larger would flatten the timeline)
            title += f"; device memory {format_size(budget)}, off the chart"
            budget = None
    plot_timeline(snapshot_series(snap), os.fspath(path), title, budget=budget,
                  budget_label=label)


def _bar(value: int, top: int, width: int = 30) -> str:
    return "#" * (round(width * value / top) if top else 0)


def show_memory(snap: dict[str, Any] | str | os.PathLike, top: int = 10,
                timeline: bool = True) -> str:
    """The text report of a snapshot (or snapshot file): where the peak is, bytes by category
    there, the ``top`` largest tensors live at the peak (with the layer owning each) and, with
    ``timeline``, one line per step with the bytes in use when it ends and its highest."""
    if not isinstance(snap, dict):
        snap = load_snapshot(snap)
    p = snap["peak"]
    room = ("no capacity limit" if snap["device"] == "meta"
            else format_size(snap["capacity_bytes"]))
    lines = [f"{snap['model']}, memory {snap['memory']!r}, {snap['device']} device "
             f"({room}), iteration {snap['iteration']} "
             f"(highest peak of {snap['iterations_recorded']} recorded"
             f"{'' if snap['timed'] else ', dry run: untimed'})"]
    where = f"{p['layer']} ({p['phase']}, program step {p['step']})"
    if snap["timed"] and 0 <= p["step"] < len(snap["steps"]):
        where += f" at {1000 * snap['steps'][p['step']]['start_s']:.2f} ms"
    lines.append(f"peak {format_size(p['bytes'])} ({p['bytes']:,} B) reached at {where}")
    if snap["budget_bytes"] is not None:
        lines.append(f"budget {format_size(snap['budget_bytes'])}: "
                     f"{'fits' if p['bytes'] <= snap['budget_bytes'] else 'OVER'}")
    lines.append("bytes by category at the peak:")
    for cat, b in p["by_category"].items():
        lines.append(f"  {cat:<18}{format_size(b):>12}  {100 * b / max(p['bytes'], 1):5.1f}%")
    rows = p["live"][:top]
    name_w = max([len("tensor")] + [len(r["tensor"]) for r in rows]) + 2
    layer_w = max([len("layer")] + [len(r["layer"]) for r in rows]) + 2
    lines.append(f"largest tensors live at the peak ({len(rows)} of {len(p['live'])}):")
    lines.append(f"  {'tensor':<{name_w}}{'layer':<{layer_w}}{'category':<16}{'bytes':>12}"
                 f"{'of peak':>9}")
    for r in rows:
        lines.append(f"  {r['tensor']:<{name_w}}{r['layer']:<{layer_w}}{r['category']:<16}"
                     f"{format_size(r['bytes']):>12}{100 * r['bytes'] / max(p['bytes'], 1):8.1f}%")
    copies = snap.get("copies") or []
    if copies:
        out = sum(c["bytes"] for c in copies if c["direction"] == "d2h")
        back = sum(c["bytes"] for c in copies if c["direction"] == "h2d")
        lines.append(f"host link: {format_size(out)} offloaded, {format_size(back)} prefetched "
                     f"in {len(copies)} copies")
    if timeline:
        lines += _timeline_lines(snap)
    return "\n".join(lines)


def _timeline_lines(snap: dict[str, Any]) -> list[str]:
    """One line per step: bytes in use when it ends and the most during it."""
    current = sum(snap["persistent_bytes"].values())
    n = len(snap["steps"])
    end = [0] * n
    high = [0] * n
    by_step: dict[int, list[int]] = {}
    for e in snap["events"]:
        by_step.setdefault(e[1], []).append(e[4])
    for d in by_step.get(-1, []):
        current += d
    for i in range(n):
        high[i] = current
        for d in by_step.get(i, []):
            current += d
            high[i] = max(high[i], current)
        end[i] = current
    peak = max(high, default=0)
    layer_w = max([len("layer")] + [len(s["layer"]) for s in snap["steps"]]) + 2
    timed = snap["timed"]
    out = ["timeline (bytes in use at the end of each step; * marks the peak):",
           f"  {'step':>5}{format('ms', '>9') if timed else ''}  {'layer':<{layer_w}}{'phase':<11}"
           f"{'in use':>12}{'highest':>12}"]
    # the step the peak is reached at (the first of equal highs when the snapshot has none)
    at = snap["peak"].get("step")
    if at not in {s["index"] for s in snap["steps"]}:
        at = next((s["index"] for s, h in zip(snap["steps"], high) if h == peak), None)
    for s, e, h in zip(snap["steps"], end, high):
        ms = f"{1000 * s['start_s']:9.2f}" if timed else ""
        mark = "*" if s["index"] == at else " "
        out.append(f"  {s['index']:>5}{ms}  {s['layer']:<{layer_w}}{s['phase']:<11}"
                   f"{format_size(e):>12}{format_size(h):>12} {mark}{_bar(h, peak)}")
    return out


def plan_snapshot(c: Compiled, peak: PeakInfo, path: str | os.PathLike, *, model: str,
                  memory: str, budget: int | None = None) -> dict[str, Any]:
    """Write the memory snapshot of a dry run's iteration (``c`` just run with
    ``record=True``, on the meta device; ``peak`` its ``engine.peak_info(c)``): torch's pickle
    for a ``.pickle`` / ``.pkl`` path, minidl's JSON otherwise. Returns the minidl snapshot."""
    pool = c.executor.pool
    rec = MemoryRecorder(model, memory, device_traits(pool.device).name, pool.capacity,
                         budget)
    rec.capture(c, peak, 0, timed=False)
    snap = rec.snapshot()
    save_snapshot(snap, path)
    return snap
