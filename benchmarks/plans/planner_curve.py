"""The auto planner's curve against fixed specs and the anchors, on a target's cost model.

    python benchmarks/plans/planner_curve.py resnet56:3x32x32:128:v100 [more models ...]
        [--points 10] [--json out.json] [--plot curve.png] [--fixed-limit N]

For each model (``name:CxHxW or T:batch:target``), budgets from 1.1x its lower bound (persistent
state plus its largest step) to its plain peak: ``auto``'s predicted step time and peak (a dry run
of ``auto,budget=B`` on the target, the engine's path: the plan a run would get), the plan's
certified lower bound when it reports one, and beside it, all predicted by the same cost model
on the same program:

* every fixed spec (each lossless combination of ``recompute=``, ``swap=`` and
  ``binarize`` / ``sparse``; a dry run each): the fastest one whose peak fits the budget;
* Chen et al.'s sqrt(n) (``recompute=sqrt``);
* torch.compile's activation-memory budget: a 0/1 knapsack of the feature maps kept for
  backward (keep the most recompute time per byte that fits; every other one recomputed once,
  as ``recompute=speed`` does its segments);
* a Capuchin-style greedy: the walk of :mod:`minidl.memory.planners.auto` (swap or recompute the
feature
  map live at the peak that frees the most bytes per second of overhead).

It checks what Part 19 asks: ``auto`` never slower with more memory (monotone) and never slower
(1 %) than a fixed spec whose peak fits (dominance). Predicted times, not timings; plan times
are this machine's seconds for one ``auto`` dry run.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass, field

import minidl
from minidl.compile.engine import Engine
from minidl.layers import SoftmaxCrossEntropy
from minidl.memory.cost.cost_model import simulate, step_costs
from minidl.memory.cost.targets import get_target
from minidl.memory.devices.device import MetaDevice
from minidl.memory.ir.config import MemoryConfig
from minidl.memory.passes.base_plan import base_plan
from minidl.memory.passes.recompute import dropping_program
from minidl.memory.passes.static_plan import static_plan
from minidl.memory.planners.auto import BudgetTooSmall, auto_plan
from minidl.memory.planners.frontier import fixed_configs, program_chain, recompute_bound
from minidl.memory.planners.knapsack import knapsack_order
from minidl.memory.runtime.pool import Pool
from minidl.net.labels import default_label_shape
from minidl.net.optim import make_optimizer
from minidl.zoo.models import get_model

MIB = 2 ** 20


@dataclass
class Case:
    model: str
    shape: tuple[int, ...]
    batch: int
    target: str
    rows: list[dict] = field(default_factory=list)
    fixed: dict[str, dict] = field(default_factory=dict)


def parse_case(text: str) -> Case:
    try:
        model, shape, batch, target = text.split(":")
        return Case(model, tuple(int(v) for v in shape.split("x")), int(batch), target)
    except ValueError:
        raise SystemExit(f"a model is name:CxHxW or T:batch:target, got {text!r}") from None


def _dry(case: Case, spec: str) -> dict:
    net = get_model(case.model, input_shape=case.shape)
    return minidl.dry_run(net, case.batch, spec, input_shape=case.shape, target=case.target)


def _program(case: Case):
    """The lowered training program on the target's device kind (SGD with momentum)."""
    net = get_model(case.model, input_shape=case.shape)
    pool = Pool(MetaDevice(kind="cuda"))
    eng = Engine(net, pool, "reuse,inplace", SoftmaxCrossEntropy(),
                 make_optimizer("sgd", net.parameters()), bind=False,
                 target=get_target(case.target))
    b = (case.batch, *case.shape)
    return eng.compiled([b], tuple(default_label_shape(net, b)), training=True).lowered.program


def _placed(program, plan) -> int:
    return program.persistent_bytes() + static_plan(plan, program.persistent_bytes()).static.arena


