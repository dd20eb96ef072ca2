"""The papers' headline settings, predicted by minidl's cost model for their hardware.

    python benchmarks/paper_targets.py

vDNN (Rhu et al. 2016): VGG-16 at batch 256 on a 12 GB Titan X (Maxwell). Chen et al. 2016:
sqrt(n) checkpointing of ResNets at about 30 % more time. Each line: the dry run's peak (what
minidl allocates, every category), whether it fits the target's memory, and the predicted
step time, the unlimited-memory device's and the overhead (memory/cost_model.py).
"""
import minidl
from minidl.models import get_model

GIB = 1 << 30


def line(model, shape, classes, batch, spec, target):
    rep = minidl.dry_run(get_model(model, shape, classes), batch, spec, input_shape=shape,
                         target=target)
    p = rep["prediction"]
    fits = rep["peak_reserved_bytes"] <= p["capacity_bytes"]
    cats = ", ".join(f"{k} {v / GIB:.2f}" for k, v in rep["breakdown"].items())
    print(f"{model} b{batch} {spec!r} on {target}: peak {rep['peak_reserved_bytes'] / GIB:.2f} "
          f"GiB ({'fits' if fits else 'does not fit'} {p['capacity_bytes'] / GIB:.0f} GiB; at "
          f"the peak: {cats}); step {p['step_s']:.3f} s vs unlimited {p['oracle_s']:.3f} s: "
          f"overhead {100 * p['overhead']:.1f} %, stall {p['stall_s']:.3f} s, "
          f"{p['offloaded_bytes'] / GIB:.2f} GiB each way")


for spec in ["none", "reuse,inplace", "vdnn", "vdnn-all", "reuse,inplace,swap=all,static",
             "gist,swap=all,static", "auto"]:
    line("vgg16", (3, 224, 224), 1000, 256, spec, "titanx-maxwell")
for model, shape, classes, batch in [("resnet50", (3, 224, 224), 1000, 64),
                                     ("resnet152", (3, 224, 224), 1000, 32),
                                     ("resnet1001", (3, 32, 32), 10, 64)]:
    for spec in ["reuse,inplace", "reuse,inplace,recompute=sqrt"]:
        line(model, shape, classes, batch, spec, "titanx-maxwell")
