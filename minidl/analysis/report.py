"""Memory reports: the per-layer table of what each layer keeps for backward and in which form,
and the timeline of device bytes by category (PNG through matplotlib, Chrome trace JSON)."""

from __future__ import annotations

import math
from typing import Any

from ..compile.engine import Compiled
from ..interop.checkpoint import write_json
from ..memory.ir.liveness import lifetimes, root_of
from ..memory.ir.names import Phase, Role
from ..memory.ir.timeline import category_series, chrome_trace
from ..memory.ir.units import format_size


def layer_table(c: Compiled) -> list[dict[str, Any]]:
    """One row per forward layer: its output bytes and what happens to them until backward —
    ``kept`` (resident), ``freed`` (backward does not need them), ``swapped`` (offloaded to
    host), ``recomputed`` (dropped, rebuilt from a checkpoint), ``in-place`` (shares its
    input's block) — plus the bytes of its stash."""
    lowered = c.lowered.program
    plan = c.plan
    prog = plan.program
    life = lifetimes(lowered)
    recomputed = {s.cost.origin for s in prog.steps if s.phase == Phase.RECOMPUTE}
    swapped_roots = set(plan.swapping.blocks)
    rows = []
    for st in lowered.steps:
        if st.phase != Phase.FORWARD:
            continue
        outs = [t for t in st.access.writes if lowered.tensors[t].role == Role.VALUE]
        stash = [t for t in st.access.writes if lowered.tensors[t].role == Role.STASH]
        nbytes = sum(lowered.block_size(lowered.tensors[t].nbytes) for t in outs)
        if st.index in recomputed:
            form = "recomputed"
        elif any(root_of(plan.aliases, t) in swapped_roots for t in outs):
            form = "swapped"
        elif not any(life[t].backward_use for t in outs if t in life):
            form = "freed"
        else:
            form = "kept"
        if any(t in plan.aliases for t in outs) and form in ("kept", "freed"):
            form += ", in-place"
        rows.append({"layer": st.layer, "kind": st.kind, "output_bytes": nbytes,
                     "stash_bytes": sum(lowered.block_size(lowered.tensors[t].nbytes)
                                        for t in stash),
                     "form": form, "flops": st.cost.flops})
    return rows


def format_layer_table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'layer':<28}{'kind':<10}{'output':>14}{'stash':>12}  kept for backward as"]
    for r in rows:
        lines.append(f"{r['layer']:<28}{r['kind']:<10}{format_size(r['output_bytes']):>14}"
                     f"{format_size(r['stash_bytes']):>12}  {r['form']}")
    return "\n".join(lines)


def persistent_by_category(c: Compiled) -> dict[str, int]:
    out: dict[str, int] = {}
    program = c.lowered.program
    for t in program.persistent:
        out[t.category] = out.get(t.category, 0) + program.block_size(t.nbytes)
    return out


def timeline(c: Compiled, by_step: bool = True) -> dict[str, Any]:
    rt = c.executor.last_runtime
    if rt is None or rt.recording is None:
        raise RuntimeError("no recorded iteration: run with record=True first")
    return category_series(rt.recording.events, c.plan.program, persistent_by_category(c), by_step)


def save_trace(c: Compiled, path: str, measured: bool) -> None:
    rt = c.executor.last_runtime
    if rt is None or rt.recording is None:
        raise RuntimeError("no recorded iteration: run with record=True first")
    times = list(c.executor.step_times) if measured else None
    write_json(path, chrome_trace(rt.recording.events, c.plan.program, times,  # (0644, not 0600)
                                  persistent_by_category(c)))


