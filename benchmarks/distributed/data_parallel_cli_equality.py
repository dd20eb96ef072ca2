"""Part 14's target through the CLI: 2 ranks against one process, 20 steps, every stage.

For smallcnn and resnet20 (synthetic 3x16x16 data, width 4, global batch 16, SGD, 20 steps;
resnet20 with ``--sync-bn`` on 2 ranks, since per-rank BatchNorm statistics are another
function) and each memory spec, ``minidl train ... --json --save`` runs once in one process and
once under ``mpiexec -n 2`` (``MINIDL_NUM_THREADS=1``); the table gives the largest absolute
difference of the 20 losses and of the saved parameters.

Free-running runs of resnet20 part after ~10 steps however exact the ranks are: its training
here is chaotic (a one-process run whose weights move by one float32 ulp differs from itself by
1e-4 after 20 steps). ``--per-step`` therefore also measures each step from the same state:
one process runs the 20 steps as a chain of resumed runs (``--resume``, bit-exact), and for
each step k the 2 ranks resume from the one-process checkpoint after k steps and run step k+1;
the columns give the largest difference of that step's loss and of the parameters after it.

    python benchmarks/distributed/data_parallel_cli_equality.py [--steps 20]
        [--models smallcnn,resnet20] [--specs none,reuse,inplace,...] [--per-step]
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


def _train(model: str, spec: str, steps: int, save: Path, ranks: int,
           resume: Path | None = None) -> list[float]:
    """The losses of ``minidl train`` to step ``steps`` (from ``resume`` if given)."""
    cmd = [sys.executable, "-m", "minidl", "train", model, "--dataset", "synthetic",
           "--input", "3x16x16", "--width", "4", "--batch-size", "16", "--max-steps",
           str(steps), "--epochs", "1", "--memory", spec, "--json", "--no-progress",
           "--save", str(save)] + (["--resume", str(resume)] if resume else [])
    if ranks == 2:
        cmd = [*_mpiexec(), *cmd] + (["--sync-bn"] if model.startswith("resnet") else [])
    out = subprocess.run(cmd, capture_output=True, text=True,
                         env={**os.environ, "MINIDL_NUM_THREADS": "1"})
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stderr[-2000:]}")
    line = [ln for ln in out.stdout.splitlines() if ln.lstrip().startswith("{")][0]
    return json.loads(line.strip().split("\x1b")[0])["losses"]  # mpiexec may add a colour reset


def _params(path: Path) -> dict[str, np.ndarray]:
    with np.load(path) as z:
        return {k: z[k] for k in z.files if k.startswith("param/")}


def _largest(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    return max(float(np.max(np.abs(a[k] - b[k]))) for k in a)


def _per_step(model: str, spec: str, steps: int, tmp: Path) -> tuple[float, float]:
    """Largest difference of one step's loss and parameters, 2 ranks against one process,
    each step taken from the one-process state before it."""
    chain = [None] + [tmp / f"one{k}.npz" for k in range(1, steps + 1)]
    ref = [_train(model, spec, k, chain[k], 1, chain[k - 1])[-1] for k in range(1, steps + 1)]
    dl = dp = 0.0
    for k in range(1, steps + 1):
        loss = _train(model, spec, k, tmp / "two.npz", 2, chain[k - 1])[-1]
        dl = max(dl, abs(loss - ref[k - 1]))
        dp = max(dp, _largest(_params(chain[k]), _params(tmp / "two.npz")))
    return dl, dp


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--models", default="smallcnn,resnet20")
    ap.add_argument("--specs", default=";".join(SPECS), help="';'-separated memory specs")
    ap.add_argument("--per-step", action="store_true",
                    help="also each step from the same state (resumed one-process checkpoints)")
    args = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp())
    extra = " | one step: losses | one step: parameters" if args.per_step else ""
    print(f"| model | spec | losses | parameters{extra} |")
    print("|---|---|---|---|" + ("---|---|" if args.per_step else ""))
    for model in args.models.split(","):
        for spec in args.specs.split(";"):
            one = _train(model, spec, args.steps, tmp / "one.npz", 1)
            two = _train(model, spec, args.steps, tmp / "two.npz", 2)
            dl = float(np.max(np.abs(np.subtract(one, two))))
            dp = _largest(_params(tmp / "one.npz"), _params(tmp / "two.npz"))
            row = f"| {model} | `{spec}` | {dl:.1e} | {dp:.1e} |"
            if args.per_step:
                sl, sp = _per_step(model, spec, args.steps, tmp)
                row += f" {sl:.1e} | {sp:.1e} |"
            print(row, flush=True)


if __name__ == "__main__":
    main()
