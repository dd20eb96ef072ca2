"""What libgomp's spin count costs and saves: ``prange`` launch latency after an idle gap, and
the fused LSTM's lane start-up after the previous step's parallel kernels.

Each setting of ``GOMP_SPINCOUNT`` runs in fresh processes (libgomp reads it when it loads),
alternated over ``--rounds``; 300000 is libgomp's own default, 30000 minidl's (see
``minidl/settings.py``). Printed per setting, medians over rounds:

* the time of a trivial ``prange`` kernel launched 10 us to 3 ms after the previous one (the
  pool is awake while its workers spin, asleep after);
* for char-lstm b32 seq64, the fused layer's forward and backward wall time and how late its
  second lane took its first task (a spinning libgomp worker holds that core).

    python benchmarks/omp_spin.py [--rounds 3] [--settings 300000,30000]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

GAPS_US = (10, 100, 300, 1000, 3000)


def launch_latency() -> dict[str, float]:
    """Median time (us) of a 2048-element ``prange`` kernel ``gap`` us after the last one."""
    from numba import njit, prange

    @njit(parallel=True)
    def bump(a):
        for i in prange(a.size):
            a[i] += 1

    a = np.zeros(2048, np.float32)
    bump(a)
    out = {}
    for gap in GAPS_US:
        times = []
        for _ in range(200):
            bump(a)
            end = time.perf_counter() + gap * 1e-6
            while time.perf_counter() < end:
                pass
            t0 = time.perf_counter()
            bump(a)
            times.append(time.perf_counter() - t0)
        out[f"gap {gap} us"] = 1e6 * float(np.median(times))
    return out


def lstm_lanes(steps: int = 10) -> dict[str, float]:
    """char-lstm's fused layer: forward / backward wall time (ms) and the second lane's delay."""
    import minidl.layers.recurrent_keep_all as keep_all

    from minidl.bench import synthetic_batch
    from minidl.commands.common import build_model
    from minidl.optim import SGD
    from minidl.trainer import Trainer

    runs: list[tuple[float, float]] = []
    run_tasks = keep_all.run_tasks

    def traced(tasks, workers):
        t0 = time.perf_counter()
        first: dict[int, float] = {}

        def wrap(fn):
            def run(wid):
                first.setdefault(wid, time.perf_counter() - t0)
                fn(wid)
            return run

        run_tasks([(k, d, wrap(f)) for k, d, f in tasks], workers)
        runs.append((time.perf_counter() - t0, max(first.values()) if first else 0.0))

    keep_all.run_tasks = traced
    net = build_model("char-lstm", (64,), 65)
    tr = Trainer(net, SGD(net.parameters(), lr=0.01, momentum=0.9), memory="none", seed=0)
    x, y = synthetic_batch(net, (64,), 32, 0)
    for _ in range(3):
        tr.step(x, y)
    runs.clear()
    for _ in range(steps):
        tr.step(x, y)
    fwd, bwd = np.array(runs[0::2]) * 1e3, np.array(runs[1::2]) * 1e3
    return {"forward ms": float(np.median(fwd[:, 0])),
            "forward lane-2 start ms": float(np.median(fwd[:, 1])),
            "backward ms": float(np.median(bwd[:, 0]))}


def child(which: str) -> None:
    print(json.dumps(launch_latency() if which == "latency" else lstm_lanes()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--settings", default="300000,30000")
    args = ap.parse_args()
    settings = args.settings.split(",")
    results: dict[str, dict[str, list[float]]] = {s: {} for s in settings}
    for _ in range(args.rounds):
        for s in settings:
            env = dict(os.environ, GOMP_SPINCOUNT=s)
            env.pop("OMP_WAIT_POLICY", None)
            for which in ("latency", "lstm"):
                out = subprocess.run([sys.executable, __file__, "--child", which], env=env,
                                     capture_output=True, text=True, check=True)
                for k, v in json.loads(out.stdout).items():
                    results[s].setdefault(k, []).append(v)
    for s, rows in results.items():
        print(f"GOMP_SPINCOUNT={s}")
        for k, v in rows.items():
            print(f"  {k:26s} {np.median(v):8.1f}   ({', '.join(f'{x:.1f}' for x in v)})")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        child(sys.argv[2])
    else:
        main()