def knapsack_anchor(program, budget: int, profile) -> tuple[int, float] | None:
    """torch.compile's policy on this program: keep the feature maps with the most recompute
    time per byte while the plan fits (a knapsack by ratio, refined by halving the capacity),
    recompute the others once (segments, as ``recompute=speed``). Steps of equal ratio: the
    later one kept first (:func:`~minidl.memory.planners.knapsack.knapsack_order`)."""
    order = knapsack_order(program, step_costs(program, profile), later_first=True)
    best = None
    for share in (1.0, 0.8, 0.6, 0.45, 0.3, 0.2, 0.1, 0.05, 0.0):
        keep = set(order[:int(share * len(order))])
        dropped = set(order) - keep
        prog = dropping_program(program, dropped)
        plan = base_plan(prog, MemoryConfig.parse("reuse,inplace"))
        peak = _placed(prog, plan)
        if peak <= budget:
            pred = simulate(plan, profile)
            best = (peak, pred.step_s)
            break
    return best


def greedy_anchor(program, budget: int, profile) -> tuple[int, float] | None:
    """The greedy walk (Capuchin-style) of memory/planners/auto.py on the target's costs."""
    costs = step_costs(program, profile)
    bw = min(profile.link_h2d_bytes_per_s, profile.link_d2h_bytes_per_s)
    try:
        plan = auto_plan(program, budget, costs, bandwidth=bw)
    except BudgetTooSmall:
        return None
    return program.persistent_bytes() + plan.static.arena, simulate(plan, profile).step_s


def run_case(case: Case, points: int, fixed_limit: int | None, log) -> Case:
    profile = get_target(case.target)
    plain = _dry(case, "reuse,inplace")
    lb, top = plain["lower_bound_bytes"], plain["peak_reserved_bytes"]
    log(f"{case.model} {'x'.join(map(str, case.shape))} b{case.batch} on {case.target}: lower "
        f"bound {lb / MIB:.1f} MiB, plain peak {top / MIB:.1f} MiB")
    specs = [config.spec for config in fixed_configs(None)[:fixed_limit]]
    for spec in specs:
        try:
            d = _dry(case, spec)
            case.fixed[spec] = {"peak": d["peak_reserved_bytes"],
                                "step_s": d["prediction"]["step_s"]}
        except MemoryError as e:
            case.fixed[spec] = {"error": str(e)[:200]}
    program = _program(case)
    chain = program_chain(program, step_costs(program, profile))
    rotor = None if chain is None else recompute_bound(program, chain)
    multiples = sorted({round(1.1 * (top / lb / 1.1) ** (k / (points - 1)), 3)
                        for k in range(points)})
    for mult in multiples:
        budget = int(mult * lb)
        row: dict = {"multiple": mult, "budget": budget}
        t0 = time.perf_counter()
        try:
            d = _dry(case, f"auto,budget={budget}")
            row.update(auto_s=d["prediction"]["step_s"], auto_peak=d["peak_reserved_bytes"],
                       split=d["split"], note=d["notes"][0] if d["notes"] else "")
            bound = (d.get("auto") or {}).get("lower_bound_s")  # (the whole step's: split)
            if bound is not None:
                row["bound_s"] = bound
        except MemoryError:
            row.update(auto_s=None)
        row["plan_time_s"] = time.perf_counter() - t0
        fits = [(v["step_s"], k) for k, v in case.fixed.items()
                if "step_s" in v and v["peak"] <= budget]
        if fits:
            row["fixed_s"], row["fixed"] = min(fits)
        sq = case.fixed.get("reuse,inplace,recompute=sqrt", {})
        row["sqrt_s"] = sq.get("step_s") if sq.get("peak", math.inf) <= budget else None
        # Checkmate's / Rotor's recomputation-only optimum is at least this (the DP over the
        # chain with the least memory figures)
        row["recompute_bound_s"] = None if rotor is None else rotor.seconds(budget)
        ks = knapsack_anchor(program, budget, profile)
        row["knapsack_s"] = ks[1] if ks else None
        gr = greedy_anchor(program, budget, profile)
        row["greedy_s"] = gr[1] if gr else None
        case.rows.append(row)
        log(_format_row(row))
    return case


