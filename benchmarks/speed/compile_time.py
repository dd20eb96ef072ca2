"""Cold compile time: the conv kernels, or the whole test suite, from an empty Numba cache.

``--conv ALGO`` compiles one convolution's forward and backward (float32 unless
``--dtype float64``, 8 x 32 x 14 x 14 -> 64 channels, 3x3, two threads) in a fresh process
whose ``NUMBA_CACHE_DIR`` is an empty folder, and prints the seconds each top-level kernel
took to compile (its callees included) and the total. ``--suite`` runs
``python -m pytest -q -n 2`` the same way (an empty ``NUMBA_CACHE_DIR``: the caches next to
the sources are not read) and prints the compile seconds summed over the workers (Numba's
``numba:compile`` events, through the pytest plugin in this file) and the wall time.

    python benchmarks/speed/compile_time.py --conv gemm [--dtype float32]
    python benchmarks/speed/compile_time.py --suite
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
import time

from minidl.kernels.jit import CompileWatch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


# ----------------------------------------------------------------------------- pytest plugin
def pytest_configure(config) -> None:  # noqa: D103 - loaded by --suite's pytest run
    config._compile_watch = CompileWatch().__enter__()


def pytest_unconfigure(config) -> None:  # noqa: D103
    out = os.environ.get("COMPILE_TIME_OUT")
    watch = getattr(config, "_compile_watch", None)
    if watch is not None:
        watch.__exit__(None, None, None)
        if out:
            worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
            with open(os.path.join(out, f"{worker}.json"), "w") as f:
                json.dump(watch.by_function, f)


# ----------------------------------------------------------------------------- modes
def _conv(algo: str, dtype: str) -> None:
    import numpy as np

    from minidl.kernels.convolution import conv

    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 32, 14, 14)).astype(dtype)
    w = rng.standard_normal((64, 32, 3, 3)).astype(dtype)
    b, y = np.zeros(64, dtype), np.empty((8, 64, 14, 14), dtype)
    dx, dw, db = np.empty_like(x), np.empty_like(w), np.empty_like(b)
    t0 = time.perf_counter()
    with CompileWatch() as watch:
        conv.conv2d_forward(x, w, b, y, padding=(1, 1), threads=2, algo=algo)
        conv.conv2d_backward(x, w, y, dx, dw, db, padding=(1, 1), threads=2, algo=algo)
    total = time.perf_counter() - t0
    for name, s in sorted(watch.by_function.items(), key=lambda kv: -kv[1]):
        print(f"  {s:6.2f} s  {name}")
    print(f"conv {algo} {dtype}, forward + backward from an empty cache: {total:.1f} s")


def _suite() -> None:
    with tempfile.TemporaryDirectory() as out:
        env = {**os.environ, "COMPILE_TIME_OUT": out, "NUMBA_CACHE_DIR": os.path.join(out, "nb"),
               "PYTHONPATH": HERE + os.pathsep + os.environ.get("PYTHONPATH", "")}
        t0 = time.perf_counter()
        res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "-p",
                              "compile_time"], cwd=ROOT, env=env)
        wall = time.perf_counter() - t0
        per_worker = {}
        for f in glob.glob(os.path.join(out, "*.json")):
            with open(f) as fh:
                per_worker[os.path.basename(f)[:-5]] = sum(json.load(fh).values())
    print(f"suite rc {res.returncode}: {wall:.0f} s wall, compile {sum(per_worker.values()):.0f} s"
          f" summed over workers ({', '.join(f'{k} {v:.0f}' for k, v in per_worker.items())})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--conv", choices=["gemm", "winograd", "winograd4"])
    mode.add_argument("--suite", action="store_true")
    ap.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.suite:
        _suite()
    elif args.child:
        _conv(args.conv, args.dtype)
    else:
        with tempfile.TemporaryDirectory() as cache:
            subprocess.run([sys.executable, __file__, "--conv", args.conv, "--dtype",
                            args.dtype, "--child"], env={**os.environ, "NUMBA_CACHE_DIR": cache},
                           check=True)


if __name__ == "__main__":
    main()
