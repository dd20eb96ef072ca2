"""The cost model's predicted stall against the stall measured on the CPU with an emulated link.

    python benchmarks/measured/link_emulation.py          # every case (a minute on 2 quiet cores)
    python benchmarks/measured/link_emulation.py --quick  # one small case per spec

Each case trains a model on the CPU under a swapping spec with ``Trainer(emulate_link=P)``:
the plans are made with ``P``'s costs and the copy engine is throttled to ``P``'s link divided
by the CPU's slowdown (measured forward+backward seconds / ``P``'s roofline seconds, see
memory/cost/link_emulation.py), so copy time / compute time is ``P``'s. After ``--warmup``
steps (the throttle follows the slowdown from the first), ``--steps`` steps are timed. Per
case:

* ``step`` — measured ``Trainer.step`` (median; includes the optimizer update and the per-step
  Python work the model does not count), against the model's step time on ``P`` x slowdown;
* ``stall`` — measured per step (the runtime's ``swap_stats.stall_s``: time compute waited
  for a copy, median), against the model's stall on ``P`` x slowdown (``pred``) and against
  the model run with this CPU's measured step times and the emulated link (``cpu-t``: the
  copy/overlap model alone, without the roofline's per-step shape).
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import numpy as np

import minidl
from minidl.memory.cost.cost_model import simulate
from minidl.memory.cost.link_emulation import compute_slowdown
from minidl.memory.cost.targets import get_target
from minidl.net.optim import SGD
from minidl.zoo.models import resnet, smallcnn, vgg

#: (name, builder, input shape, batch): steps of roughly 0.05-0.3 s on two cores.
MODELS = [
    ("smallcnn", lambda: smallcnn((1, 28, 28)), (1, 28, 28), 32),
    ("vgg11-w16", lambda: vgg(11, (3, 32, 32), 10, width=16), (3, 32, 32), 16),
    ("resnet20", lambda: resnet(20, (3, 32, 32), 10), (3, 32, 32), 16),
]
SPECS = ["vdnn", "vdnn-all", "reuse,swap=auto"]
#: A V100 behind a slow host link (PCIe 3.0 x4-like): copies weigh 3x a V100's.
SLOW_LINK = "custom:flops=15.7T,hbm=900G,link=4G,mem=16GiB"
TARGETS = ["v100", "titanx-maxwell", SLOW_LINK]


def run_case(make, shape, batch, spec, target, warmup, steps):
    """Measured and predicted figures of one (model, spec, target): medians over the timed
    steps, each predicted with the slowdown measured in that step and the rate in force."""
    profile = get_target(target)
    net = make()
    tr = minidl.Trainer(net, SGD(net.parameters(), lr=0.01, momentum=0.9), memory=spec,
                        device_memory="512MiB", emulate_link=profile)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, *shape)).astype(np.float32)
    y = rng.integers(0, 10, batch)
    for _ in range(warmup):
        tr.step(x, y)
    rows = []
    for _ in range(steps):
        rate = tr.device.link_bytes_per_s
        t0 = time.perf_counter()
        tr.step(x, y)
        dt = time.perf_counter() - t0
        c = tr.last_compiled
        times = list(c.executor.step_times)
        slow = compute_slowdown(c.plan.program, times, profile)
        pred = simulate(c.plan, profile)
        emulated = dataclasses.replace(profile, link_h2d_bytes_per_s=rate,
                                       link_d2h_bytes_per_s=rate)
        rows.append({"slowdown": slow, "rate": rate, "moved": pred.offloaded_bytes,
                     "step": dt, "step_pred": pred.step_s * slow,
                     "stall": tr.swap_stats.get("stall_s", 0.0),
                     "stall_pred": pred.stall_s * slow,
                     "stall_cpu": simulate(c.plan, emulated, step_times=times).stall_s})
    tr.close()
    tr.device.close()
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]}


def ratio(a: float, b: float) -> str:
    if b <= 0:
        return "  -  " if a <= 0 else "  inf"
    return f"{a / b:5.2f}"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps per case first")
    ap.add_argument("--steps", type=int, default=4, help="timed steps per case (median)")
    ap.add_argument("--quick", action="store_true", help="smallcnn on v100 only")
    ap.add_argument("--models", default=None, help="comma-separated subset of the models")
    args = ap.parse_args(argv)
    models = MODELS[:1] if args.quick else MODELS
    if args.models:
        models = [m for m in MODELS if m[0] in args.models.split(",")]
    targets = TARGETS[:1] if args.quick else TARGETS
    print(f"slow link: {SLOW_LINK}; {args.warmup} untimed then {args.steps} timed steps per "
          "case (medians); times in ms on this CPU; pred = the model on the target x the "
          "step's measured slowdown; cpu-t = the model with the step's measured step times and "
          "the emulated link")
    head = (f"{'model':<10} {'spec':<16} {'target':<8} {'slow':>5} {'MB/s':>7} {'MB':>6} "
            f"{'step':>7} {'pred':>7} {'ratio':>5} {'stall':>7} {'pred':>7} {'ratio':>5} "
            f"{'cpu-t':>7} {'ratio':>5}")
    print(head)
    t_start = time.perf_counter()
    for name, make, shape, batch in models:
        for spec in SPECS:
            for target in targets:
                r = run_case(make, shape, batch, spec, target, args.warmup, args.steps)
                tname = "slow" if target == SLOW_LINK else target.replace("titanx-maxwell",
                                                                          "titanx")
                print(f"{name:<10} {spec:<16} {tname:<8} {r['slowdown']:5.0f} "
                      f"{r['rate'] / 1e6:7.1f} {r['moved'] / 1e6:6.2f} "
                      f"{1e3 * r['step']:7.1f} {1e3 * r['step_pred']:7.1f} "
                      f"{ratio(r['step'], r['step_pred'])} "
                      f"{1e3 * r['stall']:7.2f} {1e3 * r['stall_pred']:7.2f} "
                      f"{ratio(r['stall'], r['stall_pred'])} "
                      f"{1e3 * r['stall_cpu']:7.2f} {ratio(r['stall'], r['stall_cpu'])}",
                      flush=True)
    print(f"total {time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
    main()
