"""Two ranks against one process on the same global batch: the largest differences.

    python benchmarks/distributed/data_parallel_equality.py      # launches mpiexec -n 2 itself

Runs the cases of tests/minidl/dp_worker.py (smallcnn 1x8x8 width 4, SGD with momentum,
10 steps on one seeded global batch: none, reuse,inplace, an uneven batch of 15, a batch of 1,
zero=1, zero=2 and zero=3, each also with swapping and recomputation, zero=2 and zero=3 also
with none; and resnet8 3x8x8 width 2 with BatchNorm synchronised (also under zero=3) and per
rank) on 2 MPI ranks and in this process, and prints per case the largest absolute difference
of the losses, the parameters and the optimizer state, and rank 0's real peak against the
plan's (``minidl plan --ranks 2``), as a Markdown table.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from minidl.distributed.comm import SingleProcess

WORKER = Path(__file__).parents[2] / "tests" / "minidl" / "dp_worker.py"


def largest(got, ref: dict, prefix: str) -> float:
    """Largest absolute difference over the arrays whose names start with ``prefix``."""
    return max(float(np.abs(got[k] - ref[k]).max()) for k in ref
               if k.startswith(prefix) and np.ndim(ref[k]))


def main() -> None:
    spec = importlib.util.spec_from_file_location("dp_worker", WORKER)
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)
    out = tempfile.mkdtemp()
    exe = shutil.which("mpiexec") or str(Path(sys.executable).parent / "mpiexec")
    extra = ["--oversubscribe"] + (["--allow-run-as-root"] if os.geteuid() == 0 else [])
    subprocess.run([exe, "-n", "2", *extra, sys.executable, str(WORKER), out], check=True,
                   env={**os.environ, "MINIDL_NUM_THREADS": "1"})
    print("| case | losses | parameters | optimizer state | rank 0 peak B | planned B |")
    print("|---|---|---|---|---|---|")
    for name, _, ref_spec, batch, bucket_bytes in worker.CASES:
        ref = worker.train(SingleProcess(), ref_spec, batch, bucket_bytes)
        got = np.load(Path(out) / f"{name}.npz")
        print(f"| {name} | {np.abs(got['losses'] - ref['losses']).max():.1e} | "
              f"{largest(got, ref, 'param/'):.1e} | {largest(got, ref, 'optim/'):.1e} | "
              f"{int(got['peak_allocated'])} | {int(got['planned_peak'])} |")
    ref = worker.train(SingleProcess(), "reuse,inplace", 16, 1024, bn=True)
    for name, _, _ in worker.BN_CASES:
        got = np.load(Path(out) / f"{name}.npz")
        print(f"| {name} (resnet8) | {np.abs(got['losses'] - ref['losses']).max():.1e} | "
              f"{largest(got, ref, 'param/'):.1e} | {largest(got, ref, 'optim/'):.1e} | "
              f"{int(got['peak_allocated'])} | {int(got['planned_peak'])} |")


if __name__ == "__main__":
    main()
