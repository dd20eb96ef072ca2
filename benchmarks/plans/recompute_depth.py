"""Feature-map bytes of deep ResNets under ``reuse,inplace`` and ``reuse,inplace,recompute=sqrt``
(meta dry runs), and the fitted growth exponent in depth.

    python benchmarks/plans/recompute_depth.py [--batch-size 64] [--input 3x32x32]

Depths use the bottleneck CIFAR layout (9n+2: 164 ... 1001) so that only depth changes.
"""

from __future__ import annotations

import argparse

import numpy as np

from minidl import dry_run
from minidl.zoo.models import resnet

SPECS = ("reuse,inplace", "reuse,inplace,recompute=sqrt")


def kept_bytes(rep: dict) -> int:
    b = rep["breakdown"]
    return b.get("feature_map", 0) + b.get("stash", 0) + b.get("input", 0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--input", default="3x32x32")
    ap.add_argument("--depths", default="164,218,326,542,1001")
    args = ap.parse_args()
    shape = tuple(int(v) for v in args.input.split("x"))
    depths = [int(d) for d in args.depths.split(",")]
    table = {s: [] for s in SPECS}
    print(f"{'depth':>6} " + " ".join(f"{s + ' peak MiB':>34} {'fmaps MiB':>10}" for s in SPECS))
    for d in depths:
        cells = []
        for s in SPECS:
            rep = dry_run(resnet(d, shape, 10), args.batch_size, s, input_shape=shape)
            table[s].append(kept_bytes(rep))
            cells.append(f"{rep['peak_allocated_bytes'] / 2**20:>34.1f} "
                         f"{kept_bytes(rep) / 2**20:>10.1f}")
        print(f"{d:>6} " + " ".join(cells))
    for s in SPECS:
        k = np.polyfit(np.log(depths), np.log(table[s]), 1)[0]
        print(f"{s}: feature-map bytes at the peak grow as depth^{k:.2f}")
    print(f"ratio at depth {depths[-1]}: {table[SPECS[0]][-1] / table[SPECS[1]][-1]:.1f}x")


if __name__ == "__main__":
    main()
