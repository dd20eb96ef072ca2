"""What :meth:`Trainer.memory_report <minidl.train.trainer.Trainer.memory_report>` says: the
pool's peaks, where the training iteration peaked and what was live there, swapping, the
plan's strategies and notes."""

from __future__ import annotations

from typing import Any

from ...analysis.report import strategy_costs
from ...compile.engine import Compiled, Engine, PeakInfo
from ...memory.ir.units import format_size


def memory_report(trainer: Any) -> dict[str, Any]:
    """``trainer``'s report (a :class:`~minidl.train.trainer.Trainer`): peak allocated and
    reserved bytes, bytes by category at the peak, and where."""
    s = trainer.pool.stats()
    rep: dict[str, Any] = {
        "device": trainer.device.name,
        "capacity_bytes": s["capacity"],
        "memory": trainer.config.spec,
        "peak_allocated_bytes": s["allocated_bytes.peak"],
        "peak_reserved_bytes": s["reserved_bytes.peak"],
        "num_ooms": s["num_ooms"],
    }
    if trainer.observed.peak is not None:
        rep.update(peak_entries(trainer.observed.peak))
    if trainer.swap_stats:
        rep["swap"] = dict(trainer.swap_stats)
        rep["swap"]["cache_fallbacks"] = trainer.observed.cache_fallbacks
    if trainer.observed.last_split > 1:
        rep["split"] = trainer.observed.last_split
    if trainer.link_emulation is not None:
        rep["link_emulation"] = trainer.link_emulation.as_dict()
    c = trainer.last_compiled
    if c is not None:
        rep.update(plan_entries(trainer.engine, c))
    outside = getattr(trainer.device, "outside_arena", None)
    if outside is not None and trainer.engine.compute:
        rep["outside_arena"] = outside()
    if trainer.config.zero >= 2 and trainer.observed.peak is not None and c is not None:
        note = zero_peak_note(trainer.config.zero, trainer.observed.peak, c.lowered.program)
        if note:
            rep.setdefault("notes", []).append(note)
    if trainer.observed.eval_peak is not None:
        add_evaluation_peak(rep, trainer.observed.eval_peak, trainer.observed.peak,
                            s["allocated_bytes.peak"])
    if trainer.observed.eval_splits:
        rep.setdefault("notes", []).append(
            f"evaluation: {trainer.observed.eval_splits} batch(es) did not fit the device memory "
            "and ran in halves")
    return rep


def peak_entries(peak: PeakInfo) -> dict[str, Any]:
    """The training iteration's peak: its bytes, its step, the bytes by category, the five
    largest tensors live there."""
    return {
        "iteration_peak_bytes": peak.bytes,
        "peak_step": {"layer": peak.step, "phase": peak.phase, "index": peak.position},
        "breakdown": dict(sorted(peak.by_category.items(), key=lambda kv: -kv[1])),
        "largest_live": [{"tensor": n, "category": c, "bytes": b} for n, c, b in peak.live[:5]],
    }


def plan_entries(engine: Engine, c: Compiled) -> dict[str, Any]:
    """The last compiled step's strategies, plan notes and device temporaries."""
    rep = strategy_costs(c)
    rep["notes"] = list(c.plan.notes)
    if c.executor.temporaries is not None:
        t = c.executor.temporaries
        rep["device_temporaries"] = {
            "scratch_bytes": 0 if engine.scratch is None else engine.scratch.size,
            "footprint_bytes": t.footprint, "peak_live_bytes": t.peak_live,
            "overflow_bytes": t.overflow_bytes}
    return rep


def add_evaluation_peak(rep: dict[str, Any], eval_peak: tuple[int, int],
                        peak: PeakInfo | None, allocated_peak: int) -> None:
    """The highest evaluation batch's peak and size into ``rep``, with a note when it is
    above the training iteration's (then it set the pool's peak)."""
    rep["evaluation_peak_bytes"], rep["evaluation_batch_size"] = eval_peak
    if eval_peak[0] > rep.get("iteration_peak_bytes", 0):
        rep.setdefault("notes", []).append(
            f"the peak allocated ({format_size(allocated_peak)}) is an "
            f"evaluation's: batch {eval_peak[1]} in eval mode reached "
            f"{format_size(eval_peak[0])}"
            + (f", the training iteration {format_size(peak.bytes)}"
               if peak is not None else ""))


def zero_peak_note(stage: int, peak: PeakInfo, program: Any) -> str:
    """What ZeRO ``stage`` (2 or 3) holds at the iteration's peak beside the rank's shards:
    full gradients before their reduce-scatter and (stage 3) parameters gathered whole for
    the step; on few ranks they can outweigh what sharding saves."""
    persistent = {t.name for t in program.tensors if t.persistent}
    full = {"gradient": 0, "parameter": 0}
    shards = 0
    for name, cat, nbytes in peak.live:
        if cat in full:
            if name in persistent:
                shards += nbytes
            else:
                full[cat] += nbytes
    if not (full["gradient"] or full["parameter"]):
        return ""
    parts = [f"{format_size(full['gradient'])} of full gradients before their reduce-scatter"]
    if stage >= 3:
        parts.append(f"{format_size(full['parameter'])} of parameters gathered whole for "
                     "their step")
    return (f"ZeRO stage {stage} at the peak: {' and '.join(parts)}, beside this rank's "
            f"shards and buffers ({format_size(shards)}); on few ranks these can outweigh "
            "what sharding saves")
