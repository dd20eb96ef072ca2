"""The optimal joint planner (``auto,planner=optimal``) against the greedy ``auto`` planner: their
estimated overheads at budgets from the lower bound to twice it, per model and target.

    python benchmarks/plans/optimal_vs_greedy.py [--targets v100,a100-40gb]
        [--multiples 1,1.05,1.1,1.2,1.5,2]
        [--models vgg16:3x224x224:64:1000,resnet50:3x224x224:32:1000,...]

One line per point: the budget (and its multiple of the lower bound: persistent state plus the
largest step's own tensors, SGD with momentum as ``minidl plan`` uses), each planner's estimated
extra time per iteration (the same estimate for both, the cost model's walk of the built plan:
stalls of the swaps' copies queued on the link, plus recomputed steps, at the target's roofline
costs; ``cpu`` is the FLOP-rate model used without a target) or ``-`` when its plan does not fit,
which choice ``planner=optimal`` takes, and the MILP's solve time and optimality gap (of the choice
against the whole MILP's dual bound; on large programs the whole MILP gets a share of the work,
counted in branch-and-bound nodes, and windows of layers the rest). Overheads are estimates, not
timings.
"""

from __future__ import annotations

import argparse
import re
import time

from minidl.compile.engine import Engine
from minidl.layers import SoftmaxCrossEntropy
from minidl.memory.cost.cost_model import step_costs
from minidl.memory.cost.targets import get_target
from minidl.memory.devices.device import MetaDevice
from minidl.memory.ir.config import MemoryConfig
from minidl.memory.ir.program import Program
from minidl.memory.passes.swap import DEFAULT_BANDWIDTH
from minidl.memory.planners.auto import auto_choose
from minidl.memory.planners.auto import step_costs as flop_costs
from minidl.memory.planners.optimal import evaluate, optimal_choose
from minidl.memory.runtime.pool import Pool
from minidl.net.labels import default_label_shape
from minidl.net.optim import make_optimizer
from minidl.zoo.models import get_model

MODELS = "vgg16:3x224x224:64:1000,resnet50:3x224x224:32:1000,resnet56:3x32x32:128:10"


def training_program(model: str, shape: tuple[int, ...], batch: int, classes: int) -> Program:
    """The lowered training program ``minidl plan`` plans (SGD with momentum, meta device)."""
    net = get_model(model, shape, classes)
    engine = Engine(net, Pool(MetaDevice()), MemoryConfig.parse("reuse,inplace"),
                    SoftmaxCrossEntropy(), make_optimizer("sgd", net.parameters()), bind=False)
    batch_shape = (batch, *shape)
    c = engine.compiled([batch_shape], default_label_shape(net, batch_shape), training=True)
    return c.lowered.program


def costs_for(program: Program, target: str) -> tuple[list[float], float]:
    if target == "cpu":
        return flop_costs(program, None), DEFAULT_BANDWIDTH
    prof = get_target(target)
    return step_costs(program, prof), min(prof.link_h2d_bytes_per_s, prof.link_d2h_bytes_per_s)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=MODELS)
    ap.add_argument("--targets", default="v100,a100-40gb")
    ap.add_argument("--multiples", default="1,1.05,1.1,1.2,1.5,2",
                    help="budgets as multiples of the lower bound")
    args = ap.parse_args()
    print(f"{'model':<26} {'target':<10} {'budget':>10} {'x LB':>5} {'greedy ms':>10} "
          f"{'optimal ms':>10} {'taken':>8} {'solve s':>8}  gap / note")
    for spec in args.models.split(","):
        name, shape_text, batch, classes = spec.split(":")
        shape = tuple(int(v) for v in shape_text.split("x"))
        program = training_program(name, shape, int(batch), int(classes))
        lb = program.lower_bound_bytes()
        for target in args.targets.split(","):
            costs, bandwidth = costs_for(program, target)
            for mult in (float(m) for m in args.multiples.split(",")):
                budget = int(lb * mult)
                greedy = auto_choose(program, budget, costs, bandwidth=bandwidth)
                g_peak, g_extra, _ = evaluate(program, greedy, costs, bandwidth)
                t0 = time.perf_counter()
                opt = optimal_choose(program, budget, costs, bandwidth, greedy=greedy)
                solve_s = time.perf_counter() - t0
                kept = any(p[0] == "fallback" for p in opt.path)
                fits = opt.peak <= budget
                taken = "-" if not fits else "greedy" if kept else "optimal"
                gap = next((m.group(1) for p in opt.path if p[0] == "milp"
                            for m in [re.search(r"gap ([0-9.]+ %) for the choice", p[1])] if m),
                           "")
                note = ("greedy does not fit" if g_peak > budget and fits
                        else "neither fits" if not fits else "")
                label = f"{name} {shape_text} b{batch}"
                print(f"{label:<26} {target:<10} {budget / 2**30:>7.2f}GiB {mult:>5.2f} "
                      f"{f'{1000 * g_extra:.1f}' if g_peak <= budget else '-':>10} "
                      f"{f'{1000 * opt.extra_time_s:.1f}' if fits else '-':>10} {taken:>8} "
                      f"{solve_s:>8.1f}  {gap} {note}".rstrip(), flush=True)


if __name__ == "__main__":
    main()
