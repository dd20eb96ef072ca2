"""Part 14's target through the CLI: 2 ranks against one process, 20 steps, every stage.

For smallcnn and resnet20 (synthetic 3x16x16 data, width 4, global batch 16, SGD, 20 steps;
resnet20 with ``--sync-bn`` on 2 ranks, since per-rank BatchNorm statistics are another
function) and each memory spec, ``minidl train ... --json --save`` runs once in one process and
once under ``mpiexec -n 2`` (``MINIDL_NUM_THREADS=1``); the table gives the largest absolute
difference of the 20 losses and of the saved parameters.

    python benchmarks/data_parallel_cli_equality.py [--steps 20] [--models smallcnn,resnet20]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

SPECS = ["none", "reuse,inplace", "reuse,inplace,zero=1", "reuse,inplace,zero=2",
         "reuse,inplace,zero=3", "reuse,swap=all,recompute=sqrt,zero=2",
         "reuse,swap=all,recompute=sqrt,zero=3"]


def _mpiexec() -> list[str]:
    exe = shutil.which("mpiexec") or str(Path(sys.executable).parent / "mpiexec")
    return [exe, "-n", "2", "--oversubscribe",
            *(["--allow-run-as-root"] if os.geteuid() == 0 else [])]


def _train(model: str, spec: str, steps: int, save: Path, ranks: int) -> list[float]:
    cmd = [sys.executable, "-m", "minidl", "train", model, "--dataset", "synthetic",
           "--input", "3x16x16", "--width", "4", "--batch-size", "16", "--max-steps",
           str(steps), "--epochs", "1", "--memory", spec, "--json", "--no-progress",
           "--save", str(save)]
    if ranks == 2:
        cmd = [*_mpiexec(), *cmd] + (["--sync-bn"] if model.startswith("resnet") else [])
    out = subprocess.run(cmd, capture_output=True, text=True,
                         env={**os.environ, "MINIDL_NUM_THREADS": "1"})
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stderr[-2000:]}")
    line = [ln for ln in out.stdout.splitlines() if ln.lstrip().startswith("{")][0]
    return json.loads(line)["losses"]


def _params(path: Path) -> dict[str, np.ndarray]:
    with np.load(path) as z:
        return {k: z[k] for k in z.files if k.startswith("param/")}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--models", default="smallcnn,resnet20")
    args = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp())
    print("| model | spec | losses | parameters |")
    print("|---|---|---|---|")
    for model in args.models.split(","):
        for spec in SPECS:
            one = _train(model, spec, args.steps, tmp / "one.npz", 1)
            two = _train(model, spec, args.steps, tmp / "two.npz", 2)
            pa, pb = _params(tmp / "one.npz"), _params(tmp / "two.npz")
            dl = float(np.max(np.abs(np.subtract(one, two))))
            dp = max(float(np.max(np.abs(pa[k] - pb[k]))) for k in pa)
            print(f"| {model} | `{spec}` | {dl:.1e} | {dp:.1e} |", flush=True)


if __name__ == "__main__":
    main()
