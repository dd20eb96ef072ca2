"""How much of the gradient all-reduce hides under backward on 2 ranks, and what it costs.

    mpiexec -n 2 --oversubscribe python benchmarks/distributed/data_parallel_overlap.py
    mpiexec -n 2 --oversubscribe python benchmarks/distributed/data_parallel_overlap.py \
        --model smallcnn
    mpiexec -n 2 --oversubscribe python benchmarks/distributed/data_parallel_overlap.py --memory \
        reuse,inplace,zero=2     # buckets reduce-scattered (ZeRO stage 2)

Each rank trains the model on its half of one global batch. After ``--warmup`` steps, rounds of
``--block`` steps alternate between the buckets all-reduced on the communication thread as
backward completes them (``overlap``) and every bucket all-reduced after backward on the main
thread (``after``). Per mode: the median step time, the collectives' time per step (measured on
the thread that runs them), the time the step waited for them after backward (``exposed``),
and the hidden fraction 1 - exposed / collective time. Rank 0 prints.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from minidl.distributed.comm import MpiCommunicator
from minidl.distributed.data_parallel import DEFAULT_BUCKET_BYTES
from minidl.net.optim import SGD
from minidl.train.trainer import Trainer
from minidl.zoo.models import smallcnn, vgg

MODELS = {
    "vgg11": lambda: vgg(11, (3, 32, 32), 10),
    "smallcnn": lambda: smallcnn((3, 32, 32), 10),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="vgg11")
    ap.add_argument("--batch-size", type=int, default=16, help="global batch")
    ap.add_argument("--bucket-mb", type=float, default=DEFAULT_BUCKET_BYTES / 2**20)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--block", type=int, default=3)
    ap.add_argument("--memory", default="reuse,inplace",
                    help="memory spec (zero=2 or 3: buckets reduce-scattered)")
    args = ap.parse_args()
    comm = MpiCommunicator()
    net = MODELS[args.model]()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.batch_size, 3, 32, 32)).astype(np.float32)
    y = rng.integers(0, 10, args.batch_size)
    tr = Trainer(net, SGD(net.parameters(), lr=0.01, momentum=0.9), memory=args.memory,
                 device_memory="1GiB", comm=comm, bucket_bytes=int(args.bucket_mb * 2**20))
    sync = tr.parallel.sync
    for _ in range(args.warmup):
        tr.step(x, y)
    times: dict[str, list[float]] = {"overlap": [], "after": []}
    stats: dict[str, list] = {"overlap": [], "after": []}
    for r in range(args.rounds):
        for mode in (("overlap", "after") if r % 2 == 0 else ("after", "overlap")):
            sync.overlap = mode == "overlap"
            for _ in range(args.block):
                t0 = time.perf_counter()
                tr.step(x, y)
                times[mode].append(time.perf_counter() - t0)
                stats[mode].append(tr.parallel.stats[-1])
    if comm.rank == 0:
        s0 = stats["overlap"][0]
        what = "reduce-scatter" if tr.parallel.sync.scatter else "all-reduce"
        print(f"{args.model}: {net.num_parameters():,} parameters, gradients "
              f"{s0.bytes / 2**20:.1f} MiB in {s0.buckets} buckets of ~{args.bucket_mb:g} MiB, "
              f"global batch {args.batch_size} on {comm.size} ranks ({comm.name}), memory "
              f"{args.memory!r}")
        for mode in ("overlap", "after"):
            st = stats[mode]
            comm_s = statistics.median(s.comm_s for s in st)
            exposed = statistics.median(s.exposed_s for s in st)
            hidden = statistics.median(s.hidden_fraction for s in st)
            print(f"  {mode:8s} step {1000 * statistics.median(times[mode]):8.1f} ms   "
                  f"{what} {1000 * comm_s:7.1f} ms   exposed {1000 * exposed:7.1f} ms   "
                  f"hidden {100 * hidden:5.1f} %")
    tr.close()


if __name__ == "__main__":
    main()
