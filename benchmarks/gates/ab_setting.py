"""One setting at two values, two trainers alternating step by step in one process.

A setting is a module constant or a class attribute, by dotted path (e.g.
``minidl.kernels.convolution.conv_geometry.WINOGRAD4_MIN_COLS`` or
``minidl.layers.recurrent.units._UnitOps.edge_projection_steps``). Trainer A is built and
always stepped with the setting at value A, trainer B at value B (the convolutions' cached
per-shape setup is cleared at each switch), alternating A-B / B-A, so both see the same
machine; on a machine whose speed drifts this resolves a few percent where separate processes
cannot. Prints each side's median step and the median of the per-pair ratios B / A.

    python benchmarks/gates/ab_setting.py WORKLOAD SETTING A B [--steps 40]
    python benchmarks/gates/ab_setting.py char-lstm \\
        minidl.layers.recurrent.units._UnitOps.edge_projection_steps 8 4
"""

from __future__ import annotations

import argparse
import ast
import importlib
import time

import numpy as np

from minidl.analysis.dryrun import auto_device_memory
from minidl.commands.common import build_model
from minidl.kernels.convolution.conv_geometry import host_call
from minidl.net.optim import SGD
from minidl.tools.bench import synthetic_batch
from minidl.train.trainer import Trainer

#: name: (model, per-sample shape, batch, classes)
WORKLOADS = {
    "smallcnn": ("smallcnn", (1, 28, 28), 64, 10),
    "lenet5": ("lenet5", (1, 28, 28), 64, 10),
    "vgg11": ("vgg11", (3, 32, 32), 128, 10),
    "resnet18": ("resnet18", (3, 32, 32), 64, 10),
    "resnet56": ("resnet56", (3, 32, 32), 128, 10),
    "char-lstm": ("char-lstm", (64,), 32, 65),
    "char-gru": ("char-gru", (64,), 32, 65),
}


def _owner(path: str) -> tuple[object, str]:
    """The module or class holding the setting, and the setting's name."""
    parts = path.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:-1]:
            obj = getattr(obj, name)
        if not hasattr(obj, parts[-1]):
            break
        return obj, parts[-1]
    raise SystemExit(f"ab_setting: no setting {path!r} (a module constant or class attribute)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("workload", choices=sorted(WORKLOADS))
    ap.add_argument("setting")
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--steps", type=int, default=40, help="steps per trainer (after 3 warm-up)")
    args = ap.parse_args()
    owner, name = _owner(args.setting)
    values = [ast.literal_eval(v) for v in (args.a, args.b)]

    def use(v) -> None:
        setattr(owner, name, v)
        host_call.cache_clear()

    model, shape, batch, classes = WORKLOADS[args.workload]
    trainers = []
    for v in values:
        use(v)
        net = build_model(model, shape, classes)
        cap = auto_device_memory(net, batch, "none", "sgd", shape)
        trainers.append(Trainer(net, SGD(net.parameters(), lr=0.01, momentum=0.9),
                                memory="none", device_memory=cap, seed=0))
    x, y = synthetic_batch(trainers[0].net, shape, batch, 0)
    times: list[list[float]] = [[], []]
    for i in range(args.steps + 3):
        for k in (0, 1) if i % 2 == 0 else (1, 0):
            use(values[k])
            t0 = time.perf_counter()
            trainers[k].step(x, y)
            if i >= 3:
                times[k].append(time.perf_counter() - t0)
    a, b = np.array(times[0]), np.array(times[1])
    print(f"{args.workload}: {name}={values[0]!r} {1e3 * np.median(a):.1f} ms, "
          f"{name}={values[1]!r} {1e3 * np.median(b):.1f} ms, "
          f"median pair ratio B/A {np.median(b / a):.3f} ({args.steps} steps each)")


if __name__ == "__main__":
    main()
