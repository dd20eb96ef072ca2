"""Per-rank device peak under ZeRO on 2 MPI ranks: measured against ``minidl plan --ranks 2``.

    mpiexec -n 2 --oversubscribe python benchmarks/distributed/data_parallel_zero_peaks.py
    mpiexec -n 2 --oversubscribe python benchmarks/distributed/data_parallel_zero_peaks.py \
        --models resnet20

Each rank trains the model (Adam, ``--steps`` steps on its half of one seeded global batch)
under ``reuse,inplace`` with ``zero=0..3`` (``--stages`` to choose),
and reports its pool's allocated peak (persistent state included). Rank 0 prints, per model
and stage, both ranks' measured peaks, rank 0's planned peak (the meta dry run of
``minidl plan MODEL --ranks 2 --memory ...``, made in this process: convolution workspaces
depend on the thread count) and rank 0's persistent bytes by category from the plan, as a
Markdown table.
"""

from __future__ import annotations

import argparse

import numpy as np

from minidl.analysis.dryrun import dry_run
from minidl.commands.common import build_model
from minidl.distributed.comm import MpiCommunicator
from minidl.net.optim import Adam
from minidl.train.trainer import Trainer

MODELS = {"smallcnn": (3, 32, 32), "resnet20": (3, 32, 32)}


def kib(n: int) -> str:
    return f"{n / 1024:,.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--stages", nargs="+", type=int, default=[0, 1, 2, 3])
    ap.add_argument("--batch-size", type=int, default=32, help="global batch")
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    comm = MpiCommunicator()
    if comm.rank == 0:
        print(f"| model (global batch {args.batch_size}) | memory | rank 0 measured B | "
              "rank 0 planned B | rank 1 measured B | parameters / gradients / optimizer "
              "state per rank KiB |")
        print("|---|---|---|---|---|---|")
    for name in args.models:
        shape = MODELS[name]
        rng = np.random.default_rng(0)
        x = rng.standard_normal((args.batch_size, *shape)).astype(np.float32)
        y = rng.integers(0, 10, args.batch_size)
        for stage in args.stages:
            spec = "reuse,inplace" + (f",zero={stage}" if stage else "")
            net = build_model(name, shape, 10, None)
            trainer = Trainer(net, Adam(net.parameters(), lr=1e-3), memory=spec,
                              device_memory="512MiB", comm=comm)
            for _ in range(args.steps):
                trainer.step(x, y)
            peaks = comm.allgather_object(trainer.pool.stats()["allocated_bytes.peak"])
            trainer.close()
            if comm.rank == 0:
                rep = dry_run(build_model(name, shape, 10, None), args.batch_size, spec, "adam",
                              input_shape=shape, ranks=comm.size)
                p = rep["zero"]["persistent_bytes"]
                print(f"| {name} | {spec} | {peaks[0]:,} | {rep['peak_allocated_bytes']:,} | "
                      f"{peaks[1]:,} | {kib(p['parameter'])} / {kib(p['gradient'])} / "
                      f"{kib(p['optimizer_state'])} |", flush=True)


if __name__ == "__main__":
    main()