def plot_timeline(series: dict[str, Any], path: str, title: str = "",
                  budget: int | None = None, budget_label: str = "budget") -> None:
    """Stacked area of device bytes by category over one iteration (one point per allocation
    event, so the peak is drawn), saved as PNG; ``budget`` (bytes) as a red line named
    ``budget_label``."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError("plots need matplotlib: pip install 'minidl[plot]'") from None
    cats = sorted(series["bytes"], key=lambda k: -max(series["bytes"][k] or [0]))
    xs = series["x"]
    fig, ax = plt.subplots(figsize=(11, 5))
    ax.stackplot(xs, [[b / 2**20 for b in series["bytes"][c]] for c in cats], labels=cats,
                 step="post", alpha=0.85)
    totals = [sum(series["bytes"][c][i] for c in cats) for i in range(len(xs))]
    if totals:
        i = max(range(len(totals)), key=totals.__getitem__)
        ax.axhline(totals[i] / 2**20, color="k", lw=0.8, ls="--")
        label = ""
        if series["axis"] == "step" and series["step_labels"]:
            pos = math.floor(xs[i])
            label = " at " + ("(start)" if pos < 0 else "(end)" if pos >= len(
                series["step_labels"]) else series["step_labels"][pos])
        ax.annotate(f"peak {totals[i] / 2**20:.1f} MiB{label}", (xs[i], totals[i] / 2**20),
                    textcoords="offset points", xytext=(5, 5), fontsize=9)
    if budget is not None:
        ax.axhline(budget / 2**20, color="r", lw=1.0)
        ax.annotate(f"{budget_label} {budget / 2**20:.1f} MiB", (1.0, budget / 2**20),
                    xycoords=("axes fraction", "data"), textcoords="offset points",
                    xytext=(-5, 4), ha="right", fontsize=9, color="r")
        ax.set_ylim(top=max(ax.get_ylim()[1], budget / 2**20 * 1.08))
    ax.set_xlabel("program step (one op of the iteration)" if series["axis"] == "step"
                  else "seconds")
    ax.set_ylabel("device MiB")
    ax.set_title(title)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)  # beside the plot
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def strategy_costs(c: Any) -> dict[str, Any]:
    """What recomputation and compression cost in the last iteration: recomputed FLOPs and
    seconds, the BPTT schedule of each fused recurrent layer (states kept, units computed),
    encode / decode seconds, and per encoded stash its codec, size ratio and (for sparse)
    measured density."""
    prog = c.plan.program
    times = c.executor.step_times
    out: dict[str, Any] = {}
    recompute = prog.rewrites.recompute
    if recompute is not None and recompute.recomputed_steps:
        out["recompute"] = {
            "flops": int(recompute.recomputed_flops),
            "steps": int(recompute.recomputed_steps),
            "time_s": float(sum(t for s, t in zip(prog.steps, times)
                                if s.phase == Phase.RECOMPUTE)),
        }
    bptt = []
    for st in c.lowered.program.steps:
        sched = st.op.options.bptt  # the plan's BPTT schedule of a fused RNN step
        if st.phase == Phase.FORWARD and sched is not None:
            layer = c.lowered.layers[st.node]
            bptt.append({"layer": st.layer, "policy": sched.policy, "units": sched.units,
                         "unit_steps": layer.unit_steps, "states_kept": sched.max_stored,
                         "unit_forwards": sched.unit_forwards,
                         "recomputed_flops": layer.recompute_flops(
                             list(st.forward.in_shapes), st.op.options.as_layer_options)})
    if bptt:
        out["bptt"] = bptt
    encodes = [s for s in prog.steps if s.phase == Phase.ENCODE]
    if encodes:
        per = []
        for s in encodes:
            src = prog.tensors[s.op.codec.source]
            enc = s.access.writes[0]
            row = {"tensor": src.name, "codec": s.op.codec.codec,
                   "ratio": src.nbytes / max(prog.tensors[enc].nbytes, 1)}
            if src.name in c.executor.densities:
                row["density"] = c.executor.densities[src.name]
            per.append(row)
        out["compression"] = {
            "encode_time_s": float(sum(t for s, t in zip(prog.steps, times)
                                       if s.phase == Phase.ENCODE)),
            "decode_time_s": float(sum(t for s, t in zip(prog.steps, times)
                                       if s.phase == Phase.DECODE)),
            "stashes": per,
        }
    return out
