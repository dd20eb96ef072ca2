"""The papers' headline settings, predicted by minidl's cost model for their hardware.

    python benchmarks/plans/paper_targets.py [--resnets]

vDNN (Rhu et al. 2016): VGG-16 at batch 256 on a 12 GB Titan X (Maxwell). Chen et al. 2016:
sqrt(n) checkpointing of ResNets at about 30 % more time, and auto at the memory of that plan
(recomputation only, greedy and optimal planners, and every action). Each line: the dry run's
peak (what minidl allocates, every category), whether it fits the target's memory, and the
predicted step time, the unlimited-memory device's and the overhead (memory/cost/cost_model.py).
``--resnets``: the recomputation part only.
"""
import sys

import minidl
from minidl.memory.planners.auto import BudgetTooSmall
from minidl.zoo.models import get_model

GIB = 1 << 30


def line(model, shape, classes, batch, spec, target):
    try:
        rep = minidl.dry_run(get_model(model, shape, classes), batch, spec, input_shape=shape,
                             target=target)
    except BudgetTooSmall as e:
        print(f"{model} b{batch} {spec!r} on {target}: does not fit ({str(e).split(' (')[0]})")
        return None
    p = rep["prediction"]
    fits = rep["peak_reserved_bytes"] <= p["capacity_bytes"]
    cats = ", ".join(f"{k} {v / GIB:.2f}" for k, v in rep["breakdown"].items())
    print(f"{model} b{batch} {spec!r} on {target}: peak {rep['peak_reserved_bytes'] / GIB:.2f} "
          f"GiB ({'fits' if fits else 'does not fit'} {p['capacity_bytes'] / GIB:.0f} GiB; at "
          f"the peak: {cats}); step {p['step_s']:.3f} s vs unlimited {p['oracle_s']:.3f} s: "
          f"overhead {100 * p['overhead']:.1f} %, stall {p['stall_s']:.3f} s, "
          f"{p['offloaded_bytes'] / GIB:.2f} GiB each way"
          + (f"; {rep['split']} micro-batches" if rep.get("split", 1) > 1 else ""))
    return rep


only_resnets = "--resnets" in sys.argv[1:]
for spec in [] if only_resnets else ["none", "reuse,inplace", "vdnn", "vdnn-all",
                                     "reuse,inplace,swap=all,static", "gist,swap=all,static",
                                     "auto", "auto,split=1"]:
    line("vgg16", (3, 224, 224), 1000, 256, spec, "titanx-maxwell")
for model, shape, classes, batch in [("resnet20", (3, 32, 32), 10, 64),
                                     ("vgg16", (3, 224, 224), 1000, 64),
                                     ("resnet50", (3, 224, 224), 1000, 64),
                                     ("resnet152", (3, 224, 224), 1000, 32),
                                     ("resnet1001", (3, 32, 32), 10, 64)]:
    for spec in ["reuse,inplace", "reuse,inplace,recompute=sqrt"]:
        rep = line(model, shape, classes, batch, spec, "titanx-maxwell")
    # at the memory of Chen's sqrt(n) plan: auto on the whole batch with that budget,
    # recomputation only (Checkmate's setting) and with every action (the Titan X's link)
    if rep is None:
        continue
    budget = rep["peak_reserved_bytes"]
    for extra in ("only=recompute", "only=recompute,planner=optimal", ""):
        spec = ",".join(f for f in (f"auto,budget={budget},split=1", extra) if f)
        line(model, shape, classes, batch, spec, "titanx-maxwell")
