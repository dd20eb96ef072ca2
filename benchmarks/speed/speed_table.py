"""Step time of minidl against PyTorch CPU on the reference workloads of Part 17.

Each workload is ``minidl bench MODEL ... --memory none --compare-torch --json`` in a fresh
process (PyTorch runs in a process of its own, the two alternating in blocks; see
``minidl.tools.bench``); the whole run is repeated ``--repeats`` times, workloads interleaved, and
the table gives the median of each side's step time and of the ratios. The machine must be
otherwise idle: a busy core stalls every parallel launch of both libraries.

    python benchmarks/speed/speed_table.py [--repeats 3] [--steps 20] [--only smallcnn,lenet5]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import numpy as np

#: name -> the ``minidl bench`` arguments after the model.
WORKLOADS = {
    "smallcnn b64": ["smallcnn", "--input", "1x28x28", "--batch-size", "64"],
    "lenet5 b64": ["lenet5", "--batch-size", "64"],
    "vgg11 3x32x32 b128": ["vgg11", "--input", "3x32x32", "--batch-size", "128"],
    "resnet18 3x32x32 b64": ["resnet18", "--input", "3x32x32", "--batch-size", "64"],
    "resnet56 3x32x32 b128": ["resnet56", "--input", "3x32x32", "--batch-size", "128"],
    "char-lstm b32 seq64": ["char-lstm", "--batch-size", "32", "--seq-len", "64"],
    "char-gru b32 seq64": ["char-gru", "--batch-size", "32", "--seq-len", "64"],
}


def run_once(args: list[str], steps: int) -> tuple[float, float]:
    """(minidl's, PyTorch's) median step time in seconds of one ``minidl bench`` run."""
    cmd = [sys.executable, "-m", "minidl", "bench", *args, "--memory", "none",
           "--compare-torch", "--json", "--steps", str(steps)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    rep = json.loads(out.stdout)
    return rep["results"][0]["step_time_median_s"], rep["torch"]["step_time_median_s"]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--only", default="", help="comma-separated model names (default: all)")
    args = ap.parse_args(argv)
    names = [n for n in WORKLOADS
             if not args.only or WORKLOADS[n][0] in args.only.split(",")]
    times: dict[str, list[tuple[float, float]]] = {n: [] for n in names}
    for r in range(args.repeats):
        for n in names:
            times[n].append(run_once(WORKLOADS[n], args.steps))
            print(f"  round {r + 1}: {n}: minidl {1e3 * times[n][-1][0]:.1f} ms, "
                  f"PyTorch {1e3 * times[n][-1][1]:.1f} ms", file=sys.stderr, flush=True)
    table = {}
    print(f"{'workload':24s} {'minidl ms':>10s} {'PyTorch ms':>11s} {'ratio':>6s}")
    for n in names:
        ours = float(np.median([a for a, _ in times[n]]))
        theirs = float(np.median([b for _, b in times[n]]))
        ratio = float(np.median([a / b for a, b in times[n]]))
        table[n] = {"minidl_ms": 1e3 * ours, "torch_ms": 1e3 * theirs, "ratio": ratio}
        print(f"{n:24s} {1e3 * ours:10.1f} {1e3 * theirs:11.1f} {ratio:6.2f}")
    return table


if __name__ == "__main__":
    main()
