"""The fused RNN layers' two lanes with and without releasing Numba's OpenMP workers first.

GNU libgomp's idle workers spin for milliseconds after each ``prange`` kernel; the fused
LSTM / GRU layers then start their second lane (a Python thread) on a core a spinning worker
holds. :func:`minidl.kernels.parallel.run_tasks` releases the pool first
(``release_parallel_workers``). This times training steps of char-lstm / char-gru (b32,
seq 64) with the release on and off, alternating step by step in one process, and prints
the medians of the step, of the layer's forward and backward, and of how late the later lane
took its first task.

    python benchmarks/speed/rnn_lanes.py [--steps 30] [--only char-lstm,char-gru]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import minidl.kernels.parallel as parallel
from minidl.commands.common import build_model
from minidl.net.optim import SGD
from minidl.tools.bench import synthetic_batch
from minidl.train.trainer import Trainer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30, help="steps per setting")
    ap.add_argument("--only", default="char-lstm,char-gru")
    args = ap.parse_args()
    release = parallel.release_parallel_workers
    calls: list[tuple[float, float]] = []  # (wall, later lane's first task) per run_tasks
    run_tasks = parallel.run_tasks

    def traced(tasks, workers):
        t0 = time.perf_counter()
        first: dict[int, float] = {}

        def wrap(fn):
            def run(wid):
                first.setdefault(wid, time.perf_counter() - t0)
                fn(wid)
            return run

        run_tasks([(k, d, wrap(f)) for k, d, f in tasks], workers)
        calls.append((time.perf_counter() - t0, max(first.values(), default=0.0)))

    import minidl.layers.recurrent.keep_all as keep_all
    keep_all.run_tasks = traced
    for name in args.only.split(","):
        net = build_model(name, (64,), 65)
        tr = Trainer(net, SGD(net.parameters(), lr=0.01, momentum=0.9), memory="none", seed=0)
        x, y = synthetic_batch(net, (64,), 32, 0)
        for _ in range(3):
            tr.step(x, y)
        rows: dict[str, list[list[float]]] = {"release on": [], "release off": []}
        for i in range(2 * args.steps):
            setting = "release on" if i % 2 == 0 else "release off"
            parallel.release_parallel_workers = release if i % 2 == 0 else (lambda: None)
            calls.clear()
            t0 = time.perf_counter()
            tr.step(x, y)
            step = time.perf_counter() - t0
            (fwd, fwd_late), (bwd, bwd_late) = calls[0], calls[1]
            rows[setting].append([step, fwd, fwd_late, bwd, bwd_late])
        parallel.release_parallel_workers = release
        print(f"{name} b32 seq64, {args.steps} steps each, alternated (medians, ms):")
        print(f"  {'':12s} {'step':>7s} {'forward':>8s} {'lane-2 at':>9s} {'backward':>8s} "
              f"{'lane-2 at':>9s}")
        for setting, r in rows.items():
            m = 1e3 * np.median(np.array(r), axis=0)
            print(f"  {setting:12s} {m[0]:7.1f} {m[1]:8.1f} {m[2]:9.2f} {m[3]:8.1f} {m[4]:9.2f}")
        on, off = np.array(rows["release on"]), np.array(rows["release off"])
        print(f"  step ratio on / off (median of pairs): {np.median(on[:, 0] / off[:, 0]):.3f}")


if __name__ == "__main__":
    main()
