"""Text summaries: :func:`memory_summary` of a trainer (as ``torch.cuda.memory_summary``),
and the per-layer memory of a network under a spec (:func:`layer_memory`) that
:meth:`Network.summary <minidl.net.graph.Network.summary>` shows as columns (:func:`summary`)."""

from __future__ import annotations

import textwrap
from typing import Any

from ..compile.engine import Engine
from ..layers import SoftmaxCrossEntropy
from ..layers.base import Layer
from ..memory.devices.device import MetaDevice
from ..memory.ir.config import MemoryConfig
from ..memory.ir.liveness import root_of
from ..memory.ir.names import Category, Phase, Role
from ..memory.ir.units import format_size
from ..memory.ir.walk import Where, walk
from ..memory.runtime.pool import Pool
from ..net.graph import Network
from ..net.labels import default_label_shape
from ..net.optim import make_optimizer


def memory_summary(trainer: Any, top: int = 5) -> str:
    """The trainer's device memory as text: the pool's current and peak bytes (allocated,
    reserved, by category), allocation counts, fragmentation, where the last iterations
    peaked and the ``top`` largest tensors live there, swapping, and the plan's notes."""
    s = trainer.pool.stats()
    rep = trainer.memory_report()
    width = 72
    rule, thick = "|" + "-" * (width - 2) + "|", "|" + "=" * (width - 2) + "|"

    def row(text: str) -> str:
        return "\n".join(f"| {part:<{width - 4}} |"
                         for part in textwrap.wrap(text, width - 4, subsequent_indent="  "))

    def metric(name: str, cur: int | str, peak: int | str) -> str:
        cur = format_size(cur) if isinstance(cur, int) else cur
        peak = format_size(peak) if isinstance(peak, int) else peak
        return f"| {name:<30}{cur:>18}{peak:>18}{'':<{width - 70}} |"

    out = [thick, row(f"minidl memory summary: {rep['device']} device, memory spec "
                      f"{rep['memory']!r}"), thick,
           row(f"device memory {format_size(s['capacity'])}, free {format_size(s['free_bytes'])}"
               f", largest free block {format_size(s['largest_free_block'])}, fragmentation "
               f"{100 * s['fragmentation']:.1f}%"),
           rule, metric("metric", "current", "peak"), rule,
           metric("allocated", s["allocated_bytes.current"], s["allocated_bytes.peak"]),
           metric("reserved (arena span)", s["reserved_bytes.current"], s["reserved_bytes.peak"])]
    cats = sorted((k.split(".")[1] for k in s if k.endswith(".peak") and k.count(".") == 2),
                  key=lambda c: -s[f"allocated_bytes.{c}.peak"])
    for c in cats:
        if s[f"allocated_bytes.{c}.peak"]:
            out.append(metric(f"  {c}", s[f"allocated_bytes.{c}.current"],
                              s[f"allocated_bytes.{c}.peak"]))
    out += [rule, metric("live blocks", f"{s['active_blocks']:,}", ""),
            metric("allocations / frees", f"{s['num_allocs']:,}", f"{s['num_frees']:,}"),
            metric("out-of-memory errors", f"{s['num_ooms']:,}", ""), rule]
    if "peak_step" in rep:
        ps = rep["peak_step"]
        out.append(row(f"iteration peak {format_size(rep['iteration_peak_bytes'])} at "
                       f"{ps['layer']} ({ps['phase']}, step {ps['index']})"))
        for r in rep["largest_live"][:top]:
            out.append(row(f"  {r['tensor'][:36]:<38}{r['category']:<16}"
                           f"{format_size(r['bytes']):>12}"))
        out.append(rule)
    swap = rep.get("swap")
    if swap:
        out.append(row(f"swap: {format_size(swap['offloaded_bytes'])} offloaded, "
                       f"{format_size(swap['prefetched_bytes'])} prefetched, stall "
                       f"{1000 * swap['stall_s']:.2f} ms (last iteration)"))
        out.append(rule)
    for note in rep.get("notes", []):
        out.append(row(f"note: {note}"))
    if rep.get("notes"):
        out.append(rule)
    out[-1] = thick
    return "\n".join(out)