def _ms(v) -> str:
    return "      -" if v is None else f"{1e3 * v:7.2f}"


def _format_row(r: dict) -> str:
    gap = ""
    if r.get("bound_s") and r.get("auto_s"):
        gap = f"  gap {100 * (r['auto_s'] / r['bound_s'] - 1):5.1f} %"
    split = f", split {r['split']}" if r.get("split", 1) > 1 else ""
    return (f"  {r['multiple']:5.2f} LB {r['budget'] / MIB:9.1f} MiB:"
            f" auto {_ms(r.get('auto_s'))} ms (plan {r['plan_time_s']:5.1f} s{split})"
            f"  fixed {_ms(r.get('fixed_s'))}  sqrt {_ms(r.get('sqrt_s'))}"
            f"  knapsack {_ms(r.get('knapsack_s'))}  greedy {_ms(r.get('greedy_s'))}"
            f"  recompute-only >= {_ms(r.get('recompute_bound_s'))}{gap}")


def checks(case: Case) -> dict:
    """Monotone, dominance and the worst gap to the certificate over the case's budgets."""
    times = [r["auto_s"] for r in case.rows]
    monotone = all(a is None or b is None or b <= a * (1 + 1e-9)
                   for a, b in zip(times, times[1:])) and \
        all(b is not None for a, b in zip(times, times[1:]) if a is not None)
    dominated = [r for r in case.rows if r.get("fixed_s") is not None
                 and (r.get("auto_s") is None or r["auto_s"] > 1.01 * r["fixed_s"])]
    gaps = [r["auto_s"] / r["bound_s"] - 1 for r in case.rows
            if r.get("bound_s") and r.get("auto_s") and r["multiple"] >= 1.25]
    return {"monotone": monotone, "dominates": not dominated,
            "dominated_at": [r["multiple"] for r in dominated],
            "worst_gap": max(gaps) if gaps else None,
            "slowest_plan_s": max(r["plan_time_s"] for r in case.rows)}


def plot(cases: list[Case], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(cases), figsize=(6 * len(cases), 4.5), squeeze=False)
    for ax, case in zip(axes[0], cases):
        x = [r["multiple"] for r in case.rows]
        for key, label in (("auto_s", "auto"), ("fixed_s", "best fixed spec"),
                           ("sqrt_s", "Chen sqrt(n)"), ("knapsack_s", "knapsack (torch.compile)"),
                           ("greedy_s", "greedy (Capuchin)"), ("bound_s", "lower bound")):
            ys = [1e3 * r[key] if r.get(key) else None for r in case.rows]
            ax.plot([a for a, b in zip(x, ys) if b], [b for b in ys if b], marker="o",
                    label=label)
        ax.set_xscale("log")
        ax.set_xlabel("budget / lower bound")
        ax.set_ylabel("predicted step (ms)")
        ax.set_title(f"{case.model} b{case.batch} on {case.target}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("cases", nargs="+", help="model:CxHxW or T:batch:target")
    p.add_argument("--points", type=int, default=10)
    p.add_argument("--fixed-limit", type=int, default=None,
                   help="only the first N fixed specs (a quick look)")
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None)
    args = p.parse_args()
    cases = []
    for text in args.cases:
        case = run_case(parse_case(text), args.points, args.fixed_limit,
                        lambda s: print(s, flush=True))
        c = checks(case)
        print(f"  monotone {c['monotone']}, dominates {c['dominates']} "
              f"{c['dominated_at'] or ''}, worst gap from 1.25 LB "
              + ("-" if c["worst_gap"] is None else f"{100 * c['worst_gap']:.1f} %")
              + f", slowest plan {c['slowest_plan_s']:.1f} s", flush=True)
        cases.append(case)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{"model": c.model, "shape": c.shape, "batch": c.batch,
                        "target": c.target, "rows": c.rows, "fixed": c.fixed,
                        "checks": checks(c)} for c in cases], f, indent=1)
    if args.plot:
        plot(cases, args.plot)
    sys.exit(0)


if __name__ == "__main__":
    main()
