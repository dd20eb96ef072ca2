"""Per-rank memory under ZeRO from the planner: ``minidl plan MODEL --ranks N --memory
reuse,inplace,zero=K`` for N = 2, 4, 8 and K = 0..3, as a Markdown table (no MPI, meta device).

    python benchmarks/distributed/zero_table.py                       # vgg16 3x224x224, bert-base
    python benchmarks/distributed/zero_table.py --models vgg16 --ranks 2 4

Adam (two state slots per parameter, as ZeRO's paper counts K = 12 bytes per parameter with
mixed precision; here float32: parameters 4, gradients 4, Adam state 8 bytes per parameter).
Each row: one rank's parameters, gradients and optimizer state, its planned peak (the global
batch split over the ranks), and the bytes each rank sends per step over a ring.
"""

from __future__ import annotations

import argparse

from minidl.analysis.dryrun import dry_run
from minidl.commands.common import build_model

MODELS = {  # name -> (input shape, classes, global batch)
    "vgg16": ((3, 224, 224), 1000, 64),
    "bert-base": ((128,), 30522, 32),
}


def mib(n: int) -> str:
    return f"{n / 2**20:,.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--ranks", nargs="+", type=int, default=[2, 4, 8])
    args = ap.parse_args()
    print("| model (global batch) | ranks | zero | parameters MiB | gradients MiB | "
          "optimizer state MiB | peak MiB | sent per step MiB |")
    print("|---|---|---|---|---|---|---|---|")
    for name in args.models:
        shape, classes, batch = MODELS[name]
        for n in args.ranks:
            for stage in range(4):
                spec = "reuse,inplace" + (f",zero={stage}" if stage else "")
                rep = dry_run(build_model(name, shape, classes, None), batch, spec, "adam",
                              input_shape=shape, ranks=n)
                z = rep["zero"]
                p = z["persistent_bytes"]
                sent = sum(c["sent_bytes_per_rank"] for c in z["collectives"])
                print(f"| {name} ({batch}) | {n} | {stage} | {mib(p['parameter'])} | "
                      f"{mib(p['gradient'])} | {mib(p['optimizer_state'])} | "
                      f"{mib(rep['peak_allocated_bytes'])} | {mib(sent)} |", flush=True)


if __name__ == "__main__":
    main()