def layer_memory(net: Network, batch_size: int, memory: str | MemoryConfig = "none",
                 optimizer: str = "sgd", input_shape: tuple[int, ...] | None = None,
                 loss: Layer | None = None) -> dict[str, dict[str, int]]:
    """Per layer, for one training iteration of ``net`` at ``batch_size`` under ``memory``
    (planned on the meta device: nothing runs): ``output`` (bytes of its outputs),
    ``kept`` (bytes of its outputs, stash and encoded forms still on the device when backward
    starts: swapped, recomputed or freed ones are not) and ``workspace`` (the most scratch
    any of its steps takes)."""
    shape = tuple(input_shape) if input_shape is not None else net.input_shapes[0]
    if shape is None:
        raise ValueError("the network has no input shape: pass input_shape")
    engine = Engine(net, Pool(MetaDevice()), MemoryConfig.parse(memory),
                    loss if loss is not None else SoftmaxCrossEntropy(),
                    make_optimizer(optimizer, net.parameters()), bind=False)
    batch = (int(batch_size), *shape)
    c = engine.compiled([batch], tuple(default_label_shape(net, batch)), training=True)
    plan, prog = c.plan, c.plan.program
    rows: dict[str, dict[str, int]] = {}

    def add(layer: str, key: str, nbytes: int, keep_max: bool = False) -> None:
        r = rows.setdefault(layer, {"output": 0, "kept": 0, "workspace": 0})
        r[key] = max(r[key], nbytes) if keep_max else r[key] + nbytes

    for st in prog.steps:
        if st.phase == Phase.FORWARD:
            for t in st.access.writes:
                if prog.tensors[t].role == Role.VALUE:
                    add(st.layer, "output", prog.block_size(prog.tensors[t].nbytes))
        ws = st.access.workspace
        if ws >= 0:
            add(st.layer, "workspace", prog.block_size(prog.tensors[ws].nbytes), True)
    for tid in _on_device_when_backward_starts(plan):
        t = prog.tensors[tid]
        if t.role in (Role.VALUE, Role.STASH) \
                or t.category in (Category.STASH, Category.ENCODED, Category.FEATURE_MAP):
            add(t.layer, "kept", prog.block_size(t.nbytes))
    return rows


_BACKWARD_PHASES = (Phase.BACKWARD, Phase.RECOMPUTE)


def _on_device_when_backward_starts(plan: Any) -> set[int]:
    """Tensors whose own block is on the device just before the first backward or
    recomputation step (aliases count under their root)."""
    live: set[int] = set()
    steps = plan.program.steps
    for visit in walk(plan):
        if visit.where is Where.END or (visit.where is Where.BEFORE
                                        and steps[visit.step].phase in _BACKWARD_PHASES):
            break
        for a in visit.actions:
            if a.tensor in plan.aliases:
                continue
            if a.effect.starts_block:
                live.add(a.tensor)
            elif a.effect.ends_block:
                live.discard(root_of(plan.aliases, a.tensor))
    return live


def summary(net: Network, batch_size: int, memory: str | MemoryConfig = "none",
            optimizer: str = "sgd", input_shape: tuple[int, ...] | None = None) -> str:
    """:meth:`Network.summary` for a batch of ``batch_size`` with the memory columns of
    :func:`layer_memory` under ``memory``."""
    shape = tuple(input_shape) if input_shape is not None else net.input_shapes[0]
    rows = layer_memory(net, batch_size, memory, optimizer, shape)
    spec = MemoryConfig.parse(memory).spec
    return net.summary([(int(batch_size), *shape)], memory=rows,
                       memory_note=f"batch {batch_size}, memory {spec!r}")
