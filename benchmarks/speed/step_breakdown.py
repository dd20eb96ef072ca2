"""Where a training step's time goes, by op kind and phase, and its effective throughput.

Each workload trains on one synthetic batch under ``--memory`` (default ``none``); after the
warm-up, every step's per-step times (``Executor.step_times``) are summed by (op kind,
phase) and the medians over the counted steps are printed, with the step's nominal FLOPs
(the FLOPs the program declares per step: recomputation excluded) over its median time, and
that throughput over the machine's float32 GEMM peak (issue 21's effective-throughput target
is >= 1.2x on vgg11 and resnet18). The peak is measured two ways:

* per core, in this process, right after every counted step (the kernels' idle workers
  released first, ``kernels.parallel.release_parallel_workers``): ``np.matmul`` of two
  ``--gemm-size`` square matrices on minidl's one BLAS thread, times the kernels' thread
  count. Two cores can at most double one core's rate, so this is an upper bound of the
  machine's peak, taken step by step beside the workload: the ratio reported is the median
  of the per-step ratios, and it is the conservative one.
* on all cores, ``np.matmul`` with NumPy's own BLAS threads in a fresh process before and
  after the workload (on a shared machine this drifts by 2x within minutes).

    python benchmarks/speed/step_breakdown.py [--only vgg11,resnet18] [--steps 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

from minidl.analysis.dryrun import auto_device_memory
from minidl.commands.common import build_model
from minidl.kernels.parallel import num_threads, release_parallel_workers
from minidl.net.optim import SGD
from minidl.tools.bench import synthetic_batch
from minidl.train.trainer import Trainer

WORKLOADS = {  # name: (model, per-sample shape or None, batch)
    "smallcnn": ("smallcnn", (1, 28, 28), 64),
    "lenet5": ("lenet5", (1, 28, 28), 64),
    "vgg11": ("vgg11", (3, 32, 32), 128),
    "resnet18": ("resnet18", (3, 32, 32), 64),
    "resnet56": ("resnet56", (3, 32, 32), 128),
}


def gemm_rate(n: int, rounds: int = 7) -> float:
    """float32 FLOP/s of ``np.matmul`` on two n x n matrices (median of ``rounds``)."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    out = np.empty((n, n), np.float32)
    np.matmul(a, b, out=out)
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        np.matmul(a, b, out=out)
        times.append(time.perf_counter() - t0)
    return 2.0 * n ** 3 / float(np.median(times))


def fresh_gemm_rate(n: int) -> float:
    """:func:`gemm_rate` measured in a fresh Python process."""
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
            f"from step_breakdown import gemm_rate; print(gemm_rate({n}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    return float(out.stdout.split()[-1])


def breakdown(name: str, memory: str, steps: int, warmup: int, gemm_size: int) -> dict:
    model, shape, batch = WORKLOADS[name]
    net = build_model(model, shape, 10)
    cap = auto_device_memory(net, batch, memory, "sgd", shape)  # as `minidl bench` sizes it
    tr = Trainer(net, SGD(net.parameters(), lr=0.01, momentum=0.9), memory=memory,
                 device_memory=cap, seed=0)
    x, y = synthetic_batch(net, shape, batch, 0)
    totals, per_kind, core_rates = [], defaultdict(list), []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        tr.step(x, y)
        dt = time.perf_counter() - t0
        if i < warmup:
            continue
        release_parallel_workers()  # no spinning worker beside the one-core product
        time.sleep(0.02)
        core_rates.append(gemm_rate(gemm_size, 3))
        c = tr.last_compiled
        sums: dict[str, float] = defaultdict(float)
        for st, t in zip(c.executor.steps, c.executor.step_times):
            sums[f"{st.kind} {st.phase}"] += float(t)
        for k, v in sums.items():
            per_kind[k].append(v)
        totals.append(dt)
    program = tr.last_compiled.plan.program
    flops = sum(s.cost.flops for s in program.steps if s.phase in ("forward", "backward"))
    med = float(np.median(totals))
    kinds = {k: float(np.median(v)) for k, v in per_kind.items()}
    cores = num_threads()
    per_step = [flops / t / (r * cores) for t, r in zip(totals, core_rates)]
    return {"workload": f"{model} {'x'.join(map(str, shape))} b{batch}", "memory": memory,
            "step_s": med, "flops": flops, "kinds": dict(sorted(kinds.items(),
                                                              key=lambda kv: -kv[1])),
            "core_gemm_flops_per_s": float(np.median(core_rates)), "cores": cores,
            "ratio_per_core_peak": float(np.median(per_step))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=",".join(WORKLOADS),
                    help=f"workloads, comma-separated: {', '.join(WORKLOADS)}")
    ap.add_argument("--memory", default="none")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--gemm-size", type=int, default=2048)
    ap.add_argument("--top", type=int, default=8, help="op kinds shown per workload")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    names = [n for n in args.only.split(",") if n]
    bad = [n for n in names if n not in WORKLOADS]
    if bad:
        ap.error(f"unknown workload {bad[0]!r}; valid: {', '.join(WORKLOADS)}")
    rows = []
    for n in names:
        before = fresh_gemm_rate(args.gemm_size)
        row = breakdown(n, args.memory, args.steps, args.warmup, args.gemm_size)
        after = fresh_gemm_rate(args.gemm_size)
        rows.append(dict(row, gemm_flops_per_s=(before + after) / 2,
                         gemm_before_after=(before, after)))
    if args.json:
        print(json.dumps({"rows": rows}))
        return
    for r in rows:
        rate, peak = r["flops"] / r["step_s"], r["gemm_flops_per_s"]
        b, a = r["gemm_before_after"]
        print(f"\n{r['workload']} ({r['memory']}): step {1000 * r['step_s']:.1f} ms, "
              f"{r['flops'] / 1e9:.2f} GFLOP nominal, {rate / 1e9:.1f} GFLOP/s effective = "
              f"{rate / peak:.2f}x GEMM ({args.gemm_size}^3 float32: {b / 1e9:.1f} before, "
              f"{a / 1e9:.1f} GFLOP/s after); against {r['cores']} x the one-core GEMM "
              f"measured after each step ({r['core_gemm_flops_per_s'] / 1e9:.1f} GFLOP/s): "
              f"**{r['ratio_per_core_peak']:.2f}x** (median of the steps)")
        shown = list(r["kinds"].items())[:args.top]
        rest = sum(v for _, v in list(r["kinds"].items())[args.top:])
        for k, v in shown:
            print(f"  {k:<24} {1000 * v:8.1f} ms  {100 * v / r['step_s']:5.1f} %")
        print(f"  {'(other kinds)':<24} {1000 * rest:8.1f} ms  {100 * rest / r['step_s']:5.1f} %")


if __name__ == "__main__":
    main()
